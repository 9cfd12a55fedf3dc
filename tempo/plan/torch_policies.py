"""What users' own PyTorch policies keep for backward and recompute, counted beside Tempo on fake tensors.

A user who runs out of memory today reaches for torch's levers, not Tempo: sdpa, ``torch.compile`` (and
its ``activation_memory_budget`` knob), selective activation checkpointing, per-layer checkpointing.
This module counts what each of them keeps and recomputes with the same fake-tensor code that counts
Tempo, so the planner (``tempo.plan``) and its frontier table can put them side by side:

    count = count_policy("compile-budget-0.5", "bert-large", seq_len=512)
    count.kept_h, count.backward_ratio, count.recomputed_text

``python -m tempo.bench.torch_policies --model bert-large --seq-len 512`` prints the table.

Policies (``POLICIES``), on transformers' model of a family (``tempo.presets.FAMILIES``):
  * ``eager``, ``sdpa``: transformers' attention implementations as they run on a GPU.
  * ``compile+sdpa``, ``compile-budget-X``: ``torch.compile`` as Inductor partitions it (Inductor's
    decompositions, its joint-graph passes and ``min_cut_rematerialization_partition``, with
    ``torch._functorch.config.activation_memory_budget`` = X); only the code generation is left out.
  * ``sac-matmuls``: selective checkpointing per block saving the outputs of the matmuls (mm, addmm,
    bmm, baddbmm) and the fused attention, recomputing the rest (LayerNorms, GELU, dropouts).
  * ``sac-every-second-matmul``: torchtitan's op-level policy: the same save list, but every second
    matmul of a block is recomputed. torchtitan's list names ``aten.mm`` only; a Linear with a bias
    runs as ``aten.addmm``, so both count as matmuls here (else the policy saves no matmul of a BERT).
  * ``full-checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block.
  * the same levers after ``apply_tempo(model)``: ``tempo``, ``tempo+compile``, ``tempo+compile-budget-X``,
    ``tempo+full-checkpoint``, ``tempo+sac-every-second-matmul``. (``tempo+sac-matmuls`` is left out: it
    saves every matmul output and recomputes Tempo's output-keeping LayerNorms and GELU from them, which
    keeps more than Tempo alone.)

What is counted, per policy (``PolicyCount``):
  * bytes kept for backward. Eager and checkpointed policies: every storage the forward makes that is
    still alive when it ends, held by the autograd graph (saved tensors, the inputs a checkpoint holds,
    a selective checkpoint's cache), each storage once: ``_LiveStorages``. ``tempo.memory``'s
    ``ActivationLedger`` cannot see inside a checkpoint (its saved-tensor hooks are replaced there), so
    it is only a cross-check where no checkpoint runs. Compiled policies: the ledger around the compiled
    call (the compiled function saves through ``save_for_backward``), checked against the bytes of the
    partitioned graph's saved values. Parameters, buffers and the token ids are inputs, not activations:
    never counted. Per added layer: models of 1 and 2 blocks (ModernBERT: 3 and 6, a global and two
    sliding-window layers at a time, ``layer_period``) at batches 1 and 2 give, exactly,
    kept(L, b) = fixed + L·fixed_per_layer + b·s·(per_token + L·per_token_per_layer)
    (autocast's weight copies are the fixed parts). The budget knob is a fraction of the *whole*
    joint graph (and is ignored where parameters outweigh activations), so ``compile-budget-X`` rows
    are counted on the whole model at its published depth and ``tokens`` tokens (6,144 by default,
    the issue's), as total saved bytes / (tokens · layers): not linear, scope "whole model".
  * backward FLOPs against ``eager``'s (``torch.utils.flop_counter``'s formulas, Tempo's ops by their
    declarations in ``tempo.movement``): every op the backward runs, recompute included. For compiled
    policies, the backward of the same model uncompiled plus the FLOPs of the forward ops the
    partitioned backward runs again (a forward node found in both partitioned graphs).
  * what is recomputed: by construction for checkpoints (the ops a selective policy did not save), the
    partitioner's choice for compiled policies (counted by kind: attention, matmul, LayerNorm, GELU,
    dropout), the scores (QKᵀ) a fused attention's backward recomputes, and what becomes of dropout
    masks under compile: saved as bool, or, below budget 1.0, drawn again in backward from fresh seeds
    when the partitioner recomputes Inductor's seed draw (``prims.inductor_seeds``): masks that differ
    from the forward's, so the gradients are not those of the forward (pytorch#190758; the slow test
    shows it on a real Inductor run: budget 0.5 against 1.0, gradients apart with dropout, equal without).
  * the transient peak of backward (eager and checkpointed policies): the most bytes alive at once
    among the storages backward makes, parameter gradients left out, recompute included. Compiled
    policies: not counted (an eager run of Inductor's graph is not its peak: Inductor fuses).

"As a GPU runs it": the steps run on fake CPU tensors under ``tempo.movement.trace.CudaSemantics``
(dropout as a bool-mask ``native_dropout``, sdpa's fused kernels, CUDA autocast's fp32 ops), bf16
autocast, dropout as each family ships (BERT, DeBERTa 0.1; ModernBERT 0). The autograd engine runs a
checkpoint's recompute without the caller's torch function modes, so ``checkpoint_blocks`` re-enters
the ones the forward ran under (else a recomputed block would take the CPU's paths). ``semantics="cpu"``
leaves them out: what a real CPU run keeps, which the tests hold the counts to, byte for byte.

Known differences from a GPU compile: Inductor's joint-graph passes run with a CPU input device here
(CUDA-only patterns such as mm padding do not apply); Inductor saves dropout masks as bool (lowmem
dropout is off, pytorch#102319); the knob's peaks are not monotone in it (pytorch#197838).
``tempo+compile`` gives Tempo's LayerNorms the kept-column plans a freshly initialised model has
(K = 0 columns), as ``tempo.memory.fake`` counts them.

It lives with the plan, whose frontier table (``tempo.plan.frontier``) puts these counts beside Tempo's
plans; it imports tempo.presets, tempo.memory, tempo.movement and tempo.integrations, never the rest of
tempo.plan.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tempo.presets import FAMILIES, FAMILY_DEPTH, family_config, longest_seq_len, supports_sdpa
from tempo.memory import ActivationLedger
from tempo.movement.declarations import Target, kernels_of
from tempo.movement.trace import CudaSemantics, FakeSession, Recorder

logger = logging.getLogger(__name__)
aten = torch.ops.aten

DEFAULT_TOKENS = 6144  # the whole-model budget rows: the 24 layers at 6,144 tokens
SEMANTICS = ("cuda", "cpu")
PIPELINES = ("inductor", "aot_eager")
_FLOPS_TARGET = Target("H100 SXM", 132)  # FLOPs do not depend on the GPU; the declarations need one


# ---------------------------------------------------------------------------------------------
# The policies
# ---------------------------------------------------------------------------------------------
CHECKPOINTS = ("full", "matmuls", "every-second-matmul")


@dataclass(frozen=True)
class Policy:
    """One way to train the model: what the user writes, as the counters need it."""

    name: str
    summary: str  # what the user writes
    attention: str = "sdpa"  # transformers' attn_implementation ("eager" where the family has no sdpa)
    tempo: bool = False  # apply_tempo(model) first (its default: every Tempo layer, O(s) attention)
    checkpoint: Optional[str] = None  # one of CHECKPOINTS, around every encoder block
    compiled: bool = False
    budget: Optional[float] = None  # torch._functorch.config.activation_memory_budget (compiled only)

    @property
    def whole_model(self) -> bool:
        """Counted on the whole model: the budget knob is a fraction of the whole joint graph."""
        return self.compiled and self.budget is not None

    @property
    def base(self) -> str:
        """The uncompiled, unrecomputed policy whose backward this one runs (plus its recompute)."""
        return "tempo" if self.tempo else self.attention


def _policies() -> dict[str, Policy]:
    budgets = (0.8, 0.5, 0.2)
    stock = [
        Policy("eager", 'attn_implementation="eager"', attention="eager"),
        Policy("sdpa", 'attn_implementation="sdpa"'),
        Policy("compile+sdpa", "torch.compile(model), sdpa (default min-cut partitioner)", compiled=True),
        *(Policy(f"compile-budget-{b}", f"torch.compile, activation_memory_budget = {b}", compiled=True, budget=b)
          for b in budgets),
        Policy("sac-matmuls", "selective checkpointing per block: matmul and attention outputs saved",
               checkpoint="matmuls"),
        Policy("sac-every-second-matmul", "selective checkpointing per block, every second matmul recomputed "
               "(torchtitan's op-level SAC)", checkpoint="every-second-matmul"),
        Policy("full-checkpoint", "torch.utils.checkpoint around every block (non-reentrant)", checkpoint="full"),
    ]
    tempo = [
        Policy("tempo", "apply_tempo(model)", attention="eager", tempo=True),
        Policy("tempo+compile", "apply_tempo + torch.compile", attention="eager", tempo=True, compiled=True),
        *(Policy(f"tempo+compile-budget-{b}", f"apply_tempo + torch.compile, activation_memory_budget = {b}",
                 attention="eager", tempo=True, compiled=True, budget=b) for b in budgets),
        Policy("tempo+sac-every-second-matmul", "apply_tempo + selective checkpointing, every second matmul "
               "recomputed", attention="eager", tempo=True, checkpoint="every-second-matmul"),
        Policy("tempo+full-checkpoint", "apply_tempo + torch.utils.checkpoint around every block",
               attention="eager", tempo=True, checkpoint="full"),
    ]
    return {p.name: p for p in stock + tempo}


POLICIES: dict[str, Policy] = _policies()


def policy_named(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}")
    return POLICIES[name]


# ---------------------------------------------------------------------------------------------
# Models: transformers' encoder of a family, with a policy's levers
# ---------------------------------------------------------------------------------------------
def encoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The encoder's blocks: the longest ``nn.ModuleList`` of modules of one class."""
    best: Optional[nn.ModuleList] = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise ValueError(f"{type(model).__name__} has no list of encoder blocks (an nn.ModuleList of one class)")
    return best


