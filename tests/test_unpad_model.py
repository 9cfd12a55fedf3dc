"""The unpadded BERT: the same loss and gradients as the padded one, computed on real tokens only.

Dropout off, fp32: every parameter's gradient within 1e-5 relative L2 of the padded run, for
pretraining (MLM at masked positions, NSP from [CLS]) and SQuAD (start/end logits over the padded
positions), for the stock layers and the Tempo ones; lengths from 1 to L, one full-length row among
short ones, and a batch without padding. Bad masks fail before any compute, naming the row.
"""

import pytest
import torch

from tempo.bert.config import BertConfig
from tempo.bert.model import BertForPreTraining, BertForQuestionAnswering
from tempo.choices import TempoChoice
from tempo.memory import ActivationLedger
from tempo.unpad import LayoutError

from test_attention_dispatch import EFFICIENT, h100  # noqa: F401  (fixture: the simulated H100)

TINY = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
L = 20
CHOICES = {
    "original": TempoChoice.none(),
    "sdpa": TempoChoice.none("sdpa"),
    "paper": TempoChoice.full(),
    "all": TempoChoice.floor(),
}
# Lengths 1..L, one full row among short ones; and a batch without padding.
LENGTHS = {"mixed": [L, 1, 7, 13, 2, L - 1], "full": [L, L, L]}


def batch_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    ids = torch.randint(5, TINY.vocab_size, (b, L), generator=g)
    mask = torch.zeros(b, L, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids * mask
    types = torch.zeros_like(ids)
    types[:, L // 2:] = 1
    types *= mask
    return ids, types, mask


def pretraining_targets(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.zeros(len(lengths), 3, dtype=torch.long)
    labels = torch.full((len(lengths), 3), -1)
    for row, n in enumerate(lengths):
        count = min(3, n)
        positions[row, :count] = torch.randperm(n, generator=g)[:count]
        labels[row, :count] = torch.randint(5, TINY.vocab_size, (count,), generator=g)
    return positions, labels, torch.randint(0, 2, (len(lengths),), generator=g)


def run(model_cls, choice, unpad, args):
    torch.manual_seed(0)
    model = model_cls(TINY, choice, unpad=unpad).train()
    out = model(*args)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(padded, unpadded, what):
    (out_p, grads_p), (out_u, grads_u) = padded, unpadded
    assert abs(out_p.loss.item() - out_u.loss.item()) <= 1e-6 * abs(out_p.loss.item()), what
    assert grads_p.keys() == grads_u.keys()
    for name in grads_p:
        ref = grads_p[name]
        error = (grads_u[name] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert error <= 1e-5 or (grads_u[name] - ref).abs().max() <= 1e-7, f"{what}: {name} {error:.2e}"


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("choice", list(CHOICES))
def test_pretraining_unpadded_equals_padded(choice, lengths):
    ids, types, mask = batch_of(LENGTHS[lengths])
    args = (ids, types, mask, *pretraining_targets(LENGTHS[lengths]))
    assert_same(run(BertForPreTraining, CHOICES[choice], False, args),
                run(BertForPreTraining, CHOICES[choice], True, args), f"{choice}/{lengths}")


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("choice", list(CHOICES))
def test_squad_unpadded_equals_padded(choice, lengths):
    ids, types, mask = batch_of(LENGTHS[lengths])
    n = torch.tensor(LENGTHS[lengths])
    start = torch.div(n, 2, rounding_mode="floor")
    args = (ids, types, mask, start, torch.minimum(start + 1, n - 1))
    padded = run(BertForQuestionAnswering, CHOICES[choice], False, args)
    unpadded = run(BertForQuestionAnswering, CHOICES[choice], True, args)
    assert_same(padded, unpadded, f"{choice}/{lengths}")
    assert torch.equal(padded[0].start_logits == torch.finfo(torch.float32).min, ~mask.bool())
    torch.testing.assert_close(unpadded[0].start_logits, padded[0].start_logits, rtol=1e-5, atol=1e-5)


def test_unpadded_keeps_fewer_bytes_per_batch():
    """The ledger: the unpadded run keeps bytes for real tokens only (the padded one for B·L)."""
    lengths = [L, 2, 3, 4]
    ids, types, mask = batch_of(lengths)
    args = (ids, types, mask, *pretraining_targets(lengths))
    kept = {}
    for unpad in (False, True):
        model = BertForPreTraining(TINY, TempoChoice.floor(), unpad=unpad).train()
        with ActivationLedger(model) as ledger:
            model(*args).loss.backward()
        kept[unpad] = ledger.by_module(depth=3).get("bert.encoder.layer", ledger.activation_bytes)
    real, total = sum(lengths), len(lengths) * L
    assert kept[True] < kept[False] * (real / total) * 1.25


@pytest.mark.parametrize("mask,message", [
    ([[1, 0, 1, 1]], "row 0's real tokens are not contiguous"),
    ([[1, 1, 1, 1], [0, 0, 0, 0]], "row 1 has no real token"),
])
def test_bad_masks_fail_before_any_compute(mask, message):
    model = BertForPreTraining(TINY, TempoChoice.floor(), unpad=True)
    mask = torch.tensor(mask)
    with pytest.raises(LayoutError, match=message):
        model(torch.ones_like(mask) * 7, torch.zeros_like(mask), mask)


def test_sequences_longer_than_the_position_table_are_named():
    model = BertForPreTraining(TINY, TempoChoice.floor(), unpad=True)
    ids = torch.ones(1, 41, dtype=torch.long)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(ids, torch.zeros_like(ids), torch.ones_like(ids))


@pytest.mark.parametrize("how", ["checkpointing", "compile"])
def test_unpadded_with_activation_checkpointing_and_torch_compile(how):
    """The layout travels through non-reentrant checkpointing and through torch.compile (its
    host-side construction is a graph break; the layers compile with a dynamic token count)."""
    lengths = LENGTHS["mixed"]
    ids, types, mask = batch_of(lengths)
    args = (ids, types, mask, *pretraining_targets(lengths))
    torch.manual_seed(0)
    reference = BertForPreTraining(TINY, TempoChoice.floor(), unpad=True).train()
    torch.manual_seed(0)
    model = BertForPreTraining(TINY, TempoChoice.floor(), unpad=True,
                               checkpoint_activations=how == "checkpointing").train()
    runner = torch.compile(model, backend="aot_eager", dynamic=True) if how == "compile" else model
    want = reference(*args).loss
    want.backward()
    got = runner(*args).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
def test_efficient_attention_keeps_the_fused_kernels_with_dropout(h100, unpad):
    """On the simulated H100 with dropout on: padded, the efficient attention gets a bool
    key-padding mask (an additive float mask with dropout would run the reference op), so every
    layer runs the fused efficient kernel; unpadded, nested sdpa with the layout's min/max lengths."""
    import dataclasses

    config = dataclasses.replace(TINY, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    lengths = LENGTHS["mixed"]
    ids, types, mask = batch_of(lengths)
    torch.manual_seed(0)
    model = BertForPreTraining(config, TempoChoice.floor(), unpad=unpad).train()
    model(ids, types, mask, *pretraining_targets(lengths)).loss.backward()
    calls = h100.calls
    assert len(calls) == config.num_hidden_layers
    for call in calls:
        assert call["chosen"] == EFFICIENT and call["p"] == 0.1 and call["nested"] == unpad
        assert (call["mask"] is None) if unpad else (call["mask"].dtype == torch.bool)
