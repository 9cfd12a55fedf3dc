"""Byte declarations of the newer paths against counts written out by hand (issue 26.5): the
kept-x̂ term of InplaceLayerNorm and DropoutAddLayerNorm with K > 0 kept columns, and the
variable-length attention's offsets and per-row bytes on packed sequences. Each expected number is
derived here from the tensors the CUDA kernels touch, not from the declaration's code."""

from __future__ import annotations

import torch

from tempo.movement.declarations import INTERPRETER, PHILOX_BYTES, kernels_of
from tempo.movement.trace import Recorder
from tempo.ops._backend import use_backend


def _declared(run):
    with Recorder() as recorder, use_backend("reference"):
        run()
    return [(call.packet, k.name, k.read, k.written) for call in recorder.calls if call.packet.startswith("tempo.")
            for k in kernels_of(call, INTERPRETER)]


def _layernorm_with_kept_columns(module, k_kept: int):
    with torch.no_grad():
        module.bias.fill_(0.5)
        module.weight[:k_kept] = 1e-30  # |γ| < |β|: these columns' x̂ are kept
    return module


def test_inplace_layernorm_forward_with_kept_columns_hand_count():
    from tempo.inplace_layernorm import InplaceLayerNorm

    rows, n, k = 10, 96, 3
    layer = _layernorm_with_kept_columns(InplaceLayerNorm(n), k)
    x = torch.randn(rows, n, dtype=torch.bfloat16, requires_grad=True)
    forward = [d for d in _declared(lambda: layer(x)) if d[0] in ("tempo.layernorm_plan", "tempo.layernorm_fwd")]
    bf16, fp32, int64 = 2, 4, 8
    block = rows * k
    assert forward == [
        # the plan: γ and β (fp32) read once, one flag byte per column written
        ("tempo.layernorm_plan", "plan_kept_columns", 2 * n * fp32, n),
        # the kernel: x (bf16), γ, β in; y (bf16), rstd and the row mean (fp32 per row) out
        ("tempo.layernorm_fwd", "_layernorm_fwd_kernel", rows * n * bf16 + 2 * n * fp32,
         rows * n * bf16 + rows * fp32 + rows * fp32),
        # the host gathers the K kept columns of x (the K int64 indices read too), casts them to
        # fp32 and centres and scales them with the row mean and rstd
        ("tempo.layernorm_fwd", "x[:, kept_cols]", block * bf16 + k * int64, block * bf16),
        ("tempo.layernorm_fwd", "kept.float()", block * bf16, block * fp32),
        ("tempo.layernorm_fwd", "kept - mean", block * fp32 + rows * fp32, block * fp32),
        ("tempo.layernorm_fwd", "kept * rstd", block * fp32 + rows * fp32, block * fp32),
    ]


def test_dropout_add_layernorm_kept_columns_are_read_back_in_backward_hand_count():
    from tempo.ops.dropout_add_layernorm import DropoutAddLayerNorm

    rows, n, k = 6, 64, 2
    layer = _layernorm_with_kept_columns(DropoutAddLayerNorm(n, p=0.1), k).train()
    x = torch.randn(rows, n, requires_grad=True)
    residual = torch.randn(rows, n, requires_grad=True)
    declared = _declared(lambda: layer(x, residual).backward(torch.randn(rows, n)))
    fwd = next(d for d in declared if d[1] == "_dal_fwd_kernel")
    bwd = next(d for d in declared if d[1] == "_dal_bwd_kernel")
    fp32, int32, seed = 4, 4, 8
    # forward: x, residual, γ, β, the seed and the column slots in; y, rstd and the kept x̂ out
    assert fwd[2:] == (2 * rows * n * fp32 + 2 * n * fp32 + seed + n * int32,
                       rows * n * fp32 + rows * fp32 + rows * k * fp32)
    # backward reads the kept x̂ block ([rows, K] fp32) and the slots besides dy, y, rstd, γ, β, 1/γ, the seed
    kept_term = rows * k * fp32 + n * int32
    without = 2 * rows * n * fp32 + rows * fp32 + 3 * n * fp32 + seed
    assert bwd[2] == without + kept_term


def test_varlen_attention_counts_offsets_and_rows_of_the_packed_sequences():
    from tempo.ops.attention import efficient_attention_varlen

    lengths = [5, 1, 9, 3]
    t, h, d = sum(lengths), 2, 8
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    q, k, v = (torch.randn(t, h, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
    declared = _declared(lambda: efficient_attention_varlen(q, k, v, cu, max(lengths), dropout_p=0.1).sum().backward())
    forward = next(dd for dd in declared if dd[0] == "tempo.efficient_attention_varlen_fwd")
    fp16, fp32 = 2, 4
    offsets = 2 * cu.numel() * 4  # cu_seqlens read for q's and for k's sequences
    # q, k, v [T, h, d] in; the output, one fp32 log-sum-exp per (token, head) and philox state out
    assert forward[2:] == (3 * t * h * d * fp16 + offsets, t * h * d * fp16 + t * h * fp32 + PHILOX_BYTES)
