"""Training checkpoints: safe to load, atomic to write, easy to resume.

Layout::

    <output_dir>/checkpoints/ckpt_<step>/
        model.safetensors    model weights, each shared storage saved once
        training_state.pt    optimizer, scheduler, scaler, step, data state,
                             RNG states; loadable with weights_only=True
        meta.json            step, time, config, options, git commit, versions

A checkpoint is written into ``.ckpt_<step>.tmp-*`` next to its final place,
fsync'd, then renamed into place, so a directory named ``ckpt_<step>`` is
always complete; leftovers of a killed save are never picked up.

Save from one process only (rank 0 under DDP); every rank may load.

A model sharded by FSDP2 (``fully_shard``: its parameters are DTensors) is saved by every rank
together: its weights and optimizer state through ``torch.distributed.checkpoint`` (each rank
writes its shards) into ``sharded/`` in place of model.safetensors, the rest by rank 0 as above,
the rename after all ranks have written. It loads into the model sharded over any number of
processes (torch.distributed.checkpoint reshards); a checkpoint of one layout is refused, in one
line, by a run of the other.

No checkpoint holds a NaN/inf: ``save_checkpoint`` checks every floating tensor of the model and
of the optimizer state first (one reduction per tensor, one host read in all) and refuses with
``NonFiniteCheckpointError`` naming the first bad tensor, writing nothing and deleting nothing
(``torch.aminmax`` per tensor, no full-size temporary: 0.2-0.45 s for BERT-base's 110M parameters
with their AdamW/LAMB state on 2 CPU cores, against 4.8 s for the whole save).
Each checkpoint's meta.json records ``"finite": true``; rotation keeps the newest ``keep`` and, in
any case, the newest checkpoint known to be finite.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import random
import re
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tempo.bert.hf_interop import CheckpointError
from tempo.utils import git_commit, unwrap_model

try:
    import numpy as np
except ImportError:  # numpy is a project dependency, but RNG capture should not need it
    np = None

__all__ = [
    "CheckpointError",
    "NonFiniteCheckpointError",
    "nonfinite_tensors",
    "StopFlag",
    "capture_rng_state",
    "install_sigterm_handler",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_weights",
    "restore_rng_state",
    "save_checkpoint",
    "unwrap_model",
]

logger = logging.getLogger(__name__)

CHECKPOINTS_SUBDIR = "checkpoints"
MODEL_FILE = "model.safetensors"
SHARDED_DIR = "sharded"  # torch.distributed.checkpoint's files of an FSDP2 model and its optimizer
STATE_FILE = "training_state.pt"
META_FILE = "meta.json"
FORMAT_VERSION = 1

_CKPT_NAME = re.compile(r"^ckpt_(\d+)$")
_TMP_NAME = re.compile(r"^\.ckpt_\d+\.tmp-")


class NonFiniteCheckpointError(CheckpointError):
    """A checkpoint would hold a NaN/inf tensor: refused before anything is written."""


# -- helpers ---------------------------------------------------------------


def nonfinite_tensors(model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                      limit: int = 3) -> list[str]:
    """Names of (at most ``limit``) floating tensors holding NaN/inf: model parameters and buffers
    by name, optimizer state as ``optimizer state '<key>' of <parameter name>``. Empty: all finite.

    One reduction per tensor on its device and a single host read for all of them (names are
    looked up only when something is bad)."""
    named: list[tuple[str, torch.Tensor]] = []
    names: dict[int, str] = {}
    if model is not None:
        target = unwrap_model(model)
        for name, tensor in list(target.named_parameters()) + list(target.named_buffers()):
            named.append((name, tensor))
            names[id(tensor)] = name
    if optimizer is not None:
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                owner = names.get(id(param), f"group {g} parameter {i}")
                for key, value in optimizer.state.get(param, {}).items():
                    if torch.is_tensor(value):
                        named.append((f"optimizer state {key!r} of {owner}", value))
            for key, value in group.items():
                if key != "params" and torch.is_tensor(value):
                    named.append((f"optimizer group {g} {key!r}", value))
    # A DTensor (FSDP2) is checked on this rank's shard: the caller combines the ranks' answers.
    floating = [(name, _local(t.detach())) for name, t in named if t.is_floating_point() and t.numel() > 0]
    floating = [(name, t) for name, t in floating if t.numel() > 0]
    if not floating:
        return []
    flags_by_device: dict[torch.device, list[torch.Tensor]] = {}
    order: dict[torch.device, list[str]] = {}
    for name, t in floating:
        # min and max propagate NaN and show +-inf; no full-size temporary (isfinite(t).all() makes
        # one, and is ~20x slower on a CPU).
        low, high = torch.aminmax(t)
        flags_by_device.setdefault(t.device, []).append(torch.isfinite(low) & torch.isfinite(high))
        order.setdefault(t.device, []).append(name)
    bad: list[str] = []
    for device, flags in flags_by_device.items():
        ok = torch.stack(flags).cpu().tolist()  # one host read per device
        bad += [name for name, good in zip(order[device], ok) if not good]
    position = {name: i for i, (name, _) in enumerate(floating)}
    return sorted(bad, key=position.get)[:limit]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (FSDP2's ``fully_shard``)."""
    return any(hasattr(p, "to_local") and hasattr(p, "placements") for p in unwrap_model(model).parameters())


