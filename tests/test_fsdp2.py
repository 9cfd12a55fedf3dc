"""FSDP2 on a patched model (issue 42): ``fully_shard`` per Transformer block and the root over a
model apply_tempo switched (its fused LM head included), two CPU processes under torchrun (gloo)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_an_fsdp2_step_of_a_patched_mlm_equals_the_stock_model_in_one_process(tmp_path):
    """tests/workers/fsdp2_step.py: each rank on its half of the batch; the loss averaged over ranks and
    every all-gathered gradient equal the stock model's on the whole batch in one process (fp32,
    dropout off). It failed with a KeyError before: fully_shard gives the switched model its own
    FSDP subclass, whose class dictionary lacks the original class the switch stands for."""
    from test_token_budget import run_torchrun  # one rerun for torchrun's exit-time abort alone

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "workers" / "fsdp2_step.py")]
    result = run_torchrun(cmd, env, tmp_path / "unused")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "done: loss" in result.stdout and "gradients: worst error" in result.stdout
