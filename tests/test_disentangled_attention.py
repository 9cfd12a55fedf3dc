"""DeBERTa's disentangled attention as one O(s) op: tempo.ops.disentangled_attention.

Checked against transformers' own eager ``DisentangledSelfAttention`` (outputs and the gradients
of every projection and of the relative embeddings), against an fp64 eager reference written here
(with the very dropout mask each path drew), the Triton kernels (through Triton's interpreter)
against the reference path, varlen against each sequence alone, what it keeps (exact bytes), the
dropout streams, torch.library/torch.compile, autocast and every input guard.
"""

import math

import pytest
import torch
from torch.library import opcheck

from tempo.memory import ActivationLedger
from tempo.ops import disentangled_attention as da
from tempo.ops._backend import use_backend
from tempo.ops.disentangled_attention import (
    MAX_SEQ_LEN,
    disentangled_attention,
    disentangled_attention_keep_mask,
    disentangled_attention_varlen,
    relative_position_index,
)

transformers = pytest.importorskip("transformers")
from transformers import DebertaV2Config  # noqa: E402
from transformers.models.deberta_v2.modeling_deberta_v2 import (  # noqa: E402
    DisentangledSelfAttention,
    build_relative_position,
)

from conftest import triton_blocker  # noqa: E402

# (position_buckets, max_relative_positions): log buckets (mid 4, clamped beyond |t| = 15 at S = 20+),
# and none (a span of 6 < S: positions clamp at ±6).
BUCKETS = {"log": (8, 16), "none": (-1, 6)}
V3 = (256, 512)  # DeBERTa-v3's position_buckets, max_relative_positions


def _span(buckets):
    pb, mrp = buckets
    return pb if pb > 0 else mrp


def _geometry(buckets, d, terms):
    pb, mrp = buckets
    return dict(span=_span(buckets), position_buckets=pb, max_relative_positions=mrp,
                scale=1.0 / math.sqrt(d * (1 + terms)))


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


# ------------------------------------------------------------------------------------------------
# fp64 eager reference (the formulas of transformers, S×S, any dropout mask)
# ------------------------------------------------------------------------------------------------
def _eager(q, k, v, kp, qp, geometry, mask=None, keep=None, p=0.0):
    """[B, S, H, *] inputs -> fp64 output, transformers' masking (a padded row attends uniformly)."""
    b, s, h, _ = q.shape
    span, pb, mrp = geometry["span"], geometry["position_buckets"], geometry["max_relative_positions"]
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2)
    if kp is not None or qp is not None:
        x = torch.zeros(1, s, 1)
        rel = build_relative_position(x, x, pb, mrp)[0] if pb > 0 else build_relative_position(x, x)[0]
        idx = torch.clamp(rel + span, 0, 2 * span - 1)
        if kp is not None:
            c2p = qh @ kp.double().permute(1, 2, 0)  # [B, H, S, 2·span]
            scores = scores + torch.gather(c2p, -1, idx.expand(b, h, s, s))
        if qp is not None:
            p2c = kh @ qp.double().permute(1, 2, 0)
            scores = scores + torch.gather(p2c, -1, torch.clamp(-rel + span, 0, 2 * span - 1).expand(b, h, s, s)
                                           ).transpose(-1, -2)
    scores = scores * geometry["scale"]
    if mask is not None:
        m = mask.bool()
        pair = m[:, None, :, None] & m[:, None, None, :]
        scores = scores.masked_fill(~pair, torch.finfo(torch.float64).min)
    probs = torch.softmax(scores, dim=-1)
    if keep is not None:
        probs = probs * keep / (1.0 - p)
    return (probs @ vh).transpose(1, 2)


def _inputs(b, s, h, d, dtype, c2p=True, p2c=True, span=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(dtype).requires_grad_() for _ in range(3))
    kp = torch.randn(2 * span, h, d, generator=g).to(dtype).requires_grad_() if c2p else None
    qp = torch.randn(2 * span, h, d, generator=g).to(dtype).requires_grad_() if p2c else None
    return q, k, v, kp, qp


def _grads(out, inputs, g):
    present = [t for t in inputs if t is not None]
    grads = iter(torch.autograd.grad(out, present, g))
    return [next(grads) if t is not None else None for t in inputs]


