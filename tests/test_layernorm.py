"""In-place LayerNorm: values and every gradient against an fp64 reference, what it keeps for
backward (the ledger), autocast dtypes, γ near zero, nn.LayerNorm interop, compile/opcheck."""

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from conftest import triton_blocker
from torch import nn

from tempo.memory import ActivationLedger
from tempo.ops import _backend
from tempo.ops._backend import use_backend
from tempo.ops.layernorm import (
    InplaceLayerNorm,
    inplace_layernorm,
    name_layernorms,
    plan_kept_columns,
    recover_xhat,
)

# Max error relative to max(1, max|reference|): fp32 tight; fp16/bf16 carry the rounding of y in
# the output dtype (and, in the interpreter, one bf16 ULP from truncating stores).
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}


def reference_fp64(x, normalized_shape, weight, bias, eps, grad):
    """fp64 LayerNorm and its gradients by autograd, written out here independently of Tempo."""
    dims = tuple(range(-len(normalized_shape), 0))
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_() if weight is not None else None
    b64 = bias.detach().double().requires_grad_() if bias is not None else None
    mean = x64.mean(dim=dims, keepdim=True)
    var = ((x64 - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (x64 - mean) / torch.sqrt(var + eps)
    if w64 is not None:
        y = y * w64
    if b64 is not None:
        y = y + b64
    y.backward(grad.double())
    return y.detach(), x64.grad, (w64.grad if w64 is not None else None), (b64.grad if b64 is not None else None)


def assert_close(actual, expected, dtype, what):
    assert actual.shape == expected.shape, what
    err = (actual.double() - expected).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} > {TOL[dtype]:.1g} x {scale:.3g}"


def make_params(shape, device):
    # |γ| in [0.5, 1.5] with random signs: recovering x̂ = (y − β)/γ is well conditioned.
    sign = torch.randint(0, 2, shape, device=device) * 2 - 1
    weight = (torch.rand(shape, device=device) + 0.5) * sign
    bias = 0.1 * torch.randn(shape, device=device)
    return weight, bias


def run_module(module, x, grad):
    y = module(x)
    y.backward(grad.clone())
    return y


# ---------------------------------------------------------------------------------------------
# values and gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(3, 1), (5, 7), (7, 123), (3, 1023), (1, 1500)])
def test_matches_fp64_reference(backend, device, dtype, rows, hidden):
    module = InplaceLayerNorm(hidden, device=device)
    weight, bias = make_params((hidden,), device)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    x = (3 * torch.randn(rows, hidden, device=device) + 1).to(dtype).requires_grad_()
    grad = torch.randn(rows, hidden, device=device).to(dtype)
    y = run_module(module, x, grad)
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert module.weight.grad.dtype == torch.float32
    ref_y, ref_dx, ref_dw, ref_db = reference_fp64(x, (hidden,), module.weight, module.bias, 1e-5, grad)
    assert_close(y, ref_y, dtype, "y")
    assert_close(x.grad, ref_dx, dtype, "dx")
    assert_close(module.weight.grad, ref_dw, dtype, "dweight")
    assert_close(module.bias.grad, ref_db, dtype, "dbias")


def test_three_dims_and_odd_rows_match_nn_layernorm(backend, device):
    ours = InplaceLayerNorm(7, eps=1e-3, device=device)
    theirs = nn.LayerNorm(7, eps=1e-3, device=device)
    weight, bias = make_params((7,), device)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        theirs.bias.copy_(bias)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 7, device=device)
    grad = torch.randn(3, 5, 7, device=device)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = run_module(ours, x_ours, grad), run_module(theirs, x_theirs, grad)
    torch.testing.assert_close(y_ours, y_theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, rtol=1e-4, atol=1e-5)


def test_normalized_shape_tuple(backend, device):
    shape = (3, 5)
    module = InplaceLayerNorm(shape, device=device)
    assert module.weight.shape == shape and module.bias.shape == shape
    weight, bias = make_params(shape, device)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    x = torch.randn(4, 3, 5, device=device, requires_grad=True)
    grad = torch.randn(4, 3, 5, device=device)
    y = run_module(module, x, grad)
    ref_y, ref_dx, ref_dw, ref_db = reference_fp64(x, shape, module.weight, module.bias, 1e-5, grad)
    assert_close(y, ref_y, torch.float32, "y")
    assert_close(x.grad, ref_dx, torch.float32, "dx")
    assert_close(module.weight.grad, ref_dw, torch.float32, "dweight")
    assert_close(module.bias.grad, ref_db, torch.float32, "dbias")


@pytest.mark.parametrize("affine,use_bias", [(False, False), (True, False)])
def test_without_affine_or_bias(backend, device, affine, use_bias):
    module = InplaceLayerNorm(9, elementwise_affine=affine, bias=use_bias, device=device)
    assert (module.weight is None) == (not affine) and module.bias is None
    if affine:
        with torch.no_grad():
            module.weight.copy_(make_params((9,), device)[0])
    x = torch.randn(5, 9, device=device, requires_grad=True)
    grad = torch.randn(5, 9, device=device)
    y = run_module(module, x, grad)
    ref_y, ref_dx, ref_dw, _ = reference_fp64(x, (9,), module.weight, None, 1e-5, grad)
    assert_close(y, ref_y, torch.float32, "y")
    assert_close(x.grad, ref_dx, torch.float32, "dx")
    if affine:
        assert_close(module.weight.grad, ref_dw, torch.float32, "dweight")


