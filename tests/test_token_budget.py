"""Token-budget batches (tempo/bert/data/token_budget.py) and the trainers' --max_tokens.

The sampler: deterministic per seed and epoch, every index exactly once per epoch, no batch over the
budget, a sequence over the budget named, DDP shares disjoint with equal step counts (also as accelerate
deals them). The trainers: --max_tokens runs end to end (pretraining, SQuAD, DDP), the loss keeps its
normalisation (a step equals one batch of the same sequences), --max_tokens auto without the planner is a
clear error. The docs page's blocks run (HF Trainer, sentence-transformers).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tempo.bert.data.token_budget import (
    POLICIES,
    TokenBudget,
    TokenBudgetBatchSampler,
    TokenBudgetError,
    TrimPadding,
    loss_weights,
    mask_lengths,
    plan_steps,
    token_lengths,
    trainer_dataloader,
)
from tempo.bert.data.pretraining_dataset import shard_lengths
from tempo.train.dllog import read_dllog

REPO = Path(__file__).resolve().parent.parent
SEQ, PRED = 64, 8


def _lengths(n: int = 500, seed: int = 0, low: int = 5, high: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, high + 1, size=n)


def _flat(steps) -> list[int]:
    return [i for step in steps for batch in step for i in batch]


# -- the sampler ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_deterministic_per_seed_and_epoch(policy):
    lengths = _lengths()
    budget = TokenBudget(512, policy)
    first = plan_steps(lengths, budget, seed=3, epoch=1)
    assert first == plan_steps(lengths, budget, seed=3, epoch=1)
    assert first != plan_steps(lengths, budget, seed=3, epoch=2)
    assert first != plan_steps(lengths, budget, seed=4, epoch=1)
    sampler = TokenBudgetBatchSampler(lengths, 512, policy=policy, seed=3)
    sampler.set_epoch(1)
    assert list(sampler) == [step[0] for step in first]
    sampler.set_epoch(0)
    assert list(sampler) == [step[0] for step in plan_steps(lengths, budget, seed=3, epoch=0)]


@pytest.mark.parametrize("options", [
    dict(policy="bucket"), dict(policy="pack"), dict(policy="bucket", max_sequences=3),
    dict(policy="pack", max_sequences=3), dict(policy="bucket", count="padded", pad_to_multiple_of=8),
    dict(policy="bucket", sort_chunk=37)])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_every_index_once_per_epoch_and_no_batch_over_budget(options, replicas):
    lengths = _lengths(401)
    budget = TokenBudget(300, **options)
    for epoch in range(3):
        steps = plan_steps(lengths, budget, seed=1, epoch=epoch, num_replicas=replicas)
        assert sorted(_flat(steps)) == list(range(len(lengths)))
        assert all(len(step) == replicas for step in steps)
        for batch in (b for step in steps for b in step):
            assert batch and budget.cost(lengths[batch].tolist()) <= 300
            assert len(batch) <= (options.get("max_sequences") or len(lengths))
            if budget.count == "padded":
                assert len(batch) * (-(-int(lengths[batch].max()) // 8) * 8) <= 300


def test_batches_are_full_and_packing_is_fuller():
    lengths = _lengths(2000)
    fill = {}
    for policy in POLICIES:
        steps = plan_steps(lengths, TokenBudget(2048, policy), seed=0)
        fill[policy] = lengths.sum() / (len(steps) * 2048)
    # Greedy filling leaves less than the longest sequence (128) free in all but the last batch.
    assert fill["bucket"] > 1 - 128 / 2048 - 0.01
    assert fill["pack"] >= fill["bucket"] and fill["pack"] > 0.99


@pytest.mark.parametrize("cap", [None, 4])
@pytest.mark.parametrize("seed", range(5))
def test_packing_is_first_fit_decreasing(seed, cap):
    """The segment tree and the equal-length shortcut place every sequence where plain first-fit
    decreasing (each sequence, longest first, into the first batch with room) places it."""
    lengths = _lengths(300, seed=seed, low=1, high=60)
    lengths[::7] = 20  # many equal lengths
    order = np.argsort(-lengths, kind="stable")  # shuffle=False: ties in index order
    bins: list[list[int]] = []
    for i in order:
        for b in bins:
            if sum(lengths[b]) + lengths[i] <= 100 and (cap is None or len(b) < cap):
                b.append(int(i))
                break
        else:
            bins.append([int(i)])
    planned = plan_steps(lengths, TokenBudget(100, "pack", max_sequences=cap), shuffle=False)
    assert [b for (b,) in planned] == bins


def test_whole_epoch_sort_keeps_the_step_count_and_buckets_hold_similar_lengths():
    lengths = _lengths(1000)
    counts = {len(plan_steps(lengths, TokenBudget(1000, p), seed=0, epoch=e)) for p in ("bucket",) for e in range(4)}
    assert len(counts) == 1  # the HF Trainer sizes an epoch once
    spreads = [int(np.ptp(lengths[b])) for (b,) in plan_steps(lengths, TokenBudget(1000), seed=0)]
    assert np.median(spreads) <= 4  # sorted by length: a batch's sequences are nearly alike


def test_a_sequence_over_the_budget_is_named():
    lengths = _lengths(50, low=5, high=100)
    lengths[17], lengths[31] = 700, 650
    with pytest.raises(TokenBudgetError,
                       match=r"sample 17 has 700 tokens, more than max_tokens=512.*1 other.*at least 700"):
        TokenBudgetBatchSampler(lengths, 512)
    lengths = np.array([10, 61, 10])
    with pytest.raises(TokenBudgetError, match=r"sample 1 has 61 tokens \(padded to 64\), more than max_tokens=63"):
        TokenBudgetBatchSampler(lengths, 63, count="padded", pad_to_multiple_of=8)
    TokenBudgetBatchSampler(lengths, 63)  # 61 real tokens fit


@pytest.mark.parametrize("lengths, options, needle", [
    ([3, 0, 2], {}, "sample 1 has length 0"),
    ([[3, 2]], {}, "1-D array of integers"),
    ([1.5, 2.0], {}, "1-D array of integers"),
    ([], {}, "lengths is empty"),
    ([3, 2], dict(max_tokens=0), "max_tokens must be a positive integer"),
    ([3, 2], dict(policy="sorted"), "policy must be one of"),
    ([3, 2], dict(count="all"), "count must be one of"),
    ([3, 2], dict(max_sequences=0), "max_sequences must be a positive integer or None"),
    ([3, 2], dict(pad_to_multiple_of=0), "pad_to_multiple_of must be a positive integer"),
    ([3, 2], dict(sort_chunk=0), "sort_chunk must be a positive integer or None"),
    ([3, 2], dict(policy="pack", count="padded"), "policy 'pack' mixes lengths"),
    ([3, 2], dict(policy="pack", sort_chunk=10), "sort_chunk applies to policy 'bucket'"),
    ([3, 2], dict(num_replicas=0), "num_replicas must be a positive integer"),
    ([3, 2], dict(num_replicas=2, rank=2), r"rank must be None or in \[0, num_replicas=2\)"),
    ([3, 2], dict(seed=-1), "seed and epoch must be non-negative"),
])
def test_bad_input_is_refused_clearly(lengths, options, needle):
    options = dict(dict(max_tokens=10), **options)
    with pytest.raises(TokenBudgetError, match=needle):
        TokenBudgetBatchSampler(lengths, options.pop("max_tokens"), **options)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_ddp_shares_are_disjoint_with_equal_step_counts(policy, replicas):
    lengths = _lengths(333, seed=5)
    samplers = [TokenBudgetBatchSampler(lengths, 400, policy=policy, seed=9, num_replicas=replicas, rank=r)
                for r in range(replicas)]
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        shares = [list(s) for s in samplers]
        assert len({len(share) for share in shares}) == 1 and len(shares[0]) == len(samplers[0])
        seen = [i for share in shares for batch in share for i in batch]
        assert sorted(seen) == list(range(len(lengths)))  # disjoint and complete
        # Ranks in one step got neighbouring batches: similar real tokens, so none waits long for another.
        if policy == "bucket":
            per_step = np.array([[lengths[b].sum() for b in step] for step in zip(*shares)])
            assert np.median(per_step.max(1) - per_step.min(1)) <= 128


def test_too_few_sequences_for_the_ranks_is_an_error():
    with pytest.raises(TokenBudgetError, match="3 sample.*3 batch.*one sample each.*equally to 2 ranks"):
        TokenBudgetBatchSampler([10, 10, 10], 10, num_replicas=2, rank=0)
    with pytest.raises(TokenBudgetError, match="equally to 4 ranks"):
        TokenBudgetBatchSampler([1, 1, 1], 10, num_replicas=4, rank=0)
    # Splitting a batch of several sequences makes the count even instead.
    steps = plan_steps([1, 1, 1], TokenBudget(10), num_replicas=2)
    assert len(steps) == 1 and sorted(_flat(steps)) == [0, 1, 2]


@pytest.mark.parametrize("replicas", [2, 3])
def test_rank_none_is_what_accelerate_deals_to_each_process(replicas):
    from accelerate.data_loader import BatchSamplerShard

    lengths = _lengths(300, seed=2)
    everyone = TokenBudgetBatchSampler(lengths, 500, seed=4, num_replicas=replicas)  # rank=None
    assert len(everyone) % replicas == 0
    for r in range(replicas):
        mine = TokenBudgetBatchSampler(lengths, 500, seed=4, num_replicas=replicas, rank=r)
        shard = BatchSamplerShard(everyone, num_processes=replicas, process_index=r)  # the HF Trainer's default
        assert list(shard) == list(mine) and len(shard) == len(mine)


# -- lengths and collating ------------------------------------------------------------------------------
def test_trim_padding_cuts_to_the_longest_rounded_up():
    samples = []
    for length in (3, 9, 5):
        mask = torch.zeros(16, dtype=torch.int8)
        mask[:length] = 1
        samples.append({"input_ids": torch.arange(16) * mask, "input_mask": mask, "labels": torch.arange(16)})
    batch = TrimPadding(("input_ids", "input_mask"), "input_mask", pad_to_multiple_of=4)(samples)
    assert batch["input_ids"].shape == (3, 12) and batch["input_mask"].shape == (3, 12)
    assert batch["labels"].shape == (3, 16)  # not a trimmed column
    assert int(batch["input_mask"].sum()) == 17
    tuples = [(s["input_ids"], s["input_mask"], torch.tensor(1)) for s in samples]
    out = TrimPadding((0, 1), 1, pad_to_multiple_of=7)(tuples)
    assert out[0].shape == (3, 14) and out[2].shape == (3,)
    assert TrimPadding((0, 1), 1, pad_to_multiple_of=32)(tuples)[0].shape == (3, 16)  # never past the stored length
    with pytest.raises(TokenBudgetError, match="mask column 'mask' must be one of"):
        TrimPadding(("input_ids",), "mask")
    with pytest.raises(TokenBudgetError, match="pad_to_multiple_of must be a positive integer, got 0"):
        TrimPadding(("mask",), "mask", pad_to_multiple_of=0)


def test_lengths_from_masks_and_tokenizers():
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=np.int8)
    assert mask_lengths(mask).tolist() == [2, 3, 1] and mask_lengths(torch.from_numpy(mask)).tolist() == [2, 3, 1]
    with pytest.raises(TokenBudgetError, match=r"\[samples, length\]"):
        mask_lengths(np.ones(3))

    def tokenizer(texts, truncation, max_length):
        ids = [[0] + [1] * len(t.split()) + [2] for t in texts]
        return {"input_ids": [i[:max_length] if truncation else i for i in ids]}

    assert token_lengths(tokenizer, ["a b", "c"], ["d e f", "g h i j k"]).tolist() == [4 + 5, 3 + 7]
    assert token_lengths(tokenizer, ["a b c d e f"], max_length=4).tolist() == [4]
    with pytest.raises(TokenBudgetError, match="differ in length"):
        token_lengths(tokenizer, ["a"], ["b", "c"])
    with pytest.raises(TokenBudgetError, match="at least one column"):
        token_lengths(tokenizer)


def test_loss_weights_make_the_step_mean():
    assert loss_weights([2, 6], 8, accumulation=2) == [0.5, 1.5]
    assert loss_weights([2, 6], 16, accumulation=2, world_size=2) == [0.5, 1.5]
    assert loss_weights([0, 0], 0, accumulation=2) == [0.0, 0.0]


# -- the pretraining shards -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """Shards of varied lengths (half the sequences short) and a tiny BERT config without dropout."""
    from tempo.bert.data.create_pretraining_data import create_shards
    from tempo.bert.data.sample_corpus import write_sample_corpus
    from tempo.bert.data.tokenization import train_wordpiece_vocab

    root = tmp_path_factory.mktemp("token_budget_data")
    files = write_sample_corpus(root / "text", num_documents=80, seed=5)
    vocab = root / "vocab.txt"
    train_wordpiece_vocab(files, 600, vocab)
    create_shards(root / "text", root / "shards", vocab, max_seq_length=SEQ, max_predictions_per_seq=PRED,
                  dupe_factor=1, num_shards=2, random_seed=1, short_seq_prob=0.5)
    config = json.loads((REPO / "configs" / "bert_tiny.json").read_text())
    config.update(vocab_size=sum(1 for _ in open(vocab)), hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (root / "config.json").write_text(json.dumps(config))
    return {"shards": root / "shards", "vocab": vocab, "config": root / "config.json"}


def test_shard_lengths_and_the_token_budget_stream(data):
    from tempo.bert.data.pretraining_dataset import PretrainingBatches, PretrainingShardDataset, ShardError

    shards = sorted(data["shards"].glob("*.hdf5"))
    for path in shards:
        lengths = shard_lengths(path)
        assert lengths.tolist() == PretrainingShardDataset(path).tensors["input_mask"].sum(1).tolist()
        assert lengths.min() < SEQ // 2 < lengths.max()  # varied: something to batch
    budget = TokenBudget(200)
    streams = [PretrainingBatches(data["shards"], None, seed=2, rank=r, world_size=2, token_budget=budget)
               for r in range(2)]
    for epoch in range(2):
        for shard_index, path in enumerate(shards):
            shares = []
            for stream in streams:
                stream.epoch = epoch
                shares.append(stream._rank_batches(shard_index))
            assert len(shares[0]) == len(shares[1])  # the ranks stay in step
            assert sorted(i for share in shares for b in share for i in b) == list(range(len(shard_lengths(path))))
    for stream in streams:
        stream.epoch = 0
    per_epoch = streams[0].batches_per_epoch()
    assert per_epoch == streams[1].batches_per_epoch() == sum(
        len(streams[0]._rank_batches(i)) for i in range(len(shards)))
    for stream in streams:
        for _, batch in zip(range(per_epoch), stream):
            mask = batch["input_mask"]
            assert int(mask.sum()) <= 200 and mask.shape[1] == int(mask.sum(1).max())  # cut to the longest
            assert batch["masked_lm_positions"].shape[1] == PRED
        assert stream.epoch == 0
    with pytest.raises(ValueError, match="either batch_size .* or token_budget"):
        PretrainingBatches(data["shards"], 4, token_budget=budget)
    with pytest.raises(ShardError,
                       match=r"shard .*pretrain_0000\d\.hdf5: sample \d+ has \d+ tokens, more than max_tokens=20"):
        next(iter(PretrainingBatches(data["shards"], None, token_budget=TokenBudget(20))))


def test_shard_lengths_names_a_bad_shard(tmp_path):
    import h5py

    from tempo.bert.data.pretraining_dataset import ShardError

    (tmp_path / "junk.hdf5").write_bytes(b"not an hdf5 file")
    with pytest.raises(ShardError, match="junk.hdf5"):
        shard_lengths(tmp_path / "junk.hdf5")
    with h5py.File(tmp_path / "no_mask.hdf5", "w") as f:
        f["input_ids"] = np.zeros((2, 4), dtype=np.int32)
    with pytest.raises(ShardError, match="no_mask.hdf5 has no input_mask dataset"):
        shard_lengths(tmp_path / "no_mask.hdf5")


def test_the_planner_must_define_tokens_per_step_and_its_own_missing_imports_are_not_hidden(monkeypatch):
    import importlib

    from tempo.train import flags
    from tempo.train.runtime import UsageError

    monkeypatch.setitem(sys.modules, "tempo.plan", types.SimpleNamespace())
    with pytest.raises(UsageError, match="needs tempo.plan.tokens_per_step"):
        flags.check_max_tokens(types.SimpleNamespace(max_tokens="auto"), 64)

    def broken(name):
        raise ModuleNotFoundError("No module named 'some_dependency'", name="some_dependency")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="some_dependency"):
        flags.check_max_tokens(types.SimpleNamespace(max_tokens="auto"), 64)


def test_token_budget_stream_resumes_with_the_same_batches(data):
    from tempo.bert.data.pretraining_dataset import PretrainingBatches

    kwargs = dict(seed=1, token_budget=TokenBudget(300, pad_to_multiple_of=8))
    stream = PretrainingBatches(data["shards"], None, **kwargs)
    it = iter(stream)
    for _ in range(3):
        next(it)
    state = stream.state_dict()
    expected = [next(it)["input_ids"] for _ in range(4)]
    resumed = PretrainingBatches(data["shards"], None, **kwargs)
    resumed.load_state_dict(state)
    got = [b["input_ids"] for _, b in zip(range(4), resumed)]
    for a, b in zip(expected, got):
        assert torch.equal(a, b) and a.shape[1] % 8 == 0


# -- the loss keeps its normalisation --------------------------------------------------------------------
class _Recorder(torch.optim.SGD):
    """SGD with lr 0 that keeps the gradients of each step."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None):
        self.grads.append(torch.cat([p.grad.flatten() for g in self.param_groups for p in g["params"]]))
        return super().step(closure)


