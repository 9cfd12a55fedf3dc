"""Which kernel efficient_attention runs on CUDA, checked on the CPU by simulating an H100.

The simulation: ``_is_cuda`` says yes, the device is sm90 with cuDNN 9.19 (torch 2.11's CUDA 13
wheel), and torch's lazy default priority (cuDNN, flash, efficient, math on that device) is
installed by the first sdpa selection of the process, as torch 2.11's ``priority_order()`` does.
``F.scaled_dot_product_attention`` is replaced by a spy that records what it was called with,
which backends were enabled and in which priority order, and which one torch 2.11 would select
there (the first enabled backend in priority order that takes the call; cuDNN 2.11 takes masks
and any dropout rate, which is the hazard), then computes the result with the CPU math kernel.
The user's switches (``torch.backends.cuda.enable_*_sdp``) are the real global flags.
"""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, sdpa_kernel

from tempo.memory import ActivationLedger
from tempo.ops import attention as attn_mod
from tempo.ops._backend import use_backend
from tempo.ops.attention import efficient_attention

FLASH, EFFICIENT, CUDNN, MATH = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                 SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)
CUDNN_FIRST = [int(CUDNN), int(FLASH), int(EFFICIENT), int(MATH), int(SDPBackend.OVERRIDEABLE)]
_REAL_SDPA = F.scaled_dot_product_attention


