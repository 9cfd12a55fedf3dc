"""DropoutAddLayerNorm = LayerNorm(residual + dropout(x, p)): values and every gradient against an
fp64 reference that uses the very keep-mask the op drew (regenerated from its seed), the mask's
statistics, what it keeps for backward (the ledger), dtypes, nn.LayerNorm interop,
checkpoint/compile/opcheck and argument errors."""

import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tempo.memory import ActivationLedger
from tempo.ops import dropout_add_layernorm as dal_module
from tempo.ops._backend import TRITON_AVAILABLE, triton_interpreting, use_backend
from tempo.ops.dropout_add_layernorm import (
    MAX_TRITON_N,
    DropoutAddLayerNorm,
    draw_seed,
    dropout_add_layernorm,
    dropout_add_layernorm_keep_mask,
)
from tempo.ops.layernorm import InplaceLayerNorm, plan_kept_columns

# Max error relative to max(1, max|reference|): fp32 tight; fp16/bf16 carry the rounding of y in
# the output dtype (x̂ is recovered from it) and, in the interpreter, one bf16 ULP from truncation.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2, torch.float64: 1e-10}
RNG_SEED = 1234


def reference_fp64(x, residual, normalized_shape, weight, bias, eps, keep, p, grad):
    """fp64 LayerNorm(residual + x·keep/(1 − p)) and its gradients by autograd, written out here."""
    dims = tuple(range(-len(normalized_shape), 0))
    x64 = x.detach().double().requires_grad_()
    r64 = residual.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_() if weight is not None else None
    b64 = bias.detach().double().requires_grad_() if bias is not None else None
    dropped = x64 * keep.double() / (1.0 - p) if keep is not None else x64
    s = r64 + dropped
    mean = s.mean(dim=dims, keepdim=True)
    var = ((s - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (s - mean) / torch.sqrt(var + eps)
    if w64 is not None:
        y = y * w64
    if b64 is not None:
        y = y + b64
    y.backward(grad.double())
    return (y.detach(), x64.grad, r64.grad, w64.grad if w64 is not None else None,
            b64.grad if b64 is not None else None)


def assert_close(actual, expected, dtype, what):
    """Within TOL of the computation's dtype, or of ``actual``'s own dtype if that is coarser."""
    assert actual.shape == expected.shape, what
    tol = max(TOL[dtype], TOL[actual.dtype])
    err = (actual.double() - expected).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:.1g} x {scale:.3g}"


def make_params(shape, device):
    # |γ| in [0.5, 1.5] with random signs: recovering x̂ = (y − β)/γ is well conditioned.
    sign = torch.randint(0, 2, shape, device=device) * 2 - 1
    return (torch.rand(shape, device=device) + 0.5) * sign, 0.1 * torch.randn(shape, device=device)


def make_module(shape, p, device, **kwargs):
    module = DropoutAddLayerNorm(shape, p, device=device, **kwargs)
    weight, bias = make_params(module.normalized_shape, device)
    with torch.no_grad():
        if module.weight is not None:
            module.weight.copy_(weight)
        if module.bias is not None:
            module.bias.copy_(bias)
    return module


def run_seeded(fn, device):
    """fn() with torch's RNG at RNG_SEED, and the seed the op draws from it."""
    torch.manual_seed(RNG_SEED)
    seed = draw_seed(device)
    torch.manual_seed(RNG_SEED)
    return fn(), seed


def check_against_reference(module, x, residual, grad, backend, dtype, out_dtype=None):
    """Run module(x, residual) forward and backward; compare everything with the fp64 reference."""
    y, seed = run_seeded(lambda: module(x, residual), x.device)
    y.backward(grad)
    dropout = module.training and module.p > 0
    keep = dropout_add_layernorm_keep_mask(seed, x.shape, module.p, x.device, backend) if dropout else None
    ref = reference_fp64(x, residual, module.normalized_shape, module.weight, module.bias, module.eps,
                         keep, module.p, grad)
    assert y.dtype == (out_dtype or dtype) and y.shape == x.shape
    assert_close(y, ref[0], dtype, "y")
    assert_close(x.grad, ref[1], dtype, "dx")
    assert_close(residual.grad, ref[2], dtype, "dresidual")
    if module.weight is not None:
        assert module.weight.grad.dtype == module.weight.dtype
        assert_close(module.weight.grad, ref[3], dtype, "dweight")
    if module.bias is not None:
        assert_close(module.bias.grad, ref[4], dtype, "dbias")
    return y, keep


# ---------------------------------------------------------------------------------------------
# values and gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(3, 1), (5, 7), (7, 123), (3, 1023), (2, 1500)])
def test_matches_fp64_reference(backend, device, dtype, rows, hidden):
    module = make_module(hidden, 0.3, device)
    x = (2 * torch.randn(rows, hidden, device=device)).to(dtype).requires_grad_()
    residual = (3 * torch.randn(rows, hidden, device=device) + 1).to(dtype).requires_grad_()
    grad = torch.randn(rows, hidden, device=device).to(dtype)
    check_against_reference(module, x, residual, grad, backend, dtype)
    assert x.grad.dtype == dtype and residual.grad.dtype == dtype


def test_fp64_on_reference_path(device):
    with use_backend("reference"):
        module = make_module(9, 0.2, device, dtype=torch.float64)
        x = torch.randn(6, 9, device=device, dtype=torch.float64, requires_grad=True)
        residual = torch.randn(6, 9, device=device, dtype=torch.float64, requires_grad=True)
        grad = torch.randn(6, 9, device=device, dtype=torch.float64)
        check_against_reference(module, x, residual, grad, "reference", torch.float64)
        seed = torch.tensor(7)
        small = [t.detach()[:3, :5].clone().requires_grad_() for t in (x, residual)]
        params = [t.detach()[:5].clone().requires_grad_() for t in (module.weight, module.bias)]
        assert torch.autograd.gradcheck(
            lambda a, r, w, b: dropout_add_layernorm(a, r, 5, w, b, 1e-5, 0.4, True, seed), (*small, *params))


@pytest.mark.parametrize("x_dtype,residual_dtype,out_dtype", [
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.float32, torch.float16, torch.float32),
    (torch.float16, torch.bfloat16, torch.float32),
])
def test_mixed_input_dtypes(backend, device, x_dtype, residual_dtype, out_dtype):
    module = make_module(33, 0.25, device)
    x = torch.randn(5, 33, device=device).to(x_dtype).requires_grad_()
    residual = torch.randn(5, 33, device=device).to(residual_dtype).requires_grad_()
    grad = torch.randn(5, 33, device=device).to(out_dtype)
    # The op computes in fp32 and writes an fp32 output: only the inputs' own rounding remains.
    check_against_reference(module, x, residual, grad, backend, torch.float32, out_dtype=out_dtype)
    assert x.grad.dtype == x_dtype and residual.grad.dtype == residual_dtype