def test_functional_bias_without_weight(backend, device):
    bias = (0.1 * torch.randn(6, device=device)).requires_grad_()
    x = torch.randn(4, 6, device=device, requires_grad=True)
    grad = torch.randn(4, 6, device=device)
    y = inplace_layernorm(x, 6, None, bias, eps=1e-5)
    y.backward(grad.clone())
    ref_y, ref_dx, _, ref_db = reference_fp64(x, (6,), None, bias, 1e-5, grad)
    assert_close(y, ref_y, torch.float32, "y")
    assert_close(x.grad, ref_dx, torch.float32, "dx")
    assert_close(bias.grad, ref_db, torch.float32, "dbias")


def test_non_contiguous_input(backend, device):
    module = InplaceLayerNorm(8, device=device)
    with torch.no_grad():
        module.weight.copy_(make_params((8,), device)[0])
    base = torch.randn(8, 5, device=device, requires_grad=True)
    x = base.t()  # [5, 8], column stride 5
    assert not x.is_contiguous()
    grad = torch.randn(8, 5, device=device).t()  # non-contiguous gradient as well
    y = run_module(module, x, grad)
    ref_y, ref_dx, ref_dw, ref_db = reference_fp64(x, (8,), module.weight, module.bias, 1e-5, grad)
    assert_close(y, ref_y, torch.float32, "y")
    assert_close(base.grad.t(), ref_dx, torch.float32, "dx")
    assert_close(module.weight.grad, ref_dw, torch.float32, "dweight")
    assert_close(module.bias.grad, ref_db, torch.float32, "dbias")


def test_empty_input(backend, device):
    module = InplaceLayerNorm(5, device=device)
    x = torch.randn(0, 5, device=device, requires_grad=True)
    y = module(x)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert x.grad.shape == (0, 5)
    assert torch.equal(module.weight.grad, torch.zeros(5, device=device))


def test_backend_fixture_really_runs_the_kernels(backend, device, monkeypatch):
    from tempo.ops import layernorm

    calls = []
    for name in ("_layernorm_fwd_triton", "_layernorm_bwd_triton"):
        original = getattr(layernorm, name)
        monkeypatch.setattr(layernorm, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    x = torch.randn(3, 4, device=device, requires_grad=True)
    InplaceLayerNorm(4, device=device)(x).sum().backward()
    expected = ["_layernorm_fwd_triton", "_layernorm_bwd_triton"] if backend == "triton" else []
    assert calls == expected


def test_fp64_gradcheck_reference(device):
    with use_backend("reference"):
        x = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
        weight = (torch.rand(5, dtype=torch.float64, device=device) + 0.5).requires_grad_()
        bias = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a, w, b: inplace_layernorm(a, 5, w, b), (x, weight, bias))


def test_rows_too_long_for_one_block_use_reference_path(backend, device, caplog, monkeypatch):
    from tempo.ops.layernorm import MAX_TRITON_N

    monkeypatch.setattr(_backend, "_logged_once", set())
    n = MAX_TRITON_N + 3
    x = torch.randn(2, n, device=device, requires_grad=True)
    grad = torch.randn(2, n, device=device)
    with caplog.at_level(logging.WARNING, logger="tempo"):
        y = inplace_layernorm(x, n)
        y.backward(grad.clone())
        inplace_layernorm(x, n)
    ref_y, ref_dx, _, _ = reference_fp64(x, (n,), None, None, 1e-5, grad)
    assert_close(y, ref_y, torch.float32, "y")
    assert_close(x.grad, ref_dx, torch.float32, "dx")
    # The fallback is not silent: logged once per process when Triton was asked for.
    fallbacks = [r for r in caplog.records if r.name == "tempo" and "reference path" in r.getMessage()]
    assert len(fallbacks) == (1 if backend == "triton" else 0)


@pytest.mark.parametrize("affine", [True, False])
def test_wide_rows_two_kernel_backward(backend, device, affine):
    """Rows wider than BWD_BLOCK_MAX: row sums, then column chunks (the one-block kernel spills)."""
    from tempo.ops.layernorm import BWD_BLOCK_MAX

    n, rows = BWD_BLOCK_MAX + 904, 7  # 2 column chunks, the second partial; 4 programs of 2 rows
    module = InplaceLayerNorm(n, elementwise_affine=affine, device=device)
    if affine:
        weight, bias = make_params((n,), device)
        with torch.no_grad():
            module.weight.copy_(weight)
            module.bias.copy_(bias)
    x = (2 * torch.randn(rows, n, device=device) - 1).requires_grad_()
    grad = torch.randn(rows, n, device=device)
    y = run_module(module, x, grad)
    ref_y, ref_dx, ref_dw, ref_db = reference_fp64(x, (n,), module.weight, module.bias, 1e-5, grad)
    assert_close(y, ref_y, torch.float32, "y")
    assert_close(x.grad, ref_dx, torch.float32, "dx")
    if affine:
        assert_close(module.weight.grad, ref_dw, torch.float32, "dweight")
        assert_close(module.bias.grad, ref_db, torch.float32, "dbias")


def test_backward_plan_fills_the_gpu():
    """Several programs per SM (one per SM was latency-bound), each over a run of rows."""
    pytest.importorskip("triton")
    from tempo.ops.layernorm import _backward_plan

    sms = 132  # H100 SXM
    # BERT-large: 32 x 512 tokens of 1024 features: up to 8 programs per SM (1056), 16 rows each
    # (1024 programs: none is left without rows).
    assert _backward_plan(16384, 1024, sms) == (False, 1024, 16, 1)
    assert _backward_plan(16384, 4096, sms) == (False, 261, 63, 1)  # 2 per SM fit at 4096
    # The 16384-wide row: 4 column chunks x 261 row runs.
    assert _backward_plan(16384, 16384, sms) == (True, 261, 63, 4)
    # Few rows: one per program; the interpreter runs at most 4 programs.
    assert _backward_plan(10, 1024, sms) == (False, 10, 1, 1)
    assert _backward_plan(7, 1024, None) == (False, 4, 2, 1)
    assert _backward_plan(7, 1023, None)[2] * 4 >= 7