# ------------------------------------------------------------------------------------------------
# Against transformers' DisentangledSelfAttention
# ------------------------------------------------------------------------------------------------
def _module(pos_att_type, share, buckets, hidden=32, heads=2):
    pb, mrp = buckets
    config = DebertaV2Config(hidden_size=hidden, num_attention_heads=heads, intermediate_size=64,
                             relative_attention=True, pos_att_type=list(pos_att_type), position_buckets=pb,
                             max_relative_positions=mrp, share_att_key=share, max_position_embeddings=64,
                             attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    return DisentangledSelfAttention(config).eval()


def _tempo_core(module, hidden, rel, mask2d):
    """The module's projections, then the op (what a patched DeBERTa layer would run)."""
    b, s, _ = hidden.shape
    h, d = module.num_attention_heads, module.attention_head_size
    q, k, v = (proj(hidden).view(b, s, h, d) for proj in (module.query_proj, module.key_proj, module.value_proj))
    span = module.pos_ebd_size
    rel = rel[: 2 * span]
    kp = qp = None
    if "c2p" in module.pos_att_type:
        kp = (module.key_proj if module.share_att_key else module.pos_key_proj)(rel).view(2 * span, h, d)
    if "p2c" in module.pos_att_type:
        qp = (module.query_proj if module.share_att_key else module.pos_query_proj)(rel).view(2 * span, h, d)
    terms = len(module.pos_att_type)
    out = disentangled_attention(q, k, v, kp, qp, span=span, position_buckets=module.position_buckets,
                                 max_relative_positions=module.max_relative_positions,
                                 scale=1.0 / math.sqrt(d * (1 + terms)), padding_mask=mask2d)
    return out.view(b, s, h * d)


def _compare_with_transformers(module, s, span_rows):
    b, hidden_size = 3, module.all_head_size
    torch.manual_seed(1)
    hidden = torch.randn(b, s, hidden_size)
    rel = torch.randn(span_rows, hidden_size, requires_grad=True)
    mask2d = torch.ones(b, s, dtype=torch.int64)
    mask2d[1, s - 5:] = 0  # real tokens left, padding right
    mask2d[2, 3:] = 0
    mask4d = mask2d[:, None, None, :] * mask2d[:, None, :, None]
    params = [p for p in module.parameters()] + [rel]
    g = torch.randn(b, s, hidden_size)
    stock, _ = module(hidden, mask4d, rel_embeddings=rel)
    stock_grads = torch.autograd.grad(stock, params, g, allow_unused=True)
    ours = _tempo_core(module, hidden, rel, mask2d)
    our_grads = torch.autograd.grad(ours, params, g, allow_unused=True)
    assert _rel_l2(ours, stock) < 1e-5
    names = [n for n, _ in module.named_parameters()] + ["rel_embeddings"]
    # Relative L2 1e-5, with a floor of 1e-6 of the largest gradient for the biases whose gradient is
    # 0 in exact arithmetic (key_proj's bias adds q_i·b to a whole row of scores; with c2p the
    # position key projection's too): there both sides are rounding noise.
    floor = 1e-6 * max(r.double().norm().item() for r in stock_grads if r is not None)
    for name, a, r in zip(names, our_grads, stock_grads):
        assert (a is None) == (r is None), name
        if r is not None:
            err = (a.double() - r.double()).norm().item()
            assert err <= 1e-5 * r.double().norm().item() + floor, (name, err, r.norm().item())
    return our_grads


@pytest.fixture
def small_reference_tiles(monkeypatch):
    """Reference tiles of 8 × 8: the comparisons run several query and key tiles, bands of table rows
    that start mid-table, and tiles that straddle the clamped and log-bucket regions."""
    monkeypatch.setattr(da, "BLOCK_Q", 8)
    monkeypatch.setattr(da, "BLOCK_K", 8)


@pytest.mark.parametrize("buckets", list(BUCKETS))
@pytest.mark.parametrize("share", [True, False], ids=["shared-key", "own-projections"])
@pytest.mark.parametrize("pos_att_type", [("p2c", "c2p"), ("c2p",), ("p2c",), ()], ids="+".join)
def test_matches_transformers_disentangled_self_attention(pos_att_type, share, buckets, small_reference_tiles):
    module = _module(pos_att_type, share, BUCKETS[buckets])
    grads = _compare_with_transformers(module, s=20, span_rows=2 * _span(BUCKETS[buckets]))
    if pos_att_type:
        assert grads[-1].abs().sum() > 0  # the relative embeddings got a gradient through the op


def test_matches_transformers_with_deberta_v3_buckets(small_reference_tiles):
    module = _module(("p2c", "c2p"), True, V3)
    _compare_with_transformers(module, s=40, span_rows=2 * 256)


def test_relative_position_index_is_transformers_bucketing():
    for pb, mrp in (V3, (8, 16), (64, 66), (-1, 6)):
        span = pb if pb > 0 else mrp
        for s in (1, 7, 40, 300):
            x = torch.zeros(1, s, 1)
            rel = build_relative_position(x, x, pb, mrp)[0] if pb > 0 else build_relative_position(x, x)[0]
            table = relative_position_index(s, span, pb, mrp, "cpu")
            assert table.dtype == torch.int32 and table.shape == (2 * s - 1,)
            i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
            assert torch.equal(table[i - j + s - 1].long(), torch.clamp(rel + span, 0, 2 * span - 1))
    assert relative_position_index(40, 256, *V3, "cpu") is relative_position_index(40, 256, *V3, "cpu")


# ------------------------------------------------------------------------------------------------
# Gradients, dropout, varlen (reference path)
# ------------------------------------------------------------------------------------------------
def test_fp64_gradcheck_with_dropout_and_mask():
    geometry = _geometry((4, 6), 3, 2)  # log buckets (mid 2), clamped beyond |t| = 5, S = 7
    q, k, v, kp, qp = _inputs(2, 7, 2, 3, torch.float64, span=4)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    seed = torch.tensor(1234)

    def fn(q, k, v, kp, qp):
        return disentangled_attention(q, k, v, kp, qp, padding_mask=mask, dropout_p=0.3, seed=seed, **geometry)

    assert torch.autograd.gradcheck(fn, (q, k, v, kp, qp))


def test_fp64_gradcheck_varlen_with_dropout():
    geometry = _geometry((-1, 3), 2, 2)
    q, k, v, kp, qp = _inputs(1, 9, 2, 2, torch.float64, span=3)
    q, k, v = (t.detach()[0].requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, 5, 6, 9], dtype=torch.int32)

    def fn(q, k, v, kp, qp):
        return disentangled_attention_varlen(q, k, v, cu, 5, kp, qp, dropout_p=0.3, seed=torch.tensor(5), **geometry)

    assert torch.autograd.gradcheck(fn, (q, k, v, kp, qp))


