"""A whole model's training step, composed from the parts of one short traced step.

``tempo.plan.trace`` records a truncated copy of the model (a few Transformer blocks, one per
recompute mode between two plain ones) at two token counts t₁ < t₂. Every allocation, every
segment's peak above its start and every kernel's FLOPs and bytes is, at a fixed sequence length, an
affine function of the tokens t = a + b·t (activations are linear in the batch; weights' autocast
copies, masks of fixed shape, the head's parameters' gradients are the constant part), fitted
exactly from the two traces. The model with L blocks in modes m₁…m_L is then replayed segment by
segment: the layers before the blocks, each block from the template of its mode, the head and loss;
each allocation alive from the segment that made it to the one that freed it, at positions relative
to its owner (a block's output freed in the next block's backward stays "the next block's
backward"). So, at every segment s, the live bytes at its start are α_s + β_s·t and its peak
α_s + β_s·t + (excess_s(t)), and the step's activation peak is max_s of those: a maximum of affine
functions of t, whose largest t within a budget is read off directly (``largest_tokens``).

Exactness: for the truncated model itself the replay gives the traced timeline byte for byte; for a
model of L blocks it is exact when every block of a mode allocates and frees as its template does
(identical blocks: the repeated Transformer layer). tests/test_plan.py compares the composed peak of
whole models with a fake trace of the whole step and with PyTorch's own tracker
(torch.distributed._tools.mem_tracker.MemTracker).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from tempo.movement.declarations import Target, kernels_of
from tempo.plan.fusion import fused_kernels
from tempo.plan.trace import StepTrace

PRE, POST = "pre", "post"
LATEST = "latest"  # in a freeing: the later of two places
FUSED = "fused"  # Part.kernels[(FUSED, phase)]: the segment's kernels as torch.compile would fuse them
BEFORE_LAST = "before the last"  # the parts key of the freeing of the output a model's last block takes
FIRST = "first"  # parts[(FIRST, next mode)]: the model's own first block, in mode "none"


@dataclass(frozen=True)
class Affine:
    """a + b·t (bytes, FLOPs, seconds) in the tokens of a step."""

    a: float
    b: float

    def at(self, t: float) -> float:
        return self.a + self.b * t

    @staticmethod
    def through(v1: float, t1: float, v2: float, t2: float) -> "Affine":
        b = (v2 - v1) / (t2 - t1)
        return Affine(v1 - b * t1, b)


class StructureMismatch(RuntimeError):
    """The traces at two token counts allocate differently (data-dependent control flow)."""


@dataclass
class Part:
    """What one part (the layers before the blocks, a block of one mode, the head) does in a step.

    ``a``/``b``: bytes of its allocations (a + b·t); ``made``/``freed``: where each is made and freed,
    as (phase, offset from the part's own position) or an anchor ("pre", "post", "fwd_end", "end",
    None = never); ``excess``: per phase, the segment's peak above its start; ``kernels``: per phase,
    FLOPs and bytes moved of its kernels (a + b·t each) and their dtypes."""

    name: Any
    a: np.ndarray
    b: np.ndarray
    made: list
    freed: list
    excess: dict  # per phase: the lines (Affine) whose highest at t is the segment's peak above its start
    kernels: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)  # indices of its output (the hidden states it hands on)

    def consumed_by(self, consumer_freeing: list, name: Any) -> "Part":
        """This part with its output alive at least as long as ``consumer_freeing`` says too. How long
        a part's output lives is decided by who holds it: the part that takes it (a checkpointed block
        keeps its input to its backward, a plain one perhaps only a cast copy) or the model's code
        around (a local variable, the model's output object): the later of the two."""
        freed = list(self.freed)
        for index, value in zip(self.outputs, consumer_freeing):
            freed[index] = (LATEST, freed[index], value)
        return Part(name, self.a, self.b, self.made, freed, self.excess, self.kernels, self.outputs)


def probe_layout(modes: Sequence[str]) -> list[str]:
    """The blocks of the probe: every ordered pair of ``modes`` once (a de Bruijn sequence of order 2,
    made linear), between a leading and a trailing plain block. For ("none", "selective", "full"):
    none | none none selective none full selective selective full full none | none."""
    k, order = len(modes), 2
    word = [0] * (k * order + 1)
    sequence: list[int] = []

    def extend(t: int, p: int) -> None:  # the standard recursive construction (Lyndon words)
        if t > order:
            if order % p == 0:
                sequence.extend(word[1:p + 1])
            return
        word[t] = word[t - p]
        extend(t + 1, p)
        for j in range(word[t - p] + 1, k):
            word[t] = j
            extend(t + 1, t)

    extend(1, 1)
    cyclic = [modes[i] for i in sequence]
    return ["none", *cyclic, cyclic[0], "none"]


def _where(segment: tuple, owner: int, blocks: int, kind: str):
    """A segment of the trace as a place relative to the part at position ``owner``."""
    if segment is None:
        return None
    if segment[0] in ("fwd_end", "end"):
        return segment[0]
    phase, position = segment
    if position == 0 and kind != PRE:
        return (phase, PRE)
    if position == blocks + 1 and kind != POST:
        return (phase, POST)
    if kind == PRE:
        return (phase, position) if position <= blocks // 2 or position == 0 else (phase, position - (blocks + 1), POST)
    if kind == POST:
        return (phase, position - (blocks + 1), POST)
    offset = position - owner
    if abs(offset) > 1:
        raise StructureMismatch(f"tempo.plan: a block's allocation is freed {offset} blocks away from it; the "
                                f"composition assumes blocks only hand tensors to their neighbours")
    return (phase, offset)


def _kernel_arrays(k1: list, k2: list, t1: float, t2: float, where: str):
    """The kernels of one segment at the two token counts as arrays of affine FLOPs and bytes."""
    if len(k1) != len(k2):
        raise StructureMismatch(f"tempo.plan: {where} runs {len(k1)} kernels at {t1:.0f} tokens and {len(k2)} at "
                                f"{t2:.0f}: the step's structure depends on the batch")
    flops = [Affine.through(x.flops, t1, y.flops, t2) for x, y in zip(k1, k2)]
    moved = [Affine.through(x.moved, t1, y.moved, t2) for x, y in zip(k1, k2)]
    half = [x.dtype in _HALF for x in k1]
    return dict(fa=np.array([f.a for f in flops]), fb=np.array([f.b for f in flops]),
                ma=np.array([m.a for m in moved]), mb=np.array([m.b for m in moved]), half=np.array(half, dtype=bool),
                count=len(k1))


_HALF = (torch.float16, torch.bfloat16)


def parts_from_traces(trace1: StepTrace, t1: float, trace2: StepTrace, t2: float, layout: Sequence[str],
                      target: Optional[Target] = None) -> dict[str, Part]:
    """The parts (PRE, POST and one block template per (mode, the next block's mode) pair found in
    ``layout``) of two traces of the same truncated model, ``layout`` its blocks' modes, at ``t1`` and
    ``t2`` tokens. A block's template depends on the next block's mode because the next block decides
    how long the block's output lives (a checkpointed block keeps its input until its backward; a
    plain one may keep only a cast copy of it). The probe's first block is the model's first block
    (``layout[0]`` is "none"): ``(FIRST, next mode)`` is it, for a model whose first block is plain;
    a first block may keep other tensors than the rest (ModernBERT's has no attention norm: it keeps
    its input, not a norm's output)."""
    k = trace1.blocks
    if len(layout) != k or trace2.blocks != k:
        raise ValueError(f"parts_from_traces: layout {list(layout)} for traces of {trace1.blocks} and {trace2.blocks} blocks")
    if layout[0] != "none" or (k > 1 and layout[1] != "none"):  # (FIRST, m) is a plain first block before a plain one
        raise ValueError(f"parts_from_traces: the probe's first two blocks must be plain, got {list(layout)}")
    owners: dict = {PRE: 0, POST: k + 1}
    for position in range(2, k + 1):  # a block with a block before it: the template of (its mode, the next's)
        following = layout[position] if position < k else POST
        owners.setdefault((layout[position - 1], following), position)
    parts: dict = {}
    for name, owner in owners.items():
        part = _owner_part(trace1, trace2, t1, t2, owner, k, target)
        part.name = name
        parts[name] = part
    # The ends of the stack: the head keeps the last block's output as it keeps the probe's last
    # block's; the model's code may hold the last block's input longer than a block in the middle's
    # (the probe's block before the last shows how long); the first block takes the embeddings'
    # output as a block of its mode takes a block's.
    before_last = _owner_part(trace1, trace2, t1, t2, k - 1, k)
    parts[BEFORE_LAST] = _output_freeing(before_last)
    first = _owner_part(trace1, trace2, t1, t2, 1, k)  # followed by a plain block
    modes = sorted({key[0] for key in parts if isinstance(key, tuple)})
    for mode in modes:
        if (mode, POST) not in parts:
            parts[(mode, POST)] = parts[(mode, "none")].consumed_by(_output_freeing(parts[("none", POST)]),
                                                                      (mode, POST))
        parts[(PRE, mode)] = parts[PRE].consumed_by(_output_freeing(parts[("none", mode)]), (PRE, mode))
    for following in (*modes, POST):
        parts[(FIRST, following)] = first.consumed_by(_output_freeing(parts[("none", following)]),
                                                      (FIRST, following))
    return parts


def _owner_part(trace1: StepTrace, trace2: StepTrace, t1: float, t2: float, owner: int, k: int,
                target: Optional[Target] = None) -> Part:
    """The allocations, segment excesses and kernels of the part at probe position ``owner``."""
    kind = PRE if owner == 0 else POST if owner == k + 1 else "block"
    # Allocations grouped by where they are made and freed (and whether they are the part's output):
    # bytes per group at the two token counts give the group's line. Grouping, not pairing one by
    # one, keeps a small data-dependent difference between the two traces (a check made once per
    # mask tensor, a cache) from derailing the count. A group seen at one token count only is
    # counted as the constant it was there.
    groups: dict[tuple, list] = {}
    for which, trace in enumerate((trace1, trace2)):
        for x in trace.allocations:
            if len(x.made) != 2 or x.made[1] != owner:
                continue
            key = (x.made[0], x.freed, x.output_of == owner and x.made[0] == "fwd")
            groups.setdefault(key, [None, None])
            groups[key][which] = (groups[key][which] or 0) + x.nbytes
    a, b, made, freed, outputs = [], [], [], [], []
    for (phase, where, is_output), (n1, n2) in groups.items():
        line = Affine.through(n1, t1, n2, t2) if n1 is not None and n2 is not None else Affine(float(n1 or n2), 0.0)
        if is_output:
            outputs.append(len(made))
        a.append(line.a)
        b.append(line.b)
        made.append((phase, 0))
        freed.append(_where(where, owner, k, kind))
    excess, kernels = {}, {}
    for phase in ("fwd", "bwd"):
        s1, s2 = trace1.segments[(phase, owner)], trace2.segments[(phase, owner)]
        # The segment's peak above its start. Older storages it frees before its peak are those of
        # the probe's neighbours; a composed neighbour of another mode can free another amount
        # there (measured: within 1 % of the step's peak; tempo.plan's margin covers it).
        excess[phase] = excess_lines(s1, t1, s2, t2)
        if target is not None:
            where = f"position {owner} ({phase})"
            eager = [[k for call in s.calls for k in kernels_of(call, target)] for s in (s1, s2)]
            kernels[phase] = _kernel_arrays(*eager, t1, t2, where)
            # As torch.compile would run them: element-wise chains fused (tempo.plan.fusion).
            fused = [fused_kernels(s.calls, s.flows, _read_after(trace, (phase, owner)), target)
                     for s, trace in ((s1, trace1), (s2, trace2))]
            kernels[(FUSED, phase)] = _kernel_arrays(*fused, t1, t2, where + " fused")
    return Part(owner, np.array(a), np.array(b), made, freed, excess, kernels, outputs)


def excess_lines(s1: Any, t1: float, s2: Any, t2: float) -> list[Affine]:
    """A segment's peak above its start as lines in t whose highest is the peak: one line per
    allocating op, through its live bytes at the two token counts (the same ops in both traces),
    reduced to those highest somewhere at t >= 0. Which op is the peak can change with t (a constant
    allocation, the tied word embeddings' gradient, is the peak at few tokens and the logits' fp32
    gradient at many): the line through the two peaks would miss it. Where the two traces' ops do
    not pair (a data-dependent allocation) the line through the two peaks, as before."""
    if not s1.events or len(s1.events) != len(s2.events):
        return [Affine.through(s1.peak - s1.start, t1, s2.peak - s2.start, t2)]
    lines = [Affine.through(e1 - s1.start, t1, e2 - s2.start, t2) for e1, e2 in zip(s1.events, s2.events)]
    return upper_envelope(lines + [Affine(0.0, 0.0)])


def upper_envelope(lines: Sequence[Affine]) -> list[Affine]:
    """The lines that are the highest of ``lines`` for some t >= 0, by increasing slope (the convex
    hull trick); their maximum equals that of all ``lines`` at every t >= 0."""
    best: dict = {}
    for line in lines:
        if line.b not in best or line.a > best[line.b]:
            best[line.b] = line.a
    hull: list[tuple[float, float]] = []  # (b, a), slopes increasing
    for b, a in sorted(best.items()):
        while len(hull) >= 2:
            (b1, a1), (b2, a2) = hull[-2], hull[-1]
            # The middle line is never the highest when the outer two cross before it rises above the first.
            if (a - a1) * (b2 - b1) >= (a2 - a1) * (b - b1):
                hull.pop()
            else:
                break
        hull.append((b, a))
    while len(hull) >= 2:  # the first line's stretch lies at t < 0: drop it
        (b1, a1), (b2, a2) = hull[0], hull[1]
        if (a1 - a2) / (b2 - b1) <= 0:
            hull.pop(0)
        else:
            break
    return [Affine(a, b) for b, a in hull]


def _read_after(trace: StepTrace, segment: tuple) -> set:
    """The storages read by any op of a segment after ``segment`` (memoised on the trace)."""
    memo = trace.__dict__.setdefault("_read_after", {})
    if not memo:
        seen: set = set()
        for later in reversed(trace.order()):
            memo[later] = set(seen)
            record = trace.segments.get(later)
            if record is not None:
                for reads, _writes in record.flows:
                    seen.update(ident for ident, _ in reads)
    return memo[segment]


def _output_freeing(part: Part) -> list:
    return [part.freed[i] for i in part.outputs]



@dataclass
class Composition:
    """The replayed step of a model with blocks in ``modes``: the activation bytes at every segment's
    start and peak, as lines in t, and what is alive at the end of backward (gradients)."""

    modes: tuple
    order: list
    start: list  # Affine per segment: live bytes at its start
    peak: list  # Affines, one or more per segment (start + each excess line): the step's peak is their max
    end: Affine  # live after backward (the gradients)
    gradients: list  # Affine per segment: of its start, the bytes made in backward and never freed
    peak_index: list = field(default_factory=list)  # per line of ``peak``: the index of its segment in ``order``

    @property
    def peak_segments(self) -> list:
        """Per line of ``peak``: its segment."""
        return [self.order[i] for i in self.peak_index]

    def peak_at(self, t: float) -> float:
        return max(p.at(t) for p in self.peak)

    def peak_segment(self, t: float) -> tuple:
        i = int(np.argmax([p.at(t) for p in self.peak]))
        return self.order[self.peak_index[i]]


def compose(parts: dict[str, Part], modes: Sequence[str]) -> Composition:
    """Replay the step of a model whose blocks have ``modes`` (module docstring)."""
    L = len(modes)
    order = ([("fwd", i) for i in range(L + 2)] + [("fwd_end",)] + [("bwd", i) for i in range(L + 1, -1, -1)]
             + [("end",)])
    index = {seg: i for i, seg in enumerate(order)}
    n = len(order)
    delta_a = np.zeros(n + 2)
    delta_b = np.zeros(n + 2)
    grad_a = np.zeros(n + 2)
    grad_b = np.zeros(n + 2)
    excess: list[list[Affine]] = [[Affine(0.0, 0.0)]] * n

    def place(part: Part, position: int) -> None:
        for a, b, made, freed in zip(part.a, part.b, part.made, part.freed):
            made_at = index[(made[0], position)]
            freed_at = _resolve(freed, position, L, index, n)
            delta_a[made_at + 1] += a
            delta_b[made_at + 1] += b
            delta_a[freed_at + 1] -= a
            delta_b[freed_at + 1] -= b
            if freed is None and made[0] == "bwd":  # a gradient (kept for the optimizer)
                grad_a[made_at + 1] += a
                grad_b[made_at + 1] += b
        for phase, lines in part.excess.items():
            excess[index[(phase, position)]] = lines

    place(parts[(PRE, modes[0])] if modes else parts[PRE], 0)
    for i, mode in enumerate(modes, start=1):
        key = (mode, modes[i] if i < L else POST)
        if key not in parts:
            raise KeyError(f"tempo.plan: no template for a {mode!r} block followed by a {key[1]!r} one; traced: "
                           f"{sorted(k for k in parts if isinstance(k, tuple) and k[0] not in (PRE, FIRST))}")
        part = parts[(FIRST, key[1])] if i == 1 and mode == "none" else parts[key]
        if i == L - 1:  # the last block's input: the model's code may hold it longer (parts_from_traces)
            part = part.consumed_by(parts[BEFORE_LAST], key)
        place(part, i)
    place(parts[POST], L + 1)
    live_a = np.cumsum(delta_a)[:n]
    live_b = np.cumsum(delta_b)[:n]
    start = [Affine(float(a), float(b)) for a, b in zip(live_a, live_b)]
    peak, peak_index = [], []
    for i, (s, lines) in enumerate(zip(start, excess)):
        for e in lines:
            peak.append(Affine(s.a + e.a, s.b + e.b))
            peak_index.append(i)
    gradients = [Affine(float(a), float(b)) for a, b in zip(np.cumsum(grad_a)[:n], np.cumsum(grad_b)[:n])]
    return Composition(tuple(modes), order, start, peak, start[index[("end",)]], gradients, peak_index)


def _resolve(freed, position: int, L: int, index: dict, n: int) -> int:
    """The segment index where an allocation of the part at ``position`` is freed (n: never)."""
    if freed is None:
        return n
    if freed in ("fwd_end", "end"):
        return index[(freed,)]
    if freed[0] == LATEST:
        return max(_resolve(f, position, L, index, n) for f in freed[1:])
    phase, where, *anchor = freed
    if where == PRE:
        return index[(phase, 0)]
    if where == POST:
        return index[(phase, L + 1)]
    if anchor:  # counted from the end: post is 0, the last block -1, ...
        return index[(phase, max(0, L + 1 + where))]
    if position == 0:  # the part before the blocks: counted from the start (a model shorter than the
        return index[(phase, min(where, L + 1))]  # probe: freed at its last block at the latest)
    return index[(phase, min(max(position + where, 0), L + 1))]


def step_seconds(parts: dict[str, Part], modes: Sequence[str], t: float, peak_flops_half: float,
                 peak_flops_fp32: float, bandwidth: float, latency: float = 0.0, fused: bool = False) -> float:
    """Σ over the composed step's kernels of max(FLOPs / peak, bytes / bandwidth, latency) at ``t``
    tokens (peaks and bandwidth already scaled by the fitted efficiencies). ``fused``: the kernels as
    torch.compile would run them (tempo.plan.fusion: element-wise chains fused)."""
    total = 0.0
    counts: dict = {}
    keys = [(mode, modes[i + 1] if i + 1 < len(modes) else POST) for i, mode in enumerate(modes)]
    for name in [PRE, *keys, POST]:
        counts[name] = counts.get(name, 0) + 1
    for name, count in counts.items():
        for key, arrays in parts[name].kernels.items():
            if (isinstance(key, tuple) and key[0] == FUSED) != fused or not arrays["count"]:
                continue
            flops = arrays["fa"] + arrays["fb"] * t
            moved = arrays["ma"] + arrays["mb"] * t
            peak = np.where(arrays["half"], peak_flops_half, peak_flops_fp32)
            seconds = np.maximum(np.maximum(flops / peak, moved / bandwidth), latency)
            total += count * float(seconds.sum())
    return total


__all__ = ["Affine", "Composition", "POST", "PRE", "Part", "StructureMismatch", "compose", "excess_lines",
           "parts_from_traces", "probe_layout", "upper_envelope",
           "step_seconds"]

