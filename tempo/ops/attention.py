"""Efficient attention: ``scaled_dot_product_attention`` that keeps O(s) per row for backward.

Eager attention keeps, for backward, the s×s softmax output, the s×s dropout mask and the s×s
dropout output. This op keeps only ``q``, ``k``, ``v``, its output, two numbers per query row
(the row's max score m and log l, l = Σ exp(S − m); fp32, fp64 for fp64 inputs: 8 bytes) and a
0-d int64 dropout seed, plus ``attn_mask`` when given (the caller's tensor, which the caller
holds anyway). Backward recomputes each block of scores from ``q`` and ``k``, the probabilities
from m and log l, and the dropout mask from the seed (FlashAttention-2's backward:
D = rowsum(dO·O), P = exp((S − m) − log l), dV += P_dropᵀ dO, dP = dO Vᵀ ∘ keep/(1−p),
dS = P ∘ (dP − D), dQ += scale·dS K, dK += scale·dSᵀ Q). On CUDA PyTorch's fused kernels do the
same with one fp32 log-sum-exp per row.

Paths
  * No backward (grad mode off, or nothing among q, k, v, attn_mask requires grad: eval,
    ``torch.no_grad()``, ``torch.inference_mode()``, frozen layers) in eval mode
    (``training=False``): nothing is kept, so the stock ``F.scaled_dot_product_attention`` runs,
    same semantics (sdpa gives 0 for fully masked rows too): on the CPU as it is; on CUDA with the
    backends of the CUDA dispatch below plus the math one (it materialises s×s scores, for the
    length of the call only). Whatever ``use_backend`` says, as every Tempo layer.
    In training mode the path is the one a backward would take, backward or not
    (``runs_own_forward``): a no-grad forward replayed with grad (reentrant checkpointing's first
    pass and its recompute; GradCache, sentence-transformers' CachedMultipleNegativesRankingLoss)
    then computes the same bits and, with dropout, draws the same mask both times (the reference op
    from its seed, a fused CUDA kernel from the same generator state); autograd keeps nothing
    under no_grad either way. Stock sdpa rounds otherwise than the reference op (measured on
    MiniLM: up to 7.7e-7 fp32, 7.8e-3 under bf16 autocast), and on the CPU the reference op costs
    1.2x its time at s = 128 and 2-3x at s = 512 (fp32, one thread), a price only training-mode
    passes pay, as their recompute with grad does.
  * CUDA with a backward (backend "auto" or "triton"): PyTorch's fused sdpa kernels, chosen here
    (next section); sdpa's own autograd keeps the same kind of O(s) state (q, k, v, out, lse,
    philox seed/offset, the mask). There is no Triton kernel of ours: without a measurement
    showing one beats PyTorch's fused kernels we use those, so forcing backend "triton" selects
    the sdpa path on CUDA and the reference path on the CPU (no error).
  * Reference (the CPU, backend "reference" anywhere, the CUDA fallback): a
    ``tempo::efficient_attention_fwd`` / ``_bwd`` custom-op pair that loops over tiles of
    ``BLOCK_Q`` query rows × ``BLOCK_K`` keys, batched over (batch, heads), with an online
    softmax in fp32 (fp64 for fp64 inputs). It works on one tile of scores at a time (a few
    tile-sized temporaries: scores/probabilities, the dropout tile, dP in backward), never on
    s_q × s_k; for s <= 128 there is one tile. Its temporaries of size O(s·d) (fp32 copies of
    low-precision q, k, v; the gradient accumulators) are freed when it returns.

Exactness: what backward recovers instead of keeping (u_c = 2^-24, the fp32 compute's unit
roundoff, 2^-53 for fp64 inputs; T key tiles of BLOCK_K; tests/test_attention_exactness.py checks
each bound elementwise with logits up to 1e4, finfo.min and −inf masks with fully masked rows,
fp32/bf16/fp16)
  * Dropout keep tiles: the same pure function of (seed, tile, shape, p) in forward and backward:
    bitwise the forward's. Exact.
  * Scores S: recomputed from q, k and the mask by the forward's arithmetic (same function, same
    tile shapes): bitwise the forward's on a deterministic BLAS.
  * P = exp((S − m) − log l): |P̃/P − 1| <= (2|S_ij − m_i| + 3 ln s_k + 3T + 136)·u_c to first
    order, P the exact softmax of the same S (for every P above fp32's underflow, |S − m| <= 104:
    <= ~(350 + 3T)·u_c ≈ 2e-5). No condition on |m|: a single fp32 lse = m + log l loses log l once
    |m| is large against 1/u_c (a row masked only by finfo.min: P = 1 instead of 1/s_k, a silently
    wrong gradient), which is why two numbers per row are kept.
  * D_i = rowsum(dO·O) from the kept output (rounded to its dtype, unit roundoff u_o):
    |ΔD_i| <= (u_o + (d_v + 2)·u_c)·Σ_k |dO_ik O_ik|, as in FlashAttention-2.
  * End to end against fp64 (logits to ±1e3): fp32 as close as eager attention; bf16 and fp16 3
    to 100 times closer than eager in the same dtype (which rounds scores and probabilities to
    it); where a row is fully masked by −inf eager gives NaN, this op 0.
  * CUDA (PyTorch's flash and efficient kernels): P from one fp32 lse (relative error about
    (|lse| + |S − lse|)·u_c: hence the mask floor), D from O, dropout from the philox seed and
    offset (exact). The gpu tests compare every gradient with fp64 there.

CUDA dispatch (torch 2.11 to 2.13; decided in Python from the inputs' dtype, shapes and strides,
the device and the switches, so eager and torch.compile take the same path)
  * Offered, in this priority order (``sdpa_kernel(..., set_priority=True)``; without
    set_priority the list is no priority, and torch 2.11 on sm90/sm100 with cuDNN > 9.15 puts
    cuDNN first): flash (fp16/bf16, no mask, head dim <= 256), efficient (fp16/fp32, bf16 from
    sm80, head dims multiples of 8 (16-bit) or 4 (fp32), any mask), cuDNN. cuDNN only without a
    mask (pytorch issue 196678: NaN grad_q when s % 128 == 64 and a row's log-sum-exp is below
    −88.7, fully padded rows included) and only when 16·p is an integer (cuDNN's dropout rate has
    1/16 resolution and torch 2.11 does not refuse other rates: BERT's 0.1 would train at
    another rate; torch >= 2.12 refuses them itself). The math backend never, with a backward
    (it keeps s×s). The same offer on every torch version: only torch's own acceptance differs
    (2.12+ also refuses the efficient kernel for q, k, v whose storage offset is not a multiple of
    its alignment, which this dispatch cannot see under torch.compile: such a call fails in sdpa).
  * Each one only if the user left it on: the offer is intersected with
    ``torch.backends.cuda.{flash,mem_efficient,cudnn}_sdp_enabled()``, which also reflect any
    enclosing ``sdpa_kernel`` block, so ``enable_cudnn_sdp(False)`` is never undone here. The
    caller's switches and exact priority order are restored after the call (sdpa_kernel alone
    moves disabled backends behind ours). torch installs its default priority lazily, at the
    first sdpa selection of the process; that is made to happen before our first block.
  * A float (additive) ``attn_mask`` runs the reference op whenever dropout is on or the mask
    requires grad; a bool mask never does. One rule for both passes of a replay: whether the
    reference op or a fused kernel draws the dropout mask may not depend on ``requires_grad``,
    which a learned bias has in the pass with grad and lacks in a no-grad pass of the same
    forward (GradCache / CachedMNRL, reentrant checkpointing): the two passes would draw different
    masks and consume torch's RNG differently, shifting every later layer's mask. A mask that
    requires grad needs its gradient, which only the reference op gives (the fused efficient
    kernel's mask gradient hits illegal memory on torch 2.11, pytorch issue 148476). With dropout
    off neither path draws anything and they agree to rounding, so a float mask without grad keeps
    the fused kernel. Key-padding masks should be bool (our BERT passes one; transformers' sdpa
    mask function makes one): they keep the fused kernels with dropout on. Every call no offered
    kernel takes (fp64, head dims the kernels refuse, a head dim with stride != 1, all fused
    backends switched off) runs the reference op too: logged once per case (logger "tempo"; under
    torch.compile when the call is traced).
  * An ``attn_bias`` runs the reference op with a backward when a float mask would (dropout on, or
    it requires grad: a learned bias always does in training) and whenever an ``attn_mask`` is
    given too (sdpa takes one mask; the merged one would be (b, h, s_q, s_k), which sdpa keeps).
    So MPNet's training attention runs the reference op on CUDA: kept for backward, q, k, v, the
    output, two fp32 numbers per row, the seed, the [b, 1, 1, s] padding mask and the shared
    [1, h, s, s] bias (the last two once per forward, shared by all layers); transient, per call,
    fp32 copies of q, k, v (O(s·d)), tile-sized scores, probabilities and dropout tiles
    ([b, h, BLOCK_Q, BLOCK_K]), and in backward the dq, dk, dv accumulators and one [1, h, s, s]
    fp32 bias-gradient buffer. Slower than a fused kernel (a Python loop over tiles, batched over
    (b, h)); a Triton kernel with the bias and its batch-reduced gradient is not written yet. The
    fused alternatives do not fit: sdpa's efficient kernel takes a bias with grad but materialises
    its gradient at the expanded (b, h, s_q, s_k) shape and is broken on torch 2.11 (pytorch issue
    148476), and it takes one mask (padding + bias merged: (b, h, s_q, s_k) kept).
  * The acceptance rules are torch's own, narrowed where unsure (cuDNN head dims <= 128). A call
    they accept that torch still refuses fails in sdpa ("No available kernel") in eager and
    compiled code alike. Under torch.compile the switches and device facts are read when the
    call is traced, as torch's own sdpa lowering does.
  * On flash and efficient the output is stored as (b, s_q, h, d_v) (see "Semantics"); on cuDNN
    and math the layout is theirs.
  * Variable-length (nested jagged) inputs, ``efficient_attention_varlen``: the same offer narrowed
    to what torch's nested sdpa takes (flash only for equal head dims that are a multiple of 8,
    neither kernel when a sequence is empty, never cuDNN or math), the nested tensors given
    ``min_seqlen`` and ``max_seqlen`` so that torch reads neither back from the device (it read
    ``offsets.diff().min().item()`` for q, k and v: three stalls per layer, and a graph break).
    Host reads of this module on CUDA: none per call with those two known (``TokenLayout`` and the
    HF packing path record them with ``remember_sequences``); the reference op's seed
    (``seed.item()``) and offsets only on its fallback path.

Semantics (those of ``torch.nn.functional.scaled_dot_product_attention``)
  * ``q`` (b, h, s_q, d), ``k`` (b, h, s_k, d), ``v`` (b, h, s_k, d_v); same dtype and device.
    ``scale`` defaults to 1/sqrt(d). ``is_causal``: query i attends keys j <= i (upper-left
    aligned, as sdpa); it cannot be combined with ``attn_mask``.
  * ``attn_bias`` (not an sdpa argument): a second additive float term, scores = scale·q·kᵀ +
    attn_bias + attn_mask, broadcasting to (b, h, s_q, s_k), with its gradient when it requires
    grad. For a learned bias shared by the batch beside a per-sample padding mask (MPNet's relative
    positions, [1, h, s_q, s_k]): the reference op keeps it as given (one copy per forward when every
    layer passes the same tensor) and accumulates its gradient in one buffer of its own shape, never
    (b, h, s_q, s_k). Without a backward the stock sdpa gets the two merged (a transient).
  * ``attn_mask`` broadcasts to (b, h, s_q, s_k): bool (True = attend) or an additive float mask
    of any float dtype. BERT's key-padding masks are (b, 1, 1, s_k). A row whose keys are all
    masked (bool False or -inf) gives output 0 and gradient 0, never NaN. Additive ``finfo.min``
    entries are numbers, as in eager and sdpa: on the reference path (and the stock CPU sdpa) a
    row masked only by finfo.min attends uniformly. The fused CUDA kernels get the mask in q's
    dtype with entries <= ``FUSED_MASK_FLOOR`` (−32768) as −inf (their fp32 log-sum-exp cannot
    recover such a row's probabilities, see ``_fused_mask``): there a row masked only by them
    gives 0, as with a bool mask; every other row is unchanged. When a key-padding mask masks
    nothing the caller should pass ``None`` instead: the fused flash kernel takes no mask at all.
    A float mask that requires grad gets its gradient (the gradient of the scores).
  * Dropout (only when ``training`` and ``dropout_p > 0``) drops probabilities after the softmax
    and scales the kept ones by 1/(1−p). On the reference path the keep mask is a pure function of
    (seed, (b, h, s_q, s_k), p, device type): tile (i, j) is drawn as one ``torch.rand`` of shape
    (b, h, tile rows, tile cols) from a ``torch.Generator`` seeded with a hash of (seed, i, j);
    ``attention_keep_mask`` regenerates the whole mask. The seed is drawn from torch's RNG, so
    ``torch.manual_seed`` and ``torch.utils.checkpoint`` reproduce it. On the sdpa path the mask
    is sdpa's own (CUDA philox) and cannot be regenerated here.
  * Autocast: sdpa's policy exactly (custom ops are on no autocast list, so ``autocast_like_sdpa``
    applies it first): sdpa is ``lower_precision_fp`` for CUDA and CPU in torch 2.11 and 2.13, so
    every floating-point q, k, v and float ``attn_mask`` on the autocast's device that is not fp64
    is cast to the autocast dtype, and the output has that dtype. q, k, v of mixed dtypes are then
    sdpa's normal case (RoPE leaves q, k fp32 beside a bf16 v); an fp64 one beside others is refused
    as sdpa refuses it. A float mask's ``finfo(float32).min`` becomes −inf in bf16 and fp16, so a row
    masked only by it gives 0, as stock sdpa under autocast. Outside autocast, mixed q, k, v dtypes
    raise ``MixedDtypeError`` (a TypeError, and the RuntimeError sdpa raises for them).
  * With a backward, the output is a (b, h, s_q, d_v) tensor stored as (b, s_q, h, d_v):
    ``out.transpose(1, 2)`` is contiguous, so merging the heads for the output projection is a
    view, not a copy (flash, efficient and the reference op; cuDNN's and the stock CPU sdpa's
    layout is theirs). Gradients of q, k, v come back in the layout of q, k, v.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
import weakref
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from tempo.ops._backend import (check_float_tensor, check_probability, held_dropout, held_dropout_rate,
                                requested_backend, runs_own_forward)

_OP = "efficient_attention"
# Tile sizes of the reference path. They fix the layout of the dropout mask's random stream, so
# changing them changes which elements a given seed drops.
BLOCK_Q = 128
BLOCK_K = 128
_MASK64 = (1 << 64) - 1

logger = logging.getLogger("tempo")
_logged_fallbacks: set[str] = set()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp64 inputs keep fp64 row statistics: fp32 ones would cap the gradient's precision at ~1e-7.
    return _compute_dtype(dtype)


# ----------------------------------------------------------------------------------------------
# Dropout mask: one generator state per (query tile, key tile), batched over (b, h).
# ----------------------------------------------------------------------------------------------
def _tile_seed(seed: int, qi: int, ki: int) -> int:
    """splitmix64 of (seed, qi, ki): the CPU generator uses only 32 bits of its seed, so mix all in."""
    z = (seed ^ (qi << 42) ^ (ki << 21)) & _MASK64
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _uniform_tile(gen: torch.Generator, seed: int, qi: int, ki: int, shape: tuple[int, ...],
                  device: torch.device) -> Tensor:
    gen.manual_seed(_tile_seed(seed, qi, ki))
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)


def _dropout_tile(gen: torch.Generator, seed: int, qi: int, ki: int, shape: tuple[int, ...], p: float,
                  device: torch.device, dtype: torch.dtype) -> Tensor:
    """keep / (1 - p) as a float tile (one multiply applies mask and scale)."""
    u = _uniform_tile(gen, seed, qi, ki, shape, device)
    return u.ge_(p).to(dtype).mul_(1.0 / (1.0 - p))


def _blocks(n: int, block: int) -> list[tuple[int, int, int]]:
    return [(i, start, min(start + block, n)) for i, start in enumerate(range(0, n, block))]


def _dv_and_dropped_dp(dv_tile: Tensor, probs: Tensor, dp: Tensor, gt: Tensor, z: Optional[Tensor]) -> None:
    """One reference backward tile, in place: dv_tile += (P·Z)ᵀ·g and dp *= Z, with Z the tile's
    ``_dropout_tile`` (None: no dropout, Z = 1). Shared with the disentangled attention."""
    if z is None:
        dv_tile += torch.matmul(probs.transpose(-1, -2), gt)
    else:
        dv_tile += torch.matmul((probs * z).transpose(-1, -2), gt)
        dp.mul_(z)


def attention_keep_mask(seed: Tensor | int, shape, dropout_p: float, device=None) -> Tensor:
    """The bool keep-mask (True = kept) the reference path draws for scores of ``shape``.

    ``shape`` is (b, h, s_q, s_k); ``seed`` the 0-d int64 seed (or an int). Materialises the full
    s_q × s_k mask: for tests, not for training.
    """
    b, h, s_q, s_k = (int(n) for n in shape)
    if device is None:
        device = seed.device if isinstance(seed, Tensor) else torch.device("cpu")
    device = torch.device(device)
    p = check_probability(dropout_p, "dropout_p", "attention_keep_mask")
    seed_int = int(seed.item()) if isinstance(seed, Tensor) else int(seed)
    keep = torch.empty((b, h, s_q, s_k), dtype=torch.bool, device=device)
    gen = torch.Generator(device=device)
    for qi, q0, q1 in _blocks(s_q, BLOCK_Q):
        for ki, k0, k1 in _blocks(s_k, BLOCK_K):
            u = _uniform_tile(gen, seed_int, qi, ki, (b, h, q1 - q0, k1 - k0), device)
            keep[:, :, q0:q1, k0:k1] = u >= p
    return keep


def _resolve_seed(seed: Optional[Tensor], p: float, device: torch.device) -> Tensor:
    """The caller's seed as a 0-d int64 on ``device``, or a fresh one when dropout is on (0 when off)."""
    if seed is None:
        return draw_seed(device) if p > 0.0 else torch.zeros((), dtype=torch.int64, device=device)
    return seed.to(device=device, dtype=torch.int64).reshape(())