class _Runtime:
    distributed, world_size = False, 1


def _step(model, loss_fn, micro_batches):
    from tempo.train.step import TrainStep

    optimizer = _Recorder(model.parameters())
    out = TrainStep(model, optimizer, loss_fn, "fp32", torch.device("cpu"), max_grad_norm=None,
                    measure_activations=False)(micro_batches)
    return out.loss, optimizer.grads[0]


def test_pretraining_loss_of_a_token_budget_step_equals_one_batch_of_its_sequences(data):
    """Micro-batches of different sizes, weighted, give the step the loss and gradient of one batch of all
    their sequences (MLM over all masked tokens, NSP over all sequences); unweighted they would not."""
    from tempo.bert.config import BertConfig
    from tempo.bert.data.pretraining_dataset import PretrainingShardDataset
    from tempo.bert.model import BertForPreTraining
    from tempo.tasks.pretrain import pretraining_loss, weigh_micro_batches

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_json_file(data["config"]), unpad=True)
    dataset = PretrainingShardDataset(sorted(data["shards"].glob("*.hdf5"))[0])
    lengths = mask_lengths(dataset.tensors["input_mask"])[:40]
    steps = plan_steps(lengths, TokenBudget(400, "pack"), seed=0)
    collate = TrimPadding(("input_ids", "segment_ids", "input_mask"), "input_mask", 8)
    micro = [collate([dataset[i] for i in b]) for (b,) in steps[:3]]
    assert len({len(b["input_ids"]) for b in micro}) > 1  # sizes differ: the weights matter
    whole = collate([dataset[i] for (b,) in steps[:3] for i in b])

    one_loss, one_grad = _step(model, pretraining_loss, [whole])
    plain_loss, _ = _step(model, pretraining_loss, [dict(b) for b in micro])
    weigh_micro_batches(micro, _Runtime())
    loss, grad = _step(model, pretraining_loss, micro)
    torch.testing.assert_close(loss, one_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, one_grad, rtol=1e-4, atol=1e-6)
    assert abs(plain_loss - one_loss) > 1e-4  # the mean of micro-batch means is another number

    # Two DDP ranks (simulated): each weighs by the step's totals over both; DDP averages their gradients.
    ranks = [micro[:1], micro[1:]]
    masked = sum(int((b["masked_lm_labels"] >= 0).sum()) for b in micro)
    sequences = sum(len(b["input_ids"]) for b in micro)
    grads, losses = [], []
    for share in ranks:
        for b in share:
            m = int((b["masked_lm_labels"] >= 0).sum())
            b["loss_weights"] = torch.tensor([loss_weights([m], masked, len(share), 2)[0],
                                              loss_weights([len(b["input_ids"])], sequences, len(share), 2)[0]])
        rank_loss, rank_grad = _step(model, pretraining_loss, share)
        losses.append(rank_loss)
        grads.append(rank_grad)
    torch.testing.assert_close(sum(losses) / 2, one_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sum(grads) / 2, one_grad, rtol=1e-4, atol=1e-6)


