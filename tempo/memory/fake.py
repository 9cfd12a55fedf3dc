"""The ledger without the compute: count what autograd keeps on fake tensors.

What a forward keeps for backward depends on shapes, dtypes and the code path, never on the values
(with one exception below), so the ledger can count it on ``torch._subclasses.FakeTensorMode``
tensors: no data exists, no FLOP runs, and a BERT-large layer at s = 512 costs milliseconds and a few
MB instead of seconds and gigabytes. ``ActivationLedger`` identifies a fake tensor's storage by its
storage object (fake tensors have no data pointer), so views, deduplication and module attribution
work as on real tensors.

    session = FakeSession()
    model = session.module(lambda: BertLayer(config, choice).train())   # built on meta, then fake
    hidden = session.tensor((2, 512, 1024), torch.bfloat16, requires_grad=True)
    with session.ledger(model) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
        model(hidden, None)
    ledger.activation_bytes   # what the same call on real tensors keeps, byte for byte

Tensors made outside the session (token ids, attention masks) stay real, and so does every op whose
inputs are all real, and small factories (``arange``, ``ones``, seeds): the host reads a model makes
on them (``bool(mask.all())``, position buckets) see real values. Everything that touches a weight
is fake. Fake tensors are CPU tensors, so CPU autocast and the CPU's dropout run exactly as on
real CPU tensors.

The exception: Tempo's LayerNorm forward ops (``tempo::layernorm_fwd``,
``tempo::dropout_add_layernorm_fwd``) keep x̂ for the K columns whose γ is too small to recover it
from, decided from γ and β's values by ``tempo::layernorm_plan`` before the call. On fake tensors
that plan is K = 0 columns, which is what freshly initialised LayerNorms (γ = 1, β = 0) keep, and the
forward ops' outputs follow it. Count a trained checkpoint on real tensors.
``tests/test_memory.py`` holds the fake counts of every table to the real-tensor ledger.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from tempo.memory import ActivationLedger
from tempo.ops.layernorm import outputs_with_no_kept_columns
from tempo.utils import fake_parameters

# A factory (no tensor inputs) whose output is at most this many elements runs for real, so that
# host reads of masks, positions and seeds see values; larger ones stay fake.
REAL_FACTORY_NUMEL = 1 << 20


class _RealWhereValuesMatter(TorchDispatchMode):
    """Under the session's FakeTensorMode: ops on real inputs only, and small factories, run for real;
    Tempo's LayerNorm plan is K = 0 columns (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        nested = [type(t) for t in tensors if t.is_nested and type(t) is not Tensor]
        if nested:  # a nested jagged tensor: its subclass runs the op on its values, through this mode
            with self:
                return nested[0].__torch_dispatch__(func, types, args, kwargs)
        if any(isinstance(t, FakeTensor) for t in tensors):
            special = outputs_with_no_kept_columns(func, args, kwargs)
            return special if special is not None else func(*args, **kwargs)
        if tensors:
            with unset_fake_temporarily():  # real inputs only: compute for real (host reads need it)
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if all(isinstance(o, Tensor) and o.numel() <= REAL_FACTORY_NUMEL for o in pytree.tree_leaves(out)):
            with unset_fake_temporarily():  # a small factory: real values for the host reads
                out = func(*args, **kwargs)
        return out


class FakeSession:
    """One FakeTensorMode: models and inputs made fake, and ledgers counted on them."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    def module(self, factory: Callable[[], nn.Module], prepare: Callable[[nn.Module], Any] | None = None) -> nn.Module:
        """``factory()`` built on the meta device (no memory, no initialisation), ``prepare(model)``
        applied there (``apply_tempo``, say), then every parameter and buffer made a fake CPU tensor
        (tied parameters stay tied)."""
        with torch.device("meta"):
            model = factory()
            if prepare is not None:
                prepare(model)
        fake_parameters(model, self.mode)
        return model

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
               requires_grad: bool = False) -> Tensor:
        with self.mode:
            t = torch.empty(tuple(shape), dtype=dtype, device="cpu")
        return t.requires_grad_(requires_grad)

    @contextlib.contextmanager
    def ledger(self, model: nn.Module | None = None) -> Iterator[ActivationLedger]:
        """An ``ActivationLedger`` over ``model`` whose body runs on this session's fake tensors."""
        with self.mode, _RealWhereValuesMatter(), ActivationLedger(model) as ledger:
            yield ledger


__all__ = ["FakeSession", "REAL_FACTORY_NUMEL"]