def draw_seed(device: torch.device | str) -> Tensor:
    """A 0-d int64 seed from torch's RNG on ``device``, without a host sync."""
    return torch.randint(0, 2**31 - 1, (), device=device, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Reference implementation: tiles of scores, batched over (batch, heads).
# ----------------------------------------------------------------------------------------------
def _as_4d(mask: Optional[Tensor]) -> Optional[Tensor]:
    if mask is None:
        return None
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _mask_tile(mask4: Tensor, q0: int, q1: int, k0: int, k1: int) -> Tensor:
    # Broadcast dims (size 1) stay whole; the tile broadcasts against (b, h, rows, cols).
    rows = slice(q0, q1) if mask4.shape[2] != 1 else slice(None)
    cols = slice(k0, k1) if mask4.shape[3] != 1 else slice(None)
    return mask4[:, :, rows, cols]


def _scores(qs: Tensor, kc: Tensor, mask4: Optional[Tensor], is_causal: bool,
            q0: int, q1: int, k0: int, k1: int, bias4: Optional[Tensor] = None) -> Tensor:
    """Masked scores of one tile; ``qs`` is the scaled query tile. Forward and backward share it.
    scale·q·kᵀ + bias + mask, in that order (MPNet's order; BERT's has no bias)."""
    s = torch.matmul(qs, kc[:, :, k0:k1].transpose(-1, -2))
    if bias4 is not None:
        s.add_(_mask_tile(bias4, q0, q1, k0, k1))
    if mask4 is not None:
        tile = _mask_tile(mask4, q0, q1, k0, k1)
        if tile.dtype == torch.bool:
            # As an additive tile of the mask's own (broadcast) shape: a broadcast add is much
            # cheaper than a broadcast masked_fill_, and a key-padding tile is tiny.
            tile = torch.zeros(tile.shape, dtype=s.dtype, device=s.device).masked_fill_(
                torch.logical_not(tile), float("-inf"))
        s.add_(tile)
    if is_causal and k1 - 1 > q0:  # the tile crosses the diagonal
        rows = torch.arange(q0, q1, device=s.device)[:, None]
        cols = torch.arange(k0, k1, device=s.device)[None, :]
        s.masked_fill_(cols > rows, float("-inf"))
    return s


def _key_blocks(is_causal: bool, q1: int, s_k: int) -> list[tuple[int, int, int]]:
    """Key tiles a query tile ending at row q1 sees. Tile bounds never depend on causality (the
    dropout stream is laid out per tile); causal only drops the tiles past the diagonal, which
    the tile's last query row q1 - 1 cannot attend."""
    tiles = _blocks(s_k, BLOCK_K)
    return [t for t in tiles if t[1] < q1] if is_causal else tiles


def _reference_forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], seed: Tensor,
                       p: float, is_causal: bool, scale: float,
                       bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    b, h, s_q, _ = q.shape
    s_k, d_v = k.shape[2], v.shape[3]
    cdt = _compute_dtype(q.dtype)
    out = q.new_empty_strided((b, h, s_q, d_v), (s_q * h * d_v, d_v, h * d_v, 1))
    # Per query row: the max score m and log l (l = sum of exp(S - m)); see "Exactness".
    stats = torch.empty((b, h, s_q, 2), dtype=_stats_dtype(q.dtype), device=q.device)
    if out.numel() == 0 and stats.numel() == 0:
        return out, stats
    qs = q.to(cdt) * scale  # O(s·d) transients; scaling q is cheaper than scaling every score
    kc, vc = expand_kv_heads(k.to(cdt), h), expand_kv_heads(v.to(cdt), h)  # grouped-query: each kv head shared
    mask4, bias4 = _as_4d(mask), _as_4d(bias)
    dropout = p > 0.0
    seed_int = int(seed.item()) if dropout else 0  # host sync: this is the CPU / fallback path
    gen = torch.Generator(device=q.device) if dropout else None
    for qi, q0, q1 in _blocks(s_q, BLOCK_Q):
        qt = qs[:, :, q0:q1]
        m = l = acc = None
        for ki, k0, k1 in _key_blocks(is_causal, q1, s_k):
            s = _scores(qt, kc, mask4, is_causal, q0, q1, k0, k1, bias4)
            m_tile = s.amax(dim=-1)
            m_new = m_tile if m is None else torch.maximum(m, m_tile)
            # Rows with every key so far at -inf shift by 0, so exp gives 0 rather than NaN.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            probs = s.sub_(m_safe.unsqueeze(-1)).exp_()
            row_sum = probs.sum(dim=-1)
            if dropout:  # l sums the undropped probabilities; only the values are dropped
                probs.mul_(_dropout_tile(gen, seed_int, qi, ki, tuple(probs.shape), p, q.device, cdt))
            pv = torch.matmul(probs, vc[:, :, k0:k1])
            if m is None:
                l, acc = row_sum, pv
            else:
                alpha = torch.exp(m - m_safe)  # m = -inf (nothing seen yet) gives 0
                l = l.mul_(alpha).add_(row_sum)
                acc = acc.mul_(alpha.unsqueeze(-1)).add_(pv)
            m = m_new
            del s, probs
        if m is None:  # s_k == 0: no keys at all
            out[:, :, q0:q1] = 0
            stats[:, :, q0:q1, 0] = float("inf")
            stats[:, :, q0:q1, 1] = 0.0
            continue
        # Every key masked: output 0, and m = +inf makes exp(S - m - log l) = 0 in backward.
        empty = l == 0
        factor = torch.where(empty, 0.0, 1.0 / l.masked_fill(empty, 1.0))
        out[:, :, q0:q1] = acc.mul_(factor.unsqueeze(-1))
        stats[:, :, q0:q1, 0] = m.masked_fill(empty, float("inf"))
        stats[:, :, q0:q1, 1] = torch.log(l.masked_fill(empty, 1.0))
    return out, stats


