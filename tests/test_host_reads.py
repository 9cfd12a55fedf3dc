"""Host reads (device-to-host transfers that stall the CUDA stream) made by Tempo's code during a
training step, on the CUDA path of every layer (issue 28).

The counter wraps what reads a tensor's value on the host: ``Tensor.item/tolist/cpu`` (``.numpy()``
fails on a CUDA tensor, so it always follows a counted ``.cpu()``),
``int()/bool()/float()`` and ``__index__`` of a tensor, ``torch.nonzero``/``Tensor.nonzero``,
``torch.equal``/``Tensor.equal``, and, through a TorchDispatchMode, the aten ops that read a value
inside C++ (``_local_scalar_dense``, ``nonzero``, ``equal``, ``masked_select``, ``unique``: boolean
indexing, ``repeat_interleave`` without ``output_size``, ...). A read is counted when the nearest
caller frame that is not torch's (nor the standard library's, nor a stand-in for torch's CUDA code
registered below) is inside the ``tempo`` package: torch's own internals called from Tempo count
(the nested-tensor ``.item()`` calls did), the test's own calls and the optimizer's do not.

The CUDA path without a GPU: Triton kernels through the interpreter (``use_backend("triton")``),
attention through the simulated H100 of test_attention_dispatch.py (``FakeH100``), whose sdpa spy
models what torch's CUDA sdpa reads on the host (the shortest and longest sequence of nested
inputs when not given) and computes the result quietly on the CPU. On CPU tensors ``.cpu()`` and
``.tolist()`` move nothing, so the count is of calls: each would be a stall on CUDA.

The budget per training step (forward, backward, optimizer step; the second step of a model, so
one-time work such as the first plan of every LayerNorm is done):
  * every Tempo LayerNorm and DropoutAddLayerNorm together: 1 (the kept-column plans of all
    layers whose γ/β changed since the last forward, read in one transfer: ``tempo.ops.layernorm``);
  * our BERT, padded: + 1 (``bool(attention_mask.all())``: is there padding at all);
  * our BERT, unpadded: + 1 (``TokenLayout.from_mask``: the lengths);
  * HF BERT padding-free: + 1 (the packed sequences' boundaries, once per position_ids tensor, or
    the check of cu_seq_lens_q/k, once per pair of tensors);
  * the fused head and loss (tempo.ops.linear_cross_entropy): + 1 (the count of labelled rows and of
    labels out of range, in one transfer, in forward; backward reads the count the forward left on
    the CPU, which stalls nothing: ``_count_on_host`` is quiet here).
and 0 per added encoder layer everywhere (3 layers minus 2 layers).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tempo
from tempo.ops import attention as attn_mod
from tempo.ops._backend import use_backend
from tempo.ops.linear_cross_entropy import _count_on_host

from test_attention_dispatch import FakeH100, h100  # noqa: F401  (fixture)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TEMPO_DIR = os.path.dirname(tempo.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(contextlib.__file__) + os.sep
_ROOT = os.path.dirname(_TEMPO_DIR.rstrip(os.sep)) + os.sep


def _codes(functions) -> set:
    """The code objects of ``functions`` and of everything defined inside them (generator
    expressions, lambdas), so that their frames are classified alike."""
    found, todo = set(), [f.__code__ for f in functions]
    while todo:
        code = todo.pop()
        found.add(code)
        todo.extend(c for c in code.co_consts if hasattr(c, "co_code"))
    return found


class HostReadCounter:
    """Counts host reads by call site (``tempo/ops/layernorm.py:123 plan``) while active."""

    METHODS = ("item", "tolist", "cpu", "__int__", "__bool__", "__float__", "__index__", "nonzero", "equal")
    FUNCTIONS = ("nonzero", "equal")
    ATEN = ("_local_scalar_dense", "nonzero", "equal", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive")

    def __init__(self, stand_ins=(), quiet=()):
        self.stand_ins = _codes(stand_ins)  # frames that model torch's own code
        self.quiet = _codes(quiet)  # frames whose reads are the simulation's, not torch's
        self.sites = collections.Counter()
        self.active = False
        self._local = threading.local()
        self._wrappers = set()

    # -- attribution ------------------------------------------------------------------------------
    def _site(self, depth: int):
        frame = sys._getframe(depth)
        while frame is not None:
            code = frame.f_code
            if code in self.quiet:
                return None
            name = code.co_filename
            if (code in self._wrappers or code in self.stand_ins or name.startswith(_TORCH_DIR)
                    or name.startswith(_STDLIB_DIR) or name.startswith("<")):
                frame = frame.f_back
                continue
            if name.startswith(_TEMPO_DIR):
                return f"{os.path.relpath(name, _ROOT)}:{frame.f_lineno} {code.co_name}"
            return None
        return None

    def _record(self, what: str, depth: int):
        if not self.active or getattr(self._local, "inside", 0):
            return
        site = self._site(depth + 1)
        if site is not None:
            self.sites[f"{site} [{what}]"] += 1

    # -- installation ------------------------------------------------------------------------------
    def _wrap(self, owner, name):
        original = getattr(owner, name)
        counter = self

        def wrapper(*args, **kwargs):
            counter._record(name, 2)
            counter._local.inside = getattr(counter._local, "inside", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._local.inside -= 1

        self._wrappers.add(wrapper.__code__)
        return original, wrapper

    @contextlib.contextmanager
    def installed(self):
        patches = [(torch.Tensor, name, *self._wrap(torch.Tensor, name)) for name in self.METHODS]
        patches += [(torch, name, *self._wrap(torch, name)) for name in self.FUNCTIONS]
        for owner, name, _original, wrapper in patches:
            setattr(owner, name, wrapper)
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket.__name__ in HostReadCounter.ATEN:
                    counter._record(f"aten.{func.overloadpacket.__name__}", 2)
                return func(*args, **(kwargs or {}))

        counter._wrappers.add(Mode.__torch_dispatch__.__code__)
        try:
            with Mode():
                yield self
        finally:
            for owner, name, original, _wrapper in patches:
                setattr(owner, name, original)

    @contextlib.contextmanager
    def counting(self):
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def table(self) -> str:
        return "\n".join(f"  {n:3d}  {site}" for site, n in sorted(self.sites.items())) or "  (none)"


# ------------------------------------------------------------------------------------------------
# The four training setups, built with a given number of encoder layers
# ------------------------------------------------------------------------------------------------
LENGTHS = [8, 5, 3]  # one full row among padded ones (small: the Triton kernels run in the interpreter)
L = 8


def _ids(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (len(lengths), L), generator=g)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids * mask, mask


def our_bert(layers: int, unpad: bool):
    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertForPreTraining
    from tempo.choices import TempoChoice

    config = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    torch.manual_seed(0)
    model = BertForPreTraining(config, TempoChoice.default(), unpad=unpad).train()
    ids, mask = _ids(LENGTHS, 96)
    types = torch.zeros_like(ids)
    positions = torch.tensor([[1, 3, 5], [0, 2, 4], [0, 1, 2]])
    labels = torch.randint(5, 96, (3, 3))
    nsp = torch.tensor([0, 1, 0])
    # Each step gets its own batch tensors, as from a data loader (nothing is cached across steps).
    return model, lambda: model(*(t.clone() for t in (ids, types, mask, positions, labels, nsp))).loss


def _hf_model(layers: int):
    transformers = pytest.importorskip("transformers")
    from tempo.integrations.patch import apply_tempo

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers, apply_tempo(transformers.BertForMaskedLM(config)).train()


def hf_bert(layers: int, unpad: bool, flash_kwargs: bool = False):
    transformers, model = _hf_model(layers)
    if not unpad:
        ids, mask = _ids(LENGTHS, 100)
        batch = dict(input_ids=ids, attention_mask=mask, labels=ids)
    else:
        g = torch.Generator().manual_seed(0)
        features = [{"input_ids": torch.randint(5, 100, (n,), generator=g).tolist()} for n in LENGTHS]
        # One row, position_ids restarting; with flash_kwargs also cu_seq_lens_q/k and max_length_q/k.
        batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)
        assert "position_ids" in batch and ("cu_seq_lens_q" in batch) == flash_kwargs
    # Each step gets its own batch tensors, as from a data loader (nothing is cached across steps).
    return model, lambda: model(**{key: value.clone() if isinstance(value, torch.Tensor) else value
                                   for key, value in batch.items()}).loss


def hf_bert_cu(layers: int, unpad: bool):
    return hf_bert(layers, unpad, flash_kwargs=True)


SETUPS = {"bert/padded": (our_bert, False), "bert/unpadded": (our_bert, True),
          "hf/padded": (hf_bert, False), "hf/padding-free": (hf_bert, True),
          "hf/padding-free+cu_seq_lens": (hf_bert_cu, True)}
# Host reads per training step allowed (see the module docstring); 0 per added layer everywhere.
BUDGET = {"bert/padded": 3, "bert/unpadded": 3, "hf/padded": 2, "hf/padding-free": 3,
          "hf/padding-free+cu_seq_lens": 3}


def reads_in_second_step(fake: FakeH100, setup: str, layers: int) -> HostReadCounter:
    build, unpad = SETUPS[setup]
    counter = HostReadCounter(stand_ins=[FakeH100.sdpa, FakeH100.takes_nested, FakeH100._seq_len_0],
                              quiet=[FakeH100.compute, _count_on_host])
    with use_backend("triton"), counter.installed():
        model, loss_fn = build(layers, unpad)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            with counter.counting() if step == 1 else contextlib.nullcontext():
                loss = loss_fn()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    # Attention took the CUDA path: nested (variable-length) sdpa exactly when unpadded.
    assert fake.calls and all(c["chosen"] is not None and c["nested"] == unpad for c in fake.calls)
    return counter


@pytest.mark.parametrize("setup", list(SETUPS))
def test_no_host_read_per_layer_on_the_cuda_path(h100, setup, capsys):
    two = reads_in_second_step(h100, setup, 2)
    h100.calls.clear()
    three = reads_in_second_step(h100, setup, 3)
    with capsys.disabled():
        print(f"\n{setup}: host reads in the second training step, 2 layers: {two.total}, 3 layers: "
              f"{three.total}\n{three.table()}")
    assert three.total - two.total == 0, three.table()
    assert three.total <= BUDGET[setup], three.table()


def test_ops_taking_parameters_check_their_device():
    """Every op taking parameters names the layer/argument when they are not on the input's device
    (on CUDA a kernel would read another device's memory instead of raising). The meta device
    stands in for another GPU. LayerNorm and DropoutAddLayerNorm: their own test files."""
    from tempo.ops.gated_mlp import gated_linear_fused

    h = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"^gated_linear: argument 'weight' .* is on meta but the input 'h' is on cpu"):
        gated_linear_fused(h, torch.ones(3, 4, device="meta"))
    with pytest.raises(ValueError, match=r"^gated_linear: argument 'bias' .* is on meta"):
        gated_linear_fused(h, torch.ones(3, 4), torch.ones(3, device="meta"))
