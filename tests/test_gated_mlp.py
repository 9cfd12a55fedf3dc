"""The gated MLP op (tempo.ops.gated_mlp) and its recipe (tempo.integrations.gated_mlp): SwiGLU and GeGLU
of every family, recognised by structure (issue 33; ModernBERT's GeGLU of issue 21 folded in)."""

import copy
import io
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tempo.memory import ActivationLedger
from tempo.ops._backend import TRITON_AVAILABLE, triton_interpreting, use_backend
from tempo.ops.gated_mlp import (GatedMLP, gated_linear, gated_linear_fused, gated_linear_fwd, gated_mlp_keep_mask)

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched  # noqa: E402

ACTS = ["silu", "gelu", "gelu_tanh"]
LAYOUTS = ["separate", "gate-first", "gate-second"]


def need_interpreter():
    if not (TRITON_AVAILABLE and triton_interpreting()):
        pytest.fail("the Triton path needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)")


def act_of(name):
    return {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[name]


def inputs(layout, rows=(3, 5), width=37, out=13, dtype=torch.float32, bias=True, seed=0, scale=3.0):
    """(op inputs, the stock computation on them) for one layout; gate pre-activations spread wide."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, width, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(out, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    if layout == "separate":
        gate = (torch.randn(*rows, width, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
        up = torch.randn(*rows, width, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        return (gate, up, w, b), lambda act, keep=None, s=1.0: stock(gate, up, w, b, act, keep, s)
    h = (torch.randn(*rows, 2 * width, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    def ref(act, keep=None, s=1.0):
        first, second = h.chunk(2, dim=-1)
        gate, up = (first, second) if layout == "gate-first" else (second, first)
        return stock(gate, up, w, b, act, keep, s)
    return (h, w, b), ref


def stock(gate, up, w, b, act, keep=None, scale=1.0):
    q = act_of(act)(gate) * up
    if keep is not None:
        q = q * keep.to(q.dtype) * scale
    return F.linear(q, w, b)


def run(layout, args, act, **kw):
    if layout == "separate":
        return gated_linear(*args, activation=act, **kw)
    h, w, b = args
    return gated_linear_fused(h, w, b, activation=act, gate_first=layout == "gate-first", **kw)


def grads(out, args, g):
    ins = [a for a in args if a is not None]
    return torch.autograd.grad(out, ins, g)


def rel(x, y):
    return float((x.detach().double() - y.detach().double()).norm() / y.detach().double().norm().clamp_min(1e-30))


def probe_loss(y):
    """A loss with a gradient everywhere (a post-LN output's mean square is constant)."""
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(42), dtype=torch.float64)
    return (y.double() * w).sum()


# ---------------------------------------------------------------------------------------------
# The op: exact against the stock ops
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act", ACTS)
def test_reference_path_is_the_stock_ops_bit_for_bit(act, layout, bias):
    args, ref = inputs(layout, bias=bias)
    with use_backend("reference"):
        out = run(layout, args, act)
    want = ref(act)
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # the forward is the stock ops
    g = torch.randn_like(out)
    for x, y in zip(grads(out, args, g), grads(want, args, g)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act", ACTS)
def test_triton_path_matches_the_stock_ops(act, layout):
    need_interpreter()
    args, ref = inputs(layout, rows=(2, 3), width=37)
    with use_backend("triton"):
        out = run(layout, args, act)
    want = ref(act)
    assert rel(out, want) < 1e-6
    g = torch.randn_like(out)
    with use_backend("triton"):
        mine = grads(out, args, g)
    for x, y in zip(mine, grads(want, args, g)):
        assert rel(x, y) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout_is_the_stock_computation_under_the_regenerated_mask(layout, backend):
    """Output and every gradient with dropout: the stock ops with the mask gated_mlp_keep_mask
    regenerates from the seed (the very mask the op drew in forward and redrew in backward)."""
    if backend == "triton":
        need_interpreter()
    args, ref = inputs(layout, rows=(4, 6), width=33)
    seed, p = torch.tensor(1234), 0.3
    with use_backend(backend):
        out = run(layout, args, "silu", p=p, seed=seed)
        keep = gated_mlp_keep_mask(seed, 24, 33, p, "cpu", backend).view(4, 6, 33)
    want = ref("silu", keep, 1 / (1 - p))
    assert rel(out, want) < 1e-6
    g = torch.randn_like(out)
    with use_backend(backend):
        mine = grads(out, args, g)
    for x, y in zip(mine, grads(want, args, g)):
        assert rel(x, y) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_dropout_rate_and_replay(backend):
    if backend == "triton":
        need_interpreter()
    torch.manual_seed(0)
    gate, up = torch.randn(64, 200) + 4.0, torch.ones(64, 200)  # act(gate) * up > 0: a zero is a drop
    with use_backend(backend):
        for p in (0.1, 0.5):
            torch.manual_seed(7)
            a = gated_linear(gate, up, None, activation="silu", p=p)
            torch.manual_seed(7)
            b = gated_linear(gate, up, None, activation="silu", p=p)
            c = gated_linear(gate, up, None, activation="silu", p=p)
            dropped = float((a == 0).double().mean())
            assert abs(dropped - p) < 4 * math.sqrt(p * (1 - p) / a.numel()), (p, dropped)
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # same RNG state, same mask
            assert not torch.equal(a, c)
            kept = a != 0
            torch.testing.assert_close(a[kept], (F.silu(gate) * up / (1 - p))[kept], rtol=1e-6, atol=0)
        # eval (training=False) and p = 0 drop nothing
        torch.testing.assert_close(gated_linear(gate, up, None, p=0.5, training=False), F.silu(gate) * up)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act", ACTS)
def test_gradcheck_fp64_with_and_without_dropout(act, layout):
    args, _ = inputs(layout, rows=(2, 3), width=5, out=4, dtype=torch.float64, scale=2.0)
    seed = torch.tensor(99)
    for p in (0.0, 0.4):
        with use_backend("reference"):
            assert torch.autograd.gradcheck(lambda *a: run(layout, a, act, p=p, seed=seed),
                                            tuple(a for a in args if a is not None) if args[-1] is not None else args)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1.5e-2), (torch.float16, 2e-3)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("act", ACTS)
def test_16_bit_against_fp64(act, backend, dtype, tol):
    """Output and gradients in 16 bits against the fp64 stock computation on the same (rounded)
    inputs: within tol (relative L2) and never worse than the stock ops in that dtype by more than
    one rounding of it."""
    if backend == "triton":
        need_interpreter()
    args, _ = inputs("separate", rows=(3, 4), width=40, out=24, dtype=dtype, scale=2.0)
    args64 = [a.detach().double().requires_grad_() for a in args]
    out64 = stock(*args64, act)
    g = torch.randn(out64.shape, dtype=torch.float64)
    want = [out64, *torch.autograd.grad(out64, args64, g)]
    with use_backend(backend):
        out = gated_linear(*args, activation=act)
        got = [out, *torch.autograd.grad(out, args, g.to(dtype))]
    eager_out = stock(*args, act)
    eager = [eager_out, *torch.autograd.grad(eager_out, args, g.to(dtype))]
    unit = torch.finfo(dtype).eps
    for name, x, e, y in zip(["out", "gate", "up", "weight", "bias"], got, eager, want):
        assert x.dtype == dtype
        assert rel(x, y) < tol, (name, rel(x, y))
        assert rel(x, y) <= rel(e, y) + 2 * unit, (name, rel(x, y), rel(e, y))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_follows_f_linear(autocast_dtype, backend):
    """fp32 weights, autocast: the projection runs in the autocast dtype and the weight's gradient
    comes back in fp32 through the cast, as for the stock ops under autocast."""
    if backend == "triton":
        need_interpreter()
    args, _ = inputs("separate", rows=(3, 4), width=40, out=24, scale=2.0)
    gate, up, w, b = args
    results = []
    for fn in ("tempo", "stock"):
        with torch.autocast("cpu", dtype=autocast_dtype), use_backend(backend):
            g16, u16 = gate.to(autocast_dtype), up.to(autocast_dtype)
            out = gated_linear(g16, u16, w, b, "silu") if fn == "tempo" else stock(g16, u16, w, b, "silu")
        assert out.dtype == autocast_dtype
        results.append([out, *torch.autograd.grad(out.float().sum(), (gate, up, w, b))])
    for x, y in zip(*results):
        assert x.dtype == y.dtype
        assert rel(x, y) < 1e-2


# ---------------------------------------------------------------------------------------------
# What the op keeps
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_keeps_gate_and_up_only(layout, dtype, p):
    """2·I elements per token (the two halves of a fused projection's output are one storage),
    plus the 8-byte seed with dropout; the weight is a parameter."""
    rows, width = (4, 7), 64
    args, _ = inputs(layout, rows=rows, width=width, out=16, dtype=dtype)
    w = nn.Parameter(args[-2].detach())
    args = (*[(a.detach() * 1.0).requires_grad_() for a in args[:-2]], w, None)
    with ActivationLedger() as ledger:
        run(layout, args, "silu", p=p)
    tokens = math.prod(rows)
    assert ledger.activation_bytes == 2 * width * tokens * torch.finfo(dtype).bits // 8 + (8 if p else 0)


def test_no_backward_keeps_nothing():
    args, ref = inputs("separate")
    with torch.no_grad(), ActivationLedger() as ledger:
        out = gated_linear(*args, "gelu")
    assert ledger.records == []
    torch.testing.assert_close(out, ref("gelu").detach(), rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(gated_linear(*[a.detach() for a in args], "gelu", p=0.2, training=False),
                                   ref("gelu").detach(), rtol=0, atol=0)


def test_bad_arguments_are_named():
    g, u, w = torch.randn(2, 4), torch.randn(2, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="'activation'"):
        gated_linear(g, u, w, activation="relu")
    with pytest.raises(ValueError, match="'up'"):
        gated_linear(g, torch.randn(2, 5), w)
    with pytest.raises(ValueError, match="'h'"):
        gated_linear_fused(torch.randn(2, 7), w)
    with pytest.raises(ValueError, match="'weight'"):
        gated_linear(g, u, torch.randn(3, 5))
    with pytest.raises(ValueError, match="'bias'"):
        gated_linear(g, u, None, torch.randn(3))
    with pytest.raises(TypeError, match="'weight'"):
        gated_linear(g, u, w.double())
    with pytest.raises(ValueError, match="'p'"):
        gated_linear(g, u, w, p=1.0)
    with pytest.raises(TypeError, match="'seed'"):
        gated_linear(g, u, w, p=0.1, seed=torch.tensor(1.5))
    with pytest.raises(TypeError, match="'gate_first'"):
        gated_linear_fused(torch.randn(2, 8), w, gate_first=1)
    with pytest.raises(ValueError, match=r"^gated_linear: argument 'weight' .* on meta but the input 'gate' is on cpu"):
        gated_linear(g, u, torch.ones(3, 4, device="meta"))
    with use_backend("triton"), pytest.raises((TypeError, RuntimeError), match="gated_linear"):
        gated_linear(g.double(), u.double(), w.double())  # the kernels compute in fp32: refused, named


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) and autograd registrations, as torch.compile uses them."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 2, 16, generator=g, requires_grad=True)
    up = torch.randn(3, 2, 8, generator=g, requires_grad=True)
    w, b = torch.randn(5, 8, generator=g, requires_grad=True), torch.randn(5, generator=g, requires_grad=True)
    seed = torch.tensor(3)
    for args in [(h[..., :8].detach().clone().requires_grad_(), up, w, b, seed, "silu", -1, 0.2, True, "reference"),
                 (h, None, w, None, None, "gelu_tanh", 1, 0.0, True, "reference"),
                 (h, None, None, None, seed, "gelu", 0, 0.3, True, "reference")]:
        torch.library.opcheck(gated_linear_fwd, args)


def test_compiles_as_one_graph():
    torch._dynamo.reset()
    args, ref = inputs("gate-second", rows=(2, 3), width=8, out=4)
    fn = torch.compile(lambda h, w, b: gated_linear_fused(h, w, b, "silu", gate_first=False), backend="aot_eager",
                       fullgraph=True)
    with use_backend("reference"):
        out = fn(*args)
    torch.testing.assert_close(out, ref("silu"), rtol=0, atol=0)
    g = torch.randn_like(out)
    for x, y in zip(grads(out, args, g), grads(ref("silu"), args, g)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_triton_kernels_match_their_movement_declarations():
    """Bytes each Triton kernel loads and stores (counted in the interpreter) against the
    declaration tempo/movement/declarations.py makes for the op."""
    need_interpreter()
    from tempo.movement.declarations import INTERPRETER, kernels_of
    from tempo.movement.interpreter import count_triton_memory
    from tempo.movement.trace import Recorder

    for layout, p, bias in (("separate", 0.1, True), ("gate-second", 0.0, False)):
        args, _ = inputs(layout, rows=(2, 9), width=41, out=12, dtype=torch.bfloat16, bias=bias)
        with count_triton_memory() as memory, Recorder() as recorder, use_backend("triton"):
            out = run(layout, args, "gelu", p=p)
            recorder.phase = "backward"
            out.backward(torch.randn_like(out))
        declared = [(k.name, k.read, k.written) for call in recorder.calls if call.packet.startswith("tempo.")
                    for k in kernels_of(call, INTERPRETER) if k.triton]
        measured = [(launch.kernel, launch.read, launch.written) for launch in memory.launches]
        assert declared and declared == measured, (declared, measured)


# ---------------------------------------------------------------------------------------------
# Families: each real MLP class replaced by structure, exact, keeping 2·I
# ---------------------------------------------------------------------------------------------
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, vocab_size=100)


def _config(name, **extra):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}: that family is not tested here")
    return cls(**{**SMALL, **extra})