def test_squad_loss_of_a_token_budget_step_equals_one_batch_of_its_windows():
    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertForQuestionAnswering
    from tempo.tasks.squad import squad_loss, weigh_micro_batches

    config = json.loads((REPO / "configs" / "bert_tiny.json").read_text())
    config.update(hidden_size=32, intermediate_size=64, num_attention_heads=2, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig(**config), unpad=True)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 48, (20,), generator=g)
    ids = torch.randint(5, 1000, (20, 48), generator=g) * (torch.arange(48) < lengths[:, None])
    mask = (ids != 0).to(torch.int8)
    start = (torch.rand(20, generator=g) * lengths).long()
    rows = list(zip(ids, torch.zeros_like(ids), mask, start, torch.minimum(start + 2, lengths - 1)))
    collate = TrimPadding((0, 1, 2), 2)
    steps = plan_steps(lengths.numpy(), TokenBudget(200), seed=0)
    micro = [collate([rows[i] for i in b]) for (b,) in steps]
    assert len(micro) > 2 and len({len(b[0]) for b in micro}) > 1
    one_loss, one_grad = _step(model, squad_loss, [collate(rows)])
    loss, grad = _step(model, squad_loss, weigh_micro_batches(micro, _Runtime()))
    torch.testing.assert_close(loss, one_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, one_grad, rtol=1e-4, atol=1e-6)


