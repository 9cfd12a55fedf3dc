"""Combined softmax -> dropout -> matmul against an fp64 reference built in this file.

The fp64 reference uses the very keep-mask the op drew (``dropout_keep_mask`` regenerates it
from the seed), so outputs and gradients are compared element by element, dropout included.
"""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from conftest import triton_blocker
from tempo.combined import Combined, combined_softmax_dropout_matmul
from tempo.memory import ActivationLedger
from tempo.ops import _backend, combined
from tempo.ops._backend import triton_usable_for, use_backend
from tempo.ops.combined import _combined_bwd_op, _combined_fwd_op, dropout_keep_mask

# (atol, rtol) against fp64, for values of order 1.
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),  # one bf16 ULP more on the interpreter (it truncates)
}


def _reference(x, v, g, keep, p, dim=-1):
    """fp64 (out, dx, dv) of matmul(softmax(x, dim) * keep / (1 - p), v)."""
    x64 = x.detach().double().requires_grad_()
    v64 = v.detach().double().requires_grad_()
    probs = torch.softmax(x64, dim)
    if keep is not None:
        probs = probs * keep / (1.0 - p)
    out = torch.matmul(probs, v64)
    out.backward(g.double())
    return out.detach(), x64.grad, v64.grad


def _run(x, v, g, p, dim=-1, training=True, seed=None):
    x = x.detach().requires_grad_()
    v = v.detach().requires_grad_()
    out = combined_softmax_dropout_matmul(x, v, dim, p, training, seed)
    out.backward(g.clone())
    return out.detach(), x.grad, v.grad


def _close(actual, expected, dtype, scale=1.0):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected, atol=atol * scale, rtol=rtol)


def _inputs(x_shape, v_shape, dtype, device, scale=2.0):
    x = (torch.randn(x_shape, device=device) * scale).to(dtype)
    v = torch.randn(v_shape, device=device).to(dtype)
    return x, v


def _leaf(t):
    """An input that requires grad: the Tempo op runs (without a backward the stock ops do)."""
    return t.detach().clone().requires_grad_()


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _skip_unsupported(backend, dtype):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("fp64 runs on the reference path only")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_matches_fp64_reference(backend, device, dtype, p):
    _skip_unsupported(backend, dtype)
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), dtype, device)
    g = torch.randn(2, 3, 7, 4, device=device).to(dtype)
    seed = torch.tensor(1234, device=device)
    out, dx, dv = _run(x, v, g, p, seed=seed)
    keep = dropout_keep_mask(seed, x.shape, p, device, backend) if p else None
    ref_out, ref_dx, ref_dv = _reference(x, v, g, keep, p)
    assert out.dtype == dtype and dx.dtype == dtype and dv.dtype == dtype
    _close(out, ref_out, dtype)
    _close(dx, ref_dx, dtype)
    _close(dv, ref_dv, dtype)


@pytest.mark.parametrize("length", [1, 7, 123])
def test_odd_sequence_lengths(backend, device, length):
    x, v = _inputs((1, 1, length, length), (1, 1, length, 3), torch.float32, device)
    g = torch.randn(1, 1, length, 3, device=device)
    seed = torch.tensor(7, device=device)
    out, dx, dv = _run(x, v, g, 0.2, seed=seed)
    keep = dropout_keep_mask(seed, x.shape, 0.2, device, backend)
    ref = _reference(x, v, g, keep, 0.2)
    for got, want in zip((out, dx, dv), ref):
        _close(got, want, torch.float32)


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_other_dims_softmax_then_matmul(backend, device, dim):
    # Any dim: softmax along dim, then torch.matmul(probs, v) as written.
    if backend == "triton" and dim != -2:
        pytest.skip("one non-last dim is enough on the slow interpreter")
    x, v = _inputs((3, 4, 5), (3, 5, 2), torch.float32, device)
    g = torch.randn(3, 4, 2, device=device)
    seed = torch.tensor(99, device=device)
    out, dx, dv = _run(x, v, g, 0.25, dim=dim, seed=seed)
    keep = dropout_keep_mask(seed, x.shape, 0.25, device, backend, dim=dim)
    ref = _reference(x, v, g, keep, 0.25, dim=dim)
    for got, want in zip((out, dx, dv), ref):
        _close(got, want, torch.float32)


