"""efficient_attention_varlen: packed sequences [T, H, D] attend inside their own sequence only.

Checked against efficient_attention on each sequence (same arithmetic, so same values and
gradients), against fp64, with dropout drawn per sequence from the seed, what it keeps (exact
bytes), the stock path without a backward, and the CUDA dispatch on a simulated H100.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

from tempo.ops import attention as attn_mod
from tempo.ops.attention import attention_keep_mask, efficient_attention, efficient_attention_varlen

from test_attention_dispatch import CUDNN, EFFICIENT, FLASH, MATH, h100  # noqa: F401  (fixture)

LENGTHS = [5, 1, 130, 0, 64]  # a one-token sequence, one longer than a 128 tile, an empty one


def packed(lengths, h=2, d=16, dtype=torch.float32, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype).requires_grad_(grad) for _ in range(3))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return q, k, v, cu


def per_sequence(fn, q, k, v, cu):
    """Run ``fn`` on each sequence as a [1, H, L, D] batch; stitch the outputs back to [T, H, D]."""
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            seq = [x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            outs.append(fn(*seq)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_equals_efficient_attention_on_each_sequence(dtype):
    q, k, v, cu = packed(LENGTHS, dtype=dtype)
    out = efficient_attention_varlen(q, k, v, cu, max(LENGTHS))
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    ref = per_sequence(lambda *s: efficient_attention(*s), q, k, v, cu)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in (("out", out, ref), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_causal_equals_causal_attention_on_each_sequence():
    q, k, v, cu = packed(LENGTHS)
    out = efficient_attention_varlen(q, k, v, cu, max(LENGTHS), is_causal=True)
    ref = per_sequence(lambda *s: efficient_attention(*s, is_causal=True), q, k, v, cu)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():  # the stock path, causal too
        torch.testing.assert_close(efficient_attention_varlen(q, k, v, cu, max(LENGTHS), is_causal=True), out,
                                   rtol=1e-5, atol=1e-6)


def test_close_to_fp64_attention_with_padding_mask():
    """The padded batch with a key-padding mask, in fp64 eager arithmetic, is the truth."""
    lengths = [7, 3, 12]
    q, k, v, cu = packed(lengths, h=3, d=8)
    out = efficient_attention_varlen(q, k, v, cu, 12)
    grad = torch.randn_like(out)
    dq = torch.autograd.grad(out, q, grad)[0]
    for (a, b) in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x.detach()[a:b].double().transpose(0, 1).requires_grad_() for x in (q, k, v))
        o64 = torch.softmax(qs @ ks.transpose(-1, -2) / 8 ** 0.5, -1) @ vs
        torch.testing.assert_close(out[a:b].double(), o64.transpose(0, 1), rtol=1e-5, atol=1e-6)
        g64 = torch.autograd.grad(o64, qs, grad[a:b].double().transpose(0, 1))[0]
        torch.testing.assert_close(dq[a:b].double(), g64.transpose(0, 1), rtol=1e-4, atol=1e-5)


def test_dropout_draws_one_independent_stream_per_sequence():
    lengths, p = [9, 140], 0.5
    q, k, v, cu = packed(lengths)
    seed = torch.tensor(1234)
    out = efficient_attention_varlen(q, k, v, cu, 140, dropout_p=p, seed=seed)
    # Sequence i is efficient_attention with seed _sequence_seed(1234, i): same mask, same values.
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        s_seed = torch.tensor(attn_mod._sequence_seed(1234, i))
        seq = [x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        ref = efficient_attention(*seq, dropout_p=p, seed=s_seed)[0].transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref, rtol=0, atol=0)
        keep = attention_keep_mask(s_seed, (1, 2, b - a, b - a), p)
        assert 0.4 < keep.float().mean() < 0.6
    # Same seed, same result; and the two sequences' streams differ.
    again = efficient_attention_varlen(q, k, v, cu, 140, dropout_p=p, seed=seed)
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    assert attn_mod._sequence_seed(1234, 0) != attn_mod._sequence_seed(1234, 1)
    # Eval (training=False): no dropout at all.
    no_drop = efficient_attention_varlen(q, k, v, cu, 140, dropout_p=p, training=False)
    torch.testing.assert_close(no_drop, efficient_attention_varlen(q, k, v, cu, 140), rtol=0, atol=0)


def test_gradcheck_with_dropout_fp64():
    q, k, v, cu = packed([3, 4], h=1, d=4, dtype=torch.float64)
    seed = torch.tensor(7)
    assert torch.autograd.gradcheck(
        lambda q, k, v: efficient_attention_varlen(q, k, v, cu, 4, dropout_p=0.3, seed=seed), (q, k, v))


def test_keeps_q_k_v_out_two_stats_per_row_offsets_and_seed():
    lengths = [5, 11]
    q, k, v, cu = packed(lengths, h=2, d=16)
    x = torch.randn(sum(lengths), 2, 16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        efficient_attention_varlen(x * 1.0, x * 2.0, x * 3.0, cu, 11)
    # x * c saves nothing of size (a scalar product keeps the python scalar), so every saved
    # tensor is the op's: q, k, v, out (16 tokens x 2 heads x 16 x 4 B each), stats (16 x 2 x 2 x 4 B),
    # cu_seqlens (3 x 4 B), the 0-d int64 seed.
    nbytes = sorted(t.numel() * t.element_size() for t in saved)
    t = sum(lengths)
    assert nbytes == sorted([t * 2 * 16 * 4] * 4 + [t * 2 * 2 * 4, 3 * 4, 8])


def test_no_backward_runs_stock_sdpa_per_sequence_and_agrees(monkeypatch):
    q, k, v, cu = packed(LENGTHS, grad=False)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        out = efficient_attention_varlen(q, k, v, cu, 130)
    assert len(calls) == 4  # one per non-empty sequence
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    ref = efficient_attention_varlen(q.requires_grad_(), k, v, cu, 130)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)


def test_autocast_runs_in_the_autocast_dtype():
    q, k, v, cu = packed([4, 6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = efficient_attention_varlen(q, k, v, cu, 6)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32


def test_bad_arguments_are_named():
    q, k, v, cu = packed([2, 3])
    with pytest.raises(ValueError, match="'q' must be 3-D"):
        efficient_attention_varlen(q[None], k, v, cu, 3)
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        efficient_attention_varlen(q, k, v, cu.float(), 3)
    with pytest.raises(TypeError, match="'max_seqlen'"):
        efficient_attention_varlen(q, k, v, cu, 3.0)
    with pytest.raises(ValueError, match="dropout_p"):
        efficient_attention_varlen(q, k, v, cu, 3, dropout_p=1.5)


def test_opcheck():
    q, k, v, cu = packed([3, 5], h=2, d=8)
    opcheck(torch.ops.tempo.efficient_attention_varlen_fwd.default,
            (q, k, v, cu, torch.tensor(3), 0.25, True, 0.3))


def test_compiles_with_a_dynamic_token_count():
    q, k, v, cu = packed([3, 5], h=2, d=8)
    fn = torch.compile(lambda q, k, v, cu: efficient_attention_varlen(q, k, v, cu, 5), backend="aot_eager",
                       dynamic=True)
    out = fn(q, k, v, cu)
    torch.testing.assert_close(out, efficient_attention_varlen(q, k, v, cu, 5), rtol=0, atol=0)
    out.sum().backward()
    assert q.grad is not None


# ------------------------------------------------------------------------------------------------
# CUDA dispatch, simulated H100 (see test_attention_dispatch.py)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_runs_nested_jagged_sdpa_flash_then_efficient_never_cudnn_or_math(h100, dtype):
    q, k, v, cu = packed([3, 9, 4], h=2, d=64, dtype=dtype)
    out = efficient_attention_varlen(q, k, v, cu, 9, dropout_p=0.0)
    (call,) = h100.calls
    assert call["enabled"] == [FLASH, EFFICIENT]
    assert call["chosen"] == FLASH and call["mask"] is None
    assert out.shape == (16, 2, 64)
    ref = efficient_attention_varlen(q.detach(), k.detach(), v.detach(), cu, 9)  # no backward: stock + math
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-3)


def test_cuda_no_backward_offers_math_last(h100):
    q, k, v, cu = packed([3, 9], h=2, d=64, dtype=torch.float16, grad=False)
    efficient_attention_varlen(q, k, v, cu, 9)
    assert h100.calls[0]["enabled"] == [FLASH, EFFICIENT, MATH]


def test_cuda_disabled_backends_stay_off_and_nothing_left_runs_the_reference_op(h100, caplog):
    q, k, v, cu = packed([3, 9], h=2, d=64, dtype=torch.float16)
    try:
        torch.backends.cuda.enable_flash_sdp(False)
        efficient_attention_varlen(q, k, v, cu, 9)
        assert h100.calls[-1]["enabled"] == [EFFICIENT]
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        n = len(h100.calls)
        with caplog.at_level("WARNING", logger="tempo"):
            out = efficient_attention_varlen(q, k, v, cu, 9)
        assert len(h100.calls) == n  # the reference op, not sdpa
        assert any("variable length" in r.getMessage() for r in caplog.records)
        out.float().sum().backward()
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
    assert CUDNN not in h100.calls[-1]["enabled"]
