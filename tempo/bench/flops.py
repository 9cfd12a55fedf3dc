"""Model FLOPs of BERT pretraining, the numerator of MFU.

Exact count (default, ``formula="gemm"``): only the matrix multiplications, 2·m·k·n FLOPs for an
[m, k] × [k, n] product (one multiply and one add per term); element-wise work (softmax, GELU,
LayerNorm, dropout, biases) and the embedding lookups are left out, as is usual for MFU. Per
sequence of s tokens, per encoder layer, forward, with hidden size h and FFN size i:

    Q, K and V projections       3 · 2·s·h·h
    attention scores Q·Kᵀ            2·s·s·h     (all heads together: heads · 2·s·s·(h/heads))
    attention probabilities · V      2·s·s·h
    attention output projection      2·s·h·h
    FFN up and down              2 · 2·s·h·i
                                 = s·(8h² + 4hi) + 4s²h        (i = 4h: 24·s·h² + 4·s²·h)

Heads, per sequence, forward:
    MLM head on the P predicted positions only (our model gathers them first):
        transform dense 2·P·h·h + decoder 2·P·h·V      (V = vocab_size, the useful rows;
        the padded rows of the padded vocab are left out). HF's models run it on all s
        positions: P = s for them.
    NSP: pooler 2·h·h + classifier 2·h·2 (absent for a masked-LM-only model).

Training = forward + backward, and backward is two GEMMs per forward GEMM (gradient of the
input and of the weight), so ×3. With activation checkpointing each encoder layer's forward
runs once more in backward: + 1× the encoder's forward (heads are not checkpointed).

Anchors (BERT-large h=1024, i=4096, 24 layers, V=30522): s=128, P=20: 240.7 GFLOP/sequence;
s=512, P=80: 1020.6 GFLOP/sequence.

Coarse count (``formula="coarse"``): 6 · parameters · tokens, the rule of thumb "each
parameter does one multiply-add per token forward and two backward". It ignores the s² attention
terms and counts the word-embedding matrix as if every token went through the MLM decoder, so it
over-counts a masked-position head and under-counts long sequences.
"""

from __future__ import annotations

import math
from typing import Any

FORMULAS = ("gemm", "coarse")


def encoder_layer_forward_flops(seq_len: int, hidden: int, intermediate: int) -> int:
    s, h, i = seq_len, hidden, intermediate
    projections = 3 * 2 * s * h * h + 2 * s * h * h
    attention = 2 * s * s * h + 2 * s * s * h
    ffn = 2 * 2 * s * h * i
    return projections + attention + ffn


def bert_pretraining_flops(config: Any, seq_len: int, mlm_positions: int, *, nsp: bool = True,
                           grad_ckpt: bool = False) -> dict[str, int]:
    """FLOPs per sequence of one training step (forward + backward [+ recompute]).

    ``config`` needs hidden_size, intermediate_size, num_hidden_layers and vocab_size (ours and
    HF's BertConfig both have them). Returns the parts and ``total``.
    """
    h, i = config.hidden_size, config.intermediate_size
    encoder_fwd = config.num_hidden_layers * encoder_layer_forward_flops(seq_len, h, i)
    mlm_fwd = mlm_positions * (2 * h * h + 2 * h * config.vocab_size)
    nsp_fwd = (2 * h * h + 2 * h * 2) if nsp else 0
    forward = encoder_fwd + mlm_fwd + nsp_fwd
    recompute = encoder_fwd if grad_ckpt else 0
    return {
        "encoder_forward": encoder_fwd,
        "mlm_forward": mlm_fwd,
        "nsp_forward": nsp_fwd,
        "forward": forward,
        "backward": 2 * forward,
        "recompute": recompute,
        "total": 3 * forward + recompute,
    }


def coarse_flops(num_parameters: int, seq_len: int) -> int:
    """6 · N · s per sequence (see the module docstring for what it misses)."""
    return 6 * num_parameters * seq_len


def flops_per_sequence(formula: str, config: Any, seq_len: int, mlm_positions: int, *, nsp: bool = True,
                       grad_ckpt: bool = False, num_parameters: int | None = None) -> int:
    if formula == "gemm":
        return bert_pretraining_flops(config, seq_len, mlm_positions, nsp=nsp, grad_ckpt=grad_ckpt)["total"]
    if formula == "coarse":
        if num_parameters is None:
            raise ValueError("the coarse formula needs the parameter count")
        return coarse_flops(num_parameters, seq_len)
    raise ValueError(f"unknown FLOP formula {formula!r}; choose one of {FORMULAS}")


def mfu(achieved_tflops: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved / peak, None when the peak is unknown."""
    if peak is None or peak <= 0 or math.isnan(achieved_tflops):
        return None
    return achieved_tflops / peak
