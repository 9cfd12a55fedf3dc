"""Which implementation of a Tempo op runs, and the input checks every op shares.

Each op has two implementations with the same memory behaviour:
  * "triton": Triton kernels. Used automatically for CUDA tensors. On the CPU they run only
    under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported), which is
    how CI tests the kernels without a GPU; it is slow, so it is never chosen automatically.
  * "reference": plain PyTorch, any device, any float dtype (fp64 included, for gradcheck).

Selection, strongest first: the ``use_backend(...)`` context manager, the ``TEMPO_BACKEND``
environment variable ("auto", "triton", "reference"), then "auto".
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Iterator, Optional

import torch

BACKENDS = ("auto", "triton", "reference")
# dtypes the Triton kernels are written for; fp64 would silently lose precision in fp32 math.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_local = threading.local()
logger = logging.getLogger("tempo")


def _import_triton() -> Optional[BaseException]:
    """None if triton imports, else the exception (ImportError, or a broken install raising)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure means the kernels cannot run
        return err
    return None


TRITON_IMPORT_ERROR: Optional[BaseException] = _import_triton()
TRITON_AVAILABLE = TRITON_IMPORT_ERROR is None
if TRITON_IMPORT_ERROR is not None:
    # Not installed at all is a supported CPU-only setup; an install that is there but fails to
    # import is not, and would otherwise quietly put every op on the reference path.
    _absent = isinstance(TRITON_IMPORT_ERROR, ModuleNotFoundError) and TRITON_IMPORT_ERROR.name == "triton"
    logger.log(logging.INFO if _absent else logging.WARNING,
               "Triton cannot be imported (%r): Tempo ops run on the PyTorch reference path only",
               TRITON_IMPORT_ERROR)


# The ops take ``triton`` and ``tl`` from here: None where triton cannot be imported (reference path only).
if TRITON_AVAILABLE:
    import triton
    import triton.language as tl
else:
    triton = tl = None


def triton_import_error() -> Optional[BaseException]:
    """The exception importing Triton raised, or None when it imports."""
    return TRITON_IMPORT_ERROR


def triton_interpreting() -> bool:
    """True when Triton kernels run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_backend_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where}={name!r} is not a Tempo backend; choose one of {BACKENDS}")
    return name


def requested_backend() -> str:
    """The backend asked for: use_backend() if active, else $TEMPO_BACKEND, else 'auto'."""
    override = getattr(_local, "backend", None)
    if override is not None:
        return override
    return _check_backend_name(os.environ.get("TEMPO_BACKEND", "auto"), "TEMPO_BACKEND")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force an implementation for the ops called inside the block (tests, benchmarks)."""
    _check_backend_name(name, "backend")
    previous = getattr(_local, "backend", None)
    _local.backend = name
    try:
        yield
    finally:
        _local.backend = previous


def triton_usable_for(t: torch.Tensor) -> bool:
    if not TRITON_AVAILABLE:
        return False
    return t.is_cuda or (t.device.type == "cpu" and triton_interpreting())


def resolve_backend(t: torch.Tensor, op: str) -> str:
    """Pick 'triton' or 'reference' for an op whose main input is ``t``.

    Raises TypeError when Triton is forced on a dtype its kernels do not support, and
    RuntimeError when Triton is forced where it cannot run.
    """
    wanted = requested_backend()
    if wanted == "reference":
        return "reference"
    if wanted == "auto":
        # fp64 stays on the reference path: the kernels compute in fp32.
        return "triton" if (t.is_cuda and TRITON_AVAILABLE and t.dtype in TRITON_DTYPES) else "reference"
    if not triton_usable_for(t):
        why = (f"triton cannot be imported: {TRITON_IMPORT_ERROR!r}" if TRITON_IMPORT_ERROR is not None
               else "on CPU set TRITON_INTERPRET=1 before importing triton")
        raise RuntimeError(f"{op}: backend 'triton' was requested but cannot run on device {t.device} ({why})")
    if t.dtype not in TRITON_DTYPES:
        raise TypeError(
            f"{op}: the Triton kernels support float32, float16 and bfloat16, got {t.dtype}; "
            f"use backend 'reference' for other dtypes"
        )
    return "triton"


_logged_once: set[str] = set()


def log_fallback_once(key: str, message: str) -> None:
    """Log a fallback to the reference path once per process (logger "tempo", warning level)."""
    if key not in _logged_once:
        _logged_once.add(key)
        logger.warning(message)