def policy_attention(policy: Policy, family: str) -> str:
    """The attn_implementation ``policy`` runs on ``family``: its own, but eager where it asks for sdpa and
    the family has none (DeBERTa); the row's note says so (``_attention_note``)."""
    return "eager" if policy.attention == "sdpa" and not supports_sdpa(family) else policy.attention


class _SelectivePolicy:
    """One checkpointed region's policy (a fresh one per region call, as torchtitan makes them).

    Saves the fused attention's outputs and the matmuls' ("matmuls"), or every matmul but the second,
    fourth, ... of the region ("every-second-matmul", counted apart in forward and recompute);
    everything else is recomputed. ``decisions`` counts the ops it left to recompute (forward only)."""

    def __init__(self, kind: str, decisions: Counter):
        self.kind, self.decisions = kind, decisions
        self.matmuls = {False: 0, True: 0}

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _MATMULS:
            self.matmuls[ctx.is_recompute] += 1
            save = self.kind == "matmuls" or self.matmuls[ctx.is_recompute] % 2 == 1
        else:
            save = _is_attention(str(func.overloadpacket))
        if not save and not ctx.is_recompute and not func.is_view:
            self.decisions[str(func.overloadpacket)] += 1
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(model: nn.Module, kind: str, decisions: Optional[Counter] = None) -> nn.Module:
    """Every encoder block's forward run through ``torch.utils.checkpoint`` (non-reentrant, RNG state
    preserved): the whole block ("full") or a selective policy (``_SelectivePolicy``). In place."""
    if kind not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; valid: {', '.join(CHECKPOINTS)}")
    decisions = Counter() if decisions is None else decisions

    def context_fn():
        return create_selective_checkpoint_contexts(_SelectivePolicy(kind, decisions))

    selective = {} if kind == "full" else {"context_fn": context_fn}
    for block in encoder_blocks(model):
        def forward(*args, _forward=block.forward, **kwargs):
            modes = tuple(_get_current_function_mode_stack())
            return checkpoint(functools.partial(_under_modes, modes, _forward), *args, use_reentrant=False,
                              **selective, **kwargs)
        block.forward = forward
    return model


