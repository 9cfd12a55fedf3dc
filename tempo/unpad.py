"""The unpadded batch: the T real tokens of a padded [B, L] batch, and where each sequence starts.

Half of what BERT computes at s = 384/512 is padding. Every layer of a Transformer except
attention works token by token, so it can run on the T real tokens alone ([T, H] instead of
[B, L, H]); attention then needs to know which tokens form one sequence: ``cu_seqlens`` (int32
[B + 1], sequence b is tokens cu_seqlens[b]:cu_seqlens[b + 1]) and the longest length
``max_seqlen``, the layout FlashAttention's variable-length kernels take.

``TokenLayout`` is that description, made once per batch from the attention mask and passed down
the whole stack (model, attention ops, heads, trainers, ledger): the padded path is the same code
with T = B·L and every sequence of length L. Left and right padding are both fine; a token keeps
the position it had in the padded row, so the position embeddings are the padded model's.

Bad input is refused before any compute, naming the argument: a mask that is not 0/1, real tokens
that are not contiguous within a row (a hole), a row without any real token (its [CLS] would not
exist: an error, not a silent zero), and ``cu_seqlens`` that do not start at 0, do not increase or
do not end at T. One host read of the mask (the lengths) per batch, and none in any layer: the
layout knows ``max_seqlen`` and ``min_seqlen`` on the host and records its ``cu_seqlens`` with the
attention ops (``tempo.ops.attention.remember_sequences``), so the variable-length attention never
reads them back from the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


class LayoutError(ValueError):
    """A mask or ``cu_seqlens`` that does not describe sequences of contiguous real tokens."""


@dataclass(frozen=True)
class TokenLayout:
    """Where the T real tokens of a [B, L] batch sit.

    ``indices``: int64 [T], flat position b·L + i of each real token in the padded batch, sequence
    by sequence; ``cu_seqlens``: int32 [B + 1]; ``max_seqlen``/``min_seqlen``: host ints, the
    longest and shortest sequence; ``batch_size`` B and ``seq_len`` L of the padded batch;
    ``lengths``: host tuple of the B lengths.
    """

    indices: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    batch_size: int
    seq_len: int
    lengths: tuple[int, ...]
    min_seqlen: int = 0

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_mask(cls, attention_mask: Tensor, arg: str = "attention_mask") -> "TokenLayout":
        """The layout of a [B, L] 0/1 mask (1 = real token); see the module docstring for errors."""
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask)
            raise LayoutError(f"argument '{arg}' must be a [batch, seq_len] tensor, got {shape}")
        b, l = attention_mask.shape
        mask = attention_mask.to(torch.int64)
        # One host read: per row its length, first real position, and whether the row is a
        # contiguous run of ones (the first and last one are exactly length - 1 apart).
        positions = torch.arange(l, device=mask.device)
        is_real = mask != 0
        lengths = is_real.sum(1)
        first = torch.where(is_real, positions, l).amin(1)
        last = torch.where(is_real, positions, -1).amax(1)
        bad_values = ((mask != 0) & (mask != 1)).sum(1)
        stats = torch.stack([lengths, first, last, bad_values], 1).tolist()  # the one host read
        for row, (length, start, end, bad) in enumerate(stats):
            if bad:
                raise LayoutError(f"argument '{arg}' must hold 0 and 1 only; row {row} has other values")
            if length == 0:
                raise LayoutError(f"argument '{arg}': row {row} has no real token (every sequence needs its "
                                  f"[CLS]); drop empty rows from the batch")
            if end - start + 1 != length:
                raise LayoutError(f"argument '{arg}': row {row}'s real tokens are not contiguous (positions "
                                  f"{start}..{end} hold {length} of them); only left or right padding is supported")
        lengths_list = tuple(int(row[0]) for row in stats)
        # The T real positions, ascending, without another host read: T is known, so a stable sort
        # of the flags (real ones first, in order) replaces nonzero (which must read its size).
        real = is_real.reshape(-1)
        indices = torch.sort(real.to(torch.uint8), stable=True, descending=True).indices[:sum(lengths_list)]
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # on the device
        return cls._build(indices, lengths_list, b, l, mask.device, cu_seqlens)

    @classmethod
    def full(cls, batch_size: int, seq_len: int, device: torch.device | str) -> "TokenLayout":
        """Every row all real tokens: the padded batch seen as B sequences of length L."""
        indices = torch.arange(batch_size * seq_len, device=device)
        cu_seqlens = torch.arange(0, (batch_size + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
        return cls._build(indices, (seq_len,) * batch_size, batch_size, seq_len, torch.device(device), cu_seqlens)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor, total_tokens: int, arg: str = "cu_seqlens") -> "TokenLayout":
        """Packed sequences given by ``cu_seqlens`` (padding-free batches: one row of T tokens)."""
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise LayoutError(f"argument '{arg}' must be a 1-D tensor of at least 2 offsets")
        if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            raise LayoutError(f"argument '{arg}' must be an integer tensor, got {cu_seqlens.dtype}")
        offsets = [int(v) for v in cu_seqlens.tolist()]  # the one host read
        if offsets[0] != 0:
            raise LayoutError(f"argument '{arg}' must start at 0, got {offsets[0]}")
        lengths = tuple(b - a for a, b in zip(offsets, offsets[1:]))
        if any(n <= 0 for n in lengths):
            raise LayoutError(f"argument '{arg}' must increase strictly, got {offsets}")
        if offsets[-1] != total_tokens:
            raise LayoutError(f"argument '{arg}' ends at {offsets[-1]} but there are {total_tokens} tokens")
        device = cu_seqlens.device
        indices = torch.arange(total_tokens, device=device)
        return cls._build(indices, lengths, 1, total_tokens, device, cu_seqlens.to(torch.int32))

    @classmethod
    def _build(cls, indices: Tensor, lengths: tuple[int, ...], b: int, l: int, device,
               cu_seqlens: Tensor) -> "TokenLayout":
        """``cu_seqlens``: int32 [B + 1] on the device, holding the offsets of ``lengths``."""
        from tempo.ops.attention import remember_sequences  # the ops sit below this module

        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        facts = remember_sequences(cu_seqlens, offsets)  # the attention ops never read it back
        return cls(indices=indices, cu_seqlens=cu_seqlens, max_seqlen=facts.max_seqlen, batch_size=b, seq_len=l,
                   lengths=lengths, min_seqlen=facts.min_seqlen)

    # -- what it tells -----------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return int(self.indices.numel())

    @property
    def padding_tokens(self) -> int:
        return self.batch_size * self.seq_len - self.total_tokens

    @property
    def is_full(self) -> bool:
        """No padding at all (T = B·L)."""
        return self.padding_tokens == 0

    def positions(self) -> Tensor:
        """int64 [T]: each real token's position in its padded row (left padding keeps its offset)."""
        return self.indices % self.seq_len

    def first_tokens(self) -> Tensor:
        """int64 [B]: index in [0, T) of each sequence's first real token ([CLS])."""
        return self.cu_seqlens[:-1].long()

    def token_index(self, positions: Tensor) -> Tensor:
        """[B, P] positions in the padded rows -> [B, P] indices in [0, T) (positions must be real tokens)."""
        start = self.indices[self.first_tokens()] % self.seq_len  # first real position per row
        return (self.cu_seqlens[:-1].long().unsqueeze(1) + positions.long() - start.unsqueeze(1)).clamp_(
            0, max(self.total_tokens - 1, 0))

    def sequence_ids(self) -> Tensor:
        """int64 [T]: the sequence each token belongs to."""
        lengths = torch.tensor(self.lengths, device=self.indices.device)
        return torch.repeat_interleave(torch.arange(len(self.lengths), device=self.indices.device), lengths)

    # -- moving tensors between the layouts --------------------------------------------------------
    def unpad(self, x: Tensor) -> Tensor:
        """[B, L, ...] -> [T, ...]: the real tokens only, sequence by sequence."""
        if tuple(x.shape[:2]) != (self.batch_size, self.seq_len):
            raise LayoutError(f"unpad: expected a [{self.batch_size}, {self.seq_len}, ...] tensor, got "
                              f"{tuple(x.shape)}")
        return x.reshape(self.batch_size * self.seq_len, *x.shape[2:]).index_select(0, self.indices)

    def pad(self, x: Tensor, value: float = 0.0) -> Tensor:
        """[T, ...] -> [B, L, ...], ``value`` at padding positions."""
        if x.shape[0] != self.total_tokens:
            raise LayoutError(f"pad: expected {self.total_tokens} tokens, got a tensor of shape {tuple(x.shape)}")
        out = x.new_full((self.batch_size * self.seq_len, *x.shape[1:]), value)
        out = out.index_copy(0, self.indices, x)
        return out.view(self.batch_size, self.seq_len, *x.shape[1:])

    def real_mask(self) -> Tensor:
        """bool [B, L]: True at real tokens."""
        mask = torch.zeros(self.batch_size * self.seq_len, dtype=torch.bool, device=self.indices.device)
        mask[self.indices] = True
        return mask.view(self.batch_size, self.seq_len)


def layout_or_none(attention_mask: Optional[Tensor], unpad: bool) -> Optional[TokenLayout]:
    """The batch's layout when ``unpad`` and a mask is given, else None (the padded path)."""
    return TokenLayout.from_mask(attention_mask) if unpad and attention_mask is not None else None


__all__ = ["LayoutError", "TokenLayout", "layout_or_none"]