def test_non_contiguous_inputs(backend, device):
    x = (torch.randn(2, 3, 5, 7, device=device) * 2).transpose(-1, -2)  # [2, 3, 7, 5]
    v = torch.randn(2, 4, 3, 5, device=device).permute(0, 2, 3, 1)  # [2, 3, 5, 4]
    assert not x.is_contiguous() and not v.is_contiguous()
    g = torch.randn(2, 3, 7, 4, device=device)
    seed = torch.tensor(5, device=device)
    out, dx, dv = _run(x, v, g, 0.1, seed=seed)
    keep = dropout_keep_mask(seed, x.shape, 0.1, device, backend)
    ref = _reference(x, v, g, keep, 0.1)
    for got, want in zip((out, dx, dv), ref):
        _close(got, want, torch.float32)


def test_broadcast_batch_dims(device):
    # x [2, 3, 4, 5] against a v shared over the first batch dim, as torch.matmul broadcasts.
    x, v = _inputs((2, 3, 4, 5), (3, 5, 2), torch.float32, device)
    g = torch.randn(2, 3, 4, 2, device=device)
    seed = torch.tensor(3, device=device)
    with use_backend("reference"):
        out, dx, dv = _run(x, v, g, 0.2, seed=seed)
        keep = dropout_keep_mask(seed, x.shape, 0.2, device, "reference")
    ref = _reference(x, v, g, keep, 0.2)
    assert dv.shape == v.shape
    for got, want in zip((out, dx, dv), ref):
        _close(got, want, torch.float32)


@pytest.mark.parametrize("mode", ["p0", "eval"])
def test_no_dropout_is_softmax_matmul(backend, device, mode):
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), torch.float32, device)
    layer = Combined(dim=-1, p=0.0 if mode == "p0" else 0.5)
    if mode == "eval":
        layer.eval()
    out = layer(_leaf(x), v).detach()
    expected = torch.matmul(torch.softmax(x, -1), v)
    if backend == "reference":
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics_and_scaling(backend, device, p):
    # With v = I the output IS the dropout output: zeros where dropped, s / (1 - p) where kept.
    rows, n = 32, 128
    x = torch.randn(rows, n, device=device)
    eye = torch.eye(n, device=device)
    seed = torch.tensor(2024, device=device)
    dropped_probs = combined_softmax_dropout_matmul(x, eye, -1, p, True, seed)
    keep = dropout_keep_mask(seed, x.shape, p, device, backend)
    s = torch.softmax(x, -1)
    torch.testing.assert_close(dropped_probs, torch.where(keep, s / (1 - p), 0.0), atol=1e-6, rtol=1e-5)
    assert torch.equal(dropped_probs != 0, keep)
    kept = keep.float().mean().item()
    sigma = math.sqrt(p * (1 - p) / keep.numel())
    assert abs(kept - (1 - p)) < 3 * sigma, (kept, 1 - p, sigma)


def test_seed_determinism(backend, device):
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), torch.float32, device)
    a = combined_softmax_dropout_matmul(x, v, -1, 0.5, True, torch.tensor(11, device=device))
    b = combined_softmax_dropout_matmul(x, v, -1, 0.5, True, torch.tensor(11, device=device))
    c = combined_softmax_dropout_matmul(x, v, -1, 0.5, True, torch.tensor(12, device=device))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # The module draws its seed from torch's RNG: manual_seed makes it reproducible.
    layer = Combined(dim=-1, p=0.5)
    x = _leaf(x)
    torch.manual_seed(3)
    d = layer(x, v)
    torch.manual_seed(3)
    assert torch.equal(d, layer(x, v))


