"""Boolean masks packed 8 to a byte, for the reference (PyTorch) path.

Layout shared with the Triton kernels: element ``i`` of the flattened mask is bit ``i % 8``
(least significant first) of byte ``i // 8``; the last byte is zero-padded. A kernel that packs
its own bits must follow the same layout so either path can unpack what the other packed.
"""

from __future__ import annotations

import torch

_BIT_WEIGHTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    weights = _BIT_WEIGHTS_CACHE.get(device)
    if weights is None:
        weights = (1 << torch.arange(8, dtype=torch.int32)).to(device=device, dtype=torch.uint8)
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
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # Multiply-and-sum in uint8 cannot overflow: the 8 weights sum to 255.
    return (flat.view(-1, 8).to(torch.uint8) * _bit_weights(mask.device)).sum(dim=1, dtype=torch.uint8)


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