@pytest.mark.parametrize("forward_backend", ["triton", "reference"])
def test_backward_in_another_thread_uses_the_forward_backend(device, forward_backend, monkeypatch):
    """use_backend() is thread-local, and CUDA runs backward on autograd's device thread: the
    backward must take the forward's path (recorded in the ctx), not resolve it again there."""
    blocked = triton_blocker(device)
    if blocked is not None:
        (pytest.fail if blocked[0] == "fail" else pytest.skip)(blocked[1])
    from tempo.ops import layernorm

    calls = []
    for path in ("triton", "reference"):
        name = f"_layernorm_bwd_{path}"
        original = getattr(layernorm, name)
        monkeypatch.setattr(layernorm, name, lambda *a, _f=original, _p=path: calls.append(_p) or _f(*a))
    # In the backward's thread no use_backend() is active, so TEMPO_BACKEND would decide there:
    # make it the other backend.
    monkeypatch.setenv("TEMPO_BACKEND", "reference" if forward_backend == "triton" else "triton")
    module = InplaceLayerNorm(6, device=device)
    with torch.no_grad():
        module.weight.copy_(make_params((6,), device)[0])
    x = torch.randn(5, 6, device=device, requires_grad=True)
    grad = torch.randn(5, 6, device=device)
    with use_backend(forward_backend):
        y = module(x)
    errors = []

    def backward():
        try:
            y.backward(grad.clone())
        except BaseException as err:  # re-raised in the test's thread below
            errors.append(err)

    worker = threading.Thread(target=backward)
    worker.start()
    worker.join()
    assert not errors, errors
    assert calls == [forward_backend]
    _, ref_dx, ref_dw, _ = reference_fp64(x, (6,), module.weight, module.bias, 1e-5, grad)
    assert_close(x.grad, ref_dx, torch.float32, "dx")
    assert_close(module.weight.grad, ref_dw, torch.float32, "dweight")


@pytest.mark.parametrize("x_shape,normalized_shape", [((2, 3, 8), (8,)), ((4, 3, 5), (3, 5)), ((6,), (6,))])
def test_output_is_not_a_view(backend, device, x_shape, normalized_shape):
    # y is allocated in x's shape, not a 2-D buffer viewed back (FSDP2 warns about view outputs).
    x = torch.randn(x_shape, device=device, requires_grad=True)
    weight = torch.rand(normalized_shape, device=device, requires_grad=True)
    y = inplace_layernorm(x, normalized_shape, weight)
    assert y.shape == x.shape and y._base is None and not y._is_view()
    y.sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


# ---------------------------------------------------------------------------------------------
# γ near zero, large β: exact by construction (a column is recovered within (R) or kept)
# ---------------------------------------------------------------------------------------------
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
# γ values the recovery cannot divide by (or can only badly) and β values that swamp them.
ADVERSARIAL_GAMMAS = (0.0, -0.0, 1e-30, -1e-6, 1e-3, 0.05)


def adversarial_params(n, device, gammas=ADVERSARIAL_GAMMAS, beta=10.0):
    """Well-conditioned columns (|γ| ~ 1, small β) except the first len(gammas) columns, which get
    the given γ and β = ±beta, plus one column with γ = 1 and β = 10 (κ = 10 > 1 without a small γ)."""
    weight, bias = make_params((n,), device)
    k = len(gammas)
    weight[:k] = torch.tensor(gammas, device=device)
    bias[:k] = beta * torch.where(torch.arange(k, device=device) % 2 == 0, 1.0, -1.0)
    weight[k], bias[k] = 1.0, 10.0
    return weight, bias


def test_kept_columns_are_exactly_the_ill_conditioned_ones():
    weight = torch.tensor([1.0, 0.0, 1e-30, 1e-3, 2.0, 1.0, -0.5, 0.4])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.1, 1.9, 1.5, 0.5, -0.4])
    # |γ| < |β| + λ: γ = 0 (even with β = 0), 1e-3 < 0.1, 1 < 1.5; 2 > 1.9 is recovered. With an
    # fp32 output (λ = 2^-126) 1e-30 and |γ| = |β| (0.5, 0.4) are recovered; with fp16 (λ = 6.1e-5) not.
    assert plan_kept_columns(weight, bias, torch.float32, 8, "cpu", "ln").tolist() == [1, 3, 5]
    assert plan_kept_columns(weight, bias, torch.float16, 8, "cpu", "ln").tolist() == [1, 2, 3, 5, 6, 7]
    # No γ: γ = 1, so only |β| > 1 is kept; no β: only γ below the smallest normal.
    assert plan_kept_columns(None, bias, torch.float32, 8, "cpu", "ln").tolist() == [4, 5]
    assert plan_kept_columns(weight, None, torch.float32, 8, "cpu", "ln").tolist() == [1]
    assert plan_kept_columns(None, None, torch.float32, 8, "cpu", "ln").numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_recovered_xhat_meets_the_documented_bound(dtype):
    """(R): |x̂' − x̂| <= (u_D + 3 u_c)(|x̂| + 1) for every recovered column, and the kept columns
    are exact; γ, β drawn around the threshold |γ| = |β| + λ, where the bound is tightest."""
    torch.manual_seed(0)
    rows, n = 64, 256
    bias = 4 * torch.randn(n)
    weight = bias.abs() * torch.exp(torch.empty(n).uniform_(-3, 3)) * torch.sign(torch.randn(n))
    x = torch.randn(rows, n, dtype=torch.float64) * 3 + 1
    xhat64 = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    cols = plan_kept_columns(weight, bias, dtype, n, "cpu", "ln")
    assert 0 < cols.numel() < n
    y = (xhat64 * weight.double() + bias.double()).to(dtype)
    xhat = recover_xhat(y, cols, xhat64[:, cols].float(), weight, bias, torch.float32).double()
    bound = (UNIT_ROUNDOFF[dtype] + 3 * UNIT_ROUNDOFF[torch.float32]) * (xhat64.abs() + 1)
    # + the fp32 rounding of the kept x̂ and of γ, β themselves (fp32 parameters, fp64 reference).
    assert ((xhat - xhat64).abs() <= bound * (1 + 1e-6) + 1e-7 * xhat64.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [12, 130])