def _under_modes(modes: tuple, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward`` under the torch function modes it first ran under: the autograd engine runs a
    checkpoint's recompute without the caller's function modes (``CudaSemantics`` among them), so the
    recompute would otherwise take other code paths than the forward did."""
    active = set(map(id, _get_current_function_mode_stack()))
    with contextlib.ExitStack() as stack:
        for mode in modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        return forward(*args, **kwargs)


def hold_fresh_layernorm_plans(model: nn.Module) -> int:
    """Give every Tempo LayerNorm of ``model`` the kept-column plan of a freshly initialised one
    (γ = 1, β = 0: K = 0 columns) for bf16 and fp32 outputs, which ``torch.compile`` takes as a graph
    input instead of planning from γ/β's values (fake parameters have none). Returns how many."""
    held = 0
    for module in model.modules():
        plans = getattr(module, "tempo_kept_columns", None)
        if isinstance(plans, dict):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                plans[dtype] = torch.empty(0, dtype=torch.int64)
            held += 1
    return held


def _build(session: FakeSession, family: str, layers: int, policy: Policy,
           decisions: Optional[Counter] = None) -> nn.Module:
    import transformers

    from tempo.integrations.patch import apply_tempo

    config = family_config(family, layers, attention=policy_attention(policy, family))
    model_class = transformers.AutoModel._model_mapping[type(config)]
    # The encoder alone: BERT's pooler would add a graph output (and its tanh) no loss here uses.
    options = {"add_pooling_layer": False} if "add_pooling_layer" in inspect.signature(model_class).parameters else {}
    with torch.device("meta"):
        model = model_class(config, **options).train()
        if policy.tempo:
            apply_tempo(model)
    session.fake_module(model)
    if policy.checkpoint is not None:
        checkpoint_blocks(model, policy.checkpoint, decisions)
    if policy.tempo and policy.compiled:
        hold_fresh_layernorm_plans(model)
    return model


def _ids(family: str, batch: int, seq_len: int) -> Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, FAMILY_DEPTH[family][1], (batch, seq_len), generator=generator)


def _with_inputs(model: nn.Module, *inputs: Tensor) -> nn.Module:
    """``model`` with its inputs as buffers of a holder: for the ledger, inputs are not activations (the
    embedding's backward keeps the token ids, which the caller holds anyway), as parameters are not."""
    holder = nn.Module()
    holder.model = model
    for i, t in enumerate(inputs):
        holder.register_buffer(f"input_{i}", t, persistent=False)
    return holder


def _semantics(semantics: str) -> contextlib.AbstractContextManager:
    if semantics not in SEMANTICS:
        raise ValueError(f"unknown semantics {semantics!r}; valid: {', '.join(SEMANTICS)}")
    return CudaSemantics() if semantics == "cuda" else contextlib.nullcontext()


def _last_hidden_state(output: Any) -> Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


# ---------------------------------------------------------------------------------------------
# Live storages: what a forward leaves alive, and backward's transient peak
# ---------------------------------------------------------------------------------------------
def _storage_key(t: Tensor) -> Optional[int]:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # subclasses without a storage
        return None
    return storage._cdata if storage.nbytes() else None


class _LiveStorages(TorchDispatchMode):
    """Every storage an op makes, by identity (held by a weak reference, so no other storage takes
    its address while it is watched), with the phase that made it and the op count at which it was
    first seen dead. Storages of ``exclude`` (parameters, inputs) are never counted."""

    def __init__(self, exclude: Iterable[Tensor]):
        super().__init__()
        self.phase = "forward"
        self.paused = False
        self._excluded = {k for k in (_storage_key(t) for t in exclude if isinstance(t, Tensor)) if k is not None}
        self.made: dict[int, dict[str, Any]] = {}  # key -> {ref, nbytes, phase, born, died}
        self._live_backward: set[int] = set()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            self.ops += 1
            for t in pytree.tree_leaves(out):
                if isinstance(t, Tensor):
                    self._see(t)
            if self.phase == "backward":
                self._sweep()
        return out

    def _see(self, t: Tensor) -> None:
        key = _storage_key(t)
        if key is None or key in self._excluded or key in self.made:
            return
        storage = t.untyped_storage()
        self.made[key] = {"ref": StorageWeakRef(storage), "nbytes": storage.nbytes(), "phase": self.phase,
                          "born": self.ops, "died": None}
        if self.phase == "backward":
            self._live_backward.add(key)

    def _sweep(self) -> None:
        for key in [k for k in self._live_backward if self.made[k]["ref"].expired()]:
            self.made[key]["died"] = self.ops
            self._live_backward.discard(key)

    def alive_bytes(self, phase: str = "forward") -> int:
        return sum(e["nbytes"] for e in self.made.values() if e["phase"] == phase and not e["ref"].expired())

    def backward_peak(self, leave_out: set[int]) -> int:
        """The most bytes alive at once among the storages backward made, ``leave_out`` keys excluded."""
        self._sweep()
        # A storage seen dead after op k may have died during op k (its input) or just before it: it is
        # counted alive until op k's outputs exist, so the peak is never below the true one.
        deltas: Counter = Counter()
        for key, e in self.made.items():
            if e["phase"] != "backward" or key in leave_out:
                continue
            deltas[e["born"], 0] += e["nbytes"]
            if e["died"] is not None:
                deltas[e["died"], 1] -= e["nbytes"]
        peak = live = 0
        for moment in sorted(deltas):
            live += deltas[moment]
            peak = max(peak, live)
        return peak


