"""What the attention ops recover instead of keeping, against fp64, with adversarial inputs.

Each recovered value is compared with the value the forward had (or its exact fp64 version),
elementwise, against the worst-case bound written in the op's module docstring ("Exactness"):
  * Combined: the dropout mask (bitwise), the dropout output D and the softmax backward, both
    from the kept softmax output s (rounded to its storage dtype);
  * efficient attention (reference path): the scores and the dropout tiles (bitwise), the
    probabilities P = exp((S - m) - log l) from the kept row statistics, D = rowsum(dO * O)
    from the kept output.
Adversarial: logits of size 1, 30, 1e3 and 1e4, finfo.min and -inf masks with a fully masked row,
fp32 / bf16 / fp16 / bf16 autocast. ``python tests/test_attention_exactness.py`` prints the
end-to-end table (ours and eager against fp64) for the README.
"""

import itertools
import math

import pytest
import torch

from conftest import triton_blocker
from tempo.ops import attention as attn_mod
from tempo.ops import combined as comb_mod
from tempo.ops._backend import use_backend
from tempo.ops.attention import attention_keep_mask, efficient_attention
from tempo.ops.combined import combined_softmax_dropout_matmul, dropout_keep_mask

U32 = 2.0 ** -24
# Storing a value x in a dtype changes it by at most UNIT * |x| + FLOOR (half the spacing of the
# subnormals: fp16 cannot hold a probability below 6e-8, and holds one below 6.1e-5 to an absolute
# 6e-8 only). Triton's interpreter truncates fp32 -> 16-bit stores: twice both.
UNIT = {torch.float32: U32, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float64: 2.0 ** -53}
FLOOR = {torch.float32: 2.0 ** -150, torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}
TRUNCATED = {dt: 2 * u for dt, u in UNIT.items()}
TRUNCATED_FLOOR = {dt: 2 * f for dt, f in FLOOR.items()}

MODES = ["fp32", "bf16", "fp16", "autocast_bf16"]
SCALES = [1.0, 30.0, 1e3, 1e4]
MASKS = ["none", "finfo.min", "-inf"]


def _scores(mode, scale, mask_kind, shape=(2, 1, 5, 33)):
    x_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
               "autocast_bf16": torch.float32}[mode]
    x = torch.randn(shape) * scale
    if mask_kind != "none":
        value = torch.finfo(x_dtype).min if mask_kind == "finfo.min" else float("-inf")
        x[..., 25:] = value  # masked keys
        x[0, 0, 3] = value  # a fully masked row
    return x.to(x_dtype)


# ------------------------------------------------------------------------------------------------
# Combined
# ------------------------------------------------------------------------------------------------
def _combined_case(backend, mode, scale, mask_kind, p):
    torch.manual_seed(11)
    x = _scores(mode, scale, mask_kind)
    v_dtype = torch.bfloat16 if mode == "autocast_bf16" else x.dtype
    v = torch.randn(2, 1, 33, 8).to(v_dtype)
    g = torch.randn(2, 1, 5, 8).to(v_dtype)
    seed = torch.tensor(5)
    xl, vl = x.clone().requires_grad_(), v.clone().requires_grad_()
    kept = []  # what autograd keeps: the softmax output is the one of x's shape
    with use_backend(backend), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast_bf16"), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = combined_softmax_dropout_matmul(xl, vl, -1, p, True, seed)
    (s_kept,) = [t for t in kept if t.shape == x.shape]
    out.backward(g)
    keep = dropout_keep_mask(seed, x.shape, p, "cpu", backend) if p else torch.ones(x.shape, dtype=torch.bool)
    return x, v, g, xl.grad, vl.grad, s_kept, keep


