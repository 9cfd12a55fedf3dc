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

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_runtime(local_rank_flag: int = -1, force_cpu: bool = False) -> Runtime:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and start DDP if needed.

    NCCL on GPUs, gloo on CPUs. ``--local_rank`` (DLE's flag, from torch.distributed.launch) is
    accepted too; torchrun's LOCAL_RANK wins when both are present.
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
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Runtime(device=device, rank=rank, world_size=world_size, local_rank=local_rank)


def teardown_runtime(rt: Runtime) -> None:
    if rt.distributed and dist.is_initialized():
        dist.destroy_process_group()


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


def mean_over_ranks(value: torch.Tensor, rt: Runtime) -> float:
    """The mean of a scalar tensor over all ranks, as a Python float (a host sync)."""
    if rt.distributed:
        value = value.clone()
        dist.all_reduce(value)
        value /= rt.world_size
    return value.item()


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