class FakeH100:
    """torch 2.11 on an H100 with cuDNN 9.19, as far as the dispatch can see it."""

    def __init__(self, sm=90, cudnn_version=91900):
        self.sm, self.cudnn_version = sm, cudnn_version
        self.priority_installed = False  # torch's priority_order_init_
        self.choice_probes = 0
        self.calls = []  # one dict per sdpa call

    def install_default_priority(self):
        # What priority_order() does on its first call on sm90 with cuDNN > 9.15.
        if not self.priority_installed:
            self.priority_installed = True
            torch._C._set_sdp_priority_order(CUDNN_FIRST)

    def fused_sdp_choice(self, q, k, v, *args, **kwargs):
        self.choice_probes += 1
        self.install_default_priority()
        return int(FLASH)

    @staticmethod
    def takes(backend, q, k, v, mask, p, is_causal, enable_gqa=False):
        """Whether torch 2.11 on sm90 would take the call on ``backend`` (the parts that matter here).
        Grouped-query heads (k, v with fewer heads than q): only with enable_gqa, and then flash,
        cuDNN and math take them; the efficient kernel checks equal heads (sdp_utils'
        ``check_batch_size_and_num_heads_dense<false>``)."""
        half = q.dtype in (torch.float16, torch.bfloat16)
        if not q.is_nested and k.shape[1] != q.shape[1]:
            if not enable_gqa or backend == EFFICIENT:
                return False
        if backend == FLASH:
            return mask is None and half and q.shape[-1] == v.shape[-1] <= 256
        if backend == EFFICIENT:
            align = 8 if half else 4
            return q.dtype != torch.float64 and q.shape[-1] % align == 0 and v.shape[-1] % align == 0
        if backend == CUDNN:  # no 1/16 dropout check, masks taken: 2.11
            return half and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0
        return backend == MATH

    @staticmethod
    def _seq_len_0(*nested):
        # torch's _check_for_seq_len_0_nested: the shortest sequence of q, then k, then v (each a
        # host read, offsets.diff().min().item(), unless the nested tensor was given min_seqlen).
        return all(t._get_min_seqlen() > 0 for t in nested)

    def takes_nested(self, backend, q, k, v, p, is_causal):
        """torch's nested (jagged) sdpa (torch/nested/_internal/sdpa.py, the same in 2.11 and 2.13):
        flash also needs equal head dims that are a multiple of 8 (only dense flash pads them);
        flash and efficient refuse an empty sequence; math refuses is_causal; cuDNN is not modelled."""
        if backend == FLASH:
            d = q.shape[-1]
            return (self.takes(FLASH, q, k, v, None, p, is_causal) and d == k.shape[-1] == v.shape[-1]
                    and d % 8 == 0 and self._seq_len_0(q, k, v))
        if backend == EFFICIENT:
            return self.takes(EFFICIENT, q, k, v, None, p, is_causal) and self._seq_len_0(q, k, v)
        if backend == MATH:
            return not is_causal
        return False

    def sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        self.install_default_priority()  # sdpa's own selection goes through priority_order() too
        enabled = _cur_sdpa_kernel_backends(with_priority=True)
        if q.is_nested:
            # Nested sdpa ignores the priority order: flash, efficient, math, cuDNN, the enabled ones.
            order = [b for b in (FLASH, EFFICIENT, MATH, CUDNN) if b in enabled]
            chosen = next((b for b in order if self.takes_nested(b, q, k, v, dropout_p, is_causal)), None)
        else:
            gqa = kwargs.get("enable_gqa", False)
            chosen = next((b for b in enabled if self.takes(b, q, k, v, attn_mask, dropout_p, is_causal, gqa)), None)
        self.calls.append(dict(enabled=enabled, priority=torch._C._get_sdp_priority_order(), chosen=chosen,
                               mask=attn_mask, p=dropout_p, is_causal=is_causal, scale=scale, nested=q.is_nested,
                               enable_gqa=kwargs.get("enable_gqa", False), kv_heads=k.shape[1]))
        assert chosen is not None, f"No viable backend (enabled {enabled})"
        if q.is_nested and chosen in (FLASH, EFFICIENT):
            # _sdpa_nested_preprocessing: cu_seqlens and max_seqlen of q and k, min_seqlen of q.
            qt, kt = q.transpose(1, 2), k.transpose(1, 2)
            qt._get_max_seqlen(), kt._get_max_seqlen(), qt._get_min_seqlen()
        return self.compute(q, k, v, attn_mask, dropout_p, is_causal, scale, kwargs.get("enable_gqa", False))

    @staticmethod
    def compute(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa=False):
        """The result, on the CPU: the math kernel (per sequence for nested inputs, causal too)."""
        if not q.is_nested:
            with sdpa_kernel([MATH]):
                return _REAL_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                  scale=scale, enable_gqa=enable_gqa)
        qv, kv, vv = (t.transpose(1, 2).values() for t in (q, k, v))  # [T, H, D]
        offsets = q.offsets()
        bounds = offsets.tolist()
        pieces = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            seq = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (qv, kv, vv)]
            with sdpa_kernel([MATH]):
                o = _REAL_SDPA(*seq, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
            pieces.append(o[0].transpose(0, 1))
        out = torch.cat(pieces) if pieces else qv.new_zeros((0, qv.shape[1], vv.shape[2]))
        return torch.nested.nested_tensor_from_jagged(out, offsets).transpose(1, 2)


@pytest.fixture
def h100(monkeypatch):
    """Simulate the H100: restores torch's switches and priority order afterwards."""
    flags = _cur_sdpa_kernel_backends()
    order = torch._C._get_sdp_priority_order()
    fake = FakeH100()
    monkeypatch.setattr(attn_mod, "_is_cuda", lambda t: True)
    monkeypatch.setattr(attn_mod, "_device_facts", lambda device: (fake.sm, fake.cudnn_version))
    monkeypatch.setattr(attn_mod, "_sdpa_priority_initialised", False)
    monkeypatch.setattr(attn_mod, "_logged_fallbacks", set())
    monkeypatch.setattr(torch, "_fused_sdp_choice", fake.fused_sdp_choice)
    monkeypatch.setattr(F, "scaled_dot_product_attention", fake.sdpa)
    yield fake
    torch.nn.attention._sdpa_kernel(flags)
    torch._C._set_sdp_priority_order(order)


def _qkv(dtype, b=2, h=2, s=64, d=64, d_v=None, grad=True):
    q = torch.randn(b, h, s, d).to(dtype)
    k = torch.randn(b, h, s, d).to(dtype)
    v = torch.randn(b, h, s, d_v or d).to(dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _padding_mask(b, s, kind, dtype):
    valid = torch.ones(b, 1, 1, s, dtype=torch.bool)
    valid[1, ..., s // 2:] = False
    if kind == "bool":
        return valid
    return torch.zeros(b, 1, 1, s, dtype=dtype).masked_fill(~valid, torch.finfo(dtype).min)


def _fallback_logs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "tempo" and "reference attention" in r.getMessage()]


# ------------------------------------------------------------------------------------------------
# What is offered, in which order
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.125])
def test_no_mask_offers_flash_then_efficient_then_cudnn(h100, dtype, p):
    """torch's default on this device puts cuDNN first; we set flash, efficient, cuDNN with
    set_priority=True, after torch installed its default, so flash is what runs."""
    flags = _cur_sdpa_kernel_backends()
    out = efficient_attention(*_qkv(dtype), dropout_p=p)
    (call,) = h100.calls
    assert call["enabled"] == [FLASH, EFFICIENT, CUDNN]
    assert call["priority"][:3] == [int(FLASH), int(EFFICIENT), int(CUDNN)]
    assert call["chosen"] == FLASH and call["mask"] is None and call["p"] == p
    assert out.dtype == dtype
    # Torch's own default is in place afterwards, exactly, and the switches are as they were.
    assert torch._C._get_sdp_priority_order() == CUDNN_FIRST
    assert _cur_sdpa_kernel_backends() == flags


