"""The per-rank plan (tempo.plan with ``world_size`` and ``parallel``) against the live storages of
a real rank's step: a small ``family``/``head`` model from tempo.plan.band, planned per rank for
``engine`` over the torchrun world, applied and wrapped as the plan counted it (``Plan.wrap``), the
second AdamW step counted on each rank by LiveStorages (no module hooks; storage resizes, FSDP2's
unsharded parameters, included), and the third by PyTorch's tracker for the engine. Prints one line
per rank: ``rank R: predicted P counted C tracker T``.
Run by tests/test_plan_parallel.py under ``torchrun --nproc_per_node 2`` (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/plan_rank_peak.py bert-large mlm fsdp2
"""

import copy
import gc
import sys

import torch
import torch.distributed as dist

import tempo.plan as tp
from tempo.plan import band
from tempo.plan.live import LiveStorages

LENGTHS = [30, 64, 100, 17, 128, 50, 77, 128, 9, 112]


def main(family: str, head: str, engine: str) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = band.small_model(family, head)
    counted = tp.count(model, LENGTHS, device="cpu", precision="fp32", optimizer="adamw", world_size=world,
                       parallel=engine)
    plan = tp.choose(counted, "64GiB")
    model = plan.wrap(plan.apply(copy.deepcopy(model)).train())
    inner = model.module if engine == "ddp" else model
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters())
    batch = band.real_batch(inner, LENGTHS, plan.unpadding, plan.seq_len)
    step = band._step(model, optimizer, batch, "fp32")
    step()  # the first step makes the optimizer's states
    gc.collect()
    states = [v.to_local() if hasattr(v, "to_local") else v
              for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    counter = LiveStorages([*params, *model.buffers(), *states, *(v for v in batch.values()
                                                                   if isinstance(v, torch.Tensor))])
    with counter:
        step()
    # PyTorch's own tracker beside it (FSDPMemTracker under FSDP2, MemTracker under DDP), over one more
    # step: its module hooks hold more than the step does (a block output's gradient through backward).
    import warnings

    if engine == "fsdp2":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(model, optimizer)
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    tracker.track_external(*(v for v in batch.values() if isinstance(v, torch.Tensor)))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
        with tracker:
            step()
    tracked = int(max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))
    tokens = sum(LENGTHS) if plan.unpadding else len(LENGTHS) * plan.seq_len
    predicted = counted.peak_at(plan.recompute, tokens)
    print(f"rank {rank}: predicted {predicted.total} counted {counter.peak()} tracker {tracked} "
          f"buffers {predicted.buffers} at {predicted.at}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("done:", family, head, engine, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