def test_adversarial_gamma_and_beta_give_the_stock_gradient(backend, device, dtype, n):
    """γ ∈ {0, 1e-30, 1e-6, 1e-3, ...}, |β| = 10: every gradient (dx, dγ, dβ, all columns) as close
    to the fp64 LayerNorm's as the rounding of y in its dtype allows: no column is wrong."""
    torch.manual_seed(n)
    weight, bias = adversarial_params(n, device)
    module = InplaceLayerNorm(n, device=device)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    x = (3 * torch.randn(9, n, device=device) + 1).to(dtype).requires_grad_()
    grad = torch.randn(9, n, device=device).to(dtype)
    y = run_module(module, x, grad)
    ref_y, ref_dx, ref_dw, ref_db = reference_fp64(x, (n,), module.weight, module.bias, 1e-5, grad)
    for what, got, ref in (("y", y, ref_y), ("dx", x.grad, ref_dx), ("dweight", module.weight.grad, ref_dw),
                           ("dbias", module.bias.grad, ref_db)):
        assert torch.isfinite(got).all(), what
        assert_close(got, ref, dtype, what)
        # Column by column too: a wrong column would hide in a max over large ones.
        if got.dim() == 1:
            err = (got.double() - ref).abs() / (ref.abs() + 1)
            assert (err <= TOL[dtype]).all(), f"{what}: columns {torch.nonzero(err > TOL[dtype]).flatten().tolist()}"


def test_gamma_all_zero_gives_the_exact_gradient(backend, device):
    module = InplaceLayerNorm(5, device=device)
    with torch.no_grad():
        module.weight.zero_()
    x = torch.randn(3, 5, device=device, requires_grad=True)
    grad = torch.randn(3, 5, device=device)
    y = run_module(module, x, grad)
    assert torch.equal(y, torch.zeros_like(y))
    # γ = 0: dx = 0, dβ = Σ g, and dγ = Σ g·x̂ from the kept x̂ (every column is kept).
    assert torch.equal(x.grad, torch.zeros_like(x))
    torch.testing.assert_close(module.bias.grad, grad.sum(0))
    _, _, ref_dw, _ = reference_fp64(x, (5,), module.weight, module.bias, 1e-5, grad)
    assert_close(module.weight.grad, ref_dw, torch.float32, "dweight")


def test_ledger_counts_the_kept_columns(backend, device):
    """What is kept: y + rstd, plus x̂ of the K ill-conditioned columns (fp32) and their int64 indices."""
    n, rows = 32, 6
    module = InplaceLayerNorm(n, device=device)
    x = torch.randn(rows, n, device=device, requires_grad=True)
    for gammas, k in (((), 0), ((0.0, 1e-7), 3)):  # adversarial_params adds the γ = 1, β = 10 column
        weight, bias = adversarial_params(n, device, gammas) if gammas else (torch.ones(n), torch.zeros(n))
        with torch.no_grad():
            module.weight.copy_(weight)
            module.bias.copy_(bias)
        with ActivationLedger(module) as ledger:
            module(x).sum().backward()
        extra = rows * k * 4 + k * 8 if k else 0
        assert ledger.activation_bytes == rows * n * 4 + rows * 4 + extra, (gammas, ledger.records)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["weight", "bias"])
