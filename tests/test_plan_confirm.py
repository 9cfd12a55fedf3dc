"""tempo.plan.confirm: the plan and its neighbours measured, the fastest that fits kept (issue 32.5).

The choice against a stand-in measure (deterministic fits and tokens/s per candidate); the default
measure (the trainers' step, the live storages' peak on the CPU) end to end on a tiny BERT; probes in a
process of their own (every OOM form is "does not fit", crashes name the candidate). Timings are
never asserted: the choice is checked against the measured values it was made from.
"""

import dataclasses
import functools
import logging
import math

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import tempo.plan as tp  # noqa: E402
from tempo.integrations.patch import tempo_patched  # noqa: E402
from tempo.plan.confirm import (ConfirmError, DefaultMeasure, Measurement, _loss, candidates_of,  # noqa: E402
                                fixed_length_batches, optimizer_factory, run_probe_isolated)
from tempo.integrations.recompute import recompute_of, transformer_blocks  # noqa: E402
from tempo.train.max_batch import ProbeError  # noqa: E402

SEQ = 32
CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
              max_position_embeddings=64)


def tiny_bert() -> nn.Module:
    """A 2-layer BERT with h = 32 (module level: a probe process can pickle it)."""
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(**CONFIG))


def sequences(n: int) -> dict:
    """n sequences of a masked LM's data: ~15 % of positions labelled, as a collator gives them and
    the plan assumes (tempo.plan.probe.masked_lm_labels)."""
    from tempo.plan.probe import masked_lm_labels

    ids = torch.randint(1, CONFIG["vocab_size"], (n, SEQ), generator=torch.Generator().manual_seed(n))
    return {"input_ids": ids, "labels": masked_lm_labels(ids)}


@pytest.fixture(scope="module")
def counted():
    """The tiny BERT counted for an H100 (projections exist), once for the module."""
    return tp.count(tiny_bert(), lengths=SEQ, device="h100", precision="bf16")


@pytest.fixture(scope="module")
def plan(counted):
    """A plan whose recompute has a neighbour on each side: the middle of the planner's candidates at
    72 MiB, as ``choose`` returns a plan (its tokens, projection and peak)."""
    planned = tp.choose(counted, "72MiB")
    assert len(planned.candidates) == 5
    middle = planned.candidates[2]
    return dataclasses.replace(planned, recompute=list(middle.recompute), tokens_per_step=middle.tokens,
                               step_seconds=middle.step_seconds, peak=middle.peak)


class StandIn:
    """A measure that measures nothing: per (recompute, tokens), fits and tokens/s from ``outcomes``
    ((fits, rate) or "oom" / "crash"). Module level and picklable: isolated probes run it too."""

    memory_counter = "stand-in bytes"

    def __init__(self, outcomes: dict, device: str = "cpu"):
        self.outcomes, self.device = outcomes, torch.device(device)

    def __call__(self, model_factory, tokens):
        outcome = self.outcomes[(model_factory.recompute, tokens)]
        if outcome == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if outcome == "crash":
            raise ValueError("a bug in the model")
        fits, rate = outcome
        return fits, rate, 1000 * tokens


def outcomes_for(plan, counted, by_label: dict) -> dict:
    return {(row.recompute, row.tokens): by_label[row.label] for row in candidates_of(plan, counted=counted)}