# -- the trainers ----------------------------------------------------------------------------------------
def _pretrain_args(data, out: Path, *extra: str, steps: int = 3) -> list[str]:
    return ["--input_dir", str(data["shards"]), "--config_file", str(data["config"]), "--vocab_file",
            str(data["vocab"]), "--output_dir", str(out), "--max_seq_length", str(SEQ), "--max_predictions_per_seq",
            str(PRED), "--learning_rate", "1e-3", "--max_steps", str(steps), "--seed", "7", "--log_freq", "1",
            "--num_workers", "0", "--disable_progress_bar", "--skip_checkpoint", "--no-tempo", *extra]


def _steps(log: Path) -> list[dict]:
    return [r["data"] for r in read_dllog(str(log)) if isinstance(r["step"], int)]


def test_run_pretraining_with_max_tokens(data, tmp_path, capsys):
    from tempo.tasks.pretrain import main

    out = tmp_path / "run"
    assert main(_pretrain_args(data, out, "--max_tokens", "300", "--gradient_accumulation_steps", "2",
                               "--max_sequences_per_batch", "12")) == 0
    steps = _steps(out / "dllogger.json")
    assert len(steps) == 3
    for record in steps:
        assert 0 < record["real_tokens"] <= 2 * 300 and record["sequences"] <= 2 * 12
        assert record["real_tokens"] <= record["padded_tokens"] <= record["sequences"] * SEQ
        assert np.isfinite(record["loss"])
    assert "up to 300 real tokens per GPU (bucket; --train_batch_size unused), 2 per step" in capsys.readouterr().out
    # --no-unpad counts the padded batch; packing is refused there.
    assert main(_pretrain_args(data, tmp_path / "padded", "--max_tokens", "300", "--no-unpad", steps=2)) == 0
    assert all(r["padded_tokens"] <= 300 for r in _steps(tmp_path / "padded" / "dllogger.json"))


