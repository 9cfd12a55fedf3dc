"""FSDP2 in this process, over a gloo process group of one (issue 42): sharded checkpoints through
torch.distributed.checkpoint (tempo.train.checkpointing) and TrainStep's gradient accumulation over a
sharded model. The 2-process runs are tests/test_pretrain_fsdp2.py and tests/test_fsdp2.py (slow)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from tempo.integrations.recompute import fully_shard_blocks
from tempo.train.checkpointing import (
    CheckpointError,
    NonFiniteCheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tempo.train.optim import Lamb, PolyWarmUpScheduler, bert_param_groups



@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one process (FSDP2 shards over it), destroyed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this test process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded_bert(seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     vocab_size=50, max_position_embeddings=16)
    model = fully_shard_blocks(transformers.BertForMaskedLM(config))
    optimizer = Lamb(bert_param_groups(model), lr=1e-3)
    return model, optimizer


def _train_once(model, optimizer):
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _local_state(model, optimizer):
    params = {n: p.to_local().clone() for n, p in model.named_parameters()}
    states = [v.to_local().clone() if hasattr(v, "to_local") else v
              for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return params, states


def test_a_sharded_checkpoint_restores_the_shards_and_the_optimizer(one_rank_group, tmp_path):
    pytest.importorskip("transformers")
    model, optimizer = _sharded_bert(0)
    _train_once(model, optimizer)
    scheduler = PolyWarmUpScheduler(optimizer, warmup=0.1, total_steps=10, base_lr=1e-3)
    path = save_checkpoint(tmp_path / "out", 1, model, optimizer, scheduler, extra={"phase": 1})
    assert (path / "sharded" / ".metadata").is_file() and not (path / "model.safetensors").exists()
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["parallel"], meta["world_size"], meta["finite"]) == ("fsdp2", 1, True)
    assert list_checkpoints(tmp_path / "out") == [(1, path)]  # complete without model.safetensors
    assert not [p for p in (tmp_path / "out" / "checkpoints").iterdir() if p.name.startswith(".")]
    saved_params, saved_states = _local_state(model, optimizer)

    fresh, fresh_optimizer = _sharded_bert(1)  # other weights, no optimizer state yet
    _train_once(fresh, fresh_optimizer)
    fresh_scheduler = PolyWarmUpScheduler(fresh_optimizer, warmup=0.1, total_steps=10, base_lr=1e-3)
    state = load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler)
    assert state["step"] == 1 and state["extra"] == {"phase": 1}
    params, states = _local_state(fresh, fresh_optimizer)
    assert params.keys() == saved_params.keys()
    assert all(torch.equal(params[n], saved_params[n]) for n in params)
    assert len(states) == len(saved_states) and all(torch.equal(a, b) for a, b in zip(states, saved_states))
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_a_sharded_checkpoint_is_refused_by_an_unsharded_model_and_the_reverse(one_rank_group, tmp_path):
    pytest.importorskip("transformers")
    import transformers

    model, optimizer = _sharded_bert(0)
    sharded = save_checkpoint(tmp_path / "a", 1, model, optimizer)
    torch.manual_seed(0)
    plain = transformers.BertForMaskedLM(model.config)
    with pytest.raises(CheckpointError, match="written by an FSDP2 run .* resume it with --parallel fsdp2"):
        load_checkpoint(sharded, plain)
    whole = save_checkpoint(tmp_path / "b", 1, plain)
    with pytest.raises(CheckpointError, match="written by one process or DDP: resume it without --parallel fsdp2"):
        load_checkpoint(whole, model)


def test_a_sharded_checkpoint_of_another_model_is_refused_in_one_line(one_rank_group, tmp_path):
    pytest.importorskip("transformers")
    model, optimizer = _sharded_bert(0)
    path = save_checkpoint(tmp_path / "out", 1, model)
    import transformers

    config = transformers.BertConfig(hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     vocab_size=50, max_position_embeddings=16)
    wider = fully_shard_blocks(transformers.BertForMaskedLM(config))
    with pytest.raises(CheckpointError, match="sharded does not fit this model: .*Size mismatch") as err:
        load_checkpoint(path, wider, restore_rng=False)
    assert "\n" not in str(err.value)


def test_a_sharded_checkpoint_holding_a_nan_is_refused_before_anything_is_written(one_rank_group, tmp_path):
    pytest.importorskip("transformers")
    model, optimizer = _sharded_bert(0)
    with torch.no_grad():
        next(model.parameters()).to_local()[0, 0] = float("nan")
    with pytest.raises(NonFiniteCheckpointError, match="bert.embeddings.word_embeddings.weight holds NaN/inf"):
        save_checkpoint(tmp_path / "out", 1, model, optimizer)
    assert not (tmp_path / "out" / "checkpoints").exists() or not any((tmp_path / "out" / "checkpoints").iterdir())


def test_a_sharded_checkpoint_without_its_metadata_is_incomplete(one_rank_group, tmp_path):
    """A killed save can leave shards without DCP's .metadata (written last): not a checkpoint."""
    pytest.importorskip("transformers")
    model, optimizer = _sharded_bert(0)
    path = save_checkpoint(tmp_path / "out", 1, model, optimizer)
    broken = path.parent / "ckpt_2"
    shutil.copytree(path, broken)
    (broken / "sharded" / ".metadata").unlink()
    assert list_checkpoints(tmp_path / "out") == [(1, path)]
    with pytest.raises(CheckpointError, match="incomplete: .*sharded/.metadata is missing"):
        load_checkpoint(broken, model, optimizer)


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def test_trainstep_accumulates_over_a_sharded_model_as_over_the_whole_one(one_rank_group):
    """FSDP2 reduce-scatters once per step (set_requires_gradient_sync on the last micro-batch only):
    with two micro-batches the sharded model's update equals the plain model's."""
    from torch.distributed.fsdp import fully_shard

    from tempo.train.step import TrainStep

    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)) for _ in range(2)]
    plain = _TwoLayers()
    sharded = _TwoLayers()
    for layer in sharded.layers:
        fully_shard(layer)
    fully_shard(sharded)
    for model in (plain, sharded):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        TrainStep(model, optimizer, _mse, "fp32", torch.device("cpu"), max_grad_norm=None, distributed=False,
                  measure_activations=False)(batches)
    for (name, a), (_, b) in zip(plain.named_parameters(), sharded.named_parameters()):
        torch.testing.assert_close(b.full_tensor(), a, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(plain.layers[0].weight, _TwoLayers().layers[0].weight)  # it stepped