@contextlib.contextmanager
def _collections_deferred() -> Iterator[Callable[[], None]]:
    """Automatic garbage collection off for a step, and a collector of the step's own garbage: every
    object the step makes stays in the youngest generation, so collecting it alone frees any cycle that
    would keep a storage alive, without walking the whole heap (seconds after torch.compile's imports)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield lambda: gc.collect(0)
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _paused(watcher: _LiveStorages) -> Iterator[None]:
    watcher.paused = True
    try:
        yield
    finally:
        watcher.paused = False


# ---------------------------------------------------------------------------------------------
# Op kinds, FLOPs
# ---------------------------------------------------------------------------------------------
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_MATMUL_PACKETS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"}
_ATTENTION_PACKETS = {
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._flash_attention_forward", "aten._efficient_attention_forward",
    "tempo.efficient_attention_fwd", "tempo.efficient_attention_varlen_fwd", "tempo.combined_softmax_dropout_matmul",
    "tempo.disentangled_attention_fwd", "tempo.disentangled_attention_varlen_fwd",
}
_ATTENTION_BACKWARD_PACKETS = {
    "aten._scaled_dot_product_flash_attention_backward", "aten._scaled_dot_product_efficient_attention_backward",
    "aten._scaled_dot_product_cudnn_attention_backward", "aten._flash_attention_backward",
    "aten._efficient_attention_backward", "tempo.efficient_attention_bwd", "tempo.efficient_attention_varlen_bwd",
    "tempo.disentangled_attention_bwd", "tempo.disentangled_attention_varlen_bwd",
}
# Kinds of forward op a recompute is described by (Inductor decomposes: a LayerNorm is one var_mean,
# an exact GELU one erf, a dropout one inductor_random).
_KINDS = {
    "matmul": _MATMUL_PACKETS,
    "attention": _ATTENTION_PACKETS,
    "LayerNorm": {"aten.native_layer_norm", "aten.var_mean", "tempo.layernorm_fwd", "tempo.dropout_add_layernorm_fwd"},
    "GELU": {"aten.gelu", "aten.erf", "aten.tanh", "tempo.inplace_gelu"},
    "dropout": {"aten.native_dropout", "prims.inductor_random", "aten.bernoulli", "aten.bernoulli_", "aten.rand",
                "aten.rand_like"},
}


def _is_attention(packet: str) -> bool:
    return packet in _ATTENTION_PACKETS


def op_kind(packet: str) -> Optional[str]:
    for kind, packets in _KINDS.items():
        if packet in packets:
            return kind
    return None


def _phase_flops(recorder: Recorder, phase: str) -> int:
    return sum(k.flops for call in recorder.calls if call.phase == phase for k in kernels_of(call, _FLOPS_TARGET))


def _node_flops(node: Any, fake_mode: Any) -> int:
    """FLOPs of one graph node: flop_counter's formula, or for a Tempo op its declared kernels (the op
    replayed on its fake inputs under the movement recorder)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils.flop_counter import flop_registry

    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    import torch.fx as fx

    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    if target.namespace == "tempo":
        recorder = Recorder()
        with fake_mode, recorder:
            target(*args, **kwargs)
        return sum(k.flops for call in recorder.calls for k in kernels_of(call, _FLOPS_TARGET))
    if target.overloadpacket not in flop_registry:
        return 0
    with unset_fake_temporarily():
        return int(flop_registry[target.overloadpacket](*args, **kwargs, out_val=node.meta.get("val")))


# ---------------------------------------------------------------------------------------------
# One eager (or checkpointed) training step on fake tensors
# ---------------------------------------------------------------------------------------------
@dataclass
class StepCount:
    """One forward + backward of a model at one batch (bytes and FLOPs of that whole step)."""

    kept: int  # bytes the forward leaves alive for backward (or the compiled graph saves)
    ledger: int  # ActivationLedger's activation bytes (equal to ``kept`` where nothing is checkpointed)
    forward_flops: int
    backward_flops: int  # everything the backward runs, recompute included
    transient: Optional[int] = None  # backward's peak of the storages it makes, parameter gradients left out
    recomputed: Counter = field(default_factory=Counter)  # forward ops run again in backward, by packet
    forward_ops: Counter = field(default_factory=Counter)  # forward ops, by packet (compiled: the graph's)
    backward_ops: Counter = field(default_factory=Counter)
    graph_saved: Optional[int] = None  # compiled: the partitioned graph's saved bytes


def eager_step(family: str, layers: int, batch: int, seq_len: int, policy: Policy,
               semantics: str = "cuda") -> StepCount:
    """Forward and backward of ``policy``'s (uncompiled) model on fake tensors, bf16 autocast."""
    if policy.compiled:
        raise ValueError(f"{policy.name} is compiled: use compiled_step")
    session = FakeSession()
    decisions: Counter = Counter()
    model = _build(session, family, layers, policy, decisions)
    ids = _ids(family, batch, seq_len)
    params = list(model.parameters()) + list(model.buffers())
    recorder = Recorder()
    watcher = _LiveStorages(params + [ids])
    with _collections_deferred() as collect:
        kept, ledger = _forward_and_backward(session, model, ids, semantics, recorder, watcher, collect)
    grads = {k for k in (_storage_key(p.grad) for p in model.parameters() if p.grad is not None) if k is not None}
    forward_ops = Counter(c.packet for c in recorder.calls if c.phase == "forward")
    return StepCount(kept=kept, ledger=ledger.activation_bytes, forward_flops=_phase_flops(recorder, "forward"),
                     backward_flops=_phase_flops(recorder, "backward"), transient=watcher.backward_peak(grads),
                     recomputed=forward_ops if policy.checkpoint == "full" else decisions, forward_ops=forward_ops,
                     backward_ops=Counter(c.packet for c in recorder.calls if c.phase == "backward"))


def _forward_and_backward(session: FakeSession, model: nn.Module, ids: Tensor, semantics: str, recorder: Recorder,
                          watcher: _LiveStorages, collect: Callable[[], None]) -> tuple[int, ActivationLedger]:
    """The step: forward, then the bytes it left alive, then backward (both phases recorded)."""
    with session.mode, _semantics(semantics), recorder, watcher:
        with ActivationLedger(_with_inputs(model, ids)) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
            out = _last_hidden_state(model(input_ids=ids))
        with _paused(watcher):  # the layer above's gradient: MulBackward keeps it, not ``out``
            seed = torch.empty_like(out)
            loss = (out * seed).sum()
        del out
    collect()
    kept = watcher.alive_bytes("forward")
    recorder.phase = watcher.phase = "backward"
    with session.mode, _semantics(semantics), recorder, watcher:
        loss.backward()
    del loss
    collect()
    return kept, ledger


# ---------------------------------------------------------------------------------------------
# Compiled: torch.compile's partition of the joint graph, captured
# ---------------------------------------------------------------------------------------------
class CompileUnavailable(RuntimeError):
    """This torch lacks a private API the compiled counts use."""


@functools.lru_cache(maxsize=None)
def _compile_api() -> dict[str, Any]:
    """The private torch APIs the compiled counts use, resolved once with a clear error where one is
    missing (checked on torch 2.13; the GPU image runs 2.11)."""
    found: dict[str, Any] = {}
    wanted = {
        "aot_autograd": ("torch._dynamo.backends.common", "aot_autograd"),
        "nop": ("torch._dynamo.backends.debugging", "boxed_nop"),
        "min_cut": ("torch._functorch.partitioners", "min_cut_rematerialization_partition"),
        "inductor_partition": ("torch._inductor.compile_fx", "partition_fn"),
        "decompositions": ("torch._inductor.compile_fx", "select_decomp_table"),
        "virtualized": ("torch._inductor.virtualized", "V"),
        "detect_fake_mode": ("torch._guards", "detect_fake_mode"),
        "functorch_config": ("torch._functorch", "config"),
    }
    import importlib

    for name, (module, attr) in wanted.items():
        try:
            found[name] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise CompileUnavailable(
                f"torch {torch.__version__} lacks {module}.{attr} ({exc}): the compiled policies' counts capture "
                f"torch.compile's partition through it; count them with a torch that has it (2.13 does)") from None
    if not hasattr(found["functorch_config"], "activation_memory_budget"):
        raise CompileUnavailable(f"torch {torch.__version__} has no torch._functorch.config.activation_memory_budget")
    return found


