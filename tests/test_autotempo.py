"""AutoTempo policies: the decision logic against deterministic fake measurements, and one small
real run on the CPU with a memory budget (timings are never asserted)."""

import logging
import sys

import pytest
import torch
from torch import nn

from tempo.integrations.autotempo import (AutoTempoResult, apply_choice, DefaultMeasure, TempoChoice, auto_tempo, default_candidates,
                             transformer_blocks)
from tempo.utils import parse_bytes
from tempo.integrations.patch import tempo_patched

GELU_LN = ("gelu", "layernorm")


@pytest.fixture(autouse=True)
def inplace_gelu_module(monkeypatch):
    """The decision logic only counts replaced modules: while tempo.inplace_gelu is still being
    written, a stand-in named InplaceGelu (plain exact GELU) lets these tests run."""
    try:
        import tempo.inplace_gelu  # noqa: F401
    except ImportError:
        import sys
        import types

        class InplaceGelu(nn.GELU):
            pass

        InplaceGelu.__module__ = "tempo.inplace_gelu"
        stand_in = types.ModuleType("tempo.inplace_gelu")
        stand_in.InplaceGelu = InplaceGelu
        monkeypatch.setitem(sys.modules, "tempo.inplace_gelu", stand_in)


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.act(self.fc(x)))


