"""In-place RMSNorm (issue 33): the op and every gradient against an fp64 reference in both forms
(w and Gemma's 1 + w), adversarial weights (the kept columns), the recovery bound, what it keeps
(the ledger), autocast dtypes, torch.compile, the plan refreshed by an optimizer step, host reads
on the CUDA path; and the recipe: every family's real RMSNorm class replaced by structure, exact in
fp32 against the stock model, and every stock-parity idiom; a look-alike left alone and logged."""

from __future__ import annotations

import copy
import io
import logging
import math

import pytest
import torch
from conftest import triton_blocker
from torch import nn

from tempo.memory import ActivationLedger
from tempo.ops import _backend
from tempo.ops._backend import use_backend
from tempo.ops.layernorm import name_layernorms, plan_kept_columns, recover_xhat
from tempo.ops.layernorm import refresh_kept_column_plans as tempo_refresh
from tempo.ops.rmsnorm import InplaceRMSNorm, inplace_rmsnorm

UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
EPS = 1e-6
# fp32: max error relative to max(1, max|fp64 reference|). 16-bit: no farther from fp64 than the stock
# module computed in that dtype (Llama's and Gemma's code), times STOCK_FACTOR, plus one ULP (2·u_D)
# of slack: a case where the stock rounding happens to be exact (rows of one feature), or the
# interpreter's fp32 -> bf16 stores, which truncate instead of rounding.
FP32_TOL = 1e-5
STOCK_FACTOR = 2.0


def rmsnorm64(x, weight, unit_offset, grad, eps=EPS):
    """fp64 RMSNorm and its gradients by autograd, written out here independently of Tempo."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    w_eff = 1.0 + w64 if unit_offset else w64
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w_eff
    y.backward(grad.double())
    return y.detach(), x64.grad, w64.grad


def stock_rmsnorm(x, weight, unit_offset, eps=EPS):
    """The stock modules' code: Llama's ``w * x̂.to(x.dtype)``, Gemma3's ``(x̂·(1 + w.float())).type_as(x)``."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.float())).type_as(x)
    return weight * h.to(x.dtype)


def stock_run(x, weight, unit_offset, grad):
    xs = x.detach().clone().requires_grad_()
    ws = weight.detach().clone().requires_grad_()
    y = stock_rmsnorm(xs, ws, unit_offset)
    y.backward(grad)
    return y.detach(), xs.grad, ws.grad


def relative_error(got, ref):
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    return float((got.detach().double() - ref).abs().max()) / scale if got.numel() else 0.0


def assert_fp32(got, ref, what):
    assert got.shape == ref.shape, what
    err = relative_error(got, ref)
    assert err <= FP32_TOL, f"{what}: max error {err:.3g} > {FP32_TOL:g}"


def assert_as_stock(got, stock, ref, dtype, what, slack=None):
    """``got`` no farther from the fp64 ``ref`` than the stock computation in ``dtype`` (times a
    factor); ``slack``: an elementwise allowance on top (see ``one_ulp_of_y_in_dx``)."""
    assert got.shape == ref.shape and got.dtype == stock.dtype, what
    scale = max(1.0, float(ref.abs().max()))
    err, stock_err = relative_error(got, ref), relative_error(stock, ref)
    allowed = STOCK_FACTOR * stock_err + 2 * UNIT[dtype]
    if slack is None:
        assert err <= allowed, f"{what}: error {err:.3g} against stock's {stock_err:.3g} (allowed {allowed:.3g})"
    else:
        excess = (got.detach().double() - ref).abs() - allowed * scale - slack
        assert float(excess.max()) <= 0, f"{what}: error {err:.3g} against stock's {stock_err:.3g}"


def one_ulp_of_y_in_dx(x, weight, unit_offset, grad, dtype):
    """Elementwise, what one more ULP of y moves dx by: Triton's interpreter stores fp32 -> bf16 by
    truncating (a GPU rounds to nearest), so x̂ is recovered within 2·u_D·(|x̂| + 1) more, and
    dx = rstd·(g·w − x̂·mean(g·w·x̂)) moves by rstd·(δx̂·|mean(g·w·x̂)| + |x̂|·mean(|g·w|·δx̂)). It
    matters where g·w·x̂ cancels (rows of one feature: dx ≈ 0, which the stock computes from its exact
    fp32 x̂), elsewhere it is within the stock-relative bound anyway."""
    x64, w64, g = x.detach().double(), weight.detach().double(), grad.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    xhat = x64 * rstd
    g_w = g * (1.0 + w64 if unit_offset else w64)
    delta = 2 * UNIT[dtype] * (xhat.abs() + 1)
    mean_g_w_xhat = (g_w * xhat).mean(-1, keepdim=True)
    return rstd * (delta * mean_g_w_xhat.abs() + xhat.abs() * (g_w.abs() * delta).mean(-1, keepdim=True))


def make_weight(n, unit_offset, device="cpu", dtype=torch.float32):
    """|w_eff| in [0.5, 1.5] with random signs: a well-conditioned recovery."""
    sign = torch.randint(0, 2, (n,), device=device) * 2 - 1
    w_eff = (torch.rand(n, device=device) + 0.5) * sign
    return (w_eff - 1.0 if unit_offset else w_eff).to(dtype)