def test_additive_masks_and_fully_masked_rows(backend, device):
    scores = torch.randn(2, 2, 4, 6, device=device)
    v = torch.randn(2, 2, 6, 3, device=device)
    g = torch.randn(2, 2, 4, 3, device=device)
    seed = torch.tensor(8, device=device)

    # finfo.min mask, last two keys padded, one query row fully masked: behaves as torch
    # (the fully masked row is uniform).
    mask = torch.zeros(2, 1, 1, 6, device=device)
    mask[..., 4:] = torch.finfo(torch.float32).min
    x = scores + mask
    x[0, 0, 1, :] = torch.finfo(torch.float32).min
    out, dx, dv = _run(x, v, g, 0.2, seed=seed)
    keep = dropout_keep_mask(seed, x.shape, 0.2, device, backend)
    ref = _reference(x, v, g, keep, 0.2)
    for got, want in zip((out, dx, dv), ref):
        _close(got, want, torch.float32)
    row = combined_softmax_dropout_matmul(_leaf(x), torch.eye(6, device=device), -1, 0.0, True)[0, 0, 1]
    torch.testing.assert_close(row.detach(), torch.full_like(row, 1 / 6))

    # -inf mask: partial rows as torch; a fully -inf row gives probabilities 0 (torch: NaN),
    # so a zero output row and zero gradients, and no NaN anywhere.
    mask[..., 4:] = float("-inf")
    x = scores + mask
    x[0, 0, 1, :] = float("-inf")
    out, dx, dv = _run(x, v, g, 0.2, seed=seed)
    assert torch.isfinite(out).all() and torch.isfinite(dx).all() and torch.isfinite(dv).all()
    assert torch.equal(out[0, 0, 1], torch.zeros(3, device=device))
    assert torch.equal(dx[0, 0, 1], torch.zeros(6, device=device))
    partial = (slice(1, None),)  # rows of batch 1 have no fully masked row: match torch
    ref = _reference(x[partial], v[partial], g[partial], keep[partial], 0.2)
    dx_masked_keys = dx[..., 4:]
    assert torch.equal(dx_masked_keys, torch.zeros_like(dx_masked_keys))
    _close(out[partial], ref[0], torch.float32)
    _close(dx[partial], torch.nan_to_num(ref[1]), torch.float32)


def test_ledger_keeps_only_softmax_output_and_v(backend, device):
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), torch.float32, device)
    x.requires_grad_()
    v.requires_grad_()
    layer = Combined(dim=-1, p=0.1)
    with ActivationLedger(layer) as ours:
        layer(x, v)
    kept = sorted((r.shape, r.dtype, r.nbytes) for r in ours.records)
    s_bytes = x.numel() * 4
    assert kept == sorted([
        ((2, 3, 7, 5), torch.float32, s_bytes),  # softmax output
        ((2, 3, 5, 4), torch.float32, v.numel() * 4),  # v
        ((), torch.int64, 8),  # the dropout seed
    ])
    assert ours.activation_bytes == s_bytes + v.numel() * 4 + 8

    # Eager keeps the softmax output, the dropout mask and the dropout output, and v.
    with ActivationLedger() as eager:
        torch.matmul(F.dropout(torch.softmax(x, -1), 0.1, True), v)
    mask_bytes = eager.activation_bytes - 2 * s_bytes - v.numel() * 4
    assert mask_bytes >= x.numel()  # bool on CUDA (1 byte/elem); CPU keeps a float noise tensor
    assert eager.activation_bytes - ours.activation_bytes == s_bytes + mask_bytes - 8


def test_autocast_stores_softmax_in_autocast_dtype(device):
    # BERT: scores come out of a bf16 matmul, plus an fp32 additive mask -> fp32 x; v is bf16.
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), torch.float32, device)
    v = v.bfloat16()
    x.requires_grad_()
    v.requires_grad_()
    with use_backend("reference"), torch.autocast(device, dtype=torch.bfloat16):
        with ActivationLedger() as ledger:
            out = Combined(dim=-1, p=0.0)(x, v)
        expected = torch.matmul(torch.softmax(x, -1), v)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    kept = [(r.shape, r.dtype) for r in ledger.records]
    assert kept == [((2, 3, 7, 5), torch.bfloat16), ((2, 3, 5, 4), torch.bfloat16), ((), torch.int64)]
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16