def test_three_dims_two_normalized_dims_non_contiguous(backend, device):
    module = make_module((3, 5), 0.4, device)
    x_base = torch.randn(5, 3, 4, device=device, requires_grad=True)
    x = x_base.permute(2, 1, 0)  # [4, 3, 5], non-contiguous
    r_base = torch.randn(4, 3, 10, device=device, requires_grad=True)
    residual = r_base[..., ::2]  # [4, 3, 5], column stride 2
    grad = torch.randn(4, 5, 3, device=device).transpose(1, 2)  # non-contiguous gradient as well
    assert not (x.is_contiguous() or residual.is_contiguous() or grad.is_contiguous())
    y, seed = run_seeded(lambda: module(x, residual), device)
    y.backward(grad)
    keep = dropout_add_layernorm_keep_mask(seed, x.shape, 0.4, device, backend)
    ref = reference_fp64(x, residual, (3, 5), module.weight, module.bias, module.eps, keep, 0.4, grad)
    assert y.shape == (4, 3, 5) and y.is_contiguous()
    assert_close(y, ref[0], torch.float32, "y")
    assert_close(x_base.grad.permute(2, 1, 0), ref[1], torch.float32, "dx")
    assert_close(r_base.grad[..., ::2], ref[2], torch.float32, "dresidual")
    assert torch.equal(r_base.grad[..., 1::2], torch.zeros(4, 3, 5, device=device))
    assert_close(module.weight.grad, ref[3], torch.float32, "dweight")
    assert_close(module.bias.grad, ref[4], torch.float32, "dbias")


@pytest.mark.parametrize("affine,use_bias", [(False, False), (True, False)])
def test_without_affine_or_bias(backend, device, affine, use_bias):
    module = make_module(13, 0.3, device, elementwise_affine=affine, bias=use_bias)
    assert (module.weight is None) == (not affine) and module.bias is None
    x = torch.randn(6, 13, device=device, requires_grad=True)
    residual = torch.randn(6, 13, device=device, requires_grad=True)
    check_against_reference(module, x, residual, torch.randn(6, 13, device=device), backend, torch.float32)


