"""AutoTempo: decide from measurements whether (and where) Tempo's layers pay off.

Tempo trades a little extra compute for activation memory. That only helps when the memory buys
a larger batch *and* the larger batch is faster per sample. Two policies:

  * "fast": measure samples/s against batch size without Tempo, up to the largest batch that
    fits. If throughput is still rising there (the last doubling gained more than ``min_gain``),
    memory is what limits speed: apply Tempo everywhere, and find the larger batch it allows.
    Otherwise the curve has flattened and Tempo's extra work would only cost time: no Tempo.
  * "smart": for each candidate application (no Tempo; each layer kind alone; all kinds; all
    kinds on the first k Transformer layers only), find the largest batch that fits and measure
    samples/s there; keep the fastest.

Measurements come from a ``measure(model_factory, batch_size) -> (fits, samples_per_s)``
callable (a third element, bytes used, is shown in the table when given). The default,
``DefaultMeasure``, trains a few steps of the model on ``batch_factory(batch_size)``:
  * on CUDA, "fits" means no out-of-memory error (and peak allocated <= ``memory_budget`` if
    one is given). Every form of OOM counts, by the one rule ``max-batch`` uses
    (``tempo.train.max_batch.is_oom_error``): torch's OutOfMemoryError, cuBLAS's
    CUBLAS_STATUS_ALLOC_FAILED RuntimeError, "CUDA error: out of memory". Each probe runs in a
    process of its own (``isolate``, on by default on CUDA), as each ``max-batch`` probe does:
    an OOM, the allocator's fragmentation and cached blocks, a corrupted CUDA context never
    reach the next probe or the caller. Probe processes come from a fork server (spawn where
    there is none), never from a fork of this process, and get their factories pickled: pass
    module-level functions or ``functools.partial`` of them (lambdas and closures are measured in
    this process instead, with one warning). A probe process killed by SIGKILL (the kernel's OOM
    killer) counts as "does not fit"; any other failure raises ``ProbeError`` naming the batch,
    with the probe's traceback;
  * on the CPU, where running out of memory cannot be observed safely, "fits" means
    weights + gradients + optimizer states + the activations autograd keeps (ActivationLedger)
    <= ``memory_budget``. Without a budget everything fits.
The batch search is the bench harness's ``search_max_batch`` (doubling, then bisection).

Which Tempo: the default is ``TempoChoice.default()`` (every layer kind, efficient attention),
what ``apply_tempo(model)`` and ``--tempo`` mean; ``kinds`` restricts it (``TempoChoice.default(kinds)``).

    result = auto_tempo(functools.partial(BertForMaskedLM, config), make_batch,
                        policy="fast", memory_budget="2GiB")
    model = result.apply(BertForMaskedLM(config))
    print(result.format_table())

Partial application: layer kinds and "first k layers" are applied with ``apply_tempo`` on the
model's repeated Transformer blocks (its longest ``nn.ModuleList``); HF attention is set per
model (one ``attn_implementation`` per config), so it is never limited to some layers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
import math
import multiprocessing
import pickle
import signal
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from tempo.choices import LAYER_KINDS, PAPER_KINDS, TEMPO_ATTENTIONS, TempoChoice
from tempo.memory import gradient_bytes, optimizer_state_bytes, weight_bytes
from tempo.train.step import TrainStep, to_device
from tempo.train.max_batch import ProbeError, is_oom_error, search_max_batch
from tempo.utils import parse_bytes
from tempo.integrations.patch import apply_tempo

logger = logging.getLogger("tempo.integrations.autotempo")

ModelFactory = Callable[[], nn.Module]
BatchFactory = Callable[[int], Any]
MeasureResult = Union[tuple[bool, float], tuple[bool, float, Optional[int]]]
Measure = Callable[[ModelFactory, int], MeasureResult]


# ---------------------------------------------------------------------------------------------
# What to apply
# ---------------------------------------------------------------------------------------------
def apply_choice(choice: TempoChoice, model: nn.Module) -> nn.Module:
    """Apply a TempoChoice to a model (in place): layer kinds on all blocks or the first k; attention
    is set per model (HF has one attn_implementation per config), never on some layers only."""
    if choice.is_none:
        return model
    attention = choice.attention if choice.attention in TEMPO_ATTENTIONS else False
    fused = choice.dropout_add_layernorm
    if choice.first_layers is None:
        return apply_tempo(model, gelu=choice.gelu, layernorm=choice.layernorm, attention=attention,
                           dropout_add_layernorm=fused)
    for block in transformer_blocks(model)[: choice.first_layers]:
        apply_tempo(block, gelu=choice.gelu, layernorm=choice.layernorm, attention=False, dropout_add_layernorm=fused)
    if attention:
        apply_tempo(model, gelu=False, layernorm=False, attention=attention)
    return model


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: its longest nn.ModuleList (bert.encoder.layer, transformer.h)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of Transformer blocks")
    return max(lists, key=len)


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------
def _loss(model: nn.Module, batch: Any) -> Any:
    """A user's batch through a user's model: keyword batch, positional batch, or one tensor."""
    if isinstance(batch, Mapping):  # a dict, or transformers' BatchEncoding
        return model(**batch)
    return model(*batch) if isinstance(batch, (list, tuple)) else model(batch)


@dataclass
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer_states: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """DefaultMeasure's optimizer: AdamW at 1e-4 (module-level, so a spawned probe can pickle it)."""
    return torch.optim.AdamW(params, lr=1e-4)