def expand_kv_heads(t: Tensor, heads: int) -> Tensor:
    """k or v at the query heads (grouped-query attention: head j serves query heads j·g to j·g + g − 1,
    as sdpa's ``enable_gqa`` and transformers' ``repeat_kv``); a transient of the op, never kept."""
    groups = heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _kv_heads(t: Tensor, kv_heads: int) -> Tensor:
    """A gradient at the query heads summed back to the kv heads (``expand_kv_heads``' adjoint), in the
    compute dtype: one rounding to the input's dtype afterwards."""
    b, heads = t.shape[0], t.shape[1]
    if heads == kv_heads:
        return t
    return t.view(b, kv_heads, heads // kv_heads, *t.shape[2:]).sum(dim=2)


def _reduce_to(t: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``t`` over the dims where ``shape`` has size 1 (broadcast dims of a mask tile)."""
    dims = [i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def _reference_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor,
                        mask: Optional[Tensor], seed: Tensor, p: float, is_causal: bool, scale: float,
                        mask_needs_grad: bool, bias: Optional[Tensor] = None,
                        bias_needs_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dmask, dbias); dmask / dbias are empty unless asked for. Both are the gradient
    of the scores summed over the mask's / bias's broadcast dims, accumulated tile by tile in the
    compute dtype: a batch-shared [1, h, s_q, s_k] bias costs one such buffer, never (b, h, s_q, s_k)."""
    s_q, s_k = q.shape[2], k.shape[2]
    cdt = _compute_dtype(q.dtype)
    qs = q.to(cdt) * scale
    kc, vc = expand_kv_heads(k.to(cdt), q.shape[1]), expand_kv_heads(v.to(cdt), q.shape[1])
    g = grad_out.to(cdt)
    # D_i = sum_j P_ij dP_ij = rowsum(dO * O), dropout included (O already holds it).
    delta = (g * out.to(cdt)).sum(dim=-1)
    dq = torch.zeros_like(q, dtype=cdt)
    dk = torch.zeros_like(kc)  # at the query heads: summed to the kv heads at the end
    dv = torch.zeros_like(vc)
    mask4, bias4 = _as_4d(mask), _as_4d(bias)
    dmask4 = torch.zeros(mask4.shape, dtype=cdt, device=q.device) if mask_needs_grad else None
    dbias4 = torch.zeros(bias4.shape, dtype=cdt, device=q.device) if bias_needs_grad else None
    dropout = p > 0.0
    seed_int = int(seed.item()) if dropout else 0
    gen = torch.Generator(device=q.device) if dropout else None
    stats_c = stats.to(cdt)
    for qi, q0, q1 in _blocks(s_q, BLOCK_Q):
        qt, gt = qs[:, :, q0:q1], g[:, :, q0:q1]
        m_t, log_l_t = stats_c[:, :, q0:q1, 0:1], stats_c[:, :, q0:q1, 1:2]
        delta_t = delta[:, :, q0:q1].unsqueeze(-1)
        for ki, k0, k1 in _key_blocks(is_causal, q1, s_k):
            # P = exp((S - m) - log l): S - m is exact near the row's max whatever |m| is.
            probs = _scores(qt, kc, mask4, is_causal, q0, q1, k0, k1, bias4).sub_(m_t).sub_(log_l_t).exp_()
            dp = torch.matmul(gt, vc[:, :, k0:k1].transpose(-1, -2))
            z = _dropout_tile(gen, seed_int, qi, ki, tuple(probs.shape), p, q.device, cdt) if dropout else None
            _dv_and_dropped_dp(dv[:, :, k0:k1], probs, dp, gt, z)
            del z
            ds = dp.sub_(delta_t).mul_(probs)  # dS = P * (dP - D), in dp's storage
            del probs
            for grad4 in (dmask4, dbias4):  # both are the scores' gradient, summed over their broadcast dims
                if grad4 is not None:
                    target = _mask_tile(grad4, q0, q1, k0, k1)
                    target += _reduce_to(ds, target.shape)
            dq[:, :, q0:q1] += torch.matmul(ds, kc[:, :, k0:k1])
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qt)  # qt carries the scale
            del ds
    dq.mul_(scale)
    dmask = dmask4.reshape(mask.shape).to(mask.dtype) if dmask4 is not None else q.new_empty(0)
    dbias = dbias4.reshape(bias.shape).to(bias.dtype) if dbias4 is not None else q.new_empty(0)
    dk, dv = _kv_heads(dk, k.shape[1]), _kv_heads(dv, v.shape[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, dbias


# ----------------------------------------------------------------------------------------------
# Custom ops: forward returns (out, stats); stats (the row max and log-sum) are not differentiable.
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("tempo::efficient_attention_fwd", mutates_args=())
def _attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], seed: Tensor,
                      dropout_p: float, is_causal: bool, scale: float,
                      attn_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    with torch.autocast(q.device.type, enabled=False):
        return _reference_forward(q, k, v, attn_mask, seed, dropout_p, is_causal, scale, attn_bias)


@_attention_fwd_op.register_fake
def _(q, k, v, attn_mask, seed, dropout_p, is_causal, scale, attn_bias=None):
    b, h, s_q, _ = q.shape
    d_v = v.shape[3]
    out = q.new_empty_strided((b, h, s_q, d_v), (s_q * h * d_v, d_v, h * d_v, 1))
    return out, q.new_empty((b, h, s_q, 2), dtype=_stats_dtype(q.dtype))


@torch.library.custom_op("tempo::efficient_attention_bwd", mutates_args=())
def _attention_bwd_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor,
                      attn_mask: Optional[Tensor], seed: Tensor, dropout_p: float, is_causal: bool,
                      scale: float, mask_needs_grad: bool, attn_bias: Optional[Tensor] = None,
                      bias_needs_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dmask, dbias); dmask / dbias are empty unless ``mask_needs_grad`` /
    ``bias_needs_grad``."""
    with torch.autocast(q.device.type, enabled=False):
        return _reference_backward(grad_out, q, k, v, out, stats, attn_mask, seed, dropout_p,
                                   is_causal, scale, mask_needs_grad, attn_bias, bias_needs_grad)


@_attention_bwd_op.register_fake
def _(grad_out, q, k, v, out, stats, attn_mask, seed, dropout_p, is_causal, scale, mask_needs_grad,
      attn_bias=None, bias_needs_grad=False):
    dmask = torch.empty_like(attn_mask) if mask_needs_grad else q.new_empty(0)
    dbias = torch.empty_like(attn_bias) if bias_needs_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask, dbias


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, seed, dropout_p, is_causal, scale, attn_bias = inputs
    out, stats = output
    ctx.mark_non_differentiable(stats)
    # One implementation sits behind this op (the CPU path has no Triton kernel), so there is no
    # backend to record: backward regenerates the dropout tiles from the seed alone.
    ctx.save_for_backward(q, k, v, out, stats, seed, attn_mask, attn_bias)
    ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale


def _backward(ctx, grad_out, grad_stats):
    q, k, v, out, stats, seed, attn_mask, attn_bias = ctx.saved_tensors
    mask_needs_grad = attn_mask is not None and ctx.needs_input_grad[3]
    bias_needs_grad = attn_bias is not None and ctx.needs_input_grad[8]
    dq, dk, dv, dmask, dbias = _attention_bwd_op(grad_out, q, k, v, out, stats, attn_mask, seed, ctx.dropout_p,
                                                 ctx.is_causal, ctx.scale, mask_needs_grad, attn_bias,
                                                 bias_needs_grad)
    return (dq, dk, dv, (dmask if mask_needs_grad else None), None, None, None, None,
            (dbias if bias_needs_grad else None))


_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# CUDA: PyTorch's fused sdpa kernels, chosen here (see "CUDA dispatch" in the module docstring).
# ----------------------------------------------------------------------------------------------
class _CudaState(NamedTuple):
    """What decides which fused kernel may run, besides the inputs themselves."""

    sm: int  # compute capability as major * 10 + minor: 90 on an H100 (ints: Dynamo 2.11 fails on tuple <)
    flash: bool  # the user's switches (torch.backends.cuda.enable_*_sdp), narrowed by any
    efficient: bool  # enclosing sdpa_kernel block: both set the same global flags
    cudnn: bool
    math: bool
    cudnn_version: int  # 0 when cuDNN is unavailable
    deterministic: bool  # torch.use_deterministic_algorithms(True) without warn_only


_sdpa_priority_initialised = False


def _initialise_sdpa_priority(device: torch.device) -> None:
    """Make torch install its default sdpa priority order now, outside any ``sdpa_kernel`` block.

    torch (2.11 to 2.13 at least) installs its default order lazily, in the first CUDA sdpa
    selection of the process: on sm90/sm100 with cuDNN > 9.15 that is cuDNN, flash, efficient,
    math. Were that first selection inside our ``sdpa_kernel(..., set_priority=True)``, the
    default would overwrite our priority for that call, and restoring the order saved before it
    would leave the process without torch's default for good. ``torch._fused_sdp_choice`` runs
    the same selection on the host (no kernel launch, no allocation beyond the probe) and so
    installs the default; its answer is not used. It raises when no backend takes the probe
    (every fused backend disabled and math too, say), after the default is installed: that
    error is expected and dropped.
    """
    global _sdpa_priority_initialised
    if _sdpa_priority_initialised:
        return
    _sdpa_priority_initialised = True
    probe = torch.zeros((1, 1, 1, 8), dtype=torch.float16, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "kernel not used because" lines of a refused probe
        try:
            torch._fused_sdp_choice(probe, probe, probe)
        except RuntimeError:
            pass  # see the docstring: only the side effect was wanted


def _device_facts(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability as major * 10 + minor, cuDNN version or 0) of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor, int(torch.backends.cudnn.version() or 0)


@torch.compiler.assume_constant_result
def _cuda_state(device: str) -> _CudaState:
    """The switches and device facts the dispatch reads. Under torch.compile this runs once, when
    the call is traced, and the graph keeps the answer (as torch's own sdpa lowering keeps the
    backend it picked then): change a switch after compiling and the compiled graph does not see
    it; ``torch._dynamo.reset()`` or a recompile does."""
    dev = torch.device(device)
    _initialise_sdpa_priority(dev)
    sm, cudnn_version = _device_facts(dev)
    deterministic = (torch.are_deterministic_algorithms_enabled()
                     and not torch.is_deterministic_algorithms_warn_only_enabled())
    return _CudaState(
        sm=sm,
        flash=torch.backends.cuda.flash_sdp_enabled(),
        efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
        cudnn=torch.backends.cuda.cudnn_sdp_enabled(),
        math=torch.backends.cuda.math_sdp_enabled(),
        cudnn_version=cudnn_version,
        deterministic=deterministic,
    )


def _is_cuda(t: Tensor) -> bool:
    """Whether ``t`` takes the CUDA dispatch (one place, so tests can simulate a GPU on the CPU)."""
    return t.is_cuda


_HALF = (torch.float16, torch.bfloat16)


def _dense_rows(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Every fused kernel: non-empty sequences and head dims, unit stride along the head dim."""
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[3] == 0 or v.shape[3] == 0:
        return False
    return all(t.stride(-1) == 1 for t in (q, k, v))


def _flash_takes(q: Tensor, k: Tensor, v: Tensor, has_mask: bool, is_causal: bool, grad: bool,
                 sm: int) -> bool:
    """torch's can_use_flash_attention, conservatively, from what is known when tracing."""
    d = q.shape[3]
    if has_mask or q.dtype not in _HALF or not 80 <= sm <= 121:
        return False
    if v.shape[3] != d or d > 256:
        return False
    if grad and (86 <= sm <= 89 or 120 <= sm <= 121) and d > 192:
        return False  # flash's backward on these parts refuses head dims in (192, 256]
    return not (is_causal and q.shape[2] != k.shape[2])  # flash's causal is lower-right aligned


def _efficient_takes(q: Tensor, v: Tensor, sm: int) -> bool:
    """torch's can_use_mem_efficient_attention, conservatively."""
    if not 50 <= sm <= 121:
        return False
    if q.dtype not in ((torch.float16, torch.float32, torch.bfloat16) if sm >= 80
                       else (torch.float16, torch.float32)):
        return False
    align = 8 if q.dtype in _HALF else 4  # its GEMMs' alignment (elements) on tensor cores
    return q.shape[3] % align == 0 and v.shape[3] % align == 0


def _cudnn_takes(q: Tensor, k: Tensor, v: Tensor, p: float, st: _CudaState) -> bool:
    """torch 2.11's can_use_cudnn_attention, conservatively (head dims <= 128 everywhere)."""
    if q.dtype not in _HALF or not 80 <= st.sm <= 121 or st.deterministic:
        return False
    if st.cudnn_version < 90000 or (p > 0.0 and 91100 < st.cudnn_version < 91400):
        return False  # cuDNN 9.11-9.13 has no sdpa dropout
    d_qk, d_v = q.shape[3], v.shape[3]
    if d_qk > 128 or d_v > 128 or d_qk % 8 or d_v % 8:
        return False
    return k.shape[2] != 1 and not (p > 0.0 and q.shape[2] == 1)


def _cudnn_allowed(has_mask: bool, p: float) -> bool:
    """Our policy, whatever cuDNN would accept: no mask (pytorch issue 196678: NaN grad_q with a
    mask when s % 128 == 64 and a row's log-sum-exp is below -88.7) and a dropout rate cuDNN can
    represent (its rate has 1/16 resolution; torch 2.11 does not check, so p = 0.1 would run as
    another rate)."""
    return not has_mask and float(p) * 16.0 == math.floor(float(p) * 16.0)


def _fused_backends(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], p: float, is_causal: bool,
                    grad: bool, st: _CudaState) -> list:
    """The fused sdpa backends to offer, in priority order: flash, efficient, cuDNN, each only when
    the user left it enabled and it takes the call. Empty: no fused kernel for this call."""
    from torch.nn.attention import SDPBackend

    if not _dense_rows(q, k, v):
        return []
    has_mask = mask is not None
    offered = []
    if st.flash and _flash_takes(q, k, v, has_mask, is_causal, grad, st.sm):
        offered.append(SDPBackend.FLASH_ATTENTION)
    if st.efficient and _efficient_takes(q, v, st.sm):
        offered.append(SDPBackend.EFFICIENT_ATTENTION)
    if st.cudnn and _cudnn_allowed(has_mask, p) and _cudnn_takes(q, k, v, p, st):
        offered.append(SDPBackend.CUDNN_ATTENTION)
    return offered