def test_functional_bias_without_weight(backend, device):
    bias = (0.1 * torch.randn(6, device=device)).requires_grad_()
    x = torch.randn(4, 6, device=device, requires_grad=True)
    residual = torch.randn(4, 6, device=device, requires_grad=True)
    grad = torch.randn(4, 6, device=device)
    seed = torch.tensor(99)
    y = dropout_add_layernorm(x, residual, 6, None, bias, 1e-5, 0.5, True, seed)
    y.backward(grad)
    keep = dropout_add_layernorm_keep_mask(seed, (4, 6), 0.5, device, backend)
    ref = reference_fp64(x, residual, (6,), None, bias, 1e-5, keep, 0.5, grad)
    for actual, expected, what in zip((y, x.grad, residual.grad, bias.grad), ref[:3] + ref[4:],
                                      ("y", "dx", "dresidual", "dbias")):
        assert_close(actual, expected, torch.float32, what)


@pytest.mark.parametrize("mode", ["eval", "p0"])
def test_no_dropout_equals_layernorm_of_sum(backend, device, mode):
    ours = make_module(24, 0.0 if mode == "p0" else 0.5, device)
    if mode == "eval":
        ours.eval()
    stock = nn.LayerNorm(24, device=device)
    stock.load_state_dict(ours.state_dict())
    x, residual = torch.randn(2, 5, 24, device=device), torch.randn(2, 5, 24, device=device)
    grad = torch.randn(2, 5, 24, device=device)
    ours_in = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
    stock_in = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
    y_ours = ours(*ours_in)
    y_stock = stock(stock_in[1] + stock_in[0])
    y_ours.backward(grad)
    y_stock.backward(grad)
    torch.testing.assert_close(y_ours, y_stock, rtol=1e-5, atol=1e-5)
    for a, b in zip(ours_in, stock_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, stock.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.bias.grad, stock.bias.grad, rtol=1e-4, atol=1e-5)
    # The functional with training=False (and any p) is the same op.
    same = dropout_add_layernorm(x, residual, 24, ours.weight, ours.bias, 1e-5, 0.9, training=False)
    torch.testing.assert_close(same, y_stock, rtol=1e-5, atol=1e-5)


ADVERSARIAL_GAMMAS = (0.0, -0.0, 1e-30, -1e-6, 1e-3, 0.05)


def adversarial_module(n, p, device, eps=1e-5, beta=10.0):
    """Well-conditioned columns except the first few: γ near or at 0 with β = ±beta, and one
    column with γ = 1, β = 10 (ill-conditioned without a small γ)."""
    module = make_module(n, p, device, eps=eps)
    k = len(ADVERSARIAL_GAMMAS)
    with torch.no_grad():
        module.weight[:k] = torch.tensor(ADVERSARIAL_GAMMAS, device=device)
        module.bias[:k] = beta * torch.where(torch.arange(k, device=device) % 2 == 0, 1.0, -1.0)
        module.weight[k], module.bias[k] = 1.0, 10.0
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adversarial_gamma_and_beta_give_the_exact_gradient(backend, device, dtype):
    """γ ∈ {0, 1e-30, 1e-6, 1e-3, ...} with |β| = 10, dropout on: every gradient of every column
    matches the fp64 reference (with the op's own mask) to the rounding of y in its dtype."""
    torch.manual_seed(3)
    n = 40
    module = adversarial_module(n, 0.2, device)
    x = (2 * torch.randn(7, n, device=device)).to(dtype).requires_grad_()
    residual = (3 * torch.randn(7, n, device=device) + 1).to(dtype).requires_grad_()
    grad = torch.randn(7, n, device=device).to(dtype)
    _, keep = check_against_reference(module, x, residual, grad, backend, dtype)
    # Column by column for dγ and dβ: one wrong column would hide in a max over the others.
    ref = reference_fp64(x, residual, (n,), module.weight, module.bias, module.eps, keep, 0.2, grad)
    for what, got, expected in (("dweight", module.weight.grad, ref[3]), ("dbias", module.bias.grad, ref[4])):
        err = (got.double() - expected).abs() / (expected.abs() + 1)
        assert (err <= TOL[dtype]).all(), f"{what}: columns {torch.nonzero(err > TOL[dtype]).flatten().tolist()}"


@pytest.mark.parametrize("scale,shift,eps", [(1e-3, 0.0, 1e-5), (1e3, 50.0, 1e-12), (1.0, 0.0, 0.5)])
def test_far_from_unit_variance_and_other_eps(backend, device, scale, shift, eps):
    """Inputs of tiny or huge variance and an eps that matters (0.5 against variance ~1): eps
    enters rstd, so a backward that ignored it (or used another) fails here."""
    torch.manual_seed(5)
    module = make_module(33, 0.1, device, eps=eps)
    x = (scale * torch.randn(6, 33, device=device)).requires_grad_()
    residual = (scale * torch.randn(6, 33, device=device) + shift).requires_grad_()
    grad = torch.randn(6, 33, device=device)
    check_against_reference(module, x, residual, grad, backend, torch.float32)