@pytest.mark.parametrize("extra, needle", [
    (["--max_tokens", "40"], "--max_tokens 40 cannot hold one sequence of --max_seq_length 64 (64 tokens"),
    (["--max_tokens", "60", "--no-unpad"], "--max_tokens 60 cannot hold one sequence"),
    (["--max_tokens", "300", "--token_batching", "pack", "--no-unpad"], "--token_batching pack needs --unpad"),
    (["--max_tokens", "300", "--synthetic_data"], "--max_tokens needs --input_dir"),
])
def test_pretraining_max_tokens_bad_flags(data, tmp_path, capsys, extra, needle):
    from tempo.tasks.pretrain import main

    assert main(_pretrain_args(data, tmp_path / "bad", *extra)) == 1
    assert needle in capsys.readouterr().err


def test_max_tokens_flag_parses_numbers_and_auto(data, tmp_path, capsys):
    from tempo.tasks.pretrain import build_parser

    assert build_parser().parse_args(_pretrain_args(data, tmp_path, "--max_tokens", "auto")).max_tokens == "auto"
    for bad in ("0", "lots", "-5"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(_pretrain_args(data, tmp_path, "--max_tokens", bad))
        assert "must be a positive number of tokens or 'auto'" in capsys.readouterr().err


@pytest.mark.parametrize("trainer", ["pretrain", "squad"])
def test_max_tokens_auto_without_the_planner_is_a_clear_error(data, tmp_path, capsys, monkeypatch, trainer):
    monkeypatch.setitem(sys.modules, "tempo.plan", None)  # as if tempo/plan did not exist
    if trainer == "pretrain":
        from tempo.tasks.pretrain import main

        status = main(_pretrain_args(data, tmp_path / "auto", "--max_tokens", "auto"))
    else:
        from tempo.tasks.squad import main

        status = main(_squad_args(tmp_path, "--max_tokens", "auto"))
    assert status == 1
    err = capsys.readouterr().err
    assert "--max_tokens auto needs the planner (tempo.plan)" in err and "Traceback" not in err
    assert not (tmp_path / "auto" / "dllogger.json").exists()  # refused before any work


def test_max_tokens_auto_takes_the_planners_tokens(data, tmp_path, monkeypatch, capsys):
    from tempo.tasks.pretrain import main

    asked = {}

    class PlanError(ValueError):
        pass

    def tokens_per_step(model, **context):
        asked.update(context, model=model)
        return 250

    planner = types.SimpleNamespace(tokens_per_step=tokens_per_step, PlanError=PlanError)
    monkeypatch.setitem(sys.modules, "tempo.plan", planner)
    out = tmp_path / "planned"
    assert main(_pretrain_args(data, out, "--max_tokens", "auto", steps=2)) == 0
    assert read_dllog(str(out / "dllogger.json"))[0]["data"]["max_tokens"] == 250
    assert all(r["real_tokens"] <= 250 for r in _steps(out / "dllogger.json"))
    assert isinstance(asked.pop("model"), torch.nn.Module) and len(asked.pop("lengths")) > 0
    # The run's terms in the planner's vocabulary: the CPU, fp32, LAMB, the device's default budget.
    # tempo=False: the model is planned as it will run (its layers are the --tempo flags').
    assert asked == {"budget": None, "device": "cpu", "precision": "fp32", "optimizer": "lamb", "tempo": False}

    planner.tokens_per_step = lambda model, **_: 0
    assert main(_pretrain_args(data, tmp_path / "zero", "--max_tokens", "auto", steps=1)) == 1
    assert "tokens_per_step returned 0, not a positive number" in capsys.readouterr().err

    def refuses(model, **_):
        raise PlanError("tempo.plan: argument 'budget' is needed on the CPU")

    planner.tokens_per_step = refuses
    assert main(_pretrain_args(data, tmp_path / "refused", "--max_tokens", "auto", steps=1)) == 1
    err = capsys.readouterr().err
    assert "--max_tokens auto: tempo.plan: argument 'budget' is needed on the CPU" in err and "Traceback" not in err
    planner.tokens_per_step = lambda model, **_: 40  # below one sequence of --max_seq_length 64
    assert main(_pretrain_args(data, tmp_path / "small", "--max_tokens", "auto", steps=1)) == 1
    assert "--max_tokens 40 cannot hold one sequence" in capsys.readouterr().err


def test_max_tokens_auto_with_the_real_planner_and_a_memory_budget(data, tmp_path, capsys):
    """The trainers' --max_tokens auto through tempo.plan itself (fake tensors, the CPU's paths)."""
    from tempo.tasks.pretrain import main

    out = tmp_path / "real_plan"
    assert main(_pretrain_args(data, out, "--max_tokens", "auto", "--memory_budget", "64MiB", steps=1)) == 0
    planned = read_dllog(str(out / "dllogger.json"))[0]["data"]["max_tokens"]
    assert isinstance(planned, int) and planned >= 64
    assert main(_pretrain_args(data, tmp_path / "tiny", "--max_tokens", "auto", "--memory_budget", "16KiB",
                               steps=1)) == 1
    err = capsys.readouterr().err
    assert "--max_tokens auto: tempo.plan: the budget 16.00 KiB is below the weights and optimizer states" in err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def squad_files(tmp_path_factory):
    from tempo.bert.data.qa_generator import write_qa_set

    return write_qa_set(tmp_path_factory.mktemp("qa_tb"), num_train=24, num_dev=4, seed=7)


def _squad_args(out: Path, *extra: str, train_file: Path | None = None) -> list[str]:
    from tempo.bert.hf_interop import minilm_dir

    return ["--config_file", str(REPO / "configs" / "bert_tiny.json"), "--vocab_file", str(minilm_dir() / "vocab.txt"),
            "--output_dir", str(out), "--max_seq_length", "96", "--doc_stride", "32", "--max_query_length", "24",
            "--disable-progress-bar", "--num_workers", "0", "--no-tempo", "--do_train",
            "--train_file", str(train_file or REPO / "README.md"), "--skip_cache", "--skip_checkpoint",
            "--log_freq", "1", *extra]


def test_run_squad_with_max_tokens(squad_files, tmp_path):
    from tempo.tasks.squad import main

    out = tmp_path / "squad"
    assert main(_squad_args(out, "--max_tokens", "400", "--token_batching", "pack", "--max_steps", "3",
                            train_file=squad_files[0])) == 0
    steps = _steps(out / "dllogger.json")
    assert len(steps) == 3
    for record in steps:
        assert 0 < record["real_tokens"] <= 400 and record["padded_tokens"] <= record["sequences"] * 96
        assert np.isfinite(record["loss"])
    assert main(_squad_args(tmp_path / "short", "--max_tokens", "90", "--max_steps", "1",
                            train_file=squad_files[0])) == 1


def test_run_squad_max_tokens_auto_takes_the_planners_tokens(squad_files, tmp_path, monkeypatch):
    from tempo.tasks.squad import main

    asked = {}

    def tokens_per_step(model, **context):
        asked.update(context)
        return 300

    monkeypatch.setitem(sys.modules, "tempo.plan", types.SimpleNamespace(tokens_per_step=tokens_per_step))
    out = tmp_path / "squad_auto"
    assert main(_squad_args(out, "--max_tokens", "auto", "--max_steps", "2", train_file=squad_files[0])) == 0
    assert asked["optimizer"] == "adamw" and asked["device"] == "cpu" and len(asked["lengths"]) >= 24
    assert all(r["real_tokens"] <= 300 for r in _steps(out / "dllogger.json"))


# torchrun on the CPU (gloo): about one run in 10-40 of a 2-process run ends with a rank aborting at
# exit, "terminate called without an active exception", after the run finished and wrote its outputs
# ("done:" printed). Seen at the commit before SeededDropout too (4 of 40), with --no-tempo, so not in
# Tempo's layers; the cause, inside torch's process-group teardown, is not found (docs/status.md). That
# abort alone gets one rerun, said on stdout; any other failure, or the abort twice, fails the test.
EXIT_ABORT = "terminate called without an active exception"


def run_torchrun(cmd: list[str], env: dict, out: Path, **kw) -> subprocess.CompletedProcess:
    import shutil

    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, **kw)
    if result.returncode != 0 and EXIT_ABORT in result.stderr and "done:" in result.stdout:
        print(f"torchrun ended with the exit-time abort after its run finished; running it once more: {cmd}")
        shutil.rmtree(out, ignore_errors=True)
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, **kw)
    return result