# Additive mask entries at or below this are -inf for the fused kernels (see _fused_mask).
FUSED_MASK_FLOOR = -32768.0


def _fused_mask(mask: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
    """The mask as the fused kernels take it: bool, or a bias of q's dtype, unit stride along the
    keys, with entries <= FUSED_MASK_FLOOR made -inf.

    Why the floor: the fused kernels keep one fp32 log-sum-exp per row, lse = m + log l, and
    backward recomputes P = exp(S - lse). In a row whose every key carries a finfo.min bias, m is
    about -3.4e38 and absorbs log l (and the efficient kernel's log2 scaling overflows it to -inf):
    the forward gives eager's uniform row but the backward takes P = 1 instead of 1/s_k. As -inf
    such a row is fully masked: output 0, gradient 0, like a bool mask. Any other row is
    unchanged: an entry <= -32768 contributes exp(-32768 + (its score - the row's max)) = 0 in
    fp32 unless that key's unmasked score exceeds every attended key's by more than 32,000. The
    floating mask is copied once for this (sdpa keeps that copy for backward).
    """
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        if mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        mask = mask.masked_fill(mask <= FUSED_MASK_FLOOR, float("-inf"))
    if mask.shape[-1] > 1 and mask.stride(-1) != 1:
        mask = mask.contiguous()
    return mask


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], p: float, is_causal: bool,
          scale: float, backends: list, enable_gqa: bool = False) -> Tensor:
    """sdpa with exactly ``backends`` enabled, in that priority order; the caller's switches and
    priority order are as they were afterwards."""
    from torch.nn.attention import sdpa_kernel

    gqa = {"enable_gqa": True} if enable_gqa else {}
    if torch.compiler.is_compiling():
        # Dynamo traces sdpa_kernel itself: the graph enables these backends around the call.
        with sdpa_kernel(backends, set_priority=True):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal, scale=scale, **gqa)
    # sdpa_kernel(set_priority=True) restores the enabled backends but not the priority of the
    # disabled ones (they come back after ours): put the caller's exact order back.
    saved = torch._C._get_sdp_priority_order()
    try:
        with sdpa_kernel(backends, set_priority=True):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal, scale=scale, **gqa)
    finally:
        torch._C._set_sdp_priority_order(saved)