def test_default_priority_installed_once_before_our_block(h100, monkeypatch):
    """Without installing torch's lazy default first, the first call would run cuDNN (the
    default overwrites our priority inside the block) and leave the process without it."""
    for _ in range(3):
        efficient_attention(*_qkv(torch.bfloat16))
    assert h100.choice_probes == 1
    assert [c["chosen"] for c in h100.calls] == [FLASH] * 3
    # The hazard the probe removes, shown on the same simulation.
    torch._C._set_sdp_priority_order([int(FLASH), int(EFFICIENT), int(MATH), int(CUDNN), int(SDPBackend.OVERRIDEABLE)])
    h100.priority_installed = False
    monkeypatch.setattr(attn_mod, "_initialise_sdpa_priority", lambda device: None)
    efficient_attention(*_qkv(torch.bfloat16))
    assert h100.calls[-1]["chosen"] == CUDNN


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("s", [64, 320])
@pytest.mark.parametrize("p", [0.0, 0.125])
def test_mask_never_offers_cudnn(h100, dtype, kind, s, p):
    """A mask is never given to cuDNN (NaN grad_q when s % 128 == 64, pytorch 196678), whatever
    the dropout rate: the efficient kernel takes it. An additive mask arrives in q's dtype. (An
    additive mask with dropout runs the reference op: see the float-mask tests below.)"""
    q, k, v = _qkv(dtype, s=s)
    mask = _padding_mask(2, s, kind, torch.float32)
    out = efficient_attention(q, k, v, attn_mask=mask, dropout_p=p)
    if kind == "additive" and p > 0:
        assert h100.calls == []
        return
    (call,) = h100.calls
    assert call["enabled"] == [EFFICIENT] and call["chosen"] == EFFICIENT
    assert call["mask"].dtype == (torch.bool if kind == "bool" else dtype)
    out.float().sum().backward()  # the CPU math kernel's backward: the graph is sdpa's
    assert q.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_mask_entries_at_the_floor_become_minus_inf(h100, dtype):
    """The fused kernels keep one fp32 log-sum-exp per row, which a finfo.min row absorbs: such
    entries go in as -inf (a fully masked row gives 0, gradient 0); the others as they are."""
    q, k, v = _qkv(dtype, s=8, d=16)
    mask = torch.zeros(2, 1, 8, 8)
    mask[..., 6:] = torch.finfo(torch.float32).min
    mask[0, 0, 3] = torch.finfo(torch.float32).min  # a fully masked row
    mask[1, 0, 2, 0] = -1000.0  # large, but above the floor: a number
    out = efficient_attention(q, k, v, attn_mask=mask)
    sent = h100.calls[0]["mask"]
    assert sent.dtype == dtype
    assert torch.equal(torch.isinf(sent), mask <= attn_mod.FUSED_MASK_FLOOR)
    assert sent[1, 0, 2, 0].item() == torch.tensor(-1000.0).to(dtype).item()
    assert (out[0, :, 3] == 0).all()
    out.float().sum().backward()
    assert (q.grad[0, :, 3] == 0).all() and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("p", [0.1, 0.3, 0.05, 0.0625, 0.125, 0.5])
def test_cudnn_only_at_sixteenths_of_dropout(h100, p):
    """cuDNN's dropout rate has 1/16 resolution and torch 2.11 does not check: p = 0.1 would run
    at another rate. It is offered only when 16·p is an integer."""
    efficient_attention(*_qkv(torch.bfloat16), dropout_p=p)
    offered_cudnn = CUDNN in h100.calls[0]["enabled"]
    assert offered_cudnn == (p * 16 == int(p * 16))
    # Eval: no dropout, so cuDNN may be offered whatever p is.
    efficient_attention(*_qkv(torch.bfloat16), dropout_p=p, training=False)
    assert CUDNN in h100.calls[1]["enabled"]


