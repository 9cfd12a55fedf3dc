"""The one training step (tempo/train/step.py): what every caller runs, and its clock."""

from __future__ import annotations

import math

from collections.abc import Mapping

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tempo.bench.common import resolve_our_config
from tempo.bench.train_bench import TrainBenchConfig, run_train_bench, synthetic_batches
from tempo.bert.model import BertForPreTraining
from tempo.tasks.pretrain import pretraining_loss
from tempo.train.optim import Lamb, PolyWarmUpScheduler, bert_param_groups, make_optimizer
from tempo.train.runtime import NonFiniteError
from tempo.train.step import StepClock, TrainStep, default_excluded_steps


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _batch(n: int = 4, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 8, generator=g), scale * torch.randn(n, 1, generator=g)


def test_clipping_is_the_documented_global_norm_after_accumulation():
    model, reference = _mlp(), _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = [_batch(4, scale=100.0), _batch(6, scale=100.0)]
    out = TrainStep(model, opt, _mse, "fp32", torch.device("cpu"), max_grad_norm=0.5)(batches)

    # By hand: mean of the micro-batch losses, one backward each, clip the summed gradient, step.
    for b in batches:
        (_mse(reference, b) / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_opt.step()
    assert norm > 0.5  # the case exercises clipping
    assert out.stepped and out.samples == 10
    assert torch.allclose(out.loss, sum(_mse(_mlp(), b) for b in batches) / 2)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


def test_zero_max_grad_norm_means_no_clipping():
    model, reference = _mlp(), _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batch = _batch(4, scale=100.0)
    TrainStep(model, opt, _mse, "fp32", torch.device("cpu"), max_grad_norm=0)([batch])
    _mse(reference, batch).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_lamb_clips_inside_its_step_with_the_same_norm():
    model = _mlp()
    opt = Lamb(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    step = TrainStep(model, opt, _mse, "fp32", torch.device("cpu"), max_grad_norm=0.25)
    assert step.clip_in_optimizer and opt.max_grad_norm == 0.25
    assert TrainStep(_mlp(), Lamb(_mlp().parameters(), lr=1e-3), _mse, "fp32", torch.device("cpu"),
                     max_grad_norm=0).optimizer.max_grad_norm is None


def test_a_skipped_step_leaves_the_schedule_and_is_counted():
    model = _mlp()
    opt = Lamb(model.parameters(), lr=1e-3)
    sched = PolyWarmUpScheduler(opt, warmup=0.5, total_steps=10, base_lr=1e-3)
    logged = []
    step = TrainStep(model, opt, _mse, "fp32", torch.device("cpu"), scheduler=sched, on_nonfinite="skip",
                     log=logged.append)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch()
    out = step([(x, torch.full_like(y, float("inf")))])  # non-finite loss -> non-finite gradients
    assert not out.stepped and out.nonfinite and step.skipped_steps == 1 and sched.last_epoch == 0
    assert step.nonfinite_steps == 1 and len(logged) == 1 and "step 1" in logged[0] and "skipped" in logged[0]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    out = step([(x, y)])
    assert out.stepped and not out.nonfinite and step.skipped_steps == 1 and sched.last_epoch == 1


# -- the non-finite guard ------------------------------------------------------------------------
OPTIMIZERS = {
    "lamb": lambda params: Lamb(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _state_copy(opt):
    return {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for p, st in opt.state.items()}


def _same_state(a, b):
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) if torch.is_tensor(a[k][n])
                                           else a[k][n] == b[k][n] for n in a[k]) for k in a)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_nonfinite_loss_stops_by_default_and_changes_nothing(name, precision):
    model = _mlp()
    opt = OPTIMIZERS[name](model.parameters())
    sched = PolyWarmUpScheduler(opt, warmup=0.5, total_steps=10, base_lr=1e-3)
    step = TrainStep(model, opt, _mse, precision, torch.device("cpu"), scheduler=sched)
    step([_batch()])  # a good step first: optimizer state exists
    params = [p.detach().clone() for p in model.parameters()]
    state = _state_copy(opt)
    x, y = _batch()
    with pytest.raises(NonFiniteError, match=r"step 2 \(" + precision + r"\): non-finite loss or gradients: loss "
                                             r"(nan|inf).*the loss is not finite with every parameter finite.*"
                                             r"without applying this step \(pass --on_nonfinite skip"):
        step([(x, y), (x, torch.full_like(y, float("nan")))])  # the second micro-batch goes bad
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert _same_state(state, _state_copy(opt)) and sched.last_epoch == 1
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_skip_mode_matches_a_run_without_the_bad_step(name):
    runs = []
    for bad in (True, False):
        model = _mlp()
        opt = OPTIMIZERS[name](model.parameters())
        step = TrainStep(model, opt, _mse, "fp32", torch.device("cpu"), on_nonfinite="skip", log=lambda m: None)
        step([_batch(4)])
        if bad:
            x, y = _batch(6)
            assert step([(x, y * float("inf"))]).nonfinite
        step([_batch(8)])
        runs.append([p.detach().clone() for p in model.parameters()])
        assert step.nonfinite_steps == int(bad) == step.skipped_steps
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("name", ["lamb", "adamw"])
def test_a_nonfinite_gradient_is_named_by_parameter_and_group(name):
    model = _mlp()
    groups = [{"params": [model[0].weight, model[2].weight]}, {"params": [model[0].bias, model[2].bias]}]
    step = TrainStep(model, OPTIMIZERS[name](groups), _mse, "fp32", torch.device("cpu"))
    model[2].bias.register_hook(lambda g: g * float("inf"))  # finite loss, one bad gradient
    with pytest.raises(NonFiniteError, match=r"step 1 .*gradient norm (inf|nan).*first non-finite gradient: "
                                             r"2\.bias \(optimizer group 1; 1 of 4"):
        step([_batch()])


def test_a_nan_weight_is_named():
    model = _mlp()
    with torch.no_grad():
        model[2].weight[0, 3] = float("nan")
    step = TrainStep(model, Lamb(model.parameters(), lr=1e-3), _mse, "fp32", torch.device("cpu"), on_nonfinite="skip")
    with pytest.raises(NonFiniteError, match=r"parameters holding NaN/inf now, first: 2\.weight \(optimizer group 0; "
                                             r"1 of 4 tensors\).*skipping cannot help"):
        step([_batch()])  # skip mode stops too: every later step would be non-finite


def test_a_skipped_lamb_step_leaves_huge_weights_untouched():
    model = _mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e19)  # finite, but their squared norm is not in fp32
    step = TrainStep(model, Lamb(model.parameters(), lr=1e-3), _mse, "fp32", torch.device("cpu"),
                     on_nonfinite="skip", log=lambda m: None)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch()
    assert step([(x, y * float("nan"))]).nonfinite
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fp16_keeps_grad_scaler_skips_and_the_option_is_checked():
    model = _mlp()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse, "fp16", torch.device("cpu"))
    assert step.scaler is not None and not step.guard  # overflows are GradScaler's business in fp16
    with pytest.raises(ValueError, match="on_nonfinite"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse, "fp32", torch.device("cpu"),
                  on_nonfinite="ignore")