# -- the candidates --------------------------------------------------------------------------------
def test_the_candidates_are_the_plan_its_token_neighbours_and_its_recompute_neighbours(plan, counted):
    rows = candidates_of(plan, counted=counted)
    assert [r.label for r in rows] == ["the plan", "0.85x tokens", "1.15x tokens", "previous recompute",
                                       "next recompute"]
    t, recompute = plan.tokens_per_step, tuple(plan.recompute)
    first = rows[0]
    assert (first.recompute, first.tokens, first.projected_seconds, first.predicted_peak) == (
        recompute, t, plan.step_seconds, plan.peak_bytes)
    # Rounded as the plan rounds (real tokens in multiples of 8): down below 1x, up above it.
    assert rows[1].tokens == math.floor(t * 0.85 / 8) * 8 and rows[2].tokens == math.ceil(t * 1.15 / 8) * 8
    for row in rows[1:3]:
        assert row.recompute == recompute
        assert row.projected_seconds == counted.step_seconds(recompute, row.tokens)
        assert row.predicted_peak == counted.peak_at(recompute, row.tokens).total
    # The plan holds the most tokens its recompute fits: more do not fit, fewer do.
    assert rows[1].predicted_fits is True and rows[2].predicted_fits is False
    before, after = plan.candidates[1], plan.candidates[3]
    assert (rows[3].recompute, rows[3].tokens, rows[3].projected_seconds) == (before.recompute, before.tokens,
                                                                              before.step_seconds)
    assert (rows[4].recompute, rows[4].tokens, rows[4].predicted_peak) == (after.recompute, after.tokens,
                                                                           after.peak.total)
    # Without the Counted the scaled neighbours have no projection; neighbours=False: the plan alone.
    bare = candidates_of(plan)
    assert [r.tokens for r in bare] == [r.tokens for r in rows]
    assert bare[1].projected_seconds is None and bare[1].predicted_peak is None and bare[1].predicted_fits is None
    assert [r.label for r in candidates_of(plan, neighbours=False)] == ["the plan"]


def test_a_padded_plan_moves_in_whole_sequences_and_a_neighbour_predicted_not_to_fit_is_checked(plan, counted):
    padded = dataclasses.replace(plan, unpadding=False, seq_len=SEQ, tokens_per_step=40 * SEQ)
    rows = candidates_of(padded, scales=(0.85, 1.15, 0.99))
    assert [r.tokens for r in rows[:4]] == [40 * SEQ, 34 * SEQ, 46 * SEQ, 39 * SEQ]  # 0.99x: one sequence less
    # The planner's first candidate (no recompute) as the previous one, found not to fit at all:
    # measured at the plan's tokens, which checks that prediction.
    nothing_fits = dataclasses.replace(plan.candidates[1], tokens=0, peak=None, step_seconds=None)
    shifted = dataclasses.replace(plan, candidates=[plan.candidates[0], nothing_fits, *plan.candidates[2:]])
    row = next(r for r in candidates_of(shifted, counted=counted) if r.label.startswith("previous"))
    assert row.label == "previous recompute (predicted not to fit)"
    assert row.tokens == plan.tokens_per_step and row.predicted_fits is False
    assert row.predicted_peak == counted.peak_at(nothing_fits.recompute, plan.tokens_per_step).total


def test_a_recompute_the_planner_did_not_try_has_no_recompute_neighbours(plan, caplog):
    elsewhere = dataclasses.replace(plan, recompute=["full", "none"])
    with caplog.at_level(logging.WARNING, logger="tempo.plan.confirm"):
        rows = candidates_of(elsewhere)
    assert [r.label for r in rows] == ["the plan", "0.85x tokens", "1.15x tokens"]
    assert any("not among plan.candidates" in m for m in caplog.messages)