def test_cudnn_alone_and_a_rate_it_cannot_draw_runs_the_reference_op(h100, caplog):
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    with caplog.at_level(logging.WARNING, logger="tempo"):
        efficient_attention(*_qkv(torch.bfloat16), dropout_p=0.125)
        assert h100.calls[-1]["enabled"] == [CUDNN] and h100.calls[-1]["chosen"] == CUDNN
        q, k, v = _qkv(torch.bfloat16)
        out = efficient_attention(q, k, v, dropout_p=0.1, seed=None)
        efficient_attention(q, k, v, dropout_p=0.1)
    assert len(h100.calls) == 1  # the p = 0.1 calls never reached sdpa
    out.float().sum().backward()  # the reference op's backward
    logs = _fallback_logs(caplog)
    assert len(logs) == 1 and "dropout 0.1" in logs[0] and "enabled: cudnn" in logs[0], logs


# ------------------------------------------------------------------------------------------------
# The user's switches and enclosing sdpa_kernel blocks
# ------------------------------------------------------------------------------------------------
def test_disabled_cudnn_stays_disabled(h100):
    h100.install_default_priority()  # as after any earlier sdpa call of the process
    torch.backends.cuda.enable_cudnn_sdp(False)
    order_before = torch._C._get_sdp_priority_order()
    for p in (0.0, 0.125):
        efficient_attention(*_qkv(torch.bfloat16), dropout_p=p)
    assert all(CUDNN not in c["enabled"] for c in h100.calls)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch._C._get_sdp_priority_order() == order_before


def test_enclosing_sdpa_kernel_narrows_the_offer(h100):
    with sdpa_kernel([EFFICIENT]):
        efficient_attention(*_qkv(torch.bfloat16))
        assert _cur_sdpa_kernel_backends() == [EFFICIENT]  # the caller's block, intact
    assert h100.calls[0]["enabled"] == [EFFICIENT]
    with sdpa_kernel([CUDNN, FLASH], set_priority=True):
        efficient_attention(*_qkv(torch.bfloat16), attn_mask=_padding_mask(2, 64, "bool", torch.float32))
    # Flash takes no mask and cuDNN gets none from us: nothing fused left, the reference op ran.
    assert len(h100.calls) == 1


def test_exact_priority_order_restored(h100):
    """sdpa_kernel(set_priority=True) alone would put the disabled cuDNN after our backends on
    exit; the caller's order comes back exactly."""
    torch._C._set_sdp_priority_order(CUDNN_FIRST)
    h100.priority_installed = True
    torch.backends.cuda.enable_cudnn_sdp(False)
    efficient_attention(*_qkv(torch.bfloat16))
    assert torch._C._get_sdp_priority_order() == CUDNN_FIRST
    assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()


def test_math_is_never_offered_with_a_backward(h100, caplog):
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    with caplog.at_level(logging.WARNING, logger="tempo"):
        efficient_attention(*_qkv(torch.bfloat16))
    assert h100.calls == []
    assert "enabled: none" in _fallback_logs(caplog)[0]


# ------------------------------------------------------------------------------------------------
# Inputs no fused kernel takes, and the float mask that needs a gradient
# ------------------------------------------------------------------------------------------------
def _non_unit_stride(dtype):
    q, k, v = (torch.randn(2, 2, 64, 64).to(dtype).transpose(-1, -2).contiguous().transpose(-1, -2)
               for _ in range(3))
    return q[..., ::2], k[..., ::2], v[..., ::2]  # head dim 32 with stride 2


REFERENCE_CASES = {
    "fp64": dict(dtype=torch.float64),
    "fp16_d12_mask": dict(dtype=torch.float16, d=12, mask=True),
    "fp32_d6": dict(dtype=torch.float32, d=6),
    "bf16_on_sm75": dict(dtype=torch.bfloat16, sm=75),
    "fp16_d_v_300": dict(dtype=torch.float16, d=64, d_v=300, mask=True),
    "non_unit_stride": dict(dtype=torch.float16, strided=True),
}


def _case_inputs(case):
    if case.get("strided"):
        q, k, v = (t.requires_grad_() for t in _non_unit_stride(case["dtype"]))
    else:
        q, k, v = _qkv(case["dtype"], d=case.get("d", 64), d_v=case.get("d_v"))
    mask = _padding_mask(2, 64, "bool", torch.float32) if case.get("mask") else None
    return q, k, v, mask


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_inputs_no_fused_kernel_takes_run_the_reference_op_logged_once(h100, caplog, name):
    case = REFERENCE_CASES[name]
    h100.sm = case.get("sm", h100.sm)
    q, k, v, mask = _case_inputs(case)
    with caplog.at_level(logging.WARNING, logger="tempo"):
        out = efficient_attention(q, k, v, attn_mask=mask)
        efficient_attention(q, k, v, attn_mask=mask)
    assert h100.calls == []
    logs = _fallback_logs(caplog)
    assert len(logs) == 1 and str(q.dtype) in logs[0], logs
    with sdpa_kernel([MATH]):
        expected = _REAL_SDPA(q.detach().double(), k.detach().double(), v.detach().double(),
                              attn_mask=mask)
    torch.testing.assert_close(out.detach().double(), expected, atol=2e-2 if q.dtype != torch.float64 else 1e-12,
                               rtol=1e-2)