def _grouped_for_fused(q: Tensor, k: Tensor, v: Tensor, backends: list) -> tuple[Tensor, Tensor, list, bool]:
    """Grouped-query k, v for the fused kernels: (k, v, backends, enable_gqa). torch's flash kernel
    takes fewer kv heads as they are (sdp_utils' ``check_batch_size_and_num_heads_dense<true>``; its
    backward sums dk, dv over each group itself) and keeps them so: only flash is offered then. The
    efficient kernel checks equal heads (``<false>``), and cuDNN's acceptance of grouped heads is not
    offered here (not verified on a GPU): without flash (fp32, flash off; a mask expanded them before)
    k and v are expanded to the query heads, as transformers' ``repeat_kv``, and the kernel keeps the
    copies, logged once."""
    from torch.nn.attention import SDPBackend

    if SDPBackend.FLASH_ATTENTION in backends:
        return k, v, [SDPBackend.FLASH_ATTENTION], True
    _log_expanded_once()
    heads = q.shape[1]
    return expand_kv_heads(k, heads), expand_kv_heads(v, heads), backends, False


_expanded_logged = False


@torch.compiler.assume_constant_result
def _log_expanded_once() -> bool:
    global _expanded_logged
    if not _expanded_logged:
        _expanded_logged = True
        logger.info("%s: grouped-query attention beside a mask, or where flash does not take the call (fp32, "
                    "flash off): k and v are expanded to the query heads and the expanded copies are kept (as "
                    "stock sdpa after repeat_kv; torch's efficient kernel has no grouped heads)", _OP)
    return True


@torch.compiler.assume_constant_result
def _log_fallback_once(reason: str) -> None:
    """Log once per process that ``reason`` runs the reference op. Marked constant so that under
    torch.compile it runs (and logs) when the call is traced, instead of breaking the graph."""
    if reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        logger.warning("%s: %s; running Tempo's tiled reference attention instead (same O(s) memory, "
                       "slower)", _OP, reason)


def _no_fused_reason(q: Tensor, v: Tensor, mask: Optional[Tensor], p: float, is_causal: bool,
                     st: _CudaState) -> str:
    mask_kind = "none" if mask is None else f"{mask.dtype} {tuple(mask.shape)}"
    enabled = [name for name, on in (("flash", st.flash), ("efficient", st.efficient),
                                     ("cudnn", st.cudnn)) if on]
    return (f"no fused sdpa kernel takes q {q.dtype} head_dim {q.shape[-1]}, v head_dim {v.shape[-1]}, "
            f"mask {mask_kind}, dropout {p}, causal {is_causal} on sm{st.sm} "
            f"with the fused backends enabled: {', '.join(enabled) or 'none'}")


# ----------------------------------------------------------------------------------------------
# Public functional and module.
# ----------------------------------------------------------------------------------------------
class MixedDtypeError(TypeError, RuntimeError):
    """q, k, v of different dtypes where sdpa refuses them too (outside autocast, or an fp64 one
    under it). A TypeError like every Tempo dtype error, and the RuntimeError sdpa raises, so code
    catching sdpa's error catches this one."""


def autocast_like_sdpa(*tensors: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    """``tensors`` as ``scaled_dot_product_attention`` receives them under the autocast active on
    their device, else unchanged. sdpa is on autocast's lower-precision list for CUDA and CPU
    (aten/src/ATen/autocast_mode.{h,cpp}: ``scaled_dot_product_attention, lower_precision_fp``, the
    same in torch 2.11 and 2.13): ``cached_cast`` turns every floating-point tensor argument that is
    on the autocast's device and not fp64 (q, k, v and a float attn_mask; a bool mask is no float)
    into the autocast dtype; fp64 ones and tensors of another device stay as they are. So RoPE's
    fp32 q and k meet a bf16 v in bf16, and an fp64 q beside fp32 k, v is a dtype error there too.
    The casts are differentiable (a gradient returns in the caller's dtype)."""
    if not tensors or not isinstance(tensors[0], Tensor):
        return tensors
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if (isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
                                 and t.device.type == device_type and t.dtype != dtype) else t
                 for t in tensors)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, op: str, layout: str) -> None:
    """Float tensors of len(layout's dims) dims and one dtype (both attention ops), checked after
    ``autocast_like_sdpa``: what sdpa accepts, this accepts."""
    dims = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(t, name, op)
        if t.dim() != dims:
            raise ValueError(f"{op}: argument '{name}' must be {dims}-D ({layout}), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        where = ("under torch.autocast only fp64 tensors keep their dtype, as in sdpa"
                 if torch.is_autocast_enabled(q.device.type) else
                 "scaled_dot_product_attention refuses them too outside torch.autocast; under autocast "
                 "every non-fp64 one is cast to the autocast dtype")
        raise MixedDtypeError(f"{op}: arguments 'q', 'k', 'v' must have the same dtype, got "
                              f"{q.dtype}, {k.dtype}, {v.dtype} ({where})")


