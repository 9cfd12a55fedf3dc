"""DeBERTa's disentangled self-attention as one op that keeps O(s) per row for backward.

What it computes (transformers' ``deberta_v2.DisentangledSelfAttention``, its core after the
projections). Per batch element b and head h, with q_i, k_j, v_j rows of head dim d and Kp
(pos_key), Qp (pos_query) rows of a [2·span, d] table per head, shared by the whole batch:

    S_ij = scale · ( q_i·k_j  +  [c2p] q_i·Kp[idx(i−j)]  +  [p2c] k_j·Qp[idx(i−j)] )
    idx(t) = clamp(bucket(t) + span, 0, 2·span − 1)
    bucket(t) = make_log_bucket_position(t, position_buckets, max_relative_positions) when both
                are > 0 (transformers' formula in the same torch float arithmetic), else t
    P = softmax_j(S) (masked below), dropout on P (kept × 1/(1−p)), out_i = Σ_j P_ij v_j

c2p runs when ``pos_key`` is given, p2c when ``pos_query`` is given. transformers computes p2c
as ``bmm(key, pos_query)`` gathered at clamp(−r(i, j) + span) and transposed; bucket() is odd
(sign · f(|t|)), so that is k_j·Qp[idx(i − j)]. The caller passes ``scale`` = 1/sqrt(d·f)
(f = 1 + number of position terms): the op does not know f. S is computed in fp32 (fp64 for fp64
inputs) as scale·((q·k + c2p) + p2c); transformers divides k by the scale first, so the two agree
to rounding, not bit for bit.

Padding mask ([B, S], bool or 0/1 integers, 1 = real token, or None): pair (i, j) is attended
iff m_i and m_j. transformers masks a padded row (m_i = 0) on every key with finfo.min, so its
softmax is uniform over all S keys: so here (its S_ij are taken as 0 on every key). Such a row
gives out_i = dropout(uniform)·v, no gradient to q_i nor to any k or position row from it; v gets
its share. A real row never attends a padded key (probability exactly 0).

What it keeps for backward: q, k, v, pos_key, pos_query (batch-independent), the output, two
numbers per (row, head) — the row max m and log l, l = Σ_j exp(S_ij − m) (fp32; fp64 for fp64
inputs), as ``tempo.ops.attention`` keeps them (one log-sum-exp would lose a row masked by
finfo.min; here padded rows are uniform, m = 0 and log l = log S) — the 0-d int64 seed, the caller's
[B, S] padding mask (or cu_seqlens) and the shared int32 index table. Never an S×S or S×2·span
tensor. Backward recomputes S tile by tile, P = exp((S − m) − log l), the dropout mask from the
seed, and FlashAttention-2's dS = P ∘ (dP − D), D = rowsum(dO·O).

Paths
  * Reference (the CPU, ``use_backend("reference")`` anywhere, fp64, head dims above
    ``MAX_TRITON_HEAD_DIM``): the ``tempo::disentangled_attention_fwd`` / ``_bwd`` custom ops
    (``..._varlen_fwd`` / ``_bwd`` for packed sequences, one sequence at a time), tiles of
    ``BLOCK_Q`` × ``BLOCK_K`` scores batched over (B, H) with an online softmax in fp32. Per tile:
    c2p as ``q_tile @ Kp_bandᵀ`` over the band of table rows the tile touches, then
    ``torch.gather`` with idx − base; p2c as ``k_tile @ Qp_bandᵀ`` gathered likewise. Backward folds
    each tile's dS into band columns with ``scatter_add_`` (deterministic on the CPU; on CUDA,
    where this is a fallback, scatter_add_ uses atomics) to get dq, dk, dKp, dQp. Temporaries are
    tile-sized (scores, a [B, H, BLOCK_Q, ≤ BLOCK_Q + BLOCK_K − 1] band product) plus O(s·d)
    fp32 copies of the inputs: never S×S. One host read of the index table per call.
  * Triton (CUDA; the CPU only through the interpreter with ``use_backend("triton")``): one
    forward kernel and two backward kernels, for the padded and the varlen form alike (token-major
    [tokens, H, D]; a sequence is a start row and a length: padded = B sequences of length S, plus
    the mask; varlen = cu_seqlens). Launched inside ``launch_on``; the backend is chosen by
    ``resolve_backend`` and recorded in the autograd ctx.
  * No backward (eval, no_grad, frozen) or no dropout: the same forward runs and autograd keeps
    nothing. With dropout the path never depends on ``requires_grad``, so a no-grad forward
    replayed with grad (GradCache, reentrant checkpointing) draws the same mask.

Triton design (the one chosen; ``_fwd_kernel``, ``_bwd_dq_kernel``, ``_bwd_dkdv_kernel``)
  * Tile a = query rows i0..i0+M, b = keys j0..j0+N: t = i − j = (i0 − j0) + (a − b), and
    u = a − b + N − 1 ∈ [0, M + N − 1). The kernel loads Kp_u = Kp[idx(i0 − j0 + u − N + 1)] as a
    [W, D] block (W = M + N rounded up to a power of two; rows u >= M + N − 1 masked) with one
    pointer per row, G' = q @ Kp_uᵀ ([M, W]) and c2p[a, b] = G'[a, a − b + N − 1] by ``tl.gather``
    along axis 1 (it exists, runs in the triton 3.6 and 3.9 interpreters and compiles for sm_80
    and sm_90a). p2c as H'ᵀ = k @ Qp_uᵀ ([N, W], so the [W, D] block is a B operand, split across
    warps, as in c2p), p2cᵀ[b, a] = H'ᵀ[b, a − b + N − 1] gathered along axis 1, transposed.
  * Forward: one program per (query tile, sequence·head), online softmax, stores out and (m, log l).
  * Backward, FlashAttention-2's dS with the mask regenerated; two kernels, no atomics:
    ``_bwd_dq_kernel`` writes D = rowsum(dO·O) of its rows, dq = scale·(dS @ k + shear1(dS) @ Kp_u)
    with shear1(dS)[a, u] = dS[a, a − u + N − 1], and the c2p position gradient;
    ``_bwd_dkdv_kernel`` (launched after it) reads D and writes dv, dk = scale·(dSᵀ @ q +
    shear0(dS)ᵀ @ Qp_u) with shear0(dS)ᵀ[b, u] = dS[u + b − N + 1, b], and the p2c position
    gradient. Several u map to one table row in the log-bucket region, so each tile folds them
    first with a 0/1 matrix Map[u, r] = [idx(u) − base = r] through ``tl.dot`` (exact weights,
    fp32 accumulation), then adds the band of rows base..base + W − 1 into a partial buffer the
    program owns: read-modify-write of its own rows, ``tl.debug_barrier()`` between tiles (bands of
    consecutive tiles overlap; the barrier orders the CTA's global stores before the next loads).
    Program (p, h, g) of a kernel walks the sequences g, g + groups, ... and in each its query (dq
    kernel) or key (dk/dv kernel) tiles p·tpp .. p·tpp + tpp − 1; its partial is
    [groups, programs, 2·span, H, D] fp32, summed over (groups, programs) by torch afterwards:
    deterministic, no fp32 atomics. ``backward_plan`` takes the fewest tiles per program whose two
    buffers fit ``PARTIAL_BUDGET_BYTES`` (64 MiB) with one group, then as many groups as still fit:
    at B = 32, S = 512, H = 16, D = 64, span = 256 (16-row tiles) 2 tiles per program, 1 group,
    2 × 32 MiB.
  * Precision. 16-bit inputs: every dot whose left operand is computed in fp32 (P for P @ V, dS,
    the folded bands) takes it as hi + lo, both in the input dtype (``_dot_split``: two tensor-core
    dots, ~16 significant bits, while the right operand is exact in its dtype), so the Triton path
    is as accurate as the reference's fp32 products (measured: outputs within one 16-bit ULP of
    fp64 beyond the reference's own error). fp32 inputs: every dot with input_precision "ieee"
    (never tf32; tf32x3 spilled registers at every tile size tried).
  * Dropout: ``tl.rand(key, (i << 15) + j)`` with key = seed + ((n·H + h) << 32) (n = batch element
    or sequence, i, j positions inside it): a unique Philox stream per (n, h) and counter per
    (i, j), the same bits in forward and backward whatever the tiles (the varlen op's sequence n
    draws the padded op's batch element n). The reference path draws a different mask for the
    same seed (one ``torch.rand`` per tile from a generator seeded with a hash of (seed, tile), as
    ``tempo.ops.attention``; varlen: one stream per sequence);
    ``disentangled_attention_keep_mask(..., backend=...)`` regenerates either.
  * Tiles: ``FWD_CONFIG`` / ``BWD_CONFIG`` (BLOCK_M, BLOCK_N, warps, stages) per dtype class, chosen
    with ``python -m tempo.ops.compile_check --ops disentangled_attention``: no register spills for
    sm_80 and sm_90a under triton 3.6 and 3.9 at D = 64 (290 launches each). The position terms are
    register-heavy: a 16-bit operand of K = D = 64 is replicated in every warp that needs it, and
    each tile holds [W, D] blocks of Kp/Qp and their gathers (content-only kernels: ~80-140
    registers; with positions up to ~250). So the backward with positions runs 16 × 16 tiles
    (W = 32) on 8 warps (fp32: 4 warps for the kernel without its own position gradient), the
    content-only backward 32 × 32 (16-bit) or 16 × 16 (fp32), the forward 32 × 32 (16-bit) or
    16 × 16 (fp32). Each backward program walks its (sequence, tile) pairs in one flat loop (a
    nested loop made ptxas keep a counter in local memory at some tile sizes). Compile-clean, not
    tuned for speed: no GPU was available to time them.
  * 16-bit operands are upcast to fp32 after loading when the kernels run in Triton's interpreter
    (``_UPCAST``; its bf16 dots return garbage), keeping every rounding the GPU does.

Limits: sequences of at most ``MAX_SEQ_LEN`` = 2^15 tokens (the dropout counter packs (i, j) in
30 bits); the Triton kernels take head dims up to ``MAX_TRITON_HEAD_DIM`` (DeBERTa's 64), others run
the reference path (logged once). On CUDA nothing reads cu_seqlens or an integer mask on the host:
a sequence longer than ``max_seqlen``, offsets not starting at 0 or not ending at the token count,
and mask values other than 0/1 (read as nonzero = real, as transformers' ``.bool()``) are the
caller's contract there; on the CPU they are refused.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from tempo.ops._backend import (
    TRITON_DTYPES,
    check_float_tensor,
    check_probability,
    launch_on,
    log_fallback_once,
    resolve_backend,
    triton_interpreting,
)
from tempo.ops._backend import tl, triton  # None without triton (reference path only)
from tempo.ops.attention import _blocks, _dropout_tile, _dv_and_dropped_dp, _sequence_seed, _uniform_tile, draw_seed


OP_NAME = "disentangled_attention"
_VAR_OP = "disentangled_attention_varlen"
MAX_SEQ_LEN = 1 << 15
MAX_TRITON_HEAD_DIM = 64
# Reference-path tiles. They fix the layout of the reference dropout stream (read at call time).
BLOCK_Q = 128
BLOCK_K = 128
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)

# Triton tiles per input dtype class ("16bit": fp16/bf16, "fp32"): (BLOCK_M, BLOCK_N, num_warps,
# num_stages); W = the next power of two >= BLOCK_M + BLOCK_N - 1. Chosen with the compile gate
# (no spills on sm_80 / sm_90a, triton 3.6 and 3.9); see the module docstring.
# The backward without position terms (content only) holds far fewer operands: its own tiles.
FWD_CONFIG = {"16bit": (32, 32, 8, 3), "fp32": (16, 16, 4, 2)}
BWD_CONFIG = {"16bit": (16, 16, 8, 1), "fp32": (16, 16, 8, 1),
              "16bit content": (32, 32, 4, 1), "fp32 content": (16, 16, 8, 1)}
# Warps of a backward kernel that has position terms but not its own position gradient (the dq
# kernel without c2p, the dk/dv kernel without p2c): lighter, so ptxas would trade its registers
# for occupancy with a few bytes of spills at 8 warps (fp32).
BWD_LIGHT_WARPS = {"16bit": 8, "fp32": 4}
# fp32 bytes the two backward partial buffers of the position gradients may take together.
PARTIAL_BUDGET_BYTES = 64 << 20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# The relative-position index table
# ----------------------------------------------------------------------------------------------
def _is_int(x: object) -> bool:
    # A SymInt too: a length torch.compile keeps symbolic (a packed batch's longest sequence), so that a
    # new value is not a new graph.
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _check_positions(span: object, position_buckets: object, max_relative_positions: object, op: str) -> None:
    for name, value in (("span", span), ("position_buckets", position_buckets),
                        ("max_relative_positions", max_relative_positions)):
        if not _is_int(value):
            raise TypeError(f"{op}: argument '{name}' must be an int, got {type(value).__name__}")
    if span < 1:
        raise ValueError(f"{op}: argument 'span' must be >= 1, got {span}")
    if position_buckets > 0 and max_relative_positions > 0:
        mid = position_buckets // 2
        if mid < 1 or max_relative_positions - 1 <= mid:
            raise ValueError(
                f"{op}: log buckets need position_buckets >= 2 and max_relative_positions - 1 > position_buckets // 2 "
                f"(else log((max_relative_positions - 1) / (position_buckets // 2)) is <= 0), got "
                f"position_buckets={position_buckets}, max_relative_positions={max_relative_positions}")
    expected = position_buckets if position_buckets > 0 else max_relative_positions
    if expected <= 0:
        raise ValueError(f"{op}: arguments 'position_buckets' and 'max_relative_positions' are both <= 0; pass the "
                         f"resolved values (transformers uses max_position_embeddings when max_relative_positions < 1)")
    if span != expected:
        which = "position_buckets" if position_buckets > 0 else "max_relative_positions"
        raise ValueError(f"{op}: argument 'span' ({span}) must equal {which} ({expected}), the table half-size "
                         f"transformers uses (pos_ebd_size)")


def _check_max_len(max_len: object, name: str, op: str) -> None:
    if not _is_int(max_len):
        raise TypeError(f"{op}: argument '{name}' must be an int, got {type(max_len).__name__}")
    if max_len < 0 or max_len > MAX_SEQ_LEN:
        raise ValueError(f"{op}: argument '{name}' must be in [0, {MAX_SEQ_LEN}] (MAX_SEQ_LEN: the dropout counter "
                         f"packs positions in 15 bits), got {max_len}")


def _log_bucket(relative_pos: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """transformers' make_log_bucket_position, operation for operation (same float arithmetic)."""
    sign = torch.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = torch.where((relative_pos < mid) & (relative_pos > -mid),
                          torch.tensor(mid - 1).type_as(relative_pos), torch.abs(relative_pos))
    log_pos = (torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1))
               + mid)
    return torch.where(abs_pos <= mid, relative_pos.type_as(log_pos), log_pos * sign)