def test_ledger_counts_the_kept_columns(backend, device):
    n, rows = 40, 6
    x = torch.randn(rows, n, device=device, requires_grad=True)
    residual = torch.randn(rows, n, device=device, requires_grad=True)
    for module, k in ((make_module(n, 0.1, device), 0), (adversarial_module(n, 0.1, device), 7)):
        with ActivationLedger(module) as ledger:
            module(x, residual).sum().backward()
        extra = rows * k * 4 + k * 8 if k else 0
        assert ledger.activation_bytes == rows * n * 4 + rows * 4 + 8 + extra


@pytest.mark.parametrize("where", ["weight", "bias"])
def test_non_finite_parameters_raise_naming_the_layer(backend, device, where):
    from tempo.ops.layernorm import name_layernorms

    model = nn.ModuleDict({"block": make_module(8, 0.1, device)})
    name_layernorms(model)
    with torch.no_grad():
        getattr(model["block"], where)[5] = float("nan")
    x = torch.randn(2, 8, device=device, requires_grad=True)
    with pytest.raises(ValueError, match=rf"^block: {where} \(.\) holds a non-finite value \(nan\) at column 5"):
        model["block"](x, x)


@pytest.mark.parametrize("mode", ["no_grad", "frozen"])
def test_without_a_backward_it_runs_the_stock_ops(device, mode, monkeypatch):
    calls = []
    original = dal_module.dropout_add_layernorm_fwd
    monkeypatch.setattr(dal_module, "dropout_add_layernorm_fwd", lambda *a: calls.append(a) or original(*a))
    module = adversarial_module(24, 0.1, device).eval()
    x, residual = torch.randn(3, 24, device=device), torch.randn(3, 24, device=device)
    expected = nn.functional.layer_norm(residual + x, (24,), module.weight, module.bias, module.eps)
    if mode == "frozen":
        module.requires_grad_(False)
        context = torch.enable_grad()
    else:
        context = torch.no_grad()
    with context:
        y = module(x, residual)
    assert calls == [] and y.grad_fn is None
    torch.testing.assert_close(y, expected)
    module.requires_grad_(True)
    module(x, residual)
    assert len(calls) == 1


def test_empty_input(backend, device):
    module = DropoutAddLayerNorm(5, 0.1, device=device)
    x = torch.randn(0, 5, device=device, requires_grad=True)
    residual = torch.randn(0, 5, device=device, requires_grad=True)
    y = module(x, residual)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert x.grad.shape == (0, 5) and residual.grad.shape == (0, 5)
    assert torch.equal(module.weight.grad, torch.zeros(5, device=device))


def test_output_is_a_fresh_tensor(backend, device):
    x = torch.randn(2, 3, 8, device=device)
    residual = torch.randn(2, 3, 8, device=device)
    y = DropoutAddLayerNorm(8, 0.1, device=device)(x, residual)
    assert y._base is None and y.shape == x.shape
    pointers = {t.untyped_storage().data_ptr() for t in (x, residual)}
    assert y.untyped_storage().data_ptr() not in pointers
    assert y.untyped_storage().nbytes() == y.numel() * y.element_size()