def test_non_finite_parameters_raise_naming_the_layer(backend, device, bad, where):
    model = nn.Sequential(nn.Linear(4, 4), InplaceLayerNorm(4)).to(device)
    name_layernorms(model)
    with torch.no_grad():
        getattr(model[1], where)[2] = bad
    x = torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match=rf"^1: {where} \(.\) holds a non-finite value \({bad}\) at column 2"):
        model(x)
    unnamed = InplaceLayerNorm(4).to(device)
    with torch.no_grad():
        getattr(unnamed, where)[0] = bad
    with pytest.raises(ValueError, match="^InplaceLayerNorm: "):
        unnamed(x)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_without_a_backward_it_runs_the_stock_op_and_keeps_nothing(device, mode, monkeypatch):
    calls = []
    original = torch.ops.tempo.layernorm_fwd
    monkeypatch.setattr(torch.ops.tempo, "layernorm_fwd", lambda *a: calls.append(a) or original(*a))
    # Eval mode: in training mode the Triton path (CUDA) runs its forward without a backward too.
    module = InplaceLayerNorm(16, device=device).eval()
    weight, bias = adversarial_params(16, device)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    x = torch.randn(4, 16, device=device)
    expected = nn.functional.layer_norm(x, (16,), module.weight, module.bias)
    if mode == "frozen":
        module.requires_grad_(False)
        context = torch.enable_grad()
    else:
        context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context, torch.autocast(device, dtype=torch.bfloat16, enabled=True):
        y = module(x)
    assert calls == [] and y.grad_fn is None
    assert y.dtype == torch.bfloat16  # what the Tempo path returns under autocast
    torch.testing.assert_close(y.float(), expected, atol=0, rtol=2**-8)
    with torch.enable_grad():
        module.requires_grad_(True)
        module(x)
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------
# autocast dtypes and what is kept for backward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_autocast_returns_autocast_dtype(backend, device, input_dtype):
    module = InplaceLayerNorm(16, device=device)
    with torch.no_grad():
        module.weight.copy_(make_params((16,), device)[0])
    x = torch.randn(3, 16, device=device).to(input_dtype).requires_grad_()
    grad = torch.randn(3, 16, device=device).to(torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = module(x)
    assert y.dtype == torch.bfloat16
    y.backward(grad.clone())
    assert x.grad.dtype == input_dtype and module.weight.grad.dtype == torch.float32
    ref_y, ref_dx, ref_dw, ref_db = reference_fp64(x, (16,), module.weight, module.bias, 1e-5, grad)
    assert_close(y, ref_y, torch.bfloat16, "y")
    assert_close(x.grad, ref_dx, torch.bfloat16, "dx")
    assert_close(module.weight.grad, ref_dw, torch.bfloat16, "dweight")
    assert_close(module.bias.grad, ref_db, torch.bfloat16, "dbias")
    # Outside autocast the output keeps the input dtype; an explicit out_dtype wins.
    assert module(x).dtype == input_dtype
    assert inplace_layernorm(x, 16, out_dtype=torch.float16).dtype == torch.float16


def test_ledger_autocast_keeps_only_output_and_rstd(backend, device):
    """Under bf16 autocast InplaceLayerNorm -> Linear keeps y (bf16, shared with the Linear) and
    rstd; nn.LayerNorm -> Linear keeps the fp32 input, mean, rstd and the Linear's bf16 copy."""
    rows, hidden = 6, 64

    def ledger_for(norm):
        model = nn.Sequential(norm, nn.Linear(hidden, hidden)).to(device)
        x = torch.randn(2, 3, hidden, device=device, requires_grad=True)  # fp32, e.g. a residual sum
        with ActivationLedger(model) as ledger:
            with torch.autocast(device, dtype=torch.bfloat16):
                out = model(x)
        out.float().sum().backward()  # the kept tensors suffice for backward
        return ledger

    tempo = ledger_for(InplaceLayerNorm(hidden))
    stock = ledger_for(nn.LayerNorm(hidden))

    bf16_linear_weight = hidden * hidden * 2  # autocast's bf16 copy of the Linear weight
    y_bytes, rstd_bytes = rows * hidden * 2, rows * 4
    norm_records = [r for r in tempo.records if r.module == "0" and not r.is_parameter]
    assert [(r.shape, r.dtype, r.nbytes) for r in norm_records] == [
        ((2, 3, hidden), torch.bfloat16, y_bytes), ((rows,), torch.float32, rstd_bytes)]
    linear_records = [r for r in tempo.records if r.module == "1" and not r.is_parameter]
    assert [(r.dtype, r.nbytes) for r in linear_records] == [(torch.bfloat16, bf16_linear_weight)]
    assert tempo.activation_bytes == y_bytes + rstd_bytes + bf16_linear_weight == 8984

    # nn.LayerNorm: fp32 input + mean + rstd, and the Linear's own bf16 copy of its input.
    assert stock.activation_bytes == rows * hidden * 4 + 2 * rows * 4 + y_bytes + bf16_linear_weight == 10544
    assert tempo.activation_bytes < stock.activation_bytes


def test_ledger_without_autocast_never_keeps_the_input(backend, device):
    module = InplaceLayerNorm(10, device=device)
    x = torch.randn(7, 10, device=device, requires_grad=True)
    with ActivationLedger(module) as ledger:
        y = module(x)
    kept = [(r.shape, r.dtype) for r in ledger.records if not r.is_parameter]
    assert kept == [((7, 10), torch.float32), ((7,), torch.float32)]
    assert ledger.activation_bytes == 7 * 10 * 4 + 7 * 4
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------
# nn.LayerNorm interop
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"elementwise_affine": False}, {"bias": False}, {"eps": 1e-6}])
def test_state_dict_and_repr_match_nn_layernorm(kwargs):
    stock = nn.LayerNorm((4, 6), **kwargs)
    ours = InplaceLayerNorm((4, 6), **kwargs)
    assert ours.extra_repr() == stock.extra_repr()
    assert ours.state_dict().keys() == stock.state_dict().keys()
    for name, param in stock.named_parameters():
        assert getattr(ours, name).shape == param.shape and getattr(ours, name).dtype == torch.float32
        with torch.no_grad():
            param.normal_()
    ours.load_state_dict(stock.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value)
    back = nn.LayerNorm((4, 6), **kwargs)
    back.load_state_dict(ours.state_dict())
    assert ours.normalized_shape == stock.normalized_shape == (4, 6)


def test_reexported_from_original_path():
    from tempo.inplace_layernorm import InplaceLayerNorm as Reexported

    assert Reexported is InplaceLayerNorm


