#!/usr/bin/env python3
"""BERT SQuAD fine-tuning/prediction with DeepLearningExamples' flags; the loop is tempo/tasks/squad.py.

    python run_squad.py --init_checkpoint "$(python -c 'from tempo.bert.hf_interop import minilm_dir; print(minilm_dir())')" \
        --do_train --train_file data/qa/train-v1.1.json --do_predict --predict_file data/qa/dev-v1.1.json \
        --max_seq_length 192 --train_batch_size 32 --learning_rate 1e-4 --num_train_epochs 2 --output_dir results/squad
"""

import sys

from tempo.tasks.squad import main

if __name__ == "__main__":
    sys.exit(main())
