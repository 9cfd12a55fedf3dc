"""apply_tempo down to the floor on HF models: efficient attention and fused dropout-add-LayerNorm."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tempo.integrations.patch import FusedResidualOutput, apply_tempo, revert_tempo, tempo_patched  # noqa: E402
from tempo.memory import ActivationLedger  # noqa: E402


def _bert(dropout: float = 0.0, layers: int = 2):
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config)


def _inputs(batch: int = 3, length: int = 12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 99, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 8:] = 0  # padding in one sequence
    return ids, mask


def _grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_bert_floor_matches_the_original_and_reverts():
    original = _bert()
    model = copy.deepcopy(original)
    keys = list(model.state_dict())
    apply_tempo(model, attention="efficient", dropout_add_layernorm=True)
    assert tempo_patched(model)["FusedResidualOutput"] == 4  # two residual blocks per layer
    assert tempo_patched(model)["attention"] == 1
    assert list(model.state_dict()) == keys  # same keys: checkpoints load both ways
    # LayerNorms inside the fused blocks are fused, not swapped on their own.
    assert tempo_patched(model)["InplaceLayerNorm"] == 2  # embeddings + MLM head transform

    ids, mask = _inputs()
    original.train(), model.train()  # dropout 0: train mode is deterministic
    ref_logits, ref_grads = _grads(original, ids, mask)
    logits, grads = _grads(model, ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(logits[keep], ref_logits[keep], atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")

    revert_tempo(model)
    assert not any(isinstance(m, FusedResidualOutput) for m in model.modules())
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                               original(input_ids=ids, attention_mask=mask).logits)


def test_fused_blocks_keep_no_mask_and_the_floor_keeps_less():
    def per_token(apply):
        model = _bert(dropout=0.1)
        apply(model)
        model.train()
        sizes = []
        for batch in (1, 2):
            ids = torch.randint(0, 99, (batch, 32))
            with ActivationLedger(model) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
                model(input_ids=ids, labels=ids)
            sizes.append(ledger.activation_bytes)
        return (sizes[1] - sizes[0]) / 32

    paper = per_token(lambda m: apply_tempo(m, attention="tempo", dropout_add_layernorm=False))
    floor = per_token(lambda m: apply_tempo(m, attention="efficient", dropout_add_layernorm=True))
    assert floor < paper
    assert per_token(apply_tempo) == floor  # the default is the floor


def test_unknown_attention_argument_is_named():
    with pytest.raises(ValueError, match="'attention'"):
        apply_tempo(_bert(), attention="flash")


def test_gpt2_causal_efficient_attention_matches():
    config = transformers.GPT2Config(vocab_size=99, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    original = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(original)
    apply_tempo(model, attention="efficient")
    assert model.config._attn_implementation == "tempo_efficient"
    ids = torch.randint(0, 99, (2, 16))
    original.train(), model.train()
    for m in (original, model):
        m.zero_grad(set_to_none=True)
    ref = original(input_ids=ids, labels=ids)
    got = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), original.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_meta_model_can_be_fused_then_materialised():
    with torch.device("meta"):
        model = _bert()
    apply_tempo(model, attention="efficient", dropout_add_layernorm=True)
    model.to_empty(device="cpu")
    model.init_weights()
    ids, mask = _inputs()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    assert torch.isfinite(out.loss)
