"""``tempo.plan``: for a memory budget, the fastest training step that fits, chosen in seconds.

    plan = tempo.plan(model, budget="24GiB", lengths=512, device="h100", precision="bf16", optimizer="adamw")
    print(plan)                      # tokens per step, recompute per block, the peak and its parts, tokens/s
    plan.apply(model)                # apply_tempo + the per-block recompute
    sampler = TokenBudgetSampler(lengths, max_tokens=plan.tokens_per_step, ...)

How (everything on fake tensors: no GPU, no real memory):
  1. a fake copy of the model with Tempo's layers (``apply_tempo``) and a dozen Transformer blocks
     whose recompute modes hold every ordered pair of modes once (tempo.plan.probe, probe_layout),
     runs one training step at two token counts under a memory timeline (tempo.plan.trace), on the
     device's semantics (a GPU's autocast, dropout and fused attention, or the CPU's reference paths),
     with the attention mask a collator passes to a padded model (ones; each row's last token padding
     when the lengths vary: tempo.plan.probe.example_batch);
  2. the step of the whole model, with any recompute per block, is composed from those parts
     (tempo.plan.compose): the activation peak is a maximum of affine functions of the tokens t;
  3. weights, gradients (in the composition), optimizer states and the optimizer step's
     temporaries (tempo.plan.states, the optimizer itself run on fake tensors), and a margin
     (cuBLAS/cuBLASLt workspaces, 64 MiB on a GPU, plus 1 % of what the composition counts)
     complete the peak;
  4. for each recompute plan in a sequence from "none" through "selective" on more and more blocks
     to "full" on more and more, the largest token count whose peak fits the budget, and its
     projected step time (tempo.movement's calibrated roofline over the step's kernels, recompute
     included, with a per-kernel floor of ``KERNEL_FLOOR_S``: small steps are latency-bound); the
     plan is the one with the most projected real tokens/s (on the CPU, without a projection: the
     least recompute that fits).
Real tokens: with Tempo's O(s) layers and padding-free batches (``unpadding``), a step's bytes are
linear in its real tokens whatever their lengths, so the plan is a token budget (``tokens_per_step``)
and the batch per length bucket follows. A model that cannot take padding-free batches is planned at
its padded length (the longest of ``lengths``).

Every time is a projection, labelled as such; the peak is a prediction that tests hold within
[1, 1.05] of the live storages of a real CPU step (tests/test_plan_band.py) and of PyTorch's own
tracker (MemTracker, tests/test_plan.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tempo.plan.budget import Device, PlanError, parse_budget, resolve_device
from tempo.plan.compose import Composition, compose, parts_from_traces, probe_layout, step_seconds
from tempo.plan.probe import example_batch, fake_probe, max_positions, structure_copy, takes_attention_mask
from tempo.integrations.recompute import MODES, apply_recompute, recomputed_parts, transformer_blocks
from tempo.plan.states import OPTIMIZERS, optimizer_memory
from tempo.plan.trace import default_loss, trace_step
from tempo.utils import format_bytes

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
WORKSPACE_BYTES = 64 << 20  # cuBLAS + cuBLASLt workspaces on a GPU (32 MiB each by default on Hopper)
# Of what the composition counts (activations, transients, gradients), the share added to the margin:
# a composed block next to one of another mode can free an older tensor at another moment than the
# probe's neighbour did (measured within 0.5 % of the step's peak; tests hold the prediction above
# PyTorch's own tracker and within 5 % of it).
COMPOSITION_MARGIN = 0.01
KERNEL_FLOOR_S = 3e-6  # the least time a kernel takes (launch and one wave): small steps are latency-bound
# tempo.movement's roofline efficiencies, fitted to published BERT measurements (python -m tempo.movement
# prints the fit; tests/test_plan.py checks these against it): FLOPs at η_c of peak, bytes at η_b of bandwidth.
FITTED_COMPUTE, FITTED_BANDWIDTH = 1.0, 0.607
DEFAULT_BUDGET_SHARE = 0.9  # device="cuda" without a budget: 90 % of the GPU (context, fragmentation)
TOKEN_ROUNDING = 8


@dataclass(frozen=True)
class PeakParts:
    """The predicted peak and what it is made of, in bytes."""

    weights: int
    gradients: int
    optimizer_states: int
    activations: int  # kept for backward at the peak's moment
    transient: int  # the temporaries of the op that peaks (backward, recompute included), or the optimizer step's
    workspace: int  # cuBLAS/cuBLASLt workspaces (a GPU) and COMPOSITION_MARGIN of what the composition counts
    at: str  # where in the step the peak is
    cublas_workspace: int = 0  # of ``workspace``, the part that is cuBLAS's
    buffers: int = 0  # a parallel engine's: DDP's gradient buckets, FSDP2's unsharded parameters (tempo.plan.parallel)

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer_states + self.activations + self.transient
                + self.workspace + self.buffers)


@dataclass(frozen=True)
class Candidate:
    """One recompute plan and what it allows."""

    recompute: tuple
    tokens: int
    peak: Optional[PeakParts]
    step_seconds: Optional[float]

    @property
    def tokens_per_second(self) -> Optional[float]:
        if not self.tokens or not self.step_seconds:
            return None
        return self.tokens / self.step_seconds

    def summary(self) -> str:
        counts = {m: self.recompute.count(m) for m in MODES if self.recompute.count(m)}
        return ", ".join(f"{n} {m}" for m, n in counts.items())


@dataclass
class Plan:
    """What ``tempo.plan`` chose (module docstring) and why."""

    model: str
    device: Device
    budget: int
    precision: str
    optimizer: str
    tempo: dict  # apply_tempo's swaps (tempo_patched of the planned copy)
    left_stock: list  # what apply_tempo left as the stock module, and why
    recompute: list  # per Transformer block: "none" / "selective" / "full"
    unpadding: bool
    seq_len: int  # the length the step was counted at
    tokens_per_step: int
    buckets: list  # [(padded length, share of sequences, sequences per step)]
    peak: PeakParts
    step_seconds: Optional[float]  # projected
    candidates: list = field(default_factory=list)
    seconds: float = 0.0  # how long planning took
    tempo_options: Optional[dict] = field(default_factory=dict)
    world_size: int = 1  # processes (GPUs), each planned as one rank
    parallel: Optional[str] = None  # "ddp" / "fsdp2" (tempo.plan.parallel), None: one process
    collective_seconds: Optional[float] = 0.0  # of ``step_seconds``: the collectives, not overlapped

    @property
    def tokens_per_global_step(self) -> int:
        """Tokens of a step over every rank (each rank takes ``tokens_per_step``)."""
        return self.tokens_per_step * self.world_size

    @property
    def step_seconds_overlapped(self) -> Optional[float]:
        """The projected step with the collectives hidden behind compute (``step_seconds``: not hidden)."""
        if self.step_seconds is None or self.collective_seconds is None:
            return None
        compute = self.step_seconds - self.collective_seconds
        return max(compute, self.collective_seconds)

    def wrap(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """``model`` (after ``apply``) wrapped by the parallel engine as this plan counted it
        (tempo.plan.parallel.wrap); the model itself when the plan is for one process."""
        if self.parallel is None:
            return model
        from tempo.plan.parallel import wrap

        return wrap(model, self.parallel, **kwargs)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    @property
    def tokens_per_second(self) -> Optional[float]:
        return self.tokens_per_step / self.step_seconds if self.step_seconds else None

    def apply(self, model: nn.Module) -> nn.Module:
        """``apply_tempo`` (this plan's choice) and the per-block recompute, on ``model`` in place."""
        from tempo.integrations.patch import apply_tempo

        if self.tempo_options is not None:  # None: a plan of the model without Tempo
            apply_tempo(model, **self.tempo_options)
        blocks = transformer_blocks(model)
        if len(blocks) != len(self.recompute):
            raise PlanError(f"Plan.apply: the plan is for {len(self.recompute)} Transformer blocks, "
                            f"{type(model).__name__} has {len(blocks)}")
        apply_recompute(model, list(self.recompute), blocks)
        return model

    def format(self) -> str:
        from tempo.plan.report import format_plan

        return format_plan(self)

    def __str__(self) -> str:
        return self.format()


def _lengths(lengths: Union[int, Sequence[int], np.ndarray], limit: Optional[int]) -> np.ndarray:
    array = np.atleast_1d(np.asarray(lengths))
    if array.size == 0 or array.dtype.kind not in "iu" or int(array.min()) < 1:
        raise PlanError(f"tempo.plan: argument 'lengths' must be a positive sequence length or a sample of them, "
                        f"got {lengths!r}"[:300])
    if limit is not None and int(array.max()) > limit:
        raise PlanError(f"tempo.plan: a sequence of {int(array.max())} tokens is longer than the model allows "
                        f"({limit} positions); truncate or split the data first")
    return array.astype(np.int64)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _buckets(lengths: np.ndarray, tokens: int, unpadding: bool, limit: Optional[int]) -> list:
    """Up to four length buckets (quartiles of the sample): padded length, share, sequences per step."""
    edges = sorted({int(np.quantile(lengths, q, method="higher")) for q in (0.25, 0.5, 0.75, 1.0)})
    rows, low = [], 0
    for edge in edges:
        inside = lengths[(lengths > low) & (lengths <= edge)]
        low = edge
        if not inside.size:
            continue
        padded = min(_round_up(edge, TOKEN_ROUNDING), limit) if limit else _round_up(edge, TOKEN_ROUNDING)
        per = float(inside.mean()) if unpadding else padded
        rows.append((padded, inside.size / lengths.size, int(tokens // per)))
    return rows


def _spread(count: int, total: int) -> list[bool]:
    """``count`` of ``total`` positions, evenly spread."""
    return [math.floor((i + 1) * count / total) > math.floor(i * count / total) for i in range(total)]


def recompute_candidates(blocks: int, modes: Sequence[str]) -> list[tuple]:
    """The plans tried, in order of recompute: none; "selective" on 1..L blocks; then "full" on 1..L
    blocks (the others selective when it is available): the cheaper bytes first."""
    out = [("none",) * blocks]
    base = "none"
    if "selective" in modes:
        out += [tuple("selective" if s else "none" for s in _spread(n, blocks)) for n in range(1, blocks + 1)]
        base = "selective"
    if "full" in modes:
        out += [tuple("full" if s else base for s in _spread(n, blocks)) for n in range(1, blocks + 1)]
    return out


def _uses_tempo_attention(model: nn.Module) -> bool:
    from tempo.integrations.attention_switch import configs_of

    configs = configs_of(model)
    return bool(configs) and all(getattr(c, "_attn_implementation", None) == "tempo_efficient" for c in configs)


def _takes_padding_free(model: nn.Module) -> bool:
    """Padding-free batches (packed real tokens) keep every sequence apart in this (patched) model,
    in bytes linear in the real tokens: Tempo's efficient attention reads the packing
    (tempo.integrations.hf_attention), DeBERTa's O(s) attention through its packing hooks; and the
    head is per token (or none). Not a model with sliding-window layers (ModernBERT's local
    attention): transformers builds a packed row's window as a dense [1, 1, T, T] mask (and int64
    distances of that size), O(T²) in the step's tokens; padded to its length it is planned exactly."""
    from tempo.integrations.attention_switch import configs_of
    from tempo.integrations.recipe import tempo_class

    name = type(model).__name__
    if any(getattr(m, "unpad", False) is True for m in model.modules()):
        return True  # tempo.bert built with unpad=True: every batch runs on its real tokens
    if name.endswith(("ForSequenceClassification", "ForMultipleChoice")):
        return False
    if any(tempo_class(m).__name__ == "DebertaEfficientAttention" for m in model.modules()):
        return True
    if any("sliding_attention" in (getattr(c, "layer_types", None) or ()) for c in configs_of(model)):
        return False
    return _uses_tempo_attention(model)


def _left_stock(model: nn.Module) -> list[str]:
    """Kinds apply_tempo has recipes for that stayed stock in the planned copy."""
    from tempo.integrations.layers import gelu_form
    from tempo.integrations.recipe import is_replacement

    left = []
    stock_norms = sum(1 for m in model.modules() if type(m) is nn.LayerNorm)
    if stock_norms:
        left.append(f"{stock_norms} nn.LayerNorm")
    stock_gelus = sum(1 for m in model.modules() if not is_replacement(m) and gelu_form(m)[1] is not None)
    if stock_gelus:
        left.append(f"{stock_gelus} GELU")
    if not _uses_tempo_attention(model) and not any(
            type(m).__name__.startswith("Deberta") and is_replacement(m) for m in model.modules()):
        left.append("attention (computed in the model's own layers, or output_attentions set)")
    return left


def _peak_lines(composition: Composition, fixed: int, optimizer_temporary: int,
                workspace: int, sharding: Any = None) -> list[tuple[float, float]]:
    """The peak's lines a + b·t; ``sharding`` (tempo.plan.parallel): each segment's moved by what a
    rank holds there beside the one-process step (a constant: the engine's buffers do not grow)."""
    grow = 1.0 + COMPOSITION_MARGIN
    moved = (lambda segment: sharding.offset(segment)) if sharding is not None else (lambda segment: 0)
    lines = [(fixed + workspace + grow * p.a + moved(composition.order[i]), grow * p.b)
             for p, i in zip(composition.peak, composition.peak_index)]
    lines.append((fixed + workspace + grow * (composition.end.a + optimizer_temporary) + moved(("end",)),
                  grow * composition.end.b))
    return lines


def largest_tokens(lines: list[tuple[float, float]], budget: int) -> int:
    """The largest t with a + b·t <= budget for every line (0 when even t = 0 does not fit). A line's
    start is compared in whole bytes, as the peak is reported (PeakParts): a budget of exactly a flat
    peak (the optimizer step's, say) holds it."""
    best = math.inf
    for a, b in lines:
        if int(a) > budget:
            return 0
        if b > 0:
            best = min(best, (budget - a) / b)
    if best is math.inf:
        raise PlanError("tempo.plan: the step's memory does not grow with its tokens; nothing to plan")
    return int(best)


def _breakdown(composition: Composition, t: int, weights: int, states: int, optimizer_temporary: int,
               workspace: int, sharding: Any = None) -> PeakParts:
    """The peak at ``t`` tokens and its parts (gradients: allocations made in backward, never freed;
    ``sharding``: a rank's, tempo.plan.parallel)."""
    grow = 1.0 + COMPOSITION_MARGIN
    moved = (lambda segment: sharding.offset(segment)) if sharding is not None else (lambda segment: 0)
    values = [p.at(t) for p in composition.peak]
    # Which moment peaks, as _peak_lines ranks them (the engine's buffers move each segment).
    ranked = [grow * v + moved(composition.order[k]) for v, k in zip(values, composition.peak_index)]
    i = int(np.argmax(ranked))
    optimizer_peak = composition.end.at(t) + optimizer_temporary
    if grow * optimizer_peak + moved(("end",)) >= ranked[i]:
        gradients = int(composition.end.at(t))
        margin = workspace + int(COMPOSITION_MARGIN * optimizer_peak)
        if sharding is None:
            return PeakParts(weights, gradients, states, 0, optimizer_temporary, margin, "the optimizer step",
                             workspace)
        return PeakParts(weights, gradients + sharding.gradient_change(("end",)), states, 0, optimizer_temporary,
                         margin, "the optimizer step", workspace, sharding.buffers(("end",)))
    j = composition.peak_index[i]
    segment = composition.order[j]
    gradients = int(composition.gradients[j].at(t))
    start = composition.start[j].at(t)
    where = {"fwd": "forward", "bwd": "backward"}.get(segment[0], segment[0])
    position = segment[1] if len(segment) > 1 else None
    blocks = len(composition.modes)
    label = (f"{where} of block {position}" if position not in (None, 0, blocks + 1)
             else f"{where} {'before the blocks' if position == 0 else 'of the head and loss'}"
             if position is not None else where)
    margin = workspace + int(COMPOSITION_MARGIN * values[i])
    if sharding is None:
        return PeakParts(weights, gradients, states, int(start - gradients), int(values[i] - start), margin, label,
                         workspace)
    return PeakParts(weights, gradients + sharding.gradient_change(segment), states, int(start - gradients),
                     int(values[i] - start), margin, label, workspace, sharding.buffers(segment))


@dataclass
class Counted:
    """What a plan is chosen from, counted once for a model, lengths, device, precision and optimizer
    (``count``); ``choose`` picks the plan for a budget from it in milliseconds."""

    model: str
    target: Device
    precision: str
    optimizer: str
    options: Optional[dict]
    swaps: dict
    left: list
    blocks: int
    unpadding: bool
    seq_len: int
    sample: np.ndarray
    limit: Optional[int]
    usable: list
    parts: dict
    weights: int
    states: int
    optimizer_temporary: int
    workspace: int
    optimizer_seconds: Optional[float]
    gpu: Any
    seconds: float
    sharding: Any = None  # tempo.plan.parallel.Sharding: counted per rank of a parallel engine

    def candidate(self, recompute: Sequence[str], budget: int, compiled: bool = False) -> Candidate:
        """``recompute`` at the most tokens ``budget`` holds (0 tokens: it does not fit)."""
        composition = compose(self.parts, recompute)
        lines = _peak_lines(composition, self.weights + self.states, self.optimizer_temporary, self.workspace,
                            self.sharding)
        most = largest_tokens(lines, budget)
        # The peak reported (PeakParts) is in whole bytes, a few below the lines' floats: a budget of
        # exactly the peak at t tokens leaves the lines a fraction of a token short of t.
        if _breakdown(composition, most + 1, self.weights, self.states, self.optimizer_temporary,
                      self.workspace, self.sharding).total <= budget:
            most += 1
        t = (most // self.token_unit) * self.token_unit
        if t < self.floor_tokens <= most:  # one longest sequence fits, though not the next multiple
            t = self.floor_tokens
        if t < self.floor_tokens:
            return Candidate(tuple(recompute), 0, None, None)
        peak = _breakdown(composition, t, self.weights, self.states, self.optimizer_temporary, self.workspace,
                          self.sharding)
        seconds = self.step_seconds(recompute, t, compiled)
        collectives = self.collective_seconds
        if seconds is not None and collectives is not None:
            seconds += collectives  # not overlapped: the conservative end (Plan.step_seconds_overlapped)
        return Candidate(tuple(recompute), t, peak, seconds)

    def peak_at(self, recompute: Sequence[str], tokens: int) -> PeakParts:
        """The predicted peak of a step of ``tokens`` tokens with ``recompute`` (what a GPU check holds
        to torch.cuda.max_memory_allocated)."""
        composition = compose(self.parts, recompute)
        return _breakdown(composition, tokens, self.weights, self.states, self.optimizer_temporary, self.workspace,
                          self.sharding)

    @property
    def world_size(self) -> int:
        return self.sharding.world_size if self.sharding is not None else 1

    @property
    def collective_seconds(self) -> Optional[float]:
        """The projected collectives of a step (tempo.plan.parallel), 0 for one process; None without
        numbers for the device's interconnect."""
        from tempo.plan.parallel import collective_seconds

        return collective_seconds(self.sharding, self.gpu.name if self.gpu is not None else None)

    @property
    def token_unit(self) -> int:
        """What a step's tokens are a multiple of: the length when every sequence has it (whole
        sequences: a padded model, or a sample of one length), else 8 (varied lengths fill a token
        budget to within a sequence; token-budget batches fill 97-99.5 % of it)."""
        if not self.unpadding:
            return self.seq_len
        lengths = np.unique(self.sample)
        return int(lengths[0]) if lengths.size == 1 else TOKEN_ROUNDING

    @property
    def floor_tokens(self) -> int:
        """The least a step must hold: the longest sequence (its padded length on a padded model)."""
        return int(self.sample.max()) if self.unpadding else self.seq_len

    def step_seconds(self, recompute: Sequence[str], tokens: float, compiled: bool = False) -> Optional[float]:
        """The projected step at ``tokens`` with ``recompute`` (None without a projection for the device);
        ``compiled``: its element-wise chains fused as torch.compile would (tempo.plan.fusion)."""
        if self.gpu is None:
            return None
        gpu = self.gpu
        return (step_seconds(self.parts, recompute, tokens, FITTED_COMPUTE * gpu.half_tflops * 1e12,
                             FITTED_COMPUTE * gpu.fp32_tflops * 1e12, FITTED_BANDWIDTH * gpu.bandwidth_gbs * 1e9,
                             KERNEL_FLOOR_S, fused=compiled)
                + self.optimizer_seconds)


def count(model: nn.Module, lengths: Union[int, Sequence[int]] = 512, device: str = "h100", precision: str = "bf16",
          optimizer: str = "adamw", *, tempo: Union[bool, dict] = True, modes: Sequence[str] = MODES,
          loss: Callable[[Any], torch.Tensor] = default_loss,
          progress: Optional[Callable[[str], None]] = None, world_size: int = 1,
          parallel: Optional[str] = None) -> Counted:
    """Everything ``plan`` chooses from, counted on fake tensors (the module docstring's steps 1-3);
    with ``parallel`` ("ddp", "fsdp2") over ``world_size`` processes, for one rank
    (tempo.plan.parallel)."""
    started = time.perf_counter()
    say = progress or (lambda line: None)
    if not isinstance(model, nn.Module):
        raise PlanError(f"tempo.plan: argument 'model' must be a torch.nn.Module, got {type(model).__name__}")
    target = resolve_device(device)
    if precision not in PRECISIONS:
        raise PlanError(f"tempo.plan: argument 'precision' must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"tempo.plan: argument 'optimizer' must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "none" not in modes:
        raise PlanError(f"tempo.plan: argument 'modes' must hold 'none' and any of {MODES}, got {list(modes)}")
    from tempo.plan.parallel import sharding as rank_sharding

    shard = rank_sharding(model, parallel, world_size, target.round_to)
    limit = max_positions(model)
    sample = _lengths(lengths, limit)

    from tempo.integrations.patch import apply_tempo, tempo_patched

    if not isinstance(tempo, (bool, dict)):
        raise PlanError(f"tempo.plan: argument 'tempo' must be True, False or a dict of apply_tempo's arguments, "
                        f"got {tempo!r}")
    options = ({} if tempo is True else dict(tempo)) if tempo is not False else None

    def prepare(copy: nn.Module) -> None:
        if options is not None:
            apply_tempo(copy, **options)

    say("applying Tempo to a structure-only copy" if options is not None else "copying the structure")
    full_copy = structure_copy(model)
    prepare(full_copy)
    swaps = {k: v for k, v in tempo_patched(full_copy).items() if v}
    left = _left_stock(full_copy)
    blocks_total = len(transformer_blocks(full_copy))
    unpadding = _takes_padding_free(full_copy)
    if unpadding:  # attention's work per token follows E[len²]/E[len]; memory per real token does not depend on it
        effective = float((sample.astype(np.float64) ** 2).sum() / sample.sum())
        seq_len = max(TOKEN_ROUNDING, _round_up(int(round(effective)), TOKEN_ROUNDING))
    else:
        seq_len = _round_up(int(sample.max()), TOKEN_ROUNDING)
    if limit is not None:
        seq_len = min(seq_len, limit)
    usable = [m for m in modes if m != "selective" or recomputed_parts(transformer_blocks(full_copy)[0])[0]]
    layout = probe_layout(usable)

    weights = _round_total(model, target.round_to) if shard is None else shard.weights
    say(f"counting the optimizer ({optimizer}) on fake tensors")
    # FSDP2's optimizer steps over a rank's shards; DDP's over a whole replica.
    owned = list(shard.shards if shard is not None and shard.engine == "fsdp2" else model.parameters())
    states, optimizer_temporary = optimizer_memory(owned, optimizer, target.semantics, target.round_to)
    workspace = WORKSPACE_BYTES if target.semantics == "cuda" else 0

    autocast = PRECISIONS[precision]
    traces = []
    for batch in (2, 4):
        say(f"tracing a step of {len(layout)} blocks at {batch * seq_len} tokens (fake tensors)")
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        probe, blocks, _depth = fake_probe(model, layout, mode, prepare)
        padded = not unpadding and takes_attention_mask(probe)  # the collator's mask, and what it builds from it
        batch_inputs = example_batch(probe, batch, seq_len, padded, ragged=np.unique(sample).size > 1,
                                     packed=unpadding)
        traces.append(trace_step(probe, blocks, batch_inputs, mode,
                                 semantics=target.semantics, autocast_dtype=autocast, loss_fn=loss,
                                 round_to=target.round_to))
    kernel_target = None
    gpu = None
    if target.projection is not None:
        from tempo.movement.declarations import Target
        from tempo.movement.projection import gpus

        gpu = gpus()[target.projection]
        kernel_target = Target(gpu.name, gpu.sms)
    parts = parts_from_traces(traces[0], 2 * seq_len, traces[1], 4 * seq_len, layout, kernel_target)
    return Counted(model=type(model).__name__, target=target, precision=precision, optimizer=optimizer,
                   options=options, swaps=swaps, left=left, blocks=blocks_total, unpadding=unpadding, seq_len=seq_len,
                   sample=sample, limit=limit, usable=usable, parts=parts, weights=weights, states=states,
                   optimizer_temporary=optimizer_temporary, workspace=workspace,
                   optimizer_seconds=_optimizer_seconds(owned, optimizer, gpu) if gpu is not None else None, gpu=gpu,
                   seconds=time.perf_counter() - started, sharding=shard)


def choose(counted: Counted, budget: Union[int, str, None], recompute_plans: Optional[list] = None,
           compiled: bool = False) -> Plan:
    """The plan for ``budget`` from what ``count`` counted: among ``recompute_plans`` (default: the
    sequence of ``recompute_candidates``), the most projected real tokens/s (without a projection: the
    least recompute that fits); ``compiled``: projected as under torch.compile (tempo.plan.fusion)."""
    started = time.perf_counter()
    if budget is None:
        if counted.target.memory is None:
            raise PlanError("tempo.plan: argument 'budget' is needed on the CPU (it has no fixed memory size)")
        budget_bytes = int(counted.target.memory * DEFAULT_BUDGET_SHARE)
    else:
        budget_bytes = parse_budget(budget)
    plans = recompute_plans if recompute_plans is not None else recompute_candidates(counted.blocks, counted.usable)
    candidates = [counted.candidate(recompute, budget_bytes, compiled) for recompute in plans]
    fitting = [c for c in candidates if c.tokens]
    if not fitting:
        _raise_does_not_fit(budget_bytes, counted.weights + counted.states, counted.workspace, counted.floor_tokens,
                            counted.unpadding)
    if counted.gpu is not None:
        best = max(fitting, key=lambda c: (c.tokens_per_second, c.tokens))
    else:
        best = fitting[0]  # no projection: the least recompute that fits
    return Plan(model=counted.model, device=counted.target, budget=budget_bytes, precision=counted.precision,
                optimizer=counted.optimizer, tempo=counted.swaps, left_stock=counted.left, recompute=list(best.recompute),
                unpadding=counted.unpadding, seq_len=counted.seq_len, tokens_per_step=best.tokens,
                buckets=_buckets(counted.sample, best.tokens, counted.unpadding, counted.limit), peak=best.peak,
                step_seconds=best.step_seconds, candidates=candidates,
                seconds=counted.seconds + time.perf_counter() - started, tempo_options=counted.options,
                world_size=counted.world_size, parallel=counted.sharding.engine if counted.sharding else None,
                collective_seconds=counted.collective_seconds)


def plan(model: nn.Module, budget: Union[int, str, None] = "24GiB", lengths: Union[int, Sequence[int]] = 512,
         device: str = "h100", precision: str = "bf16", optimizer: str = "adamw", *,
         tempo: Union[bool, dict] = True, modes: Sequence[str] = MODES, loss: Callable[[Any], torch.Tensor] = default_loss,
         progress: Optional[Callable[[str], None]] = None, world_size: int = 1,
         parallel: Optional[str] = None) -> Plan:
    """The plan for ``model`` (module docstring). ``tempo``: True (apply_tempo's default choice), a dict
    of apply_tempo's keyword arguments, or False (the model as it is: what torch alone gives, for
    comparisons); ``modes``: the recompute modes the plan may use; ``progress``: called with a short
    line at each stage; ``world_size`` and ``parallel`` ("ddp" or "fsdp2"): the plan of one rank of
    that many processes (tempo.plan.parallel: tokens per rank, ``tokens_per_global_step``)."""
    if budget is not None:
        parse_budget(budget)  # a bad budget is refused before anything is counted
    counted = count(model, lengths, device, precision, optimizer, tempo=tempo, modes=modes, loss=loss,
                    progress=progress, world_size=world_size, parallel=parallel)
    if progress is not None:
        progress(f"choosing among {len(recompute_candidates(counted.blocks, counted.usable))} recompute plans")
    return choose(counted, budget)


def _round_total(model: nn.Module, round_to: int) -> int:
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        n = t.numel() * t.element_size()
        total += -(-n // round_to) * round_to if round_to > 1 and n else n
    return total


def _optimizer_seconds(parameters: Any, optimizer: str, gpu: Any) -> float:
    """The optimizer step as one pass over ``parameters`` (a rank's), their gradients and states at
    the fitted bandwidth: AdamW/LAMB read 16 and write 12 bytes per fp32 parameter
    (tempo.movement's adam_update), SGD with momentum 12 and 8."""
    params = sum(p.numel() for p in {id(p): p for p in parameters if p.requires_grad}.values())
    per = 20 if optimizer == "sgd" else 28
    return per * params / (FITTED_BANDWIDTH * gpu.bandwidth_gbs * 1e9)


def _raise_does_not_fit(budget: int, fixed: int, workspace: int, floor_tokens: int, unpadding: bool) -> None:
    least = fixed + workspace
    unit = "real tokens" if unpadding else "tokens (one padded sequence)"
    if budget < least:
        raise PlanError(f"tempo.plan: the budget {format_bytes(budget)} is below the weights and optimizer states "
                        f"alone ({format_bytes(least)} with the workspace margin); the minimum is about "
                        f"{least / (1 << 30):.2f} GiB plus the gradients and one sequence's activations")
    raise PlanError(f"tempo.plan: not even {floor_tokens} {unit} (the longest sequence) fit "
                    f"{format_bytes(budget)} with full recompute in every block; weights and optimizer states take "
                    f"{format_bytes(least)}: raise the budget, shorten the sequences or use a smaller model")


def tokens_per_step(model: nn.Module, budget: Union[int, str, None] = "24GiB",
                    lengths: Union[int, Sequence[int]] = 512, device: str = "h100", precision: str = "bf16",
                    optimizer: str = "adamw", **kwargs: Any) -> int:
    """``plan(...).tokens_per_step``: what the trainers' ``--max_tokens auto`` asks for."""
    return plan(model, budget, lengths, device, precision, optimizer, **kwargs).tokens_per_step


__all__ = ["KERNEL_FLOOR_S", "PRECISIONS", "Candidate", "Counted", "Plan", "PeakParts", "choose", "count",
           "largest_tokens", "plan", "recompute_candidates", "tokens_per_step"]