FAMILIES = {
    # name -> (model class, config factory, MLP path in the model, act, layout, dropout)
    "llama": ("LlamaModel", lambda: _config("LlamaConfig", num_key_value_heads=2, mlp_bias=True), "silu"),
    "qwen3": ("Qwen3Model", lambda: _config("Qwen3Config", num_key_value_heads=2, head_dim=16), "silu"),
    "eurobert": ("EuroBertModel", lambda: _config("EuroBertConfig", num_key_value_heads=2, pad_token_id=0,
                                                   bos_token_id=1, eos_token_id=2, mask_token_id=3), "silu"),
    "gemma3": ("Gemma3TextModel", lambda: _config("Gemma3TextConfig", num_key_value_heads=2, head_dim=16),
               "gelu_tanh"),
    "nomic_bert": ("NomicBertModel", lambda: _config("NomicBertConfig"), "silu"),
    "gte": ("GteModel", lambda: _config("GteConfig"), "gelu"),
    "modernbert": ("ModernBertModel", lambda: _config("ModernBertConfig", global_attn_every_n_layers=2,
                                                      local_attention=8, pad_token_id=0), "gelu"),
}


def family_model(family, seed=0):
    cls_name, config, _ = FAMILIES[family]
    cfg = config()
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    torch.manual_seed(seed)
    return cls(cfg)


