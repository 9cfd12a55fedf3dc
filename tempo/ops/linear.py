"""A Linear that, under autocast, keeps its input as given rather than its own 16-bit copy (issue 33).

Under bf16 / fp16 autocast ``F.linear`` casts an fp32 input to the autocast dtype, and autograd
keeps that cast for the weight's gradient: 2 bytes per input element, per projection. In a pre-norm
block (Llama, Qwen3, EuroBERT, Gemma3, T5, ...) the fp32 input is the norm's output, which Tempo's
RMSNorm keeps anyway (its backward reads it, tempo.ops.rmsnorm), and q, k and v each keep their own
bf16 copy of it beside the norm's: 6 bytes per element of the norm's output (gate and up, 4 more).
``linear_keeping_input`` keeps the input itself, a reference to the tensor the norm keeps and every
other projection reading it keeps too (one storage, counted once), and casts it again in backward,
where the weight's gradient needs it: one element-wise cast per projection, no GEMM recomputed.

When nobody else keeps the input it costs 2 bytes per element more than the copy (4 instead of 2);
two projections reading one input break even, three save 2. So Tempo uses it only where the input
is kept anyway: the projections that read a Tempo RMSNorm's output (apply_tempo switches them,
tempo.integrations.projections).

Exact: the cast is round-to-nearest-even, deterministic, so backward's copy is bitwise the forward's;
the forward is ``F.linear`` on the same casts, and backward runs the GEMMs aten's linear backward
runs for a row-major input (dX = dY·W, dW = dYᵀ·X, db = Σ_rows dY, in the autocast dtype), then
casts dX to the input's dtype and dW, db to the parameters' dtypes, as the backward of autocast's
casts does. Gradients are bitwise the stock module's on the CPU (tests/test_linear.py); on CUDA the
same cuBLAS calls on the same operands. Nothing is recovered from an output, so there is no
condition on the values. Double backward is not supported.

Only under autocast, with an fp32 input, 16-bit autocast dtype and a backward to run: everything
else (no autocast, a 16-bit model, eval, no grad) is ``nn.Linear``'s own forward, so the module is
the stock one there.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tempo.ops._backend import autocast_dtype_for, needs_backward

_LOW = (torch.float16, torch.bfloat16)
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


class _LinearKeepingInput(torch.autograd.Function):
    """``F.linear(x.to(dtype), w.to(dtype), b.to(dtype))`` keeping x, not its cast (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], dtype: torch.dtype) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(dtype)
            out = F.linear(x.to(dtype), w, bias.to(dtype) if bias is not None else None)
        # x itself (the caller's tensor: a norm's kept output, shared by every projection reading it)
        # and the weight's cast, which the stock backward keeps too for dX.
        ctx.save_for_backward(x, w)
        ctx.dtype = dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[0]:
                dx = g.mm(w).view(x.shape).to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw = g.t().mm(x.reshape(-1, x.shape[-1]).to(ctx.dtype)).to(ctx.weight_dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                db = g.sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None


def recast_dtype(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[torch.dtype]:
    """The 16-bit dtype backward casts the kept input to again: the autocast dtype when
    ``linear_keeping_input`` changes what is kept (autocast on with a 16-bit dtype, x fp32, parameters
    of a dtype autocast casts, a backward to run), else None."""
    dtype = autocast_dtype_for(x)
    if dtype not in _LOW or x.dtype != torch.float32 or weight.dtype not in _CASTABLE:
        return None
    if bias is not None and bias.dtype not in _CASTABLE:
        return None
    return dtype if needs_backward(x, weight, bias) else None


def linear_keeping_input(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` as autocast runs it, keeping x (not its 16-bit cast) for
    backward where that changes anything (``recast_dtype``); ``F.linear`` itself elsewhere."""
    dtype = recast_dtype(x, weight, bias)
    if dtype is None or x.dim() == 0:
        return F.linear(x, weight, bias)
    return _LinearKeepingInput.apply(x, weight, bias, dtype)


class InputKeepingLinear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear_keeping_input``: the same Parameters, state_dict and
    ``isinstance``; apply_tempo switches an existing nn.Linear to it by class (no new state) and
    ``revert_tempo`` switches it back."""

    def forward(self, input: Tensor) -> Tensor:
        return linear_keeping_input(input, self.weight, self.bias)


__all__ = ["InputKeepingLinear", "linear_keeping_input", "recast_dtype"]