@pytest.mark.slow
def test_ddp_pretraining_with_max_tokens_runs_equal_steps(data, tmp_path):
    """Two processes (gloo): equal step counts per rank (or the run would hang) and the loss weights'
    all-reduce; each rank's micro-batches within the budget."""
    out = tmp_path / "ddp"
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "run_pretraining.py"), *_pretrain_args(data, out, "--max_tokens", "300", steps=4)]
    result = run_torchrun(cmd, env, out)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = _steps(out / "dllogger.json")
    assert len(steps) == 4 and all(0 < r["real_tokens"] <= 300 and np.isfinite(r["loss"]) for r in steps)


# -- the HF Trainer hook ---------------------------------------------------------------------------------
def test_hf_trainer_sees_every_sample_once_per_epoch(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 30, (40,), generator=g).tolist()
    rows = [{"input_ids": list(range(5, 5 + n)), "labels": i % 2, "index": i} for i, n in enumerate(lengths)]
    seen: list[list[int]] = []

    def collate(features):
        seen.append([f["index"] for f in features])
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
        return {"input_ids": ids, "attention_mask": (ids != 0).long(),
                "labels": torch.tensor([f["labels"] for f in features])}

    class TokenBudgetTrainer(Trainer):
        def get_train_dataloader(self):
            return trainer_dataloader(self, lengths, max_tokens=120)

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=2, report_to=[], save_strategy="no",
                             use_cpu=True, remove_unused_columns=False, logging_strategy="no", seed=3)
    trainer = TokenBudgetTrainer(model=BertForSequenceClassification(config), args=args, train_dataset=rows,
                                 data_collator=collate)
    trainer.train()
    per_epoch = len(TokenBudgetBatchSampler(lengths, 120, seed=3))
    assert len(seen) == 2 * per_epoch
    for epoch in range(2):
        batches = seen[epoch * per_epoch:(epoch + 1) * per_epoch]
        assert sorted(i for b in batches for i in b) == list(range(40))
        assert all(sum(lengths[i] for i in b) <= 120 for b in batches)
        sampler = TokenBudgetBatchSampler(lengths, 120, seed=3)
        sampler.set_epoch(epoch)
        assert batches == list(sampler)  # the Trainer set the epoch
    with pytest.raises(TokenBudgetError, match="needs a transformers Trainer"):
        trainer_dataloader(object(), lengths, 120)
    with pytest.raises(TokenBudgetError, match="lengths has 3 entries but the train_dataset 40"):
        trainer_dataloader(trainer, [1, 2, 3], 120)
    trainer.train_dataset = iter(rows)
    with pytest.raises(TokenBudgetError, match="needs a train_dataset with a length"):
        trainer_dataloader(trainer, lengths, 120)


