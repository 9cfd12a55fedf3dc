"""BertConfig validation and the BERT model: shapes, attention/layer variants agree, MLM on
masked positions, activation checkpointing, mixed precision, padding."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tempo.bert.config import BertConfig, ConfigError
from tempo.bert.model import (BertForPreTraining, BertForQuestionAnswering, BertModel, additive_attention_mask,
                              key_padding_mask, layer_attention_mask)
from tempo.choices import TempoChoice

REPO = Path(__file__).resolve().parents[1]

TINY = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16)


def tiny_config(**overrides) -> BertConfig:
    return BertConfig(**{**TINY, **overrides})


def no_dropout_config() -> BertConfig:
    return tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def padded_batch(vocab=101, batch=3, length=12):
    ids = torch.randint(1, vocab, (batch, length))
    types = torch.zeros_like(ids)
    types[:, length // 2:] = 1
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    ids = ids * mask
    return ids, types, mask


def require_tempo_layers(options: TempoChoice) -> None:
    """Skip when a Tempo layer this option set needs is not importable (yet)."""
    needed = []
    if options.gelu:
        needed.append("tempo.inplace_gelu")
    if options.layernorm:
        needed.append("tempo.inplace_layernorm")
    if options.attention == "tempo":
        needed.append("tempo.combined")
    for name in needed:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} not available")


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def write_config(tmp_path, **changes):
    d = {**TINY, "hidden_act": "gelu", "some_hf_only_key": [1, 2]}
    d.update(changes)
    d = {k: v for k, v in d.items() if v is not ...}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(d))
    return path


def test_config_reads_known_fields_and_ignores_unknown(tmp_path):
    cfg = BertConfig.from_json_file(write_config(tmp_path))
    assert cfg.hidden_size == 32 and cfg.layer_norm_eps == 1e-12 and cfg.hidden_act == "gelu"


@pytest.mark.parametrize("changes, field", [
    ({"hidden_size": ...}, "hidden_size"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"vocab_size": 30522.0}, "vocab_size"),
    ({"hidden_size": 30}, "hidden_size"),            # not divisible by 4 heads
    ({"intermediate_size": 0}, "intermediate_size"),
    ({"num_attention_heads": -2}, "num_attention_heads"),
    ({"hidden_dropout_prob": 1.0}, "hidden_dropout_prob"),
    ({"attention_probs_dropout_prob": -0.1}, "attention_probs_dropout_prob"),
    ({"hidden_act": "swish"}, "hidden_act"),
])
def test_config_errors_name_file_and_field(tmp_path, changes, field):
    path = write_config(tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        BertConfig.from_json_file(path)
    assert str(path) in str(err.value) and f"'{field}'" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_config_bad_json_and_missing_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        BertConfig.from_json_file(bad)
    with pytest.raises(ConfigError, match="nope.json"):
        BertConfig.from_json_file(tmp_path / "nope.json")


def test_config_json_round_trip(tmp_path):
    cfg = tiny_config(hidden_dropout_prob=0.05)
    cfg.to_json_file(tmp_path / "c.json")
    assert BertConfig.from_json_file(tmp_path / "c.json") == cfg
    assert BertConfig.from_dict(cfg.to_dict()) == cfg


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="hidden_size"):
        tiny_config(hidden_size=33)


@pytest.mark.parametrize("name, hidden, layers, heads", [
    ("tiny", 128, 2, 2), ("mini", 256, 4, 4), ("base", 768, 12, 12), ("large", 1024, 24, 16)])
def test_shipped_configs(name, hidden, layers, heads):
    cfg = BertConfig.from_json_file(REPO / "configs" / f"bert_{name}.json")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (hidden, layers, heads)
    assert cfg.intermediate_size == 4 * hidden and cfg.vocab_size == 30522
    assert cfg.padded_vocab_size == 30528


@pytest.mark.parametrize("vocab, padded", [(30522, 30528), (104, 104), (101, 104), (1, 8)])
def test_padded_vocab_size(vocab, padded):
    assert tiny_config(vocab_size=vocab).padded_vocab_size == padded


# ---------------------------------------------------------------------------------------------
# Model structure
# ---------------------------------------------------------------------------------------------
def test_invalid_attention_name():
    with pytest.raises(ValueError, match="flash.*eager.*tempo.*sdpa"):
        BertModel(tiny_config(), TempoChoice(attention="flash"))
    with pytest.raises(ValueError, match="nope"):
        TempoChoice.full(attention="nope")


def test_option_presets():
    assert TempoChoice.original() == TempoChoice()
    assert TempoChoice.full() == TempoChoice(gelu=True, layernorm=True, attention="tempo")
    assert TempoChoice.original("sdpa").attention == "sdpa"


def test_shapes_names_and_init():
    cfg = tiny_config()
    ids, types, mask = padded_batch()
    model = BertForPreTraining(cfg)
    names = set(model.state_dict())
    for key in ["bert.embeddings.word_embeddings.weight",
                "bert.encoder.layer.1.attention.self.query.weight",
                "bert.encoder.layer.0.attention.output.LayerNorm.bias",
                "bert.encoder.layer.0.intermediate.dense.weight",
                "bert.encoder.layer.0.output.LayerNorm.weight",
                "bert.pooler.dense.weight", "cls.predictions.bias",
                "cls.predictions.transform.LayerNorm.weight", "cls.seq_relationship.weight"]:
        assert key in names, key
    # padded vocab everywhere, decoder tied to the word embedding
    emb = model.bert.embeddings.word_embeddings.weight
    assert emb.shape == (104, 32)
    assert model.cls.predictions.decoder.weight is emb
    assert model.cls.predictions.bias.shape == (104,)
    # Google/DLE init
    assert torch.all(model.bert.encoder.layer[0].output.LayerNorm.weight == 1)
    assert torch.all(model.bert.encoder.layer[0].attention.self.query.bias == 0)
    assert 0.015 < model.bert.encoder.layer[0].intermediate.dense.weight.std() < 0.025

    out = model(ids, types, mask)
    assert out.prediction_scores.shape == (3, 12, 104)
    assert out.seq_relationship_score.shape == (3, 2)
    assert out.loss is None

    positions = torch.tensor([[1, 2, 0], [4, 0, 0], [1, 2, 0]])
    out = model(ids, types, mask, masked_lm_positions=positions)
    assert out.prediction_scores.shape == (3, 3, 104)

    base = BertModel(cfg)
    hidden, pooled, layout = base(ids)
    assert hidden.shape == (3, 12, 32) and pooled.shape == (3, 32) and layout is None

    qa = BertForQuestionAnswering(cfg)
    assert not any(k.startswith("bert.pooler") for k in qa.state_dict())
    assert "qa_outputs.weight" in qa.state_dict()
    start, end = qa(ids, types, mask)[1:]
    assert start.shape == end.shape == (3, 12)


def test_sequence_longer_than_positions_is_a_clear_error():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        BertModel(tiny_config())(torch.ones(1, 17, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Variants agree
# ---------------------------------------------------------------------------------------------
VARIANTS = {
    "sdpa": TempoChoice.original("sdpa"),
    "tempo-attention": TempoChoice(attention="tempo"),
    "tempo-gelu": TempoChoice(gelu=True),
    "tempo-layernorm": TempoChoice(layernorm=True),
    "tempo-full": TempoChoice.full(),
    "tempo-full-sdpa": TempoChoice.full(attention="sdpa"),
    "tempo-ln-attention": TempoChoice(layernorm=True, attention="tempo"),
    "efficient": TempoChoice(attention="efficient"),
    "dropout-add-layernorm": TempoChoice(dropout_add_layernorm=True),
    "tempo-floor": TempoChoice.floor(),
}


def pretraining_step(model, ids, types, mask, positions, labels, nsp):
    model.zero_grad(set_to_none=True)
    out = model(ids, types, mask, positions, labels, nsp)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def mlm_batch():
    ids, types, mask = padded_batch()
    positions = torch.tensor([[1, 5, 9], [2, 6, 0], [1, 0, 0]])
    labels = torch.tensor([[3, 4, 5], [6, 7, -1], [8, -1, -1]])
    nsp = torch.tensor([0, 1, 1])
    return ids, types, mask, positions, labels, nsp


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_eager_fp32(variant):
    options = VARIANTS[variant]
    require_tempo_layers(options)
    cfg = no_dropout_config()
    reference = BertForPreTraining(cfg)
    model = BertForPreTraining(cfg, options)
    model.load_state_dict(reference.state_dict())
    batch = mlm_batch()
    ids, types, mask = batch[:3]

    reference.eval(), model.eval()
    with torch.no_grad():
        ref_hidden = reference.bert(ids, types, mask).last_hidden_state
        hidden = model.bert(ids, types, mask).last_hidden_state
    # padded query positions differ by construction only through the values they attend to,
    # which are the same here; compare everything.
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)

    reference.train(), model.train()  # dropout is 0, so train mode is deterministic
    ref_out, ref_grads = pretraining_step(reference, *batch)
    out, grads = pretraining_step(model, *batch)
    torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("variant", ["sdpa", "tempo-ln-attention", "tempo-full", "tempo-floor"])
def test_variants_match_eager_bf16_autocast(variant):
    options = VARIANTS[variant]
    require_tempo_layers(options)
    cfg = no_dropout_config()
    reference = BertForPreTraining(cfg).eval()
    model = BertForPreTraining(cfg, options).eval()
    model.load_state_dict(reference.state_dict())
    ids, types, mask = padded_batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference.bert(ids, types, mask).last_hidden_state.float()
        got = model.bert(ids, types, mask).last_hidden_state.float()
    # bf16 has ~3 significant digits; post-LN outputs are O(1).
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)


def test_padding_does_not_leak_into_real_tokens():
    """A sample's real-token outputs do not depend on what sits in its padded positions."""
    model = BertModel(no_dropout_config()).eval()
    ids, types, mask = padded_batch()
    noisy = ids.clone()
    noisy[mask == 0] = 77
    with torch.no_grad():
        a = model(ids, types, mask).last_hidden_state
        b = model(noisy, types, mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa", "tempo", "efficient"])
def test_the_mask_each_attention_gets(attention):
    """No mask where none is needed (sdpa and the efficient attention: nothing padded, or an
    unpadded batch), so the fused kernels that take no mask (flash) stay on offer; a bool
    key-padding mask for the efficient attention; the additive mask otherwise."""
    from tempo.unpad import TokenLayout

    _, _, padded = padded_batch()
    full = torch.ones_like(padded)
    fused = attention in ("sdpa", "efficient")
    for mask, layout in ((full, None), (padded, None), (padded, TokenLayout.from_mask(padded))):
        got = layer_attention_mask(attention, mask, layout, torch.float16)
        if fused and (layout is not None or bool(mask.all())):
            assert got is None
        elif attention == "efficient":
            assert got.dtype == torch.bool and torch.equal(got, key_padding_mask(mask))
        else:
            assert torch.equal(got, additive_attention_mask(mask, torch.float16))


@pytest.mark.parametrize("attention", ["eager", "sdpa", "tempo", "efficient"])
def test_fully_masked_sample_gives_no_nan(attention):
    options = TempoChoice(attention=attention)
    require_tempo_layers(options)
    model = BertForPreTraining(tiny_config(), options)
    ids, types, mask = padded_batch()
    mask[0] = 0
    out = model(ids, types, mask, masked_lm_labels=torch.full_like(ids, -1))
    assert torch.isfinite(out.prediction_scores).all()
    assert out.loss == 0  # no label anywhere: zero, not NaN
    for dtype in (torch.float16, torch.bfloat16):
        additive = additive_attention_mask(mask, dtype)
        scores = torch.full((3, 2, 12, 12), -30000.0, dtype=dtype) + additive
        assert not torch.isnan(torch.softmax(scores.float(), -1)).any()
        # The bool mask (sdpa, the fused kernels) says the same: the empty sample attends every
        # position (a row of False is NaN or 0 depending on the backend), the others their tokens.
        assert torch.equal(key_padding_mask(mask), additive == 0)
        assert key_padding_mask(mask)[0].all()


# ---------------------------------------------------------------------------------------------
# MLM on masked positions
# ---------------------------------------------------------------------------------------------
def test_mlm_on_positions_equals_full_sequence_loss():
    model = BertForPreTraining(no_dropout_config()).eval()
    ids, types, mask, positions, labels, nsp = mlm_batch()
    full_labels = torch.full_like(ids, -1)
    for b in range(ids.shape[0]):
        for p, label in zip(positions[b], labels[b]):
            if label >= 0:
                full_labels[b, p] = label
    with torch.no_grad():
        gathered = model(ids, types, mask, positions, labels, nsp)
        full = model(ids, types, mask, None, full_labels, nsp)
    torch.testing.assert_close(gathered.mlm_loss, full.mlm_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gathered.nsp_loss, full.nsp_loss)
    torch.testing.assert_close(gathered.loss, gathered.mlm_loss + gathered.nsp_loss)
    expected = torch.stack([full.prediction_scores[b, positions[b]] for b in range(3)])
    torch.testing.assert_close(gathered.prediction_scores, expected, atol=1e-6, rtol=1e-6)

    only_mlm = model(ids, types, mask, positions, labels)
    assert only_mlm.nsp_loss is None and torch.equal(only_mlm.loss, only_mlm.mlm_loss)


def test_question_answering_loss_clamps_positions():
    model = BertForQuestionAnswering(no_dropout_config())
    ids, types, mask = padded_batch()
    start = torch.tensor([1, 30, 2])   # 30 is outside the 12-token window: ignored
    end = torch.tensor([3, 40, -5])    # -5 clamps to 0
    out = model(ids, types, mask, start, end)
    ce = torch.nn.functional.cross_entropy
    expected_start = ce(out.start_logits[[0, 2]], start[[0, 2]])
    expected_end = ce(out.end_logits[[0, 2]], torch.tensor([3, 0]))
    torch.testing.assert_close(out.loss, (expected_start + expected_end) / 2)
    out.loss.backward()


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("variant", ["original", "tempo-ln-attention", "tempo-full"])
def test_checkpoint_activations_is_exact(dropout, variant):
    options = TempoChoice.original() if variant == "original" else VARIANTS[variant]
    require_tempo_layers(options)
    cfg = tiny_config(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    plain = BertForPreTraining(cfg, options)
    ckpt = copy.deepcopy(plain)
    ckpt.bert.encoder.checkpoint_activations = True
    batch = mlm_batch()

    torch.manual_seed(1234)
    ref_out, ref_grads = pretraining_step(plain, *batch)
    torch.manual_seed(1234)
    out, grads = pretraining_step(ckpt, *batch)
    torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_checkpoint_activations_constructor_flag():
    model = BertModel(tiny_config(), checkpoint_activations=True)
    assert model.encoder.checkpoint_activations
    assert BertForPreTraining(tiny_config(), None, True).bert.encoder.checkpoint_activations


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("variant", ["original", "tempo-ln-attention", "tempo-full"])
def test_forward_backward_runs(autocast, variant):
    options = TempoChoice.original() if variant == "original" else VARIANTS[variant]
    require_tempo_layers(options)
    model = BertForPreTraining(tiny_config(), options, checkpoint_activations=True)
    ids, types, mask, positions, labels, nsp = mlm_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, types, mask, positions, labels, nsp)
    if autocast:
        assert out.prediction_scores.dtype == torch.bfloat16
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_floor_keeps_less_than_the_paper_layers_and_nothing_quadratic():
    """Bytes autograd keeps per added token: the floor choice keeps no s x s tensor, so its bytes per
    token do not grow with s, and it keeps less than the paper's three layers."""
    from tempo.memory import ActivationLedger

    cfg = tiny_config(max_position_embeddings=64)

    def per_token(choice, seq):
        torch.manual_seed(0)
        model = BertForPreTraining(cfg, choice).train()
        sizes = []
        for batch in (1, 2):
            ids = torch.randint(0, cfg.vocab_size, (batch, seq))
            with ActivationLedger(model) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
                model(ids, masked_lm_labels=ids)
            sizes.append(ledger.activation_bytes)
        return (sizes[1] - sizes[0]) / seq

    floor = [per_token(TempoChoice.floor(), s) for s in (8, 32)]
    paper = [per_token(TempoChoice.full(), s) for s in (8, 32)]
    # O(s) attention: per token the same bytes at every length, up to the per-sequence heads
    # (pooler, NSP) spread over the tokens; the paper's Combined keeps the s x s probabilities.
    assert abs(floor[1] - floor[0]) < 0.01 * floor[0]
    assert paper[1] - paper[0] > 0.05 * paper[0]
    assert floor[0] < paper[0]


# ---------------------------------------------------------------------------------------------
# GELU forms (hidden_act)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden_act, form", [
    ("gelu", "none"), ("gelu_python", "none"),
    ("gelu_new", "tanh"), ("gelu_pytorch_tanh", "tanh"), ("gelu_python_tanh", "tanh"), ("gelu_fast", "tanh"),
])
def test_hidden_act_names_a_gelu_form(hidden_act, form):
    cfg = tiny_config(hidden_act=hidden_act)
    assert cfg.gelu_approximate == form
    for options in (TempoChoice.original(), TempoChoice.full(["gelu"])):
        require_tempo_layers(options)
        model = BertForPreTraining(cfg, options)
        acts = [model.bert.encoder.layer[0].intermediate.act, model.cls.predictions.transform.transform_act_fn]
        for act in acts:
            assert act.approximate == form
            assert type(act).__name__ == ("InplaceGelu" if options.gelu else "GELU")