def test_padded_rows_attend_uniformly_and_send_no_gradient_to_q_k_or_positions():
    geometry = _geometry(BUCKETS["log"], 8, 2)
    q, k, v, kp, qp = _inputs(2, 20, 2, 8, torch.float32)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 12:] = False
    out = disentangled_attention(q, k, v, kp, qp, padding_mask=mask, **geometry)
    torch.testing.assert_close(out[1, 12:], v[1].mean(dim=0).expand(8, 2, 8))
    g = torch.zeros_like(out)
    g[1, 12:] = torch.randn(8, 2, 8)  # only the padded rows' outputs carry a gradient
    dq, dk, dv, dkp, dqp = _grads(out, (q, k, v, kp, qp), g)
    assert (dq == 0).all() and (dk == 0).all() and (dkp == 0).all() and (dqp == 0).all()
    torch.testing.assert_close(dv[1], g[1, 12:].sum(0).expand(20, 2, 8) / 20)
    # And real rows never attend a padded key: the padded keys' v gets nothing from them.
    g = torch.zeros_like(out)
    g[1, :12] = torch.randn(12, 2, 8)
    out = disentangled_attention(q, k, v, kp, qp, padding_mask=mask, **geometry)
    assert (torch.autograd.grad(out, v, g)[0][1, 12:] == 0).all()


def test_reference_tiles_do_not_change_the_result(monkeypatch):
    geometry = _geometry(BUCKETS["log"], 8, 2)
    q, k, v, kp, qp = _inputs(2, 37, 2, 8, torch.float32)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[0, 30:] = False
    g = torch.randn(2, 37, 2, 8)
    out = disentangled_attention(q, k, v, kp, qp, padding_mask=mask, **geometry)
    grads = _grads(out, (q, k, v, kp, qp), g)
    monkeypatch.setattr(da, "BLOCK_Q", 16)
    monkeypatch.setattr(da, "BLOCK_K", 8)
    tiled = disentangled_attention(q, k, v, kp, qp, padding_mask=mask, **geometry)
    torch.testing.assert_close(tiled, out)
    for a, b in zip(_grads(tiled, (q, k, v, kp, qp), g), grads):
        torch.testing.assert_close(a, b)


