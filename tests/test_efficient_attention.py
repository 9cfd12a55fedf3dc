"""efficient_attention against an fp64 eager reference built in this file.

The reference is softmax(q kᵀ·scale + mask) · keep/(1−p) @ v in fp64 with the very keep-mask the
op drew (``attention_keep_mask`` regenerates it from the seed), so outputs and all gradients are
compared element by element, dropout included. On the CPU every backend runs the tiled reference
path (the op has no Triton kernel); the CUDA tests at the end cover the fused sdpa path.
"""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tempo.memory import ActivationLedger
from tempo.ops import attention as attn_mod
from tempo.ops.attention import (
    BLOCK_K,
    BLOCK_Q,
    EfficientAttention,
    attention_keep_mask,
    efficient_attention,
)

# (atol, rtol) against fp64 for values of order 1. Measured worst errors relative to the tensor's
# max: fp32 ~1.5e-6, fp16 ~4e-4, bf16 ~3.3e-3 (the output is rounded once to the input dtype, and
# backward's D = rowsum(dO·O) reads that rounded output, as FlashAttention does).
TOL = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 5e-3),
    torch.bfloat16: (1.5e-2, 3e-2),
}
LOW = [torch.float32, torch.bfloat16, torch.float16]


def _reference(q, k, v, g, mask=None, keep=None, p=0.0, scale=None, is_causal=False):
    """fp64 eager (out, dq, dk, dv[, dmask]); rows with every key masked give 0, not NaN."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q64 @ k64.transpose(-1, -2) * scale
    m64 = None
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            m64 = mask.detach().double().requires_grad_(mask.requires_grad)
            s = s + m64
    if is_causal:
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        s = s.masked_fill(~allowed, float("-inf"))
    empty = (s == float("-inf")).all(dim=-1, keepdim=True)
    probs = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if keep is not None:
        probs = probs * keep / (1.0 - p)
    out = probs @ v64
    out.backward(g.double())
    grads = [q64.grad, k64.grad, v64.grad] + ([m64.grad] if m64 is not None and m64.requires_grad else [])
    return (out.detach(), *grads)


def _run(q, k, v, g, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = efficient_attention(q, k, v, **kw)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


def _close(actual, expected, dtype, what):
    atol, rtol = TOL[dtype]
    assert actual.dtype == dtype, what
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _qkv(b, h, s_q, s_k, d, dtype, d_v=None):
    q = torch.randn(b, h, s_q, d).to(dtype)
    k = torch.randn(b, h, s_k, d).to(dtype)
    v = torch.randn(b, h, s_k, d_v or d).to(dtype)
    return q, k, v


def _leaves(*tensors):
    """Inputs that require grad: the Tempo op runs (without a backward the stock sdpa does)."""
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def _compare(q, k, v, dtype, p=0.0, seed=1234, mask=None, scale=None, is_causal=False):
    g = torch.randn(q.shape[:3] + (v.shape[-1],)).to(dtype)
    seed_t = torch.tensor(seed)
    got = _run(q, k, v, g, attn_mask=mask, dropout_p=p, scale=scale, is_causal=is_causal, seed=seed_t)
    keep = attention_keep_mask(seed_t, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), p) if p else None
    ref = _reference(q, k, v, g, mask, keep, p, scale, is_causal)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        _close(a, r, dtype, name)
    return got


# ------------------------------------------------------------------------------------------------
# Values and gradients
# ------------------------------------------------------------------------------------------------
SHAPES = [  # (b, h, s_q, s_k, d): s in {1, 7, 123, 300}, several tiles each way, s_q != s_k
    (1, 2, 1, 1, 32),
    (2, 3, 7, 7, 64),
    (1, 2, 123, 300, 80),
    (1, 2, 300, 123, 128),
    (2, 1, 300, 7, 64),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_matches_fp64_reference(shape, dtype, p):
    b, h, s_q, s_k, d = shape
    _compare(*_qkv(b, h, s_q, s_k, d, dtype), dtype, p=p)


def test_fp64_gradcheck_with_dropout_and_mask():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 5, 6, 4, torch.float64))
    mask = torch.randn(1, 1, 5, 6, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor(7)

    def fn(q, k, v, mask):
        return efficient_attention(q, k, v, attn_mask=mask, dropout_p=0.4, seed=seed)

    assert torch.autograd.gradcheck(fn, (q, k, v, mask))


def test_value_head_dim_may_differ():
    q, k, v = _qkv(2, 2, 9, 11, 16, torch.float32, d_v=24)
    out, *_ = _compare(q, k, v, torch.float32, p=0.2)
    assert out.shape == (2, 2, 9, 24)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_key_padding_mask(dtype, kind):
    b, h, s, d = 3, 2, 130, 32  # two key tiles: padding in the second one only for some samples
    lengths = torch.tensor([130, 100, 5])
    valid = torch.arange(s)[None, :] < lengths[:, None]
    if kind == "bool":
        mask = valid[:, None, None, :]
    else:  # as BERT builds it: finfo.min of the compute dtype where padded
        mask = torch.zeros(b, 1, 1, s, dtype=dtype).masked_fill(~valid[:, None, None, :], torch.finfo(dtype).min)
    q, k, v = _qkv(b, h, s, s, d, dtype)
    _, _, dk, dv = _compare(q, k, v, dtype, p=0.1, mask=mask)
    # Padded keys get no gradient at all.
    assert (dk[~valid[:, None, :, None].expand_as(dk)] == 0).all()
    assert (dv[~valid[:, None, :, None].expand_as(dv)] == 0).all()


@pytest.mark.parametrize("mask_shape", [(3, 2, 9, 140), (1, 2, 9, 140), (9, 140), (140,), (3, 1, 9, 1)])
def test_general_masks_broadcast(mask_shape):
    q, k, v = _qkv(3, 2, 9, 140, 16, torch.float32)
    bool_mask = torch.rand(mask_shape) > 0.3
    _compare(q, k, v, torch.float32, p=0.2, mask=bool_mask)
    _compare(q, k, v, torch.float32, p=0.2, mask=torch.randn(mask_shape))


@pytest.mark.parametrize("mask_shape", [(2, 1, 9, 140), (1, 1, 1, 140), (2, 3, 9, 140)])
def test_additive_mask_gradient(mask_shape):
    q, k, v = _qkv(2, 3, 9, 140, 16, torch.float32)
    mask = torch.randn(mask_shape, requires_grad=True)
    g = torch.randn(2, 3, 9, 16)
    seed = torch.tensor(5)
    efficient_attention(q, k, v, attn_mask=mask, dropout_p=0.25, seed=seed).backward(g)
    keep = attention_keep_mask(seed, (2, 3, 9, 140), 0.25)
    *_, ref_dmask = _reference(q, k, v, g, mask, keep, 0.25)
    assert mask.grad.shape == mask.shape
    _close(mask.grad, ref_dmask, torch.float32, "dmask")


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_fully_masked_rows_give_zeros_and_zero_grads(dtype):
    b, h, s_q, s_k, d = 2, 2, 7, 135, 32
    q, k, v = _qkv(b, h, s_q, s_k, d, dtype)
    mask = torch.rand(b, 1, s_q, s_k) > 0.5
    mask[0, 0, 3] = False  # one query row masked everywhere
    mask[1] = False  # a whole sample padded (key-padding style: every row masked)
    out, dq, dk, dv = _compare(q, k, v, dtype, p=0.3, mask=mask)
    for t in (out, dq, dk, dv):
        assert not t.isnan().any()
    assert (out[0, :, 3] == 0).all() and (dq[0, :, 3] == 0).all()
    assert (out[1] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    # The same with an additive -inf mask.
    additive = torch.zeros(b, 1, s_q, s_k, dtype=dtype).masked_fill(~mask, float("-inf"))
    out2, dq2, _, _ = _compare(q, k, v, dtype, p=0.3, mask=additive)
    assert (out2[0, :, 3] == 0).all() and (dq2[1] == 0).all() and not out2.isnan().any()


def test_finfo_min_row_attends_uniformly_like_sdpa():
    """finfo.min is a number, not -inf: a row masked only by it attends uniformly, as in sdpa."""
    q, k, v = _leaves(*_qkv(1, 2, 4, 9, 8, torch.float32))
    mask = torch.zeros(1, 1, 4, 9)
    mask[0, 0, 2] = torch.finfo(torch.float32).min
    out = efficient_attention(q, k, v, attn_mask=mask).detach()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask).detach())
    torch.testing.assert_close(out[0, :, 2], v[0].detach().mean(dim=1))


@pytest.mark.parametrize("s_q,s_k", [(7, 7), (300, 300), (123, 300), (300, 123)])
def test_causal(s_q, s_k):
    q, k, v = _qkv(1, 2, s_q, s_k, 32, torch.float32)
    out, *_ = _compare(q, k, v, torch.float32, p=0.2, is_causal=True)
    no_drop = efficient_attention(*_leaves(q, k, v), is_causal=True).detach()
    torch.testing.assert_close(no_drop, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               atol=2e-5, rtol=1e-4)


def test_scale():
    q, k, v = _qkv(2, 2, 130, 70, 64, torch.float32)
    _compare(q, k, v, torch.float32, p=0.1, scale=0.37)
    torch.testing.assert_close(efficient_attention(*_leaves(q, k, v), scale=0.37).detach(),
                               F.scaled_dot_product_attention(q, k, v, scale=0.37), atol=2e-5, rtol=1e-4)


def test_matches_sdpa_without_dropout():
    q, k, v = _qkv(2, 3, 140, 140, 64, torch.float32)
    mask = torch.zeros(2, 1, 1, 140).masked_fill(torch.arange(140) >= 120, torch.finfo(torch.float32).min)
    torch.testing.assert_close(
        efficient_attention(*_leaves(q, k, v), attn_mask=mask, dropout_p=0.5, training=False).detach(),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=2e-5, rtol=1e-4)


def test_non_contiguous_inputs_and_grad_layout():
    b, s, h, d = 2, 130, 3, 32
    # As the model builds them: (b, s, h, d) projections viewed as (b, h, s, d); q sliced from a
    # wider buffer (a fused qkv projection) so it is not dense either.
    qkv = torch.randn(b, s, 3, h, d)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    got = _compare(q, k, v, torch.float32, p=0.3)
    dense_k = torch.randn(b, s, h, d).transpose(1, 2).requires_grad_()
    efficient_attention(q, dense_k, v).sum().backward()
    assert dense_k.grad.stride() == dense_k.stride()  # gradients come back in the input's layout
    assert got[1].shape == q.shape


# ------------------------------------------------------------------------------------------------
# Dropout
# ------------------------------------------------------------------------------------------------
def test_keep_mask_statistics():
    p = 0.3
    shape = (4, 4, 300, 300)  # 9 tiles of (4, 4, <=128, <=128)
    keep = attention_keep_mask(torch.tensor(11), shape, p)
    n = keep.numel()
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n)
    other = attention_keep_mask(torch.tensor(12), shape, p)
    assert (keep != other).float().mean().item() > 0.3  # independent masks differ in ~42% of places
    assert torch.equal(keep, attention_keep_mask(torch.tensor(11), shape, p))  # a pure function of the seed
    # No repeated structure across batch, heads, rows or tiles.
    assert not torch.equal(keep[0, 0], keep[1, 0]) and not torch.equal(keep[0, 0], keep[0, 1])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    assert not torch.equal(keep[0, 0, :128, :128], keep[0, 0, :128, 128:256])
    assert not torch.equal(keep[0, 0, :128, :128], keep[0, 0, 128:256, :128])
    # Each tile alone keeps at the right rate too (a bad tile seed would show up here).
    for r in range(0, 300, BLOCK_Q):
        for c in range(0, 300, BLOCK_K):
            tile = keep[:, :, r:r + BLOCK_Q, c:c + BLOCK_K]
            assert abs(tile.float().mean().item() - (1 - p)) < 6 * math.sqrt(p * (1 - p) / tile.numel())


def _correlation(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


def _worst_stream_correlation(seed=1234, p=0.5):
    """Largest |correlation| between keep masks that must be independent: tiles (i, j) and
    (j, i), tiles sharing a row or a column of tiles, heads, batches, neighbouring seeds."""
    shape = (2, 2, 2 * BLOCK_Q, 2 * BLOCK_K)  # 2 x 2 tiles of (2, 2, 128, 128)
    keep = attention_keep_mask(torch.tensor(seed), shape, p)
    tile = {(i, j): keep[:, :, i * BLOCK_Q:(i + 1) * BLOCK_Q, j * BLOCK_K:(j + 1) * BLOCK_K]
            for i in range(2) for j in range(2)}
    pairs = [(tile[0, 1], tile[1, 0]), (tile[0, 0], tile[1, 1]), (tile[0, 1], tile[1, 1]),
             (tile[1, 0], tile[1, 1]), (tile[0, 0], tile[0, 1]), (tile[0, 0], tile[1, 0]),
             (keep[:, 0], keep[:, 1]), (keep[0], keep[1])]
    for next_seed in (seed + 1, seed + 2, seed ^ (1 << 31)):
        pairs.append((keep, attention_keep_mask(torch.tensor(next_seed), shape, p)))
    return max(abs(_correlation(a, b)) for a, b in pairs), min(a.numel() for a, _ in pairs)


def test_dropout_tiles_heads_batches_and_seeds_are_independent():
    worst, n = _worst_stream_correlation()
    assert worst < 5 / math.sqrt(n), worst  # 5 sigma of a correlation of n independent pairs


_REAL_TILE_SEED = attn_mod._tile_seed
_REAL_UNIFORM_TILE = attn_mod._uniform_tile
STREAM_MUTANTS = {
    "symmetric in (i, j)": ("_tile_seed", lambda seed, qi, ki: _REAL_TILE_SEED(seed, min(qi, ki), max(qi, ki))),
    "ignores the query tile": ("_tile_seed", lambda seed, qi, ki: _REAL_TILE_SEED(seed, 0, ki)),
    "ignores the key tile": ("_tile_seed", lambda seed, qi, ki: _REAL_TILE_SEED(seed, qi, 0)),
    "ignores the seed's low bit": ("_tile_seed", lambda seed, qi, ki: _REAL_TILE_SEED(seed >> 1, qi, ki)),
    "one tile for every head": ("_uniform_tile", lambda gen, seed, qi, ki, shape, device: _REAL_UNIFORM_TILE(
        gen, seed, qi, ki, (1, 1) + tuple(shape[2:]), device).expand(shape)),
}


@pytest.mark.parametrize("mutant", list(STREAM_MUTANTS))
def test_the_independence_check_catches_a_broken_stream(monkeypatch, mutant):
    """The check above fails for each way the tile streams could collide."""
    name, fn = STREAM_MUTANTS[mutant]
    monkeypatch.setattr(attn_mod, name, fn)
    worst, _ = _worst_stream_correlation()
    assert worst > 0.99, (mutant, worst)


def test_forward_applies_exactly_the_regenerated_mask():
    """q = 0 makes the softmax uniform; v = I then reads the applied mask off the output."""
    b, h, s = 2, 3, 140
    p = 0.4
    q = torch.zeros(b, h, s, 8, dtype=torch.float64)
    k = torch.randn(b, h, s, 8, dtype=torch.float64)
    v = torch.eye(s, dtype=torch.float64).expand(b, h, s, s)
    seed = torch.tensor(99)
    out = efficient_attention(q, k, v, dropout_p=p, seed=seed)
    keep = attention_keep_mask(seed, (b, h, s, s), p)
    torch.testing.assert_close(out, keep.double() / ((1 - p) * s), atol=1e-14, rtol=0)


def test_default_seed_follows_torch_rng_and_training_flag():
    q, k, v = _leaves(*_qkv(2, 2, 20, 20, 16, torch.float32))
    torch.manual_seed(3)
    a = efficient_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    b = efficient_attention(q, k, v, dropout_p=0.5)
    c = efficient_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    no_drop = efficient_attention(q, k, v)
    assert torch.equal(efficient_attention(q, k, v, dropout_p=0.5, training=False), no_drop)
    module = EfficientAttention(dropout_p=0.5)
    assert not torch.equal(module(q, k, v), no_drop)
    assert torch.equal(module.eval()(q, k, v), no_drop)


def test_checkpoint_reproduces_dropout():
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 130, 130, 16, torch.float32))
    g = torch.randn(2, 2, 130, 16)

    def fn(q, k, v):
        return efficient_attention(q, k, v, dropout_p=0.3) * 2.0

    torch.manual_seed(21)
    fn(q, k, v).backward(g)
    plain = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(21)
    checkpoint(fn, q, k, v, use_reentrant=False).backward(g)
    for a, b in zip(plain, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Memory and layout
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("with_mask", [False, True])
def test_saved_bytes_exact(dtype, p, with_mask):
    b, h, s, d = 2, 3, 200, 16
    q, k, v = (t.requires_grad_() for t in _qkv(b, h, s, s, d, dtype))
    mask = torch.zeros(b, 1, 1, s, dtype=dtype) if with_mask else None
    with ActivationLedger() as led:
        out = efficient_attention(q, k, v, attn_mask=mask, dropout_p=p)
    esize = q.element_size()
    # q, k, v, out; per row the fp32 max and log-sum (8 bytes); the int64 seed
    expected = 4 * b * h * s * d * esize + 8 * b * h * s + 8
    if with_mask:
        expected += mask.numel() * esize
        ptrs = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: ptrs.append(t.data_ptr()) or t, lambda t: t):
            efficient_attention(q, k, v, attn_mask=mask, dropout_p=p)
        assert mask.data_ptr() in ptrs  # the caller's mask itself, not a copy
    assert led.activation_bytes == expected
    assert len(led.records) == 6 + with_mask
    assert all(math.prod(r.shape) < s * s for r in led.records)  # nothing of size s×s per (b, h)
    out.sum().backward()


def test_saved_row_stats_are_fp64_for_fp64_inputs():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 10, 10, 4, torch.float64))
    with ActivationLedger() as led:
        efficient_attention(q, k, v)
    assert led.activation_bytes == 4 * 1 * 2 * 10 * 4 * 8 + 2 * 8 * 1 * 2 * 10 + 8


def test_output_layout_merges_heads_as_a_view():
    """With a backward to keep for, the output is stored (b, s, h, d). (Without one the stock sdpa
    runs and its layout is sdpa's: see test_no_backward_runs_stock_sdpa.)"""
    b, h, s, d = 2, 4, 9, 16
    q, k, v = (t.requires_grad_() for t in _qkv(b, h, s, s, d, torch.float32))
    out = efficient_attention(q, k, v, dropout_p=0.1)
    assert out.shape == (b, h, s, d) and not out.is_contiguous()
    assert out.transpose(1, 2).is_contiguous()
    merged = out.transpose(1, 2).reshape(b, s, h * d)
    assert merged._is_view() and merged.data_ptr() == out.data_ptr()


# ------------------------------------------------------------------------------------------------
# Autocast, torch.library and torch.compile
# ------------------------------------------------------------------------------------------------
def test_autocast_bf16_follows_sdpa():
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 20, 20, 16, torch.float32))
    mask = torch.zeros(2, 1, 1, 20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = efficient_attention(q, k, v, attn_mask=mask)
        expected_dtype = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).dtype
    assert out.dtype == expected_dtype == torch.bfloat16
    ref = _reference(*(t.detach().to(torch.bfloat16) for t in (q, k, v)), torch.ones(2, 2, 20, 16), mask)[0]
    _close(out.detach(), ref, torch.bfloat16, "out")
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and q.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------
# attn_bias: a batch-shared learned bias beside a per-sample padding mask (MPNet)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("s", [9, 150], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_attn_bias_and_padding_mask_outputs_and_every_gradient(dtype, s, p):
    """scores = scale·q·kᵀ + bias + mask with a [1, h, s, s] bias that requires grad and a bool
    [b, 1, 1, s] padding mask: output, dq, dk, dv and the bias's gradient (summed over the batch)
    against fp64 eager, dropout included (the very mask the op drew)."""
    torch.manual_seed(0)
    b, h, d = 3, 2, 16
    q, k, v = _qkv(b, h, s, s, d, dtype)
    bias = (torch.randn(1, h, s, s) * 3).requires_grad_()
    valid = torch.ones(b, 1, 1, s, dtype=torch.bool)
    valid[1, ..., s // 3:] = False
    g = torch.randn(b, h, s, d).to(dtype)
    seed = torch.tensor(11)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = efficient_attention(*leaves, attn_mask=valid, dropout_p=p, seed=seed, attn_bias=bias)
    out.backward(g)
    keep = attention_keep_mask(seed, (b, h, s, s), p) if p else None
    b64 = bias.detach().double().requires_grad_()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.transpose(-1, -2) / math.sqrt(d) + b64).masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, -1)
    want = (probs * keep / (1 - p) if p else probs) @ v64
    want.backward(g.double())
    _close(out.detach(), want.detach(), dtype, "out")
    for got, exp, what in zip([t.grad for t in leaves], (q64.grad, k64.grad, v64.grad), ("dq", "dk", "dv")):
        _close(got, exp, dtype, what)
    # dbias (fp32, the bias's dtype) sums b·s score gradients: compared relative to its size, to the
    # inputs' dtype's tolerance (D = rowsum(dO·O) reads the output rounded to that dtype).
    assert bias.grad.dtype == torch.float32
    atol, rtol = TOL[dtype]
    size = b64.grad.abs().max()
    torch.testing.assert_close(bias.grad.double() / size, b64.grad / size, atol=atol, rtol=rtol)


