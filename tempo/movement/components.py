"""Each Tempo layer against the stock ops it replaces, alone: forward + backward bytes moved.

A whole-layer count says how much a choice saves; it does not say whether a Tempo op moves *more*
than the stock op it replaces (recomputation and bookkeeping cost traffic). Here each replaced
part of a BERT layer is traced on its own, with the inputs it gets inside the layer (bf16 autocast,
dropout 0.1), stock and Tempo side by side:

* GELU on the FFN's [b·s, 4h] bf16 activation: ``nn.GELU`` vs ``InplaceGelu``;
* LayerNorm on the fp32 residual sum, followed by the cast the next autocast Linear makes:
  ``nn.LayerNorm`` vs ``InplaceLayerNorm`` (which returns bf16 itself);
* dropout -> residual add -> LayerNorm (+ that cast): stock vs ``DropoutAddLayerNorm``;
* the attention core on q, k, v as the layer makes them ([b, h, s, d] views of [b, s, h·d]):
  eager (scores, softmax, dropout, matmul) vs the paper's Combined (scores then Combined), stock
  sdpa, and ``efficient_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tempo.movement.declarations import Kernel, Target, kernels_of
from tempo.movement.trace import FakeSession, build_on_meta


@dataclass
class Side:
    label: str
    kernels: list[tuple[str, Kernel]]  # (phase, kernel)

    @property
    def moved(self) -> int:
        return sum(k.moved for _, k in self.kernels)


def _trace_side(label: str, build: Callable[[], nn.Module], inputs: Callable[[FakeSession], tuple],
                forward: Callable, target: Target) -> Side:
    session = FakeSession()
    module = session.fake_module(build_on_meta(build)).train()
    args = inputs(session)
    trace = session.trace(lambda: forward(module, *args))
    return Side(label, [(c.phase, k) for c in trace.calls for k in kernels_of(c, target) if k.moved or k.flops])


class _Core(nn.Module):
    """The attention core of tempo.bert.model.BertSelfAttention._core, by implementation."""

    def __init__(self, kind: str, p: float, head_size: int):
        super().__init__()
        self.kind, self.p, self.scale = kind, p, head_size ** -0.5
        if kind == "tempo":
            from tempo.combined import Combined

            self.combined = Combined(dim=-1, p=p)

    def forward(self, q, k, v):
        if self.kind == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
        if self.kind == "efficient":
            from tempo.ops.attention import efficient_attention

            return efficient_attention(q, k, v, dropout_p=self.p, training=True)
        mask = torch.zeros((), dtype=q.dtype)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale + mask
        if self.kind == "tempo":
            return self.combined(scores, v)
        return torch.matmul(F.dropout(torch.softmax(scores, dim=-1), self.p, True), v)


class _DropoutAddNorm(nn.Module):
    def __init__(self, hidden: int, p: float, fused: bool):
        super().__init__()
        self.fused, self.p = fused, p
        if fused:
            from tempo.ops.dropout_add_layernorm import DropoutAddLayerNorm

            self.norm = DropoutAddLayerNorm(hidden, p)
        else:
            self.norm = nn.LayerNorm(hidden)

    def forward(self, x, residual):
        if self.fused:
            return self.norm(x, residual)
        return self.norm(F.dropout(x, self.p, True) + residual)


def component_table(batch: int, seq_len: int, target: Target, hidden: int = 1024, heads: int = 16,
                    intermediate: int = 4096, p: float = 0.1) -> list[dict]:
    """Rows {part, stock, tempo: [Side, ...]}: bytes moved by each part, forward + backward."""
    from tempo.inplace_gelu import InplaceGelu
    from tempo.inplace_layernorm import InplaceLayerNorm

    tokens = batch * seq_len
    bf16 = torch.bfloat16
    next_linear_cast = lambda y: y.to(bf16)  # noqa: E731 - what the next autocast Linear does first

    def act(session):
        return (session.fake_tensor((tokens, intermediate), bf16, requires_grad=True),)

    def residual_sum(session):
        return (session.fake_tensor((tokens, hidden), torch.float32, requires_grad=True),)

    def dense_and_residual(session):
        return (session.fake_tensor((tokens, hidden), bf16, requires_grad=True),
                session.fake_tensor((tokens, hidden), bf16, requires_grad=True))

    def qkv(session):
        head = hidden // heads
        # [b, s, h·d] projections viewed as [b, h, s, d], as BertSelfAttention._split_heads makes them
        return tuple(session.fake_tensor((batch, seq_len, hidden), bf16, requires_grad=True)
                     .view(batch, seq_len, heads, head).transpose(1, 2) for _ in range(3))

    rows = []
    rows.append({"part": f"GELU [{tokens}, {intermediate}]",
                 "stock": _trace_side("nn.GELU", nn.GELU, act, lambda m, x: m(x), target),
                 "tempo": [_trace_side("InplaceGelu", InplaceGelu, act, lambda m, x: m(x), target)]})
    rows.append({"part": f"LayerNorm [{tokens}, {hidden}] + next Linear's cast",
                 "stock": _trace_side("nn.LayerNorm", lambda: nn.LayerNorm(hidden), residual_sum,
                                      lambda m, x: next_linear_cast(m(x)), target),
                 "tempo": [_trace_side("InplaceLayerNorm", lambda: InplaceLayerNorm(hidden), residual_sum,
                                       lambda m, x: next_linear_cast(m(x)), target)]})
    rows.append({"part": f"dropout + add + LayerNorm [{tokens}, {hidden}] + cast",
                 "stock": _trace_side("dropout, add, nn.LayerNorm", lambda: _DropoutAddNorm(hidden, p, False),
                                      dense_and_residual, lambda m, x, r: next_linear_cast(m(x, r)), target),
                 "tempo": [_trace_side("DropoutAddLayerNorm", lambda: _DropoutAddNorm(hidden, p, True),
                                       dense_and_residual, lambda m, x, r: next_linear_cast(m(x, r)), target)]})
    head = hidden // heads
    core = lambda kind: (lambda: _Core(kind, p, head))  # noqa: E731
    rows.append({"part": f"attention core b={batch} h={heads} s={seq_len} d={head}",
                 "stock": _trace_side("eager", core("eager"), qkv, lambda m, q, k, v: m(q, k, v), target),
                 "tempo": [_trace_side("Combined (paper)", core("tempo"), qkv, lambda m, q, k, v: m(q, k, v), target),
                           _trace_side("stock sdpa (fused)", core("sdpa"), qkv, lambda m, q, k, v: m(q, k, v), target),
                           _trace_side("efficient_attention", core("efficient"), qkv,
                                       lambda m, q, k, v: m(q, k, v), target)]})
    return rows


__all__ = ["Side", "component_table"]