def test_mixed_dtypes_cast_probabilities_to_v_dtype(device):
    x, v = _inputs((2, 7, 5), (2, 5, 4), torch.float32, device)
    with use_backend("reference"):
        out = combined_softmax_dropout_matmul(_leaf(x), v.double(), -1, 0.0, False)
    assert out.dtype == torch.float64 and out.grad_fn is not None
    torch.testing.assert_close(out.detach(), torch.softmax(x, -1).double() @ v.double())


def test_empty_tensors(backend, device):
    for x_shape, v_shape in [((2, 0, 5), (2, 5, 3)), ((2, 3, 0), (2, 0, 4))]:
        x = torch.randn(x_shape, device=device, requires_grad=True)
        v = torch.randn(v_shape, device=device, requires_grad=True)
        out = combined_softmax_dropout_matmul(x, v, -1, 0.1, True)
        assert out.shape == torch.matmul(x, v).shape
        assert torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        assert x.grad.shape == x.shape and v.grad.shape == v.shape


def test_checkpoint_equivalence(backend, device):
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), torch.float32, device)
    g = torch.randn(2, 3, 7, 4, device=device)
    layer = Combined(dim=-1, p=0.3)

    def run(use_checkpoint):
        xi = x.detach().requires_grad_()
        vi = v.detach().requires_grad_()
        torch.manual_seed(17)
        out = checkpoint(layer, xi, vi, use_reentrant=False) if use_checkpoint else layer(xi, vi)
        out.backward(g.clone())
        return out, xi.grad, vi.grad

    for plain, ckpt in zip(run(False), run(True)):
        assert torch.equal(plain, ckpt)


def test_opcheck(backend, device):
    x, v = _inputs((2, 3, 5), (2, 5, 4), torch.float32, device)
    x.requires_grad_()
    v.requires_grad_()
    seed = torch.tensor(21, device=device)
    for args in [(x, v, seed, 0.2, 2, True, torch.float32, backend),
                 (x, v, seed, 0.0, 1, False, torch.float32, backend)]:
        torch.library.opcheck(_combined_fwd_op, args)
    g = torch.randn(2, 3, 4, device=device)
    s = torch.softmax(x.detach(), -1)
    torch.library.opcheck(_combined_bwd_op, (g, s, v.detach(), seed, 0.2, 2, True, torch.float32, backend))
    s1 = torch.softmax(x.detach(), 1).movedim(1, -1).contiguous()  # saved layout: dim moved last
    g1 = torch.randn(2, 3, 4, device=device)
    torch.library.opcheck(_combined_bwd_op, (g1, s1, v.detach(), seed, 0.2, 1, True, torch.float32, backend))


def test_backward_uses_the_forward_backend(device):
    # Backward may run outside the forward's use_backend() block (CUDA: on autograd's thread);
    # it must regenerate the mask the forward drew, not one of the backend in force then.
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), torch.float32, device)
    if not triton_usable_for(x):
        pytest.skip("needs the Triton path next to the reference one")
    x.requires_grad_()
    g = torch.randn(2, 3, 7, 4, device=device)
    seed = torch.tensor(31, device=device)
    with use_backend("triton"):
        out = combined_softmax_dropout_matmul(x, v, -1, 0.5, True, seed)
    keep = dropout_keep_mask(seed, x.shape, 0.5, device, "triton")
    assert not torch.equal(keep, dropout_keep_mask(seed, x.shape, 0.5, device, "reference"))
    with use_backend("reference"):
        out.backward(g.clone())
    _close(x.grad, _reference(x, v, g, keep, 0.5)[1], torch.float32)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_long_rows_two_pass_kernels(backend, device, p):
    """Rows over SINGLE_PASS_MAX: the chunked kernels (online max/sum, two passes), with a
    finfo.min-masked tail and a fully -inf row."""
    n = combined.SINGLE_PASS_MAX + 37  # 3 chunks, the last partial
    x, v = _inputs((1, 1, 3, n), (1, 1, n, 2), torch.float32, device)
    x[..., -40:] = torch.finfo(torch.float32).min
    x[0, 0, 2, :] = float("-inf")
    g = torch.randn(1, 1, 3, 2, device=device)
    seed = torch.tensor(77, device=device)
    out, dx, dv = _run(x, v, g, p, seed=seed)
    keep = dropout_keep_mask(seed, x.shape, p, device, backend) if p else None
    ref_out, ref_dx, ref_dv = _reference(x[:, :, :2], v, g[:, :, :2], None if keep is None else keep[:, :, :2], p)
    _close(out[:, :, :2], ref_out, torch.float32)
    _close(dx[:, :, :2], ref_dx, torch.float32)
    _close(dv, ref_dv, torch.float32)  # the -inf row has probabilities 0: it adds nothing to dv
    assert torch.equal(out[0, 0, 2], torch.zeros(2, device=device))
    assert torch.equal(dx[0, 0, 2], torch.zeros(n, device=device))