def test_attn_bias_keeps_one_copy_and_no_batch_sized_tensor():
    """What autograd keeps: q, k, v, the output, the stats, the seed, the [b, 1, 1, s] mask and the
    [1, h, s, s] bias as given: nothing of size b·h·s·s."""
    b, h, s, d = 4, 2, 32, 8
    q, k, v = (t.requires_grad_() for t in _qkv(b, h, s, s, d, torch.float32))
    bias = torch.randn(1, h, s, s, requires_grad=True)
    valid = torch.ones(b, 1, 1, s, dtype=torch.bool)
    with ActivationLedger() as ledger:
        efficient_attention(q, k, v, attn_mask=valid, attn_bias=bias, dropout_p=0.1)
    assert ledger.activation_bytes == 4 * (4 * b * h * s * d + 2 * b * h * s + h * s * s) + b * s + 8


@pytest.mark.parametrize("case,exc,words", [
    ("int", TypeError, ["'attn_bias'", "floating-point"]),
    ("shape", ValueError, ["'attn_bias'", "(1, 3, 5, 7)", "(2, 3, 5, 6)"]),
    ("causal", ValueError, ["'attn_bias'", "'is_causal'"]),
])
def test_bad_attn_bias_names_the_argument(case, exc, words):
    q, k, v = _qkv(2, 3, 5, 6, 8, torch.float32)
    kw = {"int": dict(attn_bias=torch.zeros(1, 3, 5, 6, dtype=torch.int64)),
          "shape": dict(attn_bias=torch.zeros(1, 3, 5, 7)),
          "causal": dict(attn_bias=torch.zeros(1, 3, 5, 6), is_causal=True)}[case]
    with pytest.raises(exc) as info:
        efficient_attention(q, k, v, **kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_opcheck_custom_ops():
    q, k, v = _qkv(2, 2, 9, 11, 8, torch.float32)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    seed = torch.tensor(4)
    mask = torch.randn(2, 1, 1, 11)
    fwd = torch.ops.tempo.efficient_attention_fwd.default
    bwd = torch.ops.tempo.efficient_attention_bwd.default
    torch.library.opcheck(fwd, (q, k, v, None, seed, 0.0, False, 0.3))
    torch.library.opcheck(fwd, (q, k, v, mask, seed, 0.2, False, 0.3))
    out, stats = fwd(q.detach(), k.detach(), v.detach(), mask, seed, 0.2, False, 0.3)
    g = torch.randn_like(out)
    qkv = (q.detach(), k.detach(), v.detach())
    torch.library.opcheck(bwd, (g, *qkv, out, stats, mask, seed, 0.2, False, 0.3, True))
    torch.library.opcheck(bwd, (g, *qkv, out, stats, None, seed, 0.0, True, 0.3, False))
    bias = torch.randn(1, 2, 9, 11, requires_grad=True)
    torch.library.opcheck(fwd, (q, k, v, mask, seed, 0.2, False, 0.3, bias))
    out, stats = fwd(*qkv, mask, seed, 0.2, False, 0.3, bias.detach())
    torch.library.opcheck(bwd, (g, *qkv, out, stats, mask, seed, 0.2, False, 0.3, False, bias.detach(), True))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = _qkv(2, 2, 10, 12, 8, torch.float32)
    mask = torch.rand(2, 1, 1, 12) > 0.2
    seed = torch.tensor(17)

    def fn(q, k, v):
        out = efficient_attention(q, k, v, attn_mask=mask, dropout_p=0.2, seed=seed)
        return out.transpose(1, 2).reshape(2, 10, 16)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = compiled(*leaves)
    ref = fn(*eager_leaves)
    torch.testing.assert_close(got, ref)
    got.sum().backward()
    ref.sum().backward()
    for a, b in zip(leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad)


# ------------------------------------------------------------------------------------------------
# Backends and errors
# ------------------------------------------------------------------------------------------------
def test_every_backend_runs(backend, device):
    """No Triton kernel: 'triton' forced means the reference path on the CPU, sdpa on CUDA."""
    from tempo.ops._backend import use_backend

    q, k, v = _leaves(*(t.to(device) for t in _qkv(1, 2, 9, 9, 16, torch.float32)))
    if device == "cpu":
        seed = torch.tensor(8)
        out = efficient_attention(q, k, v, dropout_p=0.2, seed=seed)
        with use_backend("reference"):
            assert torch.equal(out, efficient_attention(q, k, v, dropout_p=0.2, seed=seed))
    else:
        out = efficient_attention(q, k, v)
        assert _sdpa_kernel_of(out) == "efficient"  # fp32: flash takes 16-bit only
        with use_backend("reference"):
            ref = efficient_attention(q, k, v)
        assert _sdpa_kernel_of(ref) is None
        torch.testing.assert_close(out, ref)


def test_fallback_logged_once(caplog):
    attn_mod._logged_fallbacks.discard("test case")
    with caplog.at_level(logging.WARNING, logger="tempo"):
        attn_mod._log_fallback_once("test case")
        attn_mod._log_fallback_once("test case")
    records = [r for r in caplog.records if r.name == "tempo" and "test case" in r.getMessage()]
    assert len(records) == 1


def _good():
    return _qkv(2, 3, 5, 6, 8, torch.float32)


@pytest.mark.parametrize("case,exc,words", [
    ("q_3d", ValueError, ["'q'", "4-D"]),
    ("batch", ValueError, ["batch"]),
    ("heads", ValueError, ["heads"]),
    ("head_dim", ValueError, ["'q' and 'k'", "head dim"]),
    ("kv_len", ValueError, ["'k' and 'v'", "sequence length"]),
    ("dtype", TypeError, ["same dtype"]),
    ("int_q", TypeError, ["'q'", "floating-point"]),
    ("not_tensor", TypeError, ["'v'", "torch.Tensor"]),
    ("mask_shape", ValueError, ["'attn_mask'", "(2, 1, 1, 7)", "(2, 3, 5, 6)"]),
    ("mask_5d", ValueError, ["'attn_mask'"]),
    ("mask_int", TypeError, ["'attn_mask'"]),
    ("p_one", ValueError, ["'dropout_p'"]),
    ("p_negative", ValueError, ["'dropout_p'"]),
    ("p_str", TypeError, ["'dropout_p'"]),
    ("causal_and_mask", ValueError, ["'attn_mask'", "'is_causal'"]),
    ("scale_str", TypeError, ["'scale'"]),
    ("seed_float", TypeError, ["'seed'"]),
])
def test_bad_inputs_name_the_argument(case, exc, words):
    q, k, v = _good()
    kw = {}
    if case == "q_3d":
        q = q[0]
    elif case == "batch":
        k, v = k[:1], v[:1]
    elif case == "heads":
        q = q[:, :2]
    elif case == "head_dim":
        k = k[..., :4]
    elif case == "kv_len":
        v = v[:, :, :4]
    elif case == "dtype":
        v = v.double()
    elif case == "int_q":
        q = q.long()
    elif case == "not_tensor":
        v = v.tolist()
    elif case == "mask_shape":
        kw["attn_mask"] = torch.zeros(2, 1, 1, 7)
    elif case == "mask_5d":
        kw["attn_mask"] = torch.zeros(1, 2, 3, 5, 6)
    elif case == "mask_int":
        kw["attn_mask"] = torch.zeros(2, 1, 1, 6, dtype=torch.int64)
    elif case == "p_one":
        kw["dropout_p"] = 1.0
    elif case == "p_negative":
        kw["dropout_p"] = -0.1
    elif case == "p_str":
        kw["dropout_p"] = "0.1"
    elif case == "causal_and_mask":
        kw.update(attn_mask=torch.ones(2, 1, 1, 6, dtype=torch.bool), is_causal=True)
    elif case == "scale_str":
        kw["scale"] = "0.1"
    elif case == "seed_float":
        kw.update(seed=torch.tensor(1.5), dropout_p=0.1)
    with pytest.raises(exc) as info:
        efficient_attention(q, k, v, **kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


# ------------------------------------------------------------------------------------------------
# CUDA: the fused sdpa path. Marked gpu (the GPU suite selects -m gpu); skipped without a GPU.
# Expectations are those of torch 2.11 on an H100 (cuDNN 9.19, which torch would put first).
# ------------------------------------------------------------------------------------------------
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _sdpa_kernel_of(out):
    """'flash', 'efficient' or 'cudnn': the fused sdpa kernel whose backward is in ``out``'s graph;
    None for anything else (the reference op, the math backend)."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        name = fn.name()
        if "ScaledDotProduct" in name:
            for key, kernel in (("Flash", "flash"), ("Efficient", "efficient"), ("Cudnn", "cudnn")):
                if key in name:
                    return kernel
        todo.extend(f for f, _ in fn.next_functions)
    return None


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_mask", [False, True])
def test_cuda_fused_path(dtype, with_mask):
    """Flash without a mask, efficient with one (never cuDNN, though torch 2.11 would pick it
    first on an H100): both store the output as (b, s, h, d)."""
    b, h, s, d = 2, 4, 200, 64
    q, k, v = (t.cuda().requires_grad_() for t in _qkv(b, h, s, s, d, dtype))
    mask = None
    if with_mask:
        mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
        mask[1, ..., 150:] = False
    with ActivationLedger() as led:
        out = efficient_attention(q, k, v, attn_mask=mask)
    assert _sdpa_kernel_of(out) == ("efficient" if with_mask else "flash")
    assert all(math.prod(r.shape) < s * s for r in led.records)
    assert out.transpose(1, 2).is_contiguous()
    g = torch.randn_like(out)
    out.backward(g)
    ref = _reference(q.cpu(), k.cpu(), v.cpu(), g.cpu(), None if mask is None else mask.cpu())
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
        _close(a.cpu(), r, dtype, name)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("s", [64, 192, 320])
def test_cuda_fully_masked_rows_are_zero_not_nan(dtype, s):
    """A fully padded sample at s % 128 == 64: cuDNN (torch 2.11's first choice on an H100) gives
    NaN grad_q there (pytorch 196678); the efficient kernel we give masks to gives 0."""
    b, h, d = 2, 2, 64
    q, k, v = (t.cuda().requires_grad_() for t in _qkv(b, h, s, s, d, dtype))
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
    mask[1] = False  # the whole second sample is padding
    out = efficient_attention(q, k, v, attn_mask=mask)
    assert _sdpa_kernel_of(out) == "efficient"
    out.float().sum().backward()
    for t in (out, q.grad, k.grad, v.grad):
        assert not t.isnan().any()
    assert (out[1] == 0).all() and (q.grad[1] == 0).all()


def _adversarial_lse_inputs(s, dtype, kind):
    """Half the query rows score about -128 against every key (q ~ -4, k ~ +4, d = 64, scale 1/8),
    so their log-sum-exp is about -128 + ln(s) < -88.7; sample 1 pads its last quarter of keys and
    sample 0 has one fully masked query row."""
    b, h, d = 2, 2, 64
    q = torch.randn(b, h, s, d) * 0.5
    q[:, :, ::2] = -4.0 + 0.05 * torch.randn(b, h, (s + 1) // 2, d)
    k = 4.0 + 0.05 * torch.randn(b, h, s, d)
    v = torch.randn(b, h, s, d)
    allowed = torch.ones(b, 1, s, s, dtype=torch.bool)
    allowed[1, ..., 3 * s // 4:] = False
    allowed[0, 0, 5] = False
    mask = allowed if kind == "bool" else torch.zeros(b, 1, s, s).masked_fill(~allowed, float("-inf"))
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
    lse = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    finite = lse[torch.isfinite(lse)]
    assert finite.min() < -88.7 and torch.isinf(lse[0, :, 5]).all()  # the condition is really there
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("s", [64, 192, 320])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_cuda_log_sum_exp_below_fp32_exp_range(dtype, s, kind):
    """pytorch 196678's three conditions together (explicit mask, s % 128 == 64, rows whose
    log-sum-exp is below -88.7) plus a fully masked row: every gradient finite and equal to the
    fp64 reference."""
    q, k, v, mask = _adversarial_lse_inputs(s, dtype, kind)
    q, k, v = (t.cuda().requires_grad_() for t in (q, k, v))
    cuda_mask = mask.cuda() if kind == "bool" else mask.to("cuda", dtype)
    out = efficient_attention(q, k, v, attn_mask=cuda_mask)
    assert _sdpa_kernel_of(out) == "efficient"
    g = torch.randn_like(out)
    out.backward(g)
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    ref = _reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), g.cpu(),
                     mask if kind == "bool" else mask.to(dtype))
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
        # Scores of size 128 carry an absolute rounding error of 128 ulp in the dtype: compare
        # against the largest gradient entry.
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(a.cpu().double(), r, atol=atol * max(1.0, r.abs().max().item()), rtol=rtol,
                                   msg=lambda m: f"{name}: {m}")
    assert (out[0, :, 5] == 0).all() and (q.grad[0, :, 5] == 0).all()


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_finfo_min_rows_are_fully_masked(dtype):
    """A row masked only by finfo.min goes to the efficient kernel as -inf: output 0, gradient 0,
    every other row as with finfo.min (the kernel's fp32 log-sum-exp would absorb log s_k)."""
    b, h, s, d = 2, 2, 64, 64
    q, k, v = (t.cuda().requires_grad_() for t in _qkv(b, h, s, s, d, dtype))
    mask = torch.zeros(b, 1, s, s, device="cuda")
    mask[..., 50:] = torch.finfo(torch.float32).min
    mask[0, 0, 7] = torch.finfo(torch.float32).min
    out = efficient_attention(q, k, v, attn_mask=mask)
    assert _sdpa_kernel_of(out) == "efficient"
    g = torch.randn_like(out)
    out.backward(g)
    assert (out[0, :, 7] == 0).all() and (q.grad[0, :, 7] == 0).all()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    bool_mask = (mask > torch.finfo(torch.float32).min).cpu()  # the same rows as a bool mask
    ref = _reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), g.cpu(), bool_mask)
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
        _close(a.cpu(), r, dtype, name)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.3])
