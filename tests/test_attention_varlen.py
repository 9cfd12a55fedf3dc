"""efficient_attention_varlen: packed sequences [T, H, D] attend inside their own sequence only.

Checked against efficient_attention on each sequence (same arithmetic, so same values and
gradients), against fp64, with dropout drawn per sequence from the seed, what it keeps (exact
bytes), the stock path without a backward, and the CUDA dispatch on a simulated H100.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck
from torch.nn.attention import SDPBackend, sdpa_kernel

from tempo.ops import attention as attn_mod
from tempo.ops.attention import attention_keep_mask, efficient_attention, efficient_attention_varlen

from test_attention_dispatch import _REAL_SDPA, CUDNN, EFFICIENT, FLASH, MATH, h100  # noqa: F401  (fixture)

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
        out = efficient_attention_varlen(q, k, v, cu, 130, training=False)
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
    with pytest.raises(TypeError, match="'min_seqlen'"):
        efficient_attention_varlen(q, k, v, cu, 3, min_seqlen=2.0)
    with pytest.raises(ValueError, match="'min_seqlen' must be in"):
        efficient_attention_varlen(q, k, v, cu, 3, min_seqlen=4)


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


def test_cuda_no_backward_never_offers_math_for_nested_inputs(h100):
    """torch's nested math path splits per sequence (a host read each) and refuses is_causal:
    never offered; the fused kernels are."""
    q, k, v, cu = packed([3, 9], h=2, d=64, dtype=torch.float16, grad=False)
    efficient_attention_varlen(q, k, v, cu, 9)
    assert h100.calls[0]["enabled"] == [FLASH, EFFICIENT] and h100.calls[0]["nested"]


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


# ------------------------------------------------------------------------------------------------
# Nested inputs take less than dense ones (issue 28): each decision on the simulated H100
# ------------------------------------------------------------------------------------------------
NESTED_CASES = {
    # name: (dtype, head dim, v head dim, with a backward, the offer sdpa gets; None: no nested call)
    "fp16_d64": (torch.float16, 64, 64, True, [FLASH, EFFICIENT]),
    "bf16_d64_no_backward": (torch.bfloat16, 64, 64, False, [FLASH, EFFICIENT]),
    "fp32_d64": (torch.float32, 64, 64, True, [EFFICIENT]),
    "fp32_d12": (torch.float32, 12, 12, True, [EFFICIENT]),  # efficient takes d % 4 == 0 in fp32
    "fp16_d_v_32": (torch.float16, 64, 32, True, [EFFICIENT]),  # nested flash needs equal head dims
    # Flash is the only dense kernel for fp16 head dim 12 (it pads), but nested flash refuses a head
    # dim that is not a multiple of 8: offering it alone made torch raise "No viable backend".
    "fp16_d12": (torch.float16, 12, 12, True, None),
}


@pytest.mark.parametrize("name", list(NESTED_CASES))
def test_cuda_nested_offer_is_what_nested_sdpa_takes(h100, caplog, name):
    dtype, d, d_v, grad, expected = NESTED_CASES[name]
    q, k, v, cu = packed([3, 9], h=2, d=d, dtype=dtype, grad=grad)
    v = torch.randn(12, 2, d_v).to(dtype).requires_grad_(grad)
    with caplog.at_level("WARNING", logger="tempo"):
        out = efficient_attention_varlen(q, k, v, cu, 9)
    if expected is None:
        assert h100.calls == []  # the reference op
        assert any("variable length" in r.getMessage() and "head_dim 12" in r.getMessage() for r in caplog.records)
    else:
        (call,) = h100.calls
        assert call["nested"] and call["enabled"] == expected and call["chosen"] == expected[0]
    ref = per_sequence(lambda *s: _REAL_SDPA(*(t.double() for t in s)), q.detach(), k.detach(), v.detach(), cu)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.detach().double(), ref, rtol=tol, atol=tol)
    if grad:
        out.float().sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


def test_cuda_no_backward_without_a_nested_kernel_runs_dense_sdpa_per_sequence(h100):
    """fp16 head dim 12 without a backward: no nested kernel, so stock dense sdpa on each sequence
    (where flash pads the head dim), never nested math."""
    q, k, v, cu = packed([3, 9], h=2, d=12, dtype=torch.float16, grad=False)
    out = efficient_attention_varlen(q, k, v, cu, 9, training=False)
    assert [c["nested"] for c in h100.calls] == [False, False]
    assert all(c["chosen"] == FLASH and MATH in c["enabled"] for c in h100.calls)
    ref = efficient_attention_varlen(q.float().requires_grad_(), k.float(), v.float(), cu, 9)  # fp32: nested
    torch.testing.assert_close(out.float(), ref.detach(), rtol=2e-2, atol=2e-3)


def test_cuda_causal_without_a_fused_kernel_runs_per_sequence(h100):
    """Every fused backend switched off, math on, causal, no backward: torch's nested math refuses
    is_causal (it crashed); the stock dense sdpa per sequence takes it."""
    q, k, v, cu = packed([3, 9], h=2, d=16, grad=False)
    try:
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        out = efficient_attention_varlen(q, k, v, cu, 9, is_causal=True, training=False)
    finally:
        for enable in (torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.enable_mem_efficient_sdp,
                       torch.backends.cuda.enable_cudnn_sdp):
            enable(True)
    assert [(c["nested"], c["chosen"], c["is_causal"]) for c in h100.calls] == [(False, MATH, True)] * 2
    ref = per_sequence(lambda *s: efficient_attention(*s, is_causal=True), q.requires_grad_(), k, v, cu)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad", [True, False], ids=["backward", "no_backward"])
def test_cuda_empty_sequence_never_goes_to_nested_kernels(h100, grad):
    """torch's nested flash and efficient refuse a sequence of length 0 (and math is never
    offered): the reference op with a backward, dense sdpa per sequence without one."""
    q, k, v, cu = packed([3, 0, 9], h=2, d=64, dtype=torch.float16, grad=grad)
    out = efficient_attention_varlen(q, k, v, cu, 9, training=False)
    assert all(not c["nested"] for c in h100.calls) and len(h100.calls) == (0 if grad else 2)
    assert out.shape == (12, 2, 64)


def test_cuda_path_reads_nothing_given_or_remembering_the_lengths(h100):
    """min_seqlen and max_seqlen reach the nested tensors, so torch reads neither back (it read
    offsets.diff().min() for q, k and v: three host reads per layer). Without min_seqlen, a
    cu_seqlens is read once per tensor object, not per call; one recorded with
    remember_sequences (TokenLayout, the HF packing path) is never read."""
    from test_attention_dispatch import FakeH100
    from test_host_reads import HostReadCounter

    from tempo.ops.attention import remember_sequences

    def reads(fn):
        counter = HostReadCounter(stand_ins=[FakeH100.sdpa, FakeH100.takes_nested, FakeH100._seq_len_0],
                                  quiet=[FakeH100.compute])
        with counter.installed(), counter.counting():
            fn()
        return counter.total

    q, k, v, cu = packed([3, 9, 5], h=2, d=64, dtype=torch.float16)
    assert reads(lambda: efficient_attention_varlen(q, k, v, cu, 9, min_seqlen=3)) == 0
    fresh = cu.clone()
    assert reads(lambda: efficient_attention_varlen(q, k, v, fresh, 9)) == 1  # read once ...
    assert reads(lambda: [efficient_attention_varlen(q, k, v, fresh, 9) for _ in range(3)]) == 0  # ... and kept
    fresh[1] = 4  # an in-place write bumps the version: read again
    assert reads(lambda: efficient_attention_varlen(q, k, v, fresh, 9)) == 1
    remembered = cu.clone()
    remember_sequences(remembered, [0, 3, 12, 17])
    assert reads(lambda: efficient_attention_varlen(q, k, v, remembered, 9)) == 0
    assert all(c["nested"] and c["chosen"] == FLASH for c in h100.calls)


# ------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) of the CUDA branch
# ------------------------------------------------------------------------------------------------
def _cuda_nested_choice(query, key, value, attn_mask, dropout, is_causal, enable_gqa):
    """torch's nested backend choice as on CUDA (torch/nested/_internal/sdpa.py's _select_sdp_backend
    with the C++ device checks left out, which refuse CPU tensors): its own nested checks, which
    read the shortest sequence of q, k and v (a .item() each unless the nested tensor has it)."""
    from torch.backends.cuda import SDPAParams, flash_sdp_enabled, mem_efficient_sdp_enabled
    from torch.nested._internal import sdpa as nested_sdpa

    params = SDPAParams(query, key, value, attn_mask, dropout, is_causal, enable_gqa)
    if flash_sdp_enabled() and query.dtype in (torch.float16, torch.bfloat16) \
            and nested_sdpa._can_use_flash_sdpa_jagged(params):
        return FLASH
    if mem_efficient_sdp_enabled() and nested_sdpa._can_use_efficient_sdpa_jagged(params):
        return EFFICIENT
    return SDPBackend.ERROR


class _TracedOnly(Exception):
    """Raised by the compiled graph: the CPU has no nested flash/efficient kernel to run it with."""


# The efficient kernel's case with a backward fails inside torch (2.11 and 2.13): the meta function
# of aten._efficient_attention_backward lacks the schema's `out` argument, so under fake tensors
# ("got multiple values for argument 'scale'") any compiled training step through torch's nested
# efficient path fails, on a GPU too. Strict xfail: it passes the day torch fixes it.
_TORCH_META_BUG = pytest.mark.xfail(strict=True, raises=Exception,
                                    reason="torch's meta__efficient_attention_backward lacks the `out` argument")


@pytest.mark.parametrize("dtype,kernel,grad", [
    (torch.bfloat16, "_flash_attention_forward", True),
    (torch.float32, "_efficient_attention_forward", False),
    pytest.param(torch.float32, "_efficient_attention_forward", True, marks=_TORCH_META_BUG),
], ids=["flash", "efficient_no_backward", "efficient"])
def test_cuda_branch_compiles_fullgraph(h100, monkeypatch, dtype, kernel, grad):
    """The unpadded attention's CUDA branch (the dispatch, nested tensors given min and max
    seqlen, torch's nested sdpa with its CUDA backend choice) traced by torch.compile(fullgraph=True)
    through AOTAutograd on the simulated H100: no graph break, no host read (_local_scalar_dense) in
    the graph, torch's fused varlen kernel in it. The graph is traced, not run (no CPU kernel).
    The control: the same nested tensors without min_seqlen fail to trace (the .item())."""
    from torch._dynamo.backends.common import aot_autograd
    from torch.nested._internal import sdpa as nested_sdpa

    monkeypatch.setattr(F, "scaled_dot_product_attention", _REAL_SDPA)  # torch's own, not the spy
    monkeypatch.setattr(nested_sdpa, "_select_sdp_backend", _cuda_nested_choice)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise _TracedOnly()
        return run

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    q, k, v, cu = packed([3, 9, 5], h=2, d=16, dtype=dtype, grad=grad)

    def fn(q, k, v, cu):
        return efficient_attention_varlen(q, k, v, cu, 9, min_seqlen=3) * 1.0

    torch._dynamo.reset()
    try:
        with pytest.raises(_TracedOnly):
            torch.compile(fn, backend=backend, fullgraph=True)(q, k, v, cu)
        targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
        assert any(kernel in t for t in targets), targets
        assert not any("_local_scalar_dense" in t or "nonzero" in t for t in targets), targets

        def without_min(q, k, v, cu):  # what the code did before: max_seqlen only
            nested = [torch.nested.nested_tensor_from_jagged(x, offsets=cu.long(), max_seqlen=9).transpose(1, 2)
                      for x in (q, k, v)]
            with sdpa_kernel([FLASH, EFFICIENT]):
                return F.scaled_dot_product_attention(*nested).transpose(1, 2).values()

        torch._dynamo.reset()
        graphs.clear()
        with pytest.raises(Exception) as err:
            torch.compile(without_min, backend=backend, fullgraph=True)(q, k, v, cu)
        assert not isinstance(err.value, _TracedOnly) and not graphs
        assert "data-dependent" in str(err.value).lower() or "item" in str(err.value), str(err.value)[:500]
    finally:
        torch._dynamo.reset()