def _check_bias(attn_bias: Tensor, q: Tensor, k: Tensor, is_causal: bool) -> None:
    if not isinstance(attn_bias, Tensor) or not attn_bias.is_floating_point():
        got = attn_bias.dtype if isinstance(attn_bias, Tensor) else type(attn_bias).__name__
        raise TypeError(f"{_OP}: argument 'attn_bias' must be a floating-point torch.Tensor or None, got {got}")
    if is_causal:
        raise ValueError(f"{_OP}: arguments 'attn_bias' and 'is_causal' cannot both be set; fold the causal "
                         f"mask into attn_bias")
    _check_broadcasts_to_scores("attn_bias", attn_bias, q, k)


def _check_broadcasts_to_scores(name: str, tensor: Tensor, q: Tensor, k: Tensor) -> None:
    """``tensor`` (a mask or a bias) is on q's device and broadcasts to the scores' shape."""
    if tensor.device != q.device:
        raise ValueError(f"{_OP}: argument '{name}' must be on {q.device}, got {tensor.device}")
    scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    ok = tensor.dim() <= 4
    if ok:
        try:
            ok = tuple(torch.broadcast_shapes(tuple(tensor.shape), scores)) == scores
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(f"{_OP}: argument '{name}' of shape {tuple(tensor.shape)} does not broadcast "
                         f"to the scores' shape (batch, heads, s_q, s_k) = {scores}")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                  enable_gqa: bool = False) -> None:
    _check_qkv(q, k, v, _OP, "batch, heads, seq, head_dim")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{_OP}: arguments 'q', 'k', 'v' must be on the same device, got "
                         f"{q.device}, {k.device}, {v.device}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"{_OP}: argument 'enable_gqa' must be a bool, got {type(enable_gqa).__name__}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"{_OP}: arguments 'q', 'k', 'v' must have the same batch size (dim 0), "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if enable_gqa:  # sdpa's rule: k and v share a head count that divides q's
        if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ValueError(f"{_OP}: with enable_gqa=True, 'k' and 'v' must have the same number of heads "
                             f"(dim 1), dividing the number of 'q' heads, got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    elif not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"{_OP}: arguments 'q', 'k', 'v' must have the same heads size (dim 1), "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (grouped-query "
                         f"attention: pass enable_gqa=True)")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{_OP}: arguments 'q' and 'k' must have the same head dim, got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{_OP}: arguments 'k' and 'v' must have the same sequence length, got "
                         f"k {tuple(k.shape)} and v {tuple(v.shape)}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"{_OP}: argument 'is_causal' must be a bool, got {type(is_causal).__name__}")
    if attn_mask is None:
        return
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"{_OP}: argument 'attn_mask' must be a torch.Tensor or None, "
                        f"got {type(attn_mask).__name__}")
    if is_causal:
        raise ValueError(f"{_OP}: arguments 'attn_mask' and 'is_causal' cannot both be set "
                         f"(as in scaled_dot_product_attention); fold the causal mask into attn_mask")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"{_OP}: argument 'attn_mask' must be bool (True = attend) or floating point "
                        f"(added to the scores), got {attn_mask.dtype}")
    _check_broadcasts_to_scores("attn_mask", attn_mask, q, k)


def efficient_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                        dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                        training: bool = True, *, seed: Optional[Tensor] = None,
                        attn_bias: Optional[Tensor] = None, enable_gqa: bool = False) -> Tensor:
    """``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p if training else 0, is_causal,
    scale, enable_gqa=enable_gqa)`` keeping O(s) per query row for backward (see the module docstring).

    Returns (b, h, s_q, d_v), stored as (b, s_q, h, d_v) when it keeps anything for backward.
    Pass ``training=self.training``. ``seed`` (0-d integer tensor, reference path only) fixes the
    dropout mask; by default one is drawn from torch's RNG. Without a backward in eval mode
    (``training=False``) the stock sdpa runs and keeps nothing (see "Paths"); in training mode the
    backward's path runs, keeping nothing under no_grad.

    ``attn_bias``: a second additive term, scores = scale·q·kᵀ + attn_bias + attn_mask, for a
    learned bias shared by the batch (MPNet's relative positions: [1, heads, s_q, s_k]) beside a
    per-sample padding mask: added as one sdpa mask they would make (b, h, s_q, s_k), which sdpa
    keeps for backward. Float, broadcasting to the scores, may require grad (its gradient is the
    scores' gradient summed over its broadcast dims). Not cast under autocast (it is no sdpa
    argument; it is added in the op's fp32 compute, so a learned bias keeps its precision). See
    "CUDA dispatch" for which kernel takes it.

    ``enable_gqa`` (sdpa's): k and v may have fewer heads than q, a divisor of them (grouped-query
    attention: kv head j serves query heads j·g .. j·g + g − 1). Without a mask or bias they are
    kept at their own heads: the reference op shares each kv head inside its tiles and sums the
    gradient back; on CUDA the flash kernel takes them as they are. With a mask or bias, or in fp32
    or fp64, they are expanded first, as transformers' ``repeat_kv`` does, on every device, and the
    expanded copies are kept: on CUDA only the efficient kernel takes such a call with a backward and
    it has no grouped heads, and the CPU path (what ``tempo.plan`` traces) keeps what CUDA keeps. On
    CUDA also where flash refuses a 16-bit call without a mask (flash switched off, head dims it
    refuses): there the CPU path keeps less than CUDA. Logged once.
    """
    if attn_bias is not None:
        # The bias is checked before autocast so that a bad one is named as the caller passed it.
        for name, t in (("q", q), ("k", k)):
            check_float_tensor(t, name, _OP)
        _check_bias(attn_bias, q, k, is_causal)
    # sdpa's autocast policy first (mixed q, k, v under autocast are sdpa's normal case: RoPE).
    q, k, v, attn_mask = autocast_like_sdpa(q, k, v, attn_mask)
    _check_inputs(q, k, v, attn_mask, is_causal, enable_gqa)
    p = check_probability(dropout_p, "dropout_p", _OP)
    if not training:
        p = 0.0
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{_OP}: argument 'scale' must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if seed is not None and (not isinstance(seed, Tensor) or seed.is_floating_point()
                             or seed.is_complex() or seed.numel() != 1):
        raise TypeError(f"{_OP}: argument 'seed' must be a one-element integer tensor")

    if k.shape[1] != q.shape[1] and (attn_mask is not None or attn_bias is not None or q.dtype not in _HALF):
        # Grouped kv heads beside a mask, or not 16-bit (flash takes neither): expanded on every path,
        # kept so (see the docstring).
        _log_expanded_once()
        k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
    # requires_grad survives the autocast casts. Training mode takes the backward's path even
    # without one: a replayed forward computes the same bits and draws the same mask.
    grad = runs_own_forward(training, q, k, v, attn_mask, attn_bias)
    seeded = seed is not None and p > 0.0  # a mask fixed by seed: only the reference op draws it

    if not grad and not seeded:  # nothing kept: k and v at the query heads, a transient
        out = _stock_attention(q, expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1]),
                               _merged_mask(attn_mask, attn_bias), p, is_causal, scale)
        if out is not None:
            return out
    elif _is_cuda(q) and requested_backend() != "reference":
        st = _cuda_state(str(q.device))
        if attn_bias is not None and _bias_takes_reference(attn_bias, attn_mask, p):
            _log_fallback_once("an attn_bias with dropout on, that requires grad, or beside an attn_mask runs the "
                               "reference op (the float-mask rule below; and sdpa would keep the merged "
                               "(batch, heads, s_q, s_k) mask for backward)")
        elif _float_mask_takes_reference(attn_mask, p):
            _log_fallback_once("a float attn_mask with dropout on, or one that requires grad, runs the reference op "
                               "(one rule for every pass: a no-grad replay sees the same learned bias without "
                               "requires_grad and must draw the same dropout mask; the fused efficient kernel's "
                               "mask gradient is broken on torch 2.11: pytorch issue 148476)")
        else:
            mask = attn_mask if attn_bias is None else attn_bias  # here a bias comes alone
            backends = _fused_backends(q, k, v, mask, p, is_causal, True, st)
            if backends:
                if seeded:
                    raise ValueError(f"{_OP}: argument 'seed' applies to the reference path only; on CUDA "
                                     f"the fused sdpa kernels draw dropout from torch's CUDA RNG "
                                     f"(use use_backend('reference') to fix the mask by seed)")
                gqa = k.shape[1] != q.shape[1]
                if gqa:
                    k, v, backends, gqa = _grouped_for_fused(q, k, v, backends)
                return _sdpa(q, k, v, _fused_mask(mask, q), p, is_causal, scale, backends, gqa)
            _log_fallback_once(_no_fused_reason(q, v, mask, p, is_causal, st))

    seed = _resolve_seed(seed, p, q.device)
    out, _ = _attention_fwd_op(q, k, v, attn_mask, seed, p, is_causal, scale, attn_bias)
    return out


def _bias_takes_reference(bias: Tensor, mask: Optional[Tensor], p: float) -> bool:
    """An attn_bias runs the reference op with a backward whenever a float mask would (dropout on,
    or it requires grad: ``_float_mask_takes_reference``), and beside any attn_mask: sdpa takes one
    mask, and the merged bias + padding would be (b, h, s_q, s_k), kept by sdpa for backward. A
    frozen bias alone without dropout is the fused kernels' mask (kept as given: batch-shared)."""
    return _float_mask_takes_reference(bias, p) or mask is not None