@dataclass
class Partition:
    """One partition of a joint graph at one budget: what its forward saves and its backward recomputes."""

    budget: float
    saved_bytes: int  # the saved values' storages, parameters and buffers left out, each once
    recomputed: Counter  # forward op packets the backward graph runs again
    forward_ops: Counter  # op packets of the forward graph
    recomputed_flops: int
    backward_flops: int  # flop_counter's count over the backward graph (recompute included)


def _copy_graph_module(gm: Any) -> Any:
    """The joint graph copied node by node (meta shared, not deep-copied): the partitioner mutates it."""
    import torch.fx as fx

    graph = fx.Graph()
    env: dict[Any, Any] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph)


def _describe_partition(fw: Any, bw: Any, num_fwd_outputs: int, budget: float, fake_mode: Any) -> Partition:
    output = next(n for n in fw.graph.nodes if n.op == "output")
    # The graph's inputs (parameters, buffers, token ids) and views of them are not activations.
    seen = {_storage_key(n.meta["val"]) for n in fw.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), Tensor)}
    saved = 0
    for node in output.args[0][num_fwd_outputs:]:
        val = node.meta.get("val") if hasattr(node, "meta") else None
        if not isinstance(val, Tensor):
            continue
        key = _storage_key(val)
        if key is None or key in seen:
            continue
        seen.add(key)
        saved += val.untyped_storage().nbytes()
    forward = {n.name: n for n in fw.graph.nodes if n.op == "call_function"}
    backward = [n for n in bw.graph.nodes if n.op == "call_function"]
    recomputed = [n for n in backward if n.name in forward]

    def packet(node):
        target = node.target
        return str(target.overloadpacket) if isinstance(target, torch._ops.OpOverload) else str(target)

    return Partition(budget=budget, saved_bytes=saved, recomputed=Counter(packet(n) for n in recomputed),
                     forward_ops=Counter(packet(n) for n in forward.values()),
                     recomputed_flops=sum(_node_flops(n, fake_mode) for n in recomputed),
                     backward_flops=sum(_node_flops(n, fake_mode) for n in backward))


