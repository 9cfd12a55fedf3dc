"""One training step on fake tensors, recorded as a memory timeline and as ops, segment by segment.

The planner needs, for every part of a model (the layers before the Transformer blocks, each block,
the head and loss), what it allocates, when each allocation is freed, and the peak inside it, in
forward and in backward. ``trace_step`` runs one training step of a model on fake tensors
(``FakeTensorMode``: shapes and dtypes exact, no data, no FLOP) under a dispatch mode that
  * records every new storage an op makes (bytes, rounded as the CUDA caching allocator rounds
    them when counting for a GPU: 512-byte blocks) and, through a weak reference to the storage,
    the moment it is freed (the segment running then). An output that shares an input's storage
    (a view or an in-place result: ``t`` of a weight in ``linear``, ``view`` of the labels) is no
    allocation: a storage the timeline has not seen made is one that existed before the step
    (weights, inputs), which the planner counts itself or not at all;
  * keeps the live bytes and the peak of each segment;
  * records the ops themselves (tempo.movement's Recorder: FLOPs and bytes moved, for the time).
Segments are marked by hooks on the blocks (forward pre-hooks; backward pre-hooks and the first
block's backward hook) and by the driver: ``("fwd", i)`` / ``("bwd", i)`` with position 0 for what
runs before the first block, 1..k for the blocks, k + 1 for what runs after the last one (head and
loss); ``("fwd_end",)`` covers the end of the autocast region (its weight-cast cache is freed then)
and ``("end",)`` what is freed after backward. Tensors that exist before the step (weights, inputs)
are not in the timeline: the planner counts weights, gradients' storage and optimizer states itself.

With ``semantics="cuda"`` the CPU fake tensors take the CUDA build's decisions
(tempo.movement.trace.CudaSemantics: autocast's fp32 policies, bool dropout masks, sdpa's fused
kernels), so the timeline is what a GPU allocates; ``"cpu"`` runs the CPU's own paths (Tempo's
reference ops, CPU dropout), what a CPU step allocates.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from tempo.movement.trace import CudaSemantics, OpCall, Recorder
from tempo.ops.linear_cross_entropy import SCRATCH

Segment = tuple  # ("fwd", i) | ("bwd", i) | ("fwd_end",) | ("end",)
CUDA_BLOCK = 512  # the CUDA caching allocator's rounding (kMinBlockSize)


@dataclass
class Allocation:
    """One storage made during the step."""

    nbytes: int
    made: Segment
    freed: Optional[Segment] = None  # None: still alive at the end of the step (gradients)
    output_of: Optional[int] = None  # the position whose output (hidden states) this storage is


@dataclass
class SegmentRecord:
    start: int = 0  # live bytes when the segment began
    peak: int = 0  # the highest live bytes while it ran
    calls: list[OpCall] = field(default_factory=list)
    flows: list = field(default_factory=list)  # per call: (read storages, written storages) as (id, bytes)
    own: int = 0  # bytes made in this segment and alive now
    own_peak: int = 0  # the most of those alive at once (what the segment adds above its start, if
    #                    nothing older were freed before its peak: start + own_peak >= peak)
    # The live bytes after each op that allocated: the candidates for the peak. At two token counts
    # they pair one to one (the same ops), so each is a line in the tokens, and the segment's peak
    # is the highest of those lines at any t, not the line through the two peaks (which moment is
    # the peak can change with t: a constant weight gradient against the logits' fp32 gradient).
    events: list = field(default_factory=list)


@dataclass
class StepTrace:
    """What ``trace_step`` saw: every allocation, and each segment's start, peak and ops."""

    blocks: int
    allocations: list[Allocation]
    segments: dict[Segment, SegmentRecord]

    def order(self) -> list[Segment]:
        k = self.blocks
        return ([("fwd", i) for i in range(k + 2)] + [("fwd_end",)]
                + [("bwd", i) for i in range(k + 1, -1, -1)] + [("end",)])

    def peak(self) -> int:
        return max(s.peak for s in self.segments.values())