def test_hf_trainer_datasets_columns_the_model_does_not_take_are_removed(tmp_path):
    """As the Trainer's own loader: a datasets.Dataset loses the columns forward() does not take."""
    import datasets
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    lengths = [3, 5, 2, 7, 4, 6]
    table = datasets.Dataset.from_dict({"input_ids": [list(range(5, 5 + n)) for n in lengths],
                                        "labels": [0, 1, 0, 1, 0, 1], "text": ["words"] * 6})

    def collate(features):
        assert set(features[0]) == {"input_ids", "labels"}, set(features[0])  # "text" removed
        width = max(len(f["input_ids"]) for f in features)
        return {"input_ids": torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features]),
                "labels": torch.tensor([f["labels"] for f in features])}

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, seed=1)
    trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=table,
                      data_collator=collate)
    loader = trainer_dataloader(trainer, lengths, max_tokens=10)
    batches = list(loader)
    assert sum(len(b["labels"]) for b in batches) == 6 and len(batches) == len(loader)


def test_docs_page_blocks_are_run_by_test_docs():
    """tests/test_docs.py runs every python block of docs/token-budget.md (its ids docs/token-budget.md:N);
    here: the page is in the nav, and its three examples (own loop, HF Trainer, sentence-transformers) are
    among the blocks it runs, none skipped as GPU-only."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import test_docs
    finally:
        sys.path.pop(0)
    page = REPO / "docs" / "token-budget.md"
    blocks = [b for b in test_docs.PYTHON if b.path == page]
    assert len(blocks) == 3 and all(b.mark is None for b in blocks)
    assert ["DataLoader(" in blocks[0].code, "get_train_dataloader" in blocks[1].code,
            "SentenceTransformerTrainer" in blocks[2].code] == [True] * 3
    assert "token-budget.md" in (REPO / "mkdocs.yml").read_text()


def test_report_runs_quickly_on_tiny_data(capsys):
    from tempo.bert.data.token_budget import main

    assert main(["--report", "--quick"]) == 0
    table = capsys.readouterr().out
    for needle in ("| Wikipedia-like | 512 |", "| SQuAD-like | 384 |", "padded to S", "real tokens, pack"):
        assert needle in table


def test_max_tokens_auto_plans_one_process_without_an_engine(data, tmp_path, monkeypatch, capsys):
    """One process (no torchrun) runs no DDP and no FSDP2: --max_tokens auto plans it so (world size 1,
    no engine: DDP's buckets would cost tokens it does not spend), whatever --parallel says."""
    import tempo.tasks.pretrain as pretrain

    calls = []
    real = pretrain.planned_max_tokens

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(pretrain, "planned_max_tokens", recording)
    assert pretrain.main(_pretrain_args(data, tmp_path / "auto", "--max_tokens", "auto", "--memory_budget", "8MiB",
                                        "--parallel", "ddp", steps=1)) == 0
    assert len(calls) == 1 and calls[0]["world_size"] == 1 and calls[0]["parallel"] is None
    assert "--max_tokens auto:" in capsys.readouterr().out
