"""Dropout that keeps a seed, not a mask: ``seeded_dropout(x, p)`` and ``SeededDropout`` (issue 33).

Stock ``nn.Dropout`` keeps its mask for backward: one byte per element on CUDA (a bool), the
compute dtype's size on the CPU (a scaled float). Where the dropout stands on its own, not fused
into the op after it (the residual dropouts MPNet's attention, GTE and Jina-v3 write inline as
``residual + self.dropout(x)``; embedding and classifier dropouts), that mask is all the block keeps
for it. This op keeps an 8-byte seed instead and draws the same mask again in backward:

    y = x · keep / (1 − p),   dx = dy · keep / (1 − p),   keep regenerated from (seed, element index)

The backward is the forward applied to dy with the same seed: one op, ``tempo::seeded_dropout``,
serves both. Nothing is recovered from an output: the mask is a pure function of the seed, so the
backward's mask is bitwise the forward's and nothing is approximated (no condition on the values).

Semantics
  * As ``F.dropout(x, p, training=True)``: each element is zeroed with probability ``p`` and the
    kept ones scaled by 1 / (1 − p), rounded once to x's dtype. Output: x's shape and dtype (dropout
    is on no autocast list), a fresh contiguous tensor; gradients in x's dtype.
  * The mask is the one ``tempo.ops.dropout_add_layernorm`` draws for a tensor of x's number of
    elements and the same seed: element i of the contiguous x is kept iff u_i >= p, u_i =
    ``tl.rand(seed, i)`` (Triton's philox, int64 counters) on the Triton path; on the reference path
    the i-th of the int32 words a ``torch.Generator`` seeded with the seed draws (that module's
    docstring). The paths draw different masks for one seed; ``seeded_dropout_keep_mask``
    regenerates the one a path used, and the backward uses the path its forward ran on. The seed
    is drawn from torch's RNG on x's device, so ``torch.manual_seed`` and checkpointing's RNG
    restore reproduce the mask (a recomputed block draws the same one).
  * With dropout (``training`` and 0 < p < 1) the op runs with or without a backward, so a no-grad
    forward replayed with grad from the same RNG state (GradCache, sentence-transformers'
    CachedMultipleNegativesRankingLoss) draws the same mask both times. Without dropout it is
    ``F.dropout`` itself (x returned as it is).
  * Paths: Triton (CUDA, fp32/fp16/bf16; the CPU under ``TRITON_INTERPRET=1`` when forced), one
    element-wise kernel; the reference path (CPU, fp64, any device) multiplies by the mask drawn as
    0.0 / 1.0 in x's dtype and by the scale: on one CPU core about what ``nn.Dropout`` costs (its
    bernoulli draw is the same order of work as the generator's words).
  * Bytes moved on CUDA, per direction: read x (or dy), write y (or dx); the stock dropout writes a
    1-byte mask in forward and reads it in backward, so this op moves less and keeps 8 bytes.

``SeededDropout`` is an ``nn.Dropout`` (a subclass: ``isinstance`` checks, ``m.p = 0`` idioms,
``eval()`` and hooks are the module's own) whose forward runs this op with dropout, and
``F.dropout`` otherwise. apply_tempo switches the class of a model's plain ``nn.Dropout`` modules to
it (tempo.integrations.dropouts); ``inplace=True`` modules stay stock (their callers may read the
input they overwrite), and p = 1 runs ``F.dropout`` (every element dropped; logged once).
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tempo.ops._backend import check_float_tensor, check_probability, launch_on, log_fallback_once, resolve_backend
from tempo.ops._backend import tl, triton  # None without triton (reference path only)
from tempo.ops.dropout_add_layernorm import _reference_keep_mask, _triton_keep_mask, draw_seed


OP = "seeded_dropout"
logger = logging.getLogger(__name__)
_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _seeded_dropout_kernel(X, Y, SEED, numel, p, scale, BLOCK: tl.constexpr):
        # int64 counters: the same philox stream as dropout_add_layernorm's keep-mask kernel.
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        x = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
        keep = tl.rand(tl.load(SEED), offsets) >= p
        tl.store(Y + offsets, tl.where(keep, x * scale, 0.0).to(Y.dtype.element_ty), mask=inside)


def _scale(p: float) -> float:
    return 1.0 / (1.0 - p)


def _apply_triton(x: Tensor, seed: Tensor, p: float) -> Tensor:
    y = torch.empty_like(x)
    with launch_on(x):
        _seeded_dropout_kernel[(triton.cdiv(x.numel(), _BLOCK),)](x, y, seed, x.numel(), p, _scale(p), BLOCK=_BLOCK)
    return y


def _apply_reference(x: Tensor, seed: Tensor, p: float) -> Tensor:
    keep = _reference_keep_mask(seed, x.numel(), p, x.device).view(x.shape).to(x.dtype)
    return keep.mul_(x).mul_(_scale(p))


def _check_backend(backend: str, where: str) -> None:
    if backend not in ("triton", "reference"):
        raise ValueError(f"{where}: argument 'backend' must be 'triton' or 'reference', got {backend!r}")


@torch.library.custom_op("tempo::seeded_dropout", mutates_args=())
def seeded_dropout_op(x: Tensor, seed: Tensor, p: float, backend: str) -> Tensor:
    """x contiguous, seed a 0-d int64 tensor, 0 <= p < 1 -> x · keep / (1 − p), keep drawn from
    (seed, element index) on ``backend``. Its own backward (dropout is linear in x)."""
    _check_backend(backend, "tempo::seeded_dropout")
    if backend == "triton" and x.numel() > 0:
        return _apply_triton(x, seed, p)
    return _apply_reference(x, seed, p)


@seeded_dropout_op.register_fake
def _(x, seed, p, backend):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    _x, seed, p, backend = inputs
    ctx.save_for_backward(seed)  # the seed alone: no mask, no input, no output
    ctx.p, ctx.backend = p, backend


def _backward(ctx, grad):
    (seed,) = ctx.saved_tensors
    return torch.ops.tempo.seeded_dropout(grad.contiguous(), seed, ctx.p, ctx.backend), None, None, None


seeded_dropout_op.register_autograd(_backward, setup_context=_setup_context)


def _choose_backend(x: Tensor) -> str:
    backend = resolve_backend(x, OP)
    return "reference" if x.numel() == 0 else backend


def seeded_dropout(x: Tensor, p: float = 0.5, training: bool = True, seed: Optional[Tensor] = None) -> Tensor:
    """``F.dropout(x, p, training)`` keeping a seed for backward instead of the mask (module
    docstring). ``seed`` (a one-element integer tensor) fixes the mask; by default one is drawn from
    torch's RNG on x's device. 0 <= p < 1 (p = 1 keeps nothing worth a seed: use ``F.dropout``)."""
    check_float_tensor(x, "x", OP)
    p = check_probability(p, "p", OP)
    if not training or p == 0.0:
        return F.dropout(x, p, training)
    if seed is None:
        seed = draw_seed(x.device)
    else:
        seed = _seed_tensor(seed, x.device)
    return seeded_dropout_op(x.contiguous(), seed, p, _choose_backend(x))


def _seed_tensor(seed: object, device: torch.device) -> Tensor:
    if not isinstance(seed, Tensor) or seed.numel() != 1 or seed.is_floating_point() or seed.is_complex():
        raise TypeError(f"{OP}: argument 'seed' must be a one-element integer tensor, got {seed!r}"[:200])
    return seed.to(device=device, dtype=torch.int64).reshape(())


def seeded_dropout_keep_mask(seed: Tensor, shape: Sequence[int], p: float, device, backend: str) -> Tensor:
    """The bool keep mask (True = kept) ``backend`` ("triton" or "reference") draws for an x of
    ``shape`` with ``seed``: the one its forward multiplied by and its backward draws again."""
    _check_backend(backend, "seeded_dropout_keep_mask")
    p = check_probability(p, "p", "seeded_dropout_keep_mask")
    shape = tuple(int(s) for s in shape)
    device = torch.device(device)
    seed = _seed_tensor(seed, device)
    numel = math.prod(shape)
    keep = _reference_keep_mask(seed, numel, p, device) if backend == "reference" else \
        _triton_keep_mask(seed, numel, p, device)
    return keep.view(shape)


class SeededDropout(nn.Dropout):
    """``nn.Dropout`` keeping a seed for backward instead of its mask (module docstring). Reads
    ``p``, ``inplace`` and ``training`` at every forward, as ``nn.Dropout`` does."""

    def forward(self, input: Tensor) -> Tensor:
        if (not self.training or self.inplace or not 0.0 < self.p < 1.0 or not isinstance(input, Tensor)
                or not input.is_floating_point()):
            if self.training and self.p >= 1.0:
                log_fallback_once(f"{OP}:p1", f"{OP}: p = {self.p} drops every element; running F.dropout "
                                  "(it keeps a mask)")
            return F.dropout(input, self.p, self.training, self.inplace)
        return seeded_dropout(input, self.p, True)


__all__ = ["SeededDropout", "seeded_dropout", "seeded_dropout_keep_mask", "seeded_dropout_op"]
