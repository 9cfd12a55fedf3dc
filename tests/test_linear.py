"""InputKeepingLinear (tempo/ops/linear.py) and the projections apply_tempo switches to it
(tempo/integrations/projections.py): under autocast a projection keeps its fp32 input, the tensor a
Tempo RMSNorm keeps anyway, instead of its own 16-bit copy; bit for bit the stock numbers."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tempo import apply_tempo, revert_tempo
from tempo.integrations.projections import keep_norm_outputs
from tempo.integrations.recipe import restore_classes
from tempo.memory import ActivationLedger
from tempo.ops.linear import InputKeepingLinear, recast_dtype, linear_keeping_input
from tempo.ops.rmsnorm import InplaceRMSNorm

transformers = pytest.importorskip("transformers")


def _run(fn, x, w, b, dtype, grad):
    with torch.autocast("cpu", dtype=dtype):
        y = fn(x, w, b)
    wanted = [x, w] + ([b] if b is not None else [])
    return y, torch.autograd.grad(y, wanted, grad.to(y.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16), (2, 3, 4, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_bitwise_the_stock_linear_under_autocast(dtype, shape, bias):
    """Output, every gradient and their dtypes: bitwise F.linear's under autocast (adversarial
    magnitudes: weights of std 30, a bias up to ±1e3)."""
    torch.manual_seed(0)
    x = (torch.randn(*shape) * 4).requires_grad_()
    w = (torch.randn(24, 16) * 30).requires_grad_()
    b = (torch.randn(24) * 1e3).requires_grad_() if bias else None
    grad = torch.randn(*shape[:-1], 24)
    y0, g0 = _run(F.linear, x, w, b, dtype, grad)
    y1, g1 = _run(linear_keeping_input, x, w, b, dtype, grad)
    assert y1.dtype == y0.dtype == dtype and torch.equal(y1, y0)
    for a, c in zip(g0, g1):
        assert a.dtype == c.dtype and torch.equal(a, c)


def test_it_keeps_the_input_not_a_16bit_copy():
    """Three projections of one fp32 tensor under bf16 autocast: stock keeps three bf16 copies
    (2 bytes per element each), InputKeepingLinear the input itself (shared, counted once)."""
    rows, h = 6, 32

    class Reader(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

        def forward(self, x):
            return self.q(x) + self.k(x) + self.v(x)

    torch.manual_seed(0)
    stock = Reader()
    tempo = copy.deepcopy(stock)
    for m in (tempo.q, tempo.k, tempo.v):
        m.__class__ = InputKeepingLinear
    leaf = torch.randn(rows, h, requires_grad=True)
    kept = []
    for model in (stock, tempo):
        with torch.autocast("cpu", dtype=torch.bfloat16), ActivationLedger(model) as ledger:
            # Not a leaf, as a norm's output is: autocast caches its casts of leaves that require grad.
            x = leaf * 1.0
            model(x).sum().backward()
        kept.append(ledger.activation_bytes)
        copies = [r for r in ledger.records if not r.is_parameter and r.shape == (rows, h)]
        assert all(r.dtype == (torch.bfloat16 if model is stock else torch.float32) for r in copies)
    assert kept[0] - kept[1] == 3 * rows * h * 2 - rows * h * 4  # three bf16 copies, against x itself


def test_everywhere_else_it_is_nn_linear():
    """No autocast, a 16-bit model, fp16 autocast of a bf16 input, no grad: nn.Linear's forward."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    assert recast_dtype(x, lin.weight, lin.bias) is None  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert recast_dtype(x, lin.weight, lin.bias) == torch.bfloat16
        assert recast_dtype(x.bfloat16(), lin.weight, lin.bias) is None  # already 16-bit: nothing cast
        assert recast_dtype(x.double(), lin.weight.double(), None) is None  # fp64: autocast leaves it
        with torch.no_grad():
            assert recast_dtype(x, lin.weight, lin.bias) is None
    switched = copy.deepcopy(lin)
    switched.__class__ = InputKeepingLinear
    assert isinstance(switched, nn.Linear) and switched.state_dict().keys() == lin.state_dict().keys()
    assert torch.equal(switched(x), lin(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = switched(x)
    y.sum().backward()
    assert y.grad_fn is not None and "LinearKeepingInput" in type(y.grad_fn).__name__


def test_compiles_without_a_graph_break():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    lin.__class__ = InputKeepingLinear
    ref = copy.deepcopy(lin)
    ref.__class__ = nn.Linear
    x = torch.randn(4, 16, requires_grad=True)

    def step(module):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(x).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(lambda: step(lin), fullgraph=True, backend="aot_eager")
    loss = compiled()
    grads = torch.autograd.grad(loss, [x, lin.weight, lin.bias])
    loss_ref = step(ref)
    grads_ref = torch.autograd.grad(loss_ref, [x, ref.weight, ref.bias])
    assert torch.equal(loss, loss_ref)
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# apply_tempo: which projections are switched, exactness on the families, bytes saved, revert
# ---------------------------------------------------------------------------------------------
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=100, attn_implementation="eager")
FAMILIES = {
    "llama": ("LlamaModel", "LlamaConfig", {}),
    "qwen3": ("Qwen3Model", "Qwen3Config", {"head_dim": 16}),
    "gemma3": ("Gemma3TextModel", "Gemma3TextConfig", {"head_dim": 16}),
    "eurobert": ("EuroBertModel", "EuroBertConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                                     "mask_token_id": 3}),
}


def family(name, seed=0):
    cls_name, config_name, extra = FAMILIES[name]
    cls, config = getattr(transformers, cls_name, None), getattr(transformers, config_name, None)
    if cls is None or config is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}: that family is not tested here")
    torch.manual_seed(seed)
    model = cls(config(**{**SMALL, **extra}))
    with torch.no_grad():  # adversarial norms: γ near 0 and large, every norm
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn(p.shape) * 3)
                p.view(-1)[0] = 1e-7
    return model