def test_float_mask_that_needs_grad_gets_it_from_the_reference_op(h100, caplog):
    """The fused efficient kernel's mask gradient hits illegal memory on torch 2.11 (pytorch
    148476): a float mask that requires grad goes to the reference op, whose gradient is checked
    against fp64."""
    q, k, v = _qkv(torch.float32, s=40, d=16)
    mask = torch.randn(2, 1, 40, 40, requires_grad=True)
    g = torch.randn(2, 2, 40, 16)
    with caplog.at_level(logging.WARNING, logger="tempo"):
        efficient_attention(q, k, v, attn_mask=mask).backward(g)
    assert h100.calls == []
    assert "148476" in _fallback_logs(caplog)[0]
    m64 = mask.detach().double().requires_grad_()
    with sdpa_kernel([MATH]):
        _REAL_SDPA(q.detach().double(), k.detach().double(), v.detach().double(), attn_mask=m64).backward(g.double())
    torch.testing.assert_close(mask.grad.double(), m64.grad, atol=1e-5, rtol=1e-4)
    # The same mask without a gradient to compute goes to the fused kernel.
    efficient_attention(q, k, v, attn_mask=mask.detach())
    assert h100.calls[0]["chosen"] == EFFICIENT


@pytest.mark.parametrize("requires_grad", [False, True], ids=["bias", "learned_bias"])
def test_float_mask_with_dropout_runs_the_reference_op_whatever_its_requires_grad(h100, caplog, requires_grad):
    """One rule for every pass (issue 28): a float mask with dropout on runs the reference op,
    whether or not it requires grad, so a no-grad pass and its replay with grad draw the same mask
    from the same op. A bool mask with dropout keeps the fused kernel; a float mask without
    dropout and without grad too (nothing is drawn; the paths agree to rounding)."""
    q, k, v = _qkv(torch.bfloat16, s=16, d=16)
    bias = torch.randn(2, 1, 16, 16, requires_grad=requires_grad)
    with caplog.at_level(logging.WARNING, logger="tempo"):
        efficient_attention(q, k, v, attn_mask=bias, dropout_p=0.1)
        with torch.no_grad():
            efficient_attention(q, k, v, attn_mask=bias, dropout_p=0.1)
    assert h100.calls == []
    assert any("float attn_mask with dropout on" in m for m in _fallback_logs(caplog))
    efficient_attention(q, k, v, attn_mask=_padding_mask(2, 16, "bool", torch.float32), dropout_p=0.1)
    efficient_attention(q, k, v, attn_mask=bias.detach(), dropout_p=0.0)
    assert [c["chosen"] for c in h100.calls] == [EFFICIENT, EFFICIENT]
    assert h100.calls[0]["p"] == 0.1 and h100.calls[0]["mask"].dtype == torch.bool


@pytest.mark.parametrize("case", ["learned", "dropout", "beside_a_mask"])
def test_attn_bias_runs_the_reference_op_where_a_fused_kernel_would_keep_or_draw_otherwise(h100, caplog, case):
    """MPNet's batch-shared bias [1, h, s, s]: with a backward it runs the reference op when it
    requires grad, when dropout is on (the float-mask rule), or beside a padding mask (sdpa takes one
    mask: the merged one would be (b, h, s, s) and kept); alone, frozen, without dropout, it is the
    fused efficient kernel's mask as given."""
    q, k, v = _qkv(torch.bfloat16, s=16, d=16)
    bias = torch.randn(1, 2, 16, 16, requires_grad=case == "learned")
    kwargs = dict(attn_bias=bias, dropout_p=0.1 if case == "dropout" else 0.0)
    if case == "beside_a_mask":
        kwargs["attn_mask"] = _padding_mask(2, 16, "bool", torch.float32)
    with caplog.at_level(logging.WARNING, logger="tempo"):
        out = efficient_attention(q, k, v, **kwargs)
    assert h100.calls == [] and out.grad_fn is not None
    assert any("attn_bias" in m for m in _fallback_logs(caplog))
    efficient_attention(q, k, v, attn_bias=bias.detach())
    assert [c["chosen"] for c in h100.calls] == [EFFICIENT] and h100.calls[0]["mask"].shape == (1, 2, 16, 16)