def module_with(weight, unit_offset, dtype_rule, device="cpu"):
    module = InplaceRMSNorm(weight.shape[0], eps=EPS, unit_offset=unit_offset, dtype_rule=dtype_rule,
                            device=device, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


FORMS = [pytest.param(False, id="w"), pytest.param(True, id="1+w")]


# ---------------------------------------------------------------------------------------------
# values and gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("unit_offset", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(3, 1), (5, 7), (7, 123), (3, 1023), (1, 1500)])
def test_matches_fp64_reference(backend, device, dtype, rows, hidden, unit_offset):
    """y, dx and dw against fp64: fp32 within 1e-5; 16-bit input and weight (a model in 16-bit) no
    farther from fp64 than the stock module's own code in that dtype."""
    weight = make_weight(hidden, unit_offset, device, dtype)
    # The stock module's output dtype in 16-bit: Llama promotes (16 with 16), Gemma returns x's.
    module = module_with(weight, unit_offset, "input" if unit_offset else "promote", device)
    x = (3 * torch.randn(rows, hidden, device=device) + 1).to(dtype).requires_grad_()
    grad = torch.randn(rows, hidden, device=device).to(dtype)
    y = module(x)
    y.backward(grad.clone())
    assert y.dtype == dtype and x.grad.dtype == dtype and module.weight.grad.dtype == dtype
    ref = rmsnorm64(x, module.weight, unit_offset, grad)
    got = (y, x.grad, module.weight.grad)
    if dtype == torch.float32:
        for what, g, r in zip(("y", "dx", "dw"), got, ref):
            assert_fp32(g, r, what)
    else:
        stock = stock_run(x, module.weight, unit_offset, grad)
        truncating = backend == "triton" and _backend.triton_interpreting() and dtype == torch.bfloat16
        slack = one_ulp_of_y_in_dx(x, module.weight, unit_offset, grad, dtype) if truncating else None
        for what, g, s, r in zip(("y", "dx", "dw"), got, stock, ref):
            assert_as_stock(g, s, r, dtype, what, slack if what == "dx" else None)


@pytest.mark.parametrize("unit_offset", FORMS)
def test_non_contiguous_input_and_gradient(backend, device, unit_offset):
    module = module_with(make_weight(8, unit_offset, device), unit_offset, "input", device)
    base = torch.randn(8, 5, device=device, requires_grad=True)
    x = base.t()  # [5, 8], column stride 5
    grad = torch.randn(8, 5, device=device).t()
    assert not x.is_contiguous() and not grad.is_contiguous()
    y = module(x)
    y.backward(grad)
    ref_y, ref_dx, ref_dw = rmsnorm64(x, module.weight, unit_offset, grad)
    assert_fp32(y, ref_y, "y")
    assert_fp32(base.grad.t(), ref_dx, "dx")
    assert_fp32(module.weight.grad, ref_dw, "dw")


def test_three_dims_tuple_shape_and_no_weight(backend, device):
    x = torch.randn(4, 3, 5, device=device, requires_grad=True)
    weight = (torch.rand(3, 5, device=device) + 0.5).requires_grad_()
    y = inplace_rmsnorm(x, (3, 5), weight, eps=1e-5)
    x64 = x.detach().double()
    want = x64 * torch.rsqrt(x64.pow(2).mean((-2, -1), keepdim=True) + 1e-5) * weight.detach().double()
    assert_fp32(y, want, "y over two dims")
    y.sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape
    z = torch.randn(3, 9, device=device, requires_grad=True)
    grad = torch.randn(3, 9, device=device)
    plain = InplaceRMSNorm(9, elementwise_affine=False, device=device)
    assert plain.weight is None and plain.tempo_kept_columns == {}
    out = plain(z)
    out.backward(grad)
    ref_y, ref_dx, _ = rmsnorm64(z, torch.ones(9, device=device), False, grad)
    assert_fp32(out, ref_y, "y without weight")
    assert_fp32(z.grad, ref_dx, "dx without weight")


def test_empty_input(backend, device):
    module = InplaceRMSNorm(5, device=device)
    x = torch.randn(0, 5, device=device, requires_grad=True)
    y = module(x)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert x.grad.shape == (0, 5) and torch.equal(module.weight.grad, torch.zeros(5, device=device))


def test_backend_fixture_really_runs_the_kernels(backend, device, monkeypatch):
    from tempo.ops import rmsnorm

    calls = []
    for name in ("_rmsnorm_fwd_triton", "_rmsnorm_bwd_triton"):
        original = getattr(rmsnorm, name)
        monkeypatch.setattr(rmsnorm, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    x = torch.randn(3, 4, device=device, requires_grad=True)
    InplaceRMSNorm(4, device=device)(x).sum().backward()
    assert calls == (["_rmsnorm_fwd_triton", "_rmsnorm_bwd_triton"] if backend == "triton" else [])


def test_fp64_gradcheck_reference(device):
    with use_backend("reference"):
        x = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
        weight = (torch.rand(5, dtype=torch.float64, device=device) + 0.5).requires_grad_()
        for unit_offset in (False, True):
            assert torch.autograd.gradcheck(lambda a, w: inplace_rmsnorm(a, 5, w, unit_offset=unit_offset), (x, weight))


@pytest.mark.parametrize("unit_offset", FORMS)
def test_wide_rows_two_kernel_backward(backend, device, unit_offset, monkeypatch):
    """Rows wider than BWD_BLOCK_MAX take the row-sums + column-chunks backward; made cheap for the
    interpreter by narrowing both limits (the real widths are compiled by compile_check)."""
    from tempo.ops import layernorm, rmsnorm

    monkeypatch.setattr(layernorm, "BWD_BLOCK_MAX", 64)
    monkeypatch.setattr(layernorm, "_WIDE_CHUNK", 64)  # the backward plan's chunks ...
    monkeypatch.setattr(rmsnorm, "_WIDE_CHUNK", 64)  # ... and the kernels' CHUNK
    n, rows = 150, 7  # 3 column chunks, the last partial
    weight = make_weight(n, unit_offset, device)
    weight[5] = -1.0 if unit_offset else 0.0  # a kept column in the wide path too
    module = module_with(weight, unit_offset, "input", device)
    x = torch.randn(rows, n, device=device, requires_grad=True)
    grad = torch.randn(rows, n, device=device)
    y = module(x)
    y.backward(grad)
    ref = rmsnorm64(x, module.weight, unit_offset, grad)
    for what, got, want in zip(("y", "dx", "dw"), (y, x.grad, module.weight.grad), ref):
        assert_fp32(got, want, what)


def test_rows_too_long_for_one_block_use_the_reference_path_logged_once(backend, device, caplog, monkeypatch):
    from tempo.ops import rmsnorm

    monkeypatch.setattr(_backend, "_logged_once", set())
    monkeypatch.setattr(rmsnorm, "MAX_TRITON_N", 32)
    calls = []
    monkeypatch.setattr(rmsnorm, "_rmsnorm_fwd_triton", lambda *a: calls.append(a))
    x = torch.randn(2, 40, device=device, requires_grad=True)
    grad = torch.randn(2, 40, device=device)
    weight = torch.rand(40, device=device) + 0.5
    with caplog.at_level(logging.WARNING, logger="tempo"):
        y = inplace_rmsnorm(x, 40, weight)
        y.backward(grad)
        inplace_rmsnorm(x, 40, weight)
    assert calls == []
    ref_y, ref_dx, _ = rmsnorm64(x, weight, False, grad)
    assert_fp32(y, ref_y, "y")
    assert_fp32(x.grad, ref_dx, "dx")
    logged = [r for r in caplog.records if "rows of more than 32 features" in r.getMessage()]
    assert len(logged) == (1 if backend == "triton" else 0)


def test_a_dtype_the_kernels_do_not_take_runs_on_the_reference_path_logged_once(device, caplog, monkeypatch):
    """Triton asked for (forced, as on CUDA by default): an fp64 weight (or input) runs on the
    reference path in fp64, logged once per dtype; fp32 against an fp64 reference."""
    blocked = triton_blocker(device)
    if blocked is not None:
        (pytest.fail if blocked[0] == "fail" else pytest.skip)(blocked[1])
    monkeypatch.setattr(_backend, "_logged_once", set())
    weight = (torch.rand(6, dtype=torch.float64, device=device) + 0.5).requires_grad_()
    x = torch.randn(3, 6, device=device, requires_grad=True)
    grad = torch.randn(3, 6, device=device)
    with caplog.at_level(logging.WARNING, logger="tempo"), use_backend("triton"):
        y = inplace_rmsnorm(x, 6, weight)
        y.backward(grad)
        inplace_rmsnorm(x, 6, weight)
        inplace_rmsnorm(x.double(), 6, weight.detach().float().requires_grad_())
    ref_y, ref_dx, ref_dw = rmsnorm64(x, weight, False, grad)
    assert y.dtype == torch.float32 and weight.grad.dtype == torch.float64
    assert float((y.detach().double() - ref_y).abs().max()) < 1e-6  # computed in fp64, rounded once
    assert_fp32(x.grad, ref_dx, "dx")
    assert_fp32(weight.grad, ref_dw, "dw")
    messages = [r.getMessage() for r in caplog.records if r.name == "tempo"]
    assert messages == ["inplace_rmsnorm: torch.float64 weights run on the PyTorch reference path; the Triton "
                        "kernels take float32, float16 and bfloat16",
                        "inplace_rmsnorm: torch.float64 inputs run on the PyTorch reference path; the Triton "
                        "kernels take float32, float16 and bfloat16"], messages


# ---------------------------------------------------------------------------------------------
# adversarial weights: exact by construction (a column is recovered within (R) or kept)
# ---------------------------------------------------------------------------------------------
def adversarial_weight(n, unit_offset, dtype, device="cpu"):
    """Well-conditioned columns but the first six: w_eff = 0 (w = 0, or w = −1 for Gemma's form), −0,
    1e-30, −1e-6, 1e-3 and a huge one (1e4; 1e3 for an fp16 output, whose largest value is 65504)."""
    huge = 1e3 if dtype == torch.float16 else 1e4
    w_eff = torch.tensor([0.0, -0.0, 1e-30, -1e-6, 1e-3, huge], device=device)
    weight = make_weight(n, unit_offset, device)
    weight[:6] = w_eff - 1.0 if unit_offset else w_eff
    if unit_offset:  # 1 + w as the forward computes it: −1 exactly, and 1e-30 lost to rounding
        weight[1] = -1.0
    return weight


def expected_kept(weight, unit_offset, dtype):
    w_eff = weight.double() + 1.0 if unit_offset else weight.double()
    return torch.nonzero(w_eff.float().abs() < torch.finfo(dtype).tiny).flatten().tolist()


@pytest.mark.parametrize("unit_offset", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [12, 130])
def test_adversarial_weights_give_the_exact_gradient(backend, device, dtype, n, unit_offset):
    """Every gradient (dx, dw, all columns) as close to the fp64 RMSNorm's as the rounding of y in
    its dtype allows; the kept columns are exactly those with |w_eff| below λ_D (w_eff = 0 always;
    1e-6 and 1e-30 too for an fp16 output; Gemma's −1 + 1e-30 rounds to −1 and is kept)."""
    torch.manual_seed(n)
    weight = adversarial_weight(n, unit_offset, dtype, device)
    module = module_with(weight, unit_offset, "input", device)  # fp32 weight, an output in x's dtype
    x = torch.randn(9, n, device=device).to(dtype).requires_grad_()
    grad = torch.randn(9, n, device=device).to(dtype)
    y = module(x)
    y.backward(grad.clone())
    assert module.tempo_kept_columns[dtype].tolist() == expected_kept(weight, unit_offset, dtype)
    assert 0 in module.tempo_kept_columns[dtype].tolist()
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}[dtype]
    ref = rmsnorm64(x, module.weight, unit_offset, grad)
    for what, got, want in zip(("y", "dx", "dw"), (y, x.grad, module.weight.grad), ref):
        assert torch.isfinite(got).all(), what
        assert relative_error(got, want) <= tol, (what, relative_error(got, want))
        if what == "dw":  # column by column: a wrong column would hide in a max over large ones
            err = (got.double() - want).abs() / (want.abs() + 1)
            assert (err <= tol).all(), f"dw: columns {torch.nonzero(err > tol).flatten().tolist()}"


@pytest.mark.parametrize("unit_offset", FORMS)
def test_weight_all_zero_effective_gives_the_exact_gradient(backend, device, unit_offset):
    """w_eff = 0 everywhere: y = 0, dx = 0, and dw = Σ g·x̂ from the kept x̂ (every column kept)."""
    module = InplaceRMSNorm(5, unit_offset=unit_offset, device=device)
    with torch.no_grad():
        module.weight.fill_(-1.0 if unit_offset else 0.0)
    x = torch.randn(3, 5, device=device, requires_grad=True)
    grad = torch.randn(3, 5, device=device)
    y = module(x)
    y.backward(grad)
    assert torch.equal(y, torch.zeros_like(y)) and torch.equal(x.grad, torch.zeros_like(x))
    assert module.tempo_kept_columns[torch.float32].tolist() == [0, 1, 2, 3, 4]
    assert_fp32(module.weight.grad, rmsnorm64(x, module.weight, unit_offset, grad)[2], "dw")


def test_kept_columns_are_exactly_those_below_the_smallest_normal():
    """The shared plan with β = None: |w_eff| < λ_D; Gemma's form plans w + 1 (weight_offset 1)."""
    weight = torch.tensor([1.0, 0.0, 1e-30, 1e-6, -1.0, -1.0 + 2.0**-20, 2.0, -0.0])
    assert plan_kept_columns(weight, None, torch.float32, 8, "cpu", "rms").tolist() == [1, 7]
    assert plan_kept_columns(weight, None, torch.bfloat16, 8, "cpu", "rms").tolist() == [1, 7]
    assert plan_kept_columns(weight, None, torch.float16, 8, "cpu", "rms").tolist() == [1, 2, 3, 7]
    # 1 + w: w = −1 is w_eff = 0; −1 + 2⁻²⁰ is 2⁻²⁰ (exact), below fp16's λ = 2⁻¹⁴ only.
    assert plan_kept_columns(weight, None, torch.float32, 8, "cpu", "rms", 1.0).tolist() == [4]
    assert plan_kept_columns(weight, None, torch.float16, 8, "cpu", "rms", 1.0).tolist() == [4, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_recovered_xhat_meets_the_documented_bound(dtype):
    """(R): |x̂' − x̂| <= (u_D + 3 u_c)(|x̂| + 1) for every recovered column, and the kept columns
    are exact; w_eff drawn around λ_D (y underflowing into D's subnormals) and around 1."""
    torch.manual_seed(0)
    rows, n = 64, 256
    tiny = torch.finfo(dtype).tiny
    w_eff = torch.cat([tiny * torch.exp2(torch.empty(n // 2).uniform_(-4, 4)),
                       torch.exp2(torch.empty(n // 2).uniform_(-3, 3))]) * torch.sign(torch.randn(n))
    x = torch.randn(rows, n, dtype=torch.float64) * 3 + 1
    xhat64 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    cols = plan_kept_columns(w_eff, None, dtype, n, "cpu", "rms")
    assert 0 < cols.numel() < n // 2
    y = (xhat64 * w_eff.double()).to(dtype)
    xhat = recover_xhat(y, cols, xhat64[:, cols].float(), w_eff, None, torch.float32).double()
    bound = (UNIT[dtype] + 3 * UNIT[torch.float32]) * (xhat64.abs() + 1)
    # + the fp32 rounding of the kept x̂ and of w_eff itself (fp32 weights, fp64 reference).
    assert ((xhat - xhat64).abs() <= bound * (1 + 1e-6) + 1e-7 * xhat64.abs()).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_raises_naming_the_layer(backend, device, bad):
    model = nn.Sequential(nn.Linear(4, 4), InplaceRMSNorm(4)).to(device)
    name_layernorms(model)
    with torch.no_grad():
        model[1].weight[2] = bad
    with pytest.raises(ValueError, match=rf"^1: weight \(γ\) holds a non-finite value \({bad}\) at column 2"):
        model(torch.randn(3, 4, device=device))


# ---------------------------------------------------------------------------------------------
# what is kept (the ledger), dtypes, no backward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("unit_offset", FORMS)
def test_ledger_keeps_y_and_rstd_plus_the_kept_columns(backend, device, unit_offset):
    """Per token exactly y + one fp32 rstd, plus x̂ of the K kept columns (fp32) and their K int64
    indices: never the input."""
    n, rows = 32, 6
    module = InplaceRMSNorm(n, unit_offset=unit_offset, device=device)
    x = torch.randn(rows, n, device=device, requires_grad=True)
    for zeroed in ((), (3, 17)):
        with torch.no_grad():
            module.weight.fill_(0.0 if unit_offset else 1.0)
            module.weight[list(zeroed)] = -1.0 if unit_offset else 0.0
        with ActivationLedger(module) as ledger:
            y = module(x)
        y.sum().backward()
        k = len(zeroed)
        kept = [(r.shape, r.dtype) for r in ledger.records if not r.is_parameter]
        assert kept[:2] == [((rows, n), torch.float32), ((rows,), torch.float32)]
        assert ledger.activation_bytes == rows * n * 4 + rows * 4 + (rows * k * 4 + k * 8 if k else 0)
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    with torch.no_grad():
        module.weight.fill_(0.0 if unit_offset else 1.0)
    x16 = torch.randn(rows, n, device=device, dtype=torch.bfloat16, requires_grad=True)
    with ActivationLedger(module) as ledger:
        module(x16)  # "input" rule: a bf16 output
    assert ledger.activation_bytes == rows * n * 2 + rows * 4


@pytest.mark.parametrize("unit_offset", FORMS)
def test_a_narrower_input_is_kept_instead_of_y(backend, device, unit_offset, monkeypatch):
    """A bf16 input with an fp32 output (the "promote" rule, fp32 weight: Qwen3's q/k norms of an
    autocast projection): x is kept (2 bytes per element, not y's 4), and backward recomputes y with
    the forward's kernel: output and gradients bitwise those of the y-keeping op, kept columns too."""
    import tempo.ops.rmsnorm as rmsnorm

    n, rows = 32, 6
    torch.manual_seed(0)
    module = InplaceRMSNorm(n, unit_offset=unit_offset, dtype_rule="promote", device=device)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n) * 3)
        module.weight[[3, 17]] = -1.0 if unit_offset else 0.0  # two kept columns
    x = (torch.randn(rows, n, device=device) * 5).bfloat16().requires_grad_()
    g = torch.randn(rows, n, device=device)
    results = []
    for keep_x in (True, False):
        monkeypatch.setattr(rmsnorm, "keeps_input", lambda x_dtype, out_dtype, keep=keep_x: keep)
        with ActivationLedger(module) as ledger:
            y = module(x)
        assert y.dtype == torch.float32
        dx, dw = torch.autograd.grad(y, [x, module.weight], g)
        kept = [(r.shape, r.dtype) for r in ledger.records if not r.is_parameter]
        results.append((y, dx, dw, kept, ledger.activation_bytes))
    (y1, dx1, dw1, kept1, bytes1), (y0, dx0, dw0, kept0, bytes0) = results
    assert kept1[0] == ((rows, n), torch.bfloat16) and kept0[0] == ((rows, n), torch.float32)
    assert bytes0 - bytes1 == rows * n * (4 - 2)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0) and torch.equal(dw1, dw0)
    monkeypatch.undo()
    assert rmsnorm.keeps_input(torch.bfloat16, torch.float32)
    assert not rmsnorm.keeps_input(torch.float32, torch.float32)
    assert not rmsnorm.keeps_input(torch.bfloat16, torch.bfloat16)


ROWS = 6


def _norm_then_linear_ledger(norm, weights, h=64):
    """Bytes kept by ``norm`` -> Linear(h, h) for ROWS tokens under bf16 autocast (fp32 weights, fp32
    input: the residual stream) or in bf16 (``weights`` "bf16": the model in bf16), as (the norm's,
    the Linear's own, less autocast's bf16 copy of its weight)."""
    torch.manual_seed(0)
    model = nn.Sequential(norm, nn.Linear(h, h))
    x = torch.randn(2, ROWS // 2, h)
    if weights == "bf16":
        model, x = model.bfloat16(), x.bfloat16()
    x.requires_grad_()
    with ActivationLedger(model) as ledger, torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights == "fp32"):
        out = model(x)
    out.float().sum().backward()
    per_module = {m: sum(r.nbytes for r in ledger.records if r.module == m and not r.is_parameter) for m in "01"}
    return per_module["0"], per_module["1"] - (h * h * 2 if weights == "fp32" else 0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_ledger_against_the_stock_norm_under_bf16_autocast(family):
    """Per token per norm, h = 64: Llama's and Gemma3's stock RMSNorms keep their fp32 input and the
    fp32 x̂ (8h + 4 bytes) under bf16 autocast; Tempo keeps y (fp32, the stock dtype) and rstd, 4h + 4.
    In a bf16 model the stock norm keeps an fp32 copy of the input and x̂ (6h + 4, Llama; Gemma 8h + 4)
    and the next Linear its own bf16 input (2h); Tempo's bf16 y is that input: 2h + 4 in all."""
    transformers = pytest.importorskip("transformers")
    cls = {"llama": transformers.models.llama.modeling_llama.LlamaRMSNorm,
           "gemma3": transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm}[family]
    from tempo.integrations.patch import apply_tempo

    h = 64
    stock_norm = cls(h)
    patched_norm = apply_tempo(nn.Sequential(copy.deepcopy(stock_norm)))[0]
    assert type(patched_norm).__name__ == "InplaceRMSNorm" and isinstance(patched_norm, cls)
    stock = _norm_then_linear_ledger(stock_norm, "fp32")
    tempo = _norm_then_linear_ledger(patched_norm, "fp32")
    # Gemma3's stock norm also keeps (1 + w) in fp32: h·4 bytes per layer, not per token.
    stock_extra = h * 4 if family == "gemma3" else 0
    assert stock == (ROWS * (8 * h + 4) + stock_extra, ROWS * 2 * h)
    assert tempo == (ROWS * (4 * h + 4), ROWS * 2 * h)
    stock = _norm_then_linear_ledger(copy.deepcopy(stock_norm), "bf16")
    tempo = _norm_then_linear_ledger(copy.deepcopy(patched_norm), "bf16")
    stock_norm_bytes = ROWS * (6 * h + 4) if family == "llama" else ROWS * (8 * h + 4) + stock_extra
    assert stock == (stock_norm_bytes, ROWS * 2 * h) and tempo == (ROWS * (2 * h + 4), 0)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_without_a_backward_it_runs_the_stock_computation_and_keeps_nothing(device, mode, monkeypatch):
    calls = []
    original = torch.ops.tempo.rmsnorm_fwd
    monkeypatch.setattr(torch.ops.tempo, "rmsnorm_fwd", lambda *a: calls.append(a) or original(*a))
    # Eval mode: in training mode the Triton path (CUDA) runs its forward without a backward too.
    module = module_with(adversarial_weight(16, True, torch.float32, device), True, "input", device).eval()
    x = torch.randn(4, 16, device=device)
    expected = stock_rmsnorm(x, module.weight.detach(), True)
    if mode == "frozen":
        module.requires_grad_(False)
        context = torch.enable_grad()
    else:
        context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        y = module(x)
    assert calls == [] and y.grad_fn is None
    torch.testing.assert_close(y, expected, atol=0, rtol=0)  # the stock code's ops in its order
    module.requires_grad_(True)
    module(x)
    assert len(calls) == 1


@pytest.mark.parametrize("rule,cases", [
    ("promote", {(torch.float32, torch.float32): torch.float32, (torch.bfloat16, torch.float32): torch.float32,
                 (torch.bfloat16, torch.bfloat16): torch.bfloat16, (torch.float32, torch.float16): torch.float32}),
    ("input", {(torch.float32, torch.float32): torch.float32, (torch.bfloat16, torch.float32): torch.bfloat16,
               (torch.float32, torch.bfloat16): torch.float32, (torch.float16, torch.float16): torch.float16}),
    ("weight_if_16bit", {(torch.float32, torch.float32): torch.float32,
                         (torch.bfloat16, torch.float32): torch.float32,
                         (torch.float32, torch.bfloat16): torch.bfloat16,
                         (torch.float16, torch.float16): torch.float16}),
])
def test_each_dtype_rule_returns_the_stock_dtype_under_autocast_too(rule, cases):
    for (x_dtype, w_dtype), want in cases.items():
        module = InplaceRMSNorm(8, dtype_rule=rule, dtype=w_dtype)
        x = torch.randn(3, 8, dtype=x_dtype, requires_grad=True)
        for autocast in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = module(x)
            assert y.dtype == want, (rule, x_dtype, w_dtype, autocast)
            y.float().sum().backward()
            assert x.grad.dtype == x_dtype and module.weight.grad.dtype == w_dtype


def test_under_activation_checkpointing(backend, device):
    module = module_with(make_weight(12, True, device), True, "input", device)
    x = torch.randn(5, 12, device=device)
    grad = torch.randn(5, 12, device=device)
    plain, ckpt = x.clone().requires_grad_(), x.clone().requires_grad_()
    module(plain).backward(grad)
    plain_dw = module.weight.grad.clone()
    module.weight.grad = None
    torch.utils.checkpoint.checkpoint(module, ckpt, use_reentrant=False).backward(grad)
    torch.testing.assert_close(ckpt.grad, plain.grad)
    torch.testing.assert_close(module.weight.grad, plain_dw)


@pytest.mark.parametrize("unit_offset", [False, True])
def test_opcheck(backend, device, unit_offset):
    x = torch.randn(3, 8, device=device, requires_grad=True)
    weight = (torch.rand(8, device=device) + 0.5).requires_grad_()
    with torch.no_grad():
        weight[3] = -1.0 if unit_offset else 0.0  # one kept column
    offset = 1.0 if unit_offset else 0.0
    torch.library.opcheck(torch.ops.tempo.layernorm_plan.default,
                          (weight, None, torch.float32, 8, backend, "rms", offset))
    plan = plan_kept_columns(weight, None, torch.float32, 8, device, "rms", offset)
    assert plan.tolist() == [3]
    torch.library.opcheck(torch.ops.tempo.rmsnorm_fwd.default,
                          (x, 1, weight, plan, 1e-6, unit_offset, torch.float32, backend, "rms"))
    no_plan = torch.empty((0,), dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.tempo.rmsnorm_fwd.default,
                          (torch.randn(2, 3, 4, device=device, requires_grad=True), 2, None, no_plan, 1e-6, False,
                           torch.bfloat16, backend, "rms"))
    # The backward op runs inside backward only (no double backward): no input requires grad.
    torch.library.opcheck(torch.ops.tempo.rmsnorm_bwd.default,
                          (torch.randn(3, 8, device=device), torch.randn(3, 8, device=device),
                           torch.rand(3, device=device) + 0.5, plan, torch.randn(3, 1, device=device), 1,
                           weight.detach(), unit_offset, torch.float32, backend))


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"normalized_shape.*\(4,\).*\(2, 3\)"):
        InplaceRMSNorm(4)(torch.randn(2, 3))
    with pytest.raises(TypeError, match="argument 'input'"):
        InplaceRMSNorm(4)(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"argument 'weight' of shape \(5,\)"):
        inplace_rmsnorm(torch.randn(2, 4), 4, torch.ones(5))
    with pytest.raises(ValueError, match="argument 'dtype_rule' must be one of"):
        InplaceRMSNorm(4, dtype_rule="autocast")
    with pytest.raises(ValueError, match="argument 'eps_name' must be one of"):
        InplaceRMSNorm(4, eps_name="weight")
    with pytest.raises(ValueError, match=r"^norm: weight \(γ\) is on meta but the input is on cpu"):
        inplace_rmsnorm(torch.randn(2, 4, requires_grad=True), 4, torch.ones(4, device="meta"), name="norm")


# ---------------------------------------------------------------------------------------------
# torch.compile, the held plan, host reads
# ---------------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, unit_offset):
        super().__init__()
        self.norm, self.linear = InplaceRMSNorm(8, unit_offset=unit_offset), nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(self.norm(x))


def _grads(model, run, x):
    model.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    run(xr).square().sum().backward()
    return [xr.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("unit_offset", FORMS)
def test_compiled_step_has_no_graph_break_and_follows_an_optimizer_step_that_zeroes_a_column(unit_offset):
    """aot_eager, fullgraph: the compiled gradients are the eager ones; an SGD step that makes w_eff_3
    exactly 0 refreshes the held plan (the post-step hook) before the next compiled forward, which
    keeps column 3 without recompiling for anything but the new K, and stays exact (fp64 reference)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Block(unit_offset)
    with torch.no_grad():
        model.norm.weight.copy_(make_weight(8, unit_offset))
        model.norm.weight[3] = 0.5  # one SGD step of lr 1 and gradient 0.5 (1.5) lands on 0 (−1) exactly
    tempo_refresh(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8)
    for got, want in zip(_grads(model, compiled, x), _grads(model, model, x)):
        torch.testing.assert_close(got, want)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    w = model.norm.weight
    w.grad[3] = 1.5 if unit_offset else 0.5
    optimizer.step()
    assert float(w[3].detach()) + (1.0 if unit_offset else 0.0) == 0.0
    assert model.norm.tempo_kept_columns[torch.float32].tolist() == [3]
    grads = _grads(model, compiled, x)
    for got, want in zip(grads, _grads(model, model, x)):
        torch.testing.assert_close(got, want)
    # And exact against fp64: dw_3 = Σ g·x̂_3 comes from the kept x̂.
    model.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    y = model.norm(xr)
    g = torch.randn(y.shape)
    y.backward(g)
    assert_fp32(w.grad, rmsnorm64(x, w, unit_offset, g)[2], "dw after the step")


def test_a_patched_model_traces_without_a_graph_break():
    """A 2-layer Llama with its RMSNorms replaced (nothing else): one graph, every norm's op in it."""
    pytest.importorskip("transformers")
    from tempo.integrations.patch import apply_tempo

    torch._dynamo.reset()
    model = apply_tempo(build_family("llama"), **NORMS_ONLY).train()
    ids, mask = family_batch()
    explain = torch._dynamo.explain(lambda **b: model(**b).last_hidden_state.sum())
    explained = explain(input_ids=ids, attention_mask=mask)
    ops = [str(op) for graph in explained.ops_per_graph for op in graph if str(op).startswith("tempo.")]
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    assert ops == ["tempo.rmsnorm_fwd"] * 5


def test_the_cuda_path_reads_the_host_only_in_the_optimizer_step():
    """Triton path (the interpreter): forwards and backwards of an unchanged weight read nothing from
    the device; the optimizer step reads once (the plans of every stepped norm, one transfer)."""
    blocked = triton_blocker("cpu")
    if blocked is not None:
        (pytest.fail if blocked[0] == "fail" else pytest.skip)(blocked[1])
    from test_host_reads import HostReadCounter

    model = nn.Sequential(*[_Block(unit_offset=i % 2 == 1) for i in range(3)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    counter = HostReadCounter()
    with use_backend("triton"), counter.installed():
        model(x).square().sum().backward()
        optimizer.step()
        with counter.counting():
            model(x).square().sum().backward()
        assert counter.total == 0, counter.table()
        with counter.counting():
            optimizer.step()
        assert counter.total == 1, counter.table()


# ---------------------------------------------------------------------------------------------
# The recipe: every family's RMSNorm, recognised by structure
# ---------------------------------------------------------------------------------------------
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)
# The RMSNorm recipe alone (apply_tempo's layernorm option; the other swaps have their own tests).
NORMS_ONLY = dict(gelu=False, attention=False, dropout_add_layernorm=False)

# family: (model class, config class, config overrides, (norms replaced, Gemma form, dtype rule)).
FAMILIES = {
    "llama": ("LlamaModel", "LlamaConfig", dict(num_key_value_heads=1, max_position_embeddings=64),
              (5, False, "promote")),
    "qwen3": ("Qwen3Model", "Qwen3Config", dict(num_key_value_heads=1, head_dim=16, max_position_embeddings=64),
              (9, False, "promote")),
    "eurobert": ("EuroBertModel", "EuroBertConfig", dict(num_key_value_heads=2, max_position_embeddings=64,
                                                         pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                         mask_token_id=3), (5, False, "promote")),
    # EmbeddingGemma: Gemma3TextModel, bidirectional, sliding and global layers, (1 + w) norms.
    "gemma3": ("Gemma3TextModel", "Gemma3TextConfig", dict(
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, use_bidirectional_attention=True,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"]), (13, True, "input")),
    # EmbeddingGemma 2 (an encoder): w-form norms returning x's dtype; its v_norm has no weight (stays).
    "embeddinggemma2": ("EmbeddingGemma2TextModel", "EmbeddingGemma2TextConfig", dict(
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8), (16, False, "input")),
    # Sentence-T5 / GTR: T5's encoder, T5LayerNorm (x̂ cast to a 16-bit weight's dtype).
    "t5": ("T5EncoderModel", "T5Config", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                              dropout_rate=0.0), (5, False, "weight_if_16bit")),
}


def _family_params():
    transformers = pytest.importorskip("transformers")
    for name, (cls, *_rest) in FAMILIES.items():
        missing = not hasattr(transformers, cls)
        yield pytest.param(name, id=name, marks=pytest.mark.skipif(
            missing, reason=f"transformers {transformers.__version__} has no {cls}: {name} is not in this version"))


def build_family(name, device=None):
    import transformers

    cls, config_cls, overrides, _ = FAMILIES[name]
    small = {k: v for k, v in SMALL.items() if not (name == "t5" and k != "vocab_size")}
    config = getattr(transformers, config_cls)(**{**small, **overrides})
    torch.manual_seed(0)
    if device == "meta":
        with torch.device("meta"):
            return getattr(transformers, cls)(config)
    return getattr(transformers, cls)(config)


def family_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


def rms_norms(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, InplaceRMSNorm)}


def adversarial_norm_weights(model, gemma):
    """Every norm weight random around w_eff ~ 1, with w_eff = 0, 1e-30 and 1e-6 in some columns."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if "RMSNorm" in type(module).__name__ or "LayerNorm" in type(module).__name__:
                if getattr(module, "weight", None) is None:
                    continue
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=g) * 0.5 + (0.0 if gemma else 1.0))
                w[0] = -1.0 if gemma else 0.0
                w[1] = 1e-30
                w[2] = 1e-6


def loss_and_grads(model):
    ids, mask = family_batch()
    model.zero_grad(set_to_none=True)
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)).to(hidden.dtype)
    loss = (hidden * weight * mask[..., None]).sum()
    loss.backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_gradients_as_exact(grads_t, grads_s, exact):
    """Each of Tempo's gradients within 1e-5 of the gradient's scale of the stock fp32 gradient, or no
    farther from the fp64 gradient (``exact``) than 4x the stock model's own fp32 error: adversarial
    norm weights make some gradients ill-conditioned, and two fp32 orders of summation then differ
    by more than 1e-5 (EmbeddingGemma 2's k_proj: 1.5e-5)."""
    for key in grads_s:
        scale = max(float(grads_s[key].abs().max()), 1e-6)
        err = float((grads_t[key] - grads_s[key]).abs().max())
        own = float((grads_s[key].double() - exact[key]).abs().max())
        tempo_err = float((grads_t[key].double() - exact[key]).abs().max())
        assert err <= 1e-5 * scale or tempo_err <= 4 * own, (
            f"{key}: max |Δ| {err:.3g} against max |grad| {scale:.3g}; from fp64 {tempo_err:.3g} against "
            f"the stock model's {own:.3g}")


def stock_and_patched(name, **options):
    from tempo.integrations.patch import apply_tempo

    stock = build_family(name).train()
    adversarial_norm_weights(stock, FAMILIES[name][3][1])
    return stock, apply_tempo(copy.deepcopy(stock), **(options or NORMS_ONLY))


@pytest.mark.parametrize("family", list(_family_params()))
def test_every_family_norm_is_replaced_and_exact(family):
    """The family's own RMSNorm class, recognised by structure: every one replaced (the same weight
    Parameter, an instance of the original class, the form and dtype rule measured), and the whole
    model's output and every gradient within 1e-5 of the stock model's in fp32, with w_eff = 0,
    1e-30 and 1e-6 columns in every norm."""
    stock, patched = stock_and_patched(family)
    count, gemma, rule = FAMILIES[family][3]
    norms = rms_norms(patched)
    assert len(norms) == count
    stock_modules = dict(stock.named_modules())
    for name, norm in norms.items():
        original = stock_modules[name]
        assert isinstance(norm, type(original)) and type(norm).__name__ == "InplaceRMSNorm"
        assert norm.unit_offset == gemma and norm.dtype_rule == rule and norm.tempo_name == name
        eps_name = norm.eps_name
        assert getattr(norm, eps_name) == getattr(original, eps_name)
    assert patched.state_dict().keys() == stock.state_dict().keys()
    _, exact = loss_and_grads(copy.deepcopy(stock).double())  # the yardstick: the stock model in fp64
    out_s, grads_s = loss_and_grads(stock)
    out_t, grads_t = loss_and_grads(patched)
    assert relative_error(out_t, out_s.double()) <= 1e-5
    assert grads_t.keys() == grads_s.keys()
    assert_gradients_as_exact(grads_t, grads_s, exact)


@pytest.mark.parametrize("family", list(_family_params()))
def test_the_same_parameters_and_revert(family):
    stock = build_family(family)
    originals = {name: m for name, m in stock.named_modules() if "Norm" in type(m).__name__}
    weights = {name: m.weight for name, m in originals.items() if getattr(m, "weight", None) is not None}
    from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched

    apply_tempo(stock, **NORMS_ONLY)
    modules = dict(stock.named_modules())
    for name, weight in weights.items():
        assert modules[name].weight is weight
    before = [(n, type(m)) for n, m in stock.named_modules()]
    apply_tempo(stock, **NORMS_ONLY)  # idempotent
    assert [(n, type(m)) for n, m in stock.named_modules()] == before
    assert tempo_patched(stock)["InplaceRMSNorm"] == FAMILIES[family][3][0]
    revert_tempo(stock)
    modules = dict(stock.named_modules())
    for name, original in originals.items():
        assert modules[name] is original
        if name in weights:
            assert original.weight is weights[name]


@pytest.mark.parametrize("how", ["apply", "initialize_weights"])
@pytest.mark.parametrize("family", list(_family_params()))
def test_reinitialised_by_its_own_init_weights_as_the_stock_model(family, how):
    """transformers' _init_weights finds the replacement (``"RMSNorm" in`` its class name, or
    ``isinstance`` with T5LayerNorm) and initialises it as the stock norm: Gemma's to 0, others to 1."""
    stock, patched = stock_and_patched(family)
    for model in (stock, patched):
        torch.manual_seed(3)
        if how == "apply":
            model.apply(model._init_weights)
        else:
            for obj in (*model.modules(), *model.parameters(), *model.buffers()):
                obj.__dict__.pop("_is_hf_initialized", None)
            model.initialize_weights()
    want, got = stock.state_dict(), patched.state_dict()
    norm_keys = [f"{name}.weight" for name in rms_norms(patched)]
    assert all(torch.equal(got[k], want[k]) for k in want)
    fill = 0.0 if FAMILIES[family][3][1] else 1.0
    assert all(torch.equal(got[k], torch.full_like(got[k], fill)) for k in norm_keys)


@pytest.mark.parametrize("family", list(_family_params()))
def test_built_on_the_meta_device(family):
    """Applied on the meta device (no values: the form is measured on a CPU stand-in weight running
    the module's own code), then materialised and loaded: the stock model's numbers."""
    from tempo.integrations.patch import apply_tempo

    meta = apply_tempo(build_family(family, device="meta"), **NORMS_ONLY)
    count, gemma, rule = FAMILIES[family][3]
    norms = rms_norms(meta)
    assert len(norms) == count and all(n.unit_offset == gemma and n.dtype_rule == rule for n in norms.values())
    stock = build_family(family).train()
    adversarial_norm_weights(stock, gemma)
    meta = meta.to_empty(device="cpu").train()
    meta.tie_weights()  # to_empty gives each module a Parameter of its own (T5's shared embedding)
    meta.load_state_dict(stock.state_dict())
    for name, buffer in stock.named_buffers():  # non-persistent buffers (RoPE's inv_freq) are not loaded
        meta.get_buffer(name).copy_(buffer)
    (out_s, grads_s), (out_m, grads_m) = loss_and_grads(stock), loss_and_grads(meta)
    assert relative_error(out_m, out_s.double()) <= 1e-5
    assert grads_m.keys() == grads_s.keys()
    assert_gradients_as_exact(grads_m, grads_s, loss_and_grads(copy.deepcopy(stock).double())[1])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pickle_and_deepcopy_keep_the_replacements(family):
    from tempo.integrations.patch import revert_tempo

    stock, patched = stock_and_patched(family)
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    want = loss_and_grads(patched)
    for clone in (loaded, copy.deepcopy(patched)):
        assert [(n, type(m)) for n, m in clone.named_modules()] == [(n, type(m)) for n, m in patched.named_modules()]
        got = loss_and_grads(clone)
        torch.testing.assert_close(got, want)
        # The clone holds plans of its own weights (the post-step hook and refreshes reach it).
        norm = next(iter(rms_norms(clone).values()))
        assert norm.tempo_kept_columns[torch.float32].tolist() == [0]
        revert_tempo(clone)
        assert [(n, type(m)) for n, m in clone.named_modules()] == [(n, type(m)) for n, m in stock.named_modules()]


def test_a_non_finite_norm_weight_raises_naming_the_module():
    _stock, patched = stock_and_patched("llama")
    with torch.no_grad():
        patched.layers[1].post_attention_layernorm.weight[3] = float("nan")
    with pytest.raises(ValueError, match=r"^layers\.1\.post_attention_layernorm: weight \(γ\) holds a non-finite "
                                         r"value \(nan\) at column 3"):
        loss_and_grads(patched)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_under_autocast_the_stock_dtype_is_returned(family):
    """bf16 autocast, fp32 weights: the patched model returns what the stock one returns (fp32, the
    same numbers: its norms' outputs are in the stock dtype), and its gradients are as close to the
    fp32 model's as the stock ones (Gemma3's q/k norms return bf16, as stock: recovered from it, x̂
    carries bf16's rounding, (R)). Rounding every norm's output to bf16 instead (what returning the
    autocast dtype would do) moves the output by > 1e-3 and the gradients by > 3e-3 relative L2
    (measured 1.65e-3 / 3.90e-3 for Llama, 1.64e-3 / 7.30e-3 for Gemma3, against stock autocast's
    own distance from fp32 of 2.35e-3 / 3.86e-3 and 8.48e-3 / 1.23e-2: tempo/ops/rmsnorm.py)."""
    stock, patched = stock_and_patched(family)
    _out_fp32, grads_fp32 = loss_and_grads(stock)

    def run(model, round_norms=False):
        hooks = [m.register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16))
                 for m in model.modules() if round_norms and "RMSNorm" in type(m).__name__]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, grads = loss_and_grads(model)
        for hook in hooks:
            hook.remove()
        return out, grads

    def rel(a, b):
        if isinstance(b, dict):
            return math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
                             / sum(float(b[k].double().pow(2).sum()) for k in b))
        return float((a.double() - b.double()).norm() / b.double().norm())

    out_s, grads_s = run(stock)
    out_t, grads_t = run(patched)
    out_r, grads_r = run(stock, round_norms=True)
    assert out_t.dtype == out_s.dtype == torch.float32 and out_r.dtype == torch.bfloat16
    assert rel(out_t, out_s) < 1e-6
    assert rel(grads_t, grads_fp32) <= 1.1 * rel(grads_s, grads_fp32)
    assert rel(out_r, out_s) > 1e-3 and rel(grads_r, grads_s) > 3e-3


def test_a_look_alike_that_computes_something_else_is_left_alone_and_logged(caplog):
    """RMSNorm's structure (one 1-D weight, an eps) but a LayerNorm (mean subtracted), another eps
    than the attribute's, or output dtypes no family has: left alone, one line each naming the module
    and why; a real RMSNorm beside them is replaced."""
    from tempo.integrations.patch import apply_tempo

    class CenteredNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(n)), 1e-6

        def forward(self, x):
            x = x - x.mean(-1, keepdim=True)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class OtherEpsNorm(CenteredNorm):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2) * self.weight

    class Fp64Norm(CenteredNorm):
        def forward(self, x):
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).double()

    class GoodNorm(CenteredNorm):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class EpsOutsideNorm(CenteredNorm):  # its eps shows only on rows whose mean(x²) is near eps
        def forward(self, x):
            return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.weight

    model = nn.Sequential(CenteredNorm(8), OtherEpsNorm(8), Fp64Norm(8), GoodNorm(8), EpsOutsideNorm(8))
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(model)
    assert [type(m).__name__ for m in model] == ["CenteredNorm", "OtherEpsNorm", "Fp64Norm", "InplaceRMSNorm",
                                                 "EpsOutsideNorm"]
    for index, cls in ((0, "CenteredNorm"), (1, "OtherEpsNorm"), (4, "EpsOutsideNorm")):
        line = [m for m in caplog.messages if m.startswith(f"apply_tempo: left {index} ({cls}) alone:")]
        assert len(line) == 1, caplog.messages
        assert "it computes neither x·rsqrt(mean(x²) + eps)·w (in torch.float32 it differs by" in line[0]
        assert "nor x·rsqrt(mean(x²) + eps)·(1 + w) (in torch.float32 it differs by" in line[0]
    assert any("left 1 RMSNorm module alone (Fp64Norm: its output dtypes follow none of Llama's, Gemma's or "
               "T5's rules (torch.float32 input, torch.float32 weight -> torch.float64))" in m for m in caplog.messages)
    assert "apply_tempo: replaced 1 RMSNorm -> InplaceRMSNorm" in caplog.messages


def test_modules_without_the_structure_are_not_recognised():
    from tempo.integrations.layers import rmsnorm_eps

    class WithBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias, self.eps = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4)), 1e-6

    class NoEps(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    class TwoDims(NoEps):
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(2, 4)), 1e-6

    class Good(NoEps):
        def __init__(self):
            super().__init__()
            self.epsilon = 1e-5

    assert [rmsnorm_eps(m) for m in (WithBias(), NoEps(), TwoDims(), nn.LayerNorm(4, bias=False))] == [None] * 4
    assert rmsnorm_eps(Good()) == ("epsilon", 1e-5)
    assert rmsnorm_eps(nn.RMSNorm(4, eps=1e-5)) == ("eps", 1e-5)
    assert rmsnorm_eps(nn.RMSNorm(4)) is None  # eps None: finfo(x.dtype).eps at run time, not a number here