_INDEX_CACHE: dict[tuple, Tensor] = {}


def relative_position_index(max_len: int, span: int, position_buckets: int, max_relative_positions: int,
                            device) -> Tensor:
    """int32 [2·max_len − 1]: entry t + max_len − 1 is idx(t) = clamp(bucket(t) + span, 0, 2·span − 1).

    bucket() is transformers' ``make_log_bucket_position`` evaluated with the same torch ops on
    ``device`` (log buckets when position_buckets > 0 and max_relative_positions > 0, else the
    identity), so bucket boundaries agree with transformers' bit for bit. Cached per (arguments,
    device); built with device ops only (no host sync), and not built again after the first call.
    """
    _check_positions(span, position_buckets, max_relative_positions, "relative_position_index")
    _check_max_len(max_len, "max_len", "relative_position_index")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    length = max_len if isinstance(max_len, torch.SymInt) else max(int(max_len), 1)
    key = (length, span, position_buckets, max_relative_positions, device)
    compiling = torch.compiler.is_compiling()
    if not compiling:
        hit = _INDEX_CACHE.get(key)
        if hit is not None:
            return hit
    t = torch.arange(-(length - 1), length, device=device, dtype=torch.long)
    if position_buckets > 0 and max_relative_positions > 0:
        t = _log_bucket(t, position_buckets, max_relative_positions).to(torch.long)
    index = torch.clamp(t + span, 0, 2 * span - 1).to(torch.int32)
    if not compiling:
        _INDEX_CACHE[key] = index
    return index


def _table_half(table: Tensor) -> int:
    """max_len of a table of 2·max_len − 1 entries: entry t + max_len − 1 is idx(t)."""
    return (table.numel() + 1) // 2


# ----------------------------------------------------------------------------------------------
# Reference path: tiles of scores batched over (B, H)
# ----------------------------------------------------------------------------------------------
class _Tables:
    """What every tile of one reference call shares: the inputs as [B, H, S, D] compute-dtype
    views, the position tables as [H, 2·span, D], the host copy of the index table and the mask."""

    def __init__(self, q, k, v, pos_key, pos_query, table, mask, scale):
        cdt = _compute_dtype(q.dtype)
        self.cdt = cdt
        self.q = q.to(cdt).transpose(1, 2)
        self.k = k.to(cdt).transpose(1, 2)
        self.v = v.to(cdt).transpose(1, 2)
        self.kp = pos_key.to(cdt).transpose(0, 1) if pos_key is not None else None
        self.qp = pos_query.to(cdt).transpose(0, 1) if pos_query is not None else None
        self.table = table.to("cpu", torch.int64)  # one host read: this is the CPU / fallback path
        self.half = _table_half(table) - 1
        self.real = (mask != 0) if mask is not None else None
        self.scale = scale
        self.device = q.device

    def band(self, q0: int, q1: int, k0: int, k1: int) -> tuple[Tensor, int, int]:
        """(idx [M, N] − lo on the device, lo, hi): table rows lo..hi cover the tile."""
        i = torch.arange(q0, q1)[:, None]
        j = torch.arange(k0, k1)[None, :]
        idx = self.table[i - j + self.half]
        lo, hi = int(idx.min()), int(idx.max())
        return (idx - lo).to(self.device), lo, hi

    def scores(self, q0: int, q1: int, k0: int, k1: int) -> tuple[Tensor, Optional[tuple]]:
        """Masked scores of one tile [B, H, M, N] and the band (for backward)."""
        qt, kt = self.q[:, :, q0:q1], self.k[:, :, k0:k1]
        s = torch.matmul(qt, kt.transpose(-1, -2))
        band = None
        if self.kp is not None or self.qp is not None:
            rel, lo, hi = self.band(q0, q1, k0, k1)
            band = (rel, lo, hi)
            b, h, m, n = s.shape
            if self.kp is not None:
                g = torch.matmul(qt, self.kp[:, lo:hi + 1].transpose(-1, -2))  # [B, H, M, W]
                s += torch.gather(g, -1, rel.expand(b, h, m, n))
                del g
            if self.qp is not None:
                g = torch.matmul(kt, self.qp[:, lo:hi + 1].transpose(-1, -2))  # [B, H, N, W]
                s += torch.gather(g, -1, rel.transpose(0, 1).expand(b, h, n, m)).transpose(-1, -2)
                del g
        s.mul_(self.scale)
        if self.real is not None:
            rows = self.real[:, None, q0:q1, None]
            cols = self.real[:, None, None, k0:k1]
            s = torch.where(rows, s.masked_fill(~cols, float("-inf")), torch.zeros((), dtype=s.dtype, device=s.device))
        return s, band


