"""In-place GELU: output and gradient against fp64, derivative accuracy, what it keeps, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tempo.inplace_gelu import InplaceGelu, gelu_derivative_from_output, inplace_gelu
from tempo.memory import ActivationLedger
from tempo.ops.bitpack import pack_bits
from tempo.ops.gelu import X_STAR

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (output atol, gradient atol) per dtype; 16-bit outputs carry one rounding of the stored y, the
# gradient the amplified rounding near x* (the bound is 3e-2 there).
TOL = {torch.float32: (1e-6, 2e-4), torch.float16: (2e-3, 3e-2), torch.bfloat16: (3.2e-2, 3e-2)}


def exact_derivative(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return 0.5 * (1 + torch.erf(x / 2**0.5)) + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 7, 123, 1023, 1500])
def test_matches_fp64_reference(backend, device, dtype, numel):
    x = (torch.randn(numel, device=device) * 3).to(dtype).requires_grad_()
    grad = torch.randn(numel, device=device).to(dtype)
    y = inplace_gelu(x)
    y.backward(grad.clone())
    out_tol, grad_tol = TOL[dtype]
    expected = F.gelu(x.detach().double())
    torch.testing.assert_close(y.double(), expected, atol=out_tol, rtol=1e-2 if dtype != torch.float32 else 1e-5)
    expected_grad = grad.double() * exact_derivative(x.detach())
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert (x.grad.double() - expected_grad).abs().max() <= grad_tol * max(1.0, grad.abs().max().item())


def fp_neighbours(value: float, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``value`` rounded to ``dtype`` and its ``count`` nearest representable neighbours each side."""
    centre = torch.tensor(value, dtype=dtype)
    up, down = [centre], [centre]
    for _ in range(count):
        up.append(torch.nextafter(up[-1], torch.tensor(1.0, dtype=dtype)))
        down.append(torch.nextafter(down[-1], torch.tensor(-1.0, dtype=dtype)))
    return torch.stack(down[::-1] + up[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_derivative_accuracy_over_the_range(backend, device, dtype):
    """The issue's bounds: |GELU'(recovered) - GELU'(x)| over x in [-12, 12], worst near x*."""
    grid = torch.cat([torch.linspace(-12, 12, 100001, dtype=torch.float64),
                      X_STAR + torch.linspace(-0.02, 0.02, 4001, dtype=torch.float64),
                      X_STAR + torch.linspace(-3e-4, 3e-4, 601, dtype=torch.float64),
                      torch.tensor([0.0, X_STAR, -5.5, -5.6, 12.0], dtype=torch.float64)])
    x = torch.cat([grid.to(dtype), fp_neighbours(X_STAR, 300, dtype)]).to(device).requires_grad_()
    inplace_gelu(x).backward(torch.ones_like(x))
    error = (x.grad.double() - exact_derivative(x.detach())).abs().max().item()
    assert error <= (2e-4 if dtype == torch.float32 else 3e-2), error


def test_forward_near_the_minimum_is_rounded_once(backend, device):
    """Backward amplifies y's rounding error at x*: y there must be within 1 ULP of fp64 rounded once."""
    x = X_STAR + torch.linspace(-0.06, 0.06, 2001, device=device)
    expected = F.gelu(x.double()).float()
    ulp = torch.nextafter(expected.abs(), torch.tensor(1.0, device=device)) - expected.abs()
    assert ((inplace_gelu(x) - expected).abs() <= ulp).all()


def test_reference_helper_recovers_the_derivative():
    x = torch.linspace(-6, 6, 1001)
    y = F.gelu(x)
    d = gelu_derivative_from_output(y, pack_bits(x < X_STAR))
    assert (d.double() - exact_derivative(x)).abs().max() < 2e-4


def test_gradcheck_fp64_reference():
    # Away from x*, where recovering x from y is well conditioned.
    x = torch.cat([torch.linspace(-4, -0.85, 9), torch.linspace(-0.65, 4, 9)]).double().requires_grad_()
    torch.autograd.gradcheck(inplace_gelu, (x,))


def test_keeps_only_its_output_and_one_bit_per_element(backend, device):
    torch.manual_seed(0)
    tempo = torch.nn.Sequential(torch.nn.Linear(64, 256), InplaceGelu(), torch.nn.Linear(256, 64)).to(device)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
    x = torch.randn(3, 5, 64, device=device, requires_grad=True)
    with ActivationLedger(tempo) as kept:
        tempo(x)
    with ActivationLedger(plain) as baseline:
        plain(x)
    hidden = 3 * 5 * 256
    # x (kept by the first Linear) + GELU output (shared with the second Linear) + the bits.
    assert kept.activation_bytes == x.numel() * 4 + hidden * 4 + hidden // 8
    # nn.GELU keeps its input on top of that, and no bits.
    assert baseline.activation_bytes == x.numel() * 4 + 2 * hidden * 4


def test_saved_output_is_the_returned_tensor(backend, device):
    x = torch.randn(4, 16, device=device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = inplace_gelu(x)
    assert any(s.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for s in saved)
    assert all(s.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for s in saved)


def test_non_contiguous_input(backend, device):
    base = torch.randn(12, 10, device=device)
    x = base.t().requires_grad_()  # non-contiguous
    ref = base.t().clone().double().requires_grad_()
    inplace_gelu(x).sum().backward()
    F.gelu(ref).sum().backward()
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=2e-4, rtol=0)


def test_autocast_keeps_the_input_dtype(device):
    x = torch.randn(8, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y = InplaceGelu()(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_checkpoint_equivalence(backend, device):
    layer = torch.nn.Sequential(torch.nn.Linear(16, 32), InplaceGelu(), torch.nn.Linear(32, 16)).to(device)
    x = torch.randn(5, 16, device=device, requires_grad=True)
    layer(x).square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    checkpoint(layer, x, use_reentrant=False).square().sum().backward()
    for expected, got in zip(grads, [p.grad for p in layer.parameters()] + [x.grad]):
        torch.testing.assert_close(got, expected)


def test_empty_input(backend, device):
    x = torch.empty(0, 4, device=device, requires_grad=True)
    y = inplace_gelu(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape


def test_opcheck(backend, device):
    x = torch.randn(3, 11, device=device, requires_grad=True)
    y, bits = torch.ops.tempo.inplace_gelu(x)
    torch.library.opcheck(torch.ops.tempo.inplace_gelu.default, (x,))
    torch.library.opcheck(torch.ops.tempo.inplace_gelu_backward.default, (torch.randn_like(y), y.detach(), bits))


@pytest.mark.slow
def test_compile_fullgraph_reference():
    from tempo.ops import use_backend

    layer = torch.nn.Sequential(torch.nn.Linear(8, 16), InplaceGelu(), torch.nn.Linear(16, 8))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 8, requires_grad=True)
    with use_backend("reference"):
        compiled(x).sum().backward()
        expected = x.grad.clone()
        x.grad = None
        layer(x).sum().backward()
    torch.testing.assert_close(x.grad, expected)


def test_bad_input():
    with pytest.raises(TypeError, match="'x'"):
        inplace_gelu(torch.arange(4))
    with pytest.raises(TypeError, match="'x'"):
        inplace_gelu([1.0, 2.0])


def test_fp64_is_refused_on_the_triton_path(backend, device):
    if backend != "triton":
        pytest.skip("the reference path supports fp64")
    with pytest.raises(TypeError, match="float64"):
        inplace_gelu(torch.randn(4, dtype=torch.float64, device=device))