def _packed(lengths, h, d, dtype, span, c2p=True, p2c=True):
    q, k, v, kp, qp = _inputs(1, sum(lengths), h, d, dtype, c2p, p2c, span=span)
    q, k, v = (t.detach()[0].requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, kp, qp, cu


def test_varlen_equals_each_sequence_alone():
    geometry = _geometry(BUCKETS["log"], 8, 2)
    lengths = [5, 1, 23, 12]
    q, k, v, kp, qp, cu = _packed(lengths, 2, 8, torch.float32, 8)
    g = torch.randn(q.shape[0], 2, 8)
    out = disentangled_attention_varlen(q, k, v, cu, max(lengths), kp, qp, **geometry)
    dq, dk, dv, dkp, dqp = _grads(out, (q, k, v, kp, qp), g)
    dkp_sum, dqp_sum = torch.zeros_like(kp), torch.zeros_like(qp)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seq = [t[a:b].unsqueeze(0) for t in (q, k, v)]
        alone = disentangled_attention(*seq, kp, qp, **geometry)
        assert torch.equal(out[a:b], alone[0])
        ga = _grads(alone, (*seq, kp, qp), g[a:b].unsqueeze(0))
        torch.testing.assert_close(dq[a:b], ga[0][0])
        torch.testing.assert_close(dk[a:b], ga[1][0])
        torch.testing.assert_close(dv[a:b], ga[2][0])
        dkp_sum += ga[3]
        dqp_sum += ga[4]
    torch.testing.assert_close(dkp, dkp_sum)
    torch.testing.assert_close(dqp, dqp_sum)


def _keep_identity_probe(backend, p=0.4, b=2, s=20, h=2):
    """q = k = 0 and zero position tables make every probability 1/S; v = I reads the applied mask."""
    geometry = _geometry(BUCKETS["none"], s, 2)
    q = torch.zeros(b, s, h, s, requires_grad=True)
    k = torch.zeros(b, s, h, s)
    v = torch.eye(s)[None, :, None, :].expand(b, s, h, s).contiguous()
    kp = torch.zeros(2 * geometry["span"], h, s)
    seed = torch.tensor(99)
    with use_backend(backend):
        out = disentangled_attention(q, k, v, kp, kp, dropout_p=p, seed=seed, **geometry)
    keep = disentangled_attention_keep_mask(seed, b, h, s, p, backend=backend)
    torch.testing.assert_close(out.transpose(1, 2), keep.float() / ((1 - p) * s), atol=1e-6, rtol=1e-5)


def test_forward_applies_exactly_the_regenerated_mask_reference():
    _keep_identity_probe("reference")


def _correlation(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


def _check_stream(keep, other_seeds, p):
    """Keep rate within 6σ; no correlation (5σ of n independent pairs) between heads, batch elements,
    neighbouring rows, (i, j) and (j, i) (the diagonal is shared: 1/S more), neighbouring seeds."""
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n)
    s = keep.shape[-1]
    pairs = [(keep[:, 0], keep[:, 1], 0.0), (keep[0], keep[1], 0.0), (keep[..., :-1, :], keep[..., 1:, :], 0.0),
             (keep, keep.transpose(-1, -2), 1.0 / s)] + [(keep, other, 0.0) for other in other_seeds]
    for a, b, shared in pairs:
        corr = _correlation(a, b)
        assert abs(corr) < 5 / math.sqrt(a.numel()) + shared, corr


def test_dropout_stream_reference():
    p = 0.3
    keep = disentangled_attention_keep_mask(torch.tensor(11), 4, 4, 200, p)
    others = [disentangled_attention_keep_mask(torch.tensor(s), 4, 4, 200, p) for s in (12, 11 ^ (1 << 30))]
    _check_stream(keep, others, p)
    assert torch.equal(keep, disentangled_attention_keep_mask(torch.tensor(11), 4, 4, 200, p))
    # Varlen: one independent stream per sequence.
    cu = torch.tensor([0, 150, 300])
    a, b = disentangled_attention_keep_mask(torch.tensor(11), 0, 4, 0, p, cu_seqlens=cu)
    assert abs(_correlation(a, b)) < 5 / math.sqrt(a.numel())


def test_default_seed_follows_torch_rng_and_a_no_grad_replay_draws_the_same_mask():
    geometry = _geometry(BUCKETS["log"], 8, 2)
    q, k, v, kp, qp = _inputs(2, 20, 2, 8, torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        replay = disentangled_attention(q, k, v, kp, qp, dropout_p=0.5, **geometry)
    torch.manual_seed(3)
    first = disentangled_attention(q, k, v, kp, qp, dropout_p=0.5, **geometry)
    again = disentangled_attention(q, k, v, kp, qp, dropout_p=0.5, **geometry)
    assert torch.equal(first, replay) and not torch.equal(first, again)
    no_drop = disentangled_attention(q, k, v, kp, qp, **geometry)
    assert torch.equal(disentangled_attention(q, k, v, kp, qp, dropout_p=0.5, training=False, **geometry), no_drop)


# ------------------------------------------------------------------------------------------------
# What it keeps
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_saved_bytes_exact(dtype, p):
    b, s, h, d, span = 2, 40, 3, 8, 16  # S·2·span = 1280 > S·d: a position-sized tensor would be seen
    geometry = _geometry((16, 32), d, 2)
    q, k, v, kp, qp = _inputs(b, s, h, d, dtype, span=span)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 30:] = False
    with ActivationLedger() as led:
        out = disentangled_attention(q, k, v, kp, qp, padding_mask=mask, dropout_p=p, **geometry)
    es = q.element_size()
    expected = (4 * b * s * h * d * es  # q, k, v, out
                + 2 * 2 * span * h * d * es  # pos_key, pos_query
                + 8 * b * s * h  # fp32 (m, log l) per row and head
                + 8  # the int64 seed
                + b * s  # the caller's bool mask
                + 4 * (2 * s - 1))  # the shared int32 index table
    assert led.activation_bytes == expected
    assert len(led.records) == 10
    per_head = [math.prod(r.shape) / (b * h) for r in led.records]
    assert max(per_head) < min(s * s, s * 2 * span)
    out.float().sum().backward()


def test_saved_bytes_exact_varlen():
    lengths, h, d, span = [30, 7, 40], 2, 8, 16
    geometry = _geometry((16, 32), d, 2)
    q, k, v, kp, qp, cu = _packed(lengths, h, d, torch.float32, span)
    t = sum(lengths)
    with ActivationLedger() as led:
        out = disentangled_attention_varlen(q, k, v, cu, 40, kp, qp, dropout_p=0.1, **geometry)
    expected = 4 * t * h * d * 4 + 2 * 2 * span * h * d * 4 + 8 * t * h + 8 + cu.numel() * 4 + 4 * (2 * 40 - 1)
    assert led.activation_bytes == expected
    assert all(math.prod(r.shape) < min(40 * 40, 40 * 2 * span) * h for r in led.records)
    out.sum().backward()


def test_no_grad_keeps_nothing_and_matches():
    geometry = _geometry(BUCKETS["log"], 8, 2)
    q, k, v, kp, qp = _inputs(2, 20, 2, 8, torch.float32)
    with ActivationLedger() as led, torch.no_grad():
        stock = disentangled_attention(q, k, v, kp, qp, **geometry)
    assert led.activation_bytes == 0
    assert torch.equal(stock, disentangled_attention(q, k, v, kp, qp, **geometry).detach())


def test_output_is_contiguous_so_merging_heads_is_a_view():
    geometry = _geometry(BUCKETS["log"], 8, 2)
    q, k, v, kp, qp = _inputs(2, 9, 3, 8, torch.float32)
    out = disentangled_attention(q, k, v, kp, qp, **geometry)
    assert out.shape == (2, 9, 3, 8) and out.is_contiguous()
    merged = out.view(2, 9, 24)
    assert merged.data_ptr() == out.data_ptr()


# ------------------------------------------------------------------------------------------------
# Autocast, torch.library, torch.compile
# ------------------------------------------------------------------------------------------------
def test_autocast_casts_to_the_autocast_dtype():
    geometry = _geometry(BUCKETS["log"], 8, 2)
    q, k, v, kp, qp = _inputs(2, 20, 2, 8, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = disentangled_attention(q, k, v, kp, qp, **geometry)
    assert out.dtype == torch.bfloat16
    cast = [t.detach().bfloat16() for t in (q, k, v, kp, qp)]
    assert torch.equal(out, disentangled_attention(*cast, **geometry))
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and kp.grad.dtype == torch.float32 and kp.grad.abs().sum() > 0


def test_opcheck_custom_ops():
    geometry = _geometry(BUCKETS["log"], 4, 2)
    span = geometry["span"]
    q, k, v, kp, qp = (t.detach() for t in _inputs(2, 9, 2, 4, torch.float32))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    table = relative_position_index(9, span, 8, 16, "cpu")
    seed = torch.tensor(3)
    fwd, bwd = torch.ops.tempo.disentangled_attention_fwd.default, torch.ops.tempo.disentangled_attention_bwd.default
    tail = (span, 8, 16, "reference")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, kp, qp)]
    opcheck(fwd, (*leaves, table, mask, seed, 0.3, 0.2, *tail))
    opcheck(fwd, (*leaves[:3], None, leaves[4], table, None, seed, 0.3, 0.0, *tail))
    out, stats = fwd(q, k, v, kp, qp, table, mask, seed, 0.3, 0.2, *tail)
    opcheck(bwd, (torch.randn_like(out), q, k, v, kp, qp, out, stats, table, mask, seed, 0.3, 0.2, *tail))
    opcheck(bwd, (torch.randn_like(out), q, k, v, None, None, out, stats, table, None, seed, 0.3, 0.0, *tail))
    vq, vk, vv, vkp, vqp, cu = _packed([4, 1, 6], 2, 4, torch.float32, span)
    vfwd = torch.ops.tempo.disentangled_attention_varlen_fwd.default
    vbwd = torch.ops.tempo.disentangled_attention_varlen_bwd.default
    vtable = relative_position_index(6, span, 8, 16, "cpu")
    opcheck(vfwd, (vq, vk, vv, vkp, vqp, vtable, cu, 6, seed, 0.3, 0.2, *tail))
    vq, vk, vv, vkp, vqp = (t.detach() for t in (vq, vk, vv, vkp, vqp))
    out, stats = vfwd(vq, vk, vv, vkp, vqp, vtable, cu, 6, seed, 0.3, 0.2, *tail)
    opcheck(vbwd, (torch.randn_like(out), vq, vk, vv, vkp, vqp, out, stats, vtable, cu, 6, seed, 0.3, 0.2, *tail))


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    geometry = _geometry(BUCKETS["log"], 8, 2)
    base = [t.detach() for t in _inputs(2, 12, 2, 8, torch.float32)]
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 9:] = False
    seed = torch.tensor(17)

    def fn(q, k, v, kp, qp):
        out = disentangled_attention(q, k, v, kp, qp, padding_mask=mask, dropout_p=0.2, seed=seed, **geometry)
        return out.view(2, 12, 16)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in base]
    eager_leaves = [t.clone().requires_grad_() for t in base]
    got, ref = compiled(*leaves), fn(*eager_leaves)
    torch.testing.assert_close(got, ref)
    got.sum().backward()
    ref.sum().backward()
    for a, b in zip(leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# Triton kernels (Triton's interpreter on the CPU) against the reference path
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def triton_backend():
    blocked = triton_blocker("cpu")
    if blocked is not None:
        action, reason = blocked
        (pytest.fail if action == "fail" else pytest.skip)(reason)


def _run(backend, fn, inputs, g):
    with use_backend(backend):
        out = fn(*inputs)
        return out.detach(), _grads(out, inputs, g)


def _assert_paths_agree(dtype, got, ref, fp64, what):
    """fp32: Triton equals the reference path to rounding. 16-bit: both against fp64 (same 16-bit
    inputs): the Triton output within one ULP of the dtype (the interpreter truncates 16-bit stores)
    beyond the reference's own error, every gradient within the reference's error plus one ULP of its
    largest entry (Triton feeds P and dS to its tensor-core dots as hi + lo pairs of the dtype: as
    accurate as the reference's fp32 products)."""
    (out, grads), (ref_out, ref_grads) = got, ref
    fp64_out, fp64_grads = fp64
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5, msg=lambda m: f"{what} out: {m}")
        for i, (a, r) in enumerate(zip(grads, ref_grads)):
            if r is not None:
                assert _rel_l2(a, r) < 1e-5, (what, i, _rel_l2(a, r))
        return
    eps = torch.finfo(dtype).eps
    ulp = eps * fp64_out.abs().clamp_min(2 ** -6)
    assert ((out.double() - fp64_out).abs() <= 1.01 * ulp + (ref_out.double() - fp64_out).abs()).all(), what
    for i, (a, r, e) in enumerate(zip(grads, ref_grads, fp64_grads)):
        if r is not None:
            err, ref_err = (a.double() - e).abs().max().item(), (r.double() - e).abs().max().item()
            assert err <= ref_err + eps * e.abs().max().item(), (what, i, err, ref_err)