def check_float_tensor(t: object, arg: str, op: str) -> torch.Tensor:
    """A clear TypeError naming the argument when ``t`` is not a floating-point tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{arg}' must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{op}: argument '{arg}' must be a floating-point tensor, got {t.dtype}")
    return t


def check_probability(p: object, arg: str, op: str) -> float:
    """Dropout probabilities live in [0, 1): p = 1 would drop everything and divide by zero."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{op}: argument '{arg}' must be a float in [0, 1), got {type(p).__name__}")
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{op}: argument '{arg}' must be in [0, 1), got {p}")
    return float(p)


def held_dropout(p: object, dropout: object, op: str) -> torch.nn.Dropout:
    """The ``nn.Dropout`` a Tempo module drops out with: ``dropout`` when given (apply_tempo passes the
    module it replaced), else a new one of rate ``p``. The module reads its rate and train flag at
    every forward, as ``nn.Dropout`` reads its own: setting ``.p`` on a model's nn.Dropout modules
    (TRL's ``disable_dropout_in_model``) or ``eval()`` on one reaches the Tempo layer too."""
    if dropout is None:
        return torch.nn.Dropout(check_probability(p, "p", op))
    if not isinstance(dropout, torch.nn.Dropout):
        raise TypeError(f"{op}: argument 'dropout' must be an nn.Dropout, got {type(dropout).__name__}")
    return dropout


def held_dropout_rate(arg: str, op: str) -> property:
    """The property ``arg`` of a module holding ``self.dropout`` (``held_dropout``): it reads and sets
    that nn.Dropout's ``p``, a set value checked as ``check_probability(value, arg, op)`` checks it."""

    def get(self) -> float:
        return self.dropout.p

    def set_(self, value: float) -> None:
        self.dropout.p = check_probability(value, arg, op)

    return property(get, set_, doc="The dropout rate: the held nn.Dropout's.")


def autocast_dtype_for(t: torch.Tensor) -> torch.dtype | None:
    """The dtype torch.autocast would run matmuls in on ``t``'s device, or None if autocast is off."""
    device_type = t.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def needs_backward(*tensors: Optional[torch.Tensor]) -> bool:
    """True when an output computed from ``tensors`` can reach a backward pass: grad mode is on
    and one of them requires grad. When it is False a Tempo layer has nothing to keep
    (``runs_own_forward`` says which computation it runs then).
    Traceable: torch.compile guards on grad mode and ``requires_grad``."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def runs_own_forward(training: bool, *tensors: Optional[torch.Tensor]) -> bool:
    """True when a Tempo layer runs its own forward (the one its backward path runs), False when it
    runs the stock op. In training mode it always runs its own: a training-mode output never depends
    on grad mode or ``requires_grad``, so every pass of one training forward computes the same bits
    (reentrant checkpointing's no-grad first pass and its recompute with grad, GradCache's two
    passes, a frozen block with and without checkpointing). Without a backward it keeps nothing
    either way. In eval mode without a backward (``needs_backward`` False: inference, validation)
    the stock op runs, which costs nothing; eval mode with a backward runs the layer's own forward,
    so there a no-grad pass and a pass with grad may differ by rounding."""
    return training or needs_backward(*tensors)


def in_launch_guard() -> bool:
    """True inside ``launch_on``: tests use it to catch a Triton launch that bypasses the guard."""
    return getattr(_local, "launch_depth", 0) > 0


@contextlib.contextmanager
def launch_on(t: torch.Tensor) -> Iterator[None]:
    """Every Triton launch runs inside this block, on the device of its tensor ``t``.

    Triton launches on ``torch.cuda.current_device()`` and that device's current stream. A tensor
    on another device (``model.to("cuda:1")``, ``device_map="auto"``) would otherwise be handed to
    a kernel running on the wrong GPU. Inside the block the current device is ``t``'s, so the
    stream is ``t``'s device's current stream (whatever ``torch.cuda.stream(...)`` set there).
    On the CPU (Triton's interpreter) it only marks the launch as guarded.
    """
    _local.launch_depth = getattr(_local, "launch_depth", 0) + 1
    try:
        if t.is_cuda:
            with torch.cuda.device(t.device):
                yield
        else:
            yield
    finally:
        _local.launch_depth -= 1