class TinyStack(nn.Module):
    def __init__(self, layers=4, width=8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head_norm = nn.LayerNorm(width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head_norm(x).pow(2).mean()


class FakeMeasure:
    """Memory and speed as functions of what is patched, so the decisions are deterministic.

    Each sample costs ``per_sample`` bytes, minus ``gelu_saving``/``ln_saving`` per replaced
    module. Speed rises linearly with the batch up to ``knee`` and is flat after it; each
    replaced module slows it by ``gelu_cost``/``ln_cost`` (a fraction).
    """

    def __init__(self, budget=100.0, per_sample=12.0, gelu_saving=1.0, ln_saving=0.5, knee=64,
                 gelu_cost=0.01, ln_cost=0.01):
        self.budget, self.per_sample, self.knee = budget, per_sample, knee
        self.savings = {"InplaceGelu": gelu_saving, "InplaceLayerNorm": ln_saving}
        self.costs = {"InplaceGelu": gelu_cost, "InplaceLayerNorm": ln_cost}
        self.calls = []

    def __call__(self, model_factory, batch_size):
        counts = tempo_patched(model_factory())
        self.calls.append((counts, batch_size))
        per_sample = self.per_sample - sum(self.savings.get(k, 0) * n for k, n in counts.items())
        used = per_sample * batch_size
        if used > self.budget:
            return False, 0.0, int(used)
        slowdown = sum(self.costs.get(k, 0) * n for k, n in counts.items())
        return True, 100.0 * min(batch_size, self.knee) * (1 - slowdown), int(used)


def test_fast_applies_tempo_when_throughput_still_rises(caplog):
    fake = FakeMeasure()  # plain: 12 B/sample -> batch 8 fits a budget of 100; tempo: 12 - 4 - 2.5 = 5.5 -> 18
    with caplog.at_level(logging.INFO, logger="tempo.integrations.autotempo"):
        result = auto_tempo(TinyStack, policy="fast", measure=fake, kinds=GELU_LN)
    assert isinstance(result, AutoTempoResult) and result.use_tempo
    assert result.choice == TempoChoice(gelu=True, layernorm=True)
    assert result.batch_size == 18
    plain = [m for m in result.measurements if m.choice.is_none]
    assert max(m.batch_size for m in plain if m.fits) == 8
    assert any("auto_tempo(fast): gelu+layernorm, batch 18" in m for m in caplog.messages)
    assert "batch 8 -> 18" in result.reason
    assert "-> gelu+layernorm, batch 18" in result.format_table()
    model = result.apply(TinyStack())
    assert tempo_patched(model) == {"InplaceGelu": 4, "InplaceLayerNorm": 5, "attention": 0}


def test_fast_skips_tempo_when_throughput_has_flattened():
    fake = FakeMeasure(knee=1)  # flat from batch 1 on
    result = auto_tempo(TinyStack, policy="fast", measure=fake, kinds=GELU_LN)
    assert not result.use_tempo and result.batch_size == 8
    assert "flattened" in result.reason
    assert all(counts == {"attention": 0} for counts, _ in fake.calls)  # Tempo never measured


def test_fast_without_memory_pressure_or_without_a_larger_batch():
    roomy = auto_tempo(TinyStack, policy="fast", measure=FakeMeasure(budget=1e9), kinds=GELU_LN, max_batch=64)
    assert not roomy.use_tempo and roomy.batch_size == 64 and "never ran out" in roomy.reason
    useless = auto_tempo(TinyStack, policy="fast", measure=FakeMeasure(gelu_saving=0, ln_saving=0), kinds=GELU_LN)
    assert not useless.use_tempo and useless.batch_size == 8 and "does not fit a larger batch" in useless.reason


def test_fast_when_nothing_fits_without_tempo():
    result = auto_tempo(TinyStack, policy="fast", measure=FakeMeasure(budget=8), kinds=GELU_LN)
    assert result.use_tempo and result.batch_size == 1  # 5.5 bytes <= 8 < 12


def test_smart_prefers_partial_application_when_it_is_fastest():
    # Speed stops growing at batch 10 and LayerNorms are costly: patching the first 2 of 4 blocks
    # fits batch 10 (24 - 2 x 2.5 = 19 bytes/sample, budget 192) with the least overhead;
    # everywhere fits 16, but gains nothing past 10 and pays for 9 modules.
    fake = FakeMeasure(budget=192, per_sample=24, gelu_saving=0.5, ln_saving=2.0, knee=10,
                       gelu_cost=0.005, ln_cost=0.05)
    candidates = default_candidates(4, GELU_LN)
    assert [c.label for c in candidates] == [
        "no tempo", "gelu", "layernorm", "gelu+layernorm", "gelu+layernorm (first 1 layers)",
        "gelu+layernorm (first 2 layers)", "gelu+layernorm (first 3 layers)"]
    result = auto_tempo(TinyStack, policy="smart", measure=fake, kinds=GELU_LN)
    expected_rate = {}
    for m in result.measurements:
        if m.fits:
            expected_rate[m.choice] = max(expected_rate.get(m.choice, (0, 0)), (m.batch_size, m.samples_per_s))
    best = max(expected_rate.items(), key=lambda kv: kv[1][1])
    assert result.choice == best[0] == TempoChoice(gelu=True, layernorm=True, first_layers=2)
    assert result.batch_size == 10
    model = result.apply(TinyStack())
    assert type(model.blocks[1].norm).__name__ == "InplaceLayerNorm"
    assert type(model.blocks[2].norm) is nn.LayerNorm and type(model.head_norm) is nn.LayerNorm


def test_smart_keeps_no_tempo_when_nothing_beats_it():
    result = auto_tempo(TinyStack, policy="smart", measure=FakeMeasure(knee=1), kinds=GELU_LN)
    assert not result.use_tempo


def test_arguments_and_helpers():
    with pytest.raises(ValueError, match="policy"):
        auto_tempo(TinyStack, policy="slow", measure=FakeMeasure())
    with pytest.raises(ValueError, match="batch_factory"):
        auto_tempo(TinyStack)
    with pytest.raises(ValueError, match="kinds"):
        auto_tempo(TinyStack, measure=FakeMeasure(), kinds=("softmax",))
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("2MB") == 2_000_000 and parse_bytes(7) == 7
    assert len(transformer_blocks(TinyStack(layers=3))) == 3


def test_every_batch_form_reaches_the_model_as_the_trainers_pass_it():
    """A dict and transformers' BatchEncoding (a Mapping, not a dict) as keywords; a tuple or list
    positionally; one tensor alone."""
    from tempo.integrations.autotempo import _loss

    transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

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


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_real_run_on_cpu_with_a_budget(one_thread):
    """Tiny BERT, the default measure: the budget fits batch 8 only with Tempo."""
    transformers = pytest.importorskip("transformers")
    # Without the real InplaceGelu (being written), the run uses the other two kinds.
    real_gelu = getattr(sys.modules["tempo.inplace_gelu"], "__file__", None) is not None
    kinds = ("gelu", "layernorm", "attention") if real_gelu else ("layernorm", "attention")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100, attn_implementation="eager")

    def model_factory():
        torch.manual_seed(0)
        return transformers.BertForMaskedLM(config)

    def batch_factory(batch_size):
        ids = torch.randint(1, 100, (batch_size, 16), generator=torch.Generator().manual_seed(batch_size))
        return {"input_ids": ids, "labels": ids}

    # device="cpu": this test is about the CPU rule (fits = estimated bytes <= budget). Left to its
    # default, DefaultMeasure picks CUDA on a GPU machine, where "fits" is the allocator peak, which
    # is not the estimate the budget below is made of.
    probe = DefaultMeasure(batch_factory, steps=1, warmup=1, device="cpu")
    plain8 = probe.estimate(model_factory, 8)
    tempo8 = probe.estimate(lambda: apply_choice(TempoChoice.default(kinds), model_factory()), 8)
    assert tempo8.total < plain8.total and tempo8.weights == plain8.weights
    assert tempo8.optimizer_states == plain8.optimizer_states > 0

    measure = DefaultMeasure(batch_factory, memory_budget=tempo8.total, steps=1, warmup=1, device="cpu")
    # min_gain=-1: "rising" whatever the timings, so the outcome depends only on memory.
    result = auto_tempo(model_factory, policy="fast", measure=measure, max_batch=8, min_gain=-1.0, kinds=kinds)
    plain_max = max(m.batch_size for m in result.measurements if m.choice.is_none and m.fits)
    assert plain_max < 8
    assert result.choice == TempoChoice.default(kinds) and result.batch_size == 8
    assert all(m.memory_bytes is not None and (m.memory_bytes <= tempo8.total) == m.fits for m in result.measurements)
    assert result.samples_per_s > 0
    model = result.apply(model_factory())
    assert model.config._attn_implementation == "tempo_efficient"


# -- every OOM form is "does not fit"; probes in a process of their own (CUDA's default), simulated on the CPU --
from tempo.integrations.autotempo import run_probe_isolated  # noqa: E402
from tempo.train.max_batch import ProbeError, SearchError  # noqa: E402

OOM_FORMS = {
    "torch.OutOfMemoryError": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "cuBLAS workspace": lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    "CUDA error": lambda: RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
}


BUILT: list[int] = []  # batch sizes BatchesUpTo built in this process


class BatchesUpTo:
    """A batch factory (module level, so a spawned probe can pickle it) that fails above ``limit``:
    raising ``error`` (a key of OOM_FORMS, or "bug"), or, as the probe process, killing itself or
    exiting without a result."""

    def __init__(self, limit: int, error: str):
        self.limit, self.error = limit, error

    def __call__(self, batch_size: int) -> torch.Tensor:
        BUILT.append(batch_size)  # in the process that measures
        if batch_size > self.limit:
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
            raise ValueError(f"a bug at batch {batch_size}")
        return torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(batch_size))