@pytest.mark.parametrize("with_mask", [False, True])
def test_cuda_attention_dropout_statistics(dtype, p, with_mask):
    """q = k = 0 makes every probability 1/s; v = I reads the dropped, rescaled probabilities off
    the output. Keep rate within 3 sigma of 1 - p and mean 1 after scaling by s: cuDNN's 1/16
    resolution would turn p = 0.1 into 0.0625 or 0.125 (40 sigma away here)."""
    b, h, s = 4, 4, 128
    q = torch.zeros(b, h, s, s, dtype=dtype, device="cuda", requires_grad=True)
    k = torch.zeros(b, h, s, s, dtype=dtype, device="cuda", requires_grad=True)
    v = torch.eye(s, dtype=dtype, device="cuda").repeat(b, h, 1, 1).requires_grad_()
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda") if with_mask else None
    out = efficient_attention(q, k, v, attn_mask=mask, dropout_p=p)
    assert _sdpa_kernel_of(out) == ("efficient" if with_mask else "flash")
    scaled = out.detach().double() * s  # keep / (1 - p) per entry
    kept = scaled != 0
    n = kept.numel()
    rate = kept.double().mean().item()
    assert abs(rate - (1 - p)) < 3 * math.sqrt(p * (1 - p) / n), (rate, 1 - p)
    # Mean 1: the kept value is 1/(1 - p) rounded to the dtype, so its rounding adds to 3 sigma.
    assert abs(scaled.mean().item() - 1.0) < 3 * math.sqrt(p / (1 - p) / n) + torch.finfo(dtype).eps, \
        scaled.mean().item()
    torch.testing.assert_close(scaled[kept], torch.full_like(scaled[kept], 1 / (1 - p)), atol=0,
                               rtol=2 * torch.finfo(dtype).eps)
    out.float().sum().backward()
    assert torch.isfinite(v.grad).all()