def _combined_bounds(backend, x, v, g, s_kept, keep, p):
    """Elementwise bounds (the docstring's) for dx and dv against the exact backward of the
    forward's fp32 probabilities P (aten's fp32 softmax; 0 on all -inf rows)."""
    s_dtype, v_dtype, x_dtype = s_kept.dtype, v.dtype, x.dtype
    units, floors = (TRUNCATED, TRUNCATED_FLOOR) if backend == "triton" else (UNIT, FLOOR)
    u_s, u_v, u_x = units[s_dtype], UNIT[v_dtype], units[x_dtype]
    u_dv = units[v_dtype]  # the regenerated D is stored by the kernel (triton) or cast (reference)
    eta_s, eta_v, eta_x = floors[s_dtype], floors[v_dtype], floors[x_dtype]
    P = torch.ops.aten._safe_softmax(x.float(), -1).double()
    n, s_q, d_v = x.shape[-1], x.shape[-2], v.shape[-1]
    c = keep.double() / (1.0 - p)
    g64, v64 = g.double(), v.double()
    dD = g64 @ v64.transpose(-1, -2)
    # dD = g @ v^T is computed in v's dtype (fp32 accumulation): its own rounding.
    dD_err = u_v * dD.abs() + (d_v + 2) * U32 * (g64.abs() @ v64.abs().transpose(-1, -2))
    gk, gk_err = dD * c, dD_err * c
    G = (gk * P).sum(-1, keepdim=True)
    dx = P * (gk - G)
    a = (gk - G).abs()
    g_bar = (gk.abs() * P).sum(-1, keepdim=True)
    e_bar = (gk_err * P).sum(-1, keepdim=True)
    # |kept s - P|; 2 u_c: the Triton path's own fp32 softmax differs from aten's by an ulp or two.
    ds = P * (u_s + 2 * U32) + eta_s
    d_g = (ds * gk.abs()).sum(-1, keepdim=True)  # |G(kept s) - G(P)|
    dx_bound = (ds * a + P * (d_g + gk_err + e_bar + (n + 4) * U32 * (a + g_bar)) + ds * d_g
                + u_x * dx.abs() + eta_x)
    D = P * c
    dv = D.transpose(-1, -2) @ g64
    d_D = (ds + u_dv * P) * c + eta_v  # the regenerated dropout output, stored in v's dtype
    dv_bound = (d_D + (s_q + 2) * U32 * D).transpose(-1, -2) @ g64.abs() + u_v * dv.abs() + eta_v
    return dx, dx_bound * 1.01 + 1e-30, dv, dv_bound * 1.01 + 1e-30


def _cpu_backend(backend):
    """These cases run on CPU tensors: the Triton ones need the interpreter (fail without it on a
    CPU-only machine, skip on a CUDA one, where the kernels are tested on the GPU)."""
    if backend == "triton":
        blocked = triton_blocker("cpu")
        if blocked is not None:
            (pytest.fail if blocked[0] == "fail" else pytest.skip)(blocked[1])
    return backend


# Triton's interpreter is slow: there one mask kind, whose unmasked keys and fully masked row cover
# the rest (its kernels read finfo.min as the number it is).
COMBINED_CASES = [(b, m, k) for b in ("reference", "triton") for m in MODES for k in MASKS
                  if b == "reference" or k == "-inf"]


