"""A plan per rank: what DDP and FSDP2 hold on each GPU beside the step that one process counts.

Every rank runs the step of its own batch, so the activations, their transients and the workspace
are the one-process step's at the rank's tokens (tempo.plan.compose). What the engine changes is
the model's state and the buffers it communicates through (read from torch 2.13's
``torch/nn/parallel/distributed.py`` and ``torch/distributed/fsdp/_fully_shard/``, and measured
on 2 CPU processes: tests/test_plan_parallel.py):

- **DDP** (``DistributedDataParallel(model)``, its defaults): a whole replica of the weights,
  gradients and optimizer states, and its gradient buckets, one more copy of every trainable
  parameter's gradient, made when DDP wraps the model and kept for good
  (``gradient_as_bucket_view=False``).
- **FSDP2** (``fully_shard`` on every Transformer block, then on the root, default policy:
  parameters in their own dtype, resharded after forward): each rank keeps a shard of every
  parameter (dim 0 padded to a multiple of the world size), of every gradient and of the optimizer
  states. In forward and backward the root's own parameters (embeddings, head, final norm) are
  unsharded (the root does not reshard after forward), and around the block being computed: its
  unsharded parameters and the all-gather of the next one (prefetched; in forward the all-gather
  output beside the unsharded copy it fills); in backward, also the reduce-scatter input of the
  block before (FSDP2 keeps one in flight until the next block's reduce). A block's gradients are
  whole while its backward makes them and a shard after its reduce-scatter; the root's are whole
  until the end of backward.

So the per-rank peak is the one-process composition's, each segment moved by a constant (these
buffers do not grow with the tokens): ``Sharding.offset``.

Step time: each rank's compute is the one-process projection at its tokens; the collectives move,
per rank and step (ring algorithms, bytes sent): DDP's all-reduce 2(N-1)/N of the gradients; FSDP2's
all-gathers (N-1)/N of the weights in forward and of the blocks' again in backward, and its
reduce-scatter (N-1)/N of the gradients. At ``INTERCONNECT``'s bandwidth, the step is projected as a
range: the collectives hidden behind compute (the engines overlap them) to not overlapped at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tempo.plan.budget import PlanError

ENGINES = ("ddp", "fsdp2")
# GB/s per GPU and direction: (NVLink inside a node, the network across nodes). NVLink: NVIDIA's
# datasheets give 900 (H100 SXM, NVLink 4), 600 (A100 SXM, NVLink 3) and 300 (V100 SXM2, NVLink 2)
# GB/s both directions together; across nodes one 400 Gb/s NDR InfiniBand port per GPU (DGX H100),
# 200 Gb/s HDR (DGX A100), 100 Gb/s EDR (DGX-1/DGX-2 class). Peaks: nccl-tests reach ~80-90 % of them.
INTERCONNECT = {"H100": (450.0, 50.0), "A100": (300.0, 25.0), "V100": (150.0, 12.5)}
GPUS_PER_NODE = 8


def _bytes(shape: tuple, dtype: torch.dtype, round_to: int) -> int:
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    return -(-n // round_to) * round_to if round_to > 1 and n else n


def shard_shape(shape: tuple, world_size: int) -> tuple:
    """The shape of a rank's shard of a parameter under FSDP2: dim 0 split into ``world_size``
    chunks, each padded to the largest (``ceil(dim0 / N)`` rows); a 0-d parameter is kept whole."""
    if not shape:
        return tuple(shape)
    return (-(-shape[0] // world_size), *shape[1:])


@dataclass(frozen=True)
class Sharding:
    """What one rank of ``engine`` over ``world_size`` processes holds beside the one-process step
    (module docstring), in bytes."""

    engine: str
    world_size: int
    weights: int  # per rank: DDP's whole replica, FSDP2's padded shards (and buffers, whole)
    full_gradients: int  # every trainable parameter's gradient, whole (what one process keeps)
    gradients: int  # per rank after backward: DDP's whole, FSDP2's shards
    buckets: int  # DDP's gradient buckets
    root: int  # FSDP2: the root's own parameters, whole
    block: int  # FSDP2: the largest block's parameters, whole
    block_gradients: int  # FSDP2: the largest block's trainable parameters' gradients, whole
    blocks: int
    sent_bytes: int  # per rank and step, by the collectives
    shards: tuple = ()  # FSDP2: meta parameters of a rank's shard shapes (for the optimizer's states)

    def offset(self, segment: tuple) -> int:
        """Bytes this rank holds at ``segment`` of the composed step beyond the one-process step's
        activations, transients and gradients (module docstring): ``buffers + gradient_change``."""
        return self.buffers(segment) + self.gradient_change(segment)

    def buffers(self, segment: tuple) -> int:
        """What the engine holds at ``segment`` to compute and communicate: DDP's buckets; FSDP2's
        unsharded parameters, all-gather outputs and reduce-scatter input (module docstring)."""
        if self.engine == "ddp":
            return self.buckets
        L, R, B = self.blocks, self.root, self.block
        phase = segment[0]
        if phase == "end":  # after backward: the root resharded, the last reduce-scatter waited for
            return 0
        position = segment[1] if len(segment) > 1 else L + 1
        if phase in ("fwd", "fwd_end"):
            if position == 0:  # the root's all-gather output beside the unsharded copy it fills
                return 2 * R
            return R + 2 * B if 1 <= position <= L else R
        if position == L + 1:
            return R + B  # the head: the last block prefetched
        if position == 0:
            return R + B  # the first block's reduce-scatter input in flight
        return R + (2 if position == L else 3) * B

    def gradient_change(self, segment: tuple) -> int:
        """The gradients this rank holds at ``segment`` less what one process holds there: FSDP2's
        blocks done with backward keep shards; after backward every gradient is a shard."""
        if self.engine == "ddp":
            return 0
        if segment[0] == "end":
            return self.gradients - self.full_gradients
        if segment[0] != "bwd":
            return 0
        done = self.blocks - min(segment[1], self.blocks) if segment[1] <= self.blocks else 0
        whole = done * self.block_gradients
        return -(whole - whole // self.world_size)


def sharding(model: nn.Module, engine: Optional[str], world_size: int, round_to: int = 1) -> Optional[Sharding]:
    """The ``Sharding`` of ``model`` (its Transformer blocks from tempo.integrations.recompute) for
    ``engine`` over ``world_size`` processes; None for one process without an engine."""
    from tempo.integrations.recompute import transformer_blocks

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"tempo.plan: argument 'world_size' must be a positive integer, got {world_size!r}")
    if engine is None:
        if world_size != 1:
            raise PlanError(f"tempo.plan: world_size={world_size} needs argument 'parallel' ('ddp' or 'fsdp2')")
        return None
    if engine not in ENGINES:
        raise PlanError(f"tempo.plan: argument 'parallel' must be one of {', '.join(ENGINES)} or None, got {engine!r}")
    params = list({id(p): p for p in model.parameters()}.values())
    buffers = list({id(b): b for b in model.buffers()}.values())
    trainable = [p for p in params if p.requires_grad]
    full_gradients = sum(_bytes(tuple(p.shape), p.dtype, round_to) for p in trainable)
    if engine == "ddp":
        weights = sum(_bytes(tuple(t.shape), t.dtype, round_to) for t in (*params, *buffers))
        sent = 2 * (world_size - 1) * full_gradients // world_size
        return Sharding(engine, world_size, weights, full_gradients, full_gradients, full_gradients, 0, 0, 0, 0, sent)
    try:
        blocks = transformer_blocks(model)
    except ValueError as err:
        raise PlanError(f"tempo.plan: parallel='fsdp2' shards per Transformer block: {err}") from None
    in_blocks: set = set()
    block, block_gradients = 0, 0
    for b in blocks:
        own = list({id(p): p for p in b.parameters()}.values())
        in_blocks.update(id(p) for p in own)
        block = max(block, sum(_bytes(tuple(p.shape), p.dtype, round_to) for p in own))
        block_gradients = max(block_gradients,
                              sum(_bytes(tuple(p.shape), p.dtype, round_to) for p in own if p.requires_grad))
    root = sum(_bytes(tuple(p.shape), p.dtype, round_to) for p in params if id(p) not in in_blocks)
    shards = tuple(nn.Parameter(torch.empty(shard_shape(tuple(p.shape), world_size), dtype=p.dtype, device="meta"),
                                requires_grad=p.requires_grad) for p in params)
    weights = (sum(_bytes(tuple(s.shape), s.dtype, round_to) for s in shards)
               + sum(_bytes(tuple(b.shape), b.dtype, round_to) for b in buffers))
    gradients = sum(_bytes(tuple(s.shape), s.dtype, round_to) for s in shards if s.requires_grad)
    whole = sum(_bytes(tuple(p.shape), p.dtype, round_to) for p in params)
    block_total = sum(_bytes(tuple(p.shape), p.dtype, round_to) for p in params if id(p) in in_blocks)
    sent = (world_size - 1) * (whole + block_total + full_gradients) // world_size
    return Sharding(engine, world_size, weights, full_gradients, gradients, 0, root, block, block_gradients,
                    len(blocks), sent, shards)


def collective_seconds(sharding: Optional[Sharding], gpu_name: Optional[str]) -> Optional[float]:
    """Seconds the collectives of a step take at ``INTERCONNECT``'s bandwidth (NVLink up to
    ``GPUS_PER_NODE`` GPUs, the network beyond); None without numbers for the GPU."""
    if sharding is None or sharding.world_size == 1:
        return 0.0
    if gpu_name not in INTERCONNECT:
        return None
    nvlink, network = INTERCONNECT[gpu_name]
    bandwidth = nvlink if sharding.world_size <= GPUS_PER_NODE else network
    return sharding.sent_bytes / (bandwidth * 1e9)


def wrap(model: nn.Module, engine: str, **kwargs) -> nn.Module:
    """``model`` wrapped as a plan with ``parallel=engine`` counted it: DDP around it (returned), or
    ``fully_shard`` on each Transformer block and then the root (in place; returned). Needs an
    initialized process group (torchrun); ``kwargs`` go to DistributedDataParallel / fully_shard."""
    import torch.distributed as dist

    if engine not in ENGINES:
        raise PlanError(f"tempo.plan: parallel must be one of {', '.join(ENGINES)}, got {engine!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError(f"tempo.plan: parallel={engine!r} needs an initialized process group (run under torchrun)")
    if engine == "ddp":
        return nn.parallel.DistributedDataParallel(model, **kwargs)
    from tempo.integrations.recompute import fully_shard_blocks

    return fully_shard_blocks(model, **kwargs)


__all__ = ["ENGINES", "GPUS_PER_NODE", "INTERCONNECT", "Sharding", "collective_seconds", "shard_shape", "sharding",
           "wrap"]

