import json
import os
import random
import signal

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from tempo.train.checkpointing import (
    CheckpointError,
    NonFiniteCheckpointError,
    nonfinite_tensors,
    install_sigterm_handler,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    unwrap_model,
)
from tempo.train.optim import Lamb, PolyWarmUpScheduler, bert_param_groups


class TiedLM(nn.Module):
    def __init__(self, vocab=11, hidden=6):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(0.1)
        self.decoder = nn.Linear(hidden, vocab)
        self.decoder.weight = self.word_embeddings.weight  # tied, as the MLM decoder
        self.register_buffer("position_ids", torch.arange(4))

    def forward(self, ids):
        return self.decoder(self.dropout(self.LayerNorm(self.word_embeddings(ids))))


def make_training(seed=0):
    torch.manual_seed(seed)
    model = TiedLM()
    opt = Lamb(bert_param_groups(model), lr=0.05)
    sched = PolyWarmUpScheduler(opt, warmup=0.25, total_steps=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    return model, opt, sched, scaler


def train(model, opt, sched, scaler, steps):
    for _ in range(steps):
        ids = torch.randint(0, 11, (3, 4))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        scaler.scale(loss).backward()
        if scaler.step(opt):
            sched.step()
        scaler.update()
        opt.zero_grad(set_to_none=True)


def test_round_trip_restores_everything(tmp_path):
    model, opt, sched, scaler = make_training()
    train(model, opt, sched, scaler, 3)
    scaler.update(new_scale=128.0)
    data_state = {"epoch": np.int64(1), "order": np.arange(5, dtype=np.uint32), "files": ("a.h5", "b.h5")}
    path = save_checkpoint(
        tmp_path, 3, model, opt, sched, scaler, data_state=data_state, extra={"note": "hi"}, config={"hidden": 6}
    )
    assert path == tmp_path / "checkpoints" / "ckpt_3"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.safetensors", "training_state.pt"]
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert len({"word_embeddings.weight", "decoder.weight"} & keys) == 1  # tied storage saved once
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["config"] == {"hidden": 6} and meta["torch_version"] == torch.__version__
    torch.load(path / "training_state.pt", weights_only=True)

    expected_draws = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(99), random.seed(99), np.random.seed(99)

    model2, opt2, sched2, scaler2 = make_training(seed=1)
    info = load_checkpoint(path, model2, opt2, sched2, scaler2)
    assert (torch.rand(4).tolist(), random.random(), np.random.rand()) == (
        expected_draws[0].tolist(),
        expected_draws[1],
        expected_draws[2],
    )
    assert info["step"] == 3 and info["extra"] == {"note": "hi"}
    assert info["data_state"]["epoch"] == 1 and info["data_state"]["files"] == ("a.h5", "b.h5")
    assert info["data_state"]["order"].tolist() == [0, 1, 2, 3, 4]
    for (name, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), name
    assert model2.decoder.weight is model2.word_embeddings.weight
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for pid, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            assert torch.equal(opt2.state_dict()["state"][pid][key], value)
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert scaler2.state_dict() == scaler.state_dict() and scaler2.get_scale() == 128.0


def test_wrapped_models_are_unwrapped(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    compiled = torch.compile(model)  # wrapper only; never run, so nothing compiles
    assert unwrap_model(compiled) is model
    path = save_checkpoint(tmp_path, 1, compiled)
    torch.manual_seed(1)
    fresh = TiedLM()
    load_checkpoint(path, torch.compile(fresh))
    assert torch.equal(fresh.word_embeddings.weight, model.word_embeddings.weight)
    dp = nn.DataParallel(TiedLM())  # same .module unwrapping path as DDP
    assert unwrap_model(dp) is dp.module
    load_model_weights(path, dp)
    assert torch.equal(dp.module.LayerNorm.weight, model.LayerNorm.weight)


def test_keep_last_three(tmp_path):
    model = nn.Linear(2, 2)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step * 10, model, keep=3)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [30, 40, 50]
    save_checkpoint(tmp_path, 50, model, keep=3)  # re-saving a step replaces it
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "ckpt_50"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["ckpt_30", "ckpt_40", "ckpt_50"]


@pytest.mark.parametrize("where", ["parameter", "buffer", "optimizer"])
def test_a_nonfinite_tensor_is_never_written(tmp_path, where):
    model, opt, sched, scaler = make_training()
    train(model, opt, sched, scaler, 2)
    save_checkpoint(tmp_path, 2, model, opt, sched, scaler)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with torch.no_grad():
        if where == "parameter":
            model.LayerNorm.weight[1] = float("nan")
            needle = "LayerNorm.weight"
        elif where == "buffer":
            model.position_ids = torch.tensor([0.0, float("inf"), 2.0, 3.0])
            needle = "position_ids"
        else:
            opt.state[model.LayerNorm.bias]["exp_avg_sq"][0] = float("inf")
            needle = "optimizer state 'exp_avg_sq' of LayerNorm.bias"
    assert nonfinite_tensors(model, opt) == [needle]
    with pytest.raises(NonFiniteCheckpointError, match=f"step 4.*{needle}.*NaN/inf"):
        save_checkpoint(tmp_path, 4, model, opt, sched, scaler, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before  # nothing written or pruned
    assert json.loads((tmp_path / "checkpoints" / "ckpt_2" / "meta.json").read_text())["finite"] is True


def test_rotation_keeps_the_newest_finite_checkpoint(tmp_path):
    model = nn.Linear(2, 2)
    save_checkpoint(tmp_path, 1, model, keep=2)
    for step in (2, 3):  # written by an older version: not known to be finite
        save_checkpoint(tmp_path, step, model, keep=0)
        meta = tmp_path / "checkpoints" / f"ckpt_{step}" / "meta.json"
        meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "finite"}))
    save_checkpoint(tmp_path, 0, model, keep=2)  # re-numbered run: the new one is older than the rest
    assert [step for step, _ in list_checkpoints(tmp_path)] == [0, 1, 2, 3]  # 1: the newest finite before 0
    save_checkpoint(tmp_path, 4, model, keep=2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3, 4]