def mlps(model):
    return [m for n, m in model.named_modules() if n.endswith(".mlp")]


def adversarial(mlp, seed=0):
    """Weights far from init (std 1, biases up to ±10): wide pre-activations, both GELU tails."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (10.0 if name.endswith("bias") else 1.0))
    return mlp


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_mlp_is_replaced_and_exact(family):
    model = family_model(family)
    mlp = adversarial(mlps(model)[0]).eval()  # eval: dropout off (GTE's 0.1)
    holder = nn.ModuleDict({"mlp": copy.deepcopy(mlp)})
    apply_tempo(holder)
    new = holder["mlp"]
    assert isinstance(new, GatedMLP) and isinstance(new, type(mlp))
    assert new.layout.activation == FAMILIES[family][2]
    assert list(new.state_dict()) == list(mlp.state_dict())
    assert [n for n, _ in new.named_children()] == [n for n, _ in mlp.named_children()]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 32, generator=g, requires_grad=True)
    out = [m(x) for m in (new, mlp)]
    assert rel(out[0], out[1]) < 1e-6
    go = torch.randn(out[1].shape, generator=g)
    got, want = (torch.autograd.grad(o, [x, *m.parameters()], go) for o, m in zip(out, (new, mlp)))
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_keeps_2I_per_token_per_mlp(family):
    """Bytes kept per token by one MLP in training, fp32, besides its input: stock 4·I (gate, up,
    act(gate), the product) plus, with GTE's dropout 0.1, its mask (the down projection keeps the
    dropout's output instead of the product); after: 2·I (+ the 8-byte seed with dropout)."""
    model = family_model(family).train()
    mlp = mlps(model)[0]
    p = next((m.p for m in mlp.modules() if isinstance(m, nn.Dropout)), 0.0)
    width = model.config.intermediate_size
    tokens = 10
    kept = {}
    for name, m in (("stock", mlp), ("tempo", apply_tempo(nn.ModuleDict({"mlp": copy.deepcopy(mlp)}))["mlp"])):
        x = torch.randn(2, 5, 32, requires_grad=True)
        with ActivationLedger(m) as ledger:
            m(x)
        kept[name] = ledger.activation_bytes
    x_bytes = tokens * 32 * 4  # the MLP's input, kept by its projections either way
    if p:
        # On the CPU nn.Dropout multiplies by a float mask it keeps (CUDA's fused dropout: a bool one).
        assert kept["stock"] - x_bytes == tokens * width * 5 * 4
        assert kept["tempo"] - x_bytes == tokens * width * 2 * 4 + 8
    else:
        assert kept["stock"] - x_bytes == tokens * width * 4 * 4
        assert kept["tempo"] - x_bytes == tokens * width * 2 * 4


