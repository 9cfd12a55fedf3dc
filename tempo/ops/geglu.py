"""GeGLU fused with its output projection: ``Wo(gelu(a) * g)`` where ``a, g = h.chunk(2, -1)``,
keeping only ``h`` for backward (ModernBERT's MLP; issue 21).

Stock autograd keeps, per token, ``h`` (2·I: GELU's input ``a`` and the gate ``g`` are views of it,
so all of ``h`` stays alive), GELU's output (I, for the product's backward) and the product (I,
kept by ``Wo``): 4·I. This op keeps ``h`` alone (2·I) and recomputes ``gelu(a)`` and the product in
backward: elementwise work, no GEMM is recomputed.

Exact: the forward runs the stock ops in the stock order (``F.gelu``, ``*``, ``F.linear``), so its
output is bitwise the stock one; backward recomputes the same forward values bitwise and applies
the stock backward formulas (``aten.gelu_backward``, the product rule, the linear layer's three
GEMMs), so gradients equal the stock ones up to the GEMMs' summation order. Nothing is recovered
from an output, so there is no condition on the values. Under autocast the backward re-enters the
forward's autocast state, so the recomputed values have the forward's dtypes.

Without a backward (no_grad, inference_mode, frozen inputs and weights) it is the stock
computation. Dropout between the product and ``Wo`` is not fused: apply_tempo leaves a GeGLU MLP
with dropout > 0 alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tempo.ops._backend import log_fallback_once, needs_backward

_OP = "geglu_linear"


def _product(h: Tensor, approximate: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    a, g = h.chunk(2, dim=-1)
    act = F.gelu(a, approximate=approximate)
    return a, g, act, act * g


class _GegluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Optional[Tensor], approximate: str) -> Tensor:
        _, _, _, p = _product(h, approximate)
        out = F.linear(p, weight, bias)
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        ctx.approximate = approximate
        ctx.device_type = h.device.type
        ctx.autocast = torch.is_autocast_enabled(ctx.device_type)
        ctx.autocast_dtype = torch.get_autocast_dtype(ctx.device_type) if ctx.autocast else None
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        h, weight = ctx.saved_tensors
        with torch.autocast(ctx.device_type, dtype=ctx.autocast_dtype or torch.float32, enabled=ctx.autocast):
            a, g, act, p = _product(h, ctx.approximate)
            w = weight.to(p.dtype) if ctx.autocast else weight
        go = grad_out.to(p.dtype)
        go2, p2 = go.reshape(-1, go.shape[-1]), p.reshape(-1, p.shape[-1])
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = (go2.t() @ p2).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = go2.sum(0).to(weight.dtype)
        grad_h = None
        if ctx.needs_input_grad[0]:
            grad_p = go @ w
            grad_a = torch.ops.aten.gelu_backward(grad_p * g, a, approximate=ctx.approximate)
            grad_h = torch.cat([grad_a, grad_p * act], dim=-1).to(h.dtype)
        return grad_h, grad_w, grad_b, None


def geglu_linear(h: Tensor, weight: Tensor, bias: Optional[Tensor] = None, approximate: str = "none") -> Tensor:
    """``F.linear(gelu(a, approximate) * g, weight, bias)`` with ``a, g = h.chunk(2, -1)``,
    keeping only ``h`` for backward (see the module docstring)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{_OP}: argument 'approximate' must be 'none' or 'tanh', got {approximate!r}")
    if h.shape[-1] % 2:
        raise ValueError(f"{_OP}: argument 'h' must have an even last dimension (a and the gate), "
                         f"got {tuple(h.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[-1] // 2:
        raise ValueError(f"{_OP}: argument 'weight' must be [out, {h.shape[-1] // 2}], got {tuple(weight.shape)}")
    for arg, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.device != h.device:
            raise ValueError(f"{_OP}: argument '{arg}' (the output projection's) is on {param.device} but the "
                             f"input 'h' is on {h.device}; move the layer to the input's device")
    if not needs_backward(h, weight, bias):
        return F.linear(_product(h, approximate)[3], weight, bias)
    return _GegluLinear.apply(h, weight, bias, approximate)


class GegluMLP(nn.Module):
    """A GeGLU MLP (``Wo(act(a) * g)``, ``a, g = Wi(x).chunk(2)``) whose activation, product and
    projection run as ``geglu_linear``. Holds the original ``Wi``, ``act``, ``drop`` and ``Wo``
    modules under their names, so state_dict keys and Parameters are unchanged."""

    def __init__(self, old: nn.Module, approximate: str):
        super().__init__()
        self.Wi, self.act, self.drop, self.Wo = old.Wi, old.act, old.drop, old.Wo
        self.approximate = approximate
        if hasattr(old, "config"):
            self.config = old.config

    def forward(self, hidden_states: Tensor) -> Tensor:
        h = self.Wi(hidden_states)
        if self.drop.training and self.drop.p > 0.0:
            # The held nn.Dropout was switched on after the swap: dropout between the product and
            # Wo cannot be fused, so the stock computation runs while it is on (logged once).
            log_fallback_once(f"{_OP}:dropout", f"{_OP}: the GeGLU MLP's dropout is on (p = {self.drop.p}); "
                              "it runs the stock computation while it is (dropout cannot be fused with Wo)")
            a, g = h.chunk(2, dim=-1)
            return self.Wo(self.drop(self.act(a) * g))
        return geglu_linear(h, self.Wo.weight, self.Wo.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


__all__ = ["GegluMLP", "geglu_linear"]