def _reference_forward(q: Tensor, k: Tensor, v: Tensor, pos_key: Optional[Tensor], pos_query: Optional[Tensor],
                       table: Tensor, mask: Optional[Tensor], seed: int, p: float,
                       scale: float) -> tuple[Tensor, Tensor]:
    """q, k [B, S, H, D], v [B, S, H, Dv] -> (out [B, S, H, Dv], stats [B, S, H, 2] = (m, log l))."""
    bsz, s_len, heads, _ = q.shape
    d_v = v.shape[3]
    cdt = _compute_dtype(q.dtype)
    out = q.new_empty((bsz, s_len, heads, d_v))
    stats = torch.empty((bsz, s_len, heads, 2), dtype=cdt, device=q.device)
    if out.numel() == 0 and stats.numel() == 0:
        return out, stats
    tabs = _Tables(q, k, v, pos_key, pos_query, table, mask, scale)
    out_t, stats_t = out.transpose(1, 2), stats.transpose(1, 2)  # [B, H, S, *] views
    dropout = p > 0.0
    gen = torch.Generator(device=q.device) if dropout else None
    for qi, q0, q1 in _blocks(s_len, BLOCK_Q):
        m = l = acc = None
        for ki, k0, k1 in _blocks(s_len, BLOCK_K):
            s, _ = tabs.scores(q0, q1, k0, k1)
            m_tile = s.amax(dim=-1)
            m_new = m_tile if m is None else torch.maximum(m, m_tile)
            probs = s.sub_(m_new.unsqueeze(-1)).exp_()  # every row has a finite score in tile 0
            row_sum = probs.sum(dim=-1)
            if dropout:  # l sums the undropped probabilities; only the values are dropped
                probs.mul_(_dropout_tile(gen, seed, qi, ki, tuple(probs.shape), p, q.device, cdt))
            pv = torch.matmul(probs, tabs.v[:, :, k0:k1])
            if m is None:
                l, acc = row_sum, pv
            else:
                alpha = torch.exp(m - m_new)
                l = l.mul_(alpha).add_(row_sum)
                acc = acc.mul_(alpha.unsqueeze(-1)).add_(pv)
            m = m_new
            del s, probs
        out_t[:, :, q0:q1] = acc.div_(l.unsqueeze(-1))
        stats_t[:, :, q0:q1, 0] = m
        stats_t[:, :, q0:q1, 1] = torch.log(l)
    return out, stats


def _reference_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, pos_key: Optional[Tensor],
                        pos_query: Optional[Tensor], out: Tensor, stats: Tensor, table: Tensor,
                        mask: Optional[Tensor], seed: int, p: float, scale: float):
    """-> (dq, dk, dv, dKp, dQp) in the inputs' dtypes; dKp/dQp None when the table is absent."""
    s_len = q.shape[1]
    tabs = _Tables(q, k, v, pos_key, pos_query, table, mask, scale)
    cdt = tabs.cdt
    g = grad_out.to(cdt).transpose(1, 2)
    delta = (g * out.to(cdt).transpose(1, 2)).sum(dim=-1, keepdim=True)  # [B, H, S, 1]
    st = stats.to(cdt).transpose(1, 2)
    dq = torch.zeros_like(tabs.q)
    dk = torch.zeros_like(tabs.k)
    dv = torch.zeros_like(tabs.v)
    dkp = torch.zeros_like(tabs.kp) if tabs.kp is not None else None  # [H, 2·span, D]
    dqp = torch.zeros_like(tabs.qp) if tabs.qp is not None else None
    dropout = p > 0.0
    gen = torch.Generator(device=q.device) if dropout else None
    for qi, q0, q1 in _blocks(s_len, BLOCK_Q):
        qt, gt = tabs.q[:, :, q0:q1], g[:, :, q0:q1]
        m_t, log_l_t = st[:, :, q0:q1, 0:1], st[:, :, q0:q1, 1:2]
        delta_t = delta[:, :, q0:q1]
        real_rows = tabs.real[:, None, q0:q1, None] if tabs.real is not None else None
        for ki, k0, k1 in _blocks(s_len, BLOCK_K):
            s, band = tabs.scores(q0, q1, k0, k1)
            probs = s.sub_(m_t).sub_(log_l_t).exp_()
            vt, kt = tabs.v[:, :, k0:k1], tabs.k[:, :, k0:k1]
            dp = torch.matmul(gt, vt.transpose(-1, -2))
            z = _dropout_tile(gen, seed, qi, ki, tuple(probs.shape), p, q.device, cdt) if dropout else None
            _dv_and_dropped_dp(dv[:, :, k0:k1], probs, dp, gt, z)
            del z
            ds = dp.sub_(delta_t).mul_(probs)  # dS / scale
            del probs
            if real_rows is not None:  # a padded row's scores are constants: no gradient
                ds = ds.masked_fill_(~real_rows, 0.0)
            dq[:, :, q0:q1] += torch.matmul(ds, kt)
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qt)
            if band is not None:
                rel, lo, hi = band
                b, h, m, n = ds.shape
                width = hi - lo + 1
                if dkp is not None:  # c2p: dS folded into band columns, by row
                    dg = ds.new_zeros((b, h, m, width)).scatter_add_(-1, rel.expand(b, h, m, n), ds)
                    dq[:, :, q0:q1] += torch.matmul(dg, tabs.kp[:, lo:hi + 1])
                    dkp[:, lo:hi + 1] += torch.einsum("bhmw,bhmd->hwd", dg, qt)
                    del dg
                if dqp is not None:  # p2c: dSᵀ folded into band columns, by key
                    dst = ds.transpose(-1, -2)
                    dh = ds.new_zeros((b, h, n, width)).scatter_add_(-1, rel.transpose(0, 1).expand(b, h, n, m), dst)
                    dk[:, :, k0:k1] += torch.matmul(dh, tabs.qp[:, lo:hi + 1])
                    dqp[:, lo:hi + 1] += torch.einsum("bhnw,bhnd->hwd", dh, kt)
                    del dh
            del ds
    grads = [dq.mul_(scale).transpose(1, 2).to(q.dtype), dk.mul_(scale).transpose(1, 2).to(k.dtype),
             dv.transpose(1, 2).to(v.dtype)]
    grads.append(dkp.mul_(scale).transpose(0, 1).to(pos_key.dtype).contiguous() if dkp is not None else None)
    grads.append(dqp.mul_(scale).transpose(0, 1).to(pos_query.dtype).contiguous() if dqp is not None else None)
    return tuple(g.contiguous() if g is not None else None for g in grads)


def _bounds(cu_seqlens: Tensor) -> list[tuple[int, int, int]]:
    """(index, start, end) of each non-empty sequence; one host read (reference path only)."""
    offsets = [int(o) for o in cu_seqlens.tolist()]
    return [(i, a, b) for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])) if b > a]


def _sub_table(table: Tensor, length: int) -> Tensor:
    """The entries t ∈ (−length, length) of a table built for a longer max_len (a view)."""
    half = _table_half(table)
    return table[half - length: half + length - 1]


def _varlen_reference_forward(q, k, v, pos_key, pos_query, table, cu_seqlens, seed, p, scale):
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    stats = torch.zeros((q.shape[0], q.shape[1], 2), dtype=_compute_dtype(q.dtype), device=q.device)
    seed_int = int(seed.item()) if p > 0.0 else 0
    for n, a, b in _bounds(cu_seqlens):
        o, st = _reference_forward(q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), pos_key, pos_query,
                                   _sub_table(table, b - a), None, _sequence_seed(seed_int, n), p, scale)
        out[a:b], stats[a:b] = o[0], st[0]
    return out, stats


