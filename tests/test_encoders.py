"""apply_tempo on DeBERTa-v2/v3 (issue 21): GELU, LayerNorm, the residual dropout-add-LayerNorm
blocks and the attention core (softmax -> dropout -> bmm as Combined, relative-position bias
untouched) swapped; loss and every gradient as the unpatched model's (fp32, dropout off), also
with adversarial LayerNorm parameters (γ near 0, large β); the bytes the core keeps, exactly."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations.deberta import DebertaCombinedAttention, DebertaEfficientAttention  # noqa: E402
from tempo.integrations.patch import FusedResidualOutput, apply_tempo, revert_tempo, tempo_patched  # noqa: E402
from tempo.memory import ActivationLedger  # noqa: E402


def deberta(**overrides):
    config = transformers.DebertaV2Config(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, relative_attention=True,
        pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=-1, norm_rel_ebd="layer_norm"),
        **overrides})
    return transformers.DebertaV2Model(config)


def run(model, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=dtype)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


NOISE_FACTOR = 8  # as tests/test_exactness.py: Tempo's rounding may differ from stock's, not its accuracy


def assert_same_gradients(grads, stock, exact):
    """Within 1e-5 relative L2 of the stock gradient; where they differ more, the gradient is one
    that cancels (the key and position-key biases: nearly or exactly a per-row shift of the
    scores, whose softmax gradient sums to ~0; amplified by γ near 0), and Tempo's distance to the
    fp64 gradient must then stay within a few times the stock fp32 model's own. A wrong gradient
    (the old LayerNorm recovery: 20-30 % off) fails either way."""
    assert grads.keys() == stock.keys()
    for name in stock:
        if (grads[name] - stock[name]).norm() <= 1e-5 * stock[name].norm():
            continue
        stock_error = (stock[name].double() - exact[name]).norm()
        tempo_error = (grads[name].double() - exact[name]).norm()
        assert tempo_error <= NOISE_FACTOR * stock_error, (name, float(exact[name].norm()), float(stock_error),
                                                           float(tempo_error))


@pytest.mark.parametrize("adversarial", [False, True], ids=["init", "gamma-near-zero"])
def test_deberta_fused_blocks_same_outputs_and_gradients(adversarial, caplog):
    torch.manual_seed(0)
    model = deberta().train()
    if adversarial:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.LayerNorm):
                    module.weight[:3] = torch.tensor([0.0, 1e-30, 1e-6])
                    module.bias[:3] = torch.tensor([10.0, -10.0, 3.0])
    keys = list(model.state_dict())
    out, stock = run(model)
    _, exact = run(copy.deepcopy(model).double(), torch.float64)
    with caplog.at_level("INFO", logger="tempo.integrations.patch"):
        patched = apply_tempo(copy.deepcopy(model))
    assert sum(isinstance(m, FusedResidualOutput) for m in patched.modules()) == 4
    assert sum(isinstance(m, DebertaEfficientAttention) for m in patched.modules()) == 2
    assert any("replaced 2 DeBERTa attention -> DebertaEfficientAttention" in r.getMessage() for r in caplog.records)
    assert not any("attention left as it is" in r.getMessage() for r in caplog.records)
    assert patched.config._attn_implementation == "eager"  # its own modules, not the AttentionInterface
    assert list(patched.state_dict()) == keys
    tempo_out, grads = run(patched)
    torch.testing.assert_close(tempo_out, out, rtol=1e-5, atol=1e-5)
    assert_same_gradients(grads, stock, exact)
    reverted = revert_tempo(patched)
    assert not any(isinstance(m, (FusedResidualOutput, DebertaEfficientAttention)) for m in reverted.modules())
    assert list(reverted.state_dict()) == keys
    _, reverted_grads = run(reverted)
    assert_same_gradients(reverted_grads, stock, exact)


def test_deberta_with_dropout_fuses_the_same_dropout_rate():
    model = apply_tempo(deberta(hidden_dropout_prob=0.1))
    rates = {m.LayerNorm.p for m in model.modules() if isinstance(m, FusedResidualOutput)}
    assert rates == {0.1}


def _kept_bytes(model, batch=2, seq=12):
    ids = torch.randint(3, 100, (batch, seq), generator=torch.Generator().manual_seed(1))
    with ActivationLedger(model) as ledger:
        model(input_ids=ids).last_hidden_state.sum()
    return ledger.activation_bytes


@pytest.mark.parametrize("share_att_key", [False, True])
def test_deberta_attention_core_keeps_the_probabilities_only(share_att_key):
    """Per layer, eager keeps the softmax output, the dropout mask and the dropout output (fp32: 4
    bytes) per score; the Combined core the softmax output and an 8-byte seed. (The mask is 1
    byte per score on CUDA, dropout's float noise on the CPU: measured here, not assumed.)"""
    torch.manual_seed(0)
    model = deberta(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1, share_att_key=share_att_key).train()
    stock = _kept_bytes(model)
    patched = apply_tempo(copy.deepcopy(model), gelu=False, layernorm=False, attention="tempo",
                          dropout_add_layernorm=False)
    assert tempo_patched(patched)["DebertaCombinedAttention"] == 2
    scores = 2 * 2 * 12 * 12  # batch x heads x s x s
    with ActivationLedger() as dropout:
        torch.nn.functional.dropout(torch.rand(scores, requires_grad=True) + 0, 0.1, True)
    mask_bytes = dropout.activation_bytes
    assert mask_bytes in (scores, 4 * scores)  # bool mask, or the CPU's float noise
    assert stock - _kept_bytes(patched) == 2 * (mask_bytes + 4 * scores - 8)


@pytest.mark.parametrize("attention", ["efficient", "tempo"])
def test_deberta_attention_with_dropout_trains_and_replays(attention):
    """Dropout on: the core draws its mask from a seed; a no-grad pass and its replay with grad
    from the same RNG state agree (GradCache), and a backward reaches every attention weight."""
    torch.manual_seed(0)
    model = apply_tempo(deberta(attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.1), attention=attention).train()
    ids = torch.randint(3, 100, (2, 12))
    state = torch.get_rng_state()
    with torch.no_grad():
        first = model(input_ids=ids).last_hidden_state
    torch.set_rng_state(state)
    second = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(first, second.detach(), rtol=1e-5, atol=1e-5)
    second.square().sum().backward()
    core = model.encoder.layer[0].attention.self
    assert isinstance(core, DebertaEfficientAttention if attention == "efficient" else DebertaCombinedAttention)
    for name, param in core.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_deberta_attention_choices(caplog):
    """The default and attention='efficient' swap the core for the O(s) disentangled attention;
    attention='tempo' for the paper's Combined; False leaves it."""
    from tempo.integrations.deberta import DebertaEfficientAttention

    model = deberta()
    for attention in (None, "efficient"):
        patched = apply_tempo(copy.deepcopy(model), attention=attention)
        assert tempo_patched(patched)["DebertaEfficientAttention"] == 2
        assert sum(isinstance(m, DebertaEfficientAttention) for m in patched.modules()) == 2
    assert tempo_patched(apply_tempo(copy.deepcopy(model), attention="tempo"))["DebertaCombinedAttention"] == 2
    left = tempo_patched(apply_tempo(copy.deepcopy(model), attention=False))
    assert "DebertaCombinedAttention" not in left and "DebertaEfficientAttention" not in left


def test_deberta_attention_weights_come_from_the_original_forward(caplog, monkeypatch):
    import tempo.integrations.deberta as deberta_module

    monkeypatch.setattr(deberta_module, "_logged_reasons", set())  # logged once per process
    torch.manual_seed(0)
    model = deberta().eval()
    ids = torch.randint(3, 100, (2, 12))
    want = model(input_ids=ids, output_attentions=True).attentions
    patched = apply_tempo(copy.deepcopy(model))
    with caplog.at_level("INFO", logger="tempo.integrations.deberta"):
        got = patched(input_ids=ids, output_attentions=True).attentions
    assert len(got) == 2 and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))
    assert sum("attention probabilities" in r.getMessage() for r in caplog.records) == 1


def test_deberta_on_the_meta_device_then_loaded():
    """Built on meta, patched, materialised and loaded: the stock model's state dict loads and the
    outputs agree."""
    torch.manual_seed(0)
    stock = deberta().eval()
    with torch.device("meta"):
        model = deberta()
    apply_tempo(model)
    assert tempo_patched(model)["DebertaEfficientAttention"] == 2
    model.to_empty(device="cpu")
    model.load_state_dict(stock.state_dict())
    for name, buffer in stock.named_buffers():  # non-persistent ones (position ids) are not in the state dict
        model.get_buffer(name).copy_(buffer)
    model.eval()
    ids = torch.randint(3, 100, (2, 12))
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, stock(input_ids=ids).last_hidden_state,
                               rtol=1e-5, atol=1e-5)