class PartitionCapture:
    """A ``torch.compile`` backend that partitions each joint graph as ``pipeline`` does and records it.

    "inductor": Inductor's decompositions, its joint-graph passes and min-cut partitioner
    (``torch._inductor.compile_fx.partition_fn``), code generation left out (the graphs run as they
    are); "aot_eager": torch's ``aot_eager`` backend (no decompositions, min-cut). Each joint graph is
    partitioned once per budget of ``budgets`` (on copies), the first one's graphs are the ones run."""

    def __init__(self, pipeline: str = "inductor", budgets: Sequence[float] = (1.0,)):
        if pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {pipeline!r}; valid: {', '.join(PIPELINES)}")
        if not budgets:
            raise ValueError("budgets: name at least one activation_memory_budget")
        self.pipeline, self.budgets = pipeline, tuple(float(b) for b in budgets)
        self.graphs: list[list[Partition]] = []  # per joint graph, per budget
        self.api = _compile_api()

    def backend(self) -> Any:
        api = self.api
        decompositions = api["decompositions"]() if self.pipeline == "inductor" else None
        return api["aot_autograd"](fw_compiler=api["nop"], bw_compiler=api["nop"], partition_fn=self._partition,
                                   decompositions=decompositions, keep_inference_input_mutations=True)

    def _partition(self, joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        api = self.api
        fake_mode = api["detect_fake_mode"](joint_inputs)
        partition = api["inductor_partition"] if self.pipeline == "inductor" else api["min_cut"]
        described, executed = [], None
        for budget in self.budgets:
            graph = _copy_graph_module(joint)
            with api["functorch_config"].patch(activation_memory_budget=budget), \
                    api["virtualized"].set_fake_mode(fake_mode):
                fw, bw = partition(graph, joint_inputs, **dict(kwargs))
            described.append(_describe_partition(fw, bw, kwargs["num_fwd_outputs"], budget, fake_mode))
            if executed is None:
                executed = (fw, bw)
        self.graphs.append(described)
        return executed


def compiled_step(family: str, layers: int, batch: int, seq_len: int, policy: Policy,
                  semantics: str = "cuda", pipeline: str = "inductor",
                  budgets: Optional[Sequence[float]] = None) -> tuple[StepCount, list[Partition]]:
    """``torch.compile`` of ``policy``'s model on fake tensors (one graph: a graph break is an error),
    its forward run under the ledger. Returns the step (bytes saved by the run at the first budget) and
    the partition at every budget of ``budgets`` (default: the policy's, 1.0 for plain compile)."""
    if not policy.compiled:
        raise ValueError(f"{policy.name} is not compiled: use eager_step")
    budgets = tuple(budgets) if budgets is not None else (policy.budget if policy.budget is not None else 1.0,)
    capture = PartitionCapture(pipeline, budgets)
    session = FakeSession()
    model = _build(session, family, layers, policy)
    ids = _ids(family, batch, seq_len)
    torch._dynamo.reset()  # a fresh cache: no recompile limit reached, no graph compiled for another model
    compiled = torch.compile(model, backend=capture.backend(), fullgraph=True, dynamic=False)
    with session.mode, _semantics(semantics):
        with ActivationLedger(_with_inputs(model, ids)) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
            _last_hidden_state(compiled(input_ids=ids))
    torch._dynamo.reset()
    if len(capture.graphs) != 1:
        raise RuntimeError(f"torch.compile of {family} ({policy.name}) made {len(capture.graphs)} joint graphs, "
                           "expected one")
    partitions = capture.graphs[0]
    first = partitions[0]
    if first.saved_bytes != ledger.activation_bytes:
        logger.warning("%s %s: the partitioned graph saves %d bytes but the compiled run saved %d",
                       family, policy.name, first.saved_bytes, ledger.activation_bytes)
    step = StepCount(kept=ledger.activation_bytes, ledger=ledger.activation_bytes, forward_flops=0,
                     backward_flops=first.backward_flops, recomputed=first.recomputed, forward_ops=first.forward_ops,
                     graph_saved=first.saved_bytes)
    return step, partitions


# ---------------------------------------------------------------------------------------------
# Per policy: per added layer (linear policies) or the whole model (budget rows)
# ---------------------------------------------------------------------------------------------
@dataclass
class PolicyCount:
    """What one policy keeps and recomputes on one family at one sequence length.

    ``scope`` "per added layer": bytes are exact for every depth L and batch b at this s:
    kept(L, b) = fixed + L·fixed_per_layer + b·s·(per_token + L·per_token_per_layer)
    (``kept_bytes``). "whole model": counted at ``layers`` and ``tokens`` only (the budget knob is not
    linear): ``per_token_per_layer`` = saved bytes / (tokens · layers), the fixed parts are None."""

    policy: str
    family: str
    seq_len: int
    hidden: int
    scope: str  # "per added layer" | "whole model"
    counted: bool = True
    note: str = ""
    layers: int = 2  # the depth counted ("whole model": the published depth)
    tokens: int = 0  # tokens counted ("whole model")
    per_token_per_layer: Optional[float] = None  # bytes kept per token per added layer
    per_token: Optional[float] = None  # per token outside the blocks (embeddings)
    fixed_per_layer: Optional[float] = None  # batch-independent per block (autocast's weight copies)
    fixed: Optional[float] = None
    backward_flops_per_token_per_layer: Optional[float] = None
    eager_backward_flops_per_token_per_layer: Optional[float] = None
    backward_ratio: Optional[float] = None  # backward FLOPs (recompute included) / eager's
    recomputed_flops_per_token_per_layer: Optional[float] = None
    recomputed: dict[str, int] = field(default_factory=dict)  # kind -> ops recomputed (per layer, or whole model)
    forward_kinds: dict[str, int] = field(default_factory=dict)  # kind -> forward ops of that kind, same scope
    recomputed_text: str = ""
    transient_per_token: Optional[float] = None  # backward's transient peak, bytes per token (one block's)
    transient_fixed: Optional[float] = None

    @property
    def kept_h(self) -> Optional[float]:
        return None if self.per_token_per_layer is None else self.per_token_per_layer / self.hidden

    def kept_bytes(self, layers: int, tokens: int) -> float:
        """Bytes kept at ``layers`` blocks and ``tokens`` tokens (a multiple of seq_len)."""
        if not self.counted:
            raise ValueError(f"{self.policy} on {self.family} is not counted: {self.note}")
        if self.scope == "whole model":
            if (layers, tokens) != (self.layers, self.tokens):
                raise ValueError(f"{self.policy} was counted on the whole model at {self.layers} layers and "
                                 f"{self.tokens} tokens only (the budget knob is not linear); count it again at "
                                 f"{layers} layers and {tokens} tokens")
            return self.per_token_per_layer * tokens * layers
        per_token = self.per_token + layers * self.per_token_per_layer
        return self.fixed + layers * self.fixed_per_layer + tokens * per_token


def layer_period(family: str) -> int:
    """Blocks after which a family's stack repeats: ModernBERT's global attention every n-th layer (the
    others slide a window), 1 for uniform stacks. Added layers are counted a period at a time."""
    return int(FAMILIES[family][2].get("global_attn_every_n_layers", 1))


def _linear_fit(m: dict[tuple[int, int], float], seq_len: int, period: int) -> tuple[float, float, float, float]:
    """(per_token_per_layer, per_token, fixed_per_layer, fixed) from m[(layers, batch)] at ``period`` and
    2·``period`` layers and batch 1 and 2: exact at every multiple of the period."""
    p, q = period, 2 * period
    per_token_per_layer = (m[q, 2] - m[q, 1] - m[p, 2] + m[p, 1]) / (seq_len * p)
    per_token = (m[p, 2] - m[p, 1]) / seq_len - p * per_token_per_layer
    fixed_per_layer = (m[q, 1] - m[p, 1]) / p - seq_len * per_token_per_layer
    fixed = m[p, 1] - p * fixed_per_layer - seq_len * (per_token + p * per_token_per_layer)
    return per_token_per_layer, per_token, fixed_per_layer, fixed


def _kinds(ops: Counter) -> dict[str, int]:
    out: Counter = Counter()
    for packet, n in ops.items():
        kind = op_kind(packet)
        if kind is not None:
            out[kind] += n
    return {k: out[k] for k in _KINDS if out[k]}


def _difference(a: Counter, b: Counter) -> Counter:
    return Counter({k: a[k] - b[k] for k in set(a) | set(b) if a[k] - b[k] > 0})


def _recompute_text(policy: Policy, recomputed: dict[str, int], forward: dict[str, int],
                    backward_ops: Optional[Counter] = None, per: str = "per layer",
                    packets: Optional[Counter] = None) -> str:
    """What a policy recomputes, in words: kinds of forward op run again (k of n), the scores a fused
    attention's backward recomputes, and what becomes of dropout masks under torch.compile (saved;
    recomputed from the forward's seeds; or drawn again from fresh seeds when the partitioner recomputes
    Inductor's seed draw, ``prims.inductor_seeds``, in backward: masks that differ from the forward's)."""
    parts = []
    if policy.checkpoint == "full":
        parts.append("the whole block")
    elif recomputed:
        parts.append(", ".join(f"{kind} {recomputed[kind]}/{forward.get(kind, recomputed[kind])}"
                               for kind in recomputed) + f" ({per})")
    if backward_ops and any(p in _ATTENTION_BACKWARD_PACKETS for p in backward_ops):
        parts.append("QKᵀ (fused attention backward)")
    if policy.compiled and packets and packets.get("prims.inductor_seeds"):
        parts.append("dropout masks drawn again from fresh seeds (inductor_seeds recomputed in backward)")
    elif policy.compiled and "dropout" in recomputed:
        parts.append("dropout masks recomputed from the forward's seeds")
    elif policy.compiled and forward.get("dropout"):
        parts.append("dropout masks saved (bool)")
    return "; ".join(parts) if parts else "—"


def _shapes(family: str) -> list[tuple[int, int]]:
    """(layers, batch) of the four steps a per-added-layer count fits: a period and two, batch 1 and 2."""
    period = layer_period(family)
    return [(layers, batch) for layers in (period, 2 * period) for batch in (1, 2)]


def _per_period(text: str, family: str) -> str:
    period = layer_period(family)
    return text if period == 1 else f"per {period} layers"


@functools.lru_cache(maxsize=None)
def _eager_family_fit(policy_name: str, family: str, seq_len: int, semantics: str) -> dict[str, Any]:
    """The four eager steps (``_shapes``) of an uncompiled policy, fitted."""
    policy = POLICIES[policy_name]
    p, q = layer_period(family), 2 * layer_period(family)
    steps = {shape: eager_step(family, *shape, seq_len, policy, semantics) for shape in _shapes(family)}
    fit = _linear_fit({k: s.kept for k, s in steps.items()}, seq_len, p)
    bwd = {k: s.backward_flops for k, s in steps.items()}
    backward_per_layer = (bwd[q, 1] - bwd[p, 1]) / (seq_len * p)
    backward_per_token = bwd[p, 1] / seq_len - p * backward_per_layer
    transient_per_token = (steps[q, 2].transient - steps[q, 1].transient) / seq_len
    return {"fit": fit, "backward_per_layer": backward_per_layer, "backward_per_token": backward_per_token,
            "transient_per_token": transient_per_token,
            "transient_fixed": steps[q, 1].transient - seq_len * transient_per_token,
            "recomputed": _difference(steps[q, 1].recomputed, steps[p, 1].recomputed),
            "forward": _difference(steps[q, 1].forward_ops, steps[p, 1].forward_ops),
            "backward_ops": steps[q, 1].backward_ops}


def _attention_note(policy: Policy, family: str) -> str:
    return f"{family} has no sdpa: eager attention" if policy_attention(policy, family) != policy.attention else ""


def _hidden(family: str) -> int:
    return FAMILIES[family][2]["hidden_size"]


def check_seq_len(family: str, seq_len: int) -> None:
    """ValueError unless ``family`` is a preset and ``seq_len`` fits its position table."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    limit = longest_seq_len(family)
    if not 1 <= seq_len <= limit:
        raise ValueError(f"seq_len {seq_len} is out of range for {family}: 1 to {limit} (its position table)")


def count_policy(name: str, family: str = "bert-large", seq_len: int = 512, *, tokens: int = DEFAULT_TOKENS,
                 semantics: str = "cuda", pipeline: str = "inductor") -> PolicyCount:
    """Count policy ``name`` on ``family`` at ``seq_len`` (see the module docstring)."""
    policy = policy_named(name)
    check_seq_len(family, seq_len)
    hidden = _hidden(family)
    eager = _eager_family_fit("eager", family, seq_len, semantics)
    note = _attention_note(policy, family)
    if policy.whole_model:
        return count_whole_model_budgets(policy.tempo, family, seq_len, (policy.budget,), tokens=tokens,
                                         semantics=semantics, pipeline=pipeline)[0]
    if policy.compiled:
        return _count_compiled(policy, family, seq_len, semantics, pipeline, eager, note)
    try:
        fitted = _eager_family_fit(policy.name, family, seq_len, semantics)
    except RuntimeError as exc:  # torch.utils.checkpoint refusing apply_tempo's model says so in its row
        if not (policy.tempo and policy.checkpoint):
            raise
        return _not_counted(policy, family, seq_len, "per added layer", exc)
    per_token_per_layer, per_token, fixed_per_layer, fixed = fitted["fit"]
    recomputed, forward = _kinds(fitted["recomputed"]), _kinds(fitted["forward"])
    if policy.checkpoint is None:
        recomputed = {}
    return PolicyCount(
        policy=name, family=family, seq_len=seq_len, hidden=hidden, scope="per added layer", note=note,
        per_token_per_layer=per_token_per_layer, per_token=per_token, fixed_per_layer=fixed_per_layer, fixed=fixed,
        backward_flops_per_token_per_layer=fitted["backward_per_layer"],
        eager_backward_flops_per_token_per_layer=eager["backward_per_layer"],
        backward_ratio=fitted["backward_per_layer"] / eager["backward_per_layer"],
        recomputed_flops_per_token_per_layer=fitted["backward_per_layer"] - (
            _eager_family_fit(policy.base, family, seq_len, semantics)["backward_per_layer"]),
        recomputed=recomputed, forward_kinds=forward,
        recomputed_text=_recompute_text(policy, recomputed, forward, fitted["backward_ops"],
                                        _per_period("per layer", family)),
        transient_per_token=fitted["transient_per_token"], transient_fixed=fitted["transient_fixed"])


def _not_counted(policy: Policy, family: str, seq_len: int, scope: str, exc: Exception) -> PolicyCount:
    """The row of a lever that fails on apply_tempo's model (a stock model's failure is raised): what
    failed, in one line, logged, never a guess."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lever = "torch.compile" if policy.compiled else f"torch.utils.checkpoint ({policy.checkpoint})"
    note = f"not yet counted: {lever} fails on apply_tempo's model ({type(exc).__name__}: {first[:200]})"
    logger.warning("%s on %s, s = %d: %s", policy.name, family, seq_len, note)
    return PolicyCount(policy=policy.name, family=family, seq_len=seq_len, hidden=_hidden(family), scope=scope,
                       counted=False, note=note)


