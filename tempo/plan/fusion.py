"""The bytes a fusing compiler moves: a step's element-wise work grouped into fused kernels.

``torch.compile`` (Inductor) turns the chains of element-wise and reduction ops between two matmuls
into single kernels: each reads its inputs once and writes only what is needed later. The step's
recorded ops (tempo.plan.trace, with the storages each op read and wrote) are grouped so: a *region*
is a maximal run of consecutive fusible ops (aten ops without FLOPs: element-wise, reductions,
copies, dropout, the layer norms aten decomposes to; never a matmul, an attention kernel or one of
Tempo's custom ops, whose kernels are their own); it moves the storages it reads that it did not
make itself, and the storages it writes that any later op reads (the next matmul's input, a tensor
saved for backward). Its FLOPs are not counted (they are the element-wise kind the roofline's bytes
bound). This is a lower bound on a real compiler's traffic for the same graph (Inductor also splits
regions at reductions with other shapes and recomputes some, and a matmul's bias epilogue stays in
cuBLAS's kernel here as in eager), used to project a compiled step beside an eager one.
"""

from __future__ import annotations

from tempo.movement.declarations import ELEMENTWISE, Kernel, Target, kernels_of
from tempo.movement.trace import OpCall


def fusible(call: OpCall) -> bool:
    """An op Inductor fuses into its neighbours (module docstring)."""
    return call.flops == 0 and call.packet.startswith("aten.") and "attention" not in call.packet


def fused_kernels(calls: list[OpCall], flows: list, later_reads: set, target: Target) -> list[Kernel]:
    """The kernels of ``calls`` (one segment, in order) as a fusing compiler runs them: each region of
    fusible ops one kernel, every other op its own declared kernels. ``flows[i]``: (reads, writes) of
    call i as (storage id, bytes); ``later_reads``: the storage ids read by any op after this segment."""
    out: list[Kernel] = []
    i = 0
    n = len(calls)
    while i < n:
        if not fusible(calls[i]):
            out.extend(kernels_of(calls[i], target))
            i += 1
            continue
        j = i
        while j < n and fusible(calls[j]):
            j += 1
        out.append(_region_kernel(flows[i:j], flows[j:], later_reads))
        i = j
    return out


def _region_kernel(region: list, after: list, later_reads: set) -> Kernel:
    made: set = set()
    reads: dict = {}
    writes: dict = {}
    for read, written in region:
        for ident, nbytes in read:
            if ident not in made:
                reads[ident] = max(reads.get(ident, 0), nbytes)
        for ident, nbytes in written:
            made.add(ident)
            writes[ident] = max(writes.get(ident, 0), nbytes)
    needed_later = set(later_reads)
    for read, _written in after:
        needed_later.update(ident for ident, _ in read)
    written_bytes = sum(nbytes for ident, nbytes in writes.items() if ident in needed_later)
    return Kernel("fused element-wise region", ELEMENTWISE, sum(reads.values()), written_bytes)


__all__ = ["fusible", "fused_kernels"]