def _merged_mask(mask: Optional[Tensor], bias: Optional[Tensor]) -> Optional[Tensor]:
    """attn_mask and attn_bias as the one mask stock sdpa takes (no backward: a transient of the
    broadcast shape, as the stock model's own scores + bias + mask)."""
    if bias is None:
        return mask
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, torch.full((), float("-inf"), dtype=bias.dtype, device=bias.device))
    return bias + mask


def _float_mask_takes_reference(mask: Optional[Tensor], p: float) -> bool:
    """A float (additive) mask runs the reference op whenever dropout is on or it requires grad
    (module docstring, "CUDA dispatch"). With dropout the choice must not depend on requires_grad:
    a learned bias computed under ``no_grad`` (GradCache's first pass, reentrant checkpointing) does
    not require grad, and the replay with grad would draw its dropout mask from another op. With
    dropout off nothing is drawn and the two paths agree to rounding, so a bias that needs no
    gradient keeps the fused kernel."""
    return mask is not None and mask.dtype != torch.bool and (p > 0.0 or mask.requires_grad)


def _stock_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], p: float, is_causal: bool,
                     scale: float) -> Optional[Tensor]:
    """No backward will run: nothing to keep, so the stock sdpa, same semantics (fully masked
    rows give 0 in sdpa too). On CUDA the same fused backends as with a backward (same cuDNN
    rules), plus the math one when the user left it on (it materialises the scores, but only
    for the length of this call). None when nothing may run (the caller runs the reference op)."""
    if _is_cuda(q):
        from torch.nn.attention import SDPBackend

        st = _cuda_state(str(q.device))
        backends = _fused_backends(q, k, v, mask, p, is_causal, False, st)
        if st.math:
            backends.append(SDPBackend.MATH)
        if not backends:
            _log_fallback_once(_no_fused_reason(q, v, mask, p, is_causal, st) + " and math is disabled")
            return None
        return _sdpa(q, k, v, _fused_mask(mask, q), p, is_causal, scale, backends)
    # q, k, v and a float mask are already as sdpa's autocast makes them (autocast_like_sdpa); a
    # bias merged into the mask keeps its dtype (fp32 or q's: what sdpa takes).
    with torch.autocast(q.device.type, enabled=False):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal, scale=scale)


# ----------------------------------------------------------------------------------------------
# Variable-length attention: the T real tokens of B packed sequences (issue 19, unpadding).
# ----------------------------------------------------------------------------------------------
_VAR_OP = "efficient_attention_varlen"


def _sequence_seed(seed: int, index: int) -> int:
    """The dropout seed of sequence ``index``: a splitmix64 mix, so sequences draw independent
    streams (63 bits: it becomes a 0-d int64 tensor)."""
    return _tile_seed(seed ^ 0x5EED5EED5EED5EED, index, 1 << 20) & ((1 << 63) - 1)


class SequenceFacts(NamedTuple):
    """What the host knows of a ``cu_seqlens`` tensor: its offsets and the shortest and longest
    sequence (the nested tensors' ``min_seqlen``/``max_seqlen``; flash and efficient refuse an
    empty sequence)."""

    offsets: tuple[int, ...]
    min_seqlen: int
    max_seqlen: int

    @classmethod
    def of(cls, offsets: Sequence[int]) -> "SequenceFacts":
        offsets = tuple(int(o) for o in offsets)
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        return cls(offsets, min(lengths, default=0), max(lengths, default=0))


# Per cu_seqlens tensor object: (weak reference, (version, data pointer) it was read at, facts, the
# int64 offsets the nested tensors take). Few live at once (a batch's), so a small dict.
_sequence_facts: dict[int, tuple] = {}
_facts_lock = threading.Lock()


def _facts_state(cu_seqlens: Tensor) -> tuple[int, int]:
    return cu_seqlens._version, cu_seqlens.data_ptr()


def remember_sequences(cu_seqlens: Tensor, offsets: Sequence[int]) -> SequenceFacts:
    """Record that ``cu_seqlens`` holds ``offsets`` (host ints its maker already has, e.g.
    ``TokenLayout``), so the attention ops never read it back from the device. Returns the facts."""
    facts = SequenceFacts.of(offsets)
    with _facts_lock:
        for key, entry in list(_sequence_facts.items()):
            if entry[0]() is None:
                del _sequence_facts[key]
        _sequence_facts[id(cu_seqlens)] = (weakref.ref(cu_seqlens), _facts_state(cu_seqlens), facts, {})
    return facts


def _cached_facts(cu_seqlens: Tensor) -> Optional[tuple]:
    with _facts_lock:
        entry = _sequence_facts.get(id(cu_seqlens))
    if entry is not None and entry[0]() is cu_seqlens and entry[1] == _facts_state(cu_seqlens):
        return entry
    return None


def sequence_facts(cu_seqlens: Tensor) -> SequenceFacts:
    """The offsets, shortest and longest sequence of ``cu_seqlens``: remembered (no host read), or
    read once for this tensor object and version (one host read) and remembered."""
    entry = _cached_facts(cu_seqlens)
    if entry is not None:
        return entry[2]
    return remember_sequences(cu_seqlens, cu_seqlens.tolist())


def _nested_offsets(cu_seqlens: Tensor) -> Tensor:
    """cu_seqlens as the int64 offsets nested tensors take, made once per cu_seqlens object (every
    layer of a forward gets the same tensor: one conversion, and one ragged size for all of them)."""
    entry = _cached_facts(cu_seqlens)
    if entry is None:
        return cu_seqlens.to(torch.int64)
    made = entry[3]
    if "offsets" not in made:
        made["offsets"] = cu_seqlens.to(torch.int64)
    return made["offsets"]


def _bounds(cu_seqlens: Tensor) -> list[tuple[int, int, int]]:
    """(index, start, end) of each non-empty sequence (host offsets: ``sequence_facts``)."""
    offsets = sequence_facts(cu_seqlens).offsets
    return [(i, a, b) for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])) if b > a]


def _as_sequence(x: Tensor, a: int, b: int) -> Tensor:
    return x[a:b].transpose(0, 1).unsqueeze(0)  # [L, H, D] rows of one sequence -> [1, H, L, D]


def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, seed: Tensor, p: float,
                    is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    t, h, _ = q.shape
    out = q.new_zeros((t, h, v.shape[2]))
    stats = torch.zeros((t, h, 2), dtype=_stats_dtype(q.dtype), device=q.device)
    seed_int = int(seed.item()) if p > 0.0 else 0
    for i, a, b in _bounds(cu_seqlens):
        s_seed = torch.tensor(_sequence_seed(seed_int, i), dtype=torch.int64)
        o, st = _reference_forward(_as_sequence(q, a, b), _as_sequence(k, a, b), _as_sequence(v, a, b),
                                   None, s_seed, p, is_causal, scale)
        out[a:b] = o[0].transpose(0, 1)
        stats[a:b] = st[0].transpose(0, 1)
    return out, stats


def _varlen_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor,
                     cu_seqlens: Tensor, seed: Tensor, p: float, is_causal: bool,
                     scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    seed_int = int(seed.item()) if p > 0.0 else 0
    for i, a, b in _bounds(cu_seqlens):
        s_seed = torch.tensor(_sequence_seed(seed_int, i), dtype=torch.int64)
        gq, gk, gv, _, _ = _reference_backward(
            _as_sequence(grad_out, a, b), _as_sequence(q, a, b), _as_sequence(k, a, b), _as_sequence(v, a, b),
            _as_sequence(out, a, b), _as_sequence(stats, a, b), None, s_seed, p, is_causal, scale, False)
        dq[a:b], dk[a:b], dv[a:b] = gq[0].transpose(0, 1), gk[0].transpose(0, 1), gv[0].transpose(0, 1)
    return dq, dk, dv


@torch.library.custom_op("tempo::efficient_attention_varlen_fwd", mutates_args=())
def _varlen_fwd_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, seed: Tensor, dropout_p: float,
                   is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    with torch.autocast(q.device.type, enabled=False):
        return _varlen_forward(q, k, v, cu_seqlens, seed, dropout_p, is_causal, scale)


@_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens, seed, dropout_p, is_causal, scale):
    t, h, _ = q.shape
    return q.new_empty((t, h, v.shape[2])), q.new_empty((t, h, 2), dtype=_stats_dtype(q.dtype))


@torch.library.custom_op("tempo::efficient_attention_varlen_bwd", mutates_args=())
def _varlen_bwd_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor,
                   cu_seqlens: Tensor, seed: Tensor, dropout_p: float, is_causal: bool,
                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    with torch.autocast(q.device.type, enabled=False):
        return _varlen_backward(grad_out, q, k, v, out, stats, cu_seqlens, seed, dropout_p, is_causal, scale)


@_varlen_bwd_op.register_fake
def _(grad_out, q, k, v, out, stats, cu_seqlens, seed, dropout_p, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, seed, dropout_p, is_causal, scale = inputs
    out, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, stats, cu_seqlens, seed)
    ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale


def _varlen_backward_rule(ctx, grad_out, grad_stats):
    q, k, v, out, stats, cu_seqlens, seed = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None, None, None
    dq, dk, dv = _varlen_bwd_op(grad_out, q, k, v, out, stats, cu_seqlens, seed, ctx.dropout_p, ctx.is_causal,
                                ctx.scale)
    return dq, dk, dv, None, None, None, None, None


