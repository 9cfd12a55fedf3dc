"""apply_tempo on DeBERTa-v2/v3 (issue 21): GELU, LayerNorm and the residual dropout-add-LayerNorm
blocks swapped, attention left alone and said so; loss and every gradient as the unpatched model's
(fp32, dropout off), also with adversarial LayerNorm parameters (γ near 0, large β)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations.patch import FusedResidualOutput, apply_tempo, revert_tempo  # noqa: E402


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


def assert_same_gradients(grads, stock, exact):
    """Within 1e-5 relative L2 of the stock gradient, or, for gradients zero in exact arithmetic
    (the position-key bias: a per-row shift of the scores), rounding noise like the stock one's."""
    assert grads.keys() == stock.keys()
    for name in stock:
        if (grads[name] - stock[name]).norm() <= 1e-5 * stock[name].norm():
            continue
        stock_noise = (stock[name].double() - exact[name]).norm()
        assert exact[name].norm() < stock_noise, name  # only noise may differ
        assert (grads[name].double() - exact[name]).norm() <= 8 * stock_noise, name


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
    assert any("attention left as it is" in r.getMessage() for r in caplog.records)
    assert patched.config._attn_implementation == "eager"  # never claimed, never switched
    assert list(patched.state_dict()) == keys
    tempo_out, grads = run(patched)
    torch.testing.assert_close(tempo_out, out, rtol=1e-5, atol=1e-5)
    assert_same_gradients(grads, stock, exact)
    reverted = revert_tempo(patched)
    assert not any(isinstance(m, FusedResidualOutput) for m in reverted.modules())
    assert list(reverted.state_dict()) == keys


def test_deberta_with_dropout_fuses_the_same_dropout_rate():
    model = apply_tempo(deberta(hidden_dropout_prob=0.1))
    rates = {m.LayerNorm.p for m in model.modules() if isinstance(m, FusedResidualOutput)}
    assert rates == {0.1}