@pytest.mark.parametrize("family", ["llama", "gte", "modernbert"])
def test_whole_model_same_loss_and_gradients(family):
    torch.manual_seed(0)
    model = family_model(family).eval()
    for mlp in mlps(model):
        adversarial(mlp, seed=len(mlp.state_dict()))
    patched = apply_tempo(copy.deepcopy(model), attention=False)
    assert tempo_patched(patched)["GatedMLP"] == model.config.num_hidden_layers
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for m in (model, patched):
        y = m(input_ids=ids).last_hidden_state
        probe_loss(y).backward()
        results.append((y.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert rel(results[1][0], results[0][0]) < 1e-5
    assert results[1][1].keys() == results[0][1].keys()
    for name in results[0][1]:
        assert rel(results[1][1][name], results[0][1][name]) < 1e-5, name


# ---------------------------------------------------------------------------------------------
# Structure, not names: layouts of other code, look-alikes left alone
# ---------------------------------------------------------------------------------------------
class RemoteGteMLP(nn.Module):
    """Alibaba's trust_remote_code GTE MLP: one up_gate_proj, up first, the dropout inside."""

    def __init__(self, h=16, i=24, p=0.1):
        super().__init__()
        self.up_gate_proj = nn.Linear(h, 2 * i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=True)
        from transformers.activations import ACT2FN

        self.act_fn = ACT2FN["gelu"]
        self.hidden_dropout = nn.Dropout(p)

    def forward(self, hidden_states):
        up, gate = torch.split(self.up_gate_proj(hidden_states), [24, 24], dim=-1)
        return self.down_proj(self.hidden_dropout(self.act_fn(gate) * up))


class OddNamesMLP(nn.Module):
    """Names no table knows; the gate is the second Linear, the activation a custom SiLU class."""

    class Swish(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)

    def __init__(self, h=16, i=24):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(h, i), nn.Linear(h, i), nn.Linear(i, h)
        self.nonlinearity = OddNamesMLP.Swish()

    def forward(self, x):
        return self.c(self.a(x) * self.nonlinearity(self.b(x)))


class LookAlike(nn.Module):
    """Gated structure, another computation: act(up) − gate."""

    def __init__(self, h=16, i=24):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i), nn.Linear(h, i), nn.Linear(i, h)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) - self.gate_proj(x))


