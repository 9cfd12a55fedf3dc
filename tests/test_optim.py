import io
import math

import pytest
import torch
from torch import nn

from tempo.train.optim import (
    Lamb,
    LinearWarmUpScheduler,
    PolyWarmUpScheduler,
    bert_param_groups,
    make_optimizer,
)

BETAS = (0.9, 0.999)
EPS = 1e-6


def reference_lamb_step(groups, grads, states, *, max_grad_norm, grad_averaging=True, use_nvlamb=False):
    """Plain per-tensor LAMB (apex FusedLAMB math), updates params in place.

    groups: list of dicts {"params": [tensor], "lr", "weight_decay"}; grads: a
    list per group (None = no grad); states: dict keyed by (group, index).
    Returns False when the step is skipped.
    """
    all_grads = [g for group_grads in grads for g in group_grads if g is not None]
    global_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in all_grads))
    if not math.isfinite(global_norm):
        return False
    clip = 1.0
    if max_grad_norm and global_norm > max_grad_norm:
        clip = max_grad_norm / global_norm
    beta1, beta2 = BETAS
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for gi, group in enumerate(groups):
        group["step"] = group.get("step", 0) + 1
        bc1 = 1 - beta1 ** group["step"]
        bc2 = 1 - beta2 ** group["step"]
        for pi, p in enumerate(group["params"]):
            g = grads[gi][pi]
            if g is None:
                continue
            g = g.double() * clip
            m, v = states.setdefault((gi, pi), (torch.zeros_like(p), torch.zeros_like(p)))
            m = beta1 * m + beta3 * g
            v = beta2 * v + (1 - beta2) * g * g
            states[(gi, pi)] = (m, v)
            update = (m / bc1) / ((v / bc2).sqrt() + EPS) + group["weight_decay"] * p
            ratio = 1.0
            if use_nvlamb or group["weight_decay"] != 0:
                p_norm, u_norm = float(p.norm()), float(update.norm())
                if p_norm > 0 and u_norm > 0:
                    ratio = p_norm / u_norm
            p.sub_(group["lr"] * ratio * update)
    return True


def make_problem(dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [[(5, 4), (4,), (3, 3)], [(4,), (6,)]]
    params = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes_g] for shapes_g in shapes]
    params[0][2].zero_()  # zero-norm weight: trust ratio falls back to 1
    params[1][1].zero_()  # zero-norm "bias"
    ref_groups = [
        {"params": [p.clone() for p in params[0]], "lr": 0.02, "weight_decay": 0.01},
        {"params": [p.clone() for p in params[1]], "lr": 0.05, "weight_decay": 0.0},
    ]
    tested = [[p.clone().to(dtype).requires_grad_() for p in ps] for ps in params]
    return ref_groups, tested, gen


def grads_for_step(step, ref_groups, gen):
    grads = []
    for gi, group in enumerate(ref_groups):
        group_grads = []
        for pi, p in enumerate(group["params"]):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            # Alternate between clipping active (big grads) and inactive (small).
            g *= 10.0 if step % 2 == 0 else 0.01
            if gi == 1 and pi == 1 and step == 2:
                g = None  # a param without grad this step
            if gi == 0 and pi == 2 and step < 2:
                g = torch.zeros_like(p)  # zero param and zero grad -> zero update
            group_grads.append(g)
        grads.append(group_grads)
    return grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_lamb_matches_reference(dtype, tol, use_nvlamb):
    ref_groups, tested, gen = make_problem(dtype)
    opt = Lamb(
        [
            {"params": tested[0], "lr": 0.02, "weight_decay": 0.01},
            {"params": tested[1], "lr": 0.05, "weight_decay": 0.0},
        ],
        betas=BETAS,
        eps=EPS,
        max_grad_norm=1.0,
        use_nvlamb=use_nvlamb,
    )
    states = {}
    for step in range(5):
        grads = grads_for_step(step, ref_groups, gen)
        for gi, ps in enumerate(tested):
            for pi, p in enumerate(ps):
                g = grads[gi][pi]
                p.grad = None if g is None else g.to(dtype)
        taken = opt.step()
        assert _taken(taken) is True
        assert reference_lamb_step(ref_groups, grads, states, max_grad_norm=1.0, use_nvlamb=use_nvlamb)
        for ref_group, ps in zip(ref_groups, tested):
            for ref_p, p in zip(ref_group["params"], ps):
                torch.testing.assert_close(p.detach().double(), ref_p, rtol=tol, atol=tol)
    # Clipping must not modify the user's gradients.
    assert torch.equal(tested[0][0].grad, grads[0][0].to(dtype))
    assert opt.state[tested[0][0]]["exp_avg"].dtype == dtype
    assert [int(g["step"]) for g in opt.param_groups] == [5, 5]
    assert opt.skipped_steps == 0