def test_rows_over_the_triton_limit_fall_back_logged_once(backend, device, caplog, monkeypatch):
    monkeypatch.setattr(_backend, "_logged_once", set())
    n = combined.MAX_TRITON_ROW + 1
    x, v = _inputs((1, 1, 1, n), (1, 1, n, 2), torch.float32, device)
    g = torch.randn(1, 1, 1, 2, device=device)
    seed = torch.tensor(5, device=device)
    launched = []
    original = combined._triton_softmax_dropout_backward
    monkeypatch.setattr(combined, "_triton_softmax_dropout_backward",
                        lambda *a, **k: launched.append(1) or original(*a, **k))
    with caplog.at_level(logging.WARNING, logger="tempo"):
        out, dx, dv = _run(x, v, g, 0.1, seed=seed)
        _run(x, v, g, 0.1, seed=seed)
    # Forward and backward both ran the reference path: its mask is the one applied.
    keep = dropout_keep_mask(seed, x.shape, 0.1, device, "reference")
    for got, want in zip((out, dx, dv), _reference(x, v, g, keep, 0.1)):
        _close(got, want, torch.float32)
    assert launched == []
    fallbacks = [r for r in caplog.records if r.name == "tempo" and "reference path" in r.getMessage()]
    assert len(fallbacks) == (1 if backend == "triton" else 0)


def test_backward_walks_the_batch_in_chunks(backend, device, monkeypatch):
    """dD = g @ vᵀ never exists at full b·heads·s² size: the backward takes the flattened batch
    in ~BACKWARD_CHUNKS chunks, and the gradients match the whole-batch reference exactly."""
    name = "_triton_softmax_dropout_backward" if backend == "triton" else "_softmax_backward_reference"
    chunk_batches = []
    original = getattr(combined, name)
    monkeypatch.setattr(combined, name, lambda dd, *a, **k: chunk_batches.append(dd.shape[0]) or original(dd, *a, **k))
    x, v = _inputs((4, 4, 3, 6), (4, 4, 6, 2), torch.float32, device)  # 16 (b, head) pairs
    g = torch.randn(4, 4, 3, 2, device=device)
    seed = torch.tensor(9, device=device)
    out, dx, dv = _run(x, v, g, 0.3, seed=seed)
    assert chunk_batches == [2] * 8  # 16 / BACKWARD_CHUNKS per chunk
    keep = dropout_keep_mask(seed, x.shape, 0.3, device, backend)
    for got, want in zip((out, dx, dv), _reference(x, v, g, keep, 0.3)):
        _close(got, want, torch.float32)


def test_compile_fullgraph(device):
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), torch.float32, device)
    seed = torch.tensor(4, device=device)

    def attention(x, v, seed):
        return combined_softmax_dropout_matmul(x * 1.0, v, -1, 0.2, True, seed).sum(-1)

    with use_backend("reference"):
        compiled = torch.compile(attention, fullgraph=True)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        eager_out, compiled_out = attention(xs[0], v, seed), compiled(xs[1], v, seed)
        torch.testing.assert_close(compiled_out, eager_out)
        eager_out.sum().backward()
        compiled_out.sum().backward()
        torch.testing.assert_close(xs[1].grad, xs[0].grad)
        # The module draws its seed inside the graph: still one graph, and it runs.
        layer = Combined(dim=-1, p=0.2)
        assert torch.compile(layer, fullgraph=True)(_leaf(x), v).shape == (2, 3, 7, 4)
        # Without a backward: the stock ops, one graph too.
        assert torch.compile(layer, fullgraph=True)(x, v).shape == (2, 3, 7, 4)