TRITON_PADDED = [  # (dtype, S, d, c2p, p2c, masked)
    (torch.float32, 33, 16, True, True, True),
    (torch.bfloat16, 33, 16, True, True, True),
    (torch.float32, 7, 8, True, False, False),
    (torch.bfloat16, 1, 8, False, True, True),
    (torch.float16, 7, 8, False, False, True),
]


@pytest.mark.parametrize("case", TRITON_PADDED, ids=lambda c: f"{str(c[0])[6:]}-S{c[1]}-d{c[2]}-c2p{int(c[3])}"
                         f"-p2c{int(c[4])}-mask{int(c[5])}")
def test_triton_padded_matches_reference(case, triton_backend):
    dtype, s, d, c2p, p2c, masked = case
    geometry = _geometry(BUCKETS["log"], d, c2p + p2c)
    inputs = _inputs(2, s, 2, d, dtype, c2p, p2c)
    mask = None
    if masked:
        mask = torch.ones(2, s, dtype=torch.bool)
        mask[1, (s + 1) // 2:] = False
    g = torch.randn(2, s, 2, d).to(dtype)
    present = [t for t in inputs]

    def fn(q, k, v, kp, qp):
        return disentangled_attention(q, k, v, kp, qp, padding_mask=mask, **geometry)

    got = _run("triton", fn, present, g)
    ref = _run("reference", fn, present, g)
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in present]
    fp64_out = _eager(*leaves, geometry, mask)
    fp64 = (fp64_out.detach(), _grads(fp64_out, leaves, g.double()))
    _assert_paths_agree(dtype, got, ref, fp64, f"padded {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_varlen_matches_reference(dtype, triton_backend):
    lengths, d = ([1, 7, 33], 16) if dtype == torch.float32 else ([7, 20], 8)
    geometry = _geometry(BUCKETS["log"], d, 2)
    q, k, v, kp, qp, cu = _packed(lengths, 2, d, dtype, 8)
    g = torch.randn(q.shape[0], 2, d).to(dtype)

    def fn(q, k, v, kp, qp):
        return disentangled_attention_varlen(q, k, v, cu, max(lengths), kp, qp, **geometry)

    got = _run("triton", fn, [q, k, v, kp, qp], g)
    ref = _run("reference", fn, [q, k, v, kp, qp], g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, kp, qp)]
    outs = [_eager(*[t[a:b].unsqueeze(0) for t in leaves[:3]], *leaves[3:], geometry)[0]
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    fp64_out = torch.cat(outs)
    fp64 = (fp64_out.detach(), _grads(fp64_out, leaves, g.double()))
    _assert_paths_agree(dtype, got, ref, fp64, f"varlen {dtype}")


def test_triton_dropout_matches_fp64_with_its_own_mask(triton_backend):
    p, seed = 0.3, torch.tensor(77)
    geometry = _geometry(BUCKETS["log"], 16, 2)
    q, k, v, kp, qp = _inputs(2, 33, 2, 16, torch.float32)
    mask = torch.ones(2, 33, dtype=torch.bool)
    mask[0, 20:] = False
    g = torch.randn(2, 33, 2, 16)
    with use_backend("triton"):
        out = disentangled_attention(q, k, v, kp, qp, padding_mask=mask, dropout_p=p, seed=seed, **geometry)
        grads = _grads(out, (q, k, v, kp, qp), g)
    keep = disentangled_attention_keep_mask(seed, 2, 2, 33, p, backend="triton")
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, kp, qp)]
    ref = _eager(*leaves, geometry, mask, keep.double(), p)
    ref_grads = _grads(ref, leaves, g.double())
    assert _rel_l2(out, ref) < 1e-6
    for a, r in zip(grads, ref_grads):
        assert _rel_l2(a, r) < 1e-5
    # Varlen: sequence n draws the stream of padded batch element n.
    lengths = [9, 20]
    vq, vk, vv, vkp, vqp, cu = _packed(lengths, 2, 16, torch.float32, 8)
    gv = torch.randn(29, 2, 16)
    with use_backend("triton"):
        vout = disentangled_attention_varlen(vq, vk, vv, cu, 20, vkp, vqp, dropout_p=p, seed=seed, **geometry)
        vgrads = _grads(vout, (vq, vk, vv, vkp, vqp), gv)
    keeps = disentangled_attention_keep_mask(seed, 0, 2, 0, p, backend="triton", cu_seqlens=cu)
    full = disentangled_attention_keep_mask(seed, 2, 2, 20, p, backend="triton")
    assert torch.equal(keeps[0], full[0, :, :9, :9]) and torch.equal(keeps[1], full[1])
    leaves = [t.detach().double().requires_grad_() for t in (vq, vk, vv, vkp, vqp)]
    ref = torch.cat([_eager(*[t[a:b].unsqueeze(0) for t in leaves[:3]], *leaves[3:], geometry,
                            keep=keeps[n].double().unsqueeze(0), p=p)[0]
                     for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))])
    assert _rel_l2(vout, ref) < 1e-6
    for a, r in zip(vgrads, _grads(ref, leaves, gv.double())):
        assert _rel_l2(a, r) < 1e-5