# -- the choice ------------------------------------------------------------------------------------
def test_the_choice_is_the_fastest_measured_candidate_that_fits(plan, counted):
    # 1.15x tokens would be fastest but does not fit; of the rest, the next recompute is fastest.
    measure = StandIn(outcomes_for(plan, counted, {
        "the plan": (True, 900.0), "0.85x tokens": (True, 800.0), "1.15x tokens": (False, 0.0),
        "previous recompute": (True, 850.0), "next recompute": (True, 950.0)}))
    lines = []
    confirmation = tp.confirm(plan, tiny_bert, measure=measure, counted=counted, progress=lines.append)
    chosen = confirmation.choice
    assert chosen.label == "next recompute" and not confirmation.confirmed
    assert confirmation.recompute == list(plan.candidates[3].recompute)
    assert confirmation.tokens_per_step == plan.candidates[3].tokens and confirmation.tokens_per_second == 950.0
    # Projections beside measurements, for every row.
    for row, expected in zip(confirmation.rows, candidates_of(plan, counted=counted)):
        assert (row.projected_seconds, row.predicted_peak) == (expected.projected_seconds, expected.predicted_peak)
        assert row.memory_bytes == 1000 * row.tokens and row.fits is (row.label != "1.15x tokens")
    assert confirmation.rows[0].projected_tokens_per_second == pytest.approx(plan.tokens_per_second)
    assert len(lines) == 5 and lines[0].startswith("measuring the plan")
    text = str(confirmation)
    assert "->next recompute" in text and "chosen: next recompute" in text and "stand-in bytes" in text
    # Applied: the plan's Tempo and the chosen recompute.
    model = confirmation.apply(tiny_bert())
    assert [recompute_of(b) for b in transformer_blocks(model)] == confirmation.recompute
    assert tempo_patched(model)["InplaceGelu"] == 3
    # When the plan itself is the fastest that fits, it is confirmed.
    measure.outcomes = outcomes_for(plan, counted, {
        "the plan": (True, 990.0), "0.85x tokens": (True, 800.0), "1.15x tokens": (False, 0.0),
        "previous recompute": (True, 850.0), "next recompute": (True, 950.0)})
    assert tp.confirm(plan, tiny_bert, measure=measure, counted=counted).confirmed


def test_when_nothing_fits_it_says_so_with_the_measurements(plan, counted, caplog):
    none = {label: (False, 0.0) for label in ("the plan", "0.85x tokens", "1.15x tokens", "previous recompute",
                                              "next recompute")}
    with pytest.raises(ConfirmError, match="no candidate fits 72.00 MiB on cpu") as caught:
        tp.confirm(plan, tiny_bert, measure=StandIn(outcomes_for(plan, counted, none)))
    confirmation = caught.value.confirmation
    assert len(confirmation.rows) == 5 and all(row.fits is False for row in confirmation.rows)
    with pytest.raises(ConfirmError, match="nothing to apply"):
        confirmation.apply(tiny_bert())
    # The plan alone not fitting while a neighbour does: chosen, and said.
    smaller = dict(none, **{"0.85x tokens": (True, 700.0)})
    with caplog.at_level(logging.WARNING, logger="tempo.plan.confirm"):
        confirmation = tp.confirm(plan, tiny_bert, measure=StandIn(outcomes_for(plan, counted, smaller)))
    assert confirmation.choice.label == "0.85x tokens"
    assert any("the plan itself" in m and "does not fit" in m for m in caplog.messages)


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
def test_an_oom_in_a_probe_is_does_not_fit(plan, counted, isolate):
    measure = StandIn(outcomes_for(plan, counted, {
        "the plan": "oom", "0.85x tokens": (True, 800.0), "1.15x tokens": "oom",
        "previous recompute": (True, 850.0), "next recompute": (True, 820.0)}))
    confirmation = tp.confirm(plan, tiny_bert, measure=measure, isolate=isolate, probe_timeout=60.0)
    assert [row.fits for row in confirmation.rows] == [False, True, False, True, True]
    assert confirmation.rows[0].tokens_per_second == 0.0 and confirmation.rows[0].memory_bytes is None
    assert confirmation.choice.label == "previous recompute"


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
def test_a_probe_that_crashes_names_the_candidate(plan, counted, isolate):
    measure = StandIn(outcomes_for(plan, counted, {
        "the plan": (True, 900.0), "0.85x tokens": (True, 800.0), "1.15x tokens": (False, 0.0),
        "previous recompute": "crash", "next recompute": (True, 820.0)}))
    before = plan.candidates[1]
    where = f"previous recompute ({before.summary()}, {before.tokens} tokens)"
    with pytest.raises(ConfirmError, match=rf"the probe of {where.replace('(', '[(]').replace(')', '[)]')} failed: "
                                           r"ValueError: a bug in the model") as caught:
        tp.confirm(plan, tiny_bert, measure=measure, counted=counted, isolate=isolate, probe_timeout=60.0)
    if isolate:
        assert "Traceback" in str(caught.value)  # the probe's own traceback comes back
    measured = [row.fits for row in caught.value.confirmation.rows]
    assert measured == [True, True, False, None, None]  # what ran before the crash is kept


