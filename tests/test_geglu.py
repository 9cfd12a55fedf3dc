"""GeGLU fused with its projection (tempo.ops.geglu) and ModernBERT after apply_tempo (issue 21)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tempo.memory import ActivationLedger
from tempo.ops.geglu import geglu_linear

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations.patch import apply_tempo, revert_tempo  # noqa: E402


def stock(h, w, b, approximate):
    a, g = h.chunk(2, dim=-1)
    return F.linear(F.gelu(a, approximate=approximate) * g, w, b)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_equals_the_stock_ops(approximate, dtype):
    torch.manual_seed(0)
    h = (torch.randn(3, 5, 16, dtype=dtype) * 3).requires_grad_()
    w = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    b = torch.randn(6, dtype=dtype, requires_grad=True)
    out, ref = geglu_linear(h, w, b, approximate), stock(h, w, b, approximate)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the forward is the stock ops
    g = torch.randn_like(out)
    for x, y in zip(torch.autograd.grad(out, (h, w, b), g), torch.autograd.grad(ref, (h, w, b), g)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda h, w, b: geglu_linear(h, w, b, approximate), (h[:1, :2], w, b))


def test_bf16_autocast_matches_stock_autocast():
    torch.manual_seed(0)
    h = torch.randn(4, 32, requires_grad=True)
    w, b = torch.randn(8, 16, requires_grad=True), torch.randn(8, requires_grad=True)
    grads = []
    for fn in (geglu_linear, stock):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(h.to(torch.bfloat16), w, b, "none")
        assert out.dtype == torch.bfloat16
        grads.append(torch.autograd.grad(out.float().sum(), (h, w, b)))
    for x, y in zip(*grads):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)


def test_keeps_only_its_input():
    h = torch.randn(4, 7, 64, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        geglu_linear(h * 1.0, w, None)
    kept = sorted(t.numel() for t in saved if t.data_ptr() != w.data_ptr())
    assert kept == [4 * 7 * 64]  # h; the weight is a parameter (the ledger does not count it)


def test_no_backward_keeps_nothing():
    h, w = torch.randn(2, 8), torch.randn(3, 4)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: pytest.fail("kept a tensor"), lambda t: t):
        out = geglu_linear(h, w)
    torch.testing.assert_close(out, stock(h, w, None, "none"), rtol=0, atol=0)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="'approximate'"):
        geglu_linear(torch.randn(2, 8), torch.randn(3, 4), approximate="sigmoid")
    with pytest.raises(ValueError, match="'h'"):
        geglu_linear(torch.randn(2, 7), torch.randn(3, 4))
    with pytest.raises(ValueError, match="'weight'"):
        geglu_linear(torch.randn(2, 8), torch.randn(3, 5))


# ------------------------------------------------------------------------------------------------
# ModernBERT
# ------------------------------------------------------------------------------------------------
def modernbert(**overrides):
    config = transformers.ModernBertConfig(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, vocab_size=100,
        global_attn_every_n_layers=2, local_attention=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, attn_implementation="eager"), **overrides})
    return transformers.ModernBertForMaskedLM(config)


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids)


def loss_and_grads(model):
    model.zero_grad(set_to_none=True)
    loss = model(**batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_modernbert_mlp_fused_same_loss_gradients_and_keys(caplog):
    from tempo.ops.geglu import GegluMLP

    torch.manual_seed(0)
    model = modernbert().train()
    keys = list(model.state_dict())
    loss, grads = loss_and_grads(model)
    # attention=False: transformers' own sdpa and eager ModernBERT differ by up to 10% in layer 1's
    # attention gradients on this random model (Tempo's efficient attention equals its sdpa); here
    # the GeGLU, GELU and LayerNorm swaps are compared with the eager model.
    patched = apply_tempo(copy.deepcopy(model), attention=False)
    assert sum(isinstance(m, GegluMLP) for m in patched.modules()) == 2
    assert list(patched.state_dict()) == keys
    tempo_loss, tempo_grads = loss_and_grads(patched)
    torch.testing.assert_close(tempo_loss, loss, rtol=1e-6, atol=1e-6)
    assert tempo_grads.keys() == grads.keys()
    for name in grads:
        err = (tempo_grads[name] - grads[name]).norm() / grads[name].norm().clamp_min(1e-12)
        assert err < 1e-5, (name, err)
    reverted = revert_tempo(patched)
    assert not any(isinstance(m, GegluMLP) for m in reverted.modules())
    assert list(reverted.state_dict()) == keys


def test_modernbert_keeps_fewer_bytes_per_mlp():
    torch.manual_seed(0)
    kept = {}
    for name, model in (("stock", modernbert()), ("tempo", apply_tempo(modernbert(), attention=False,
                                                                       layernorm=False))):
        model.train()
        with ActivationLedger(model) as ledger:
            model(**batch()).loss
        kept[name] = ledger.by_module(depth=4)
    mlp = [k for k in kept["stock"] if k.endswith(".mlp")]
    assert mlp
    for key in mlp:
        # Stock: Wi's output (2I) + GELU's output (I) + the product (I); fused: Wi's output only.
        # (GELU is In-place elsewhere; inside the fused MLP none of it is kept.) 4 bytes, 60 tokens, I = 48.
        assert kept["stock"][key] - kept["tempo"][key] == 2 * 60 * 48 * 4, key


def test_mlp_dropout_set_on_a_model_in_eval_mode_keeps_the_fused_path():
    """A rate set on the MLP's nn.Dropout does nothing in eval mode (as in the stock MLP): the
    fused op runs and keeps Wi's output only, e.g. a frozen-dropout fine-tune with grad on."""
    torch.manual_seed(0)
    model = apply_tempo(modernbert(), attention=False, layernorm=False).eval()
    kept = {}
    for p in (0.0, 0.3):
        for layer in model.model.layers:
            layer.mlp.drop.p = p
        with ActivationLedger(model) as ledger:
            model(**batch()).loss
        kept[p] = {k: v for k, v in ledger.by_module(depth=4).items() if k.endswith(".mlp")}
    assert kept[0.0] and kept[0.3] == kept[0.0]


def test_modernbert_mlp_with_dropout_is_left_alone(caplog):
    from tempo.ops.geglu import GegluMLP

    with caplog.at_level("INFO", logger="tempo.integrations.patch"):
        model = apply_tempo(modernbert(mlp_dropout=0.1))
    assert not any(isinstance(m, GegluMLP) for m in model.modules())
    assert any("GeGLU MLP" in r.getMessage() and "left" in r.getMessage() for r in caplog.records)


def test_modernbert_on_the_meta_device():
    from tempo.ops.geglu import GegluMLP

    with torch.device("meta"):
        model = modernbert()
    apply_tempo(model)
    assert sum(isinstance(m, GegluMLP) for m in model.modules()) == 2