_varlen_fwd_op.register_autograd(_varlen_backward_rule, setup_context=_varlen_setup_context)


def _check_varlen_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                         is_causal: bool) -> None:
    _check_qkv(q, k, v, _VAR_OP, "total_tokens, heads, head_dim")
    if not (q.device == k.device == v.device == cu_seqlens.device):
        raise ValueError(f"{_VAR_OP}: arguments 'q', 'k', 'v', 'cu_seqlens' must be on the same device, got "
                         f"{q.device}, {k.device}, {v.device}, {cu_seqlens.device}")
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2]) or q.shape[2] != k.shape[2]:
        raise ValueError(f"{_VAR_OP}: arguments 'q', 'k', 'v' must share (total_tokens, heads) and q, k the "
                         f"head dim, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if (not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
            or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{_VAR_OP}: argument 'cu_seqlens' must be an int32/int64 tensor [batch + 1], got "
                         f"{tuple(cu_seqlens.shape) if isinstance(cu_seqlens, Tensor) else type(cu_seqlens)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"{_VAR_OP}: argument 'max_seqlen' must be a non-negative int, got {max_seqlen!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"{_VAR_OP}: argument 'is_causal' must be a bool, got {type(is_causal).__name__}")


def efficient_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                               dropout_p: float = 0.0, training: bool = True, scale: Optional[float] = None,
                               is_causal: bool = False, *, seed: Optional[Tensor] = None,
                               min_seqlen: Optional[int] = None) -> Tensor:
    """Attention over packed sequences: ``q``, ``k``, ``v`` are [T, heads, head_dim] holding B
    sequences back to back (sequence b is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``, the layout of
    ``tempo.unpad.TokenLayout``); each token attends the tokens of its own sequence only, with no
    mask and no padding: Σ L_b² scores instead of B·L². ``is_causal``: token i of a sequence
    attends that sequence's tokens j <= i. Returns [T, heads, d_v].

    Keeps what ``efficient_attention`` keeps, per real token: q, k, v, the output, two fp32 row
    statistics per (token, head), a 0-d seed, plus the B + 1 offsets. Exactness as there (the
    same tiled arithmetic runs on each sequence; padded and unpadded batches agree to rounding
    with dropout off). Dropout draws one independent stream per sequence from ``seed`` (the keep
    masks differ from the padded op's, as every dropout layer's do once tokens move).

    Host reads: ``max_seqlen`` and ``min_seqlen`` (the longest and shortest sequence) are what the
    CUDA kernels need on the host besides the device offsets; given both (``TokenLayout`` has
    them), the CUDA path reads nothing from the device. ``min_seqlen`` None: taken from
    ``remember_sequences`` (``TokenLayout`` and the HF packing path record every cu_seqlens they
    make), else read once per cu_seqlens tensor and version (``sequence_facts``), not per layer.
    Under ``torch.compile(fullgraph=True)`` pass ``min_seqlen``: the cache lookup is not traced.

    Paths: without a backward (no_grad, frozen) in eval mode (in training mode the backward's path
    runs, so a replayed forward computes the same bits and draws the same mask) the stock sdpa runs
    on each sequence (CPU) or on nested jagged tensors (CUDA) and keeps nothing. CUDA with a
    backward: stock sdpa on nested jagged tensors, which runs the flash or efficient kernel with
    cu_seqlens, offered and intersected with the user's switches as in ``efficient_attention``. Nested
    tensors narrow the offer: flash only when q, k, v share a head dim that is a multiple of 8
    (torch pads it for dense inputs only, and refuses such nested inputs), neither kernel when a
    sequence is empty (torch refuses min_seqlen 0), never cuDNN, never math (it would keep L_b²
    scores, and torch's nested math splits per sequence with a host read each and refuses
    causal). What no fused kernel takes runs the reference op with a backward (logged once) and
    the stock dense sdpa on each sequence without one (causal included). Reference (CPU, backend
    "reference"): a custom op that runs ``efficient_attention``'s tiled forward and backward on each
    sequence (its offsets from ``sequence_facts``).
    """
    q, k, v = autocast_like_sdpa(q, k, v)  # as efficient_attention: sdpa's autocast policy, then the checks
    _check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen, is_causal)
    if min_seqlen is not None:
        if isinstance(min_seqlen, bool) or not isinstance(min_seqlen, int):
            raise TypeError(f"{_VAR_OP}: argument 'min_seqlen' must be None or an int, got {min_seqlen!r}")
        if not 0 <= min_seqlen <= max_seqlen:
            raise ValueError(f"{_VAR_OP}: argument 'min_seqlen' must be in [0, max_seqlen = {max_seqlen}], "
                             f"got {min_seqlen}")
    p = check_probability(dropout_p, "dropout_p", _VAR_OP)
    if not training:
        p = 0.0
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    scale = float(scale)
    grad = runs_own_forward(training, q, k, v)  # training: the backward's path, so a replay gives the same bits
    seeded = seed is not None and p > 0.0

    if _is_cuda(q) and not seeded and (not grad or requested_backend() != "reference"):
        st = _cuda_state(str(q.device))
        if min_seqlen is None:
            min_seqlen = sequence_facts(cu_seqlens).min_seqlen
        backends = _nested_backends(q, k, v, p, is_causal, grad, min_seqlen, st)
        if backends:
            offsets = _nested_offsets(cu_seqlens) if not torch.compiler.is_compiling() else cu_seqlens.to(torch.int64)
            nested = [torch.nested.nested_tensor_from_jagged(x, offsets=offsets, min_seqlen=min_seqlen,
                                                             max_seqlen=max_seqlen).transpose(1, 2)
                      for x in (q, k, v)]
            out = _sdpa(*nested, None, p, is_causal, scale, backends)
            return out.transpose(1, 2).values()
        if grad:
            _log_fallback_once(_no_fused_reason(*_dense_proxies(q, k, v)[::2], None, p, is_causal, st)
                               + f" (variable length, shortest sequence {min_seqlen})")
        else:
            out = _stock_per_sequence(q, k, v, cu_seqlens, is_causal, scale)
            if out is not None:
                return out
    elif not grad and not seeded:
        return _stock_per_sequence(q, k, v, cu_seqlens, is_causal, scale)

    seed = _resolve_seed(seed, p, q.device)
    out, _ = _varlen_fwd_op(q, k, v, cu_seqlens, seed, p, is_causal, scale)
    return out


def _dense_proxies(q: Tensor, k: Tensor, v: Tensor) -> list[Tensor]:
    """[T, H, D] -> [1, H, T, D] views: what the kernels see, for the dense acceptance rules."""
    return [x.unsqueeze(0).transpose(1, 2) for x in (q, k, v)]


def _nested_backends(q: Tensor, k: Tensor, v: Tensor, p: float, is_causal: bool, grad: bool, min_seqlen: int,
                     st: _CudaState) -> list:
    """The fused backends to offer for nested jagged q, k, v ([T, H, D] values): the dense offer
    narrowed to what torch's nested sdpa takes (see ``efficient_attention_varlen``)."""
    from torch.nn.attention import SDPBackend

    if min_seqlen == 0:
        return []  # torch/nested/_internal/sdpa.py: _check_for_seq_len_0_nested refuses flash and efficient
    d = q.shape[-1]
    flash_ok = d == k.shape[-1] == v.shape[-1] and d % 8 == 0  # _check_head_dim_size_flash_nested
    return [b for b in _fused_backends(*_dense_proxies(q, k, v), None, p, is_causal, grad, st)
            if b == SDPBackend.EFFICIENT_ATTENTION or (b == SDPBackend.FLASH_ATTENTION and flash_ok)]


def _stock_per_sequence(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, is_causal: bool,
                        scale: float) -> Optional[Tensor]:
    """No backward, no dropout: the stock dense sdpa on each sequence (on CUDA with the backends
    ``_stock_attention`` offers, math included); the offsets from ``sequence_facts``. None when
    no sdpa backend may run (CUDA, every one switched off: the caller runs the reference op)."""
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    for _, a, b in _bounds(cu_seqlens):
        o = _stock_attention(_as_sequence(q, a, b), _as_sequence(k, a, b), _as_sequence(v, a, b), None, 0.0,
                             is_causal, scale)
        if o is None:
            return None
        out[a:b] = o[0].transpose(0, 1)
    return out


class EfficientAttention(nn.Module):
    """``efficient_attention`` with the module's dropout probability and ``self.training``."""

    def __init__(self, dropout_p: float = 0.0, *, dropout: Optional[nn.Dropout] = None):
        super().__init__()
        self.dropout = held_dropout(dropout_p, dropout, "EfficientAttention")  # read at every forward

    dropout_p = held_dropout_rate("dropout_p", "EfficientAttention")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False, scale: Optional[float] = None) -> Tensor:
        return efficient_attention(q, k, v, attn_mask, float(self.dropout.p), is_causal, scale, self.dropout.training)

    def extra_repr(self) -> str:
        return f"dropout_p={self.dropout_p}"


__all__ = ["BLOCK_K", "BLOCK_Q", "FUSED_MASK_FLOOR", "EfficientAttention", "MixedDtypeError", "SequenceFacts",
           "attention_keep_mask", "autocast_like_sdpa", "draw_seed", "efficient_attention",
           "efficient_attention_varlen", "expand_kv_heads", "remember_sequences", "sequence_facts"]
