"""Recompute per Transformer block: "none", "selective" or "full", applied so the model stays the model.

  * "none": the block keeps what its layers keep (Tempo's floor after ``apply_tempo``).
  * "full": ``torch.utils.checkpoint`` (non-reentrant) around the block's forward: it keeps its
    inputs only and runs its forward again inside backward.
  * "selective": the block's MLP expansion is recomputed, nothing else. The outputs of its widest
    Linear layers (an MLP's up projection, h -> I; gate and up of a gated MLP; the fused h -> 2I)
    and of the activations applied to them are not kept for backward: where autograd saves one of
    them, a small handle holding the Linear's input (kept anyway: it is the MLP's input, which the
    Linear itself saves) takes its place, and backward recomputes the tensor from it when it needs
    it. That drops the MLP's intermediate (8 h per token for BERT's GELU output, 2·I for a gated
    MLP's gate and up) for one more up-projection GEMM per token in backward: the cheapest bytes a
    Tempo block still has. (A selective-checkpoint policy over the whole block,
    ``create_selective_checkpoint_contexts``, was measured first: it caches the output of every op
    it saves, projections' pre-reshape outputs and the residual branches' inputs among them, and
    kept 24.1 h per BERT-large token against Tempo's 20.6 h without it.)

Exactness: "full" runs the forward again on the same inputs with the RNG state the forward had
(``preserve_rng_state``), so every dropout mask and every seed Tempo's layers draw is drawn again
identically. "selective" recomputes a Linear (and its activation) on the same input under the
autocast state of the forward, with no random op in between (a block whose activation is not
applied right to the Linear's output gets no handle for it): the same GEMM on the same operands. On
the CPU that is bitwise the same tensor; on CUDA cuBLAS is deterministic for the same shapes on the
same stream and configuration, which a backward on the forward's device has. Tests compare the
gradients of every mode with the block without recompute, dropout on, to the bit on the CPU.

How it is applied: ``set_recompute(block, mode)`` gives the block a class that is a subclass of its
own (``recomputed_class``: the same name, ``isinstance`` holds, pickles and deep-copies as itself,
state_dict keys unchanged) whose ``forward`` wraps the original's, only in training with grad
enabled (eval and ``no_grad`` run the block as it is). Hooks on the block stay outside the
checkpoint (as transformers' own gradient checkpointing does since 5.2x), so FSDP2's and the
ledger's hooks run once. "selective" finds the Linear and activation outputs through forward hooks
on those modules (module-level functions, found again by identity when removed: nothing in the
model refers to another instance). ``set_recompute(block, "none")`` gives the block its class back
and removes the hooks; ``remove_recompute(model)`` does that for every block of a model
(``revert_tempo`` calls it: a reverted model is the stock model, recompute included).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger("tempo.plan")

MODES = ("none", "selective", "full")
_MODE = "_tempo_recompute"  # on a block: its mode ("selective" / "full"); absent for "none"
_STANDS_FOR = "_tempo_recomputes"  # on a recomputed block's class: the block's own class

_active = threading.local()  # the selective forward running on this thread: its records


class _Recompute:
    """Stands for a saved tensor backward can make again: ``module`` applied to ``source`` (a tensor,
    or another _Recompute), under the autocast state the forward ran with."""

    __slots__ = ("module", "source", "autocast", "modes", "value")

    def __init__(self, module: nn.Module, source: Any, autocast: tuple) -> None:
        self.module, self.source, self.autocast, self.value = module, source, autocast, None
        self.modes = _ForwardContext()

    def tensor(self) -> torch.Tensor:
        if self.value is None:
            source = self.source.tensor() if isinstance(self.source, _Recompute) else self.source
            device_type, enabled, dtype, cache = self.autocast
            # With grad, as the forward ran: Tempo's layers take their training path only when a
            # backward can follow (without one they run the stock op, rounded differently). The
            # graph this builds is dropped at once.
            with self.modes, torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                                  cache_enabled=cache):
                self.value = self.module(source.detach().requires_grad_(source.is_floating_point())).detach()
        return self.value


def _autocast_state(device_type: str) -> tuple:
    return (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


def _record_linear(module: nn.Module, args: tuple, output: Any) -> None:
    records = getattr(_active, "records", None)
    if records is None or not isinstance(output, torch.Tensor) or len(args) != 1:
        return
    source = args[0]
    if isinstance(source, torch.Tensor):
        records[output] = _Recompute(module, source, _autocast_state(source.device.type))


def _enter_activation(module: nn.Module, args: tuple) -> None:
    records = getattr(_active, "records", None)
    if records is None or len(args) != 1:
        return
    source = records.whole(args[0])
    if source is not None:  # the activation of a recorded Linear's whole output, nothing in between
        records.activations.append(_Activation(module, source, args[0]))


def _record_activation(module: nn.Module, args: tuple, output: Any) -> None:
    records = getattr(_active, "records", None)
    if records is None or not records.activations or records.activations[-1].module is not module:
        return
    activation = records.activations.pop()
    if not isinstance(output, torch.Tensor):
        return
    if activation.claimed is not None and activation.claimed is not records.storage_of(output):
        raise RuntimeError(f"tempo selective recompute: {type(module).__name__} saved a tensor shaped like its output "
                           f"that is not its output; this activation cannot be recomputed selectively (use "
                           f"recompute 'full' for this block)")
    if activation.claimed is None:
        records[output] = _Recompute(module, activation.source, activation.source.autocast)


class _Activation:
    """An activation module running on a recorded Linear's output: while it runs, a tensor it saves
    that has its input's size and dtype in a storage of its own is its output (checked against the
    output when it returns: anything else raises before any backward could use it)."""

    __slots__ = ("module", "source", "numel", "dtype", "input_storage", "claimed")

    def __init__(self, module: nn.Module, source: "_Recompute", x: torch.Tensor) -> None:
        self.module, self.source, self.numel, self.dtype = module, source, x.numel(), x.dtype
        self.input_storage = x.untyped_storage()
        self.claimed: Any = None


class _Records:
    """The recomputable tensors of one selective forward, found by their storage, held weakly: a
    storage freed during the forward takes its entry with it, so memory reused by a later tensor is
    never mistaken for it. Only outputs that are their whole storage (contiguous, from offset 0) are
    recorded, so that any saved view of one is the same view of the recomputed tensor."""

    def __init__(self) -> None:
        self._by_storage: "weakref.WeakKeyDictionary[Any, _Recompute]" = weakref.WeakKeyDictionary()
        self.activations: list[_Activation] = []  # activation modules running now (innermost last)

    def storage_of(self, t: torch.Tensor) -> Any:
        return self._storage(t)

    def claim(self, t: torch.Tensor) -> Optional["_Recompute"]:
        """A tensor saved inside a running activation that is its output (see _Activation)."""
        if not self.activations:
            return None
        activation = self.activations[-1]
        storage = self._storage(t)
        if (activation.claimed is not None or storage is None or storage is activation.input_storage
                or t.numel() != activation.numel or t.dtype != activation.dtype
                or storage.nbytes() != t.numel() * t.element_size()):
            return None
        activation.claimed = storage
        record = _Recompute(activation.module, activation.source, activation.source.autocast)
        self._by_storage[storage] = record
        return record

    @staticmethod
    def _storage(t: torch.Tensor) -> Any:
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None

    def __setitem__(self, t: torch.Tensor, record: _Recompute) -> None:
        storage = self._storage(t)
        whole = (t.is_contiguous() and t.storage_offset() == 0
                 and storage is not None and storage.nbytes() == t.numel() * t.element_size())
        if whole:
            self._by_storage[storage] = record

    def get(self, t: Any) -> Optional[_Recompute]:
        """The recompute of ``t``'s storage (``t`` may be any view of it)."""
        if not isinstance(t, torch.Tensor):
            return None
        storage = self._storage(t)
        return self._by_storage.get(storage) if storage is not None else None

    def whole(self, t: Any) -> Optional[_Recompute]:
        """The recompute of ``t`` when ``t`` is that whole tensor, not a part of it (a chunk of a fused
        projection's output is not what applying the activation to the recompute would give)."""
        record = self.get(t)
        if record is None or not (t.is_contiguous() and t.storage_offset() == 0
                                  and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
            return None
        return record


class _Saved:
    """What autograd holds for a recomputable saved tensor: the recompute and the saved view."""

    __slots__ = ("record", "shape", "stride", "offset", "dtype")

    def __init__(self, record: _Recompute, t: torch.Tensor) -> None:
        self.record, self.shape, self.stride = record, tuple(t.shape), tuple(t.stride())
        self.offset, self.dtype = t.storage_offset(), t.dtype

    def tensor(self) -> torch.Tensor:
        value = self.record.tensor()
        if value.dtype != self.dtype:
            raise RuntimeError(f"tempo selective recompute: {type(self.record.module).__name__} recomputed a "
                               f"{value.dtype} tensor where {self.dtype} was saved")
        return value.as_strided(self.shape, self.stride, self.offset)


class RecomputedBlock(nn.Module):
    """The mixin ``set_recompute`` puts in front of a block's class (see the module docstring)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        original_forward = super().forward
        mode = self.__dict__.get(_MODE, "none")
        if mode == "none" or not (self.training and torch.is_grad_enabled()):
            return original_forward(*args, **kwargs)
        if mode == "full":
            args, kwargs = _without_cache(self, original_forward, args, kwargs)
            return checkpoint(original_forward, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=_same_function_modes, **kwargs)
        records = _Records()

        def pack(t: torch.Tensor) -> Any:
            record = records.get(t) or records.claim(t)
            return _Saved(record, t) if record is not None else t

        outer = getattr(_active, "records", None)
        _active.records = records
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                return original_forward(*args, **kwargs)
        finally:
            _active.records = outer


def _same_function_modes() -> tuple:
    """checkpoint's (forward, recompute) contexts: the recomputation runs under the torch function
    modes the forward ran under (the autograd engine does not carry them into backward; tempo.plan's
    fake traces take CUDA's decisions through one), and inside the model calls it ran inside: the
    packing of a padding-free batch, which DeBERTa's and Tempo's attention layers read from the
    call (``tempo.integrations.model_calls``), is gone by the time backward recomputes the block."""
    return contextlib.nullcontext(), _ForwardContext()


class _ForwardContext:
    """Re-enters, when backward recomputes, the torch function modes (innermost last) and the model
    calls active where it was made."""

    def __init__(self) -> None:
        from tempo.integrations import model_calls

        self.modes = list(torch.overrides._get_current_function_mode_stack())
        self.calls = model_calls.current_calls()
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> "_ForwardContext":
        from tempo.integrations import model_calls

        self._stack = contextlib.ExitStack()
        for mode in self.modes:
            self._stack.enter_context(mode)
        self._stack.enter_context(model_calls.replayed(self.calls))
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.__exit__(*exc)


_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past", "cache")
_logged_cache = False
_POSITIONAL: dict[type, tuple[str, ...]] = {}  # recomputed class -> its forward's positional parameter names


def _positional_names(block: nn.Module, forward: Any) -> tuple[str, ...]:
    """The names of ``forward``'s positional parameters, in order, up to a ``*args`` (after one,
    a position names nothing); found once per class."""
    cls = type(block)
    if cls not in _POSITIONAL:
        names = []
        for parameter in inspect.signature(forward).parameters.values():
            if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                break
            names.append(parameter.name)
        _POSITIONAL[cls] = tuple(names)
    return _POSITIONAL[cls]


def _without_cache(block: nn.Module, forward: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``forward`` (the block's original forward) under "full" recompute:
    every argument named in ``_CACHE_ARGUMENTS`` that is not None becomes None and ``use_cache``,
    when true, becomes False, whether passed by keyword (Llama: ``cache=``) or by position (GPT-2's
    block takes its cache second). So neither the forward nor its recomputation in backward reads
    or writes a KV cache (the recomputation would append its keys a second time), and no cache
    is kept in the checkpoint: the caller's cache object is left as it was passed. As
    transformers' own gradient checkpointing does, training with recompute runs without one
    (logged once). Without a cache or a true ``use_cache``, ``args`` and ``kwargs`` are returned
    as they are."""
    global _logged_cache
    names = _positional_names(block, forward)
    named = [(names[i] if i < len(names) else None, value) for i, value in enumerate(args)] + list(kwargs.items())
    dropped = [name for name, value in named if name in _CACHE_ARGUMENTS and value is not None]
    if not dropped and not any(name == "use_cache" and value for name, value in named):
        return args, kwargs
    if not _logged_cache:
        _logged_cache = True
        logger.warning("tempo recompute: %s runs without a KV cache under full recompute (%s dropped; logged once)",
                       type(block).__name__, ", ".join(dropped or ["use_cache"]))

    def without(name: Optional[str], value: Any) -> Any:
        if name in _CACHE_ARGUMENTS:
            return None
        return False if name == "use_cache" else value

    args = tuple(without(name, value) for (name, _), value in zip(named, args))
    return args, {k: without(k, v) for k, v in kwargs.items()}


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor() if isinstance(saved, _Saved) else saved


_RECOMPUTED: dict[type, type] = {}


def _rebuild_recomputed(original_cls: type) -> nn.Module:
    """pickle / deepcopy: an empty instance of the recomputed class (its state is set after)."""
    return object.__new__(recomputed_class(original_cls))


def _reduce_recomputed(self: nn.Module, protocol: int) -> Any:
    return _rebuild_recomputed, (type(self).__dict__[_STANDS_FOR],), self.__getstate__()


def recomputed_class(original_cls: type) -> type:
    """``RecomputedBlock`` in front of ``original_cls``, under the original's name, module and
    qualname (``type(block).__name__`` and transformers' ``_no_split_modules`` see the block as
    before); one class per original, made once."""
    if original_cls not in _RECOMPUTED:
        namespace = {_STANDS_FOR: original_cls, "__module__": original_cls.__module__,
                     "__qualname__": original_cls.__qualname__, "__doc__": original_cls.__doc__,
                     "__reduce_ex__": _reduce_recomputed}
        _RECOMPUTED[original_cls] = type(original_cls.__name__, (RecomputedBlock, original_cls), namespace)
    return _RECOMPUTED[original_cls]


def _is_activation(module: nn.Module) -> bool:
    from tempo.integrations.layers import gelu_form

    if any(True for _ in module.parameters(recurse=False)) or module._modules:
        return False
    name = type(module).__name__.lower()
    return gelu_form(module)[0] or any(word in name for word in ("silu", "swish", "gelu", "relu", "tanh",
                                                                "activation"))


def recomputed_parts(block: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the Linear layers, the activation modules) "selective" recomputes in ``block``: its widest
    Linear layers (the largest out_features, when wider than their input) and its parameter-free
    activation modules. No Linears: the block has no MLP expansion to recompute."""
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    widest = max((m.out_features for m in linears), default=0)
    parts = [m for m in linears if m.out_features == widest and m.out_features > m.in_features]
    if not parts:
        return [], []
    return parts, [m for m in block.modules() if _is_activation(m)]


def _remove_marks(block: nn.Module) -> None:
    for module in block.modules():
        for key in [k for k, v in module._forward_hooks.items() if v in (_record_linear, _record_activation)]:
            del module._forward_hooks[key]
            module._forward_hooks_always_called.pop(key, None)
        for key in [k for k, v in module._forward_pre_hooks.items() if v is _enter_activation]:
            del module._forward_pre_hooks[key]


def recompute_of(block: nn.Module) -> str:
    """The block's recompute mode ("none" when set_recompute never changed it)."""
    return block.__dict__.get(_MODE, "none")


def set_recompute(block: nn.Module, mode: str) -> nn.Module:
    """Give ``block`` recompute ``mode`` (module docstring); returns it. Idempotent.

    Every call first takes off what an earlier one put on: the block's own class back, no mode
    recorded in its ``__dict__``, and no hook this module registered left on the block or any
    of its submodules. "none" stops there: afterwards ``type(block)`` is the class it had before
    any set_recompute, ``recompute_of(block) == "none"`` and the block is the block it was
    (every other hook and attribute untouched). "selective" and "full" then record the mode and
    switch the class (and "selective" hooks its Linears and activations)."""
    if mode not in MODES:
        raise ValueError(f"set_recompute: argument 'mode' must be one of {MODES}, got {mode!r}")
    if not isinstance(block, nn.Module):
        raise TypeError(f"set_recompute: argument 'block' must be an nn.Module, got {type(block).__name__}")
    if getattr(block, "gradient_checkpointing", False) and mode != "none":
        raise ValueError(f"set_recompute: {type(block).__name__} already has transformers' gradient checkpointing "
                         f"switched on; switch it off (model.gradient_checkpointing_disable()) or leave the "
                         f"recompute to it")
    _remove_marks(block)
    cls = type(block)
    if isinstance(block, RecomputedBlock) and _STANDS_FOR in cls.__dict__:
        block.__class__ = cls.__dict__[_STANDS_FOR]
    block.__dict__.pop(_MODE, None)
    if mode == "none":
        return block
    if mode == "selective":
        linears, activations = recomputed_parts(block)
        if not linears:
            raise ValueError(f"set_recompute: {type(block).__name__} has no Linear wider than its input to "
                             f"recompute selectively; use 'full' or 'none'")
        for linear in linears:
            linear.register_forward_hook(_record_linear)
        for activation in activations:
            activation.register_forward_pre_hook(_enter_activation)
            activation.register_forward_hook(_record_activation, always_call=True)
    block.__class__ = recomputed_class(type(block))
    block.__dict__[_MODE] = mode
    return block


def remove_recompute(model: nn.Module) -> int:
    """``set_recompute(m, "none")`` for every module ``m`` of ``model`` with a recompute, then the
    hooks this module registered off every module of the tree (one left on a module that was
    outside the tree when its block was set back: an original ``apply_tempo`` had replaced, put
    back by ``revert_tempo``). Afterwards no module of ``model`` has a recompute class, mode or
    hook. Returns how many modules had a recompute."""
    blocks = [m for m in model.modules() if isinstance(m, RecomputedBlock) or _MODE in m.__dict__]
    for block in blocks:
        set_recompute(block, "none")
    _remove_marks(model)
    return len(blocks)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated Transformer blocks: its longest nn.ModuleList whose entries are all of
    one class (bert.encoder.layer, model.layers, transformer.h)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0
             and len({type(b).__name__ for b in m}) == 1]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of Transformer blocks (one class repeated)")
    return max(lists, key=len)


def apply_recompute(model: nn.Module, modes: list[str], blocks: Optional[nn.ModuleList] = None) -> nn.Module:
    """``modes[i]`` for the i-th Transformer block of ``model``; returns the model."""
    blocks = transformer_blocks(model) if blocks is None else blocks
    if len(modes) != len(blocks):
        raise ValueError(f"apply_recompute: {len(modes)} modes for {len(blocks)} Transformer blocks")
    for block, mode in zip(blocks, modes):
        set_recompute(block, mode)
    return model



def fully_shard_blocks(model: nn.Module, **kwargs) -> nn.Module:
    """FSDP2 as Tempo plans and trains it: ``fully_shard`` on each Transformer block, then on the
    root, in place (an initialized process group needed; ``kwargs`` go to fully_shard)."""
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


__all__ = ["MODES", "RecomputedBlock", "apply_recompute", "fully_shard_blocks", "recompute_of", "recomputed_class", "recomputed_parts",
           "remove_recompute", "set_recompute", "transformer_blocks"]
