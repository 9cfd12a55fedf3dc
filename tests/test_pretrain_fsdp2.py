"""run_pretraining.py --parallel fsdp2 (issue 42): ``fully_shard`` per block and the root under
torchrun (2 CPU processes, gloo), the same losses as DDP, checkpoints sharded through
torch.distributed.checkpoint that resume exactly at the same world size and load at another (2 -> 1,
1 -> 2), and one clear line for a checkpoint of the other layout, another model, or no torchrun."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from test_token_budget import _steps, data, run_torchrun  # noqa: F401,F811 - data is a fixture

REPO = Path(__file__).resolve().parents[1]


def _args(data, out: Path, parallel: str, *extra: str, steps: int = 4) -> list[str]:
    from test_token_budget import PRED, SEQ

    return ["--input_dir", str(data["shards"]), "--config_file", str(data["config"]), "--vocab_file",
            str(data["vocab"]), "--output_dir", str(out), "--max_seq_length", str(SEQ), "--max_predictions_per_seq",
            str(PRED), "--learning_rate", "1e-3", "--max_steps", str(steps), "--seed", "7", "--log_freq", "1",
            "--num_workers", "0", "--disable_progress_bar", "--train_batch_size", "8", "--parallel", parallel,
            "--num_steps_per_checkpoint", "2", *extra]


def _torchrun(nproc: int, args: list[str], out: Path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(REPO / "run_pretraining.py"), *args]
    return run_torchrun(cmd, env, out)


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in _steps(out / "dllogger.json")]


@pytest.mark.slow
def test_fsdp2_trains_as_ddp_and_resumes_at_any_world_size(data, tmp_path):
    ddp, full, part = tmp_path / "ddp", tmp_path / "fsdp2", tmp_path / "part"
    for out, parallel in ((ddp, "ddp"), (full, "fsdp2")):
        result = _torchrun(2, _args(data, out, parallel, "--skip_checkpoint"), out)
        assert result.returncode == 0, result.stderr[-3000:]
    # The same loss as DDP on the same global batch (fp32, dropout off: the data fixture's config).
    np.testing.assert_allclose(_losses(full), _losses(ddp), rtol=0, atol=1e-5)
    assert len(_losses(full)) == 4

    # 2 steps, a sharded checkpoint, then 2 more from it: exactly the uninterrupted run.
    result = _torchrun(2, _args(data, part, "fsdp2", "--steps_this_run", "2"), part)
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = part / "checkpoints" / "ckpt_2"
    assert (ckpt / "sharded" / ".metadata").is_file() and not (ckpt / "model.safetensors").exists()
    assert json.loads((ckpt / "meta.json").read_text())["world_size"] == 2
    assert not [p for p in (part / "checkpoints").iterdir() if p.name.startswith(".")]  # no leftovers
    resumed = tmp_path / "resumed"
    import shutil

    shutil.copytree(part, resumed)
    result = _torchrun(2, _args(data, resumed, "fsdp2", "--resume_from_checkpoint"), resumed)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2, starting at step 2" in result.stdout
    np.testing.assert_allclose(_losses(resumed)[-2:], _losses(full)[-2:], rtol=0, atol=1e-6)

    # The same checkpoint at another world size: 2 -> 1, then the one process's checkpoint 1 -> 2.
    one = tmp_path / "one"
    shutil.copytree(part, one)
    result = _torchrun(1, _args(data, one, "fsdp2", "--resume_from_checkpoint"), one)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 1, starting at step 2" in result.stdout
    assert json.loads((one / "checkpoints" / "ckpt_4" / "meta.json").read_text())["world_size"] == 1
    result = _torchrun(2, _args(data, one, "fsdp2", "--resume_from_checkpoint", steps=6), one)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2, starting at step 4" in result.stdout
    assert all(np.isfinite(_losses(one)))

    # A checkpoint of the other layout, and one of another model: one line, a non-zero exit.
    plain = tmp_path / "plain"
    result = _torchrun(2, _args(data, plain, "ddp", "--steps_this_run", "2"), plain)
    assert result.returncode == 0, result.stderr[-3000:]
    result = _torchrun(2, _args(data, plain, "fsdp2", "--resume_from_checkpoint"), plain)
    assert result.returncode != 0
    assert "was written by one process or DDP: resume it without --parallel fsdp2" in result.stderr
    result = _torchrun(2, _args(data, one, "ddp", "--resume_from_checkpoint", steps=8), one)
    assert result.returncode != 0
    assert "was written by an FSDP2 run (--parallel fsdp2)" in result.stderr
    config = json.loads(Path(data["config"]).read_text())
    config.update(hidden_size=48, intermediate_size=96)
    (tmp_path / "wider.json").write_text(json.dumps(config))
    wider = _args(data, one, "fsdp2", "--resume_from_checkpoint", steps=8)
    wider[wider.index("--config_file") + 1] = str(tmp_path / "wider.json")
    result = _torchrun(2, wider, one)
    assert result.returncode != 0
    assert "sharded does not fit this model: ValueError: Size mismatch" in result.stderr


def test_fsdp2_without_torchrun_is_refused_in_one_line(data, tmp_path, capsys, monkeypatch):
    from tempo.tasks.pretrain import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(_args(data, tmp_path / "out", "fsdp2")) != 0
    err = capsys.readouterr().err
    assert "--parallel fsdp2 needs torchrun" in err and not (tmp_path / "out").exists()