_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _make_loadable(obj: Any, where: str) -> Any:
    """Return ``obj`` in a form ``torch.load(weights_only=True)`` accepts.

    numpy arrays become tensors and numpy scalars Python numbers; anything
    else that is not a tensor, plain value or container raises here, at save
    time, instead of at resume time.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, _PLAIN_TYPES):
        return obj
    if np is not None:
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind == "u" and obj.dtype != np.uint8:
                obj = obj.astype(np.int64)  # torch has little support for wide unsigned ints
            if obj.dtype.kind not in "biuf":
                raise TypeError(f"{where}: numpy array of dtype {obj.dtype} cannot be checkpointed")
            return torch.from_numpy(obj.copy())
    if isinstance(obj, dict):
        return {key: _make_loadable(value, f"{where}[{key!r}]") for key, value in obj.items()}
    if isinstance(obj, torch.Size):
        return obj
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_make_loadable(value, f"{where}[{i}]") for i, value in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items) if isinstance(obj, tuple) else set(items)
    raise TypeError(
        f"{where}: {type(obj).__qualname__} cannot be stored in a weights_only checkpoint; "
        "use tensors, numbers, strings, lists, tuples and dicts"
    )


def capture_rng_state() -> dict[str, Any]:
    """RNG states of torch (CPU and every CUDA device), python and numpy as plain data."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    # Only when CUDA is already in use: querying would otherwise initialise it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    if np is not None:
        algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        state["numpy"] = {
            "algorithm": algorithm,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(cuda_states) != count:
            logger.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d; "
                "restoring the first %d",
                len(cuda_states),
                count,
                min(count, len(cuda_states)),
            )
        for device, cuda_state in enumerate(cuda_states[:count]):
            torch.cuda.set_rng_state(cuda_state, device)
    np_state = state.get("numpy")
    if np_state is not None and np is not None:
        np.random.set_state(
            (
                np_state["algorithm"],
                np_state["keys"].numpy().astype(np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )


def _fsync_path(path: Path) -> None:
    """fsync a file or directory (directories: best effort, not on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    return str(obj)


def _checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINTS_SUBDIR


# -- discovery -------------------------------------------------------------


def _is_complete(path: Path) -> bool:
    weights = (path / MODEL_FILE).is_file() or (path / SHARDED_DIR / ".metadata").is_file()
    return weights and all((path / name).is_file() for name in (STATE_FILE, META_FILE))


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``output_dir`` as (step, path), oldest first.

    Temporary directories of an unfinished save and directories missing one
    of the three files are ignored; a missing or empty directory gives [].
    """
    root = _checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _CKPT_NAME.match(entry.name)
        if not match or not entry.is_dir():
            continue
        if not _is_complete(entry):
            logger.warning("ignoring incomplete checkpoint directory %s", entry)
            continue
        found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step, or None if there is none."""
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1][1] if checkpoints else None


# -- save ------------------------------------------------------------------


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: torch.amp.GradScaler | None = None,
    data_state: Any = None,
    extra: Any = None,
    keep: int | None = 3,
    *,
    config: Any = None,
    options: Any = None,
) -> Path:
    """Atomically write ``<output_dir>/checkpoints/ckpt_<step>`` and return its path.

    ``data_state`` and ``extra`` may hold tensors, numbers, strings, lists,
    tuples, dicts and numpy values (numpy comes back as tensors / Python
    numbers). ``config`` and ``options`` only go to meta.json. After the new
    checkpoint is in place, all but the newest ``keep`` checkpoints are
    deleted (``keep=None`` or ``<= 0`` keeps everything); the new one is
    never deleted. Re-saving an existing step replaces it.
    """
    step = int(step)
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    sharded = is_sharded(model)
    bad = nonfinite_tensors(model, optimizer)
    if sharded:  # every rank refuses together (each checked its own shards)
        bad = _any_rank(bad)
    if bad:
        raise NonFiniteCheckpointError(
            f"refusing to write checkpoint step {step} to {_checkpoint_root(output_dir)}: {bad[0]} holds NaN/inf"
            + (f" (also {', '.join(bad[1:])})" if len(bad) > 1 else "")
            + "; the checkpoints already there are kept")
    root = _checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt_{step}"
    existing = list_checkpoints(output_dir)
    if existing and existing[-1][0] > step:
        logger.warning(
            "saving step %d into %s, which already holds a newer checkpoint (step %d)",
            step,
            root,
            existing[-1][0],
        )

    # Build (and validate) everything before touching the disk.
    training_state = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "optimizer": _make_loadable(optimizer.state_dict(), "optimizer") if optimizer is not None else None,
        "scheduler": _make_loadable(scheduler.state_dict(), "scheduler") if scheduler is not None else None,
        "scaler": _make_loadable(scaler.state_dict(), "scaler") if scaler is not None else None,
        "data_state": _make_loadable(data_state, "data_state"),
        "extra": _make_loadable(extra, "extra"),
        "rng": capture_rng_state(),
    }

    if sharded:
        training_state["optimizer"] = None  # in sharded/, with the weights
        return _save_sharded(root, final, step, model, optimizer, training_state, output_dir, keep, config, options)
    tmp = root / f".ckpt_{step}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    replaced = None
    try:
        _save_model_file(unwrap_model(model), tmp / MODEL_FILE)
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save(training_state, f)
            f.flush()
            os.fsync(f.fileno())
        meta = _meta(step, config, options, {name: (tmp / name).stat().st_size for name in (MODEL_FILE, STATE_FILE)})
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, default=_json_default)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)

        if final.exists():
            # os.replace cannot overwrite a non-empty directory: move it aside.
            replaced = root / f".ckpt_{step}.tmp-old-{uuid.uuid4().hex[:8]}"
            os.replace(final, replaced)
        os.replace(tmp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if replaced is not None and not final.exists():
            os.replace(replaced, final)
        raise
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)

    _prune(root, output_dir, keep, final)
    logger.info("saved checkpoint %s", final)
    return final


def _any_rank(bad: list[str]) -> list[str]:
    """This rank's non-finite tensors, or a line saying another rank found some (one all-reduce)."""
    import torch.distributed as dist

    flag = torch.tensor([1 if bad else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bad or (["a shard on another rank"] if int(flag) else [])


def _meta(step: int, config: Any, options: Any, files: dict, **more: Any) -> dict:
    now = time.time()
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "time": now,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "config": config,
        "options": options,
        "git_commit": git_commit()["commit"],
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "finite": True,  # checked before writing: rotation never deletes the newest such checkpoint
        # Sizes let load_checkpoint tell a truncated file from a corrupt one.
        "file_sizes": files,
        **more,
    }


def _save_sharded(root: Path, final: Path, step: int, model: nn.Module, optimizer: Any, training_state: dict,
                  output_dir: Any, keep: int | None, config: Any, options: Any) -> Path:
    """Every rank writes its shards into one temporary directory (rank 0 names it), rank 0 the
    training state and meta.json; after a barrier rank 0 renames it into place (module docstring)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    rank = dist.get_rank()
    name = [f".ckpt_{step}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    tmp = root / name[0]
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    failed = torch.tensor([0])
    try:
        dcp.save(state, checkpoint_id=str(tmp / SHARDED_DIR))
        if rank == 0:
            with open(tmp / STATE_FILE, "wb") as f:
                torch.save(training_state, f)
                f.flush()
                os.fsync(f.fileno())
            meta = _meta(step, config, options, {STATE_FILE: (tmp / STATE_FILE).stat().st_size},
                         parallel="fsdp2", world_size=dist.get_world_size())
            with open(tmp / META_FILE, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2, default=_json_default)
                f.flush()
                os.fsync(f.fileno())
            for folder in (tmp / SHARDED_DIR, tmp):
                _fsync_path(folder)
    except BaseException:
        failed += 1
        dist.all_reduce(failed)  # the other ranks learn of it at the barrier below
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.all_reduce(failed)  # every rank has written (or one failed: nothing is renamed)
    if int(failed):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint step {step}: another rank failed to write its shards into {tmp}")
    if rank == 0:
        replaced = None
        if final.exists():
            replaced = root / f".ckpt_{step}.tmp-old-{uuid.uuid4().hex[:8]}"
            os.replace(final, replaced)
        os.replace(tmp, final)
        _fsync_path(root)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        _prune(root, output_dir, keep, final)
        logger.info("saved sharded checkpoint %s", final)
    dist.barrier()  # no rank goes on (and may load) before the checkpoint is in place
    return final


def _load_sharded(path: Path, model: nn.Module, optimizer: Any) -> None:
    """The weights and optimizer state of a sharded checkpoint into ``model`` sharded over this
    run's processes (any number: torch.distributed.checkpoint reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path / SHARDED_DIR))
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        # Its text holds each rank's traceback: the first line naming an error says what.
        lines = [line.strip() for line in str(err).splitlines() if re.match(r"^\s*\w+(Error|Exception): ", line)]
        first = (lines[0] if lines else str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        raise CheckpointError(f"{path / SHARDED_DIR} does not fit this model: {first[:300]}") from err


def _save_model_file(model: nn.Module, path: Path) -> None:
    from safetensors.torch import save_model

    # save_model stores each shared storage (tied weights) once.
    save_model(model, str(path), metadata={"format": "pt"})
    _fsync_path(path)


def _known_finite(path: Path) -> bool:
    try:
        return json.loads((path / META_FILE).read_text(encoding="utf-8")).get("finite") is True
    except (OSError, ValueError, AttributeError):
        return False


def _prune(root: Path, output_dir, keep: int | None, newest: Path) -> None:
    if keep is not None and keep > 0:
        checkpoints = list_checkpoints(output_dir)
        kept = {path for _, path in checkpoints[-keep:]}
        if not any(_known_finite(path) for path in kept):
            # The newest finite checkpoint survives rotation even when newer ones (written before
            # this check existed, or copied in) are not known to be finite.
            finite = [path for _, path in checkpoints if _known_finite(path)]
            kept |= set(finite[-1:])
        for _, path in checkpoints:
            if path not in kept and path != newest:
                shutil.rmtree(path, ignore_errors=True)
    # Leftovers of killed saves: only one process saves, so none is in flight.
    for entry in root.iterdir():
        if _TMP_NAME.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


# -- load ------------------------------------------------------------------


def _check_files(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    weights = SHARDED_DIR + "/.metadata" if (path / SHARDED_DIR).is_dir() else MODEL_FILE
    for name in (weights, STATE_FILE, META_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {path / name} is missing")
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path / META_FILE}: {err}") from err
    for name, size in (meta.get("file_sizes") or {}).items():
        actual = (path / name).stat().st_size
        if actual != size:
            raise CheckpointError(
                f"{path / name} has {actual} bytes but {size} were written; the file is truncated or corrupt"
            )
    return meta


def _load_training_state(file: Path, map_location) -> dict[str, Any]:
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure means the file is unusable
        raise CheckpointError(
            f"cannot load {file} (corrupt, or contains objects other than tensors and plain data, "
            f"which are refused): {err}"
        ) from err
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{file} is not a tempo training state")
    return state


def load_model_weights(path: str | os.PathLike, model: nn.Module, strict: bool = True) -> nn.Module:
    """Load weights from a checkpoint directory or a ``.safetensors`` file into ``model``.

    Only the weights: suitable for ``--init_checkpoint``. Returns the unwrapped model.
    """
    from safetensors.torch import load_model

    path = Path(path)
    file = path / MODEL_FILE if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"model weights {file} not found")
    target = unwrap_model(model)
    try:
        load_model(target, str(file), strict=strict)
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"cannot load model weights from {file}: {err}") from err
    return target


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: torch.amp.GradScaler | None = None,
    map_location: Any = "cpu",
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a checkpoint written by `save_checkpoint` into the given objects.

    Returns ``{"step", "data_state", "extra", "meta", "path"}``. Everything is
    read with ``weights_only=True``; a missing, truncated, corrupt or unsafe
    file raises `CheckpointError` naming it. Create the scheduler before
    calling this (constructing a scheduler resets the optimizer's lr).
    """
    path = Path(path)
    meta = _check_files(path)
    state_file = path / STATE_FILE
    state = _load_training_state(state_file, map_location)

    written_sharded, sharded = (path / SHARDED_DIR).is_dir(), is_sharded(model)
    if written_sharded != sharded:
        how = ("by an FSDP2 run (--parallel fsdp2): resume it with --parallel fsdp2, at any number of processes"
               if written_sharded else "by one process or DDP: resume it without --parallel fsdp2")
        raise CheckpointError(f"checkpoint {path} was written {how}")
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is not None and state.get(name) is None and not (name == "optimizer" and sharded):
            raise CheckpointError(f"{state_file} has no {name} state; pass {name}=None to skip it")

    if sharded:
        _load_sharded(path, model, optimizer)
    else:
        load_model_weights(path, model)
    try:
        if optimizer is not None and not sharded:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None:
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            elif scaler.is_enabled():
                logger.warning("%s has no GradScaler state; keeping the scaler's initial state", state_file)
    except (KeyError, ValueError, RuntimeError, TypeError) as err:
        raise CheckpointError(f"state in {state_file} does not fit the given objects: {err}") from err
    if restore_rng and state.get("rng") is not None:
        restore_rng_state(state["rng"])
    return {
        "step": int(state["step"]),
        "data_state": state.get("data_state"),
        "extra": state.get("extra"),
        "meta": meta,
        "path": path,
    }


# -- graceful stop -----------------------------------------------------------


class StopFlag:
    """Set by a signal handler; the training loop polls ``requested``.

    Under DDP the ranks should agree (e.g. all-reduce the flag) before saving.
    """

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def restore(self) -> None:
        """Reinstall the handlers that were active before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def install_sigterm_handler(signals: tuple[int, ...] = (signal.SIGTERM,)) -> StopFlag:
    """On the given signals (default SIGTERM) only set ``flag.requested = True``.

    The handler does no other work; the training loop checks the flag, writes
    a final checkpoint and exits. Must be called from the main thread.
    """
    flag = StopFlag()

    def _request_stop(signum, frame):  # noqa: ARG001 - signal handler signature
        flag.requested = True
        flag.signum = signum

    for signum in signals:
        flag._previous[signum] = signal.signal(signum, _request_stop)
    return flag