def test_forward_applies_exactly_the_regenerated_mask_triton(triton_backend):
    _keep_identity_probe("triton")


def test_dropout_stream_triton(triton_backend):
    p = 0.3
    keep = disentangled_attention_keep_mask(torch.tensor(11), 2, 2, 96, p, backend="triton")
    others = [disentangled_attention_keep_mask(torch.tensor(s), 2, 2, 96, p, backend="triton")
              for s in (12, 11 ^ (1 << 30))]
    _check_stream(keep, others, p)
    assert torch.equal(keep, disentangled_attention_keep_mask(torch.tensor(11), 2, 2, 96, p, backend="triton"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_batches_and_sequences(backend):
    if backend == "triton":
        blocked = triton_blocker("cpu")
        if blocked is not None:
            (pytest.fail if blocked[0] == "fail" else pytest.skip)(blocked[1])
    geometry = _geometry((4, 8), 8, 2)
    with use_backend(backend):
        for b, s in ((0, 5), (2, 0)):
            q, k, v, kp, qp = _inputs(b, s, 2, 8, torch.float32, span=4)
            out = disentangled_attention(q, k, v, kp, qp, dropout_p=0.1, **geometry)
            assert out.shape == (b, s, 2, 8)
            out.sum().backward()
            assert q.grad.shape == q.shape and (kp.grad == 0).all()
        # Varlen with empty sequences between real ones.
        q, k, v, kp, qp, cu = _packed([0, 5, 0, 3], 2, 8, torch.float32, 4)
        out = disentangled_attention_varlen(q, k, v, cu, 5, kp, qp, dropout_p=0.2, **geometry)
        out.sum().backward()
        assert out.shape == (8, 2, 8) and q.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------
# Bad input: a ValueError/TypeError naming the argument, before any compute
# ------------------------------------------------------------------------------------------------
def _good():
    q, k, v, kp, qp = (t.detach() for t in _inputs(2, 6, 2, 4, torch.float32))
    mask = torch.ones(2, 6, dtype=torch.bool)
    kw = dict(span=8, position_buckets=8, max_relative_positions=16, scale=0.3, padding_mask=mask)
    return [q, k, v, kp, qp], kw


BAD = {
    "q_3d": (lambda a, kw: a.__setitem__(0, a[0][0]), ValueError, ["'q'", "4-D"]),
    "k_shape": (lambda a, kw: a.__setitem__(1, a[1][:, :5].contiguous()), ValueError, ["'q', 'k', 'v'"]),
    "v_heads": (lambda a, kw: a.__setitem__(2, a[2][:, :, :1].contiguous()), ValueError, ["'q', 'k', 'v'"]),
    "q_not_contiguous": (lambda a, kw: a.__setitem__(0, a[0].transpose(1, 2).contiguous().transpose(1, 2)),
                         ValueError, ["'q'", "contiguous"]),
    "pos_key_not_contiguous": (lambda a, kw: a.__setitem__(3, a[3].transpose(0, 1).contiguous().transpose(0, 1)),
                               ValueError, ["'pos_key'", "contiguous"]),
    "int_q": (lambda a, kw: a.__setitem__(0, a[0].long()), TypeError, ["'q'", "floating-point"]),
    "mixed_dtypes": (lambda a, kw: a.__setitem__(4, a[4].double()), TypeError, ["one dtype"]),
    "mixed_devices": (lambda a, kw: a.__setitem__(3, a[3].to("meta")), ValueError, ["one device"]),
    "pos_key_shape": (lambda a, kw: a.__setitem__(3, a[3][:10].contiguous()), ValueError, ["'pos_key'", "[2·span"]),
    "pos_query_heads": (lambda a, kw: a.__setitem__(4, a[4][:, :1].contiguous()), ValueError, ["'pos_query'"]),
    "pos_query_not_tensor": (lambda a, kw: a.__setitem__(4, [1.0]), TypeError, ["'pos_query'"]),
    "mask_shape": (lambda a, kw: kw.update(padding_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError,
                   ["'padding_mask'", "(2, 6)"]),
    "mask_values": (lambda a, kw: kw.update(padding_mask=torch.full((2, 6), 2)), ValueError,
                    ["'padding_mask'", "0 and 1"]),
    "mask_float": (lambda a, kw: kw.update(padding_mask=torch.ones(2, 6)), TypeError, ["'padding_mask'"]),
    "mask_device": (lambda a, kw: kw.update(padding_mask=torch.ones(2, 6, dtype=torch.bool, device="meta")),
                    ValueError, ["'padding_mask'"]),
    "span_mismatch": (lambda a, kw: kw.update(span=4), ValueError, ["'span'", "position_buckets"]),
    "log_buckets_degenerate": (lambda a, kw: kw.update(max_relative_positions=5), ValueError,
                               ["max_relative_positions - 1 > position_buckets // 2"]),
    "no_positions_resolved": (lambda a, kw: kw.update(position_buckets=-1, max_relative_positions=-1), ValueError,
                              ["max_relative_positions"]),
    "span_float": (lambda a, kw: kw.update(span=8.0), TypeError, ["'span'"]),
    "scale_str": (lambda a, kw: kw.update(scale="0.3"), TypeError, ["'scale'"]),
    "scale_negative": (lambda a, kw: kw.update(scale=-1.0), TypeError, ["'scale'"]),
    "seed_float": (lambda a, kw: kw.update(seed=torch.tensor(1.5), dropout_p=0.1), TypeError, ["'seed'"]),
    "p_one": (lambda a, kw: kw.update(dropout_p=1.0), ValueError, ["'dropout_p'"]),
    "training_str": (lambda a, kw: kw.update(training="yes"), TypeError, ["'training'"]),
    "too_long": (lambda a, kw: [a.__setitem__(i, torch.zeros(1, MAX_SEQ_LEN + 1, 1, 1)) for i in range(3)]
                 + [a.__setitem__(3, None), a.__setitem__(4, None), kw.update(padding_mask=None)],
                 ValueError, ["seq_len", str(MAX_SEQ_LEN)]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_name_the_argument(case):
    args, kw = _good()
    change, exc, words = BAD[case]
    change(args, kw)
    with pytest.raises(exc) as info:
        disentangled_attention(*args, **kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


BAD_VARLEN = {
    "cu_float": (lambda kw: kw.update(cu_seqlens=torch.tensor([0.0, 3.0, 6.0])), ValueError, ["'cu_seqlens'", "int32"]),
    "cu_2d": (lambda kw: kw.update(cu_seqlens=torch.tensor([[0, 3, 6]])), ValueError, ["'cu_seqlens'", "1-D"]),
    "cu_not_from_zero": (lambda kw: kw.update(cu_seqlens=torch.tensor([1, 3, 6])), ValueError, ["start at 0"]),
    "cu_short_of_tokens": (lambda kw: kw.update(cu_seqlens=torch.tensor([0, 3, 5])), ValueError, ["token count"]),
    "cu_decreasing": (lambda kw: kw.update(cu_seqlens=torch.tensor([0, 4, 3, 6])), ValueError, ["nondecreasing"]),
    "longer_than_max_seqlen": (lambda kw: kw.update(max_seqlen=2), ValueError, ["max_seqlen=2"]),
    "max_seqlen_beyond_max": (lambda kw: kw.update(max_seqlen=MAX_SEQ_LEN + 1), ValueError,
                              ["'max_seqlen'", str(MAX_SEQ_LEN)]),
    "max_seqlen_float": (lambda kw: kw.update(max_seqlen=3.0), TypeError, ["'max_seqlen'"]),
    "q_4d": (lambda kw: kw.update(q=kw["q"][None]), ValueError, ["'q'", "3-D"]),
}


@pytest.mark.parametrize("case", list(BAD_VARLEN))
def test_bad_varlen_inputs_name_the_argument(case):
    q, k, v, kp, qp = (t.detach() for t in _inputs(1, 6, 2, 4, torch.float32))
    kw = dict(q=q[0], k=k[0], v=v[0], cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32), max_seqlen=3,
              pos_key=kp, pos_query=qp, span=8, position_buckets=8, max_relative_positions=16, scale=0.3)
    change, exc, words = BAD_VARLEN[case]
    change(kw)
    with pytest.raises(exc) as info:
        disentangled_attention_varlen(**kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