@pytest.mark.gpu
@cuda_only
def test_cuda_cudnn_runs_when_it_is_what_the_user_left():
    """Flash and efficient switched off by the user: cuDNN takes an unmasked call at p = 0, and
    p = 0.1 (not a multiple of 1/16) or a mask go to the reference op instead, logged once."""
    q, k, v = (t.cuda().requires_grad_() for t in _qkv(2, 2, 128, 128, 64, torch.bfloat16))
    flash, eff = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    try:
        out = efficient_attention(q, k, v)
        cap = torch.cuda.get_device_capability()
        cudnn_ok = cap >= (8, 0) and (torch.backends.cudnn.version() or 0) >= 90000
        assert _sdpa_kernel_of(out) == ("cudnn" if cudnn_ok else None)
        assert _sdpa_kernel_of(efficient_attention(q, k, v, dropout_p=0.1)) is None
        mask = torch.ones(2, 1, 1, 128, dtype=torch.bool, device="cuda")
        assert _sdpa_kernel_of(efficient_attention(q, k, v, attn_mask=mask)) is None
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)
        torch.backends.cuda.enable_mem_efficient_sdp(eff)
    g = torch.randn_like(out)
    out.backward(g)
    ref = _reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), g.cpu())
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
        _close(a.cpu(), r, torch.bfloat16, name)