def _step(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16), ActivationLedger(model) as ledger:
        out = model(input_ids=ids).last_hidden_state
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads, ledger.activation_bytes


@pytest.mark.parametrize("name", list(FAMILIES))
def test_families_switch_q_k_v_and_gate_up_and_stay_bitwise(name):
    """apply_tempo switches q, k, v (and o: a no-op there) and the gated MLP's gate and up, never
    its down projection; under bf16 autocast outputs and gradients are bitwise those of the same
    patched model without the switch, and each layer keeps exactly the five bf16 copies fewer:
    10 bytes per token per hidden unit."""
    model = apply_tempo(family(name))
    layers = model.layers
    for layer in layers:
        attention = layer.self_attn
        assert {type(m) for m in attention.children() if isinstance(m, nn.Linear)} == {InputKeepingLinear}
        assert type(layer.mlp.gate_proj) is InputKeepingLinear and type(layer.mlp.up_proj) is InputKeepingLinear
        assert type(layer.mlp.down_proj) is nn.Linear
    ids = torch.randint(4, 100, (2, 9))
    out, grads, kept = _step(model, ids)
    restore_classes([(m, nn.Linear) for m in model.modules() if type(m) is InputKeepingLinear])
    out0, grads0, kept0 = _step(model, ids)
    assert torch.equal(out, out0)
    assert grads.keys() == grads0.keys() and all(torch.equal(grads[k], grads0[k]) for k in grads)
    h, tokens = model.config.hidden_size, ids.numel()
    assert kept0 - kept == len(layers) * tokens * 5 * h * 2


def test_revert_gives_nn_linear_back_and_copies_revert_on_their_own():
    model = apply_tempo(family("llama"))
    twin = copy.deepcopy(model)
    revert_tempo(model)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(type(m) is not InputKeepingLinear for m in model.modules())
    assert type(twin.layers[0].self_attn.q_proj) is InputKeepingLinear  # the copy keeps its own
    revert_tempo(twin)
    assert type(twin.layers[0].self_attn.q_proj) is nn.Linear


def test_only_plain_linears_beside_a_tempo_rmsnorm_are_switched():
    """A Linear subclass (a LoRA or quantized layer stands in) is left alone; an attention module
    with no Tempo RMSNorm beside it (a LayerNorm block) too; guards tripped."""

    class OtherLinear(nn.Linear):
        pass

    class TinyAttention(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.q, self.k = nn.Linear(h, h), OtherLinear(h, h)

    class Block(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm, self.attn = norm, TinyAttention(8)

    with_rms, with_ln = Block(InplaceRMSNorm(8)), Block(nn.LayerNorm(8))
    switched = keep_norm_outputs(nn.ModuleList([with_rms, with_ln]))
    assert switched == [(with_rms.attn.q, nn.Linear)]
    assert type(with_rms.attn.k) is OtherLinear and type(with_ln.attn.q) is nn.Linear
    restore_classes(switched)
    assert type(with_rms.attn.q) is nn.Linear