def test_missing_or_empty_dir_gives_none(tmp_path):
    assert latest_checkpoint(tmp_path / "does-not-exist") is None
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    assert latest_checkpoint(tmp_path) is None


def test_partial_checkpoints_are_ignored_and_cleaned(tmp_path):
    model = nn.Linear(2, 2)
    save_checkpoint(tmp_path, 2, model)
    root = tmp_path / "checkpoints"
    leftover = root / ".ckpt_7.tmp-1234-deadbeef"  # a save killed half way
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    (root / "ckpt_9").mkdir()  # not written by us, and incomplete
    (root / "ckpt_9" / "model.safetensors").write_bytes(b"x")
    assert latest_checkpoint(tmp_path) == root / "ckpt_2"
    save_checkpoint(tmp_path, 3, model)
    assert not leftover.exists()
    assert latest_checkpoint(tmp_path) == root / "ckpt_3"


def test_corrupt_training_state_names_the_file(tmp_path):
    model = nn.Linear(2, 2)
    path = save_checkpoint(tmp_path, 1, model, Lamb(model.parameters(), lr=0.1))
    state_file = path / "training_state.pt"
    size = state_file.stat().st_size
    state_file.write_bytes(b"\0" * size)  # same size: only the content is wrong
    with pytest.raises(CheckpointError, match="training_state.pt") as err:
        load_checkpoint(path, model)
    assert str(state_file) in str(err.value)
    state_file.write_bytes(b"\0" * 10)  # truncated
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path, model)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path, model)


UNPICKLED = []


def _record_unpickle():
    UNPICKLED.append(True)
    return "pwned"


class Payload:
    def __reduce__(self):
        return (_record_unpickle, ())


def test_pickled_objects_are_refused(tmp_path):
    model = nn.Linear(2, 2)
    path = save_checkpoint(tmp_path, 1, model)
    state_file = path / "training_state.pt"
    torch.save({"step": 1, "extra": Payload()}, state_file)
    meta = json.loads((path / "meta.json").read_text())
    meta["file_sizes"]["training_state.pt"] = state_file.stat().st_size
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="training_state.pt"):
        load_checkpoint(path, model)
    assert UNPICKLED == []


def test_unsafe_extra_fails_at_save_time(tmp_path):
    with pytest.raises(TypeError, match=r"extra\['fn'\]"):
        save_checkpoint(tmp_path, 1, nn.Linear(2, 2), extra={"fn": lambda: 1})
    assert latest_checkpoint(tmp_path) is None
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_missing_optimizer_state_is_an_error(tmp_path):
    model = nn.Linear(2, 2)
    path = save_checkpoint(tmp_path, 1, model)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(path, model, optimizer=Lamb(model.parameters(), lr=0.1))


def _resume_setup(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = Lamb(bert_param_groups(model), lr=0.02)
    sched = PolyWarmUpScheduler(opt, warmup=0.2, total_steps=12)
    return model, opt, sched


def _resume_train(model, opt, sched, steps):
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 5)  # data and dropout both draw from the global RNG
        loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
        loss.backward()
        if opt.step():
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_resume_reproduces_uninterrupted_run(tmp_path):
    uninterrupted = _resume_train(*_resume_setup(0), 12)

    model, opt, sched = _resume_setup(0)
    first_half = _resume_train(model, opt, sched, 6)
    save_checkpoint(tmp_path, 6, model, opt, sched, data_state={"batches_seen": 6})
    del model, opt, sched

    torch.manual_seed(1234)  # the new process would start from another RNG state
    model, opt, sched = _resume_setup(5)
    info = load_checkpoint(latest_checkpoint(tmp_path), model, opt, sched)
    assert info["step"] == 6 and info["data_state"] == {"batches_seen": 6}
    second_half = _resume_train(model, opt, sched, 6)
    assert first_half + second_half == uninterrupted


def test_sigterm_sets_flag_only(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    flag = install_sigterm_handler()
    try:
        assert flag.requested is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested is True and flag.signum == signal.SIGTERM
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) == previous