class MemoryTimeline(Recorder):
    """Recorder (ops, FLOPs, bytes moved) that also follows every storage's life (module docstring)."""

    def __init__(self, round_to: int = 1, kernels: bool = False) -> None:
        super().__init__()
        self.round_to = round_to
        self.kernels = kernels  # an op's inside as its Triton path holds it (a CUDA step), else its reference path
        self.allocations: list[Allocation] = []
        self.segments: dict[Segment, SegmentRecord] = {}
        self.segment: Segment = ("fwd", 0)
        self.live = 0
        # storage -> its Allocation; None: a storage from before the step (never counted)
        self._known: "weakref.WeakKeyDictionary[Any, Optional[Allocation]]" = weakref.WeakKeyDictionary()
        self._ids: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # storage -> its id
        self._next_id = 0
        self._refs: list[Any] = []
        self.enter(("fwd", 0))

    def enter(self, segment: Segment) -> None:
        self.segment = segment
        record = self.segments.setdefault(segment, SegmentRecord(self.live, self.live))
        record.peak = max(record.peak, self.live)

    def _rounded(self, nbytes: int) -> int:
        if self.round_to <= 1 or nbytes == 0:
            return nbytes
        return -(-nbytes // self.round_to) * self.round_to

    def stop(self) -> None:
        """Stop following storages: those alive now stay "never freed" (dropping the weak references
        drops their callbacks)."""
        self._refs.clear()

    def mark_output(self, t: Any, position: int) -> None:
        """``t`` is the output (hidden states) of ``position``: its consumer decides how long it lives."""
        if isinstance(t, Tensor):
            try:
                allocation = self._known.get(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                allocation = None
            if allocation is not None:
                allocation.output_of = position

    def _freed(self, allocation: Allocation) -> None:
        allocation.freed = self.segment
        self.live -= allocation.nbytes
        if allocation.made == self.segment:
            self.segments[self.segment].own -= allocation.nbytes

    def _track(self, out: Any, inputs: set[int]) -> None:
        allocated = False
        for t in pytree.tree_leaves(out):
            if not isinstance(t, Tensor) or t.is_nested:
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage in self._known:
                continue
            if id(storage) in inputs:  # an input's storage the step did not make: it existed before
                self._known[storage] = None
                continue
            allocation = Allocation(self._rounded(storage.nbytes()), self.segment)
            self._known[storage] = allocation
            self.allocations.append(allocation)
            self._refs.append(weakref.ref(storage, lambda _ref, a=allocation: self._freed(a)))
            self.live += allocation.nbytes
            self.segments[self.segment].own += allocation.nbytes
            allocated = True
        record = self.segments[self.segment]
        if allocated:
            record.events.append(self.live)
        record.peak = max(record.peak, self.live)
        record.own_peak = max(record.own_peak, record.own)

    def _storage_id(self, t: Tensor) -> Optional[int]:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        ident = self._ids.get(storage)
        if ident is None:
            self._next_id += 1
            ident = self._ids[storage] = self._next_id
        return ident

    def recorded(self, call: OpCall, reads: list[Tensor], writes: list[Tensor]) -> None:
        """The storages each op reads and writes (tempo.plan.fusion follows the data through them)."""
        def flow(tensors: list[Tensor], metas: tuple) -> tuple:
            return tuple((self._storage_id(t), meta.nbytes) for t, meta in zip(tensors, metas)
                         if not t.is_nested)
        record = self.segments[self.segment]
        record.calls.append(call)
        record.flows.append((flow(reads, call.reads), flow(writes, call.writes)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = _storages(pytree.tree_leaves((args, kwargs)))  # held: their ids stay theirs during the op
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._track(out, {id(s) for s in inputs})
        scratch = SCRATCH.get(str(func.overloadpacket))
        if scratch is not None:  # what the op holds inside (this mode sees the op, not the ops in it)
            self._momentary(self._rounded(scratch(args, self.kernels)))
        return out

    def _momentary(self, nbytes: int) -> None:
        """``nbytes`` alive for a moment now, above the live bytes: a peak candidate of the segment."""
        record = self.segments[self.segment]
        record.events.append(self.live + nbytes)
        record.peak = max(record.peak, self.live + nbytes)
        record.own_peak = max(record.own_peak, record.own + nbytes)


def _storages(leaves: list) -> list:
    out = []
    for t in leaves:
        if isinstance(t, Tensor) and not t.is_nested:
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):  # a subclass without a storage
                pass
    return out


@contextlib.contextmanager
def segment_hooks(timeline: MemoryTimeline, blocks: list[nn.Module]) -> Iterator[None]:
    """Hooks marking the segments (module docstring) on ``blocks``, removed on exit. Backward
    segments are marked by hooks on the hidden-states tensors (a block's backward begins when the
    gradient of its output is ready; the part before the blocks, when the first block's input's is),
    not by module backward hooks, which hold the gradients they see until the module's backward ends
    and would change what they measure."""
    k = len(blocks)
    handles = []

    def on_gradient(segment: tuple):
        def hook(grad: Tensor) -> None:
            timeline.enter(segment)
        return hook

    def hidden(value: Any) -> Optional[Tensor]:
        if isinstance(value, (tuple, list)):
            value = value[0] if value else None
        return value if isinstance(value, Tensor) else None

    def entering(i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # The hidden states a block gets are the output of what ran before it (pre or block i-1).
            states = hidden(args[0] if args else kwargs.get("hidden_states"))
            timeline.mark_output(states, i - 1)
            if i == 1 and states is not None and states.requires_grad:
                states.register_hook(on_gradient(("bwd", 0)))
            timeline.enter(("fwd", i))
        return hook

    def leaving(i: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            states = hidden(output)
            if states is not None and states.requires_grad:
                states.register_hook(on_gradient(("bwd", i)))
            if i == k:
                timeline.mark_output(states, k)
                timeline.enter(("fwd", k + 1))
        return hook

    for i, block in enumerate(blocks, start=1):
        handles.append(block.register_forward_pre_hook(entering(i), with_kwargs=True))
        handles.append(block.register_forward_hook(leaving(i), always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def default_loss(output: Any) -> Tensor:
    """The model's own loss when it returns one (``labels`` given), else the mean of squares of its
    first floating-point output in fp32 (a stand-in with the cost of a small head)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    if hasattr(output, "to_tuple"):  # transformers' ModelOutput
        output = output.to_tuple()
    first = output[0] if isinstance(output, (tuple, list)) and output else output
    if not isinstance(first, Tensor):
        raise TypeError(f"tempo.plan: cannot find a loss or a tensor output in {type(output).__name__}; "
                        f"pass loss=... (a function of the model's output)")
    return first.float().square().mean()


def trace_step(model: nn.Module, blocks: list[nn.Module], batch: dict[str, Any], mode: Any, *,
               semantics: str = "cuda", autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
               loss_fn: Callable[[Any], Tensor] = default_loss, round_to: int = 1) -> StepTrace:
    """One forward (under autocast with ``autocast_dtype``, None: no autocast) and backward of
    ``model`` on ``batch`` inside the FakeTensorMode ``mode``; the model's parameters are fake
    tensors of that mode already (module docstring). The model's output is held through backward,
    as ``out = model(**batch); out.loss.backward()`` holds it (its logits among them)."""
    if semantics not in ("cuda", "cpu"):
        raise ValueError(f"trace_step: semantics must be 'cuda' or 'cpu', got {semantics!r}")
    timeline = MemoryTimeline(round_to, kernels=semantics == "cuda")
    k = len(blocks)
    semantic_mode = CudaSemantics() if semantics == "cuda" else contextlib.nullcontext()
    with mode, semantic_mode, timeline, segment_hooks(timeline, blocks):
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            output = model(**batch)
            loss = loss_fn(output)
            timeline.enter(("fwd_end",))
        timeline.enter(("bwd", k + 1))
        timeline.phase = "backward"
        loss.backward()
        timeline.enter(("end",))
        del output, loss
    for segment in StepTrace(k, [], {}).order():
        timeline.segments.setdefault(segment, SegmentRecord(timeline.live, timeline.live))
    timeline.stop()  # what is freed later (the gradients, with the model) is not this step's
    return StepTrace(k, timeline.allocations, timeline.segments)


__all__ = ["Allocation", "CUDA_BLOCK", "MemoryTimeline", "SegmentRecord", "StepTrace", "default_loss", "segment_hooks",
           "trace_step"]