# ---------------------------------------------------------------------------------------------
# checkpoint, compile, opcheck
# ---------------------------------------------------------------------------------------------
def test_under_activation_checkpointing(backend, device):
    module = InplaceLayerNorm(12, device=device)
    with torch.no_grad():
        module.weight.copy_(make_params((12,), device)[0])
    x = torch.randn(5, 12, device=device)
    grad = torch.randn(5, 12, device=device)
    plain_x, ckpt_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    run_module(module, plain_x, grad)
    plain_dw = module.weight.grad.clone()
    module.weight.grad = None
    y = torch.utils.checkpoint.checkpoint(module, ckpt_x, use_reentrant=False)
    y.backward(grad.clone())
    torch.testing.assert_close(ckpt_x.grad, plain_x.grad)
    torch.testing.assert_close(module.weight.grad, plain_dw)


@pytest.mark.slow
def test_torch_compile_fullgraph():
    module = InplaceLayerNorm(16)

    def step(x):
        return module(x * 2.0).square().sum()

    x = torch.randn(3, 16)
    with use_backend("reference"):
        eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        step(eager_x).backward()
        torch.compile(step, fullgraph=True)(compiled_x).backward()
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)


@pytest.mark.parametrize("with_affine", [True, False])
def test_opcheck(backend, device, with_affine):
    x = torch.randn(3, 8, device=device, requires_grad=True)
    weight = (torch.rand(8, device=device) + 0.5).requires_grad_() if with_affine else None
    bias = torch.randn(8, device=device, requires_grad=True) if with_affine else None
    if with_affine:
        with torch.no_grad():
            weight[3] = 0.0  # one kept column: a K > 0 plan is exercised too
        # The plan op: its output length depends on γ/β's values (a data-dependent shape).
        torch.library.opcheck(torch.ops.tempo.layernorm_plan.default, (weight, bias, torch.float32, 8, backend, "ln"))
    plan = plan_kept_columns(weight, bias, torch.float32, 8, device, "ln")
    assert (3 in plan.tolist()) == with_affine
    torch.library.opcheck(torch.ops.tempo.layernorm_fwd.default,
                          (x, 1, weight, bias, plan, 1e-5, torch.float32, backend, "ln"))
    x3 = torch.randn(2, 3, 4, device=device, requires_grad=True)  # normalized over the last 2 dims
    flat_w = (torch.rand(12, device=device) + 0.5).requires_grad_() if with_affine else None
    no_plan = torch.empty((0,), dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.tempo.layernorm_fwd.default,
                          (x3, 2, flat_w, None, no_plan, 1e-5, torch.float32, backend, "ln"))
    # The backward op runs inside backward only (no double backward): no input requires grad.
    detached = [t.detach() if t is not None else None for t in (weight, bias)]
    y = torch.randn(3, 8, device=device)
    rstd = torch.rand(3, device=device) + 0.5
    cols = torch.tensor([3] if with_affine else [], dtype=torch.int64, device=device)
    kept = torch.randn(3, cols.numel(), device=device)
    torch.library.opcheck(torch.ops.tempo.layernorm_bwd.default,
                          (torch.randn(3, 8, device=device), y, rstd, cols, kept, 1, *detached, torch.float32,
                           backend))


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def test_normalized_shape_mismatch_raises_value_error():
    module = InplaceLayerNorm((3, 4))
    with pytest.raises(ValueError, match=r"normalized_shape.*\(3, 4\).*\(2, 4, 3\)"):
        module(torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="normalized_shape"):
        inplace_layernorm(torch.randn(4), (2, 4))
    with pytest.raises(ValueError, match="weight"):
        inplace_layernorm(torch.randn(2, 4), 4, torch.ones(5))


def test_integer_input_raises_type_error():
    with pytest.raises(TypeError, match="input"):
        InplaceLayerNorm(4)(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="weight"):
        inplace_layernorm(torch.randn(2, 4), 4, torch.ones(4, dtype=torch.int32))


def test_triton_backend_rejects_fp64(backend, device):
    module = InplaceLayerNorm(4, dtype=torch.float64, device=device)
    x = torch.randn(2, 4, dtype=torch.float64, device=device)
    if backend == "reference":
        assert module(x).dtype == torch.float64
    else:
        with pytest.raises(TypeError, match="float64"):
            module(x)


def test_broken_triton_import_is_logged_and_exposed():
    """A Triton that fails to import leaves the reference path working, logs a warning once and
    exposes the error (forcing 'triton' then names it); it is not swallowed silently."""
    script = """
import logging, sys
records = []
logging.getLogger("tempo").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r)})())
class Broken:
    def find_spec(self, name, path=None, target=None):
        if name == "triton":
            raise ImportError("libtriton.so: undefined symbol (simulated)")
sys.meta_path.insert(0, Broken())
import torch
from tempo.ops import _backend
from tempo.ops.layernorm import inplace_layernorm
assert not _backend.TRITON_AVAILABLE and "simulated" in repr(_backend.triton_import_error())
assert [r.levelname for r in records] == ["WARNING"] and "simulated" in records[0].getMessage()
assert inplace_layernorm(torch.randn(2, 4, requires_grad=True), 4).shape == (2, 4)
try:
    with _backend.use_backend("triton"):
        inplace_layernorm(torch.randn(2, 4, requires_grad=True), 4)
except RuntimeError as err:
    assert "simulated" in str(err), err
else:
    raise AssertionError("forcing triton did not raise")
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# The plan per parameter version (issue 28): no host read while γ and β are unchanged
# ---------------------------------------------------------------------------------------------
def _plan_reads(fn):
    """Host reads Tempo's code makes while ``fn`` runs (see test_host_reads.py)."""
    from test_host_reads import HostReadCounter

    counter = HostReadCounter()
    with counter.installed(), counter.counting():
        fn()
    return counter.total