# -- bad arguments ---------------------------------------------------------------------------------
def test_bad_arguments_are_named(plan, counted):
    measure = StandIn({})
    batches = fixed_length_batches(sequences, SEQ)
    cases = [
        (dict(plan="24GiB", model_factory=tiny_bert, measure=measure), "argument 'plan' must be a tempo.plan.Plan"),
        (dict(model_factory=tiny_bert(), measure=measure), "argument 'model_factory' must be a function"),
        (dict(model_factory=tiny_bert), "argument 'batch_factory' is needed"),
        (dict(model_factory=tiny_bert, batch_factory=batches, measure=measure), "or 'measure', not both"),
        (dict(model_factory=tiny_bert, measure="fast"), "argument 'measure' must be callable"),
        (dict(model_factory=tiny_bert, measure=measure, scales=(0.85, 1.0)), "argument 'scales'"),
        (dict(model_factory=tiny_bert, measure=measure, scales=0.85), "argument 'scales'"),
        (dict(model_factory=tiny_bert, measure=measure, scales=(-1.0,)), "argument 'scales'"),
        (dict(model_factory=tiny_bert, measure=measure, counted="yes"), "argument 'counted' must be the"),
        (dict(model_factory=tiny_bert, measure=measure, probe_timeout=0), "argument 'probe_timeout'"),
        (dict(model_factory=tiny_bert, measure=measure, device="cpu"), "argument 'device' is for the default"),
        (dict(model_factory=tiny_bert, measure=measure, steps=5), "argument 'steps' is for the default"),
        (dict(model_factory=tiny_bert, measure=measure, warmup=2), "argument 'warmup' is for the default"),
        (dict(model_factory=tiny_bert, batch_factory=batches, device="cpu"),
         "argument 'device' is 'cpu' but the plan is for H100"),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(model_factory=tiny_bert, batch_factory=batches), "measures on a CUDA GPU, and none"))
    for kwargs, message in cases:
        with pytest.raises(tp.PlanError, match=message):
            tp.confirm(kwargs.pop("plan", plan), **kwargs)
    bigger = dataclasses.replace(plan, recompute=["none"] * 3)  # not the model the Counted counted
    with pytest.raises(tp.PlanError, match="argument 'counted' must be the"):
        tp.confirm(bigger, tiny_bert, measure=measure, counted=counted)
    with pytest.raises(ConfirmError, match=r"argument 'measure' must return \(fits, tokens/s"):
        tp.confirm(plan, tiny_bert, measure=lambda factory, tokens: 3.0, neighbours=False)
    with pytest.raises(TypeError, match="argument 'batch_factory' must be callable"):
        DefaultMeasure(None)
    with pytest.raises(ValueError, match="argument 'steps'"):
        DefaultMeasure(batches, steps=0)
    with pytest.raises(ValueError, match="argument 'warmup'"):
        DefaultMeasure(batches, warmup=0)
    with pytest.raises(ValueError, match="argument 'precision' must be one of fp32, tf32, bf16, fp16"):
        DefaultMeasure(batches, precision="int8")
    with pytest.raises(tp.PlanError, match="argument 'budget'"):
        DefaultMeasure(batches, memory_budget="lots")
    with pytest.raises(tp.PlanError, match="optimizer 'adam' is not one of"):
        optimizer_factory("adam", "cpu")
    with pytest.raises(ValueError, match="argument 'seq_len'"):
        fixed_length_batches(sequences, 0)
    with pytest.raises(TypeError, match="argument 'batch_of_sequences'"):
        fixed_length_batches(None, SEQ)
    with pytest.raises(ValueError, match="31 tokens hold no whole sequence of 32 tokens"):
        batches(31)


def test_fixed_length_batches_and_a_batch_factory_that_gives_too_many_tokens():
    assert sequences(3)["input_ids"].shape == (3, SEQ)
    assert fixed_length_batches(sequences, SEQ)(100)["input_ids"].shape == (3, SEQ)  # 100 // 32
    measure = DefaultMeasure(functools.partial(_too_many, SEQ), device="cpu", steps=1)
    with pytest.raises(ValueError, match=r"batch_factory\(64\) returned a batch of 96 real tokens"):
        measure(tiny_bert, 64)