def _probe_child(conn: Any, measure: Callable[[ModelFactory, int], Any], model_factory: ModelFactory,
                 batch_size: int) -> None:
    """In the probe process: measure once, send ("result", tuple) or ("error", type, message, traceback)."""
    try:
        message: tuple = ("result", tuple(measure(model_factory, batch_size)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent, which decides
        message = ("error", type(exc).__name__, str(exc), traceback.format_exc())
    try:
        conn.send(message)
    finally:
        conn.close()


_PROBE_CONTEXT = None


def _probe_context() -> Any:
    """Where probe processes come from: a fork server where the platform has one, else spawn.

    Not a fork of this process: a forked child cannot use a CUDA context its parent created, and
    one forked after this process ran OpenMP-parallel ops (any intra-op-threaded CPU op) can hang
    in its first parallel region (GNU libgomp is not fork-safe). The fork server is a fresh
    interpreter that has done neither; it imports torch once, so each probe starts in a fraction of
    a second instead of spawn's full interpreter start. Either way the probe's arguments travel
    pickled."""
    global _PROBE_CONTEXT
    if _PROBE_CONTEXT is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            _PROBE_CONTEXT = multiprocessing.get_context("forkserver")
            # Preloaded once in the server, not per probe (torch.optim's first step imports torch._dynamo:
            # ~1 s a probe otherwise). Only speeds up a server not yet started; one already running is used.
            _PROBE_CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "tempo.integrations.autotempo"])
        else:
            _PROBE_CONTEXT = multiprocessing.get_context("spawn")
    return _PROBE_CONTEXT


def probe_pickles(measure: Callable[[ModelFactory, int], Any], model_factory: ModelFactory) -> Optional[str]:
    """None when a probe of (measure, model_factory) can be sent to a process of its own, else why not."""
    try:
        pickle.dumps((measure, model_factory))
    except Exception as exc:  # noqa: BLE001 - pickling raises PicklingError, AttributeError, TypeError, ...
        return f"{type(exc).__name__}: {exc}"
    return None