@pytest.mark.gpu
@cuda_only
def test_cuda_switches_and_priority_order_untouched():
    from torch.nn.attention import _cur_sdpa_kernel_backends

    q, k, v = (t.cuda().requires_grad_() for t in _qkv(2, 2, 64, 64, 64, torch.bfloat16))
    efficient_attention(q, k, v)  # torch's lazy default priority is installed by now
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        flags, order = _cur_sdpa_kernel_backends(), torch._C._get_sdp_priority_order()
        efficient_attention(q, k, v)
        efficient_attention(q, k, v, attn_mask=torch.ones(2, 1, 1, 64, dtype=torch.bool, device="cuda"))
        assert _cur_sdpa_kernel_backends() == flags
        assert torch._C._get_sdp_priority_order() == order
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("with_mask", [False, True])
def test_cuda_no_backward_keeps_nothing_and_matches(with_mask):
    q, k, v = (t.cuda() for t in _qkv(2, 4, 130, 130, 64, torch.bfloat16))
    mask = torch.ones(2, 1, 1, 130, dtype=torch.bool, device="cuda") if with_mask else None
    if with_mask:
        mask[1, ..., 100:] = False
    with ActivationLedger() as led, torch.no_grad():
        stock = efficient_attention(*_leaves(q, k, v), attn_mask=mask)
    assert led.activation_bytes == 0
    trained = efficient_attention(*_leaves(q, k, v), attn_mask=mask)
    _close(stock.cpu(), trained.detach().cpu().double(), torch.bfloat16, "out")


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_cuda_compiled_matches_eager(dtype):
    """Compiled and eager take the same path: bf16 with a mask on the efficient kernel, fp64 (no
    fused kernel) on the reference op in both."""
    torch._dynamo.reset()
    q, k, v = (t.cuda() for t in _qkv(2, 2, 64, 64, 64, dtype))
    mask = torch.ones(2, 1, 1, 64, dtype=torch.bool, device="cuda")
    mask[1, ..., 40:] = False

    def fn(q, k, v):
        return efficient_attention(q, k, v, attn_mask=mask)

    eager = fn(*_leaves(q, k, v))
    compiled = torch.compile(fn, fullgraph=True)(*_leaves(q, k, v))
    torch.testing.assert_close(compiled, eager, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    compiled.sum().backward()
    torch._dynamo.reset()


@pytest.mark.gpu
@cuda_only
def test_cuda_fp64_falls_back_to_reference_and_logs_once(caplog):
    q, k, v = (t.cuda().requires_grad_() for t in _qkv(1, 2, 9, 9, 8, torch.float64))
    g = torch.randn(1, 2, 9, 8, dtype=torch.float64, device="cuda")
    attn_mod._logged_fallbacks.clear()
    with caplog.at_level(logging.WARNING, logger="tempo"):
        out = efficient_attention(q, k, v)
        efficient_attention(q, k, v)
    messages = [r.getMessage() for r in caplog.records if r.name == "tempo"]
    assert len(messages) == 1 and "torch.float64" in messages[0], messages
    assert _sdpa_kernel_of(out) is None
    out.backward(g)
    ref = _reference(q.cpu(), k.cpu(), v.cpu(), g.cpu())
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
        _close(a.cpu(), r, torch.float64, name)


# ---------------------------------------------------------------------------------------------
# Grouped-query attention (enable_gqa): k and v kept at their own heads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_heads_equal_the_expanded_call_and_keep_k_v_unexpanded(dtype, p, masked):
    """enable_gqa=True on k, v of 2 heads for 6 query heads: output bitwise the call on k, v expanded
    (repeat_interleave, as repeat_kv), the same dropout mask for one seed, gradients of q equal and of
    k, v the group sums (fp32 bitwise; 16-bit: summed in fp32 before one rounding, so within one unit
    of the dtype); kept for backward, 16-bit without a mask: k and v at 2 heads, 1/3 of the expanded
    bytes; with a mask or in fp32 the expanded copies (what CUDA's efficient kernel keeps there)."""
    torch.manual_seed(0)
    b, h, kv, s, d = 2, 6, 2, 37, 8
    q = (torch.randn(b, h, s, d) * 3).to(dtype).requires_grad_()
    k, v = ((torch.randn(b, kv, s, d) * 3).to(dtype).requires_grad_() for _ in range(2))
    mask = (torch.rand(b, 1, 1, s) > 0.3) if masked else None
    seed = torch.tensor(1234)
    g = torch.randn(b, h, s, d).to(dtype)
    with ActivationLedger() as grouped:
        out = efficient_attention(q, k, v, attn_mask=mask, dropout_p=p, seed=seed, enable_gqa=True)
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], g)
    k_e, v_e = (t.detach().repeat_interleave(3, 1).requires_grad_() for t in (k, v))
    with ActivationLedger() as expanded:
        out_e = efficient_attention(q, k_e, v_e, attn_mask=mask, dropout_p=p, seed=seed)
    dq_e, dk_e, dv_e = torch.autograd.grad(out_e, [q, k_e, v_e], g)
    assert torch.equal(out, out_e) and torch.equal(dq, dq_e)
    for a, member in ((dk, dk_e), (dv, dv_e)):
        member = member.float().view(b, kv, 3, s, d)
        e = member.sum(2)
        if dtype == torch.float32:
            assert torch.equal(a, e)
        else:  # each member rounded to the dtype (the expanded call) against one rounding here
            assert ((a.float() - e).abs() <= 4 * torch.finfo(dtype).eps * member.abs().sum(2)).all()
    kv_bytes = 2 * b * kv * s * d * q.element_size()
    if masked or dtype == torch.float32:  # expanded first on every device, as CUDA's efficient kernel keeps them
        assert expanded.activation_bytes - grouped.activation_bytes == 0
    else:
        assert expanded.activation_bytes - grouped.activation_bytes == 2 * kv_bytes  # 3 heads each, not 1
    assert dk.shape == k.shape and dv.shape == v.shape