def _triton_or_skip():
    blocked = triton_blocker("cpu")
    if blocked is not None:
        pytest.skip(blocked[1])


def test_plan_is_made_once_per_parameter_version():
    """Triton path: construction makes the plan (one read), forwards, backwards and the
    recomputation under activation checkpointing read nothing; an in-place update reads once."""
    _triton_or_skip()
    assert _plan_reads(lambda: InplaceLayerNorm(16)) == 1
    module = InplaceLayerNorm(16)
    x = torch.randn(4, 16, requires_grad=True)
    with use_backend("triton"):
        assert _plan_reads(lambda: module(x).sum().backward()) == 0
        assert _plan_reads(lambda: module(x).sum().backward()) == 0
        checkpointed = lambda: torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False).sum().backward()  # noqa: E731
        assert _plan_reads(checkpointed) == 0
        with torch.no_grad():
            module.weight.mul_(1.5)
        assert _plan_reads(lambda: module(x).sum().backward()) == 1
        assert _plan_reads(lambda: module(x).sum().backward()) == 0


def test_plan_is_made_per_output_dtype():
    """One layer run with fp32 output, then fp16 (autocast, say): |γ_2| = 1e-5 is recoverable in fp32
    and below fp16's λ_D (6.1e-5), so the fp16 plan keeps column 2 and the fp32 plan does not."""
    from tempo.ops.layernorm import cached_kept_columns, plan_kept_columns

    module = InplaceLayerNorm(8)
    with torch.no_grad():
        module.weight[2] = 1e-5
    for dtype, want in ((torch.float32, []), (torch.float16, [2]), (torch.float32, [])):
        args = (module.weight, module.bias, dtype, 8, torch.device("cpu"), "ln")
        assert cached_kept_columns(*args).tolist() == plan_kept_columns(*args).tolist() == want


def test_plan_cache_tells_views_of_one_parameter_apart():
    """γ of two layers as rows of one [2, 8] parameter (views sharing a base and its version
    counter): the cache keys each on the base and the view's geometry, so each row gets its own
    plan (row 1's γ_3 = 1e-30 < |β_3| = 0.5 is kept, row 0 keeps nothing)."""
    from tempo.ops.layernorm import cached_kept_columns, forget_kept_column_plans

    forget_kept_column_plans()
    base = nn.Parameter(torch.ones(2, 8))
    bias = torch.full((8,), 0.5)
    with torch.no_grad():
        base[1, 3] = 1e-30
    rest = (bias, torch.float32, 8, torch.device("cpu"), "ln")
    assert cached_kept_columns(base[0], *rest).tolist() == []
    assert cached_kept_columns(base[1], *rest).tolist() == [3]
    assert cached_kept_columns(base[0], *rest).tolist() == []


def test_plans_of_every_layer_refresh_in_one_read():
    """An optimizer step makes every LayerNorm's plan stale: torch's optimizer post-step hook makes
    the plans of all the layers it stepped again in one transfer, whatever the number of layers,
    and the forwards and backwards read nothing."""
    _triton_or_skip()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), InplaceLayerNorm(8)) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 8)

    with use_backend("triton"):
        for _ in range(3):
            assert _plan_reads(lambda: model(x).square().sum().backward()) == 0
            assert _plan_reads(opt.step) == 1
            opt.zero_grad()


