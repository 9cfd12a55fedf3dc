"""tempo.plan.fusion: a step's element-wise chains as a fusing compiler runs them (its bytes)."""

import contextlib

import torch
from torch import nn

from tempo.movement.declarations import Target
from tempo.plan.fusion import fused_kernels, fusible
from tempo.plan.trace import MemoryTimeline

H100 = Target("H100", 132)


def _record(fn, *args):
    timeline = MemoryTimeline()
    with timeline:
        out = fn(*args)
    record = timeline.segments[("fwd", 0)]
    return record, out


def test_a_chain_between_two_matmuls_reads_its_input_once_and_writes_only_what_the_next_matmul_reads():
    x, w1, w2 = torch.randn(64, 32), torch.randn(32, 128), torch.randn(128, 32)

    def step(x, w1, w2):
        h = x @ w1                      # matmul: its own kernel
        h = torch.nn.functional.gelu(h * 2.0 + 1.0)  # three element-wise ops: one fused region
        return h @ w2                   # matmul: reads the region's output

    record, _ = _record(step, x, w1, w2)
    kernels = fused_kernels(record.calls, record.flows, set(), H100)
    regions = [k for k in kernels if k.name == "fused element-wise region"]
    assert len(regions) == 1
    # Reads h (64x128 fp32) once; writes the GELU output once (the product and the sum never leave it).
    assert regions[0].read == 64 * 128 * 4 and regions[0].written == 64 * 128 * 4
    eager_elementwise = sum(c.reads[0].nbytes + c.writes[0].nbytes for c in record.calls if fusible(c))
    assert eager_elementwise == 3 * 2 * 64 * 128 * 4  # eager: each op reads and writes the whole tensor


def test_what_a_later_segment_reads_is_written_and_what_nobody_reads_is_not():
    x = torch.randn(16, 16)
    record, out = _record(lambda t: (t * 3.0).exp(), x)
    written = {ident for _, writes in record.flows for ident, _ in writes}
    last = list(written)[-1]
    kept = fused_kernels(record.calls, record.flows, {last}, H100)
    dropped = fused_kernels(record.calls, record.flows, set(), H100)
    assert kept[0].written == 16 * 16 * 4 and dropped[0].written == 0


def test_matmuls_attention_and_tempo_ops_are_never_fused():
    lin = nn.Linear(8, 8)
    record, _ = _record(lambda t: lin(t).relu(), torch.randn(4, 8))
    packets = [c.packet for c in record.calls]
    assert [fusible(c) for c in record.calls] == [p != "aten.addmm" for p in packets]