def test_lamb_without_clipping_and_grad_averaging():
    ref_groups, tested, gen = make_problem(torch.float64)
    opt = Lamb(
        [{"params": tested[0], "lr": 0.02, "weight_decay": 0.01}, {"params": tested[1], "lr": 0.05, "weight_decay": 0.0}],
        max_grad_norm=None,
        grad_averaging=False,
    )
    states = {}
    for step in range(3):
        grads = grads_for_step(0, ref_groups, gen)  # large grads: clipping would be active
        for ps, gs in zip(tested, grads):
            for p, g in zip(ps, gs):
                p.grad = g
        opt.step()
        reference_lamb_step(ref_groups, grads, states, max_grad_norm=None, grad_averaging=False)
    for ref_group, ps in zip(ref_groups, tested):
        for ref_p, p in zip(ref_group["params"], ps):
            torch.testing.assert_close(p.detach(), ref_p, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_lamb_skips_non_finite_step(bad):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = Lamb(bert_param_groups(model), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    assert opt.step()
    before_params = [p.detach().clone() for p in model.parameters()]
    before_state = io.BytesIO()
    torch.save(opt.state_dict(), before_state)

    model.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    model.bias.grad[0] = bad
    grad_before = model.bias.grad.clone()
    assert _taken(opt.step()) is False
    assert _taken(opt.last_step_taken) is False
    assert opt.skipped_steps == 1
    assert torch.equal(model.bias.grad.nan_to_num(), grad_before.nan_to_num())  # p.grad untouched
    assert not math.isfinite(opt.last_grad_norm)
    for before, p in zip(before_params, model.parameters()):
        assert torch.equal(before, p)
    before_state.seek(0)
    old = torch.load(before_state, weights_only=True)
    new = opt.state_dict()
    assert [int(g["step"]) for g in new["param_groups"]] == [int(g["step"]) for g in old["param_groups"]] == [1, 1]
    for pid, st in old["state"].items():
        for key, value in st.items():
            assert torch.equal(new["state"][pid][key], value)
    assert new["skipped_steps"] == 1


def _taken(result):
    """step()'s answer as a Python bool: a 0-d bool tensor (decided on the device) or False."""
    if isinstance(result, torch.Tensor):
        assert result.dim() == 0 and result.dtype == torch.bool
        return bool(result)
    return result


def test_lamb_skip_on_first_step_is_the_same_as_no_step():
    """The skip is decided on the device, so a skipped first step creates zero moments and a step
    counter of 0: the next taken step must equal a fresh optimizer's first step, bit for bit."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    fresh_model = nn.Linear(3, 2)
    fresh_model.load_state_dict(model.state_dict())
    opt = Lamb(bert_param_groups(model), lr=0.1)
    fresh = Lamb(bert_param_groups(fresh_model), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model.weight.grad = torch.full_like(model.weight, float("inf"))
    model.bias.grad = torch.ones_like(model.bias)
    assert _taken(opt.step()) is False
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert [int(g["step"]) for g in opt.param_groups] == [0, 0] and opt.skipped_steps == 1
    for state in opt.state.values():
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    x = torch.randn(4, 3)
    for m, o in ((model, opt), (fresh_model, fresh)):
        o.zero_grad()
        m(x).sum().backward()
        assert _taken(o.step()) is True
    for pa, pb in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(pa, pb)
    assert [int(g["step"]) for g in opt.param_groups] == [1, 1]


def test_lamb_step_without_grads_returns_false():
    opt = Lamb(nn.Linear(2, 2).parameters(), lr=0.1)
    assert opt.step() is False and opt.skipped_steps == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lamb_skip_mid_run_leaves_everything_bit_identical_and_keeps_counting(dtype):
    """A non-finite norm in the middle of a run (bf16 params too): params, moments and step
    counters unchanged; later steps continue as if the bad step never happened."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2)).to(dtype)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2)).to(dtype)
    model.load_state_dict(ref.state_dict())
    opt, ref_opt = Lamb(bert_param_groups(model), lr=0.05), Lamb(bert_param_groups(ref), lr=0.05)
    data = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(4)]
    for i, x in enumerate(data):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).float().sum().backward()
            if o is opt and i == 2:  # one bad step injected into one run only
                snapshot = io.BytesIO()
                torch.save(o.state_dict(), snapshot)
                params = [p.detach().clone() for p in m.parameters()]
                m[0].weight.grad[0, 0] = float("nan")
                assert _taken(o.step()) is False
                assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
                snapshot.seek(0)
                old = torch.load(snapshot, weights_only=True)
                new = o.state_dict()
                for pid, st in old["state"].items():
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert torch.equal(new["state"][pid][key], st[key])
                assert [float(g["step"]) for g in new["param_groups"]] == [2.0, 2.0]
                o.zero_grad()
                m(x).float().sum().backward()
            assert _taken(o.step()) is True
    assert opt.skipped_steps == 1 and ref_opt.skipped_steps == 0
    assert opt.state_dict()["skipped_steps"] == 1
    for pa, pb in zip(model.parameters(), ref.parameters()):
        assert torch.equal(pa, pb)


