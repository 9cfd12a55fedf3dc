"""The one training step (tempo/train/step.py): what every caller runs, and its clock."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from tempo.bench.common import resolve_our_config
from tempo.bench.train_bench import TrainBenchConfig, run_train_bench, synthetic_batches
from tempo.bert.model import BertForPreTraining
from tempo.tasks.pretrain import pretraining_loss
from tempo.train.optim import Lamb, PolyWarmUpScheduler, bert_param_groups, make_optimizer
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
    step = TrainStep(model, opt, _mse, "fp32", torch.device("cpu"), scheduler=sched)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch()
    out = step([(x, torch.full_like(y, float("inf")))])  # non-finite loss -> non-finite gradients
    assert not out.stepped and step.skipped_steps == 1 and sched.last_epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    out = step([(x, y)])
    assert out.stepped and step.skipped_steps == 1 and sched.last_epoch == 1


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