class ReluGLU(LookAlike):
    def __init__(self):
        super().__init__()
        self.act_fn = nn.ReLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DropoutAfterDown(LookAlike):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.dropout(self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


@pytest.mark.parametrize("cls, layout", [(RemoteGteMLP, dict(fused="up_gate_proj", gate_half=1, activation="gelu",
                                                               dropout="hidden_dropout")),
                                         (OddNamesMLP, dict(gate="b", up="a", down="c", activation="silu"))],
                         ids=["remote-gte", "odd-names"])
def test_other_code_is_recognised_by_structure(cls, layout):
    torch.manual_seed(0)
    mlp = cls().eval()
    holder = apply_tempo(nn.ModuleDict({"mlp": copy.deepcopy(mlp)}))
    new = holder["mlp"]
    assert isinstance(new, GatedMLP)
    for key, value in layout.items():
        assert getattr(new.layout, key) == value
    x = torch.randn(3, 16, requires_grad=True)
    out = [m(x) for m in (new, mlp)]
    assert rel(out[0], out[1]) < 1e-6
    got, want = (torch.autograd.grad(o.sum(), [x, *m.parameters()]) for o, m in zip(out, (new, mlp)))
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("cls, why", [(LookAlike, "looks like a gated MLP but computes something else"),
                                      (ReluGLU, "its activation ReLU is none of SiLU, exact or tanh GELU"),
                                      (DropoutAfterDown, "its dropout dropout is not applied to the gated product")],
                         ids=["computes-else", "relu", "dropout-elsewhere"])
def test_a_look_alike_is_left_alone_with_one_line(cls, why, caplog):
    torch.manual_seed(0)
    holder = nn.ModuleDict({"mlp": cls()})
    original = holder["mlp"]
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(holder)
    assert holder["mlp"] is original
    lines = [m for m in caplog.messages if "gated MLP" in m]
    # one summary line for the kind, with the reason (a numerical refusal also names the module with its numbers)
    summary = [m for m in lines if m.startswith("apply_tempo: left 1 gated MLP module alone")]
    assert len(summary) == 1 and f"({cls.__name__}: {why}" in summary[0], caplog.messages
    assert all("alone" in m and cls.__name__ in m for m in lines), caplog.messages


def test_attention_and_plain_mlps_are_not_recognised(caplog):
    """BERT's attention (three same-shaped Linears, no activation) and a plain MLP (fc1, act, fc2)
    are no gated MLPs: nothing is tried on them, nothing logged about them."""
    from tempo.integrations.gated_mlp import gated_mlp_recipes

    recognise = gated_mlp_recipes()[0].recognise
    bert = transformers.BertModel(transformers.BertConfig(**SMALL))
    assert not any(recognise(m) for m in bert.modules())
    jina = getattr(transformers, "JinaEmbeddingsV3MLP", None)
    plain = nn.Sequential()
    plain.fc1, plain.act, plain.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)
    assert not recognise(plain)
    if jina is not None:
        assert not any(recognise(m) for m in transformers.JinaEmbeddingsV3Model(
            transformers.JinaEmbeddingsV3Config(**SMALL)).modules())