def test_lamb_grad_norm_and_counters_stay_on_the_device():
    """No host sync inside step(): the norm, the decision and the step counters are tensors."""
    model = nn.Linear(3, 2)
    opt = Lamb(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    taken = opt.step()
    assert isinstance(taken, torch.Tensor) and isinstance(opt.last_grad_norm, torch.Tensor)
    assert isinstance(opt.param_groups[0]["step"], torch.Tensor)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(opt.last_grad_norm, expected)
    # if opt.step(): sched.step() (the DLE idiom) still reads the tensor
    model(torch.randn(2, 3)).sum().backward()
    assert opt.step()


def test_lamb_loads_state_dicts_with_int_steps():
    """Checkpoints written before the step counter became a tensor keep their step count."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = Lamb(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    state["param_groups"][0]["step"] = int(state["param_groups"][0]["step"])  # the old format
    other = Lamb(model.parameters(), lr=0.1)
    other.load_state_dict(state)
    model(torch.randn(2, 3)).sum().backward()
    other.step()
    assert int(other.param_groups[0]["step"]) == 2


def test_lamb_with_grad_scaler_matches_unscaled():
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    model_b = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    model_b.load_state_dict(model_a.state_dict())
    opt_a = Lamb(bert_param_groups(model_a), lr=0.01)
    opt_b = Lamb(bert_param_groups(model_b), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for _ in range(2):
        x = torch.randn(3, 4)
        model_a(x).sum().backward()
        opt_a.step()
        opt_a.zero_grad()
        scaler.scale(model_b(x).sum()).backward()
        scaler.unscale_(opt_b)
        assert _taken(scaler.step(opt_b)) is True
        scaler.update()
        opt_b.zero_grad()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    # An overflowing step is skipped by the scaler, which lowers the scale.
    before = [p.detach().clone() for p in model_b.parameters()]
    scaler.scale(model_b(torch.full((3, 4), 1e38)).sum()).backward()
    assert scaler.step(opt_b) is None
    scaler.update()
    assert scaler.get_scale() < 2.0**10
    assert all(torch.equal(b, p) for b, p in zip(before, model_b.parameters()))


def test_lamb_bf16_params_keep_fp32_moments_across_state_dict():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(torch.bfloat16)
    opt = Lamb(model.parameters(), lr=0.01)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    assert opt.step()
    assert opt.state[model.weight]["exp_avg"].dtype == torch.float32
    fresh = Lamb(model.parameters(), lr=0.01)
    fresh.load_state_dict(opt.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        assert fresh.state[model.weight][key].dtype == torch.float32
        assert torch.equal(fresh.state[model.weight][key], opt.state[model.weight][key])


def _train_steps(model, opt, sched, steps, start):
    losses = []
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, 6, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _small_model():
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))


def test_state_dict_round_trip_mid_run_is_bit_exact():
    torch.manual_seed(0)
    model_a = _small_model()
    opt_a = Lamb(bert_param_groups(model_a), lr=0.05)
    sched_a = PolyWarmUpScheduler(opt_a, warmup=0.2, total_steps=10)
    _train_steps(model_a, opt_a, sched_a, 4, start=0)

    buf = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict(), "sched": sched_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    torch.manual_seed(1)
    model_b = _small_model()
    model_b.load_state_dict(saved["model"])
    opt_b = Lamb(bert_param_groups(model_b), lr=123.0)
    sched_b = PolyWarmUpScheduler(opt_b, warmup=0.2, total_steps=10)
    opt_b.load_state_dict(saved["opt"])
    sched_b.load_state_dict(saved["sched"])

    losses_a = _train_steps(model_a, opt_a, sched_a, 6, start=4)
    losses_b = _train_steps(model_b, opt_b, sched_b, 6, start=4)
    assert losses_a == losses_b
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)


class InplaceLayerNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))


class TinyBert(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(10, 4)
        self.LayerNorm = nn.LayerNorm(4)
        self.dense = nn.Linear(4, 4)
        self.norm2 = InplaceLayerNorm(4)
        self.decoder = nn.Linear(4, 10)
        self.decoder.weight = self.word_embeddings.weight  # tied
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)


def test_bert_param_groups_weight_decay_split():
    model = TinyBert()
    decay, no_decay = bert_param_groups(model, weight_decay=0.02)
    assert decay["weight_decay"] == 0.02 and no_decay["weight_decay"] == 0.0
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decay["params"]) == ids([model.word_embeddings.weight, model.dense.weight])
    assert ids(no_decay["params"]) == ids(
        [model.LayerNorm.weight, model.LayerNorm.bias, model.dense.bias, model.norm2.weight, model.norm2.bias, model.decoder.bias]
    )
    assert len(decay["params"]) == 2  # tied weight appears once


def _lrs(sched_cls, steps, **kwargs):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = sched_cls(opt, **kwargs)
    lrs = {}
    for k in range(1, steps + 1):  # lr in effect for optimizer step k
        lrs[k] = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
    return lrs


def test_poly_warmup_values():
    lrs = _lrs(PolyWarmUpScheduler, 105, warmup=0.1, total_steps=100)
    assert lrs[1] == pytest.approx(0.1)
    assert lrs[5] == pytest.approx(0.5)
    assert lrs[10] == pytest.approx(0.9**0.5)  # warm-up over; decay starts
    assert lrs[50] == pytest.approx(0.5**0.5)
    assert lrs[100] == 0.0 and lrs[105] == 0.0
    lrs = _lrs(PolyWarmUpScheduler, 50, warmup=0.0, total_steps=50, degree=1.0, base_lr=2.0)
    assert lrs[1] == pytest.approx(2.0 * 49 / 50)
    assert lrs[25] == pytest.approx(1.0)


def test_linear_warmup_values():
    lrs = _lrs(LinearWarmUpScheduler, 101, warmup=0.1, total_steps=100)
    assert lrs[1] == pytest.approx(0.1)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[55] == pytest.approx(0.5)
    assert lrs[100] == 0.0 and lrs[101] == 0.0


def test_scheduler_state_dict_round_trip():
    def make():
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
        return opt, PolyWarmUpScheduler(opt, warmup=0.1, total_steps=40)

    opt_a, sched_a = make()
    for _ in range(7):
        opt_a.step()
        sched_a.step()
    buf = io.BytesIO()
    torch.save(sched_a.state_dict(), buf)
    buf.seek(0)
    opt_b, sched_b = make()
    sched_b.load_state_dict(torch.load(buf, weights_only=True))
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    for _ in range(10):
        for opt, sched in ((opt_a, sched_a), (opt_b, sched_b)):
            opt.step()
            sched.step()
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]


def test_make_optimizer_choices():
    model = TinyBert()
    lamb = make_optimizer("lamb", bert_param_groups(model), 1e-3, max_grad_norm=2.0)
    assert isinstance(lamb, Lamb) and lamb.max_grad_norm == 2.0 and lamb.defaults["eps"] == 1e-6
    adamw = make_optimizer("adamw", bert_param_groups(model), 1e-3)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[1]["weight_decay"] == 0.0
    fused = make_optimizer("adamw_fused", bert_param_groups(model), 1e-3)
    assert isinstance(fused, torch.optim.AdamW)
    assert fused.defaults["fused"] or fused.defaults["foreach"]
    with pytest.raises(ValueError, match="lamb, adamw, adamw_fused"):
        make_optimizer("sgd", bert_param_groups(model), 1e-3)