class _CountHostReads(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (.item(), bool(), int() of a tensor)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("clip", [1.0, 0])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_guard_reads_the_device_once_per_step(name, clip):
    """One host read per step outside the optimizer's own step() (torch's AdamW/SGD read their CPU
    step counters there: no device sync on a GPU, where those counters stay on the host)."""
    model = _mlp()
    opt = OPTIMIZERS[name](model.parameters())
    step = TrainStep(model, opt, _mse, "fp32", torch.device("cpu"), max_grad_norm=clip, measure_activations=False)
    step([_batch()])  # the first step creates optimizer state
    inside = []
    optimizer_step = opt.step

    def counted_step(*args, **kwargs):
        before = counter.reads
        result = optimizer_step(*args, **kwargs)
        inside.append(counter.reads - before)
        return result

    opt.step = counted_step
    with _CountHostReads() as counter:
        step([_batch(4), _batch(6)])
    assert len(inside) == 1 and counter.reads - inside[0] == 1
    if name == "lamb":
        assert inside == [0]  # LAMB decides on the device; TrainStep's one read is its decision


def test_first_micro_batch_runs_under_the_ledger():
    model = _mlp()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse, "fp32", torch.device("cpu"))
    step([_batch()])
    assert step.activation_bytes is not None and step.activation_bytes > 0
    first = step.activation_bytes
    step([_batch(16)])
    assert step.activation_bytes == first  # measured once, on the first micro-batch