def test_meta_device_uses_the_known_layouts_and_refuses_the_rest(caplog):
    with torch.device("meta"):
        llama = family_model("llama")
        modern = family_model("modernbert")
        holder = nn.ModuleDict({"mlp": OddNamesMLP()})
    for model in (llama, modern):
        apply_tempo(model, attention=False)
        assert tempo_patched(model)["GatedMLP"] == 2
    assert modern.layers[0].mlp.layout.gate_half == 0
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(holder)
    assert not isinstance(holder["mlp"], GatedMLP)
    assert any("OddNamesMLP: on the meta device which projection is the gate cannot be measured" in m
               for m in caplog.messages)
    llama.to_empty(device="cpu")  # then initialised or loaded as usual
    x = torch.randn(2, 3, 32)
    mlp = llama.layers[0].mlp
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
        want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Stock-parity idioms
# ---------------------------------------------------------------------------------------------
def test_same_objects_revert_idempotent_pickle():
    model = family_model("llama")
    params = {n: p for n, p in model.named_parameters()}
    children = [(n, list(m._modules.items())) for n, m in model.named_modules() if n.endswith(".mlp")]
    patched = apply_tempo(model, attention=False)
    assert {n: p for n, p in patched.named_parameters()}.keys() == params.keys()
    assert all(p is params[n] for n, p in patched.named_parameters())
    for (name, kids), mlp in zip(children, mlps(patched)):
        assert list(mlp._modules.items()) == kids  # the same objects, in the original's order
        assert mlp.config is model.config and mlp.intermediate_size == 48
    structure = [(n, id(m)) for n, m in patched.named_modules()]
    apply_tempo(patched, attention=False)
    assert [(n, id(m)) for n, m in patched.named_modules()] == structure
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randint(3, 100, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).last_hidden_state, patched(input_ids=x).last_hidden_state)
    revert_tempo(patched)
    for (name, kids), mlp in zip(children, mlps(patched)):
        assert not isinstance(mlp, GatedMLP) and list(mlp._modules.items()) == kids