@pytest.mark.parametrize("backend,mode,mask_kind", COMBINED_CASES)
def test_combined_backward_within_its_recovery_bound(backend, mode, mask_kind):
    """dx from the kept s and dv from the regenerated D, elementwise within the bound, at every
    logit scale. With fp32 s the bound is a few fp32 ulps; with a 16-bit s it is that dtype's
    rounding of s (plus fp16's subnormal floor) times |g_j - G| + sum_k s_k |g_k|."""
    _cpu_backend(backend)
    # On Triton the no-dropout kernels differ only by the mask's absence.
    cases = ([(30.0, 0.1), (1e4, 0.1)] if backend == "triton"
             else itertools.product([1.0, 30.0, 1e4], [0.0, 0.1]))
    for scale, p in cases:
        x, v, g, dx, dv, s_kept, keep = _combined_case(backend, mode, scale, mask_kind, p)
        ref_dx, dx_bound, ref_dv, dv_bound = _combined_bounds(backend, x, v, g, s_kept, keep, p)
        dx_err = (dx.double() - ref_dx).abs()
        dv_err = (dv.double() - ref_dv).abs()
        assert (dx_err <= dx_bound).all(), (scale, (dx_err / dx_bound).max().item())
        assert (dv_err <= dv_bound).all(), (scale, (dv_err / dv_bound).max().item())


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("shared_v", [False, True])
def test_combined_regenerates_the_forward_mask_bitwise(backend, monkeypatch, shared_v):
    """The mask applied in forward (read off the output with v = I) is the one backward
    regenerates, element for element, in the batch-chunked backward and the whole-tensor one."""
    _cpu_backend(backend)
    x = torch.randn(2, 2, 9, 33)
    eye = torch.eye(33) if shared_v else torch.eye(33).expand(2, 2, 33, 33).contiguous()
    seed = torch.tensor(77)
    with use_backend(backend):
        out = combined_softmax_dropout_matmul(x.clone().requires_grad_(), eye, -1, 0.3, True, seed)
    keep = dropout_keep_mask(seed, x.shape, 0.3, "cpu", backend)
    assert torch.equal(out.detach() != 0, keep)
    seen = []  # (flat offset, regenerated keep as a flat bool tensor)
    if backend == "triton":
        real = comb_mod._triton_dropout_output

        def record(s, dtype, sd, pp, base=0):
            d = real(s, dtype, sd, pp, base)
            seen.append((base, (d != 0).reshape(-1)))  # s > 0 everywhere: D != 0 exactly where kept
            return d
        monkeypatch.setattr(comb_mod, "_triton_dropout_output", record)
    else:
        real = comb_mod._reference_keep_mask

        def record(sd, shape, pp, device):
            m = real(sd, shape, pp, device)
            seen.append((0, m.reshape(-1)))
            return m
        monkeypatch.setattr(comb_mod, "_reference_keep_mask", record)
    out.sum().backward()
    flat = keep.reshape(-1)
    assert seen and sum(m.numel() for _, m in seen) == flat.numel()
    assert all(torch.equal(m, flat[base:base + m.numel()]) for base, m in seen)


