"""Small helpers every stage uses, written once: atomic writes, byte sizes, the command lines' number
types, the git commit, unwrapping.

Nothing here imports another tempo module, so any stage may use it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, Iterator, Optional, Union

from torch import nn


# -- atomic writes: a reader (or a crash) never sees half a file ------------------------------------
@contextlib.contextmanager
def atomic_path(path: Union[str, os.PathLike]) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to (for libraries that write by name: h5py,
    safetensors, np.savez); renamed onto ``path`` when the block succeeds, removed when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_write(path: Union[str, os.PathLike], mode: str = "w") -> Iterator[IO[Any]]:
    """``open(path, mode)`` that lands atomically: text modes are UTF-8."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())


def atomic_write_text(path: Union[str, os.PathLike], text: str) -> Path:
    with atomic_write(path) as fh:
        fh.write(text)
    return Path(path)


# -- byte sizes ---------------------------------------------------------------------------------------
_BYTE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6,
               "GB": 10**9, "TB": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "B": 1}


def parse_bytes(value: Union[int, float, str, None]) -> Optional[int]:
    """1.5e9, "512MiB", "2GB", "2G" -> bytes (K/M/G/T are binary, as KiB/MiB/GiB/TiB); None stays None."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    text = value.strip().upper().replace(" ", "")
    try:
        for suffix in sorted(_BYTE_UNITS, key=len, reverse=True):
            if text.endswith(suffix):
                number = float(text[: -len(suffix)])
                break
        else:
            suffix, number = "B", float(text)
    except ValueError:
        raise ValueError(f"{value!r} is not a byte size (e.g. 2GiB, 512MB, 1.5e9)") from None
    if not number >= 0 or number == float("inf"):
        raise ValueError(f"{value!r} is not a byte size (must be a finite, non-negative amount)")
    return int(number * _BYTE_UNITS[suffix])


def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def positive_size(text: str) -> int:
    """An argparse ``type=`` for a memory size flag: a positive byte size as ``parse_bytes`` reads it
    (2GiB, 512MB, 1.5e9), in bytes; else a one-line error."""
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not value:  # 0, or a fraction of a byte
        raise argparse.ArgumentTypeError(f"must be a positive size (e.g. 2GiB, 512MB), got {text!r}")
    return value


# -- number flags: argparse ``type=`` values, so every CLI refuses a bad number when it is parsed -------------
@dataclass(frozen=True)
class NumberArg:
    """An argparse ``type=`` for a number flag: an int (``integer``) or a finite float in [low, high]
    (``low_open``/``high_open``: that end excluded; None: unbounded), or exactly ``sentinel`` (an int
    flag's "not set" value, such as DLE's -1). Anything else, NaN and inf included, is refused with
    one line, which argparse prints as "argument --flag: must be ..., got X" before exiting with
    status 2. The bounds stay readable so that tests can derive bad values from them."""

    integer: bool
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    sentinel: Optional[int] = None

    @property
    def want(self) -> str:
        if self.integer and self.low == 1 and self.high is None:
            text = "a positive integer"
        else:
            bounds = []
            if self.low is not None:
                bounds.append(f"{'>' if self.low_open else '>='} {self.low:g}")
            if self.high is not None:
                bounds.append(f"{'<' if self.high_open else '<='} {self.high:g}")
            text = ("an integer" if self.integer else "a finite number") + (
                " " + " and ".join(bounds) if bounds else "")
        return text if self.sentinel is None else f"{text} or {self.sentinel}"

    def __call__(self, text: str) -> Union[int, float]:
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self.want}, got {text!r}") from None
        if value == self.sentinel:
            return value
        low, high = self.low, self.high
        if (not math.isfinite(value) or (low is not None and (value <= low if self.low_open else value < low))
                or (high is not None and (value >= high if self.high_open else value > high))):
            raise argparse.ArgumentTypeError(f"must be {self.want}, got {text}")
        return value


def int_in(low: Optional[int] = None, high: Optional[int] = None, sentinel: Optional[int] = None) -> NumberArg:
    """``type=`` for an int flag in [low, high], or ``sentinel``."""
    return NumberArg(True, low, high, sentinel=sentinel)


def number_in(low: Optional[float] = None, high: Optional[float] = None, *, low_open: bool = False,
              high_open: bool = False) -> NumberArg:
    """``type=`` for a finite float flag in [low, high] (``low_open``/``high_open``: that end excluded)."""
    return NumberArg(False, low, high, low_open, high_open)


positive_int = int_in(1)  # counts: lengths, batches, steps, repeats
non_negative_int = int_in(0)  # warm-up steps, workers, seeds
positive_int_or_unset = int_in(1, sentinel=-1)  # DLE's "-1 = not set" counts: --max_steps, --steps_this_run
finite_number = number_in()
positive_number = number_in(0.0, low_open=True)  # learning rates, time limits, TFLOPS
non_negative_number = number_in(0.0)  # weight decay, clipping norm, epochs
proportion = number_in(0.0, 1.0, high_open=True)  # warm-up and padding shares, dropout rates: [0, 1)

# -- provenance ---------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def git_commit() -> dict[str, Any]:
    """{"commit": sha or None, "dirty": bool or None} of the checkout this package runs from."""
    root = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip() or None, "dirty": bool(dirty)}


# -- models -------------------------------------------------------------------------------------------
def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DataParallel (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    parallel_wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while True:
        if isinstance(model, parallel_wrappers):
            model = model.module
            continue
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module):
            model = orig
            continue
        return model


def fake_parameters(module: nn.Module, mode: Any) -> nn.Module:
    """``module`` (built on the meta device) with fake CPU parameters and buffers made in the
    FakeTensorMode ``mode``, in place: no memory, the same shapes, strides and dtypes. A parameter
    shared by several modules (tied embeddings) stays one parameter. (The ledger's and the movement
    counter's fake sessions both build their models so.)"""
    import torch

    memo: dict[int, Any] = {}

    def fake(t: Any) -> Any:
        if id(t) not in memo:
            with mode:
                made = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
            memo[id(t)] = nn.Parameter(made, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else made
        return memo[id(t)]

    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = fake(param)
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = fake(buf)
    return module