def run_probe_isolated(measure: Callable[[ModelFactory, int], Any], model_factory: ModelFactory, batch_size: int,
                       timeout: Optional[float] = None) -> tuple:
    """``measure(model_factory, batch_size)`` in a process of its own (``_probe_context``); returns its
    result. ``measure`` and ``model_factory`` must pickle (module-level functions, functools.partial
    of them, picklable objects): otherwise ValueError, naming what to pass instead.

    An out-of-memory error in the probe (``is_oom_error``), or the probe killed by SIGKILL (the
    kernel's OOM killer), is (False, 0.0, None): does not fit. Anything else raises
    ProbeError(batch_size, ...) with the probe's traceback; so does a probe still running after
    ``timeout`` seconds (it is killed).
    """
    why = probe_pickles(measure, model_factory)
    if why is not None:
        raise ValueError(f"auto_tempo: the probe for batch {batch_size} cannot be sent to a process of its own "
                         f"({why}). Pass model_factory and batch_factory as module-level functions (or "
                         "functools.partial of them), or DefaultMeasure(isolate=False)")
    context = _probe_context()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_probe_child, args=(send, measure, model_factory, batch_size), daemon=True,
                              name=f"tempo-autotempo-probe-{batch_size}")
    process.start()
    send.close()  # the child holds its end: EOF here when it dies without sending
    message = None
    try:
        if timeout is not None and not receive.poll(timeout):
            process.kill()
            raise ProbeError(batch_size, f"the probe process ran longer than {timeout} s and was killed")
        message = receive.recv()
    except EOFError:
        pass
    finally:
        receive.close()
        process.join()
    if message is None:
        if process.exitcode == -signal.SIGKILL:
            logger.warning("auto_tempo: the probe for batch %d was killed by SIGKILL, as the kernel's out-of-memory "
                           "killer does: counted as 'does not fit'", batch_size)
            return False, 0.0, None
        raise ProbeError(batch_size, f"the probe process ended with exit code {process.exitcode} without a result")
    if message[0] == "result":
        return message[1]
    _, name, text, trace = message
    if is_oom_error(RuntimeError(f"{name}: {text}")):  # a measure that let an OOM escape
        return False, 0.0, None
    raise ProbeError(batch_size, f"{name}: {text}\n{trace.rstrip()}")


class DefaultMeasure:
    """Train a few steps and report (fits, samples/s, bytes); see the module docstring.

    ``optimizer_factory`` (default AdamW) gets the model's parameters. ``autocast_dtype`` runs
    the forward under torch.autocast. Timing: ``warmup`` untimed steps, then ``steps`` timed.
    ``isolate`` (default: on for CUDA, off for the CPU's estimate): each probe in a process of its
    own (``run_probe_isolated``), which needs factories that pickle; by default factories that do
    not (lambdas, closures) are measured in this process instead, with one warning; ``isolate=True``
    raises for them. ``probe_timeout`` seconds per isolated probe (None: no limit).
    """

    def __init__(self, batch_factory: BatchFactory, memory_budget: Union[int, str, None] = None,
                 device: Union[str, torch.device, None] = None, steps: int = 3, warmup: int = 1,
                 optimizer_factory: Optional[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = None,
                 autocast_dtype: Optional[torch.dtype] = None, max_grad_norm: Optional[float] = 1.0,
                 isolate: Optional[bool] = None, probe_timeout: Optional[float] = None):
        self.batch_factory = batch_factory
        self.memory_budget = parse_bytes(memory_budget)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.steps = steps
        self.warmup = max(1, warmup)  # the first step also sizes the optimizer states
        self.optimizer_factory = optimizer_factory or default_optimizer
        self.autocast_dtype = autocast_dtype
        self.max_grad_norm = max_grad_norm
        self.isolate = self.device.type == "cuda" if isolate is None else bool(isolate)
        self.isolate_by_default = isolate is None  # then factories that do not pickle run here, logged once
        self._warned_in_process = False
        if probe_timeout is not None and not probe_timeout > 0:
            raise ValueError(f"DefaultMeasure: argument 'probe_timeout' must be > 0 seconds or None, "
                             f"got {probe_timeout!r}")
        self.probe_timeout = probe_timeout

    @property
    def precision(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.autocast_dtype]

    def _train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainStep:
        # The trainers' step (autocast, fp16 scaling, clipping, skip rules); the ledger runs on
        # the first micro-batch only when the footprint is estimated (CPU), as in the trainers.
        return TrainStep(model, optimizer, _loss, self.precision, self.device, max_grad_norm=self.max_grad_norm,
                         measure_activations=self.device.type != "cuda")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def estimate(self, model_factory: ModelFactory, batch_size: int) -> MemoryEstimate:
        """Exact byte count of one training step's persistent parts (no timing)."""
        model = model_factory().to(self.device).train()
        optimizer = self.optimizer_factory(model.parameters())
        step = TrainStep(model, optimizer, _loss, self.precision, self.device, max_grad_norm=self.max_grad_norm)
        step([self.batch_factory(batch_size)])
        return self._estimate(model, optimizer, step.activation_bytes)

    @staticmethod
    def _estimate(model: nn.Module, optimizer: torch.optim.Optimizer, activations: int) -> MemoryEstimate:
        return MemoryEstimate(weights=weight_bytes(model), gradients=gradient_bytes(model),
                              optimizer_states=optimizer_state_bytes(optimizer), activations=activations)

    def __call__(self, model_factory: ModelFactory, batch_size: int) -> tuple[bool, float, Optional[int]]:
        isolate = self.isolate
        if self.isolate_by_default and isolate:
            why = probe_pickles(self.measure_here, model_factory)
            if why is not None:
                isolate = False
                if not self._warned_in_process:
                    self._warned_in_process = True
                    logger.warning("auto_tempo: probes run in this process, not each in its own (%s): an OOM's "
                                   "aftermath (fragmentation, cached blocks) may reach later probes. Pass module-level "
                                   "model_factory/batch_factory (or functools.partial of them) to isolate them", why)
        if isolate:
            return run_probe_isolated(self.measure_here, model_factory, batch_size, self.probe_timeout)
        return self.measure_here(model_factory, batch_size)

    def measure_here(self, model_factory: ModelFactory, batch_size: int) -> tuple[bool, float, Optional[int]]:
        """One probe in this process: (fits, samples/s, bytes); an out-of-memory error is "does not fit"."""
        model = optimizer = batch = step = None
        try:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.device)
            model = model_factory().to(self.device).train()
            optimizer = self.optimizer_factory(model.parameters())
            batch = to_device(self.batch_factory(batch_size), self.device)
            step = self._train_step(model, optimizer)
            step([batch])  # also the first warm-up step
            used = None
            if self.device.type != "cuda":
                used = self._estimate(model, optimizer, step.activation_bytes).total
                if self.memory_budget is not None and used > self.memory_budget:
                    return False, 0.0, used
            for _ in range(self.warmup - 1):
                step([batch])
            self._sync()
            start = time.perf_counter()
            for _ in range(self.steps):
                step([batch])
            self._sync()
            elapsed = time.perf_counter() - start
            if self.device.type == "cuda":
                used = torch.cuda.max_memory_allocated(self.device)
                if self.memory_budget is not None and used > self.memory_budget:
                    return False, 0.0, used
            return True, batch_size * self.steps / elapsed, used
        except Exception as exc:  # noqa: BLE001 - every OOM form is "does not fit"; anything else is raised
            if not is_oom_error(exc):
                raise
            logger.debug("batch %d does not fit: %s: %s", batch_size, type(exc).__name__, str(exc).splitlines()[0]
                         if str(exc) else "")
            return False, 0.0, None
        finally:
            model = optimizer = batch = step = None  # noqa: F841 - free before the next probe
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class Measurement:
    choice: TempoChoice
    batch_size: int
    fits: bool
    samples_per_s: float
    memory_bytes: Optional[int] = None