def _compiled_steps(policy: Policy, family: str, seq_len: int, semantics: str, pipeline: str,
                    shapes: Iterable[tuple[int, int]], budgets: Optional[Sequence[float]] = None
                    ) -> dict[tuple[int, int], tuple[StepCount, list[Partition]]]:
    return {(L, b): compiled_step(family, L, b, seq_len, policy, semantics, pipeline, budgets) for L, b in shapes}


def _count_compiled(policy: Policy, family: str, seq_len: int, semantics: str, pipeline: str,
                    eager: dict[str, Any], note: str) -> PolicyCount:
    hidden = _hidden(family)
    try:
        steps = _compiled_steps(policy, family, seq_len, semantics, pipeline, _shapes(family))
    except Exception as exc:  # noqa: BLE001 - only Tempo's model may be untraceable, and then it says so
        if policy.tempo and isinstance(exc, (torch._dynamo.exc.TorchDynamoException, RuntimeError)):
            return _not_counted(policy, family, seq_len, "per added layer", exc)
        raise
    p, q = layer_period(family), 2 * layer_period(family)
    per_token_per_layer, per_token, fixed_per_layer, fixed = _linear_fit(
        {k: s.kept for k, (s, _) in steps.items()}, seq_len, p)
    base = _eager_family_fit(policy.base, family, seq_len, semantics)
    recomputed_flops = (steps[q, 1][1][0].recomputed_flops - steps[p, 1][1][0].recomputed_flops) / (seq_len * p)
    backward = base["backward_per_layer"] + recomputed_flops
    recomputed = _difference(steps[q, 1][0].recomputed, steps[p, 1][0].recomputed)
    forward = _kinds(_difference(steps[q, 1][0].forward_ops, steps[p, 1][0].forward_ops))
    return PolicyCount(
        policy=policy.name, family=family, seq_len=seq_len, hidden=hidden, scope="per added layer", note=note,
        per_token_per_layer=per_token_per_layer, per_token=per_token, fixed_per_layer=fixed_per_layer, fixed=fixed,
        backward_flops_per_token_per_layer=backward,
        eager_backward_flops_per_token_per_layer=eager["backward_per_layer"],
        backward_ratio=backward / eager["backward_per_layer"], recomputed_flops_per_token_per_layer=recomputed_flops,
        recomputed=_kinds(recomputed), forward_kinds=forward,
        recomputed_text=_recompute_text(policy, _kinds(recomputed), forward, base["backward_ops"],
                                        _per_period("per layer", family), recomputed))