def _unrecoverable_after(idiom, module):
    """Apply ``idiom`` to ``module`` (γ = 1, β_3 = 0.5) so that γ_3 becomes ~0: column 3 kept."""
    from tempo.train.optim import Lamb

    n = module.weight.numel()
    if idiom in ("adamw_foreach", "adamw_fused", "adamw_single", "lamb"):
        kwargs = dict(lr=1.0, weight_decay=0.0)
        opt = {"adamw_foreach": lambda p: torch.optim.AdamW(p, foreach=True, **kwargs),
               "adamw_fused": lambda p: torch.optim.AdamW(p, fused=True, **kwargs),
               "adamw_single": lambda p: torch.optim.AdamW(p, foreach=False, **kwargs),
               "lamb": lambda p: Lamb(p, **kwargs)}[idiom](module.parameters())
        module.weight.grad = torch.zeros(n)
        module.weight.grad[3] = 1.0  # the first Adam step moves γ_3 by lr · g/|g|: to ~0
        module.bias.grad = torch.zeros(n)
        opt.step()
    elif idiom == "handwritten_optimizer":  # an old-style optimizer writing through .data
        class DataSGD(torch.optim.Optimizer):
            def __init__(self, params):
                super().__init__(params, {})

            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.data.add_(p.grad, alpha=-1.0)

        module.weight.grad = torch.zeros(n)
        module.weight.grad[3] = 1.0
        DataSGD(module.parameters()).step()
    elif idiom == "load_state_dict":
        state = {k: v.clone() for k, v in module.state_dict().items()}
        state["weight"][3] = 0.0
        module.load_state_dict(state)
    elif idiom == "nn_init":
        nn.init.constant_(module.weight, 0.25)  # every |γ_j| >= |β_j| but column 3's: 0.25 < 0.5
    elif idiom == "no_grad_copy":
        with torch.no_grad():
            module.weight.copy_(torch.ones(n).index_fill_(0, torch.tensor([3]), 0.0))
    elif idiom == "no_grad_view_write":
        with torch.no_grad():
            module.weight.view(2, n // 2)[0, 3] = 0.0
    elif idiom == "data_assignment":  # as module.to() / module.half() do it
        module.weight.data = torch.ones(n).index_fill_(0, torch.tensor([3]), 0.0)
    elif idiom == "data_write":
        module.weight.data[3] = 0.0
    else:
        raise AssertionError(idiom)


UPDATE_IDIOMS = ["adamw_foreach", "adamw_fused", "adamw_single", "lamb", "handwritten_optimizer", "load_state_dict",
                 "nn_init", "no_grad_copy", "no_grad_view_write", "data_assignment", "data_write"]


@pytest.mark.parametrize("idiom", UPDATE_IDIOMS)
def test_plan_follows_every_update_idiom_but_writes_through_data(idiom):
    """Each way of updating γ invalidates the cached plan, except an in-place write through
    ``.data`` outside an optimizer step (its own version counter): that one is documented, and
    forget_kept_column_plans() recovers from it. (AdamW(fused=True) and the hand-written optimizer
    leave the version counter as it was: torch's optimizer post-step hook is what sees them.)"""
    from tempo.ops.layernorm import cached_kept_columns, forget_kept_column_plans, refresh_kept_column_plans

    module = InplaceLayerNorm(8)
    with torch.no_grad():
        module.bias[3] = 0.5

    def cached():
        return cached_kept_columns(module.weight, module.bias, torch.float32, 8, torch.device("cpu"), "ln").tolist()

    assert cached() == []
    _unrecoverable_after(idiom, module)
    fresh = plan_kept_columns(module.weight, module.bias, torch.float32, 8, "cpu", "ln").tolist()
    assert fresh == [3], (idiom, module.weight)
    if idiom == "data_write":
        assert cached() == []  # the documented hole: the plan of the old values
        forget_kept_column_plans()
    assert cached() == [3]
    if idiom == "data_write":  # and back through .data: refresh_kept_column_plans re-reads the values too
        module.weight.data[3] = 1.0
        assert cached() == [3]
        refresh_kept_column_plans(module)
        assert cached() == [] and module.tempo_kept_columns[torch.float32].tolist() == []


def test_a_non_finite_update_raises_in_the_updated_layer_only():
    """A refresh triggered by one layer makes every stale plan; an error found for another
    layer is raised by that layer's forward, naming it."""
    _triton_or_skip()
    model = nn.Sequential(InplaceLayerNorm(4), InplaceLayerNorm(4))
    name_layernorms(model)
    x = torch.randn(2, 4, requires_grad=True)
    with use_backend("triton"):
        model(x).sum().backward()
        with torch.no_grad():
            model[0].weight.mul_(2.0)
            model[1].weight[1] = float("nan")
        model[0](x).sum().backward()  # refreshes both plans; the first layer is fine
        with pytest.raises(ValueError, match=r"^1: weight \(γ\) holds a non-finite value \(nan\) at column 1"):
            model[1](x)


@pytest.mark.parametrize("where", ["weight", "bias"])
def test_parameters_on_another_device_raise_naming_the_layer(where):
    """γ/β on another device than the input: a ValueError naming the layer, before any kernel
    (on CUDA a kernel would read another device's memory). The meta device stands in for one."""
    model = nn.Sequential(nn.Identity(), InplaceLayerNorm(4))
    name_layernorms(model)
    setattr(model[1], where, nn.Parameter(torch.ones(4, device="meta")))
    with pytest.raises(ValueError, match=rf"^1: {where} \(.\) is on meta but the input is on cpu"):
        model(torch.randn(2, 4, requires_grad=True))
    with pytest.raises(ValueError, match="^inplace_layernorm: "):
        inplace_layernorm(torch.randn(2, 4), (4,), torch.ones(4, device="meta"))


def test_compiled_forward_follows_parameter_updates():
    """Under torch.compile the op gets the module's held plan as a graph input and checks it when it
    runs: a write to γ behind the compiled model's back that changes the number of kept columns
    raises a RuntimeError naming the layer and tempo.refresh_kept_column_plans (never a wrong plan);
    after the refresh, and after a write that only moves the kept column (same K: the op takes the
    current columns), the compiled gradient is nn.LayerNorm's."""
    import tempo

    _triton_or_skip()
    torch._dynamo.reset()
    module = InplaceLayerNorm(8)
    model = nn.Sequential(module)
    name_layernorms(model)
    stock = nn.LayerNorm(8)
    x = torch.randn(3, 8)
    grad = torch.randn(3, 8)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)

    def same_gradient_as_stock():
        stock.load_state_dict(module.state_dict())
        xs = [x.clone().requires_grad_() for _ in range(2)]
        compiled(xs[0]).backward(grad)
        stock(xs[1]).backward(grad)
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-4, atol=1e-5)

    try:
        with use_backend("triton"):
            with torch.no_grad():
                module.bias.fill_(0.5)  # no column kept while every |γ| = 1 > 0.5
            same_gradient_as_stock()
            with torch.no_grad():
                module.weight[3] = 1e-30  # column 3 becomes unrecoverable: K 0 -> 1
            with pytest.raises(RuntimeError, match=r"^0: .* plan of 0 column\(s\) but γ/β now need 1 .*"
                                                   r"tempo\.refresh_kept_column_plans\(model\)"):
                compiled(x.clone().requires_grad_())
            tempo.refresh_kept_column_plans(model)
            assert module.tempo_kept_columns[torch.float32].tolist() == [3]
            same_gradient_as_stock()
            with torch.no_grad():
                module.weight[3] = 1.0
                module.weight[5] = 1e-30  # the kept column moves, K stays 1: no error, the current plan
            same_gradient_as_stock()
    finally:
        torch._dynamo.reset()