@dataclass
class AutoTempoResult:
    policy: str
    choice: TempoChoice  # TempoChoice.none() when Tempo does not pay off
    batch_size: int  # the largest batch that fits with that choice (0: none fits)
    samples_per_s: float
    reason: str
    measurements: list[Measurement] = field(default_factory=list)

    @property
    def use_tempo(self) -> bool:
        return not self.choice.is_none

    def apply(self, model: nn.Module) -> nn.Module:
        return apply_choice(self.choice, model)

    def table(self) -> list[dict[str, Any]]:
        return [{"tempo": m.choice.label, "batch_size": m.batch_size, "fits": m.fits,
                 "samples_per_s": m.samples_per_s, "memory_bytes": m.memory_bytes}
                for m in self.measurements]

    def format_table(self) -> str:
        lines = [f"{'tempo':<40} {'batch':>6} {'fits':>5} {'samples/s':>11} {'memory':>12}"]
        for m in self.measurements:
            memory = "" if m.memory_bytes is None else f"{m.memory_bytes / 2**20:.2f} MiB"
            lines.append(f"{m.choice.label:<40} {m.batch_size:>6} {str(m.fits):>5} "
                         f"{m.samples_per_s:>11.1f} {memory:>12}")
        lines.append(f"-> {self.choice.label}, batch {self.batch_size}: {self.reason}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------
def _search_max_batch(probe: Callable[[int], bool], start: int, max_batch: Optional[int]) -> int:
    return search_max_batch(probe, start=start, max_batch=max_batch)[0]


class _Measurer:
    """Memoised measurements of (choice, batch), recorded in order for the result table."""

    def __init__(self, model_factory: ModelFactory, measure: Measure):
        self.model_factory = model_factory
        self.measure = measure
        self.records: list[Measurement] = []
        self._cache: dict[tuple[TempoChoice, int], Measurement] = {}

    def __call__(self, choice: TempoChoice, batch_size: int) -> Measurement:
        key = (choice, batch_size)
        if key not in self._cache:
            # A partial of module-level pieces, not a lambda: an isolated probe may have to pickle it.
            result = tuple(self.measure(functools.partial(build_with_choice, choice, self.model_factory), batch_size))
            fits, samples_per_s = bool(result[0]), float(result[1]) if result[0] else 0.0
            memory = result[2] if len(result) > 2 else None
            record = Measurement(choice, batch_size, fits, samples_per_s, memory)
            logger.debug("measured %s at batch %d: fits=%s, %.1f samples/s", choice.label, batch_size,
                         fits, samples_per_s)
            self._cache[key] = record
            self.records.append(record)
        return self._cache[key]

    def max_batch(self, choice: TempoChoice, start: int, max_batch: Optional[int]) -> int:
        return _search_max_batch(lambda b: self(choice, b).fits, start, max_batch)

    def curve(self, choice: TempoChoice) -> list[Measurement]:
        return sorted((m for m in self.records if m.choice == choice and m.fits), key=lambda m: m.batch_size)


def _still_rising(curve: list[Measurement], min_gain: float) -> tuple[bool, str]:
    """Did throughput still grow over the last doubling (or more) before memory ran out?"""
    if len(curve) < 2:
        return True, "only one batch size fits, so memory is what limits the batch"
    top = curve[-1]
    earlier = [m for m in curve[:-1] if m.batch_size * 2 <= top.batch_size] or curve[:-1]
    base = earlier[-1]
    gain = top.samples_per_s / base.samples_per_s - 1 if base.samples_per_s > 0 else math.inf
    rising = gain > min_gain
    return rising, (f"samples/s {'still rises' if rising else 'has flattened'} at the largest batch that "
                    f"fits: {base.samples_per_s:.1f} at batch {base.batch_size} -> {top.samples_per_s:.1f} "
                    f"at {top.batch_size} ({gain:+.0%}, threshold {min_gain:+.0%})")


def build_with_choice(choice: TempoChoice, model_factory: ModelFactory) -> nn.Module:
    """``apply_choice(choice, model_factory())``: the model a measurement of ``choice`` trains."""
    return apply_choice(choice, model_factory())


def default_candidates(num_layers: Optional[int], kinds: Sequence[str] = LAYER_KINDS) -> list[TempoChoice]:
    """No Tempo, each kind alone, all ``kinds`` of the default together (``TempoChoice.default(kinds)``:
    with every kind, the default itself), and those on the first 1/4, 1/2, 3/4 of the layers; with
    the paper's three kinds among ``kinds`` also the paper's combination (Combined attention)."""
    candidates = [TempoChoice.none()] + [TempoChoice.default([k]) for k in kinds]
    everything = TempoChoice.default(kinds)
    if len(kinds) > 1:
        candidates.append(everything)
    if set(PAPER_KINDS) <= set(kinds) and TempoChoice.paper() not in candidates:
        candidates.append(TempoChoice.paper())
    if num_layers:
        for k in sorted({max(1, num_layers * q // 4) for q in (1, 2, 3)} - {num_layers}):
            candidates.append(replace(everything, first_layers=k))
    return candidates


def auto_tempo(model_factory: ModelFactory, batch_factory: Optional[BatchFactory] = None, policy: str = "fast",
               memory_budget: Union[int, str, None] = None, measure: Optional[Measure] = None,
               start_batch: int = 1, max_batch: Optional[int] = 1024, min_gain: float = 0.05,
               kinds: Sequence[str] = LAYER_KINDS, candidates: Optional[Sequence[TempoChoice]] = None,
               device: Union[str, torch.device, None] = None) -> AutoTempoResult:
    """Choose how to apply Tempo to the models ``model_factory`` builds; see the module docstring.

    ``batch_factory(batch_size)`` builds a training batch (a dict of model kwargs with labels, a
    tuple of positional args, or one tensor) for the default measure; ``measure`` replaces that
    default. ``max_batch`` caps the search (on CPU without a budget nothing runs out).
    ``min_gain``: "fast" applies Tempo when the last doubling before memory ran out gained more
    than this fraction of samples/s. "Tempo" is the default choice (every kind, efficient
    attention); ``kinds`` limits the layer kinds considered (e.g. without "attention" for non-HF
    models); ``candidates`` replaces smart's default list. A probe that fails for a reason other
    than memory raises (SearchError/ProbeError naming the batch on an isolated probe).
    """
    if policy not in ("fast", "smart"):
        raise ValueError(f"policy must be 'fast' or 'smart', got {policy!r}")
    unknown = set(kinds) - set(LAYER_KINDS)
    if unknown:
        raise ValueError(f"unknown Tempo layer kinds {sorted(unknown)}; choose from {LAYER_KINDS}")
    if measure is None:
        if batch_factory is None:
            raise ValueError("auto_tempo needs batch_factory (for the default measure) or measure")
        measure = DefaultMeasure(batch_factory, memory_budget=memory_budget, device=device)
    measurer = _Measurer(model_factory, measure)
    if policy == "fast":
        result = _fast(measurer, start_batch, max_batch, min_gain, kinds)
    else:
        result = _smart(measurer, model_factory, start_batch, max_batch, kinds, candidates)
    logger.info("auto_tempo(%s): %s, batch %d, %.1f samples/s: %s", policy, result.choice.label,
                result.batch_size, result.samples_per_s, result.reason)
    return result


def _fast(measurer: _Measurer, start: int, max_batch: Optional[int], min_gain: float,
          kinds: Sequence[str]) -> AutoTempoResult:
    plain = TempoChoice.none()
    plain_max = measurer.max_batch(plain, start, max_batch)
    curve = measurer.curve(plain)
    if max_batch is not None and plain_max >= max_batch:
        best = curve[-1]
        return AutoTempoResult("fast", plain, plain_max, best.samples_per_s,
                               f"batch {max_batch} (the search limit) fits without Tempo: memory never ran out",
                               measurer.records)
    rising, why = _still_rising(curve, min_gain) if plain_max else (True, "not even the smallest batch fits without Tempo")
    if not rising:
        return AutoTempoResult("fast", plain, plain_max, curve[-1].samples_per_s, why + ": no Tempo",
                               measurer.records)
    tempo = TempoChoice.default(kinds)
    tempo_max = measurer.max_batch(tempo, max(plain_max, start), max_batch)
    if tempo_max <= plain_max:
        rate = curve[-1].samples_per_s if curve else 0.0
        return AutoTempoResult("fast", plain, plain_max, rate,
                               why + f", but Tempo does not fit a larger batch ({tempo_max}): no Tempo",
                               measurer.records)
    rate = measurer(tempo, tempo_max).samples_per_s
    return AutoTempoResult("fast", tempo, tempo_max, rate,
                           why + f": Tempo, batch {plain_max} -> {tempo_max}", measurer.records)


def _smart(measurer: _Measurer, model_factory: ModelFactory, start: int, max_batch: Optional[int],
           kinds: Sequence[str], candidates: Optional[Sequence[TempoChoice]]) -> AutoTempoResult:
    if candidates is None:
        try:
            num_layers = len(transformer_blocks(model_factory()))
        except ValueError:
            num_layers = None
        candidates = default_candidates(num_layers, kinds)
    best: Optional[tuple[float, int, TempoChoice]] = None
    for choice in candidates:  # ties keep the earlier (simpler) candidate
        batch = measurer.max_batch(choice, start, max_batch)
        rate = measurer(choice, batch).samples_per_s if batch else 0.0
        if best is None or rate > best[0]:
            best = (rate, batch, choice)
    assert best is not None
    rate, batch, choice = best
    baseline = next((m for m in reversed(measurer.curve(TempoChoice.none()))), None)
    versus = (f"{rate / baseline.samples_per_s:.2f}x no Tempo at its largest batch {baseline.batch_size}"
              if baseline is not None and baseline.samples_per_s > 0 and not choice.is_none else
              "the fastest of the candidates at their largest batch")
    return AutoTempoResult("smart", choice, batch, rate,
                           f"best of {len(candidates)} candidates: {versus}", measurer.records)


__all__ = ["apply_choice", "auto_tempo", "AutoTempoResult", "DefaultMeasure", "Measurement", "MemoryEstimate", "TempoChoice",
           "build_with_choice", "default_candidates", "default_optimizer", "run_probe_isolated", "transformer_blocks"]