def test_bad_inputs():
    x, v = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="'p'"):
            combined_softmax_dropout_matmul(x, v, -1, p, True)
        with pytest.raises(ValueError, match="'p'"):
            Combined(dim=-1, p=p)
    with pytest.raises(TypeError, match="'x'"):
        combined_softmax_dropout_matmul(x.long(), v)
    with pytest.raises(TypeError, match="'v'"):
        combined_softmax_dropout_matmul(x, v.int())
    with pytest.raises(ValueError, match=r"'dim'=3 .*rank 3"):
        combined_softmax_dropout_matmul(x, v, 3)
    with pytest.raises(ValueError, match=r"'dim'=-4 .*rank 3"):
        Combined(dim=-4, p=0.1)(x, v)
    with pytest.raises(ValueError, match="x's last dim .* v's"):
        combined_softmax_dropout_matmul(x, torch.randn(2, 5, 5))
    with pytest.raises(ValueError, match="batch dims of x .* and v"):
        combined_softmax_dropout_matmul(x, torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="'x' and 'v'"):
        combined_softmax_dropout_matmul(torch.randn(4), v)
    with pytest.raises(TypeError, match="'seed'"):
        combined_softmax_dropout_matmul(x, v, seed=torch.tensor(1.5))
    with pytest.raises(TypeError, match="'dim'"):
        Combined(dim=1.0)


def test_import_paths_and_repr():
    import tempo

    assert tempo.Combined is Combined
    # The rate lives in the nn.Dropout it holds (setting .p on a model's nn.Dropout modules reaches it).
    assert repr(Combined(-1, 0.1)) == "Combined(\n  dim=-1, p=0.1\n  (dropout): Dropout(p=0.1, inplace=False)\n)"


# ----------------------------------------------------------------------------------------
# No backward: the stock ops, nothing kept
# ----------------------------------------------------------------------------------------
def _scores_with_masked_rows(device, dtype):
    x = torch.randn(2, 2, 5, 9, device=device) * 3
    x[..., 7:] = float("-inf")  # masked keys
    x[0, 0, 1] = float("-inf")  # a row all -inf: probabilities 0 (torch.softmax gives NaN)
    x[0, 1, 2] = torch.finfo(torch.float32).min  # all finfo.min: uniform, as torch
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen", "eval"])
def test_no_backward_runs_the_stock_ops_and_keeps_nothing(backend, device, dtype, mode, monkeypatch):
    _skip_unsupported(backend, dtype)
    x = _scores_with_masked_rows(device, dtype)
    v = torch.randn(2, 2, 9, 4, device=device).to(dtype)
    stock_calls = []
    real = combined._stock_combined
    monkeypatch.setattr(combined, "_stock_combined", lambda *a: stock_calls.append(1) or real(*a))
    layer = Combined(dim=-1, p=0.0).eval()  # training mode runs the op without a backward too
    with ActivationLedger() as ledger:
        if mode == "no_grad":
            with torch.no_grad():
                out = layer(_leaf(x), _leaf(v))
        elif mode == "inference_mode":
            with torch.inference_mode():
                out = layer(x, v)
        elif mode == "frozen":
            out = layer(x, v)
        else:
            out = Combined(dim=-1, p=0.5).eval()(x, v)
    assert stock_calls == [1] and ledger.records == [] and out.grad_fn is None
    tempo = layer(_leaf(x), v)  # the Tempo op: same values within the dtype's rounding
    assert stock_calls == [1] and tempo.grad_fn is not None
    assert out.dtype == tempo.dtype == dtype
    _close(out, tempo.detach().double(), dtype)
    assert torch.equal(out[0, 0, 1], torch.zeros(4, dtype=dtype, device=device))
    assert torch.isfinite(out).all()


