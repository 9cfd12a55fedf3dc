"""Process-level setup shared by the trainers: device, distributed, precision, seeds, errors.

Kept apart from the training loops so that run_pretraining.py and run_squad.py read as the
loop itself, and so that every entry point fails on bad input the same way: one line naming the
file, field or argument, a non-zero exit, no traceback.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist


class UsageError(Exception):
    """Bad input from the user (a flag, a path, a file's content): reported without a traceback."""


class NonFiniteError(UsageError):
    """A training step's loss or gradient norm was NaN/inf (``--on_nonfinite stop``): the message
    names the step, the values and where the first non-finite number was; no traceback, exit 1.
    Nothing was applied to the weights or the optimizer state at that step."""


class ModelTooLargeError(UsageError):
    """A config's sizes need more memory than the machine has; named before anything is allocated."""


# Errors raised by our own modules for bad input; they all subclass ValueError/OSError, but a
# ValueError from deep inside torch is a bug and must keep its traceback, so we list ours.
def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [UsageError, FileNotFoundError, PermissionError, IsADirectoryError]
    for module, name in (
        ("tempo.bert.config", "ConfigError"),
        ("tempo.bert.data.tokenization", "DataError"),  # base of the data pipeline's errors
        ("tempo.bert.data.pretraining_dataset", "ShardError"),
        ("tempo.bert.hf_interop", "CheckpointError"),
        ("tempo.choices", "ChoiceError"),
        ("tempo.bert.data.squad", "SquadFormatError"),
    ):
        try:
            mod = __import__(module, fromlist=[name])
            types.append(getattr(mod, name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def run_main(main: Callable[[], int | None], prog: str) -> int:
    """Call ``main``; turn user errors into `prog: error: ...` on stderr and exit status 1."""
    try:
        return int(main() or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except _user_error_types() as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


@dataclass
class Runtime:
    """Where and how this process trains."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    cpu_threads: "CpuThreads | None" = None  # on the CPU: torch's threads following the load

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def follow_load(self) -> None:
        """Call once per training step: on the CPU, torch's threads follow the cores other work leaves
        free (``CpuThreads.follow``: a clock read, and /proc/stat about once a second)."""
        if self.cpu_threads is not None:
            self.cpu_threads.follow()


# -- intra-op threads on a CPU that other work shares ------------------------------------------------
# OpenMP threads beyond the cores other processes leave free add no speed and cost a lot: every
# parallel op ends at a barrier that waits for a thread the scheduler has parked, so each of a
# step's thousands of small ops can cost a time slice instead of microseconds. Measured on 2 cores
# that other work kept busy (load 4): the main job's Tempo run made 468 real tokens/s with 2 threads
# and 9,518 with 1, the original's 1,100 and 5,385; and a run that started on 2 idle cores kept its 2
# threads when other work arrived and fell to 1,396 real tokens/s against the original's 6,313
# (results/cpu_speed/main_job_load.md). So the threads follow the load for the whole run.
FREE_CORES_WINDOW_S = 0.25  # how long setup_runtime watches the CPUs (jiffies are 10 ms: ±4 % of a core)
FOLLOW_INTERVAL_S = 1.0  # how often a run looks again
BUSY_SLACK = 0.1  # cores: other work below this is noise, not a reason to drop a thread
RISE_AFTER = 2  # looks in a row with a core to spare before a thread is added (dropping one is at once)
PROC_STAT = "/proc/stat"
CGROUP_QUOTA_FILES = ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us")


def _cpu_jiffies(cpus: list[int]) -> dict[int, tuple[int, int]] | None:
    """(busy, total) jiffies of each CPU in ``cpus`` from /proc/stat (idle and iowait are not busy;
    steal is: another guest had the core); None when /proc/stat or one of the CPUs' lines is missing."""
    try:
        with open(PROC_STAT, encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    found = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]
            total = sum(values)
            found[int(name[3:])] = (total - values[3] - values[4], total)
    return found if len(found) == len(cpus) else None


def _cgroup_cores() -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 cpu.max or v1 cfs_quota_us), None if unlimited."""
    for path in CGROUP_QUOTA_FILES:
        try:
            with open(path, encoding="ascii") as fh:
                text = fh.read().split()
        except OSError:
            continue
        if path.endswith("cpu.max"):  # "max 100000" or "<quota> <period>"
            if len(text) == 2 and text[0] != "max":
                return int(text[0]) / int(text[1])
            return None
        try:
            with open(os.path.join(os.path.dirname(path), "cpu.cfs_period_us"), encoding="ascii") as fh:
                period = int(fh.read())
        except (OSError, ValueError):
            return None
        quota = int(text[0]) if text else -1
        return quota / period if quota > 0 and period > 0 else None
    return None


@dataclass(frozen=True)
class _CpuSample:
    jiffies: dict[int, tuple[int, int]]
    own: float  # this process's CPU seconds, all its threads
    at: float  # time.monotonic()


class CpuWatch:
    """What other processes do on this process's CPUs (its CPU set, capped by its cgroup quota):
    ``others(since)`` is the cores they kept busy since an earlier sample, from /proc/stat less this
    process's own CPU time. ``CpuWatch.open()`` is None where /proc/stat cannot be read (not Linux)."""

    def __init__(self, cpus: list[int]):
        self.cpus = cpus
        quota = _cgroup_cores()
        self.usable = float(len(cpus)) if quota is None else min(float(len(cpus)), quota)

    @classmethod
    def open(cls) -> "CpuWatch | None":
        try:
            watch = cls(sorted(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return None
        return watch if watch.sample() is not None else None

    def sample(self) -> _CpuSample | None:
        jiffies = _cpu_jiffies(self.cpus)
        return None if jiffies is None else _CpuSample(jiffies, time.process_time(), time.monotonic())

    def others(self, before: _CpuSample, now: _CpuSample) -> float:
        busy = sum((now.jiffies[c][0] - before.jiffies[c][0]) / max(1, now.jiffies[c][1] - before.jiffies[c][1])
                   for c in self.cpus)
        return max(0.0, busy - (now.own - before.own) / max(now.at - before.at, 1e-9))


class CpuThreads:
    """torch's intra-op threads for training on a CPU that other work may share (the comment above):
    at the start, the cores other work leaves free (watched for ``FREE_CORES_WINDOW_S``), shared by
    the ``local_ranks`` processes of a run on this machine; then ``follow``, once per step, looks again
    about once a second: a thread fewer as soon as other work takes a core, more once cores have
    stayed free for ``RISE_AFTER`` looks. Never more than torch's own count, never fewer than 1.
    ``line`` says the choice; each change is logged (``log``). ``restore`` gives the threads back."""

    def __init__(self, watch: CpuWatch, local_ranks: int = 1, log: Callable[[str], None] | None = None):
        self.watch, self.log = watch, log
        self.most = self.before = torch.get_num_threads()
        first = watch.sample()
        time.sleep(FREE_CORES_WINDOW_S)
        self.last = watch.sample()
        if first is None or self.last is None:
            raise OSError("/proc/stat stopped being readable")
        others = watch.others(first, self.last)
        self.threads = self._fit(watch.usable - others, local_ranks)
        torch.set_num_threads(self.threads)
        self.spare = 0
        self.line = (f"CPU threads: {self.threads} of {self.most} (other work kept {others:.1f} of "
                     f"{watch.usable:g} cores busy; followed during the run; OMP_NUM_THREADS=N fixes them)")

    def _fit(self, free: float, share: int = 1) -> int:
        return max(1, min(self.most, int((max(0.0, free) + BUSY_SLACK) // share)))

    def follow(self) -> None:
        if time.monotonic() - self.last.at < FOLLOW_INTERVAL_S:
            return
        now = self.watch.sample()
        if now is None:
            return
        others = self.watch.others(self.last, now)
        self.last = now
        target = self._fit(self.watch.usable - others)
        self.spare = self.spare + 1 if target > self.threads else 0
        if target < self.threads or self.spare >= RISE_AFTER:
            if self.log is not None:
                self.log(f"CPU threads: {self.threads} -> {target} (other work kept {others:.1f} of "
                         f"{self.watch.usable:g} cores busy)")
            self.threads, self.spare = target, 0
            torch.set_num_threads(target)

    def restore(self) -> None:
        torch.set_num_threads(self.before)


def cpu_threads_for_training(local_ranks: int = 1, log: Callable[[str], None] | None = None
                             ) -> tuple[CpuThreads | None, str]:
    """(the threads' governor, its line) for training on this CPU; no governor (torch's threads kept)
    when OMP_NUM_THREADS is set or the CPUs cannot be watched."""
    current = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return None, f"CPU threads: {current} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    watch = CpuWatch.open()
    if watch is None:
        return None, f"CPU threads: {current}, torch's default (cannot see other work without /proc/stat)"
    governor = CpuThreads(watch, local_ranks, log)
    return governor, governor.line


def setup_runtime(local_rank_flag: int = -1, force_cpu: bool = False, group: bool = False) -> Runtime:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and start DDP if needed.

    NCCL on GPUs, gloo on CPUs. ``--local_rank`` (DLE's flag, from torch.distributed.launch) is
    accepted too; torchrun's LOCAL_RANK wins when both are present. On the CPU, torch's intra-op
    threads follow the cores other work leaves free (``CpuThreads``: one line on rank 0, and one per
    change; the training loop calls ``rt.follow_load()`` each step); ``teardown_runtime`` gives the
    process its threads back.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", local_rank_flag if local_rank_flag >= 0 else 0))
    use_cuda = torch.cuda.is_available() and not force_cpu
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    # ``group``: a process group even for one process (FSDP2 shards over one; torchrun set it up).
    if (world_size > 1 or group) and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rt = Runtime(device=device, rank=rank, world_size=world_size, local_rank=local_rank)
    if not use_cuda:
        log = (lambda line: print(line, flush=True)) if rt.is_main else None
        rt.cpu_threads, line = cpu_threads_for_training(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), log)
        if log is not None:
            log(line)
    return rt


def teardown_runtime(rt: Runtime) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    if rt.cpu_threads is not None:  # in-process callers (tests, notebooks) get their threads back
        rt.cpu_threads.restore()
        rt.cpu_threads = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def precision_from_flags(fp16: bool, bf16: bool, tf32: bool = False) -> str:
    if fp16 and bf16:
        raise UsageError("--fp16/--amp and --bf16 are mutually exclusive")
    return "fp16" if fp16 else "bf16" if bf16 else "tf32" if tf32 else "fp32"


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """torch.amp autocast for bf16/fp16; nothing for fp32/tf32."""
    if precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        if precision == "fp16" and device.type == "cpu":
            raise UsageError("--fp16 needs a CUDA GPU; use --bf16 on the CPU")
        return torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext()


def configure_matmul_precision(precision: str) -> None:
    # TF32 matmuls are an explicit choice (--tf32), so that "fp32" numbers mean true fp32.
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"


def make_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling; bf16 has fp32's exponent range and does not."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def peak_memory_bytes(device: torch.device) -> dict[str, int]:
    """Allocator peaks on CUDA; the process's peak resident set on the CPU (Linux, in bytes)."""
    if device.type == "cuda":
        return {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    try:
        import resource

        return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    except (ImportError, OSError):
        return {}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def no_sync_if(model: Any, condition: bool) -> Iterator[None]:
    """DDP's no_sync() for the micro-steps of gradient accumulation that do not end a step."""
    if condition and hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield


def check_output_dir(path: str) -> None:
    """Create ``path`` and make sure we can write there before any work is done."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test_{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise UsageError(f"--output_dir {path!r} is not writable: {exc.strerror or exc}") from None


def wrap_ddp(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """The module a training step runs: DDP around ``model`` when this is a distributed run."""
    if not rt.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)


def shard_fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` on each Transformer block, then on the root (--parallel fsdp2), in place,
    before the optimizer is made: it steps over the shards. As tempo.plan's ``parallel="fsdp2"``
    counts it (tempo.plan.parallel.wrap)."""
    from tempo.integrations.recompute import fully_shard_blocks

    return fully_shard_blocks(model)


def mean_over_ranks(value: torch.Tensor, rt: Runtime) -> float:
    """The mean of a scalar tensor over all ranks, as a Python float (a host sync)."""
    if rt.distributed:
        value = value.clone()
        dist.all_reduce(value)
        value /= rt.world_size
    return value.item()


def sum_over_ranks(counts: list[float], rt: Runtime) -> list[float]:
    """Counts summed over all ranks (one all-reduce in fp64, exact for counts below 2^53); the
    counts themselves on one process."""
    if not rt.distributed:
        return [float(c) for c in counts]
    summed = torch.tensor(counts, dtype=torch.float64, device=rt.device)
    dist.all_reduce(summed)
    return summed.tolist()


# -- will the model fit? ---------------------------------------------------------------------
# Bytes per parameter while training: fp32 weight + fp32 gradient + two fp32 optimizer moments
# (LAMB and AdamW both keep m and v). Activations come on top and depend on the batch; this is
# the floor below which no batch size helps.
TRAINING_BYTES_PER_PARAMETER = 16
# Sizes of BERT-large, to say which field of an oversized config is out of line.
_BERT_LARGE = {"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 4096,
               "max_position_embeddings": 512, "type_vocab_size": 2}


def estimate_parameters(config: Any) -> dict[str, int]:
    """Parameter counts of a BERT config by part (exact for tempo.bert.model's BertForPreTraining;
    BertForQuestionAnswering has the encoder, embeddings and a 2-wide head: within a few percent).

    Needs only the config's integer fields, so it runs before anything is allocated."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    vocab = getattr(config, "padded_vocab_size", config.vocab_size)
    return {
        "word embeddings (vocab_size x hidden_size)": vocab * h,
        "position embeddings (max_position_embeddings x hidden_size)": config.max_position_embeddings * h,
        "token type embeddings (type_vocab_size x hidden_size)": config.type_vocab_size * h,
        "encoder (num_hidden_layers x (4 hidden_size^2 + 2 hidden_size x intermediate_size))":
            layers * (4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h),
        "heads (hidden_size^2, vocab_size)": 2 * (h * h + h) + 4 * h + vocab + 2 * h + 2,
    }


_PART_FIELDS = {
    "word": ("vocab_size", "hidden_size"),
    "position": ("max_position_embeddings", "hidden_size"),
    "token": ("type_vocab_size", "hidden_size"),
    "encoder": ("num_hidden_layers", "hidden_size", "intermediate_size"),
    "heads": ("hidden_size", "vocab_size"),
}


def memory_for_training(device: torch.device) -> tuple[int, str]:
    """(bytes, description) of the memory a model must fit in: the GPU's total memory, or the
    machine's physical memory for CPU training."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"GPU {index}"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine (CPU training)"
    except (ValueError, OSError, AttributeError):  # not POSIX: no check
        return 1 << 62, "this machine"


def check_model_fits(config: Any, source: str, device: torch.device | None = None,
                     available: int | None = None) -> int:
    """Refuse (ModelTooLargeError naming ``source`` and a field) a config whose parameters, with
    their gradients and optimizer moments, need more bytes than the device has; return the bytes.

    ``device`` None: the device setup_runtime will choose (CUDA when available, else the CPU);
    ``available`` overrides the memory figure (tests)."""
    parts = estimate_parameters(config)
    total = sum(parts.values())
    needed = total * TRAINING_BYTES_PER_PARAMETER
    if available is None:
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        available, where = memory_for_training(device)
    else:
        where = "the memory given"
    if needed <= available:
        return needed
    part = max(parts, key=parts.get)
    fields = _PART_FIELDS[part.split()[0]]
    field = max(fields, key=lambda f: getattr(config, f) / _BERT_LARGE[f])
    raise ModelTooLargeError(
        f"{source}: field '{field}' ({getattr(config, field):,}) makes the model too large: {total:,} parameters "
        f"need {needed / 2**30:,.1f} GiB for weights, gradients and optimizer state "
        f"({TRAINING_BYTES_PER_PARAMETER} bytes each) before any activation, more than the "
        f"{available / 2**30:,.1f} GiB of {where}; most of it is the {part}")


def format_rate(samples_per_second: float) -> str:
    """'123.4 seq/s', or 'n/a seq/s (run too short to time)' for a NaN figure."""
    if samples_per_second != samples_per_second:  # NaN: no timed step
        return "n/a seq/s (run too short to time)"
    return f"{samples_per_second:.1f} seq/s"
