"""Confirm a plan on the real device: measure it and its neighbours, keep the fastest that fits.

    plan = tempo.plan.plan(model, budget="24GiB", lengths=lengths, device="cuda")
    confirmed = tempo.plan.confirm(plan, model_factory, batch_factory)
    print(confirmed)                  # each candidate: projected beside measured
    model = confirmed.apply(model_factory())

``tempo.plan`` chooses on fake tensors, from projections; ``confirm`` trains a few real steps of
the plan and of its neighbours and keeps the fastest measured candidate that fits the plan's budget.
It is a check of the plan, not a second planner: it only measures what the plan proposes and the
candidates next to it.

The candidates (``neighbours=True``; ``False``: the plan alone):
  * the plan itself: its recompute at its ``tokens_per_step``;
  * the same recompute at fewer and more tokens (``scales``, 0.85x and 1.15x by default), rounded as
    the plan rounds (a multiple of ``TOKEN_ROUNDING`` real tokens on a padding-free plan, of the
    padded sequence length otherwise; down below 1x, up above it, at least one unit away);
  * the previous and the next recompute plan in the order the planner tried them
    (``plan.candidates``, ``recompute_candidates``: less recompute before, more after), each at its
    own planned tokens. One the planner found not to fit at all is measured at the plan's tokens:
    that checks the prediction that less recompute does not fit.
Projections sit beside the measurements: the projected step time and the predicted peak of the
plan and of the recompute neighbours come from the plan; those of the scaled neighbours need the
``Counted`` the plan was chosen from (``counted=``, from ``tempo.plan.count``), else they show "-".

Model and batch: ``model_factory()`` builds a fresh model; a candidate is measured on
``plan.apply(model_factory())`` with that candidate's recompute (``PlannedModel``).
``batch_factory(tokens)`` returns a training batch of at most ``tokens`` real tokens (a dict of
model keyword arguments with labels, a tuple of positional arguments, or one tensor; real tokens are
counted from its ``attention_mask``/``input_mask``, else the elements of its first tensor). For
fixed-length data, ``fixed_length_batches(batch_of_sequences, seq_len)`` asks
``batch_of_sequences(tokens // seq_len)``.

Measuring (``DefaultMeasure``; ``measure=`` replaces it: ``measure(model_factory, tokens)`` returns
``(fits, real tokens/s)`` or ``(fits, real tokens/s, memory bytes[, real tokens per step])``): the
trainers' own step (``tempo.train.step.TrainStep``) with the plan's precision and optimizer, one
warm-up step, then ``steps`` timed; tokens/s are real tokens.
  * On CUDA the peak is ``torch.cuda.max_memory_allocated`` over the probe; "fits" means no
    out-of-memory error and that peak within the plan's budget. Every form of OOM counts, by the one
    rule ``max-batch`` uses (``tempo.train.max_batch.is_oom_error``): torch's OutOfMemoryError,
    cuBLAS's CUBLAS_STATUS_ALLOC_FAILED, "CUDA error: out of memory". Each probe runs in a process of
    its own (``isolate``, on by default on CUDA): an OOM, the allocator's cached blocks and a broken
    CUDA context never reach the next probe or the caller. Probe processes come from a fork server
    (spawn where there is none), never from a fork of this process, and get the measure and the model
    factory pickled: pass module-level functions or ``functools.partial`` of them (others are
    measured in this process instead, with one warning; ``isolate=True`` refuses them). A probe
    process killed by SIGKILL (the kernel's OOM killer) counts as "does not fit"; any other failure
    raises ``ConfirmError`` naming the candidate, with the probe's traceback.
  * On the CPU, where running out of memory cannot be observed safely, the peak is counted storage
    by storage over one more step, the optimizer states present (``tempo.plan.live.LiveStorages``:
    no module hooks, unlike MemTracker, whose hooks hold one more gradient of a block's output) and
    "fits" means that peak within the budget. That is the counter the plan's predicted peak is held
    to (tempo.plan.band), so a neighbour the plan says overshoots is measured against the same rule. (The activation ledger's footprint, weights +
    gradients + optimizer states + kept activations, leaves out backward's transients: it would let
    the 1.15x neighbour "fit" where the plan and the counter say it does not.) A CPU probe over the
    budget is not timed (tokens/s 0).
The plan must be for the kind of device measured (a plan for an H100 is confirmed on a GPU, a plan
for device="cpu" on the CPU): the measure refuses the other.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import pickle
import signal
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from tempo.choices import PRECISIONS
from tempo.plan.budget import PlanError, parse_budget
from tempo.plan.planner import TOKEN_ROUNDING, Counted, Plan
from tempo.integrations.recompute import MODES
from tempo.train.max_batch import ProbeError, is_oom_error
from tempo.train.step import TrainStep
from tempo.utils import format_bytes

logger = logging.getLogger("tempo.plan.confirm")

ModelFactory = Callable[[], nn.Module]
BatchFactory = Callable[[int], Any]  # real tokens -> a batch of at most that many
Measure = Callable[[ModelFactory, int], Any]
DEFAULT_SCALES = (0.85, 1.15)


class ConfirmError(PlanError):
    """A confirmation that cannot be made or finished; ``confirmation`` holds what was measured so far."""

    def __init__(self, message: str, confirmation: Optional["Confirmation"] = None):
        super().__init__(message)
        self.confirmation = confirmation


class Measurement(NamedTuple):
    """What a measure returns for one candidate."""

    fits: bool
    tokens_per_second: float  # real tokens per second (0.0 when not measured)
    memory_bytes: Optional[int] = None  # the peak (see the measure's ``memory_counter``), None: no counter
    real_tokens: Optional[int] = None  # real tokens in one step of the probe


# ---------------------------------------------------------------------------------------------
# The model and the batch of a candidate
# ---------------------------------------------------------------------------------------------
class PlannedModel:
    """``model_factory()`` with ``plan`` applied and ``recompute`` per block: the model a candidate
    trains. Pickles when ``model_factory`` does (a probe process builds it there)."""

    def __init__(self, plan: Plan, recompute: Sequence[str], model_factory: ModelFactory):
        self.plan = replace(plan, recompute=list(recompute), candidates=[])
        self.model_factory = model_factory

    @property
    def recompute(self) -> tuple:
        return tuple(self.plan.recompute)

    def __call__(self) -> nn.Module:
        return self.plan.apply(self.model_factory())


def _sequences_for(batch_of_sequences: Callable[[int], Any], seq_len: int, tokens: int) -> Any:
    sequences = tokens // seq_len
    if sequences < 1:
        raise ValueError(f"fixed_length_batches: {tokens} tokens hold no whole sequence of {seq_len} tokens")
    return batch_of_sequences(sequences)


def fixed_length_batches(batch_of_sequences: Callable[[int], Any], seq_len: int) -> BatchFactory:
    """A batch factory for data of one length: ``tokens`` -> ``batch_of_sequences(tokens // seq_len)``
    (every token real). Pickles when ``batch_of_sequences`` does."""
    if not callable(batch_of_sequences):
        raise TypeError(f"fixed_length_batches: argument 'batch_of_sequences' must be callable, "
                        f"got {type(batch_of_sequences).__name__}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"fixed_length_batches: argument 'seq_len' must be a positive int, got {seq_len!r}")
    return functools.partial(_sequences_for, batch_of_sequences, seq_len)


# ---------------------------------------------------------------------------------------------
# Measuring one candidate
# ---------------------------------------------------------------------------------------------
def _loss(model: nn.Module, batch: Any) -> Any:
    """A user's batch through a user's model: keyword batch, positional batch, or one tensor."""
    if isinstance(batch, Mapping):  # a dict, or transformers' BatchEncoding
        return model(**batch)
    return model(*batch) if isinstance(batch, (list, tuple)) else model(batch)


def optimizer_factory(name: str, device_type: str) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """The optimizer ``name`` as the plan counted it (tempo.plan.states), as a picklable factory."""
    from tempo.plan.states import OPTIMIZERS, _build

    if name not in OPTIMIZERS:
        raise PlanError(f"confirm: optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")
    return functools.partial(_build, name, semantics="cuda" if device_type == "cuda" else "cpu")


class DefaultMeasure:
    """Train a few steps of a candidate and report a ``Measurement``; see the module docstring.

    ``precision`` ("fp32", "tf32", "bf16", "fp16") and ``optimizer`` (a name of
    tempo.plan.states.OPTIMIZERS) as in the plan; ``memory_budget``: what "fits" is held to (None:
    everything fits). Timing: ``warmup`` untimed steps (at least one: it sizes the optimizer
    states), then ``steps`` timed.
    """

    def __init__(self, batch_factory: BatchFactory, memory_budget: Union[int, str, None] = None,
                 device: Union[str, torch.device, None] = None, precision: str = "fp32", optimizer: str = "adamw",
                 steps: int = 3, warmup: int = 1, max_grad_norm: Optional[float] = 1.0):
        if not callable(batch_factory):
            raise TypeError(f"DefaultMeasure: argument 'batch_factory' must be callable, "
                            f"got {type(batch_factory).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"DefaultMeasure: argument 'steps' must be a positive int, got {steps!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"DefaultMeasure: argument 'warmup' must be an int >= 1 (the first step sizes the "
                             f"optimizer states), got {warmup!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"DefaultMeasure: argument 'precision' must be one of {', '.join(PRECISIONS)}, "
                             f"got {precision!r}")
        self.batch_factory = batch_factory
        self.memory_budget = None if memory_budget is None else parse_budget(memory_budget)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.precision = precision
        self.optimizer_factory = optimizer_factory(optimizer, self.device.type)
        self.steps, self.warmup = steps, warmup
        self.max_grad_norm = max_grad_norm

    @property
    def memory_counter(self) -> str:
        """What ``Measurement.memory_bytes`` is."""
        return "torch.cuda.max_memory_allocated" if self.device.type == "cuda" else "live storages peak"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, model_factory: ModelFactory, tokens: int) -> Measurement:
        """One probe in this process; an out-of-memory error is "does not fit", anything else is raised."""
        model = optimizer = batch = step = None
        cuda = self.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.device)
            model = model_factory().to(self.device).train()
            optimizer = self.optimizer_factory(model.parameters())
            batch = self.batch_factory(tokens)
            step = TrainStep(model, optimizer, _loss, self.precision, self.device, max_grad_norm=self.max_grad_norm,
                             measure_activations=False)
            real = step([batch]).tokens  # the first warm-up step
            if real > tokens:
                raise ValueError(f"confirm: batch_factory({tokens}) returned a batch of {real} real tokens; it must "
                                 f"return at most the tokens it is asked for")
            peak = None if cuda else _tracked_peak(model, optimizer, step, batch)
            if not cuda and self.memory_budget is not None and peak > self.memory_budget:
                return Measurement(False, 0.0, peak, real)
            for _ in range(self.warmup - 1):
                step([batch])
            self._sync()
            start, timed = time.perf_counter(), 0
            for _ in range(self.steps):
                timed += step([batch]).tokens
            self._sync()
            rate = timed / (time.perf_counter() - start)
            if cuda:
                peak = torch.cuda.max_memory_allocated(self.device)
            fits = self.memory_budget is None or peak <= self.memory_budget
            return Measurement(fits, rate, peak, real)
        except Exception as exc:  # noqa: BLE001 - every OOM form is "does not fit"; anything else is raised
            if not is_oom_error(exc):
                raise
            logger.debug("%d tokens do not fit: %s: %s", tokens, type(exc).__name__,
                         str(exc).splitlines()[0] if str(exc) else "")
            return Measurement(False, 0.0, None, None)
        finally:
            model = optimizer = batch = step = None  # noqa: F841 - free before the next probe
            if cuda:
                torch.cuda.empty_cache()


def _tracked_peak(model: nn.Module, optimizer: torch.optim.Optimizer, step: TrainStep, batch: Any) -> int:
    """The peak bytes of one more training step (optimizer states present), storage by storage
    (tempo.plan.live.LiveStorages: no module hooks, the inside of the ops the plan counts inside)."""
    from tempo.plan.live import LiveStorages

    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    inputs = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    counter = LiveStorages([*model.parameters(), *model.buffers(), *states, *inputs])
    with counter:
        step([batch])
    return counter.peak()


# ---------------------------------------------------------------------------------------------
# Probes in a process of their own
# ---------------------------------------------------------------------------------------------
def _probe_child(conn: Any, measure: Measure, model_factory: ModelFactory, tokens: int) -> None:
    """In the probe process: measure once, send ("result", tuple) or ("error", type, message, traceback)."""
    try:
        message: tuple = ("result", tuple(measure(model_factory, tokens)))
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
            _PROBE_CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "tempo.plan.confirm"])
        else:
            _PROBE_CONTEXT = multiprocessing.get_context("spawn")
    return _PROBE_CONTEXT


def probe_pickles(measure: Measure, model_factory: ModelFactory) -> Optional[str]:
    """None when a probe of (measure, model_factory) can be sent to a process of its own, else why not."""
    try:
        pickle.dumps((measure, model_factory))
    except Exception as exc:  # noqa: BLE001 - pickling raises PicklingError, AttributeError, TypeError, ...
        return f"{type(exc).__name__}: {exc}"
    return None


def run_probe_isolated(measure: Measure, model_factory: ModelFactory, tokens: int,
                       timeout: Optional[float] = None) -> tuple:
    """``measure(model_factory, tokens)`` in a process of its own (``_probe_context``); returns its
    result. ``measure`` and ``model_factory`` must pickle (module-level functions, functools.partial
    of them, picklable objects): otherwise ValueError, naming what to pass instead.

    An out-of-memory error in the probe (``is_oom_error``), or the probe killed by SIGKILL (the
    kernel's OOM killer), is (False, 0.0, None): does not fit. Anything else raises
    ProbeError(tokens, ...) with the probe's traceback; so does a probe still running after
    ``timeout`` seconds (it is killed).
    """
    why = probe_pickles(measure, model_factory)
    if why is not None:
        raise ValueError(f"confirm: the probe at {tokens} tokens cannot be sent to a process of its own ({why}). "
                         f"Pass model_factory and batch_factory as module-level functions (or functools.partial "
                         f"of them), or isolate=False")
    context = _probe_context()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_probe_child, args=(send, measure, model_factory, tokens), daemon=True,
                              name=f"tempo-confirm-probe-{tokens}")
    process.start()
    send.close()  # the child holds its end: EOF here when it dies without sending
    message = None
    try:
        if timeout is not None and not receive.poll(timeout):
            process.kill()
            raise ProbeError(tokens, f"the probe process ran longer than {timeout} s and was killed")
        message = receive.recv()
    except EOFError:
        pass
    finally:
        receive.close()
        process.join()
    if message is None:
        if process.exitcode == -signal.SIGKILL:
            logger.warning("confirm: the probe at %d tokens was killed by SIGKILL, as the kernel's out-of-memory "
                           "killer does: counted as 'does not fit'", tokens)
            return False, 0.0, None
        raise ProbeError(tokens, f"the probe process ended with exit code {process.exitcode} without a result")
    if message[0] == "result":
        return message[1]
    _, name, text, trace = message
    if is_oom_error(RuntimeError(f"{name}: {text}")):  # a measure that let an OOM escape
        return False, 0.0, None
    raise ProbeError(tokens, f"{name}: {text}\n{trace.rstrip()}")


# ---------------------------------------------------------------------------------------------
# The candidates and the result
# ---------------------------------------------------------------------------------------------
@dataclass
class MeasuredCandidate:
    """One candidate: what the plan projects for it beside what was measured."""

    label: str  # "the plan", "0.85x tokens", "previous recompute", ...
    recompute: tuple
    tokens: int  # real tokens asked of batch_factory
    projected_seconds: Optional[float]  # projected step time (None: no projection)
    predicted_peak: Optional[int]  # the plan's predicted peak bytes (None: not predicted)
    predicted_fits: Optional[bool] = None  # the planner's verdict (None: not predicted)
    fits: Optional[bool] = None  # measured (None: not measured yet)
    tokens_per_second: Optional[float] = None  # measured real tokens/s
    memory_bytes: Optional[int] = None  # measured peak
    real_tokens: Optional[int] = None  # real tokens per measured step

    @property
    def projected_tokens_per_second(self) -> Optional[float]:
        return self.tokens / self.projected_seconds if self.projected_seconds else None

    def summary(self) -> str:
        counts = {m: self.recompute.count(m) for m in MODES if self.recompute.count(m)}
        return ", ".join(f"{n} {m}" for m, n in counts.items())


@dataclass
class Confirmation:
    """The plan's candidates, projected and measured, and the choice: the fastest measured that fits."""

    plan: Plan
    device: str  # where the measurements ran
    memory_counter: str  # what ``memory_bytes`` is
    rows: list[MeasuredCandidate] = field(default_factory=list)
    choice: Optional[MeasuredCandidate] = None

    @property
    def recompute(self) -> list:
        return list(self._chosen().recompute)

    @property
    def tokens_per_step(self) -> int:
        return self._chosen().tokens

    @property
    def tokens_per_second(self) -> float:
        return float(self._chosen().tokens_per_second or 0.0)

    @property
    def confirmed(self) -> bool:
        """Whether the plan itself is the choice."""
        return self.choice is self.rows[0] if self.rows and self.choice is not None else False

    def _chosen(self) -> MeasuredCandidate:
        if self.choice is None:
            raise ConfirmError("confirm: no candidate fits, there is nothing to apply", self)
        return self.choice

    def apply(self, model: nn.Module) -> nn.Module:
        """``apply_tempo`` (the plan's choice) and the chosen recompute per block, on ``model`` in place;
        train it with ``tokens_per_step`` real tokens a step."""
        return replace(self.plan, recompute=self.recompute, candidates=[]).apply(model)

    def format(self) -> str:
        plan = self.plan
        lines = [f"Confirmation of the plan for {plan.model} ({plan.device.name}, budget {format_bytes(plan.budget)}, "
                 f"{plan.precision}, {plan.optimizer}), measured on {self.device}",
                 f"  {'candidate':<34} {'recompute':<22} {'tokens':>8} {'projected tok/s':>16} {'predicted peak':>15}"
                 f" {'fits':>5} {'measured tok/s':>15} {'measured peak':>14}"]
        for row in self.rows:
            projected = row.projected_tokens_per_second
            fits = "-" if row.fits is None else "yes" if row.fits else "no"
            rate = f"{row.tokens_per_second:,.0f}" if row.tokens_per_second else "-"
            mark = "->" if row is self.choice else "  "
            lines.append(f"{mark}{row.label:<34} {row.summary():<22} {row.tokens:>8,} "
                         f"{(f'{projected:,.0f}' if projected else '-'):>16} {format_bytes(row.predicted_peak):>15} "
                         f"{fits:>5} {rate:>15} {format_bytes(row.memory_bytes):>14}")
        if self.choice is None:
            lines.append("  no candidate fits")
        else:
            lines.append(f"  chosen: {self.choice.label} ({self.choice.summary()}, {self.choice.tokens:,} tokens per "
                         f"step): the fastest measured that fits")
        lines.append(f"  projected: tempo.movement's roofline; predicted: the plan's peak; measured: {self.device} "
                     f"(peak: {self.memory_counter})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _scaled(tokens: int, scale: float, unit: int) -> int:
    """``tokens`` x ``scale`` rounded to a multiple of ``unit``: down below 1x, up above, at least one unit away."""
    units = tokens / unit * scale
    n = math.floor(units + 1e-9) if scale < 1 else math.ceil(units - 1e-9)  # 40 x 1.15 is 45.999...: 46
    current = tokens // unit
    if n == current:
        n += -1 if scale < 1 else 1
    return n * unit


def candidates_of(plan: Plan, neighbours: bool = True, scales: Sequence[float] = DEFAULT_SCALES,
                  counted: Optional[Counted] = None) -> list[MeasuredCandidate]:
    """The candidates ``confirm`` measures (module docstring), not yet measured; the plan first."""
    recompute = tuple(plan.recompute)
    rows = [MeasuredCandidate("the plan", recompute, plan.tokens_per_step, plan.step_seconds, plan.peak_bytes, True)]
    if not neighbours:
        return rows
    unit = TOKEN_ROUNDING if plan.unpadding else plan.seq_len
    for scale in scales:
        tokens = _scaled(plan.tokens_per_step, scale, unit)
        if tokens < unit:
            continue
        projected = counted.step_seconds(recompute, tokens) if counted is not None else None
        peak = counted.peak_at(recompute, tokens).total if counted is not None else None
        rows.append(MeasuredCandidate(f"{scale:g}x tokens", recompute, tokens, projected, peak,
                                      None if peak is None else peak <= plan.budget))
    order = [tuple(c.recompute) for c in plan.candidates]
    if recompute in order:
        i = order.index(recompute)
        for j, name in ((i - 1, "previous recompute"), (i + 1, "next recompute")):
            if not 0 <= j < len(order):
                continue
            other = plan.candidates[j]
            if other.tokens:
                rows.append(MeasuredCandidate(name, tuple(other.recompute), other.tokens, other.step_seconds,
                                              other.peak.total if other.peak is not None else None, True))
            else:  # predicted not to fit at all: measured at the plan's tokens, to check that
                peak = counted.peak_at(other.recompute, plan.tokens_per_step).total if counted is not None else None
                rows.append(MeasuredCandidate(f"{name} (predicted not to fit)", tuple(other.recompute),
                                              plan.tokens_per_step, None, peak, False))
    elif plan.candidates:
        logger.warning("confirm: the plan's recompute is not among plan.candidates; no recompute neighbours")
    seen, unique = set(), []
    for row in rows:
        if (row.recompute, row.tokens) not in seen:
            seen.add((row.recompute, row.tokens))
            unique.append(row)
    return unique


class _Prober:
    """Runs ``measure`` on a candidate, in a process of its own or here (module docstring)."""

    def __init__(self, measure: Measure, isolate: Optional[bool], timeout: Optional[float]):
        device = getattr(measure, "device", None)
        self.measure, self.timeout = measure, timeout
        self.by_default = isolate is None
        self.isolate = (isinstance(device, torch.device) and device.type == "cuda") if isolate is None else isolate
        self._warned = False

    def __call__(self, factory: PlannedModel, tokens: int) -> tuple:
        isolate = self.isolate
        if isolate and self.by_default:
            why = probe_pickles(self.measure, factory)
            if why is not None:
                isolate = False
                if not self._warned:
                    self._warned = True
                    logger.warning("confirm: probes run in this process, not each in its own (%s): an OOM's aftermath "
                                   "(fragmentation, cached blocks) may reach later probes. Pass module-level "
                                   "model_factory/batch_factory (or functools.partial of them) to isolate them", why)
        if isolate:
            return run_probe_isolated(self.measure, factory, tokens, self.timeout)
        try:
            return self.measure(factory, tokens)
        except Exception as exc:  # noqa: BLE001 - a measure that let an OOM escape: does not fit
            if not is_oom_error(exc):
                raise
            return False, 0.0, None


def _as_measurement(result: Any, where: str) -> Measurement:
    try:
        values = tuple(result)
    except TypeError:
        values = ()
    if not 2 <= len(values) <= 4:
        raise ConfirmError(f"confirm: argument 'measure' must return (fits, tokens/s[, memory bytes[, real tokens]]); "
                           f"for {where} it returned {result!r}"[:400])
    measured = Measurement(*values)
    return measured._replace(fits=bool(measured.fits),
                             tokens_per_second=float(measured.tokens_per_second or 0.0))


def confirm(plan: Plan, model_factory: ModelFactory, batch_factory: Optional[BatchFactory] = None, *,
            measure: Optional[Measure] = None, neighbours: bool = True, scales: Sequence[float] = DEFAULT_SCALES,
            counted: Optional[Counted] = None, device: Union[str, torch.device, None] = None,
            steps: Optional[int] = None, warmup: Optional[int] = None, isolate: Optional[bool] = None, probe_timeout: Optional[float] = None,
            progress: Optional[Callable[[str], None]] = None) -> Confirmation:
    """Measure ``plan`` and its neighbours on the device and keep the fastest that fits (module docstring).

    ``batch_factory(tokens)``: a batch of at most ``tokens`` real tokens, for the default measure
    (``DefaultMeasure`` with the plan's budget, precision and optimizer, ``steps`` timed steps (3)
    after ``warmup`` (1), on ``device``: by default CUDA for a plan for a GPU, the CPU for a plan for
    device="cpu"); ``measure`` replaces it. ``counted``: the ``Counted`` the plan was chosen from,
    for the projections of the scaled neighbours. ``isolate``: each probe in a process of its own
    (None: on CUDA); ``probe_timeout`` seconds per isolated probe. ``progress`` is called with a
    line per probe. Raises ConfirmError naming the candidate when a probe fails for a reason other
    than memory, or when no candidate fits (with what was measured).
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"confirm: argument 'plan' must be a tempo.plan.Plan (from tempo.plan.plan), "
                        f"got {type(plan).__name__}")
    if not callable(model_factory) or isinstance(model_factory, nn.Module):
        raise PlanError(f"confirm: argument 'model_factory' must be a function that builds a fresh model, "
                        f"got {type(model_factory).__name__}")
    if measure is None and batch_factory is None:
        raise PlanError("confirm: argument 'batch_factory' is needed (tokens -> a batch of at most that many real "
                        "tokens) unless a 'measure' is given")
    if measure is not None and batch_factory is not None:
        raise PlanError("confirm: give 'batch_factory' (the default measure builds the batches) or 'measure', not both")
    if measure is not None and not callable(measure):
        raise PlanError(f"confirm: argument 'measure' must be callable, got {type(measure).__name__}")
    if isinstance(scales, (int, float)) or any(isinstance(s, bool) or not isinstance(s, (int, float))
                                               or not s > 0 or s == 1 for s in scales):
        raise PlanError(f"confirm: argument 'scales' must be positive factors other than 1, such as (0.85, 1.15), "
                        f"got {scales!r}")
    if counted is not None and (not isinstance(counted, Counted) or counted.blocks != len(plan.recompute)
                                or counted.model != plan.model):
        raise PlanError("confirm: argument 'counted' must be the tempo.plan.count(...) this plan was chosen from "
                        f"(a {plan.model} of {len(plan.recompute)} blocks)")
    if probe_timeout is not None and not probe_timeout > 0:
        raise PlanError(f"confirm: argument 'probe_timeout' must be > 0 seconds or None, got {probe_timeout!r}")
    if measure is None:
        measure = DefaultMeasure(batch_factory, memory_budget=plan.budget, device=_device_for(plan, device),
                                 precision=plan.precision, optimizer=plan.optimizer,
                                 steps=3 if steps is None else steps, warmup=1 if warmup is None else warmup)
    else:
        for name, value in (("device", device), ("steps", steps), ("warmup", warmup)):
            if value is not None:
                raise PlanError(f"confirm: argument '{name}' is for the default measure; a given 'measure' runs as "
                                f"it runs")
    measured_on = str(getattr(measure, "device", "the given measure"))
    counter = getattr(measure, "memory_counter", "the measure's")
    result = Confirmation(plan, measured_on, counter, candidates_of(plan, neighbours, scales, counted))
    probe = _Prober(measure, isolate, probe_timeout)
    say = progress or (lambda line: None)
    for i, row in enumerate(result.rows, 1):
        where = f"{row.label} ({row.summary()}, {row.tokens} tokens)"
        say(f"measuring {where} on {measured_on} ({i}/{len(result.rows)})")
        try:
            raw = probe(PlannedModel(plan, row.recompute, model_factory), row.tokens)
        except ProbeError as exc:
            raise ConfirmError(f"confirm: the probe of {where} failed: {exc.message}", result) from exc
        except Exception as exc:
            raise ConfirmError(f"confirm: the probe of {where} failed: {type(exc).__name__}: {exc}", result) from exc
        measured = _as_measurement(raw, where)
        row.fits, row.tokens_per_second = measured.fits, measured.tokens_per_second
        row.memory_bytes, row.real_tokens = measured.memory_bytes, measured.real_tokens
        logger.debug("confirm: %s: fits=%s, %.1f real tokens/s", where, row.fits, row.tokens_per_second)
    fitting = [row for row in result.rows if row.fits]
    if not fitting:
        raise ConfirmError(f"confirm: no candidate fits {format_bytes(plan.budget)} on {measured_on}, not even "
                           f"{min(r.tokens for r in result.rows)} tokens; the plan overestimates what fits here "
                           f"(re-plan with a smaller budget):\n{result.format()}", result)
    result.choice = max(fitting, key=lambda row: row.tokens_per_second)  # ties: the earlier row (the plan first)
    if not result.rows[0].fits:
        logger.warning("confirm: the plan itself (%d tokens) does not fit %s on %s; chose %s instead",
                       plan.tokens_per_step, format_bytes(plan.budget), measured_on, result.choice.label)
    return result


def _device_for(plan: Plan, device: Union[str, torch.device, None]) -> torch.device:
    """Where the default measure runs: the kind of device the plan is for (a GPU's or the CPU's)."""
    wanted = "cuda" if plan.device.semantics == "cuda" else "cpu"
    if device is None:
        if wanted == "cuda" and not torch.cuda.is_available():
            raise PlanError(f"confirm: the plan is for {plan.device.name}, which confirm measures on a CUDA GPU, and "
                            f"none is visible; plan with device='cpu' to confirm on the CPU")
        return torch.device(wanted)
    chosen = torch.device(device)
    if chosen.type != wanted:
        raise PlanError(f"confirm: argument 'device' is {str(chosen)!r} but the plan is for {plan.device.name} "
                        f"({wanted}); plan for the device you measure on")
    return chosen


__all__ = ["ConfirmError", "Confirmation", "DefaultMeasure", "MeasuredCandidate", "Measurement", "PlannedModel",
           "candidates_of", "confirm", "fixed_length_batches", "optimizer_factory", "probe_pickles",
           "run_probe_isolated"]
