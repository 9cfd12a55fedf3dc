"""What only a CUDA GPU can confirm (``pytest -m gpu``; the first stage of scripts/gpu_check.sh).

  * each Tempo layer's Triton kernels against an fp64 reference at BERT-large shapes (b=8, s=512,
    h=1024, 16 heads) in fp32, fp16 and bf16: InplaceGelu, InplaceLayerNorm, Combined (dropout
    included: the reference uses the very keep-mask the kernel drew), DropoutAddLayerNorm, and
    efficient_attention (CUDA's fused sdpa kernels; the tiled reference path with dropout);
  * sdpa and efficient_attention with key-padding masks at s = 192 and 320, where cuDNN's
    attention has returned NaN: every fused backend that accepts the call must be finite and right;
  * the Triton path under torch.compile (fullgraph) against eager;
  * BERT-large (tempo.bert.model.BertForPreTraining) with Tempo layers training a few LAMB steps
    on CUDA with a finite loss.

Selected without CUDA (``-m gpu`` on a machine without a GPU) every test FAILS with one clear
message instead of skipping, so a GPU job on a broken CUDA setup cannot pass by doing nothing.
Collected in an ordinary CPU run (no ``-m`` naming ``gpu``) they are skipped.

``TEMPO_GPU_TESTS_ON_CPU=1`` runs this file's code on the CPU at tiny shapes through Triton's
interpreter: a check of the tests themselves, not of the GPU.

Tolerances are on the error relative to the largest reference value (``_rel_err``): a wrong
kernel is off by O(1); rounding of one value in the dtype is ~5e-4 (fp16) / 4e-3 (bf16).
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

ON_CPU = os.environ.get("TEMPO_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
# BERT-large (or tiny stand-ins for the CPU self-check)
B, S, H, FF, HEADS, D = (2, 16, 32, 64, 2, 16) if ON_CPU else (8, 512, 1024, 4096, 16, 64)
MODEL_CONFIG = "bert_tiny" if ON_CPU else "bert_large"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# max |a - ref| / max |ref| allowed, per dtype
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _gpu_was_selected(markexpr: str) -> bool:
    """True when the -m expression asks for gpu tests ("gpu", "gpu and not slow"), not "not gpu"."""
    return re.search(r"(?<!not )\bgpu\b", markexpr or "") is not None


@pytest.fixture(autouse=True)
def _needs_cuda(request):
    if ON_CPU or torch.cuda.is_available():
        return
    message = (f"tests/test_gpu.py needs a CUDA GPU, but torch.cuda.is_available() is False "
               f"(torch {torch.__version__}, CUDA build {torch.version.cuda}, "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    if _gpu_was_selected(request.config.getoption("markexpr")):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    scale = expected.abs().max().clamp_min(1e-30)
    return float(((actual.double() - expected).abs().max() / scale).item())


def _check(what: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = _rel_err(actual, expected)
    assert err <= tol, f"{what}: max error {err:.2e} of the largest value > {tol:.0e}"


def _triton():
    from tempo.ops._backend import use_backend

    return use_backend("triton")  # a missing Triton fails here instead of running the reference path


# ------------------------------------------------------------------------------------------------
# Each Tempo layer's kernels against fp64
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_gelu_matches_fp64(dtype):
    from tempo.inplace_gelu import InplaceGelu

    x = (torch.randn(B * S, FF, device=DEVICE) * 3).to(dtype).requires_grad_()
    with _triton():
        y = InplaceGelu()(x * 1)  # an intermediate, as in the model (no in-place op on a leaf)
        y.backward(torch.ones_like(y))  # dy = 1: x.grad is GELU'(x) itself
    x64 = x.detach().double()
    ref_y = F.gelu(x64)
    ref_slope = 0.5 * (1 + torch.erf(x64 / math.sqrt(2))) + x64 * torch.exp(-x64 * x64 / 2) / math.sqrt(2 * math.pi)
    assert y.dtype == dtype and x.grad.dtype == dtype
    _check("y", y.detach(), ref_y, TOL[dtype])
    # The slope comes from a table interpolated at y (tempo/ops/gelu.py documents the bounds:
    # 4.8e-5 fp32, 6.6e-3 fp16, 1.5e-2..2.3e-2 bf16), plus the rounding of x.grad to the dtype.
    _check("dx", x.grad, ref_slope, {torch.float32: 2e-4, torch.float16: 1.2e-2, torch.bfloat16: 4e-2}[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_layernorm_matches_fp64(dtype):
    from tempo.inplace_layernorm import InplaceLayerNorm

    module = InplaceLayerNorm(H, eps=1e-12).to(DEVICE)  # fp32 parameters, as in the model
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(H, device=DEVICE))
        module.bias.copy_(0.1 * torch.randn(H, device=DEVICE))
    x = (torch.randn(B * S, H, device=DEVICE) * 2 + 0.5).to(dtype).requires_grad_()
    g = torch.randn(B * S, H, device=DEVICE).to(dtype)
    with _triton():
        y = module(x * 1)
        y.backward(g)
    x64 = x.detach().double().requires_grad_()
    w64 = module.weight.detach().double().requires_grad_()
    b64 = module.bias.detach().double().requires_grad_()
    ref = F.layer_norm(x64, (H,), w64, b64, 1e-12)
    ref.backward(g.double())
    assert y.dtype == dtype and x.grad.dtype == dtype and module.weight.grad.dtype == torch.float32
    for what, a, r in (("y", y.detach(), ref), ("dx", x.grad, x64.grad), ("dweight", module.weight.grad, w64.grad),
                       ("dbias", module.bias.grad, b64.grad)):
        _check(what, a, r.detach(), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_combined_matches_fp64_with_its_dropout_mask(dtype):
    from tempo.combined import combined_softmax_dropout_matmul
    from tempo.ops.combined import dropout_keep_mask

    p = 0.1
    scores = (torch.randn(B, HEADS, S, S, device=DEVICE) * 2).to(dtype).requires_grad_()
    v = torch.randn(B, HEADS, S, D, device=DEVICE).to(dtype).requires_grad_()
    g = torch.randn(B, HEADS, S, D, device=DEVICE).to(dtype)
    seed = torch.tensor(1234, device=DEVICE)
    with _triton():
        out = combined_softmax_dropout_matmul(scores, v, -1, p, True, seed)
        out.backward(g)
        keep = dropout_keep_mask(seed, scores.shape, p, DEVICE, "triton")
    assert 0.85 < keep.float().mean().item() < 0.95  # the mask really drops ~p
    s64 = scores.detach().double().requires_grad_()
    v64 = v.detach().double().requires_grad_()
    ref = torch.matmul(torch.softmax(s64, -1) * keep / (1 - p), v64)
    ref.backward(g.double())
    assert out.dtype == dtype
    for what, a, r in (("out", out.detach(), ref), ("dscores", scores.grad, s64.grad), ("dv", v.grad, v64.grad)):
        _check(what, a, r.detach(), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_add_layernorm_matches_fp64_with_its_dropout_mask(dtype):
    dal = pytest.importorskip("tempo.ops.dropout_add_layernorm")
    p = 0.1
    module = dal.DropoutAddLayerNorm(H, p, eps=1e-12).to(DEVICE).train()
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(H, device=DEVICE))
        module.bias.copy_(0.1 * torch.randn(H, device=DEVICE))
    x = torch.randn(B * S, H, device=DEVICE).to(dtype).requires_grad_()
    residual = (torch.randn(B * S, H, device=DEVICE) * 2).to(dtype).requires_grad_()
    g = torch.randn(B * S, H, device=DEVICE).to(dtype)
    seed = torch.tensor(4321, device=DEVICE)
    with _triton():
        y = dal.dropout_add_layernorm(x * 1, residual * 1, (H,), module.weight, module.bias, 1e-12, p, True, seed)
        y.backward(g)
        keep = dal.dropout_add_layernorm_keep_mask(seed, x.shape, p, DEVICE, "triton")
    x64, r64 = x.detach().double().requires_grad_(), residual.detach().double().requires_grad_()
    w64, b64 = module.weight.detach().double().requires_grad_(), module.bias.detach().double().requires_grad_()
    ref = F.layer_norm(r64 + x64 * keep / (1 - p), (H,), w64, b64, 1e-12)
    ref.backward(g.double())
    assert y.dtype == dtype
    for what, a, r in (("y", y.detach(), ref), ("dx", x.grad, x64.grad), ("dresidual", residual.grad, r64.grad),
                       ("dweight", module.weight.grad, w64.grad), ("dbias", module.bias.grad, b64.grad)):
        _check(what, a, r.detach(), TOL[dtype])


# ------------------------------------------------------------------------------------------------
# Attention: efficient_attention and sdpa against fp64, with padding masks
# ------------------------------------------------------------------------------------------------
def _attention_reference(q, k, v, g, keep_keys=None, keep=None, p=0.0):
    """fp64 (out, dq, dk, dv); keep_keys (b, s_k) bool masks keys, keep the dropout mask."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if keep_keys is not None:
        scores = scores.masked_fill(~keep_keys[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, -1)
    if keep is not None:
        probs = probs * keep / (1 - p)
    out = probs @ v64
    out.backward(g.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _qkv(s, dtype):
    q, k, v = (torch.randn(B, HEADS, s, D, device=DEVICE).to(dtype).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(B, HEADS, s, D, device=DEVICE).to(dtype)


def _padding(s):
    """Key-padding (b, s) bool: True = a real token; lengths from 1 to s, never all padding."""
    lengths = torch.linspace(1, s, B).round().long().tolist()
    lengths[0] = s  # one unpadded sample
    keep = torch.zeros(B, s, dtype=torch.bool, device=DEVICE)
    for i, n in enumerate(lengths):
        keep[i, :n] = True
    return keep


def _mask(keep_keys, kind, dtype):
    if kind == "bool":
        return keep_keys[:, None, None, :]
    mask = torch.zeros(keep_keys.shape, dtype=dtype, device=DEVICE)  # BERT's additive mask
    return mask.masked_fill(~keep_keys, torch.finfo(dtype).min)[:, None, None, :]


ATT_TOL = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # fp32: the fused kernels may use TF32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_efficient_attention_fused_path_matches_fp64(dtype):
    from tempo.ops.attention import efficient_attention

    q, k, v, g = _qkv(S, dtype)
    keep_keys = _padding(S)
    out = efficient_attention(q, k, v, attn_mask=_mask(keep_keys, "bool", dtype), dropout_p=0.0)
    out.backward(g)
    ref = _attention_reference(q, k, v, g, keep_keys)
    for what, a, r in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
        _check(what, a, r, ATT_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_efficient_attention_reference_path_with_dropout_on_cuda(dtype):
    from tempo.ops._backend import use_backend
    from tempo.ops.attention import attention_keep_mask, efficient_attention

    p, s = 0.1, min(S, 256)  # the tiled path loops in Python: a smaller s keeps it quick
    q, k, v, g = _qkv(s, dtype)
    seed = torch.tensor(99, device=DEVICE)
    with use_backend("reference"):
        out = efficient_attention(q, k, v, dropout_p=p, seed=seed)
        out.backward(g)
    keep = attention_keep_mask(seed, (B, HEADS, s, s), p, device=DEVICE)
    ref = _attention_reference(q, k, v, g, keep=keep, p=p)
    for what, a, r in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
        _check(what, a, r, ATT_TOL[dtype])


def _sdpa_backend_context(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "default":
        import contextlib

        return contextlib.nullcontext()
    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "math": SDPBackend.MATH}[name]])


@pytest.mark.parametrize("s", [192, 320])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("impl", ["sdpa-default", "sdpa-cudnn", "sdpa-efficient", "efficient_attention"])
def test_attention_with_padding_at_odd_lengths_is_finite_and_right(s, dtype, mask_kind, impl):
    """s = 192 and 320 with key padding: the lengths where cuDNN's fused attention returned NaN."""
    from tempo.ops.attention import efficient_attention

    if ON_CPU and impl in ("sdpa-cudnn", "sdpa-efficient"):
        pytest.skip("fused CUDA backends")
    q, k, v, g = _qkv(s, dtype)
    keep_keys = _padding(s)
    mask = _mask(keep_keys, mask_kind, dtype)
    if impl == "efficient_attention":
        out = efficient_attention(q, k, v, attn_mask=mask)
    else:
        try:
            with _sdpa_backend_context(impl.split("-", 1)[1]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        except RuntimeError as exc:
            if "No available kernel" in str(exc):
                pytest.skip(f"{impl} does not take this call here: {str(exc).splitlines()[0]}")
            raise
    out.backward(g)
    ref = _attention_reference(q, k, v, g, keep_keys)
    for what, a, r in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
        _check(f"{impl} {what}", a, r, ATT_TOL[dtype])


# ------------------------------------------------------------------------------------------------
# torch.compile over the Triton path
# ------------------------------------------------------------------------------------------------
def test_triton_path_under_torch_compile_matches_eager():
    from tempo.combined import combined_softmax_dropout_matmul
    from tempo.inplace_gelu import inplace_gelu
    from tempo.inplace_layernorm import inplace_layernorm

    dtype = torch.bfloat16
    rows = B * min(S, 128)
    x = torch.randn(rows, H, device=DEVICE).to(dtype)
    w1 = (torch.randn(H, FF, device=DEVICE) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(FF, H, device=DEVICE) / math.sqrt(FF)).to(dtype)
    ln_w, ln_b = torch.ones(H, device=DEVICE), torch.zeros(H, device=DEVICE)
    scores = torch.randn(B, HEADS, 64, 64, device=DEVICE).to(dtype)
    v = torch.randn(B, HEADS, 64, D, device=DEVICE).to(dtype)
    seed = torch.tensor(7, device=DEVICE)

    def block(x, w1, w2, scores, v):
        h = inplace_gelu(x @ w1)
        y = inplace_layernorm(h @ w2 + x, (H,), ln_w, ln_b, 1e-12)
        a = combined_softmax_dropout_matmul(scores, v, -1, 0.1, True, seed)
        return y.float().square().mean() + a.float().square().mean()

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, scores, v)]
        with _triton():
            loss = fn(*leaves)
            loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    eager = run(block)
    compiled = run(torch.compile(block, fullgraph=True, backend="aot_eager" if ON_CPU else "inductor"))
    for what, a, r in zip(("loss", "dx", "dw1", "dw2", "dscores", "dv"), compiled, eager):
        _check(f"compiled {what}", a, r, 2e-2)


# ------------------------------------------------------------------------------------------------
# BERT-large with Tempo layers, a few training steps on the GPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice,precision", [("full", "bf16"), ("full", "fp16"), ("floor", "bf16")])
def test_bert_with_tempo_layers_trains_with_finite_loss(choice, precision):
    from tempo.bench.train_bench import synthetic_batches
    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertForPreTraining
    from tempo.choices import TempoChoice
    from tempo.train.optim import bert_param_groups, make_optimizer
    from tempo.train.step import TrainStep

    if ON_CPU and precision == "fp16":
        pytest.skip("fp16 autocast needs CUDA")
    options = TempoChoice.floor() if choice == "floor" else TempoChoice.full()
    config = BertConfig.from_name(MODEL_CONFIG)
    device = torch.device(DEVICE)
    torch.manual_seed(0)
    with device:
        model = BertForPreTraining(config, options).train()
    kinds = {type(m).__name__ for m in model.modules()}
    expected = {"InplaceGelu"} | ({"DropoutAddLayerNorm", "InplaceLayerNorm"} if choice == "floor"
                                  else {"InplaceLayerNorm", "Combined"})
    assert expected <= kinds, f"Tempo layers missing from the model: {sorted(expected - kinds)}"
    optimizer = make_optimizer("lamb", bert_param_groups(model), lr=1e-4)
    step = TrainStep(model, optimizer, _pretraining_loss, precision, device, max_grad_norm=1.0,
                     measure_activations=False)
    seq = 128 if not ON_CPU else 32
    batches = synthetic_batches(config.vocab_size, 8 if not ON_CPU else 2, seq, 20 if not ON_CPU else 5,
                                device, count=2, seed=0)
    batches[1]["input_mask"][1:, seq * 3 // 4:] = 0  # padding: masks through the attention
    before = [p.detach().clone() for p in list(model.parameters())[:4]]
    losses = torch.stack([step([batches[i % 2]]).loss.float() for i in range(5)]).cpu()
    assert torch.isfinite(losses).all(), f"non-finite loss: {losses.tolist()}"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if precision == "bf16":  # no loss scaling: LAMB must have taken every step
        assert optimizer.skipped_steps == 0, f"LAMB skipped {optimizer.skipped_steps} of 5 steps"
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def _pretraining_loss(model, b):
    return model(input_ids=b["input_ids"], token_type_ids=b["segment_ids"], attention_mask=b["input_mask"],
                 masked_lm_positions=b["masked_lm_positions"], masked_lm_labels=b["masked_lm_labels"],
                 next_sentence_labels=b["next_sentence_labels"]).loss
