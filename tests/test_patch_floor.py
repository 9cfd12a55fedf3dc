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
    # the loss: with Tempo's fused head a training call with labels forms no logits
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


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
    ref_loss, ref_grads = _grads(original, ids, mask)
    loss, grads = _grads(model, ids, mask)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
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
    assert got.logits is None  # training with labels: the fused head and loss form none
    torch.testing.assert_close(got.loss, ref.loss, atol=1e-5, rtol=1e-5)
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


# ---------------------------------------------------------------------------------------------
# The fused block against the block it replaced: eps, p, train/eval, which branch is dropped
# ---------------------------------------------------------------------------------------------
def _bert_for_fusion(dropout: float, eps: float):
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=64, hidden_dropout_prob=dropout,
                                     attention_probs_dropout_prob=0.0, layer_norm_eps=eps,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    with torch.no_grad():  # LayerNorm parameters that are not 1/0, so a wrong γ/β would show
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model


def _blocks(model):
    layer = model.encoder.layer[0]
    return {"attention.output": layer.attention.output, "output": layer.output}


def _block_inputs(block, scale: float = 0.1):
    """(sublayer input, residual) whose sum has a variance ~scale^2: eps = 0.05 is far from negligible."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, block.dense.in_features, generator=g) * scale
    r = torch.randn(2, 5, block.dense.out_features, generator=g) * scale
    return h, r


@pytest.mark.parametrize("where", ["attention.output", "output"])
def test_fused_block_is_the_replaced_block_in_eval_mode_at_its_eps(where):
    """Dropout 0.3 in eval mode, eps = 0.05 against inputs of variance ~0.01: a fused block built
    with another eps (BERT's 1e-12, LayerNorm's default 1e-5) or left in training mode differs."""
    model = _bert_for_fusion(dropout=0.3, eps=0.05).eval()
    stock = copy.deepcopy(model)
    apply_tempo(model)  # patched while in eval mode: the fused blocks must be in eval mode too
    fused, original = _blocks(model)[where], _blocks(stock)[where]
    assert isinstance(fused, FusedResidualOutput)
    h, r = _block_inputs(original)
    want = original(h, r)
    for _ in range(2):  # no dropout: the same output every time
        torch.testing.assert_close(fused(h, r), want, atol=1e-6, rtol=1e-6)
    model.train()
    model.eval()  # and back: .eval() reaches the fused LayerNorm
    torch.testing.assert_close(fused(h, r), want, atol=1e-6, rtol=1e-6)
    model.train()
    assert not torch.equal(fused(h, r), fused(h, r))  # .train() turns its dropout on
    # The whole model too: its embeddings' InplaceLayerNorm sees a variance ~1e-3, where eps = 0.05 dominates.
    ids, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   stock(input_ids=ids, attention_mask=mask).last_hidden_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("where", ["attention.output", "output"])
def test_fused_block_drops_the_sublayer_output_like_the_replaced_block(where):
    """Dropout 0.3 in training mode, compared with the original block given the very mask the fused
    block drew. The mask is read from the fused block's own gradients: d/d(dense output) =
    d/d(residual) x keep/(1-p), so their ratio is 0 or 1/(1-p) element by element. Output and every
    gradient (inputs and parameters) must then be the original block's with that mask: dropout on
    the residual instead, on both branches, after the LayerNorm, or with another p, all fail."""
    p = 0.3
    model = _bert_for_fusion(dropout=p, eps=0.05).train()
    stock = copy.deepcopy(model)
    apply_tempo(model)
    fused, original = _blocks(model)[where], _blocks(stock)[where]
    h, r = _block_inputs(original, scale=1.0)
    upstream = torch.randn(2, 5, original.dense.out_features, generator=torch.Generator().manual_seed(4))

    captured = {}

    def keep_dense_output(module, args, output):
        output.retain_grad()
        captured["x"] = output

    handle = fused.dense.register_forward_hook(keep_dense_output)
    h1, r1 = h.clone().requires_grad_(), r.clone().requires_grad_()
    y = fused(h1, r1)
    handle.remove()
    y.backward(upstream)
    ratio = captured["x"].grad / r1.grad
    kept = ratio != 0
    torch.testing.assert_close(ratio[kept], torch.full_like(ratio[kept], 1 / (1 - p)), atol=1e-5, rtol=1e-5)
    assert ((ratio == 0) | kept).all()
    assert 0.5 < kept.float().mean() < 0.9  # p = 0.3 of 320 elements

    class FixedMask(torch.nn.Module):
        def forward(self, x):
            return x * kept / (1 - p)

    original.dropout = FixedMask()
    h2, r2 = h.clone().requires_grad_(), r.clone().requires_grad_()
    want = original(h2, r2)
    want.backward(upstream)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r1.grad, r2.grad, atol=1e-5, rtol=1e-5)
    for name, param in original.named_parameters():
        torch.testing.assert_close(fused.get_parameter(name).grad, param.grad, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# Revert: module types, and Parameters replaced while patched
# ---------------------------------------------------------------------------------------------
def _types(model):
    return [(name, type(module)) for name, module in model.named_modules()]


def _logits(model, ids, mask):
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("replace", ["load_state_dict(assign=True)", "to_empty+load_state_dict", "new dense"])
def test_revert_after_parameters_were_replaced_while_patched(replace):
    """Whatever replaced the Parameters (or a block's dense module, as PEFT does) while the model was
    patched is what the original modules hold after revert_tempo: same types, same values, logits
    of a stock model holding those weights."""
    stock = _bert()
    types = _types(stock)
    model = copy.deepcopy(stock)
    apply_tempo(model)
    other = _bert()
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    weights = {k: v.clone() for k, v in other.state_dict().items()}
    if replace == "load_state_dict(assign=True)":
        model.load_state_dict(weights, assign=True)
    elif replace == "to_empty+load_state_dict":
        model.to_empty(device="cpu")
        model.load_state_dict(weights)
        for name, buffer in other.named_buffers():  # non-persistent buffers (position ids)
            model.get_buffer(name).copy_(buffer)
    else:
        block = model.bert.encoder.layer[1].output
        block.dense = torch.nn.Linear(block.dense.in_features, block.dense.out_features)
        with torch.no_grad():
            block.dense.weight.copy_(weights["bert.encoder.layer.1.output.dense.weight"])
            block.dense.bias.copy_(weights["bert.encoder.layer.1.output.dense.bias"])
        stock.load_state_dict({**stock.state_dict(), "bert.encoder.layer.1.output.dense.weight":
                               weights["bert.encoder.layer.1.output.dense.weight"],
                               "bert.encoder.layer.1.output.dense.bias":
                               weights["bert.encoder.layer.1.output.dense.bias"]})
        other = stock
    model.tie_weights()
    revert_tempo(model)
    assert _types(model) == types
    assert not any(isinstance(m, FusedResidualOutput) or type(m).__module__.startswith("tempo.")
                   for m in model.modules())
    ids, mask = _inputs()
    torch.testing.assert_close(_logits(model, ids, mask), _logits(other, ids, mask), atol=1e-5, rtol=1e-5)
    if replace == "new dense":
        assert model.bert.encoder.layer[1].output.dense is block.dense
    else:
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, weights[key], atol=0, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