def count_whole_model_budgets(tempo: bool, family: str, seq_len: int, budgets: Sequence[float], *,
                              tokens: int = DEFAULT_TOKENS, semantics: str = "cuda",
                              pipeline: str = "inductor") -> list[PolicyCount]:
    """``torch.compile`` of the whole model (published depth, ``tokens`` tokens) partitioned at every
    budget of ``budgets`` from one trace; one PolicyCount per budget (scope "whole model")."""
    check_seq_len(family, seq_len)
    if tokens % seq_len:
        raise ValueError(f"tokens ({tokens}) must be a multiple of seq_len ({seq_len}): whole sequences")
    layers = FAMILY_DEPTH[family][0]
    batch = tokens // seq_len
    hidden = _hidden(family)
    prefix = "tempo+" if tempo else ""
    policy = Policy(f"{prefix}compile-budget-{budgets[0]}", "", attention="eager" if tempo else "sdpa", tempo=tempo,
                    compiled=True, budget=budgets[0])
    reference = "tempo+compile (whole model)" if tempo else "compile+sdpa (whole model)"
    names = [f"{prefix}compile-budget-{b}" if b < 1.0 else reference for b in budgets]
    try:
        step, partitions = compiled_step(family, layers, batch, seq_len, policy, semantics, pipeline, budgets)
    except Exception as exc:  # noqa: BLE001 - only Tempo's model may be untraceable, and then it says so
        if tempo and isinstance(exc, (torch._dynamo.exc.TorchDynamoException, RuntimeError)):
            return [_not_counted(Policy(n, "", tempo=True, compiled=True), family, seq_len, "whole model", exc)
                    for n in names]
        raise
    eager = _eager_family_fit("eager", family, seq_len, semantics)
    base = _eager_family_fit("tempo" if tempo else policy.attention, family, seq_len, semantics)
    eager_backward = tokens * (eager["backward_per_token"] + layers * eager["backward_per_layer"])
    base_backward = tokens * (base["backward_per_token"] + layers * base["backward_per_layer"])
    counts = []
    for name, partition in zip(names, partitions):
        recomputed, forward = _kinds(partition.recomputed), _kinds(partition.forward_ops)
        backward = base_backward + partition.recomputed_flops
        counts.append(PolicyCount(
            policy=name, family=family, seq_len=seq_len, hidden=hidden, scope="whole model", layers=layers,
            note=_attention_note(policy, family),
            tokens=tokens, per_token_per_layer=partition.saved_bytes / (tokens * layers),
            backward_flops_per_token_per_layer=backward / (tokens * layers),
            eager_backward_flops_per_token_per_layer=eager_backward / (tokens * layers),
            backward_ratio=backward / eager_backward,
            recomputed_flops_per_token_per_layer=partition.recomputed_flops / (tokens * layers),
            recomputed=recomputed, forward_kinds=forward,
            recomputed_text=_recompute_text(Policy(name, "", compiled=True), recomputed, forward, base["backward_ops"],
                                            f"of the whole model's {layers} layers", partition.recomputed)))
    if step.graph_saved != step.kept:
        for count in counts:
            count.note = (f"the compiled run saved {step.kept} bytes at budget {budgets[0]}, its graph "
                          f"{step.graph_saved}: graph counts shown")
    return counts


def count_policies(names: Sequence[str], family: str = "bert-large", seq_len: int = 512, *,
                   tokens: int = DEFAULT_TOKENS, semantics: str = "cuda", pipeline: str = "inductor",
                   tick: Optional[Callable[[str], None]] = None) -> list[PolicyCount]:
    """``count_policy`` for every name, in order. The budget rows of the stock model share one trace of
    the whole model, and so do Tempo's; each group is followed by a budget-1.0 row counted the same way
    ("compile+sdpa (whole model)", "tempo+compile (whole model)"), the reference its fractions act on."""
    for name in names:
        policy_named(name)
    check_seq_len(family, seq_len)
    rows: list[PolicyCount] = []
    whole_model: dict[bool, list[PolicyCount]] = {}
    for name in names:
        policy = POLICIES[name]
        if not policy.whole_model:
            if tick:
                tick(name)
            rows.append(count_policy(name, family, seq_len, tokens=tokens, semantics=semantics, pipeline=pipeline))
            continue
        group = [POLICIES[n] for n in names if POLICIES[n].whole_model and POLICIES[n].tempo == policy.tempo]
        if policy.tempo not in whole_model:
            if tick:
                tick(f"{'tempo+' if policy.tempo else ''}compile on the whole model, budgets "
                     f"{', '.join(str(p.budget) for p in group)}")
            whole_model[policy.tempo] = count_whole_model_budgets(
                policy.tempo, family, seq_len, [p.budget for p in group] + [1.0], tokens=tokens,
                semantics=semantics, pipeline=pipeline)
        counted = whole_model[policy.tempo]
        rows.append(counted[[p.name for p in group].index(name)])
        if name == group[-1].name:
            rows.append(counted[-1])  # the budget-1.0 reference
    return rows


__all__ = ["CHECKPOINTS", "DEFAULT_TOKENS", "POLICIES", "Partition", "PartitionCapture", "Policy", "PolicyCount",
           "StepCount", "check_seq_len", "checkpoint_blocks", "compiled_step", "count_policies", "count_policy",
           "count_whole_model_budgets", "eager_step", "encoder_blocks", "hold_fresh_layernorm_plans", "op_kind",
           "policy_attention", "policy_named"]