def test_backend_fixture_really_runs_the_kernels(backend, device, monkeypatch):
    calls = []
    for name in ("_fwd_triton", "_bwd_triton"):
        original = getattr(dal_module, name)
        monkeypatch.setattr(dal_module, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    x = torch.randn(3, 4, device=device, requires_grad=True)
    DropoutAddLayerNorm(4, 0.1, device=device)(x, torch.randn(3, 4, device=device)).sum().backward()
    assert calls == (["_fwd_triton", "_bwd_triton"] if backend == "triton" else [])


def test_rows_too_long_for_one_block_use_reference_path(backend, device, monkeypatch, caplog):
    monkeypatch.setattr(dal_module, "_long_row_fallback_logged", False)
    n = MAX_TRITON_N + 3
    x = torch.randn(2, n, device=device, requires_grad=True)
    residual = torch.randn(2, n, device=device, requires_grad=True)
    grad = torch.randn(2, n, device=device)
    seed = torch.tensor(5)
    with caplog.at_level(logging.WARNING, logger="tempo"):
        y = dropout_add_layernorm(x, residual, n, None, None, 1e-5, 0.1, True, seed)
        dropout_add_layernorm(x, residual, n, None, None, 1e-5, 0.1, True, seed)
    y.backward(grad)
    fallback_logs = [r for r in caplog.records if "Triton block limit" in r.getMessage()]
    assert len(fallback_logs) == (1 if backend == "triton" else 0)
    # Whatever was asked for, the reference path ran: its mask, in forward and backward.
    keep = dropout_add_layernorm_keep_mask(seed, x.shape, 0.1, device, "reference")
    ref = reference_fp64(x, residual, (n,), None, None, 1e-5, keep, 0.1, grad)
    assert_close(y, ref[0], torch.float32, "y")
    assert_close(x.grad, ref[1], torch.float32, "dx")
    assert_close(residual.grad, ref[2], torch.float32, "dresidual")


# ---------------------------------------------------------------------------------------------
# the dropout mask
# ---------------------------------------------------------------------------------------------
def test_keep_mask_statistics(backend, device):
    rows, cols, p = 64, 257, 0.25
    keep = dropout_add_layernorm_keep_mask(torch.tensor(11), (rows, cols), p, device, backend)
    assert keep.dtype == torch.bool and keep.shape == (rows, cols)
    count = rows * cols
    sigma = math.sqrt(p * (1 - p) / count)
    assert abs(keep.float().mean().item() - (1 - p)) < 6 * sigma
    # Per-column rates too: the counter covers every column (a column-independent mask would not).
    column_rate = keep.float().mean(0)
    assert (column_rate - (1 - p)).abs().max().item() < 6 * math.sqrt(p * (1 - p) / rows)
    other = dropout_add_layernorm_keep_mask(torch.tensor(12), (rows, cols), p, device, backend)
    assert not torch.equal(keep, other), "different seeds must give different masks"
    assert abs((keep == other).float().mean().item() - (p * p + (1 - p) ** 2)) < 6 * sigma * 2
    assert len({tuple(row) for row in keep.tolist()}) == rows, "rows must not repeat"
    again = dropout_add_layernorm_keep_mask(torch.tensor(11), (rows, cols), p, device, backend)
    assert torch.equal(keep, again), "the mask is a function of the seed"


def test_forward_and_backward_use_the_same_recorded_mask(backend, device):
    p = 0.3
    module = make_module(37, p, device)
    x = torch.randn(40, 37, device=device, requires_grad=True)
    residual = torch.randn(40, 37, device=device, requires_grad=True)
    grad = torch.randn(40, 37, device=device)
    y, seed = run_seeded(lambda: module(x, residual), device)
    # Backward under the other backend: the recorded one must still be used.
    other = "reference" if backend == "triton" else "triton"
    with use_backend(other):
        y.backward(grad)
    keep = dropout_add_layernorm_keep_mask(seed, x.shape, p, device, backend)
    ref = reference_fp64(x, residual, (37,), module.weight, module.bias, module.eps, keep, p, grad)
    assert_close(y, ref[0], torch.float32, "y (forward mask)")
    assert_close(x.grad, ref[1], torch.float32, "dx (backward mask)")
    # dx is exactly 0 where dropped; the residual always gets the gradient.
    assert torch.equal(x.grad == 0, ~keep)
    assert (residual.grad != 0).all()
    dropped = (x.grad == 0).float().mean().item()
    assert abs(dropped - p) < 6 * math.sqrt(p * (1 - p) / x.numel())


def test_each_call_draws_a_new_mask(backend, device):
    module = DropoutAddLayerNorm(64, 0.5, device=device)
    x, residual = torch.randn(4, 64, device=device), torch.randn(4, 64, device=device)
    assert not torch.equal(module(x, residual), module(x, residual))
    torch.manual_seed(3)
    first = module(x, residual)
    torch.manual_seed(3)
    assert torch.equal(module(x, residual), first), "torch.manual_seed reproduces the mask"


# ---------------------------------------------------------------------------------------------
# dtypes under autocast, and what is kept for backward
# ---------------------------------------------------------------------------------------------
class NormThenLinear(nn.Module):
    def __init__(self, norm, hidden):
        super().__init__()
        self.norm = norm
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x, residual):
        return self.linear(self.norm(x, residual))