def test_attn_bias_without_a_backward_merges_into_stock_sdpas_mask(h100):
    q, k, v = _qkv(torch.float32, s=16, d=16, grad=False)
    bias = torch.randn(1, 2, 16, 16)
    valid = _padding_mask(2, 16, "bool", torch.float32)
    out = efficient_attention(q, k, v, attn_mask=valid, attn_bias=bias, training=False)
    merged = h100.calls[0]["mask"]
    assert merged.shape == (2, 2, 16, 16) and torch.isinf(merged[1, :, :, 8:]).all()
    with sdpa_kernel([MATH]):
        want = _REAL_SDPA(q, k, v, attn_mask=bias.masked_fill(~valid, float("-inf")))
    torch.testing.assert_close(out, want)


def test_seed_with_dropout_on_the_fused_path_is_an_error(h100):
    with pytest.raises(ValueError, match="'seed'"):
        efficient_attention(*_qkv(torch.bfloat16), dropout_p=0.1, seed=torch.tensor(3))
    with use_backend("reference"):  # the documented way to fix the mask by seed
        efficient_attention(*_qkv(torch.bfloat16), dropout_p=0.1, seed=torch.tensor(3))
    assert h100.calls == []


# ------------------------------------------------------------------------------------------------
# No backward: the stock sdpa, nothing kept
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_grouped_query_heads_go_to_flash_unexpanded(h100, dtype):
    """k, v with fewer heads than q (enable_gqa): flash alone is offered, with enable_gqa=True and
    k, v at their own heads, so flash keeps them so; the result is sdpa's on the expanded heads."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 64).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 64, 64).to(dtype).requires_grad_() for _ in range(2))
    out = efficient_attention(q, k, v, enable_gqa=True)
    (call,) = h100.calls
    assert call["enabled"] == [FLASH] and call["chosen"] == FLASH
    assert call["enable_gqa"] is True and call["kv_heads"] == 2
    with sdpa_kernel([MATH]):
        ref = _REAL_SDPA(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("case", ["mask", "fp32", "flash off"])
def test_grouped_query_heads_without_flash_are_expanded_for_the_efficient_kernel(h100, case, caplog):
    """Where flash does not take the call, the efficient kernel (no grouped heads in torch) gets k and
    v expanded to the query heads (beside a mask or in fp32 before the dispatch, on every device),
    logged once; never cuDNN with grouped heads."""
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    q = torch.randn(2, 4, 64, 64).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 64, 64).to(dtype).requires_grad_() for _ in range(2))
    mask = _padding_mask(2, 64, "bool", dtype) if case == "mask" else None
    attn_mod._expanded_logged = False
    with caplog.at_level(logging.INFO, logger="tempo"):
        if case == "flash off":
            with sdpa_kernel([EFFICIENT, CUDNN]):
                efficient_attention(q, k, v, enable_gqa=True)
        else:
            efficient_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    (call,) = h100.calls
    assert call["chosen"] == EFFICIENT and call["enable_gqa"] is False and call["kv_heads"] == 4
    assert any("expanded to the query heads" in r.getMessage() for r in caplog.records)


def test_grouped_query_heads_need_enable_gqa_and_a_divisor():
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        efficient_attention(q, k, k)
    with pytest.raises(ValueError, match="dividing the number of 'q' heads"):
        efficient_attention(q, torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8), enable_gqa=True)
    with pytest.raises(ValueError, match="same number of heads"):
        efficient_attention(q, k, torch.randn(1, 1, 8, 8), enable_gqa=True)
    with pytest.raises(TypeError, match="'enable_gqa' must be a bool"):
        efficient_attention(q, k, k, enable_gqa=1)


def test_no_backward_on_cuda_offers_math_after_the_fused_kernels(h100, caplog):
    q, k, v = _qkv(torch.float64, grad=False)
    efficient_attention(q, k, v, training=False)  # fp64: no fused kernel, the stock math one
    assert h100.calls[-1]["enabled"] == [MATH]
    mask = _padding_mask(2, 64, "bool", torch.float32)
    efficient_attention(*_qkv(torch.bfloat16, grad=False), attn_mask=mask, training=False)
    assert h100.calls[-1]["enabled"] == [EFFICIENT, MATH] and h100.calls[-1]["chosen"] == EFFICIENT
    # Training mode, the backends a backward would get (no math): a no-grad forward replayed with
    # grad from the same RNG state (GradCache) must run the same kernel to draw the same mask.
    efficient_attention(*_qkv(torch.bfloat16, grad=False), attn_mask=mask, dropout_p=0.1)
    with_grad = efficient_attention(*_qkv(torch.bfloat16), attn_mask=mask, dropout_p=0.1)
    assert h100.calls[-1]["enabled"] == h100.calls[-2]["enabled"] == [EFFICIENT] and with_grad.requires_grad
    torch.backends.cuda.enable_math_sdp(False)
    with caplog.at_level(logging.WARNING, logger="tempo"), torch.no_grad():
        efficient_attention(*_qkv(torch.float64), training=False)
    assert len(h100.calls) == 4 and "math is disabled" in _fallback_logs(caplog)[0]


# ------------------------------------------------------------------------------------------------
# torch.compile: the same decisions as eager
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def kernel_sets(monkeypatch):
    """Record each set of backends we offer with sdpa_kernel(..., set_priority=True), in eager code
    and in a compiled graph (when it is traced and when it runs). Math is never among them (with a
    backward); the restores of the caller's state on exit include it and are not recorded. So that
    the CPU can run the call, math is enabled next to what we offer."""
    real = torch.nn.attention._sdpa_kernel
    sets = []

    def recording(backends, set_priority=False):
        backends = list(backends)
        if set_priority and MATH not in backends:
            sets.append(backends)
            backends = backends + [MATH]
        real(backends, set_priority)

    monkeypatch.setattr(torch.nn.attention, "_sdpa_kernel", recording)
    return sets


@pytest.fixture
def h100_for_compile(h100, monkeypatch):
    """The simulation without the sdpa spy (Dynamo would trace into it): the real CPU sdpa."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", _REAL_SDPA)
    torch._dynamo.reset()
    yield h100
    torch._dynamo.reset()