def _too_many(seq_len, tokens):
    return sequences(tokens // seq_len + 1)


# -- the default measure, end to end on the CPU --------------------------------------------------------
@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_default_measure_confirms_a_cpu_plan_end_to_end(one_thread):
    """The tiny BERT planned for the CPU at 8 MiB, its candidates trained for real: the live storages' peak
    against the budget, real tokens/s, the fastest that fits applied."""
    on_cpu = tp.count(tiny_bert(), lengths=SEQ, device="cpu", precision="fp32")
    plan = tp.choose(on_cpu, "8MiB")
    confirmation = tp.confirm(plan, tiny_bert, fixed_length_batches(sequences, SEQ), counted=on_cpu, steps=2)
    rows = confirmation.rows
    assert [(r.label, r.recompute, r.tokens) for r in rows] == [
        (r.label, r.recompute, r.tokens) for r in candidates_of(plan, counted=on_cpu)]
    assert confirmation.device == "cpu" and confirmation.memory_counter == "live storages peak"
    for row in rows:
        assert row.real_tokens == row.tokens // SEQ * SEQ  # whole sequences, every token real
        assert row.memory_bytes > 0 and row.fits == (row.memory_bytes <= plan.budget)
        assert (row.tokens_per_second > 0) == row.fits  # a CPU probe over the budget is not timed
    # The plan fits, and its predicted peak is never below what the real step allocated.
    assert rows[0].fits and rows[0].memory_bytes <= plan.peak_bytes
    fitting = [r for r in rows if r.fits]
    assert confirmation.choice is max(fitting, key=lambda r: r.tokens_per_second)
    model = confirmation.apply(tiny_bert())
    assert [recompute_of(b) for b in transformer_blocks(model)] == confirmation.recompute
    ids = torch.randint(1, CONFIG["vocab_size"], (2, SEQ))
    model.train()(input_ids=ids, labels=ids).loss.backward()


# -- the default measure's pieces (from AutoTempo, which it replaced) -----------------------------------
def test_every_batch_form_reaches_the_model_as_the_trainers_pass_it():
    """A dict and transformers' BatchEncoding (a Mapping, not a dict) as keywords; a tuple or list
    positionally; one tensor alone."""

    class Recorder(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args, kwargs

    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    encoding = transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask})
    assert not isinstance(encoding, dict)
    for batch in ({"input_ids": ids, "attention_mask": mask}, encoding):
        args, kwargs = _loss(Recorder(), batch)
        assert args == () and kwargs.keys() == {"input_ids", "attention_mask"} and kwargs["input_ids"] is ids
    for batch in ((ids, mask), [ids, mask]):
        args, kwargs = _loss(Recorder(), batch)
        assert kwargs == {} and args[0] is ids and args[1] is mask
    args, kwargs = _loss(Recorder(), ids)
    assert kwargs == {} and len(args) == 1 and args[0] is ids


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.act(self.fc(x)))