def test_benchmark_runs_the_trainers_step():
    """python -m tempo.bench train and run_pretraining's step give the same losses on the same batches."""
    cfg = TrainBenchConfig(model="bert_tiny", seq_len=32, batch_size=4, steps=3, warmup=1, precision="fp32",
                           optimizer="lamb", lr=1e-3, device="cpu", seed=7)
    bench = run_train_bench(cfg)

    torch.manual_seed(cfg.seed)
    model = BertForPreTraining(resolve_our_config("bert_tiny"), cfg.choice)
    optimizer = make_optimizer("lamb", bert_param_groups(model, weight_decay=0.01), lr=cfg.lr)
    step = TrainStep(model, optimizer, pretraining_loss, "fp32", torch.device("cpu"), max_grad_norm=1.0,
                     track=("mlm_loss",))
    batches = synthetic_batches(model.config.vocab_size, cfg.batch_size, cfg.seq_len, cfg.predictions,
                                torch.device("cpu"), count=2, seed=cfg.seed)
    model.train()
    # The benchmark runs two ledger forwards first (the batch, and its first sample): they draw
    # dropout masks, so draw the same ones here to keep the RNG streams aligned.
    pretraining_loss(model, batches[0])
    pretraining_loss(model, {k: v[:1] for k, v in batches[0].items()})
    for i in range(cfg.warmup + cfg.steps):
        out = step([batches[i % 2]])
    assert math.isclose(out.loss.item(), bench["final_loss"], rel_tol=1e-6)


def test_clock_leaves_out_warm_up_and_reports_nan_when_nothing_was_timed():
    clock = StepClock(torch.device("cpu"), excluded=default_excluded_steps(1))
    clock.begin_step()
    clock.end_step(8)
    clock.stop()
    assert clock.timed_steps == 0 and math.isnan(clock.samples_per_second)
    clock = StepClock(torch.device("cpu"), excluded=1, per_step=True)
    for _ in range(3):
        clock.begin_step()
        clock.end_step(8)
    clock.stop()
    assert clock.timed_steps == 2 and clock.timed_samples == 16 and clock.samples_per_second > 0
    assert len(clock.step_times) == 3


def test_an_empty_step_is_an_error():
    model = _mlp()
    with pytest.raises(ValueError, match="at least one micro-batch"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse, "fp32", torch.device("cpu"))([])