COMPILE_CASES = {
    "bf16_no_mask": (dict(dtype=torch.bfloat16), [FLASH, EFFICIENT, CUDNN]),
    "fp32_mask": (dict(dtype=torch.float32, mask=True), [EFFICIENT]),
    "fp64": (dict(dtype=torch.float64), None),
    "fp16_d12_mask": (dict(dtype=torch.float16, d=12, mask=True), None),
    "fp32_d6": (dict(dtype=torch.float32, d=6), None),
}


@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_compiled_and_eager_take_the_same_path(h100_for_compile, kernel_sets, caplog, name):
    """Inputs no fused kernel takes run the reference op in both (the compiled call used to go to
    sdpa and fail); the others offer the same backends in the same order in both."""
    case, expected = COMPILE_CASES[name]
    q, k, v, mask = _case_inputs(case)

    def fn(q, k, v):
        return efficient_attention(q, k, v, attn_mask=mask, is_causal=False) * 1.0

    with caplog.at_level(logging.WARNING, logger="tempo"):
        eager = fn(q, k, v)
        eager_sets = list(kernel_sets)
        kernel_sets.clear()
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(*leaves)
    compiled_sets = list(kernel_sets)
    assert eager_sets == ([expected] if expected else [])
    assert all(s == expected for s in compiled_sets) and bool(compiled_sets) == bool(expected), compiled_sets
    torch.testing.assert_close(compiled, eager, atol=1e-2 if q.dtype in (torch.float16, torch.bfloat16) else 1e-5,
                               rtol=1e-2)
    compiled.float().sum().backward()
    assert all(t.grad is not None for t in leaves)
    if expected is None:  # logged once, by the eager call (the compiled trace finds it logged)
        assert len(_fallback_logs(caplog)) == 1


def test_compiled_call_logs_its_fallback_when_traced(h100_for_compile, caplog):
    q, k, v, _ = _case_inputs(dict(dtype=torch.float64))
    with caplog.at_level(logging.WARNING, logger="tempo"):
        torch.compile(lambda q, k, v: efficient_attention(q, k, v), backend="aot_eager", fullgraph=True)(q, k, v)
    logs = _fallback_logs(caplog)
    assert len(logs) == 1 and "torch.float64" in logs[0]