def test_unknown_hidden_act_lists_the_choices(tmp_path):
    path = write_config(tmp_path, hidden_act="quick_gelu")
    with pytest.raises(ConfigError) as err:
        BertConfig.from_json_file(path)
    message = str(err.value)
    assert str(path) in message and "'hidden_act'" in message and "'quick_gelu'" in message
    for name in ("'gelu'", "'gelu_new'", "'gelu_pytorch_tanh'", "'gelu_fast'"):
        assert name in message


def test_with_gelu_overrides_the_form():
    exact = tiny_config()
    assert exact.with_gelu(None) is exact and exact.with_gelu("none") is exact
    tanh = exact.with_gelu("tanh")
    assert tanh.hidden_act == "gelu_pytorch_tanh" and tanh.gelu_approximate == "tanh" and exact.hidden_act == "gelu"
    assert tiny_config(hidden_act="gelu_new").with_gelu("tanh").hidden_act == "gelu_new"  # name kept
    assert tanh.with_gelu("none").hidden_act == "gelu"
    with pytest.raises(ConfigError, match="'sigmoid'"):
        exact.with_gelu("sigmoid")


@pytest.mark.parametrize("options", [TempoChoice.original(), TempoChoice.full()], ids=["original", "tempo"])
def test_tanh_and_exact_models_differ_only_in_the_gelu(options):
    """Same weights, fp32: the tanh model equals a copy whose GELUs were swapped for
    nn.GELU("tanh") by hand, and differs from the exact one by a GELU-sized amount."""
    require_tempo_layers(options)
    torch.manual_seed(0)
    exact = BertForPreTraining(no_dropout_config(), options).eval()
    tanh = BertForPreTraining(no_dropout_config().with_gelu("tanh"), options).eval()
    tanh.load_state_dict(exact.state_dict())
    by_hand = copy.deepcopy(exact)
    for layer in by_hand.bert.encoder.layer:
        layer.intermediate.act = torch.nn.GELU(approximate="tanh")
    by_hand.cls.predictions.transform.transform_act_fn = torch.nn.GELU(approximate="tanh")
    ids, types, mask = padded_batch()
    with torch.no_grad():
        a = tanh(ids, types, mask).prediction_scores
        b = by_hand(ids, types, mask).prediction_scores
        c = exact(ids, types, mask).prediction_scores
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert (a - c).abs().max() > 1e-6


@pytest.mark.parametrize("name, fused", [("floor", True), ("default", True), ("paper", False)])
def test_the_floor_and_the_default_pretrain_through_the_fused_head_the_papers_layers_do_not(name, fused,
                                                                                            monkeypatch):
    """TempoChoice.floor(): every Tempo layer and the fused LM head and loss (its docstring); the
    default is the floor; the paper's three layers (full()) keep the stock head. Seen in a training
    forward with masked-LM labels: the fused op runs or it does not."""
    import tempo.bert.model as bert_model

    choice = {"floor": TempoChoice.floor(), "default": TempoChoice.default(), "paper": TempoChoice.full()}[name]
    calls = []
    real = bert_model.linear_cross_entropy
    monkeypatch.setattr(bert_model, "linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = tiny_config()
    torch.manual_seed(0)
    model = BertForPreTraining(cfg, choice).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    out = model(ids, masked_lm_labels=ids)
    assert choice.lm_loss is fused and bool(calls) is fused and torch.isfinite(out.loss)