def test_init_weights_sees_the_original_class():
    """_init_weights of the model initialises the replacement as the original: the same draws."""
    stock = family_model("modernbert")
    patched = apply_tempo(copy.deepcopy(stock), attention=False)
    for model in (stock, patched):
        torch.manual_seed(3)
        model.apply(model._init_weights)
    for (n, a), (_, b) in zip(stock.named_parameters(), patched.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_gte_dropout_switched_by_its_module():
    """GTE's MLP dropout (0.1): Tempo's seeded dropout while the held nn.Dropout is on; TRL's
    ``m.p = 0`` (or eval) gives the stock numbers; a rate set after the swap is read at the next
    forward; the same RNG state replays the same mask."""
    from trl.trainer.utils import disable_dropout_in_model

    stock = family_model("gte").train()
    patched = apply_tempo(copy.deepcopy(stock), attention=False)
    x = torch.randint(3, 100, (2, 9))

    def loss(model, seed=5):
        torch.manual_seed(seed)
        return probe_loss(model(input_ids=x).last_hidden_state)

    assert torch.equal(loss(patched), loss(patched))  # replay
    assert not torch.equal(loss(patched, 5), loss(patched, 6))
    for m in (stock, patched):
        disable_dropout_in_model(m)
    torch.testing.assert_close(loss(patched), loss(stock), rtol=1e-5, atol=1e-6)
    mlp = patched.layers[0].mlp
    assert mlp.dropout.p == 0.0 and patched.layers[1].mlp.dropout is not None
    mlp.dropout.p = 0.5
    assert not torch.equal(loss(patched), loss(stock))


def test_peft_lora_on_the_projections_is_not_bypassed():
    """LoRA (random B, so an adapter changes the output) on gate, up and down, put on after
    apply_tempo and before it: the same outputs and gradients as LoRA on the stock model; the down
    projection's adapter runs (the product path), then merge_and_unload fuses it again."""
    import peft

    stock = family_model("llama").eval()
    x = torch.randint(3, 100, (2, 7))

    def lora(model):
        torch.manual_seed(11)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
                                 lora_dropout=0.0, init_lora_weights=False)
        return peft.get_peft_model(model, config)

    def run_model(model):
        model.zero_grad()
        y = model(input_ids=x).last_hidden_state
        probe_loss(y).backward()
        return y.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want = run_model(lora(copy.deepcopy(stock)))
    after = lora(apply_tempo(copy.deepcopy(stock), attention=False))
    before = apply_tempo(lora(copy.deepcopy(stock)), attention=False)
    for model in (after, before):
        assert sum(isinstance(m, GatedMLP) for m in model.modules()) == 2
        got = run_model(model)
        assert rel(got[0], want[0]) < 1e-6
        assert got[1].keys() == want[1].keys() and any("lora_B" in k and "down_proj" in k for k in got[1])
        for k in want[1]:
            assert rel(got[1][k], want[1][k]) < 1e-5, k
    merged = after.merge_and_unload()
    assert type(merged.layers[0].mlp.down_proj) is nn.Linear
    with torch.no_grad():
        assert rel(merged(input_ids=x).last_hidden_state, want[0]) < 1e-5