# ------------------------------------------------------------------------------------------------
# Efficient attention (reference path)
# ------------------------------------------------------------------------------------------------
def _attention_inputs(dtype, scale, mask_kind, s_q=150, s_k=300, d=16):
    torch.manual_seed(3)
    q = torch.randn(1, 2, s_q, d) * math.sqrt(scale)
    k = torch.randn(1, 2, s_k, d) * math.sqrt(scale)
    v = torch.randn(1, 2, s_k, d)
    mask = None
    if mask_kind != "none":
        value = torch.finfo(dtype).min if mask_kind == "finfo.min" else float("-inf")
        mask = torch.zeros(1, 1, s_q, s_k)
        mask[..., 260:] = value
        mask[0, 0, 3] = value  # a fully masked row
        mask = mask.to(dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


def _probability_recovery(q, k, v, mask, is_causal=False):
    """(recovered P, exact P of the same fp32 scores, the docstring's bound), over all tiles."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    seed = torch.tensor(0)
    out, stats = attn_mod._reference_forward(q, k, v, mask, seed, 0.0, is_causal, scale)
    qs, kc = q.float() * scale, k.float()
    mask4 = attn_mod._as_4d(mask)
    s_q, s_k = q.shape[2], k.shape[2]
    tiles = len(attn_mod._blocks(s_k, attn_mod.BLOCK_K))
    m, log_l = stats[..., 0:1], stats[..., 1:2]
    rec, exact, bound = [], [], []
    for qi, q0, q1 in attn_mod._blocks(s_q, attn_mod.BLOCK_Q):
        row = [attn_mod._scores(qs[:, :, q0:q1], kc, mask4, is_causal, q0, q1, k0, k1)
               for _, k0, k1 in attn_mod._blocks(s_k, attn_mod.BLOCK_K)]
        S = torch.cat(row, dim=-1)  # the fp32 scores backward recomputes, tile by tile
        m_t, l_t = m[:, :, q0:q1], log_l[:, :, q0:q1]
        rec.append((S - m_t - l_t).exp())
        exact.append(torch.ops.aten._safe_softmax(S.double(), -1))
        spread = (S.double() - m_t.double()).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
        bound.append(exact[-1] * (2 * spread + 3 * math.log(s_k) + 3 * tiles + 136) * U32 + 1e-37)
    return torch.cat(rec, 2).double(), torch.cat(exact, 2), torch.cat(bound, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_attention_probabilities_within_their_recovery_bound(dtype, mask_kind):
    """P = exp((S - m) - log l) against softmax(S) in fp64 for the same fp32 scores: relative
    error within (2|S - m| + 3 ln s_k + 3T + 136) u_c, however large |m| is (finfo.min rows
    included: an fp32 log-sum-exp there would recover P = 1 instead of 1/s_k)."""
    for scale in SCALES:
        q, k, v, mask = _attention_inputs(dtype, scale, mask_kind)
        rec, exact, bound = _probability_recovery(q, k, v, mask)
        err = (rec - exact).abs()
        assert (err <= bound).all(), (scale, (err / bound).max().item())
    rec, exact, bound = _probability_recovery(*_attention_inputs(dtype, 30.0, "none", s_q=300)[:3], None,
                                              is_causal=True)
    assert ((rec - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_attention_row_delta_within_its_recovery_bound(dtype):
    """D = rowsum(dO * O) from the kept O (the forward's fp32 output rounded to the dtype):
    |D - D_exact| <= u_o sum|dO O| + (d_v + 2) u_c sum|dO O|."""
    q, k, v, mask = _attention_inputs(dtype, 30.0, "finfo.min")
    seed = torch.tensor(0)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, _ = attn_mod._reference_forward(q, k, v, mask, seed, 0.0, False, scale)
    out32, _ = attn_mod._reference_forward(q.float(), k.float(), v.float(), mask, seed, 0.0, False, scale)
    g = torch.randn(out.shape).to(dtype)
    delta = (g.float() * out.float()).sum(-1).double()  # as backward computes it
    exact = (g.double() * out32.double()).sum(-1)
    mag = (g.double() * out32.double()).abs().sum(-1)
    assert ((delta - exact).abs() <= (UNIT[dtype] + (v.shape[-1] + 2) * U32) * mag * 1.01 + 1e-30).all()


def test_attention_scores_and_dropout_tiles_are_recomputed_bitwise(monkeypatch):
    """Backward recomputes each tile's scores and dropout tile with the forward's arithmetic: the
    same bits."""
    seen = {"scores": [], "dropout": []}
    real_scores, real_tile = attn_mod._scores, attn_mod._dropout_tile
    monkeypatch.setattr(attn_mod, "_scores", lambda *a: seen["scores"].append(real_scores(*a).clone())
                        or seen["scores"][-1].clone())
    monkeypatch.setattr(attn_mod, "_dropout_tile", lambda *a: seen["dropout"].append(real_tile(*a).clone())
                        or seen["dropout"][-1].clone())
    q, k, v, mask = _attention_inputs(torch.bfloat16, 30.0, "finfo.min")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = efficient_attention(q, k, v, attn_mask=mask, dropout_p=0.2, seed=torch.tensor(9))
    n_fwd = {key: len(val) for key, val in seen.items()}
    out.float().sum().backward()
    for key, tiles in seen.items():
        fwd, bwd = tiles[:n_fwd[key]], tiles[n_fwd[key]:]
        assert len(fwd) == len(bwd) == 6  # 2 query tiles x 3 key tiles
        assert all(torch.equal(a, b) for a, b in zip(fwd, bwd)), key


# ------------------------------------------------------------------------------------------------
# End to end, against fp64, next to eager in the same dtype (the README table)
# ------------------------------------------------------------------------------------------------
def _rel_err(a, ref):
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float("inf")
    ok = torch.isfinite(ref)
    return ((a - ref).abs()[ok].max() / ref.abs()[ok].max().clamp_min(1e-300)).item()


def attention_errors(dtype, scale, mask_kind, p):
    """Max |error| / max |exact| of (out, dq, dk, dv): ours, and eager attention in the same
    dtype (inf where eager gives NaN: a fully -inf row)."""
    q, k, v, mask = _attention_inputs(dtype, scale, mask_kind)
    g = torch.randn(q.shape[:3] + (v.shape[-1],)).to(dtype)
    seed = torch.tensor(3)
    keep = attention_keep_mask(seed, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), p) if p else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = efficient_attention(*leaves, attn_mask=mask, dropout_p=p, seed=seed)
    out.backward(g)
    ours = [out] + [t.grad for t in leaves]

    def attend(q, k, v, dt):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s + mask.to(dt)
        if dt == torch.float64:
            empty = (s == float("-inf")).all(-1, keepdim=True)
            probs = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
        else:
            probs = torch.softmax(s, -1)
        if keep is not None:
            probs = probs * keep / (1 - p)
        return probs @ v

    exact_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact_out = attend(*exact_leaves, torch.float64)
    exact_out.backward(g.double())
    exact = [exact_out.detach()] + [t.grad for t in exact_leaves]
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager_out = attend(*eager_leaves, dtype)
    eager_out.backward(g)
    eager = [eager_out.detach()] + [t.grad for t in eager_leaves]
    return [_rel_err(a, r) for a, r in zip(ours, exact)], [_rel_err(a, r) for a, r in zip(eager, exact)]


def combined_errors(backend, mode, scale, mask_kind, p):
    """Max |error| / max |exact| of (out, dx, dv): ours, and eager softmax -> dropout -> matmul in
    the same mode (autocast: eager keeps an fp32 softmax output)."""
    x, v, g, dx, dv, _, keep = _combined_case(backend, mode, scale, mask_kind, p)
    with use_backend(backend), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast_bf16"):
        out = combined_softmax_dropout_matmul(x.clone().requires_grad_(), v, -1, p, True, torch.tensor(5))
    c = keep / (1 - p)
    x64, v64 = x.double().requires_grad_(), v.double().requires_grad_()
    exact_out = (torch.ops.aten._safe_softmax(x64, -1) * c) @ v64
    exact_out.backward(g.double())
    xe, ve = x.clone().requires_grad_(), v.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast_bf16"):
        eager_out = (torch.softmax(xe, -1) * c.to(xe.dtype)) @ ve
    eager_out.backward(g.to(eager_out.dtype))
    ours = [_rel_err(a, r) for a, r in zip((out, dx, dv), (exact_out.detach(), x64.grad, v64.grad))]
    eager = [_rel_err(a, r) for a, r in zip((eager_out.detach(), xe.grad, ve.grad),
                                             (exact_out.detach(), x64.grad, v64.grad))]
    return ours, eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_attention_end_to_end_no_worse_than_eager(dtype, mask_kind):
    """The reference path computes in fp32 what eager computes in the dtype: never farther from
    fp64 than eager, by more than a few of the dtype's ulps."""
    for scale, p in [(1.0, 0.0), (300.0, 0.1)]:
        ours, eager = attention_errors(dtype, scale, mask_kind, p)
        for name, a, e in zip(("out", "dq", "dk", "dv"), ours, eager):
            assert a <= 1.5 * e + 8 * UNIT[dtype], (scale, p, name, a, e)


if __name__ == "__main__":  # the README table: worst over logit scales and p in {0, 0.1}
    def fmt(values):
        return " / ".join("NaN" if math.isinf(x) else f"{x:.1e}" for x in values)

    for dtype, mask_kind in itertools.product((torch.float32, torch.bfloat16, torch.float16), MASKS):
        worst = [[0.0] * 4, [0.0] * 4]
        for scale, p in itertools.product([1.0, 30.0, 300.0], [0.0, 0.1]):
            for w, errs in zip(worst, attention_errors(dtype, scale, mask_kind, p)):
                w[:] = [max(a, b) for a, b in zip(w, errs)]
        print(f"| efficient_attention (reference) | {dtype} | {mask_kind} | {fmt(worst[0])} | {fmt(worst[1])} |")
    for backend, mode, mask_kind in itertools.product(("reference", "triton"), MODES, MASKS):
        worst = [[0.0] * 3, [0.0] * 3]
        for scale, p in itertools.product([1.0, 30.0], [0.0, 0.1]):
            for w, errs in zip(worst, combined_errors(backend, mode, scale, mask_kind, p)):
                w[:] = [max(a, b) for a, b in zip(w, errs)]
        print(f"| Combined ({backend}) | {mode} | {mask_kind} | {fmt(worst[0])} | {fmt(worst[1])} |")
