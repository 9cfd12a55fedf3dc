"""What one model call tells its layers: a per-thread stack of calls, pushed and popped by hooks on
the model.

Some facts about a batch can only be read at the model's call: the sequence boundaries of a
padding-free batch (a host read, so outside any torch.compile graph), or whether the model builds
its layers' mask itself from a [B, S] mask (shapes only). A forward pre-hook on the model pushes a
call record, a forward post-hook (``always_call``) pops it, and the layers read the innermost
record: no host read and no graph break inside a layer. Three users, each with its own record and
stack: the registered Tempo attention (``hf_attention``), DeBERTa-v2's and MPNet's.

The hooks themselves stay module-level functions of each user (pickled by reference, shared by
deep copies, found again by identity when removed): no handle, no closure, nothing that refers to
one model instance is kept anywhere. This module holds what the three share: the stack, finding,
installing and removing the hooks, and reading a call's arguments.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn


_STACKS: "weakref.WeakSet[CallStack]" = weakref.WeakSet()  # every CallStack made: what a replay re-enters


class CallStack:
    """The calls running in this thread, innermost last (one stack per user)."""

    def __init__(self) -> None:
        self._local = threading.local()
        _STACKS.add(self)

    def _calls(self) -> list:
        calls = getattr(self._local, "calls", None)
        if calls is None:
            calls = self._local.calls = []
        return calls

    def current(self) -> Any:
        """The innermost call running in this thread, or None."""
        calls = getattr(self._local, "calls", None)
        return calls[-1] if calls else None

    def push(self, call: Any) -> None:
        """``call`` (which has an ``owner``: the module whose hook pushed it) becomes the innermost."""
        self._calls().append(call)

    def pop(self, owner: nn.Module) -> None:
        """Pop the innermost call if ``owner`` pushed it (not when another pre-hook raised before the
        pushing one ran)."""
        calls = self._calls()
        if calls and calls[-1].owner is owner:
            calls.pop()


def current_calls() -> list[tuple[CallStack, Any]]:
    """The innermost call of every stack that has one, in this thread: what a layer run again
    later (a block's recomputation in backward, after the model call has returned) must see."""
    return [(stack, stack.current()) for stack in list(_STACKS) if stack.current() is not None]


@contextlib.contextmanager
def replayed(calls: list[tuple[CallStack, Any]]) -> Iterator[None]:
    """Run the body inside ``calls`` (from ``current_calls``) again: each pushed on its stack, and
    popped after, whatever happens."""
    for stack, call in calls:
        stack.push(call)
    try:
        yield
    finally:
        for stack, call in reversed(calls):
            stack.pop(call.owner)


def hooked(module: nn.Module, pre_hook: Callable[..., Any]) -> bool:
    """Whether ``pre_hook`` (by identity) is one of ``module``'s forward pre-hooks."""
    return any(hook is pre_hook for hook in module._forward_pre_hooks.values())


def install(module: nn.Module, pre_hook: Callable[..., Any], post_hook: Callable[..., Any]) -> bool:
    """Put the call hooks on ``module`` unless it has them; whether it got them."""
    if hooked(module, pre_hook):
        return False
    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    module.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
    return True


def remove(modules: Iterable[nn.Module], pre_hook: Callable[..., Any], post_hook: Callable[..., Any]) -> None:
    """Take the call hooks out of ``modules``: the entries whose function is ``pre_hook`` or
    ``post_hook`` (by identity; a user's hooks stay), as their RemovableHandle would."""
    for module in modules:
        for key, hook in list(module._forward_pre_hooks.items()):
            if hook is pre_hook:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
        for key, hook in list(module._forward_hooks.items()):
            if hook is post_hook:
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)


def argument(args: tuple, kwargs: dict, name: str, position: int) -> Any:
    """The call's argument ``name``, passed by keyword or at ``position``; None when absent."""
    return kwargs[name] if name in kwargs else (args[position] if len(args) > position else None)


def mask_per_token(args: tuple, kwargs: dict, positions: dict[str, int]) -> bool:
    """The call's attention_mask is absent or [B, S], the batch's shape (read from shapes only): the
    model then builds its layers' mask itself. ``positions``: where the model's forward takes
    ``attention_mask``, ``input_ids`` and ``inputs_embeds``."""
    mask = argument(args, kwargs, "attention_mask", positions["attention_mask"])
    if mask is None:
        return True
    ids = argument(args, kwargs, "input_ids", positions["input_ids"])
    if ids is None:
        ids = argument(args, kwargs, "inputs_embeds", positions["inputs_embeds"])
    return (isinstance(mask, torch.Tensor) and isinstance(ids, torch.Tensor) and mask.dim() == 2
            and tuple(mask.shape) == tuple(ids.shape[:2]))


__all__ = ["CallStack", "argument", "current_calls", "hooked", "install", "mask_per_token", "remove", "replayed"]