def small_stack() -> TinyStack:
    torch.manual_seed(0)
    return TinyStack(layers=2)


def cpu_measure(limit: int, error: str, isolate: bool, **kwargs) -> DefaultMeasure:
    return DefaultMeasure(BatchesUpTo(limit, error), device="cpu", steps=1, warmup=1, isolate=isolate,
                          optimizer_factory=None, **kwargs)


@pytest.mark.parametrize("form", list(OOM_FORMS))
@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
def test_every_oom_form_is_does_not_fit(form, isolate):
    """The search goes on past an OOM of any form (max-batch's markers) and finds the largest batch."""
    measure = cpu_measure(5, form, isolate)
    # min_gain=inf: "flattened" whatever the timings, so only the search without Tempo runs.
    result = auto_tempo(small_stack, policy="fast", measure=measure, kinds=GELU_LN, max_batch=8,
                        min_gain=float("inf"))
    assert [(m.batch_size, m.fits) for m in result.measurements] == [
        (1, True), (2, True), (4, True), (8, False), (6, False), (5, True)]
    assert not result.use_tempo and result.batch_size == 5


def test_a_failure_that_is_not_memory_is_raised_naming_the_batch():
    with pytest.raises(ValueError, match="a bug at batch 8"):
        cpu_measure(5, "bug", isolate=False)(small_stack, 8)
    with pytest.raises(SearchError, match=r"batch 8: ValueError: a bug at batch 8") as caught:
        auto_tempo(small_stack, policy="fast", measure=cpu_measure(5, "bug", isolate=True), kinds=GELU_LN, max_batch=64)
    assert "Traceback" in caught.value.cause.message  # the probe's own traceback comes back
    assert [p.batch for p in caught.value.probes] == [1, 2, 4]