def _varlen_reference_backward(grad_out, q, k, v, pos_key, pos_query, out, stats, table, cu_seqlens, seed, p, scale):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dkp = torch.zeros_like(pos_key, dtype=_compute_dtype(q.dtype)) if pos_key is not None else None
    dqp = torch.zeros_like(pos_query, dtype=_compute_dtype(q.dtype)) if pos_query is not None else None
    seed_int = int(seed.item()) if p > 0.0 else 0
    for n, a, b in _bounds(cu_seqlens):
        gq, gk, gv, gkp, gqp = _reference_backward(
            grad_out[a:b].unsqueeze(0), q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0),
            pos_key.to(dkp.dtype) if pos_key is not None else None,
            pos_query.to(dqp.dtype) if pos_query is not None else None,
            out[a:b].unsqueeze(0), stats[a:b].unsqueeze(0), _sub_table(table, b - a), None,
            _sequence_seed(seed_int, n), p, scale)
        dq[a:b], dk[a:b], dv[a:b] = gq[0], gk[0], gv[0]
        if dkp is not None:
            dkp += gkp
        if dqp is not None:
            dqp += gqp
    return (dq, dk, dv, dkp.to(pos_key.dtype) if dkp is not None else None,
            dqp.to(pos_query.dtype) if dqp is not None else None)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if triton is not None:
    # Triton's interpreter has no bf16 arithmetic (its bf16 dots return garbage): there the kernels
    # upcast 16-bit operands to fp32 right after loading and after each rounding to the input
    # dtype (so the roundings the GPU does still happen). A module constant, not a launch
    # argument: the compile gate records launches under the interpreter and compiles them
    # without it, where this is False.
    _UPCAST = tl.constexpr(triton_interpreting())

    @triton.jit
    def _ld(ptr, mask):
        # A dot operand: the input dtype on a GPU (tensor cores), fp32 in the interpreter.
        x = tl.load(ptr, mask=mask, other=0.0)
        if _UPCAST:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _rnd(x, dtype: tl.constexpr):
        # x rounded to the input dtype for a tensor-core dot (fp32 inputs: unchanged).
        y = x.to(dtype)
        if _UPCAST:
            y = y.to(tl.float32)
        return y

    @triton.jit
    def _dot_split(a, b, acc, dtype: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr):
        # acc + a @ b for an fp32 ``a`` (probabilities, dS) and a ``b`` of the input dtype. 16-bit
        # inputs (SPLIT): a = hi + lo, both in the input dtype, two tensor-core dots: a is kept to
        # about 16 significant bits (b is exact in its dtype), so the products are as accurate as
        # the reference path's fp32 ones. fp32 inputs: one fp32 dot.
        if SPLIT:
            hi = _rnd(a, dtype)
            lo = _rnd(a - hi, dtype)
            acc = tl.dot(hi, b, acc, input_precision=DOT_PREC)
            acc = tl.dot(lo, b, acc, input_precision=DOT_PREC)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        return acc

    @triton.jit
    def _sequence(CU, n, L, VARLEN: tl.constexpr):
        # (first token row, length) of sequence n: cu_seqlens, or n·L for the padded layout.
        # int32 (B·S and T < 2^31); the kernels widen (start + i) to int64 before scaling by H·D.
        if VARLEN:
            start = tl.load(CU + n).to(tl.int32)
            length = tl.load(CU + n + 1).to(tl.int32) - start
        else:
            start = n * L
            length = L
        return start, length

    @triton.jit
    def _band_index(TABLE, L, i0, j0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
        # idx(t_u) for u in [0, W), t_u = i0 − j0 + u − (N − 1); rows u >= M + N − 1 masked.
        u = tl.arange(0, BLOCK_W)
        valid = u < BLOCK_M + BLOCK_N - 1
        pos = tl.minimum(tl.maximum(i0 - j0 + u - (BLOCK_N - 1) + L - 1, 0), 2 * L - 2)
        idx = tl.load(TABLE + pos, mask=valid, other=0)
        return idx, valid

    @triton.jit
    def _band_rows(P, idx, valid, h, H, D, BLOCK_D: tl.constexpr):
        # [W, BLOCK_D]: table row idx[u] of head h (zeros where u is masked or d >= D).
        d = tl.arange(0, BLOCK_D)
        return _ld(P + (idx[:, None] * H + h) * D + d[None, :], valid[:, None] & (d[None, :] < D))

    @triton.jit
    def _keep(key, i, j, p):
        # The dropout keep mask of positions (i, j) of one (sequence, head) stream: same bits in
        # every kernel whatever the tile.
        return tl.rand(key, (i[:, None] << 15) + j[None, :]) >= p

    @triton.jit
    def _scores(q, k, kp, qp, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, DOT_PREC: tl.constexpr):
        # scale·((q·kᵀ + c2p) + p2c) of one tile, fp32 [M, N], unmasked.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        a = tl.arange(0, BLOCK_M)[:, None]
        b = tl.arange(0, BLOCK_N)[None, :]
        shear = a - b + (BLOCK_N - 1)  # u of (a, b)
        if HAS_C2P:
            g = tl.dot(q, tl.trans(kp), input_precision=DOT_PREC)  # [M, W]
            s += tl.gather(g, shear, axis=1)
        if HAS_P2C:
            # H'ᵀ = k @ Qp_uᵀ ([N, W]: the [W, D] block stays a B operand, split across warps) and
            # p2cᵀ[b, a] = H'ᵀ[b, a − b + N − 1].
            g2 = tl.dot(k, tl.trans(qp), input_precision=DOT_PREC)
            s += tl.trans(tl.gather(g2, tl.trans(shear), axis=1))
        return s * scale

    @triton.jit
    def _mask_scores(s, row_ok, col_ok, row_real, col_real, HAS_MASK: tl.constexpr):
        # Keys past the sequence: -inf. With a padding mask: a padded row is 0 on every key of the
        # sequence (uniform, as finfo.min everywhere), a real row -inf on padded keys.
        if HAS_MASK:
            s = tl.where(row_real[:, None], tl.where(col_real[None, :], s, float("-inf")), 0.0)
        return tl.where(col_ok[None, :], s, float("-inf"))

    @triton.jit
    def _fwd_kernel(
        Q, K, V, KP, QP, TABLE, MASK, CU, SEED, OUT, STATS,
        H, L, D, DV, scale, p, drop_scale,
        HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, VARLEN: tl.constexpr,
        DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # One program per (query tile, sequence·head): online softmax over the key tiles.
        i0 = tl.program_id(0) * BLOCK_M
        nh = tl.program_id(1)
        n = nh // H
        h = nh % H
        start, length = _sequence(CU, n, L, VARLEN)
        if i0 < length:
            a = tl.arange(0, BLOCK_M)
            bb = tl.arange(0, BLOCK_N)
            d = tl.arange(0, BLOCK_D)
            dv = tl.arange(0, BLOCK_DV)
            i = i0 + a
            row_ok = i < length
            q_ptr = Q + (start + i0).to(tl.int64) * H * D + h * D
            q = _ld(q_ptr + a[:, None] * (H * D) + d[None, :], mask=row_ok[:, None] & (d[None, :] < D))
            row_real = row_ok
            if HAS_MASK:
                row_real = tl.load(MASK + start + i, mask=row_ok, other=0) != 0
            if DROPOUT:
                key = tl.load(SEED) + (nh.to(tl.int64) << 32)
            m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
            for j0 in range(0, length, BLOCK_N):
                j = j0 + bb
                col_ok = j < length
                k = _ld(K + (start + j0).to(tl.int64) * H * D + h * D + bb[:, None] * (H * D) + d[None, :],
                            mask=col_ok[:, None] & (d[None, :] < D))
                v = _ld(V + (start + j0).to(tl.int64) * H * DV + h * DV + bb[:, None] * (H * DV) + dv[None, :],
                            mask=col_ok[:, None] & (dv[None, :] < DV))
                col_real = col_ok
                if HAS_MASK:
                    col_real = tl.load(MASK + start + j, mask=col_ok, other=0) != 0
                kp = q
                qp = k
                if HAS_C2P or HAS_P2C:
                    idx, valid = _band_index(TABLE, L, i0, j0, BLOCK_M, BLOCK_N, BLOCK_W)
                    if HAS_C2P:
                        kp = _band_rows(KP, idx, valid, h, H, D, BLOCK_D)
                    if HAS_P2C:
                        qp = _band_rows(QP, idx, valid, h, H, D, BLOCK_D)
                s = _scores(q, k, kp, qp, scale, BLOCK_M, BLOCK_N, HAS_C2P, HAS_P2C, DOT_PREC)
                s = _mask_scores(s, row_ok, col_ok, row_real, col_real, HAS_MASK)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                pr = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(pr, axis=1)
                if DROPOUT:
                    pr = tl.where(_keep(key, i, j, p), pr * drop_scale, 0.0)
                acc = _dot_split(pr, v, acc * alpha[:, None], V.dtype.element_ty, DOT_PREC, SPLIT)
                m_i = m_new
            out = acc / l_i[:, None]
            tl.store(OUT + (start + i0).to(tl.int64) * H * DV + h * DV + a[:, None] * (H * DV) + dv[None, :],
                     out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
            st_ptr = STATS + ((start + i0).to(tl.int64) * H + h) * 2 + a * (H * 2)
            tl.store(st_ptr, m_i, mask=row_ok)
            tl.store(st_ptr + 1, tl.log(l_i), mask=row_ok)

    @triton.jit
    def _fold_add(PART, base, last, dband, H, D, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
        # PART[base + r] += dband[r] for the band rows r <= last − base (this program's own rows),
        # then a barrier: the next tile's band overlaps these rows, read by other threads.
        r = tl.arange(0, BLOCK_W)
        d = tl.arange(0, BLOCK_D)
        ptr = PART + (base + r)[:, None] * (H * D) + d[None, :]
        ok = (r[:, None] <= last - base) & (d[None, :] < D)
        old = tl.load(ptr, mask=ok, other=0.0)
        tl.store(ptr, old + dband, mask=ok)
        tl.debug_barrier()

    @triton.jit
    def _fold_matrix(idx, valid, BLOCK_W: tl.constexpr):
        # (Map [W, W] with Map[u, r] = [idx(u) − base = r], base, last): idx is nondecreasing in u.
        base = tl.min(tl.where(valid, idx, 2147483647), axis=0)
        last = tl.max(tl.where(valid, idx, -1), axis=0)
        r = tl.arange(0, BLOCK_W)
        fold = tl.where(((idx[:, None] - base) == r[None, :]) & valid[:, None], 1.0, 0.0)
        return fold, base, last

    @triton.jit
    def _bwd_dq_kernel(
        Q, K, V, KP, QP, TABLE, MASK, CU, SEED, OUT, DO, STATS, DELTA, DQ, PART_KP,
        H, L, D, DV, N_SEQ, GROUPS, PROGS, TPP, TWO_SPAN, scale, p, drop_scale,
        HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, VARLEN: tl.constexpr,
        DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # Programs over (TPP query tiles, head, batch group), each walking the sequences of its
        # group: D of its rows, dq, and the c2p position gradient into its own partial rows.
        prog = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.program_id(2)
        a = tl.arange(0, BLOCK_M)
        bb = tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        uu = tl.arange(0, BLOCK_W)
        shear1 = a[:, None] - uu[None, :] + (BLOCK_N - 1)  # [M, W]: key b of (a, u)
        shear1_ok = (shear1 >= 0) & (shear1 < BLOCK_N)
        shear1 = tl.minimum(tl.maximum(shear1, 0), BLOCK_N - 1)
        part = PART_KP + ((g.to(tl.int64) * PROGS + prog) * TWO_SPAN * H + h) * D
        # One flat loop over (sequence of the group, tile of the program): a nested loop kept its
        # counter in local memory (ptxas, at some tile sizes).
        for it in range(0, tl.cdiv(N_SEQ - g, GROUPS) * TPP):
            n = g + (it // TPP) * GROUPS
            i0 = (prog * TPP + it % TPP) * BLOCK_M
            start, length = _sequence(CU, n, L, VARLEN)
            if i0 < length:
                i = i0 + a
                row_ok = i < length
                row_base = (start + i0).to(tl.int64) * H
                q = _ld(Q + (row_base + h) * D + a[:, None] * (H * D) + d[None, :],
                            mask=row_ok[:, None] & (d[None, :] < D))
                dmask = row_ok[:, None] & (dv[None, :] < DV)
                do = _ld(DO + (row_base + h) * DV + a[:, None] * (H * DV) + dv[None, :], mask=dmask)
                o = _ld(OUT + (row_base + h) * DV + a[:, None] * (H * DV) + dv[None, :], mask=dmask)
                delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
                tl.store(DELTA + row_base + h + a * H, delta, mask=row_ok)
                st_ptr = STATS + (row_base + h) * 2 + a * (H * 2)
                m_i = tl.load(st_ptr, mask=row_ok, other=0.0)
                log_l = tl.load(st_ptr + 1, mask=row_ok, other=0.0)
                row_real = row_ok
                if HAS_MASK:
                    row_real = tl.load(MASK + start + i, mask=row_ok, other=0) != 0
                if DROPOUT:
                    key = tl.load(SEED) + (tl.cast(n * H + h, tl.int64) << 32)
                dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
                for j0 in range(0, length, BLOCK_N):
                    j = j0 + bb
                    col_ok = j < length
                    k = _ld(K + (start + j0).to(tl.int64) * H * D + h * D + bb[:, None] * (H * D) + d[None, :],
                                mask=col_ok[:, None] & (d[None, :] < D))
                    v = _ld(V + (start + j0).to(tl.int64) * H * DV + h * DV + bb[:, None] * (H * DV) + dv[None, :],
                                mask=col_ok[:, None] & (dv[None, :] < DV))
                    col_real = col_ok
                    if HAS_MASK:
                        col_real = tl.load(MASK + start + j, mask=col_ok, other=0) != 0
                    kp = q
                    qp = k
                    idx = uu
                    valid = uu < 0
                    if HAS_C2P or HAS_P2C:
                        idx, valid = _band_index(TABLE, L, i0, j0, BLOCK_M, BLOCK_N, BLOCK_W)
                        if HAS_C2P:
                            kp = _band_rows(KP, idx, valid, h, H, D, BLOCK_D)
                        if HAS_P2C:
                            qp = _band_rows(QP, idx, valid, h, H, D, BLOCK_D)
                    s = _scores(q, k, kp, qp, scale, BLOCK_M, BLOCK_N, HAS_C2P, HAS_P2C, DOT_PREC)
                    s = _mask_scores(s, row_ok, col_ok, row_real, col_real, HAS_MASK)
                    pr = tl.exp((s - m_i[:, None]) - log_l[:, None])
                    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
                    if DROPOUT:
                        dp = tl.where(_keep(key, i, j, p), dp * drop_scale, 0.0)
                    ds = tl.where(row_real[:, None], pr * (dp - delta[:, None]), 0.0)
                    if HAS_C2P:
                        dg = tl.where(shear1_ok, tl.gather(ds, shear1, axis=1), 0.0)  # [M, W]
                        fold, base, last = _fold_matrix(idx, valid, BLOCK_W)
                        dgb = _dot_split(dg, _rnd(fold, K.dtype.element_ty), tl.zeros((BLOCK_M, BLOCK_W), tl.float32),
                                         K.dtype.element_ty, DOT_PREC, SPLIT)  # [M, W] per table row
                        dband = _dot_split(tl.trans(dgb), q, tl.zeros((BLOCK_W, BLOCK_D), tl.float32),
                                           K.dtype.element_ty, DOT_PREC, SPLIT)  # [W, D]
                        _fold_add(part, base, last, dband, H, D, BLOCK_W, BLOCK_D)
                        dq = _dot_split(dg, kp, dq, K.dtype.element_ty, DOT_PREC, SPLIT)
                    dq = _dot_split(ds, k, dq, K.dtype.element_ty, DOT_PREC, SPLIT)
                tl.store(DQ + (row_base + h) * D + a[:, None] * (H * D) + d[None, :],
                         (dq * scale).to(DQ.dtype.element_ty),
                         mask=row_ok[:, None] & (d[None, :] < D))

    @triton.jit
    def _bwd_dkdv_kernel(
        Q, K, V, KP, QP, TABLE, MASK, CU, SEED, DO, STATS, DELTA, DK, DVV, PART_QP,
        H, L, D, DV, N_SEQ, GROUPS, PROGS, TPP, TWO_SPAN, scale, p, drop_scale,
        HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_MASK: tl.constexpr, VARLEN: tl.constexpr,
        DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # Programs over (TPP key tiles, head, batch group): dk, dv and the p2c position gradient.
        # Apart on purpose from _bwd_dq_kernel, whose loops run the other way round (query tiles
        # outside), so each kernel accumulates its own gradients in registers without atomics.
        prog = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.program_id(2)
        a = tl.arange(0, BLOCK_M)
        bb = tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        uu = tl.arange(0, BLOCK_W)
        shear0 = bb[:, None] + uu[None, :] - (BLOCK_N - 1)  # [N, W]: query a of (b, u)
        shear0_ok = (shear0 >= 0) & (shear0 < BLOCK_M)
        shear0 = tl.minimum(tl.maximum(shear0, 0), BLOCK_M - 1)
        part = PART_QP + ((g.to(tl.int64) * PROGS + prog) * TWO_SPAN * H + h) * D
        # One flat loop over (sequence of the group, tile of the program): a nested loop kept its
        # counter in local memory (ptxas, at some tile sizes).
        for it in range(0, tl.cdiv(N_SEQ - g, GROUPS) * TPP):
            n = g + (it // TPP) * GROUPS
            j0 = (prog * TPP + it % TPP) * BLOCK_N
            start, length = _sequence(CU, n, L, VARLEN)
            if j0 < length:
                j = j0 + bb
                col_ok = j < length
                k = _ld(K + (start + j0).to(tl.int64) * H * D + h * D + bb[:, None] * (H * D) + d[None, :],
                            mask=col_ok[:, None] & (d[None, :] < D))
                v = _ld(V + (start + j0).to(tl.int64) * H * DV + h * DV + bb[:, None] * (H * DV) + dv[None, :],
                            mask=col_ok[:, None] & (dv[None, :] < DV))
                col_real = col_ok
                if HAS_MASK:
                    col_real = tl.load(MASK + start + j, mask=col_ok, other=0) != 0
                if DROPOUT:
                    key = tl.load(SEED) + (tl.cast(n * H + h, tl.int64) << 32)
                dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
                dvacc = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
                for i0 in range(0, length, BLOCK_M):
                    i = i0 + a
                    row_ok = i < length
                    row_base = (start + i0).to(tl.int64) * H
                    q = _ld(Q + (row_base + h) * D + a[:, None] * (H * D) + d[None, :],
                                mask=row_ok[:, None] & (d[None, :] < D))
                    do = _ld(DO + (row_base + h) * DV + a[:, None] * (H * DV) + dv[None, :],
                                 mask=row_ok[:, None] & (dv[None, :] < DV))
                    st_ptr = STATS + (row_base + h) * 2 + a * (H * 2)
                    m_i = tl.load(st_ptr, mask=row_ok, other=0.0)
                    log_l = tl.load(st_ptr + 1, mask=row_ok, other=0.0)
                    delta = tl.load(DELTA + row_base + h + a * H, mask=row_ok, other=0.0)
                    row_real = row_ok
                    if HAS_MASK:
                        row_real = tl.load(MASK + start + i, mask=row_ok, other=0) != 0
                    kp = q
                    qp = k
                    idx = uu
                    valid = uu < 0
                    if HAS_C2P or HAS_P2C:
                        idx, valid = _band_index(TABLE, L, i0, j0, BLOCK_M, BLOCK_N, BLOCK_W)
                        if HAS_C2P:
                            kp = _band_rows(KP, idx, valid, h, H, D, BLOCK_D)
                        if HAS_P2C:
                            qp = _band_rows(QP, idx, valid, h, H, D, BLOCK_D)
                    s = _scores(q, k, kp, qp, scale, BLOCK_M, BLOCK_N, HAS_C2P, HAS_P2C, DOT_PREC)
                    s = _mask_scores(s, row_ok, col_ok, row_real, col_real, HAS_MASK)
                    # Rows past the sequence: P = 0 (their stats are not there to normalise them).
                    pr = tl.where(row_ok[:, None], tl.exp((s - m_i[:, None]) - log_l[:, None]), 0.0)
                    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
                    if DROPOUT:
                        keep = _keep(key, i, j, p)
                        pd = tl.where(keep, pr * drop_scale, 0.0)
                        dp = tl.where(keep, dp * drop_scale, 0.0)
                    else:
                        pd = pr
                    dvacc = _dot_split(tl.trans(pd), do, dvacc, V.dtype.element_ty, DOT_PREC, SPLIT)
                    ds = tl.where(row_real[:, None], pr * (dp - delta[:, None]), 0.0)
                    dk = _dot_split(tl.trans(ds), q, dk, Q.dtype.element_ty, DOT_PREC, SPLIT)
                    if HAS_P2C:
                        # shear0(dS)ᵀ[b, u] = dS[u + b − N + 1, b], gathered from dSᵀ: [N, W].
                        dht = tl.where(shear0_ok, tl.gather(tl.trans(ds), shear0, axis=1), 0.0)
                        dk = _dot_split(dht, qp, dk, Q.dtype.element_ty, DOT_PREC, SPLIT)
                        fold, base, last = _fold_matrix(idx, valid, BLOCK_W)
                        dhbt = _dot_split(dht, _rnd(fold, Q.dtype.element_ty), tl.zeros((BLOCK_N, BLOCK_W), tl.float32),
                                          Q.dtype.element_ty, DOT_PREC, SPLIT)  # [N, W] per table row
                        dband = _dot_split(tl.trans(dhbt), k, tl.zeros((BLOCK_W, BLOCK_D), tl.float32),
                                           Q.dtype.element_ty, DOT_PREC, SPLIT)  # [W, D]
                        _fold_add(part, base, last, dband, H, D, BLOCK_W, BLOCK_D)
                out_mask = col_ok[:, None] & (d[None, :] < D)
                tl.store(DK + (start + j0).to(tl.int64) * H * D + h * D + bb[:, None] * (H * D) + d[None, :],
                         (dk * scale).to(DK.dtype.element_ty), mask=out_mask)
                tl.store(DVV + (start + j0).to(tl.int64) * H * DV + h * DV + bb[:, None] * (H * DV) + dv[None, :],
                         dvacc.to(DVV.dtype.element_ty), mask=col_ok[:, None] & (dv[None, :] < DV))

    @triton.jit
    def _keep_mask_kernel(OUT, SEED, H, L, p, BLOCK: tl.constexpr):
        # OUT [n_seq, H, L, L] uint8: the keep mask the kernels above draw for (n, h, i, j).
        i0 = tl.program_id(0) * BLOCK
        nh = tl.program_id(1)
        key = tl.load(SEED) + (nh.to(tl.int64) << 32)
        i = i0 + tl.arange(0, BLOCK)
        for j0 in range(0, L, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            keep = _keep(key, i, j, p)
            ok = (i[:, None] < L) & (j[None, :] < L)
            tl.store(OUT + nh.to(tl.int64) * L * L + i[:, None] * L + j[None, :], keep.to(tl.uint8), mask=ok)


# ----------------------------------------------------------------------------------------------
# Triton host launchers
# ----------------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def triton_tiles(kind: str, dtype: torch.dtype, positions: bool = True) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_W, num_warps, num_stages) of the forward ("fwd") or the backward
    ("bwd") kernels for inputs of ``dtype``, with or without position terms."""
    key = "fp32" if dtype == torch.float32 else "16bit"
    if kind == "bwd" and not positions:
        key += " content"
    m, n, warps, stages = (FWD_CONFIG if kind == "fwd" else BWD_CONFIG)[key]
    return m, n, _pow2(m + n - 1), warps, stages


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 data: full fp32 FMA products ("ieee"; tf32x3 spilled registers at every tile size
    # tried), never tf32; 16-bit data: the flag is not read.
    return "ieee" if dtype == torch.float32 else "tf32"


def _head_blocks(d: int, d_v: int) -> tuple[int, int]:
    return max(16, _pow2(d)), max(16, _pow2(d_v))


def backward_plan(n_seq: int, max_len: int, heads: int, d: int, span: int, has_c2p: bool, has_p2c: bool,
                  on_gpu: bool, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(groups, tiles per program, programs over the query tiles, programs over the key tiles) of
    the backward kernels.

    Program (p, h, g) of a kernel walks the sequences g, g + groups, ... and in each its tiles
    p·tpp .. p·tpp + tpp − 1, accumulating its position-gradient rows in a partial buffer it owns,
    [groups, programs, 2·span, H, D] fp32. On a GPU: the fewest tiles per program (1, 2, 4, ...)
    whose two buffers fit PARTIAL_BUDGET_BYTES with one group, then as many groups as still fit
    (at least 1). On the interpreter: 2 tiles per program and at most 2 groups, so that both loops
    and the sum over partials run.
    """
    m, n, _, _, _ = triton_tiles("bwd", dtype, has_c2p or has_p2c)
    tiles_q, tiles_k = triton.cdiv(max(max_len, 1), m), triton.cdiv(max(max_len, 1), n)

    def programs(tpp: int) -> tuple[int, int]:
        return triton.cdiv(tiles_q, tpp), triton.cdiv(tiles_k, tpp)

    def group_bytes(tpp: int) -> int:
        pq, pk = programs(tpp)
        return 4 * 2 * span * heads * d * (pq * has_c2p + pk * has_p2c)

    if not on_gpu:
        tpp = 2
        return (max(1, min(n_seq, 2)), tpp, *programs(tpp))
    tpp = 1
    while group_bytes(tpp) > PARTIAL_BUDGET_BYTES and tpp < max(tiles_q, tiles_k):
        tpp *= 2
    per_group = group_bytes(tpp)
    groups = PARTIAL_BUDGET_BYTES // per_group if per_group else n_seq
    return (max(1, min(n_seq, groups)), tpp, *programs(tpp))


def _mask_arg(mask: Optional[Tensor], dummy: Tensor) -> Tensor:
    if mask is None:
        return dummy
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _triton_forward(q, k, v, pos_key, pos_query, table, mask, cu_seqlens, seed, p, scale, max_len):
    """q, k [T, H, D], v [T, H, Dv] token-major; mask [n_seq, L] or None; cu_seqlens or None."""
    tokens, heads, d = q.shape
    d_v = v.shape[2]
    out = torch.empty((tokens, heads, d_v), dtype=q.dtype, device=q.device)
    stats = torch.empty((tokens, heads, 2), dtype=torch.float32, device=q.device)
    n_seq = cu_seqlens.numel() - 1 if cu_seqlens is not None else tokens // max(max_len, 1)
    if tokens == 0 or heads == 0 or n_seq == 0 or max_len == 0:
        return out, stats
    m, n, w, warps, stages = triton_tiles("fwd", q.dtype)
    block_d, block_dv = _head_blocks(d, d_v)
    dummy = stats
    grid = (triton.cdiv(max_len, m), n_seq * heads)
    with launch_on(q):
        _fwd_kernel[grid](
            q, k, v, pos_key if pos_key is not None else dummy, pos_query if pos_query is not None else dummy,
            table, _mask_arg(mask, dummy), cu_seqlens if cu_seqlens is not None else dummy, seed, out, stats,
            heads, max_len, d, d_v, scale, p, 1.0 / (1.0 - p),
            HAS_C2P=pos_key is not None, HAS_P2C=pos_query is not None, HAS_MASK=mask is not None,
            VARLEN=cu_seqlens is not None, DROPOUT=p > 0.0, BLOCK_M=m, BLOCK_N=n, BLOCK_W=w,
            BLOCK_D=block_d, BLOCK_DV=block_dv, DOT_PREC=_dot_precision(q.dtype), SPLIT=q.dtype != torch.float32,
            num_warps=warps, num_stages=stages,
        )
    return out, stats


def _triton_backward(grad_out, q, k, v, pos_key, pos_query, out, stats, table, mask, cu_seqlens, seed, p, scale,
                     max_len, span):
    tokens, heads, d = q.shape
    d_v = v.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    n_seq = cu_seqlens.numel() - 1 if cu_seqlens is not None else tokens // max(max_len, 1)
    has_c2p, has_p2c = pos_key is not None, pos_query is not None
    dkp = dqp = None
    if tokens == 0 or heads == 0 or n_seq == 0 or max_len == 0:
        return (dq.zero_(), dk.zero_(), dv.zero_(), torch.zeros_like(pos_key) if has_c2p else None,
                torch.zeros_like(pos_query) if has_p2c else None)
    m, n, w, warps, stages = triton_tiles("bwd", q.dtype, has_c2p or has_p2c)
    block_d, block_dv = _head_blocks(d, d_v)
    groups, tpp, progs_q, progs_k = backward_plan(n_seq, max_len, heads, d, span, has_c2p, has_p2c, q.is_cuda,
                                                  q.dtype)
    delta = torch.empty((tokens, heads), dtype=torch.float32, device=q.device)
    part_kp = (torch.zeros((groups, progs_q, 2 * span, heads, d), dtype=torch.float32, device=q.device)
               if has_c2p else delta)
    part_qp = (torch.zeros((groups, progs_k, 2 * span, heads, d), dtype=torch.float32, device=q.device)
               if has_p2c else delta)
    dummy = delta
    common = (pos_key if has_c2p else dummy, pos_query if has_p2c else dummy, table, _mask_arg(mask, dummy),
              cu_seqlens if cu_seqlens is not None else dummy, seed)
    flags = dict(HAS_C2P=has_c2p, HAS_P2C=has_p2c, HAS_MASK=mask is not None, VARLEN=cu_seqlens is not None,
                 DROPOUT=p > 0.0, BLOCK_M=m, BLOCK_N=n, BLOCK_W=w, BLOCK_D=block_d, BLOCK_DV=block_dv,
                 DOT_PREC=_dot_precision(q.dtype), SPLIT=q.dtype != torch.float32, num_stages=stages)
    ints = (heads, max_len, d, d_v, n_seq, groups)
    floats = (scale, p, 1.0 / (1.0 - p))
    light = BWD_LIGHT_WARPS["fp32" if q.dtype == torch.float32 else "16bit"] if (has_c2p or has_p2c) else warps
    with launch_on(q):
        # dq first: it writes D = rowsum(dO·O), which the dk/dv kernel reads.
        _bwd_dq_kernel[(progs_q, heads, groups)](
            q, k, v, *common, out, grad_out, stats, delta, dq, part_kp, *ints, progs_q, tpp, 2 * span, *floats,
            **flags, num_warps=warps if has_c2p else light)
        _bwd_dkdv_kernel[(progs_k, heads, groups)](
            q, k, v, *common, grad_out, stats, delta, dk, dv, part_qp, *ints, progs_k, tpp, 2 * span, *floats,
            **flags, num_warps=warps if has_p2c else light)
    # torch's sums over dims are deterministic (no atomics): bit-reproducible position gradients.
    if has_c2p:
        dkp = part_kp.sum(dim=(0, 1)).mul_(scale).to(pos_key.dtype)
    if has_p2c:
        dqp = part_qp.sum(dim=(0, 1)).mul_(scale).to(pos_query.dtype)
    return dq, dk, dv, dkp, dqp


def _triton_keep_mask(seed: Tensor, n_seq: int, heads: int, length: int, p: float) -> Tensor:
    out = torch.empty((n_seq, heads, length, length), dtype=torch.uint8, device=seed.device)
    if out.numel():
        with launch_on(out):
            _keep_mask_kernel[(triton.cdiv(length, 32), n_seq * heads)](out, seed, heads, length, p, BLOCK=32)
    return out.view(torch.bool)


# ----------------------------------------------------------------------------------------------
# Custom ops. Forward returns (out, stats); stats (m, log l per row and head) are not differentiable.
# ----------------------------------------------------------------------------------------------
def _check_op_backend(backend: str, dtype: torch.dtype, d: int, d_v: int, op: str) -> None:
    if backend not in ("triton", "reference"):
        raise ValueError(f"{op}: argument 'backend' must be 'triton' or 'reference', got {backend!r}")
    if backend == "triton" and (dtype not in TRITON_DTYPES or max(d, d_v) > MAX_TRITON_HEAD_DIM):
        raise ValueError(f"{op}: the Triton kernels take float32/float16/bfloat16 and head dims <= "
                         f"{MAX_TRITON_HEAD_DIM}, got {dtype}, d={d}, d_v={d_v}")


def _empty_grad(like: Tensor) -> Tensor:
    return like.new_empty((0,))


@torch.library.custom_op("tempo::disentangled_attention_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, pos_key: Optional[Tensor], pos_query: Optional[Tensor], index: Tensor,
            padding_mask: Optional[Tensor], seed: Tensor, scale: float, dropout_p: float, span: int,
            position_buckets: int, max_relative_positions: int, backend: str) -> tuple[Tensor, Tensor]:
    """q, k [B, S, H, D], v [B, S, H, Dv] contiguous -> (out [B, S, H, Dv], stats [B, S, H, 2])."""
    _check_op_backend(backend, q.dtype, q.shape[3], v.shape[3], "tempo::disentangled_attention_fwd")
    with torch.autocast(q.device.type, enabled=False):
        if backend == "triton":
            b, s, h, d = q.shape
            d_v = v.shape[3]
            out, stats = _triton_forward(q.view(b * s, h, d), k.view(b * s, h, d), v.view(b * s, h, d_v), pos_key,
                                         pos_query, index, padding_mask, None, seed, dropout_p, scale, s)
            return out.view(b, s, h, d_v), stats.view(b, s, h, 2)
        seed_int = int(seed.item()) if dropout_p > 0.0 else 0  # host read: the CPU / fallback path
        return _reference_forward(q, k, v, pos_key, pos_query, _sub_table(index, q.shape[1]), padding_mask,
                                  seed_int, dropout_p, scale)


@_fwd_op.register_fake
def _(q, k, v, pos_key, pos_query, index, padding_mask, seed, scale, dropout_p, span, position_buckets,
      max_relative_positions, backend):
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[3])), q.new_empty((b, s, h, 2), dtype=_compute_dtype(q.dtype))


@torch.library.custom_op("tempo::disentangled_attention_bwd", mutates_args=())
def _bwd_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, pos_key: Optional[Tensor],
            pos_query: Optional[Tensor], out: Tensor, stats: Tensor, index: Tensor, padding_mask: Optional[Tensor],
            seed: Tensor, scale: float, dropout_p: float, span: int, position_buckets: int,
            max_relative_positions: int, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dpos_key, dpos_query); an absent position table gets an empty gradient."""
    _check_op_backend(backend, q.dtype, q.shape[3], v.shape[3], "tempo::disentangled_attention_bwd")
    with torch.autocast(q.device.type, enabled=False):
        if backend == "triton":
            b, s, h, _ = q.shape
            flat = [t.reshape(b * s, h, t.shape[3]) for t in (grad_out.contiguous(), q, k, v, out)]
            dq, dk, dv, dkp, dqp = _triton_backward(flat[0], *flat[1:4], pos_key, pos_query, flat[4],
                                                    stats.view(b * s, h, 2), index, padding_mask, None, seed,
                                                    dropout_p, scale, s, span)
            dq, dk, dv = dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
        else:
            seed_int = int(seed.item()) if dropout_p > 0.0 else 0
            dq, dk, dv, dkp, dqp = _reference_backward(grad_out, q, k, v, pos_key, pos_query, out, stats,
                                                       _sub_table(index, q.shape[1]), padding_mask, seed_int,
                                                       dropout_p, scale)
    return (dq, dk, dv, dkp if dkp is not None else _empty_grad(q), dqp if dqp is not None else _empty_grad(q))


@_bwd_op.register_fake
def _(grad_out, q, k, v, pos_key, pos_query, out, stats, index, padding_mask, seed, scale, dropout_p, span,
      position_buckets, max_relative_positions, backend):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(pos_key) if pos_key is not None else q.new_empty((0,)),
            torch.empty_like(pos_query) if pos_query is not None else q.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    (q, k, v, pos_key, pos_query, index, padding_mask, seed, scale, dropout_p, span, position_buckets,
     max_relative_positions, backend) = inputs
    out, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, pos_key, pos_query, out, stats, index, padding_mask, seed)
    # The backend the forward ran (the dropout mask is that path's), not whatever use_backend()
    # says when backward runs (autograd's device thread on CUDA).
    ctx.args = (scale, dropout_p, span, position_buckets, max_relative_positions, backend)


def _backward_rule(ctx, grad_out, grad_stats):
    q, k, v, pos_key, pos_query, out, stats, index, padding_mask, seed = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 14
    dq, dk, dv, dkp, dqp = _bwd_op(grad_out, q, k, v, pos_key, pos_query, out, stats, index, padding_mask, seed,
                                   *ctx.args)
    return (dq, dk, dv, dkp if pos_key is not None else None, dqp if pos_query is not None else None,
            *(None,) * 9)


_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


@torch.library.custom_op("tempo::disentangled_attention_varlen_fwd", mutates_args=())
def _varlen_fwd_op(q: Tensor, k: Tensor, v: Tensor, pos_key: Optional[Tensor], pos_query: Optional[Tensor],
                   index: Tensor, cu_seqlens: Tensor, max_seqlen: int, seed: Tensor, scale: float, dropout_p: float,
                   span: int, position_buckets: int, max_relative_positions: int,
                   backend: str) -> tuple[Tensor, Tensor]:
    """q, k [T, H, D], v [T, H, Dv] -> (out [T, H, Dv], stats [T, H, 2])."""
    _check_op_backend(backend, q.dtype, q.shape[2], v.shape[2], "tempo::disentangled_attention_varlen_fwd")
    with torch.autocast(q.device.type, enabled=False):
        if backend == "triton":
            return _triton_forward(q, k, v, pos_key, pos_query, index, None, cu_seqlens, seed, dropout_p, scale,
                                   max_seqlen)
        return _varlen_reference_forward(q, k, v, pos_key, pos_query, index, cu_seqlens, seed, dropout_p, scale)


@_varlen_fwd_op.register_fake
def _(q, k, v, pos_key, pos_query, index, cu_seqlens, max_seqlen, seed, scale, dropout_p, span, position_buckets,
      max_relative_positions, backend):
    t, h, _ = q.shape
    return q.new_empty((t, h, v.shape[2])), q.new_empty((t, h, 2), dtype=_compute_dtype(q.dtype))


@torch.library.custom_op("tempo::disentangled_attention_varlen_bwd", mutates_args=())
def _varlen_bwd_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, pos_key: Optional[Tensor],
                   pos_query: Optional[Tensor], out: Tensor, stats: Tensor, index: Tensor, cu_seqlens: Tensor,
                   max_seqlen: int, seed: Tensor, scale: float, dropout_p: float, span: int, position_buckets: int,
                   max_relative_positions: int, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_op_backend(backend, q.dtype, q.shape[2], v.shape[2], "tempo::disentangled_attention_varlen_bwd")
    with torch.autocast(q.device.type, enabled=False):
        if backend == "triton":
            dq, dk, dv, dkp, dqp = _triton_backward(grad_out.contiguous(), q, k, v, pos_key, pos_query, out, stats,
                                                    index, None, cu_seqlens, seed, dropout_p, scale, max_seqlen, span)
        else:
            dq, dk, dv, dkp, dqp = _varlen_reference_backward(grad_out, q, k, v, pos_key, pos_query, out, stats,
                                                              index, cu_seqlens, seed, dropout_p, scale)
    return (dq, dk, dv, dkp if dkp is not None else _empty_grad(q), dqp if dqp is not None else _empty_grad(q))


@_varlen_bwd_op.register_fake
def _(grad_out, q, k, v, pos_key, pos_query, out, stats, index, cu_seqlens, max_seqlen, seed, scale, dropout_p, span,
      position_buckets, max_relative_positions, backend):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(pos_key) if pos_key is not None else q.new_empty((0,)),
            torch.empty_like(pos_query) if pos_query is not None else q.new_empty((0,)))


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, pos_key, pos_query, index, cu_seqlens, max_seqlen, seed, scale, dropout_p, span, position_buckets,
     max_relative_positions, backend) = inputs
    out, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, pos_key, pos_query, out, stats, index, cu_seqlens, seed)
    ctx.max_seqlen = max_seqlen
    ctx.args = (scale, dropout_p, span, position_buckets, max_relative_positions, backend)


def _varlen_backward_rule(ctx, grad_out, grad_stats):
    q, k, v, pos_key, pos_query, out, stats, index, cu_seqlens, seed = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 15
    dq, dk, dv, dkp, dqp = _varlen_bwd_op(grad_out, q, k, v, pos_key, pos_query, out, stats, index, cu_seqlens,
                                          ctx.max_seqlen, seed, *ctx.args)
    return (dq, dk, dv, dkp if pos_key is not None else None, dqp if pos_query is not None else None,
            *(None,) * 10)


_varlen_fwd_op.register_autograd(_varlen_backward_rule, setup_context=_varlen_setup_context)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _check_tensor(t: object, name: str, op: str, dims: int, layout: str) -> Tensor:
    check_float_tensor(t, name, op)
    if t.dim() != dims:
        raise ValueError(f"{op}: argument '{name}' must be {dims}-D ({layout}), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: argument '{name}' must be contiguous (a view of a Linear's output, {layout}), got "
                         f"strides {t.stride()} for shape {tuple(t.shape)}")
    return t


def _check_common(q, k, v, pos_key, pos_query, span, position_buckets, max_relative_positions, scale, seed,
                  op: str, layout: str) -> None:
    dims = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(t, name, op, dims, layout)
    if q.shape != k.shape or q.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{op}: arguments 'q', 'k', 'v' must agree ({layout}; q and k the same head dim), got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    _check_positions(span, position_buckets, max_relative_positions, op)
    heads, d = q.shape[-2], q.shape[-1]
    for name, t in (("pos_key", pos_key), ("pos_query", pos_query)):
        if t is None:
            continue
        _check_tensor(t, name, op, 3, "2·span, heads, head_dim")
        if tuple(t.shape) != (2 * span, heads, d):
            raise ValueError(f"{op}: argument '{name}' must have shape [2·span, heads, head_dim] = "
                             f"{(2 * span, heads, d)}, got {tuple(t.shape)}")
    tensors = [("q", q), ("k", k), ("v", v), ("pos_key", pos_key), ("pos_query", pos_query)]
    present = [(n, t) for n, t in tensors if t is not None]
    if len({t.device for _, t in present}) > 1:
        raise ValueError(f"{op}: arguments {', '.join(repr(n) for n, _ in present)} must be on one device, got "
                         f"{', '.join(str(t.device) for _, t in present)}")
    autocast = torch.is_autocast_enabled(q.device.type) and all(t.dtype in _AUTOCAST_ELIGIBLE for _, t in present)
    if not autocast and len({t.dtype for _, t in present}) > 1:
        raise TypeError(f"{op}: arguments {', '.join(repr(n) for n, _ in present)} must have one dtype (outside "
                        f"autocast), got {', '.join(str(t.dtype) for _, t in present)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise TypeError(f"{op}: argument 'scale' must be a positive finite float (1/sqrt(d·f)), got {scale!r}")
    if seed is not None and (not isinstance(seed, Tensor) or seed.is_floating_point() or seed.is_complex()
                             or seed.dtype == torch.bool or seed.numel() != 1):
        raise TypeError(f"{op}: argument 'seed' must be a one-element integer tensor")


def _check_mask(mask: object, batch: int, s_len: int, device: torch.device) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{OP_NAME}: argument 'padding_mask' must be a tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and (mask.is_floating_point() or mask.is_complex()):
        raise TypeError(f"{OP_NAME}: argument 'padding_mask' must be bool or integer (1 = real token), got "
                        f"{mask.dtype}")
    if tuple(mask.shape) != (batch, s_len):
        raise ValueError(f"{OP_NAME}: argument 'padding_mask' must have shape [batch, seq_len] = {(batch, s_len)}, "
                         f"got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{OP_NAME}: argument 'padding_mask' must be on {device}, got {mask.device}")
    if not mask.is_contiguous():
        raise ValueError(f"{OP_NAME}: argument 'padding_mask' must be contiguous")
    # Values: read on the CPU only (on CUDA a host sync), and not while torch.compile traces.
    if (mask.dtype != torch.bool and mask.device.type == "cpu" and mask.numel() and not torch.compiler.is_compiling()
            and bool(((mask != 0) & (mask != 1)).any())):
        raise ValueError(f"{OP_NAME}: argument 'padding_mask' must hold only 0 and 1 (1 = real token)")


def _check_cu_seqlens(cu_seqlens: object, tokens: int, max_seqlen: object, device: torch.device) -> None:
    if (not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1
            or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        got = ((cu_seqlens.dtype, tuple(cu_seqlens.shape)) if isinstance(cu_seqlens, Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"{_VAR_OP}: argument 'cu_seqlens' must be a 1-D int32/int64 tensor [sequences + 1], got {got}")
    if cu_seqlens.device != device:
        raise ValueError(f"{_VAR_OP}: argument 'cu_seqlens' must be on {device}, got {cu_seqlens.device}")
    if not cu_seqlens.is_contiguous():
        raise ValueError(f"{_VAR_OP}: argument 'cu_seqlens' must be contiguous")
    _check_max_len(max_seqlen, "max_seqlen", _VAR_OP)
    if cu_seqlens.device.type != "cpu" or torch.compiler.is_compiling():
        return  # reading the offsets: a host sync on CUDA, a graph break when compiling (the caller's contract)
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != tokens:
        raise ValueError(f"{_VAR_OP}: argument 'cu_seqlens' must start at 0 and end at the token count {tokens}, got "
                         f"{offsets[0]} ... {offsets[-1]}")
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{_VAR_OP}: argument 'cu_seqlens' must be nondecreasing")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{_VAR_OP}: a sequence of {max(lengths)} tokens is longer than max_seqlen={max_seqlen}")


def _resolve_seed(seed: Optional[Tensor], p: float, device: torch.device) -> Tensor:
    if seed is None:
        return draw_seed(device) if p > 0.0 else torch.zeros((), dtype=torch.int64, device=device)
    return seed.to(device=device, dtype=torch.int64).reshape(())


def _autocast(tensors: list[Optional[Tensor]], device_type: str) -> list[Optional[Tensor]]:
    if not torch.is_autocast_enabled(device_type):
        return tensors
    present = [t for t in tensors if t is not None]
    if not all(t.dtype in _AUTOCAST_ELIGIBLE for t in present):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if t is not None else None for t in tensors]


def _backend_for(q: Tensor, d: int, d_v: int) -> str:
    backend = resolve_backend(q, OP_NAME)
    if backend == "triton" and max(d, d_v) > MAX_TRITON_HEAD_DIM:
        log_fallback_once(f"{OP_NAME}:head_dim", f"{OP_NAME}: head dims above {MAX_TRITON_HEAD_DIM} "
                          f"(got {max(d, d_v)}) run on the PyTorch reference path")
        return "reference"
    return backend


def disentangled_attention(q: Tensor, k: Tensor, v: Tensor, pos_key: Optional[Tensor], pos_query: Optional[Tensor],
                           *, span: int, position_buckets: int, max_relative_positions: int, scale: float,
                           padding_mask: Optional[Tensor] = None, dropout_p: float = 0.0, training: bool = True,
                           seed: Optional[Tensor] = None) -> Tensor:
    """DeBERTa's disentangled attention core (module docstring), keeping O(s) per row.

    q, k, v: [B, S, H, D] (v: [B, S, H, Dv]), contiguous (a free view of a Linear's [B, S, H·D]
    output); pos_key / pos_query: [2·span, H, D] or None (c2p needs pos_key, p2c pos_query; both
    None = content only); ``scale`` = 1/sqrt(d·f); ``padding_mask`` [B, S] bool or 0/1 (1 = real)
    or None. Dropout on the probabilities when ``training`` and ``dropout_p`` > 0, the mask drawn
    from ``seed`` (0-d integer tensor) or, by default, a seed from torch's RNG. Returns
    [B, S, H, Dv], contiguous (``.view(B, S, H·Dv)`` is free). Under autocast fp32/fp16/bf16 inputs
    are cast to the autocast dtype and the output has it.
    """
    _check_common(q, k, v, pos_key, pos_query, span, position_buckets, max_relative_positions, scale, seed, OP_NAME,
                  "batch, seq_len, heads, head_dim")
    batch, s_len = q.shape[0], q.shape[1]
    _check_max_len(s_len, "q.shape[1] (seq_len)", OP_NAME)
    _check_mask(padding_mask, batch, s_len, q.device)
    p = check_probability(dropout_p, "dropout_p", OP_NAME)
    if not isinstance(training, bool):
        raise TypeError(f"{OP_NAME}: argument 'training' must be a bool, got {type(training).__name__}")
    if not training:
        p = 0.0
    q, k, v, pos_key, pos_query = _autocast([q, k, v, pos_key, pos_query], q.device.type)
    backend = _backend_for(q, q.shape[3], v.shape[3])
    index = relative_position_index(s_len, span, position_buckets, max_relative_positions, q.device)
    seed_t = _resolve_seed(seed, p, q.device)
    out, _ = _fwd_op(q, k, v, pos_key, pos_query, index, padding_mask, seed_t, float(scale), p, span,
                     position_buckets, max_relative_positions, backend)
    return out


def disentangled_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                                  pos_key: Optional[Tensor], pos_query: Optional[Tensor], *, span: int,
                                  position_buckets: int, max_relative_positions: int, scale: float,
                                  dropout_p: float = 0.0, training: bool = True,
                                  seed: Optional[Tensor] = None) -> Tensor:
    """``disentangled_attention`` over packed sequences: q, k, v [T, H, D] hold the sequences back
    to back (sequence n is rows cu_seqlens[n]:cu_seqlens[n + 1], the layout of
    ``tempo.unpad.TokenLayout``); each token attends its own sequence only, relative positions
    i − j inside it, no mask. ``max_seqlen`` bounds every sequence's length (it sizes the index
    table and the grids). Returns [T, H, Dv]. Keeps what the padded op keeps per real token, with
    cu_seqlens instead of the mask. Dropout: the Triton path draws sequence n's mask as the padded
    op draws batch element n's; the reference path one stream per sequence."""
    _check_common(q, k, v, pos_key, pos_query, span, position_buckets, max_relative_positions, scale, seed, _VAR_OP,
                  "total_tokens, heads, head_dim")
    _check_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen, q.device)
    p = check_probability(dropout_p, "dropout_p", _VAR_OP)
    if not isinstance(training, bool):
        raise TypeError(f"{_VAR_OP}: argument 'training' must be a bool, got {type(training).__name__}")
    if not training:
        p = 0.0
    q, k, v, pos_key, pos_query = _autocast([q, k, v, pos_key, pos_query], q.device.type)
    backend = _backend_for(q, q.shape[2], v.shape[2])
    index = relative_position_index(max_seqlen, span, position_buckets, max_relative_positions, q.device)
    seed_t = _resolve_seed(seed, p, q.device)
    out, _ = _varlen_fwd_op(q, k, v, pos_key, pos_query, index, cu_seqlens, max_seqlen, seed_t, float(scale), p,
                            span, position_buckets, max_relative_positions, backend)
    return out


def disentangled_attention_keep_mask(seed: Tensor | int, batch: int, heads: int, seq_len: int, dropout_p: float, *,
                                     backend: str = "reference", cu_seqlens: Optional[Tensor] = None,
                                     device=None):
    """The bool keep mask (True = kept) a path drew for ``seed`` (tests; materialises S×S).

    Padded (``cu_seqlens`` None): [batch, heads, seq_len, seq_len], element (b, h, i, j) for
    query i and key j. Varlen (``cu_seqlens`` given; ``batch`` and ``seq_len`` are ignored): a list
    with one [heads, L_n, L_n] mask per sequence. ``backend`` is the path that ran: "reference"
    (tiles of BLOCK_Q × BLOCK_K from per-tile generators; varlen: one stream per sequence) or
    "triton" (Philox per (sequence, head, i, j)).
    """
    if backend not in ("reference", "triton"):
        raise ValueError(f"disentangled_attention_keep_mask: argument 'backend' must be 'reference' or 'triton', "
                         f"got {backend!r}")
    p = check_probability(dropout_p, "dropout_p", "disentangled_attention_keep_mask")
    if device is None:
        device = seed.device if isinstance(seed, Tensor) else torch.device("cpu")
    device = torch.device(device)
    seed_t = (seed if isinstance(seed, Tensor) else torch.tensor(seed)).to(device=device, dtype=torch.int64).reshape(())
    if cu_seqlens is not None:
        offsets = [int(o) for o in cu_seqlens.tolist()]
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        if backend == "triton":
            longest = max(lengths, default=0)
            full = _triton_keep_mask(seed_t, len(lengths), heads, longest, p)
            return [full[n, :, :n_len, :n_len] for n, n_len in enumerate(lengths)]
        seed_int = int(seed_t.item())
        return [_reference_keep(_sequence_seed(seed_int, n), 1, heads, n_len, p, device)[0]
                for n, n_len in enumerate(lengths)]
    if backend == "triton":
        return _triton_keep_mask(seed_t, batch, heads, seq_len, p)
    return _reference_keep(int(seed_t.item()), batch, heads, seq_len, p, device)


def _reference_keep(seed: int, batch: int, heads: int, s_len: int, p: float, device) -> Tensor:
    keep = torch.empty((batch, heads, s_len, s_len), dtype=torch.bool, device=device)
    gen = torch.Generator(device=device)
    for qi, q0, q1 in _blocks(s_len, BLOCK_Q):
        for ki, k0, k1 in _blocks(s_len, BLOCK_K):
            keep[:, :, q0:q1, k0:k1] = _uniform_tile(gen, seed, qi, ki, (batch, heads, q1 - q0, k1 - k0), device) >= p
    return keep


__all__ = ["BLOCK_K", "BLOCK_Q", "MAX_SEQ_LEN", "MAX_TRITON_HEAD_DIM", "OP_NAME", "disentangled_attention",
           "disentangled_attention_keep_mask", "disentangled_attention_varlen", "relative_position_index"]