def test_ledger_autocast_keeps_output_rstd_and_seed_only(backend, device):
    """Under bf16 autocast the op returns bf16 y, which the next Linear keeps as its input: the
    same storage. Kept: y (bf16), rstd (fp32 per row), the 8-byte seed, nothing else."""
    rows, hidden = 6, 64
    torch.manual_seed(0)
    model = NormThenLinear(make_module(hidden, 0.1, device), hidden).to(device)
    x = torch.randn(2, 3, hidden, device=device).to(torch.bfloat16).requires_grad_()  # an autocast Linear's output
    residual = torch.randn(2, 3, hidden, device=device, requires_grad=True)  # fp32 residual stream
    with ActivationLedger(model) as ledger:
        with torch.autocast(device, dtype=torch.bfloat16):
            normed = model.norm(x, residual)
            out = model.linear(normed)
    assert normed.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    out.float().sum().backward()  # the kept tensors suffice for backward
    assert x.grad.dtype == torch.bfloat16 and residual.grad.dtype == torch.float32
    assert model.norm.weight.grad.dtype == torch.float32

    y_bytes, rstd_bytes, seed_bytes = rows * hidden * 2, rows * 4, 8
    norm_records = [(r.shape, r.dtype, r.nbytes) for r in ledger.records if r.module == "norm" and not r.is_parameter]
    assert norm_records == [((2, 3, hidden), torch.bfloat16, y_bytes), ((rows,), torch.float32, rstd_bytes),
                            ((), torch.int64, seed_bytes)]
    assert {r.shape for r in ledger.records if r.module == "norm" and r.is_parameter} == {(hidden,)}
    # The Linear keeps only autocast's bf16 copy of its weight: its input is the norm's y.
    bf16_linear_weight = hidden * hidden * 2
    linear_records = [(r.dtype, r.nbytes) for r in ledger.records if r.module == "linear" and not r.is_parameter]
    assert linear_records == [(torch.bfloat16, bf16_linear_weight)]
    assert ledger.activation_bytes == y_bytes + rstd_bytes + seed_bytes + bf16_linear_weight == 8992

    # Stock dropout -> add -> nn.LayerNorm keeps the mask, the fp32 sum, mean/rstd and a bf16 copy.
    stock_norm = nn.LayerNorm(hidden, device=device)
    stock = NormThenLinear(lambda a, r: stock_norm(r + nn.functional.dropout(a, 0.1)), hidden).to(device)
    with ActivationLedger(stock) as stock_ledger:
        with torch.autocast(device, dtype=torch.bfloat16):
            stock(x, residual)
    assert stock_ledger.activation_bytes >= ledger.activation_bytes + rows * hidden * (1 + 4)


def test_kept_columns_follow_the_output_dtype_not_the_inputs(backend, device):
    """fp16 autocast over an fp32 residual stream: y is fp16 while x is fp32. |γ_0| = 1e-6 is
    recoverable from an fp32 y but not from an fp16 one (below λ_D = 6.1e-5): column 0 is kept,
    and every gradient matches the fp64 reference as for any other column."""
    torch.manual_seed(0)
    rows, n = 6, 16
    module = make_module(n, 0.0, device)
    with torch.no_grad():
        module.weight[0], module.bias[0] = 1e-6, 0.0
    x = torch.randn(rows, n, device=device, dtype=torch.float64).float().requires_grad_()
    residual = torch.randn(rows, n, device=device, requires_grad=True)
    grad = torch.randn(rows, n, device=device).half()
    with ActivationLedger(module) as ledger, torch.autocast(device, dtype=torch.float16):
        y = module(x, residual)
    assert y.dtype == torch.float16
    y.backward(grad)
    kept = [r.shape for r in ledger.records if not r.is_parameter]
    assert (rows, 1) in kept or (1,) in kept, kept  # the kept x̂ column (and its index)
    ref = reference_fp64(x, residual, module.normalized_shape, module.weight, module.bias, module.eps, None, 0.0,
                         grad)
    err = (module.weight.grad[0].double() - ref[3][0]).abs() / (ref[3][0].abs() + 1)
    assert err <= TOL[torch.float16], float(err)


def test_ledger_without_autocast_keeps_no_input_and_no_mask(backend, device):
    module = make_module(10, 0.5, device)
    x = torch.randn(7, 10, device=device, requires_grad=True)
    residual = torch.randn(7, 10, device=device, requires_grad=True)
    with ActivationLedger(module) as ledger:
        y = module(x, residual)
    kept = [(r.shape, r.dtype) for r in ledger.records if not r.is_parameter]
    assert kept == [((7, 10), torch.float32), ((7,), torch.float32), ((), torch.int64)]
    assert ledger.activation_bytes == 7 * 10 * 4 + 7 * 4 + 8
    assert y.untyped_storage().data_ptr() not in {x.untyped_storage().data_ptr(), residual.untyped_storage().data_ptr()}