def test_isolated_probe_matches_in_process_and_runs_elsewhere():
    BUILT.clear()
    here = cpu_measure(64, "bug", isolate=False)(small_stack, 4)
    assert BUILT == [4]
    there = cpu_measure(64, "bug", isolate=True)(small_stack, 4)
    assert BUILT == [4]  # the isolated probe built its batch in its own process
    assert there[0] is True and here[0] is True and there[2] == here[2] > 0  # the same estimate, made there


@pytest.mark.parametrize("how,fits", [("sigkill", False), ("exit", None), ("hang", None)])
def test_a_probe_process_that_dies_or_hangs(how, fits, caplog):
    measure = cpu_measure(2, how, isolate=True, probe_timeout=20.0 if how != "hang" else 1.0)
    assert measure(small_stack, 2)[0] is True
    if fits is False:  # SIGKILL is what the kernel's OOM killer sends
        with caplog.at_level(logging.WARNING, logger="tempo.integrations.autotempo"):
            assert measure(small_stack, 4) == (False, 0.0, None)
        assert any("SIGKILL" in m for m in caplog.messages)
        return
    message = "exit code 3 without a result" if how == "exit" else "ran longer than 1.0 s and was killed"
    with pytest.raises(ProbeError, match=message):
        measure(small_stack, 4)


def test_factories_that_do_not_pickle():
    """Probe processes get their factories pickled: with isolation asked for, a lambda is refused
    naming what to pass instead; with isolation by default (CUDA's), it is measured in this process,
    said once."""
    measure = cpu_measure(2, "CUDA error", isolate=True)
    with pytest.raises(ValueError, match=r"module-level functions .* or DefaultMeasure\(isolate=False\)"):
        run_probe_isolated(measure.measure_here, lambda: small_stack(), 1)
    by_default = cpu_measure(2, "CUDA error", isolate=None)
    assert not by_default.isolate and by_default.isolate_by_default  # on the CPU; on CUDA it is on
    by_default.isolate = True  # as on CUDA
    with caplog_at_warning() as records:
        assert by_default(lambda: small_stack(), 1)[0] is True
        assert by_default(lambda: small_stack(), 4) == (False, 0.0, None)
    assert sum("probes run in this process" in r.getMessage() for r in records) == 1
    with pytest.raises(ValueError, match="probe_timeout"):
        cpu_measure(2, "bug", isolate=True, probe_timeout=0)


class caplog_at_warning:
    """The autotempo logger's WARNING records inside the block."""

    def __enter__(self):
        self.records, self.logger = [], logging.getLogger("tempo.integrations.autotempo")
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = self.records.append
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
