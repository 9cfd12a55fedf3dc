"""Boolean masks packed 8 to a byte, for the reference (PyTorch) path.

Layout shared with the Triton kernels: element ``i`` of the flattened mask is bit ``i % 8``
(least significant first) of byte ``i // 8``; the last byte is zero-padded. A kernel that packs
its own bits must follow the same layout so either path can unpack what the other packed.

``pack_bits`` runs on every forward of the CPU path, so it works on 4 flags at a time: the bool
bytes of 4 consecutive elements, read as one little-endian int32, hold the flags at bits 0, 8,
16 and 24; multiplying by 2^0 + 2^7 + 2^14 + 2^21 moves flag j to bit 21 + j (every partial
product lands on its own bit, so there are no carries) and the product stays below 2^47, so
int64 never overflows. Two such nibbles make a byte. Six cheap passes over n/4 elements instead
of a multiply-and-sum over an [n/8, 8] view (about 3x faster on the CPU).
"""

from __future__ import annotations

import sys

import torch

_BIT_WEIGHTS_CACHE: dict[torch.device, torch.Tensor] = {}
# Flag j of an int32 group of 4 bool bytes sits at bit 8j: this multiplier moves it to bit 21 + j.
_NIBBLE_MULTIPLIER = (1 << 0) + (1 << 7) + (1 << 14) + (1 << 21)
# Reading bool bytes as int32 words assumes little-endian storage (every platform torch ships for).
_LITTLE_ENDIAN = sys.byteorder == "little"


def _bit_weights(device: torch.device) -> torch.Tensor:
    weights = _BIT_WEIGHTS_CACHE.get(device)
    if weights is None:
        weights = (1 << torch.arange(8, dtype=torch.int32, device="cpu")).to(device=device, dtype=torch.uint8)
        _BIT_WEIGHTS_CACHE[device] = weights
    return weights


def packed_numel(numel: int) -> int:
    """Bytes needed for ``numel`` bits."""
    return (numel + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (any shape) into a flat uint8 tensor of ceil(numel / 8) bytes."""
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_bits: argument 'mask' must be a bool tensor, got {mask.dtype}")
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad or flat.storage_offset() % 4:
        # The int32 view needs whole groups and a 4-byte aligned start: a fresh padded copy has both.
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if not _LITTLE_ENDIAN:
        # Multiply-and-sum in uint8 cannot overflow: the 8 weights sum to 255.
        return (flat.view(-1, 8).to(torch.uint8) * _bit_weights(mask.device)).sum(dim=1, dtype=torch.uint8)
    nibbles = flat.view(torch.uint8).view(torch.int32).to(torch.int64)
    nibbles.mul_(_NIBBLE_MULTIPLIER).bitwise_right_shift_(21).bitwise_and_(15)
    pairs = nibbles.view(-1, 2)
    return torch.add(pairs[:, 0], pairs[:, 1], alpha=16).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of pack_bits: a bool tensor of ``shape``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits: argument 'packed' must be a uint8 tensor, got {packed.dtype}")
    numel = 1
    for size in shape:
        numel *= int(size)
    if packed.numel() != packed_numel(numel):
        raise ValueError(
            f"unpack_bits: {packed.numel()} bytes cannot hold a mask of shape {tuple(shape)} "
            f"({packed_numel(numel)} bytes expected)"
        )
    bits = (packed.reshape(-1, 1) & _bit_weights(packed.device)) != 0
    return bits.reshape(-1)[:numel].reshape(shape)