# ---------------------------------------------------------------------------------------------
# Bytes moved: the declarations (tempo.movement) against the kernels and a count by hand
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["narrow", "kept-column", "gemma-bf16", "wide-rows", "wide-kept"])
def test_kernels_match_their_declarations(case, monkeypatch):
    """Each Triton launch's distinct bytes loaded and stored, counted in the interpreter, against
    tempo/movement/declarations.py's rmsnorm_fwd/bwd (test_movement.py's check)."""
    from test_movement import _check_against_interpreter

    from tempo.ops import layernorm, rmsnorm

    torch.manual_seed(0)
    n, rows, unit_offset, dtype = {"narrow": (64, 10, False, torch.float32),
                                   "kept-column": (96, 10, False, torch.float32),
                                   "gemma-bf16": (48, 9, True, torch.bfloat16),
                                   "wide-rows": (150, 3, False, torch.float32),
                                   "wide-kept": (150, 3, True, torch.float16)}[case]
    if case.startswith("wide"):  # the two-kernel backward at a width the interpreter runs quickly
        monkeypatch.setattr(layernorm, "BWD_BLOCK_MAX", 64)
        monkeypatch.setattr(layernorm, "_WIDE_CHUNK", 64)
        monkeypatch.setattr(rmsnorm, "_WIDE_CHUNK", 64)
    layer = InplaceRMSNorm(n, unit_offset=unit_offset, dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_()
        if case in ("kept-column", "wide-kept"):
            layer.weight[5] = -1.0 if unit_offset else 0.0
    x = torch.randn(rows, n, dtype=dtype, requires_grad=True)
    _check_against_interpreter(lambda: layer(x).backward(torch.randn(rows, n, dtype=dtype)))


def test_forward_and_backward_with_kept_columns_hand_count():
    """Written out from the tensors the CUDA kernels touch, not from the declaration's code."""
    from test_movement_hand_counts import _declared

    rows, n, k = 10, 96, 2
    layer = InplaceRMSNorm(n, unit_offset=True, dtype=torch.bfloat16)  # Gemma's form, a bf16 model
    with torch.no_grad():
        layer.weight[:k] = -1.0  # w_eff = 0: these columns' x̂ are kept
    x = torch.randn(rows, n, dtype=torch.bfloat16, requires_grad=True)
    declared = _declared(lambda: layer(x).backward(torch.randn(rows, n, dtype=torch.bfloat16)))
    bf16, fp32, int32, int64 = 2, 4, 4, 8
    block = rows * k
    forward = [d for d in declared if d[0] in ("tempo.layernorm_plan", "tempo.rmsnorm_fwd")]
    assert forward == [
        # the plan: w read once, one flag byte per column written
        ("tempo.layernorm_plan", "plan_kept_columns", n * bf16, n),
        # the kernel: x and w (bf16) in; y (bf16) and rstd (fp32 per row) out
        ("tempo.rmsnorm_fwd", "_rmsnorm_fwd_kernel", rows * n * bf16 + n * bf16, rows * n * bf16 + rows * fp32),
        # the host gathers the K kept columns of x (reading the K indices), casts them to fp32, scales by rstd
        ("tempo.rmsnorm_fwd", "x[:, kept_cols]", block * bf16 + k * int64, block * bf16),
        ("tempo.rmsnorm_fwd", "kept.float()", block * bf16, block * fp32),
        ("tempo.rmsnorm_fwd", "kept * rstd", block * fp32 + rows * fp32, block * fp32),
    ]
    backward = {d[1]: d[2:] for d in declared if d[0] == "tempo.rmsnorm_bwd"}
    # w_eff = 1 + w in fp32 (a cast of the bf16 w, the add) and its reciprocal, n each
    assert backward["w.to(float32)"] == (n * bf16, n * fp32) and backward["w + 1"] == (n * fp32, n * fp32)
    # the kernel: dy and y (bf16), rstd, 1/w_eff, and for the kept columns the slots, w_eff and the
    # kept x̂; dx (bf16) and one fp32 partial dw per program (4 in the interpreter) out
    programs = 4
    assert backward["_rmsnorm_bwd_kernel"] == (
        2 * rows * n * bf16 + rows * fp32 + n * fp32 + (n * int32 + n * fp32 + block * fp32),
        rows * n * bf16 + programs * n * fp32)
    assert backward["partials.sum(0)"] == (programs * n * fp32, n * fp32)
