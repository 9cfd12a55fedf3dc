"""A forward run under torch.no_grad() and replayed with grad from the same RNG state draws the
same dropout masks (GradCache; sentence-transformers' CachedMultipleNegativesRankingLoss embeds
each mini-batch without grad, then replays it with grad and backpropagates the first pass's
embedding gradients through the second: exact only if both passes are the same function).

Tempo's ops draw their masks from a seed taken from torch's RNG; without a backward and without
dropout they run the stock ops, but with dropout they must run their own path either way, or
the no-grad pass would draw torch's stock masks and the replay Tempo's."""

import pytest
import torch

from tempo.ops.attention import efficient_attention, efficient_attention_varlen
from tempo.ops.combined import combined_softmax_dropout_matmul
from tempo.ops.dropout_add_layernorm import dropout_add_layernorm

from test_attention_dispatch import h100  # noqa: F401  (fixture: the simulated H100)


def _replayed(fn, *inputs):
    """fn's output under no_grad and again with grad, from the same RNG state."""
    state = torch.get_rng_state()
    with torch.no_grad():
        first = fn(*inputs)
    torch.set_rng_state(state)
    leaves = [t.detach().requires_grad_() for t in inputs]
    second = fn(*leaves)
    assert second.grad_fn is not None  # the replay is the pass a backward follows
    return first, second.detach()


def _inputs(*shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for shape in shapes]


def test_dropout_add_layernorm_replays_its_mask(backend):
    x, r = _inputs((4, 6, 32), (4, 6, 32))
    w, b = torch.randn(32), torch.randn(32)
    first, second = _replayed(lambda x, r: dropout_add_layernorm(x, r, (32,), w, b, p=0.3), x, r)
    assert torch.equal(first, second)
    without_dropout = dropout_add_layernorm(x, r, (32,), w, b, p=0.3, training=False)
    assert not torch.equal(first, without_dropout)  # the mask did drop something


def test_combined_replays_its_mask(backend):
    x, v = _inputs((2, 3, 8, 8), (2, 3, 8, 4))
    first, second = _replayed(lambda x, v: combined_softmax_dropout_matmul(x, v, p=0.3), x, v)
    assert torch.equal(first, second)
    assert not torch.equal(first, combined_softmax_dropout_matmul(x, v, p=0.3, training=False))


@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "padding-mask"])
def test_efficient_attention_replays_its_mask(mask):
    q, k, v = _inputs((2, 2, 9, 8), (2, 2, 9, 8), (2, 2, 9, 8))
    attn_mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    attn_mask[1, ..., 6:] = False
    m = attn_mask if mask else None
    first, second = _replayed(lambda q, k, v: efficient_attention(q, k, v, attn_mask=m, dropout_p=0.3), q, k, v)
    assert torch.equal(first, second)
    assert not torch.equal(first, efficient_attention(q, k, v, attn_mask=m, dropout_p=0.3, training=False))


@pytest.mark.parametrize("where", ["cpu", "simulated_h100"])
def test_efficient_attention_with_a_learned_bias_replays_its_mask(request, where):
    """A float attn_mask computed from a learned parameter requires grad in the pass with grad and
    not in the no-grad pass: which op draws the dropout mask must not depend on that (issue 28: on
    CUDA the no-grad pass ran the fused kernel, the replay the reference op). Same output, same
    amount of torch's RNG consumed (later layers' masks stay aligned), and the bias gets its
    gradient."""
    if where == "simulated_h100":
        request.getfixturevalue("h100")
    q, k, v = _inputs((2, 2, 9, 8), (2, 2, 9, 8), (2, 2, 9, 8))
    table = torch.randn(1, 2, 9, 9, generator=torch.Generator().manual_seed(1)).requires_grad_()

    def attention(q, k, v):
        bias = table * 0.5  # requires grad only when grad mode is on
        return efficient_attention(q, k, v, attn_mask=bias, dropout_p=0.3)

    state = torch.get_rng_state()
    with torch.no_grad():
        first = attention(q, k, v)
    after_first = torch.get_rng_state()
    torch.set_rng_state(state)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    second = attention(*leaves)
    assert torch.equal(torch.get_rng_state(), after_first)
    assert torch.equal(first, second.detach())
    second.sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    assert not torch.equal(first, efficient_attention(q, k, v, attn_mask=table.detach() * 0.5, dropout_p=0.3,
                                                      training=False))


def test_varlen_attention_replays_its_mask():
    q, k, v = _inputs((11, 2, 8), (11, 2, 8), (11, 2, 8))
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    first, second = _replayed(lambda q, k, v: efficient_attention_varlen(q, k, v, cu, 7, dropout_p=0.3), q, k, v)
    assert torch.equal(first, second)


def test_eval_mode_still_runs_the_stock_ops(monkeypatch):
    """The stock fast path stays in eval mode; in training mode the op runs without a backward even
    with p == 0, so that a replay gives the same bits (tests/test_nograd_equals_grad.py)."""
    import tempo.ops.combined as combined

    calls = []
    real = combined._stock_combined
    monkeypatch.setattr(combined, "_stock_combined", lambda *a: calls.append(1) or real(*a))
    x, v = _inputs((2, 5, 5), (2, 5, 3))
    with torch.no_grad():
        combined_softmax_dropout_matmul(x, v, p=0.3, training=False)
        combined_softmax_dropout_matmul(x, v, p=0.0, training=False)
        assert calls == [1, 1]
        combined_softmax_dropout_matmul(x, v, p=0.0)
        combined_softmax_dropout_matmul(x, v, p=0.3)
    assert calls == [1, 1]


def test_hf_bert_with_tempo_replays_dropout_in_a_no_grad_pass():
    """The whole model, as CachedMultipleNegativesRankingLoss uses it: training mode, dropout 0.1,
    apply_tempo's default (fused residual blocks, efficient attention), a padded batch."""
    transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it
    from tempo.integrations.patch import apply_tempo

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = apply_tempo(transformers.BertModel(config)).train()
    ids = torch.randint(3, 100, (3, 10))
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0
    state = torch.get_rng_state()
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.set_rng_state(state)
    second = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert second.requires_grad
    # Same masks; the layers without dropout (GELU, LayerNorm) run the stock ops in the no-grad
    # pass, which round differently from Tempo's: equal within fp32 rounding, not bitwise.
    torch.testing.assert_close(first, second.detach(), rtol=1e-5, atol=1e-5)
    other = model(input_ids=ids, attention_mask=mask).last_hidden_state  # new masks: a real draw
    assert (first - other.detach()).abs().max() > 0.1


def test_hf_bert_with_tempo_under_reentrant_checkpointing_matches_without():
    """Reentrant activation checkpointing runs each layer's forward under no_grad and recomputes
    it with grad in backward, RNG restored: with dropout on, the loss and every gradient must be
    those of the same model without checkpointing (same masks in all three passes)."""
    transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it
    from tempo.integrations.patch import apply_tempo

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    ids = torch.randint(3, 100, (3, 10))
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = apply_tempo(transformers.BertForMaskedLM(config)).train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        torch.manual_seed(1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain_loss, plain), (ckpt_loss, ckpt) = results
    torch.testing.assert_close(ckpt_loss, plain_loss, rtol=1e-5, atol=1e-6)
    assert ckpt.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)