def test_no_backward_compiles_to_stock_sdpa_on_the_cpu():
    torch._dynamo.reset()
    q, k, v = _qkv(torch.float32, s=9, d=16, grad=False)
    mask = _padding_mask(2, 9, "bool", torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v: efficient_attention(q, k, v, attn_mask=mask, training=False), backend=backend,
                       fullgraph=True)
    out = fn(q, k, v)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("scaled_dot_product_attention" in t for t in targets), targets
    assert not any("tempo" in t for t in targets), targets
    torch.testing.assert_close(out, _REAL_SDPA(q, k, v, attn_mask=mask))
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# No backward on the CPU: stock sdpa, same outputs, nothing kept
# ------------------------------------------------------------------------------------------------
def _masks_with_degenerate_rows(dtype, s_q=7, s_k=135):
    m = torch.rand(2, 1, s_q, s_k) > 0.5
    m[0, 0, 3] = False  # a fully masked row
    m[1] = False  # a fully padded sample
    additive = torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    finfo_min = torch.zeros(m.shape).masked_fill(~m, torch.finfo(torch.float32).min)
    return {"bool": m, "-inf": additive, "finfo.min": finfo_min}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["bool", "-inf", "finfo.min", "causal", "none"])
def test_no_backward_matches_the_tempo_op_and_keeps_nothing(monkeypatch, dtype, kind):
    q, k, v = _qkv(dtype, s=7, d=16, grad=False)
    k, v = torch.randn(2, 2, 135, 16).to(dtype), torch.randn(2, 2, 135, 16).to(dtype)
    mask = _masks_with_degenerate_rows(dtype).get(kind)
    causal = kind == "causal"
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or _REAL_SDPA(*a, **kw))
    with ActivationLedger() as led:
        stock = efficient_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=0.3, training=False)
        with torch.no_grad():  # eval mode under no_grad: same
            stock_ng = efficient_attention(*(t.requires_grad_() for t in (q, k, v)), attn_mask=mask, is_causal=causal,
                                           training=False)
    assert len(calls) == 2 and led.activation_bytes == 0 and led.records == []
    tempo = efficient_attention(q, k, v, attn_mask=mask, is_causal=causal)  # q, k, v require grad now
    assert len(calls) == 2 and tempo.grad_fn is not None
    with torch.no_grad(), ActivationLedger() as led:  # training mode under no_grad: the Tempo op's bits
        replay = efficient_attention(q, k, v, attn_mask=mask, is_causal=causal)
    assert len(calls) == 2 and led.records == [] and torch.equal(replay, tempo.detach())
    tol = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    for out in (stock, stock_ng):
        assert out.dtype == dtype and not out.isnan().any()
        torch.testing.assert_close(out, tempo.detach(), atol=tol, rtol=tol)
    if kind in ("bool", "-inf"):
        assert (stock[0, :, 3] == 0).all() and (stock[1] == 0).all()


def test_no_backward_dropout_rate_and_scale():
    """q = 0 makes the softmax uniform; v = I reads the dropped, rescaled probabilities off the
    output: keep rate within 3 sigma of 1 - p, kept values 1 / ((1 - p) s)."""
    b, h, s, p = 2, 4, 128, 0.3
    q = torch.zeros(b, h, s, 8)
    k = torch.randn(b, h, s, 8)
    v = torch.eye(s).expand(b, h, s, s)
    out = efficient_attention(q, k, v, dropout_p=p)
    assert out.grad_fn is None
    kept = out != 0
    n = kept.numel()
    assert abs(kept.float().mean().item() - (1 - p)) < 3 * ((p * (1 - p) / n) ** 0.5)
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / ((1 - p) * s)))


def test_no_backward_with_a_seed_runs_the_seeded_reference_op():
    q, k, v = _qkv(torch.float32, s=20, d=8, grad=False)
    seed = torch.tensor(5)
    no_grad = efficient_attention(q, k, v, dropout_p=0.4, seed=seed)
    with_grad = efficient_attention(*(t.clone().requires_grad_() for t in (q, k, v)), dropout_p=0.4, seed=seed)
    assert torch.equal(no_grad, with_grad.detach())


def test_no_backward_under_autocast_casts_the_mask_as_sdpa():
    """Under autocast sdpa casts q, k, v and a float mask to the autocast dtype (its autocast
    policy); so does this op: an fp32 finfo.min row becomes -inf in fp16, a fully masked row, 0."""
    q, k, v = _qkv(torch.float32, s=6, d=8, grad=False)
    mask = torch.zeros(2, 1, 6, 6)
    mask[0, 0, 2] = torch.finfo(torch.float32).min
    with torch.autocast("cpu", dtype=torch.float16):
        out = efficient_attention(q, k, v, attn_mask=mask)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == want.dtype == torch.float16
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2])) and torch.equal(want[0, :, 2], out[0, :, 2])
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)