# -- what StepResult reports is what the optimizer did -------------------------------------------------------------
def test_step_result_lr_is_the_rate_the_optimizer_used():
    """Plain SGD (no momentum, no decay, no clipping) moves every parameter by -lr x grad: the rate read
    back from the move must be StepResult.lr, step after step of a schedule that changes it each step."""
    model, reference = _mlp(), _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    step = TrainStep(model, opt, _mse, "fp32", torch.device("cpu"), scheduler=sched, max_grad_norm=0,
                     measure_activations=False)
    for i in range(3):
        batch = _batch(4 + i)
        reference.load_state_dict(model.state_dict())
        reference.zero_grad(set_to_none=True)
        _mse(reference, batch).backward()
        before = [p.detach().clone() for p in model.parameters()]
        out = step([batch])
        assert out.stepped and out.lr == pytest.approx(0.1 / (i + 1))
        for b, p, q in zip(before, model.parameters(), reference.parameters()):
            # the move is what StepResult.lr predicts (the neighbouring steps' rates are 1.5-2x off)
            torch.testing.assert_close(b - p.detach(), out.lr * q.grad, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nonfinite_loss_with_finite_gradients_changes_nothing(name, precision, bad):
    """A loss term that does not depend on the parameters (a constant NaN/inf added to the loss)
    leaves every gradient finite: the step must still see the loss, stop (or skip) and change
    nothing -- the optimizer, its state, the weights and the schedule."""
    def poisoned(model, batch):
        return _mse(model, batch) + torch.tensor(bad)

    for mode in ("stop", "skip"):
        model = _mlp()
        opt = OPTIMIZERS[name](model.parameters())
        sched = PolyWarmUpScheduler(opt, warmup=0.5, total_steps=10, base_lr=1e-3)
        calls = {"n": 0}

        def loss_fn(model, batch):
            calls["n"] += 1
            return poisoned(model, batch) if calls["n"] > 1 else _mse(model, batch)

        step = TrainStep(model, opt, loss_fn, precision, torch.device("cpu"), scheduler=sched, on_nonfinite=mode,
                         log=lambda message: None)
        step([_batch()])  # a good step first: optimizer state exists
        params = [p.detach().clone() for p in model.parameters()]
        state = _state_copy(opt)
        if mode == "stop":
            with pytest.raises(NonFiniteError, match=r"step 2 .*loss (nan|inf).*the loss is not finite with every "
                                                     r"parameter finite"):
                step([_batch()])
        else:
            out = step([_batch()])
            assert out.nonfinite and not out.stepped and step.nonfinite_steps == 1
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters())), mode
        assert _same_state(state, _state_copy(opt)) and sched.last_epoch == 1, mode


# ---------------------------------------------------------------------------------------------
# Real tokens and batch size, counted exactly for every batch form a user passes
# ---------------------------------------------------------------------------------------------
def _mask_and_ids():
    ids = torch.arange(1, 13).view(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    return ids, mask  # 7 real tokens of 12


def test_the_loss_of_every_output_form():
    """What a model or loss function returns: a scalar, an output with .loss, a tuple whose first
    item is the loss, or a per-sample loss vector (averaged, as a reduction='mean' loss is)."""
    from types import SimpleNamespace

    from tempo.train.step import _loss_of

    per_sample = torch.tensor([1.0, 3.0, 8.0])
    assert float(_loss_of(per_sample)) == 4.0
    assert float(_loss_of(torch.tensor(2.5))) == 2.5
    assert float(_loss_of(SimpleNamespace(loss=torch.tensor(1.5)))) == 1.5
    assert float(_loss_of((per_sample, "logits"))) == 4.0


@pytest.mark.parametrize("form", ["dle-dict", "hf-dict", "batch-encoding", "bare-tensor", "tuple", "list",
                                  "strings-first"])
def test_real_tokens_and_batch_size_are_exact_for_every_batch_form(form):
    from tempo.train.step import _batch_size, _real_tokens, to_device

    ids, mask = _mask_and_ids()
    if form == "dle-dict":
        batch, real = {"input_ids": ids, "input_mask": mask, "segment_ids": torch.zeros_like(ids)}, 7
    elif form == "hf-dict":
        batch, real = {"input_ids": ids, "attention_mask": mask, "labels": ids}, 7
    elif form == "batch-encoding":
        transformers = pytest.importorskip("transformers")
        batch, real = transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask}), 7
    elif form == "bare-tensor":
        batch, real = ids, 12  # no mask to read: every token counts
    elif form == "tuple":
        batch, real = (ids, mask), 12
    elif form == "list":
        batch, real = [ids, torch.zeros_like(ids)], 12
    else:  # a collator that passes the examples' ids along (strings), before the tensors; no mask
        batch, real = {"id": ["a", "b", "c"], "input_ids": ids}, 12
    assert _real_tokens(batch) == real
    assert _batch_size(batch) == 3
    moved = to_device(batch, torch.device("meta"))  # every tensor moves, whatever holds it
    values = [moved] if isinstance(moved, torch.Tensor) else list(moved.values() if isinstance(moved, Mapping) else moved)
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert tensors[0].shape == ids.shape