def test_mixed_dtypes_outside_autocast_run_the_stock_computation(caplog):
    """A bf16 down projection under fp32 activations without autocast: the stock computation runs
    (and fails as the stock module fails), logged once."""
    mlp = apply_tempo(nn.ModuleDict({"mlp": family_model("llama").layers[0].mlp}))["mlp"]
    mlp.down_proj.to(torch.bfloat16)
    x = torch.randn(2, 32)
    with caplog.at_level(logging.WARNING, logger="tempo"), pytest.raises(RuntimeError) as tempo_err:
        mlp(x)
    assert any("mixed dtypes outside autocast" in m for m in caplog.messages)
    with pytest.raises(RuntimeError) as stock_err:
        mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert str(tempo_err.value) == str(stock_err.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_weights_and_autocast_training_step(dtype):
    """A model in 16 bits, and an fp32 model under autocast: patched as stock, to the dtype's rounding."""
    for cast in ("weights", "autocast"):
        stock = family_model("gte").eval()
        if cast == "weights":
            stock.to(dtype)
        patched = apply_tempo(copy.deepcopy(stock), attention=False, layernorm=False)
        x = torch.randint(3, 100, (2, 9))
        results = []
        for model in (stock, patched):
            with torch.autocast("cpu", dtype=dtype, enabled=cast == "autocast"):
                y = model(input_ids=x).last_hidden_state
            probe_loss(y).backward()
            results.append((y.detach(), [p.grad for p in model.parameters()]))
        assert results[1][0].dtype == results[0][0].dtype
        assert rel(results[1][0], results[0][0]) < 2e-2
        assert rel(torch.cat([g.flatten().double() for g in results[1][1]]),
                   torch.cat([g.flatten().double() for g in results[0][1]])) < 5e-2


def test_modernbert_mlp_dropout_is_fused_and_a_rate_in_eval_keeps_nothing_more():
    """ModernBERT with mlp_dropout (0 in its checkpoints) is replaced too, its dropout inside the op;
    in eval mode a rate set on the held nn.Dropout drops nothing and keeps no seed (a frozen-dropout
    fine-tune with grad on keeps gate and up only)."""
    model = family_model("modernbert")
    model.config.mlp_dropout = 0.1
    model = transformers.ModernBertModel(model.config)
    patched = apply_tempo(model, attention=False, layernorm=False)
    assert all(isinstance(m, GatedMLP) and m.layout.dropout == "drop" for m in mlps(patched))
    x = torch.randint(3, 100, (2, 9))
    kept = {}
    for mode, p in (("eval", 0.0), ("eval", 0.3), ("train", 0.3)):
        getattr(patched, mode)()
        for m in mlps(patched):
            m.drop.p = p
        with ActivationLedger(patched) as ledger:
            patched(input_ids=x)
        kept[mode, p] = {k: v for k, v in ledger.by_module(depth=3).items() if k.endswith(".mlp")}
    assert kept["eval", 0.0] and kept["eval", 0.3] == kept["eval", 0.0]
    assert all(kept["train", 0.3][k] == v + 8 for k, v in kept["eval", 0.0].items())  # + the seed


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_a_frozen_down_weight_or_bias_leaves_the_other_its_gradient(fused, frozen):
    """PEFT's LoRA with bias="all" trains the down projection's bias beside a frozen weight (and the
    reverse happens with a frozen bias): each gets its own gradient, equal to F.linear's, whatever
    the other requires."""
    from tempo.ops.gated_mlp import gated_linear, gated_linear_fused

    torch.manual_seed(0)
    inter, out = 8, 6
    h = torch.randn(5, 2 * inter, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(out, inter, dtype=torch.float64, requires_grad=frozen != "weight")
    bias = torch.randn(out, dtype=torch.float64, requires_grad=frozen != "bias")
    gate, up = h[:, :inter], h[:, inter:]
    if fused:
        got = gated_linear_fused(h, weight, bias, activation="silu", gate_first=True)
    else:
        got = gated_linear(gate, up, weight, bias, activation="silu")
    want = nn.functional.linear(nn.functional.silu(gate) * up, weight, bias)
    trained = [t for t in (h, weight, bias) if t.requires_grad]
    grads = torch.autograd.grad(got.square().sum(), trained)
    expected = torch.autograd.grad(want.square().sum(), trained)
    for g, e in zip(grads, expected):
        assert g is not None and torch.allclose(g, e, rtol=1e-10, atol=1e-12)
