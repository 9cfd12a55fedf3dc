#!/usr/bin/env python3
"""BERT pretraining with DeepLearningExamples' flags; see tempo/tasks/pretrain.py for the loop.

    torchrun --nproc_per_node=8 run_pretraining.py --input_dir=... --config_file=configs/bert_large.json \
        --output_dir=results/pretrain --train_batch_size=64 --bf16 --tempo
"""

import sys

from tempo.tasks.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