def test_autocast_output_dtype_rules(device):
    x = torch.randn(3, 8, device=device)
    with use_backend("reference"), torch.autocast(device, dtype=torch.bfloat16):
        assert dropout_add_layernorm(x, x.half(), 8, p=0.1).dtype == torch.bfloat16
        # fp64 is left alone by autocast: the result type wins.
        assert dropout_add_layernorm(x, x.double(), 8, p=0.1).dtype == torch.float64
    assert dropout_add_layernorm(x.bfloat16(), x.bfloat16(), 8, p=0.1).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# nn.LayerNorm interop, construction on the meta device
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"elementwise_affine": False}, {"bias": False}, {"eps": 1e-6}])
def test_state_dict_round_trip_with_layernorms(kwargs):
    stock = nn.LayerNorm((4, 6), **kwargs)
    ours = DropoutAddLayerNorm((4, 6), 0.1, **kwargs)
    assert ours.state_dict().keys() == stock.state_dict().keys()
    assert ours.extra_repr() == stock.extra_repr() + ", p=0.1"
    for param in stock.parameters():
        with torch.no_grad():
            param.normal_()
    ours.load_state_dict(stock.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value)
    back, inplace = nn.LayerNorm((4, 6), **kwargs), InplaceLayerNorm((4, 6), **kwargs)
    back.load_state_dict(ours.state_dict())
    inplace.load_state_dict(ours.state_dict())
    ours.load_state_dict(inplace.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(back.state_dict()[key], value) and torch.equal(ours.state_dict()[key], value)


def test_built_on_meta_then_materialized():
    with torch.device("meta"):
        module = DropoutAddLayerNorm(8, 0.1)
    assert module.weight.is_meta
    module.to_empty(device="cpu")
    module.reset_parameters()
    assert torch.equal(module.weight, torch.ones(8)) and torch.equal(module.bias, torch.zeros(8))
    x, residual = torch.randn(2, 8), torch.randn(2, 8)
    with use_backend("reference"):
        torch.testing.assert_close(module.eval()(x, residual), nn.functional.layer_norm(x + residual, (8,)))


# ---------------------------------------------------------------------------------------------
# checkpoint, compile, opcheck
# ---------------------------------------------------------------------------------------------
def test_under_activation_checkpointing(backend, device):
    module = make_module(12, 0.3, device)
    x, residual = torch.randn(5, 12, device=device), torch.randn(5, 12, device=device)
    grad = torch.randn(5, 12, device=device)
    plain = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
    ckpt = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
    torch.manual_seed(8)
    module(*plain).backward(grad)
    plain_dw = module.weight.grad.clone()
    module.weight.grad = None
    torch.manual_seed(8)
    y = checkpoint(module, *ckpt, use_reentrant=False)
    torch.manual_seed(9)  # the recomputation restores the forward's RNG state by itself
    y.backward(grad)
    torch.testing.assert_close(ckpt[0].grad, plain[0].grad)
    torch.testing.assert_close(ckpt[1].grad, plain[1].grad)
    torch.testing.assert_close(module.weight.grad, plain_dw)
    assert (plain[0].grad == 0).any(), "dropout was on"


def test_torch_compile_fullgraph_aot_eager(backend, device):
    module = make_module(16, 0.25, device)

    def step(x, residual):
        return module(x * 2.0, residual).square().sum()

    x, residual = torch.randn(3, 16, device=device), torch.randn(3, 16, device=device)
    eager = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
    compiled = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
    torch.manual_seed(4)
    step(*eager).backward()
    torch._dynamo.reset()
    compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.manual_seed(4)
    compiled_step(*compiled).backward()
    torch.testing.assert_close(compiled[0].grad, eager[0].grad)
    torch.testing.assert_close(compiled[1].grad, eager[1].grad)
    assert (eager[0].grad == 0).any(), "dropout was on"


@pytest.mark.parametrize("with_affine,training", [(True, True), (False, True), (True, False)])
def test_opcheck(backend, device, with_affine, training):
    x = torch.randn(3, 8, device=device, requires_grad=True)
    residual = torch.randn(3, 8, device=device, requires_grad=True)
    weight = (torch.rand(8, device=device) + 0.5).requires_grad_() if with_affine else None
    bias = torch.randn(8, device=device, requires_grad=True) if with_affine else None
    seed = torch.tensor(17, device=device)
    if with_affine:
        with torch.no_grad():
            weight[2] = 0.0  # one kept column: a K > 0 plan is exercised too
    plan = plan_kept_columns(weight, bias, torch.float32, 8, device, "dal")
    assert (2 in plan.tolist()) == with_affine
    torch.library.opcheck(torch.ops.tempo.dropout_add_layernorm_fwd.default,
                          (x, residual, [8], weight, bias, plan, seed, 1e-5, 0.3, training, torch.float32, backend,
                           "dal"))
    # The backward op runs inside backward only (no double backward): no input requires grad.
    params = [t.detach() if t is not None else None for t in (weight, bias)]
    cols = torch.tensor([2] if with_affine else [], dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.tempo.dropout_add_layernorm_bwd.default,
                          (torch.randn(3, 8, device=device), torch.randn(3, 8, device=device),
                           torch.rand(3, device=device) + 0.5, cols, torch.randn(3, cols.numel(), device=device),
                           [8], *params, seed, 0.3, training, torch.float32, torch.float32, backend))


# ---------------------------------------------------------------------------------------------
# argument errors name the argument
# ---------------------------------------------------------------------------------------------
def _call(**overrides):
    args = {"x": torch.randn(2, 4), "residual": torch.randn(2, 4), "normalized_shape": 4,
            "weight": torch.ones(4), "bias": torch.zeros(4), "eps": 1e-5, "p": 0.1, "training": True}
    args.update(overrides)
    return dropout_add_layernorm(**args)


@pytest.mark.parametrize("overrides,error,name", [
    ({"x": torch.ones(2, 4, dtype=torch.int64)}, TypeError, "'x'"),
    ({"x": [[1.0] * 4] * 2}, TypeError, "'x'"),
    ({"residual": torch.ones(2, 4, dtype=torch.int32)}, TypeError, "'residual'"),
    ({"residual": torch.randn(2, 1)}, ValueError, "'residual'"),
    ({"residual": torch.randn(4)}, ValueError, "'residual'"),
    ({"normalized_shape": 3}, ValueError, "'normalized_shape'"),
    ({"normalized_shape": (2, 3, 4)}, ValueError, "'normalized_shape'"),
    ({"normalized_shape": "4"}, TypeError, "'normalized_shape'"),
    ({"weight": torch.ones(3)}, ValueError, "'weight'"),
    ({"bias": torch.zeros(4, dtype=torch.int64)}, TypeError, "'bias'"),
    ({"p": 1.0}, ValueError, "'p'"),
    ({"p": -0.1}, ValueError, "'p'"),
    ({"p": "0.1"}, TypeError, "'p'"),
    ({"eps": -1.0}, ValueError, "'eps'"),
    ({"training": 1}, TypeError, "'training'"),
    ({"seed": torch.tensor(1.5)}, TypeError, "'seed'"),
])
def test_bad_arguments_are_named(overrides, error, name):
    with pytest.raises(error, match=name):
        _call(**overrides)


def test_bad_module_and_helper_arguments_are_named():
    with pytest.raises(ValueError, match="'p'"):
        DropoutAddLayerNorm(8, 1.5)
    with pytest.raises(ValueError, match="'backend'"):
        dropout_add_layernorm_keep_mask(torch.tensor(1), (2, 3), 0.1, "cpu", "auto")
    with pytest.raises(ValueError, match="'backend'"):
        torch.ops.tempo.dropout_add_layernorm_fwd(torch.randn(2, 4), torch.randn(2, 4), [4], None, None,
                                                 torch.empty(0, dtype=torch.int64), torch.tensor(1), 1e-5, 0.1,
                                                 True, torch.float32, "auto", "dal")


def test_triton_forced_on_fp64_names_the_dtype():
    if not (TRITON_AVAILABLE and triton_interpreting()):
        pytest.skip("Triton cannot run on the CPU here")
    with use_backend("triton"), pytest.raises(TypeError, match="float64"):
        _call(residual=torch.randn(2, 4, dtype=torch.float64, requires_grad=True))


# ---------------------------------------------------------------------------------------------
# The kept-column plan per parameter version, parameters on another device (issue 28)
# ---------------------------------------------------------------------------------------------
def test_plan_is_cached_per_parameter_version_and_follows_updates():
    """Triton path: the plan is read once per version of γ/β (the second forward reads nothing),
    and an update that makes a column unrecoverable (γ_3 -> 1e-30 under β_3 = 0.5) is planned:
    every gradient stays the stock one's."""
    from test_host_reads import HostReadCounter
    from conftest import triton_blocker

    if triton_blocker("cpu") is not None:
        pytest.skip(triton_blocker("cpu")[1])
    module = DropoutAddLayerNorm(8, 0.0)
    stock = nn.LayerNorm(8)
    x, r, g = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)

    def reads(fn):
        counter = HostReadCounter()
        with counter.installed(), counter.counting():
            fn()
        return counter.total

    with use_backend("triton"):
        for gamma_3 in (1.0, 1e-30):
            with torch.no_grad():
                module.weight[3] = gamma_3
                module.bias[3] = 0.5
                stock.load_state_dict(module.state_dict())
            xs = [x.clone().requires_grad_() for _ in range(2)]
            assert reads(lambda: module(xs[0], r).backward(g)) == 1
            stock(xs[1] + r).backward(g)
            torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-4, atol=1e-5)
            assert reads(lambda: module(x.clone().requires_grad_(), r).backward(g)) == 0


@pytest.mark.parametrize("where", ["weight", "bias"])
def test_parameters_on_another_device_raise_naming_the_layer(where):
    from tempo.ops.layernorm import name_layernorms

    model = nn.ModuleDict({"block": DropoutAddLayerNorm(4, 0.1)})
    name_layernorms(model)
    setattr(model["block"], where, nn.Parameter(torch.ones(4, device="meta")))
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match=rf"^block: {where} \(.\) is on meta but the input is on cpu"):
        model["block"](x, x)