def test_no_backward_under_autocast_and_mixed_dtypes(device):
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        stock = combined_softmax_dropout_matmul(x, v.bfloat16(), -1, 0.0, True)
        tempo = combined_softmax_dropout_matmul(_leaf(x), v, -1, 0.0, True)
    assert stock.dtype == tempo.dtype == torch.bfloat16
    _close(stock, tempo.detach().double(), torch.bfloat16)
    # fp32 scores against an fp64 v: the probabilities meet v in fp64, as in the op.
    out = combined_softmax_dropout_matmul(x, v.double(), -1, 0.0, True)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.softmax(x, -1).double() @ v.double())


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_no_backward_dropout_rate_and_scale(device, p):
    x = torch.randn(64, 128, device=device)
    out = combined_softmax_dropout_matmul(x, torch.eye(128, device=device), -1, p, True)
    kept = out != 0
    rate = kept.float().mean().item()
    assert abs(rate - (1 - p)) < 3 * math.sqrt(p * (1 - p) / kept.numel()), rate
    torch.testing.assert_close(out[kept], (torch.softmax(x, -1) / (1 - p))[kept])


def test_no_backward_with_a_seed_keeps_the_seeded_op(backend, device):
    x, v = _inputs((2, 3, 7, 5), (2, 3, 5, 4), torch.float32, device)
    seed = torch.tensor(41, device=device)
    frozen = combined_softmax_dropout_matmul(x, v, -1, 0.5, True, seed)
    trained = combined_softmax_dropout_matmul(_leaf(x), v, -1, 0.5, True, seed)
    assert torch.equal(frozen, trained.detach())


# ----------------------------------------------------------------------------------------
# Launches and dropout streams
# ----------------------------------------------------------------------------------------
def test_every_triton_launch_runs_under_launch_on(device, monkeypatch):
    """Each Triton launch of this op happens inside launch_on (on CUDA: on its tensor's device):
    forward, the regenerated dropout output and mask, both backward layouts."""
    blocked = triton_blocker(device)
    if blocked is not None:
        (pytest.fail if blocked[0] == "fail" else pytest.skip)(blocked[1])
    from tempo.ops._backend import in_launch_guard, triton_interpreting

    if triton_interpreting() and device == "cpu":
        from triton.runtime.interpreter import InterpretedFunction as launcher
    else:
        from triton.runtime.jit import JITFunction as launcher
    launches = []
    original = launcher.run

    def run(kernel, *args, **kwargs):
        name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
        on_device = device == "cpu" or torch.cuda.current_device() == torch.device(device).index
        launches.append((name, in_launch_guard() and on_device))
        return original(kernel, *args, **kwargs)

    monkeypatch.setattr(launcher, "run", run)
    with use_backend("triton"):
        x, v = _inputs((2, 3, 4, 6), (2, 3, 6, 2), torch.float32, device)
        combined_softmax_dropout_matmul(_leaf(x), _leaf(v), -1, 0.3, True).sum().backward()
        x2, v2 = _inputs((2, 3, 4, 6), (3, 6, 2), torch.float32, device)  # v broadcast: whole-tensor backward
        combined_softmax_dropout_matmul(_leaf(x2), _leaf(v2), -1, 0.3, True).sum().backward()
        dropout_keep_mask(torch.tensor(3, device=device), (4, 6), 0.3, device, "triton")
    names = {n for n, _ in launches}
    assert {"_softmax_dropout_fwd_kernel", "_dropout_from_seed_kernel", "_softmax_dropout_bwd_kernel"} <= names, names
    assert all(ok for _, ok in launches), launches


def _correlation(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


def test_neighbouring_seeds_and_rows_draw_independent_masks(backend, device):
    shape, p = (8, 4, 64), 0.5
    keep = [dropout_keep_mask(torch.tensor(s, device=device), shape, p, device, backend).cpu() for s in (1000, 1001)]
    n = keep[0].numel()
    bound = 5 / math.sqrt(n / 2)  # 5 sigma of a correlation over n/2 pairs
    assert abs(_correlation(keep[0], keep[1])) < bound
    assert abs(_correlation(keep[0][0::2], keep[0][1::2])) < bound  # neighbouring rows
    assert abs(_correlation(keep[0][..., 0::2], keep[0][..., 1::2])) < bound  # neighbouring columns
