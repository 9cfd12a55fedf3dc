"""The activation ledger: exactly which bytes autograd keeps for backward.

Every tensor autograd saves passes through ``torch.autograd.graph.saved_tensors_hooks``. The
ledger counts each underlying storage once (a view of a tensor that is already kept costs
nothing more; a view keeps its whole storage alive), attributes it to the innermost module that
was running when it was saved, and sets parameters apart, since they are kept anyway.

The count is exact and device-independent for eager code: it is what a bigger batch has to
pay for, which is the figure the Tempo layers exist to reduce. It does not see tensors kept
outside autograd (e.g. the inputs ``torch.utils.checkpoint`` holds on to), nor temporaries that
live only during forward or backward: the allocator's peak measures those.

    with ActivationLedger(model) as ledger:
        loss = model(batch).loss
    print(ledger.activation_bytes, ledger.by_module())

``tempo.memory.fake.FakeSession`` counts the same bytes on fake tensors: no data, no compute.

``python -m tempo.memory`` (``tempo.memory.cli``) prints the per-layer tables for BERT-large encoder
layers and transformers' encoders. The tables (``tempo.memory.tables``) build models; this module and
``tempo.memory.fake`` do not, so every layer of Tempo may count with them.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn


@dataclass(frozen=True)
class SavedTensor:
    """One storage autograd kept, the first time it was seen."""

    module: str  # qualified name of the innermost running module ("" = outside any module)
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # bytes of the whole storage
    is_parameter: bool


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of the memory behind ``t``; None when it has none we can name (or no bytes).

    Real tensors: the data pointer. Fake and meta tensors (``tempo.memory.fake``) have none: their
    storage object names them instead, which views share, as they share a data pointer."""
    try:
        storage = t.untyped_storage()
        if storage.device.type == "meta":  # fake tensors' storage lives on meta
            return ("meta", storage._cdata) if storage.nbytes() else None
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without real storage
        return None
    if ptr == 0:  # empty tensors: no bytes, and not comparable
        return None
    return (t.device.type, t.device.index, ptr)


def _storage_nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


class ActivationLedger:
    """Context manager recording the storages autograd saves for backward.

    ``model`` (optional) lets the ledger attribute tensors to submodules and recognise the
    model's parameters; without it everything is attributed to "" and only tensors that are
    ``nn.Parameter`` instances are treated as parameters.
    """

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self.records: list[SavedTensor] = []
        self._seen: set[tuple[Any, ...]] = set()
        self._param_keys: set[tuple[Any, ...]] = set()
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._hooks_cm: contextlib.AbstractContextManager | None = None

    # -- recording ------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._seen:
            self._seen.add(key)
            self.records.append(
                SavedTensor(
                    module=self._stack[-1] if self._stack else "",
                    shape=tuple(t.shape),
                    dtype=t.dtype,
                    nbytes=_storage_nbytes(t),
                    is_parameter=key in self._param_keys or isinstance(t, nn.Parameter),
                )
            )
        return t  # keep the tensor itself: the ledger observes, it never changes what is saved

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "ActivationLedger":
        if self.model is not None:
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                key = _storage_key(tensor)
                if key is not None:
                    self._param_keys.add(key)
            for name, module in self.model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
                self._handles.append(module.register_forward_hook(self._leave_module, always_call=True))
        self._hooks_cm = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks_cm is not None
        self._hooks_cm.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter_module(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)

        return hook

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    # -- results --------------------------------------------------------------------------
    @property
    def activation_bytes(self) -> int:
        """Bytes kept for backward, parameters and buffers excluded."""
        return sum(r.nbytes for r in self.records if not r.is_parameter)

    @property
    def parameter_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if r.is_parameter)

    def by_module(self, depth: int | None = None) -> "OrderedDict[str, int]":
        """Activation bytes per module, in first-saved order; ``depth`` truncates dotted names."""
        totals: OrderedDict[str, int] = OrderedDict()
        for r in self.records:
            if r.is_parameter:
                continue
            name = r.module if depth is None else ".".join(r.module.split(".")[:depth])
            totals[name] = totals.get(name, 0) + r.nbytes
        return totals

    def per_token_per_layer(self, tokens: int, layers: int, hidden: int) -> float:
        """Activation bytes per token per layer in units of the hidden size h (bytes / h)."""
        return self.activation_bytes / (tokens * layers * hidden)


def saved_bytes(fn: Callable[..., Any], *args: Any, model: nn.Module | None = None, **kwargs: Any) -> ActivationLedger:
    """Run ``fn(*args, **kwargs)`` under a ledger and return the ledger (the output is dropped)."""
    with ActivationLedger(model) as ledger:
        fn(*args, **kwargs)
    return ledger


def marginal_bytes_per_token(run_batch: Callable[[int], ActivationLedger], tokens_per_sample: int,
                             batches: tuple[int, int] = (1, 2)) -> tuple[float, float]:
    """(activation bytes per token, fixed bytes) from ledgers at two batch sizes.

    Under autocast, autograd also keeps the low-precision copies of the weights; they cost the
    same at every batch size, so a single ledger divided by tokens overstates what each extra
    sample costs. The difference between two batch sizes is the figure that decides how large a
    batch fits; what is left at batch 0 is reported separately as the fixed part.
    """
    small, large = batches
    bytes_small = run_batch(small).activation_bytes
    bytes_large = run_batch(large).activation_bytes
    per_token = (bytes_large - bytes_small) / ((large - small) * tokens_per_sample)
    fixed = bytes_small - per_token * small * tokens_per_sample
    return per_token, fixed


# -- the other persistent parts of a training step (each storage counted once) ---------------
def unique_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once."""
    seen: set[tuple[Any, ...]] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = _storage_key(t)
        nbytes = _storage_nbytes(t)
        if key is None:
            key = (id(t),)
        if key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


def weight_bytes(model: nn.Module) -> int:
    return unique_tensor_bytes(list(model.parameters()) + list(model.buffers()))


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients a backward pass gives every trainable parameter (one per parameter,
    in its dtype): exact whether or not the gradients exist right now (zero_grad frees them)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    return sum(p.numel() * p.element_size() for p in params)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    def tensors():
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value

    return unique_tensor_bytes(tensors())