class TinyStack(nn.Module):
    def __init__(self, layers=2, width=8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def small_stack() -> TinyStack:
    torch.manual_seed(0)
    return TinyStack()


OOM_FORMS = {
    "torch.OutOfMemoryError": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "cuBLAS workspace": lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    "CUDA error": lambda: RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
}
BUILT: list[int] = []  # token counts TokensUpTo built batches for, in this process


class TokensUpTo:
    """A batch factory (module level, so a probe process can pickle it) of rows of 8 values (every
    value a real token) that fails above ``limit`` tokens: raising ``error`` (a key of OOM_FORMS, or
    "bug"), or, as the probe process, killing itself, exiting without a result or hanging."""

    def __init__(self, limit: int, error: str):
        self.limit, self.error = limit, error

    def __call__(self, tokens: int) -> torch.Tensor:
        BUILT.append(tokens)  # in the process that measures
        if tokens > self.limit:
            if self.error in OOM_FORMS:
                raise OOM_FORMS[self.error]()
            if self.error == "sigkill":
                import os
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            if self.error == "exit":
                import os

                os._exit(3)
            if self.error == "hang":
                import time

                time.sleep(60)
            raise ValueError(f"a bug at {tokens} tokens")
        return torch.randn(tokens // 8, 8, generator=torch.Generator().manual_seed(tokens))


def cpu_measure(limit: int, error: str) -> DefaultMeasure:
    return DefaultMeasure(TokensUpTo(limit, error), device="cpu", steps=1)


@pytest.mark.parametrize("form", list(OOM_FORMS))
def test_every_oom_form_is_does_not_fit(form):
    measure = cpu_measure(40, form)
    fits = measure(small_stack, 40)
    assert fits.fits and fits.real_tokens == 40 and fits.tokens_per_second > 0 and fits.memory_bytes > 0
    assert measure(small_stack, 48) == Measurement(False, 0.0, None, None)
    isolated = run_probe_isolated(measure, small_stack, 48, timeout=60.0)
    assert tuple(isolated) == (False, 0.0, None, None)


def test_a_failure_that_is_not_memory_is_raised_naming_the_tokens():
    with pytest.raises(ValueError, match="a bug at 48 tokens"):
        cpu_measure(40, "bug")(small_stack, 48)
    with pytest.raises(ProbeError, match="48: ValueError: a bug at 48 tokens") as caught:
        run_probe_isolated(cpu_measure(40, "bug"), small_stack, 48, timeout=60.0)
    assert "Traceback" in caught.value.message  # the probe's own traceback comes back


def test_an_isolated_probe_matches_in_process_and_runs_elsewhere():
    BUILT.clear()
    here = cpu_measure(64, "bug")(small_stack, 32)
    assert BUILT == [32]
    there = run_probe_isolated(cpu_measure(64, "bug"), small_stack, 32, timeout=60.0)
    assert BUILT == [32]  # the isolated probe built its batch in its own process
    assert there[0] is True and here.fits is True and there[2] == here.memory_bytes > 0  # the same peak, made there


@pytest.mark.parametrize("how", ["sigkill", "exit", "hang"])
def test_a_probe_process_that_dies_or_hangs(how, caplog):
    measure = cpu_measure(16, how)
    assert run_probe_isolated(measure, small_stack, 16, timeout=60.0)[0] is True
    if how == "sigkill":  # what the kernel's OOM killer sends: does not fit
        with caplog.at_level(logging.WARNING, logger="tempo.plan.confirm"):
            assert run_probe_isolated(measure, small_stack, 32, timeout=60.0) == (False, 0.0, None)
        assert any("SIGKILL" in m for m in caplog.messages)
        return
    message = "exit code 3 without a result" if how == "exit" else "ran longer than 1.0 s and was killed"
    with pytest.raises(ProbeError, match=message):
        run_probe_isolated(measure, small_stack, 32, timeout=60.0 if how == "exit" else 1.0)


def test_factories_that_do_not_pickle(plan, counted, caplog):
    """Probe processes get their factories pickled: isolation asked for refuses a lambda, naming what
    to pass instead; isolation by default (a measure on CUDA) measures it in this process, said once."""
    with pytest.raises(ValueError, match=r"module-level functions .* or isolate=False"):
        run_probe_isolated(cpu_measure(16, "bug"), lambda: small_stack(), 16)
    fits = {label: (True, 1.0) for label in ("the plan", "0.85x tokens", "1.15x tokens", "previous recompute",
                                               "next recompute")}
    with pytest.raises(ConfirmError, match="the probe of the plan .* cannot be sent to a process of its own"):
        tp.confirm(plan, lambda: tiny_bert(), measure=StandIn(outcomes_for(plan, counted, fits)), isolate=True)
    on_cuda = StandIn(outcomes_for(plan, counted, fits), device="cuda")  # isolated by default
    with caplog.at_level(logging.WARNING, logger="tempo.plan.confirm"):
        confirmation = tp.confirm(plan, lambda: tiny_bert(), measure=on_cuda)
    assert all(row.fits for row in confirmation.rows)
    assert sum("probes run in this process" in m for m in caplog.messages) == 1
