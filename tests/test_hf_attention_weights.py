"""Attention weights from a patched HF model are eager's: BERT (padding), GPT-2 (causality, left and
right padding) and ModernBERT (padding, sliding windows), for both Tempo attentions, asked for per call
(``output_attentions=True``) or by the config (``model.config.output_attentions = True``)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tempo.integrations import hf_attention  # noqa: E402
from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched  # noqa: E402

IMPLEMENTATIONS = {"tempo": "tempo", "efficient": "tempo_efficient"}


def bert():
    return transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        attn_implementation="eager"))


def gpt2():
    return transformers.GPT2Model(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager"))


def modernbert():
    # Layer 0 global, layers 1 and 2 sliding: each token sees the keys within 2 positions of it.
    return transformers.ModernBertModel(transformers.ModernBertConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=64, global_attn_every_n_layers=3, local_attention=4, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, attn_implementation="eager"))


def batch(padding: str, length: int = 10):
    ids = torch.randint(3, 100, (3, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    if padding in ("right", "both"):
        mask[1, length - 4:] = 0
    if padding in ("left", "both"):
        mask[2, :3] = 0
    return ids, (None if padding == "none" else mask)


CASES = [
    # (model, padding, length): what masks the scores there
    pytest.param(bert, "right", 10, id="bert-padding"),
    pytest.param(bert, "none", 10, id="bert-no-mask"),
    pytest.param(gpt2, "none", 10, id="gpt2-causal-only"),  # sdpa's mask function leaves causality to is_causal
    pytest.param(gpt2, "both", 10, id="gpt2-causal-padding"),
    pytest.param(modernbert, "right", 10, id="modernbert-sliding-padding"),
    pytest.param(modernbert, "none", 10, id="modernbert-sliding"),  # the window alone masks
    pytest.param(modernbert, "none", 3, id="modernbert-window-covers-all"),  # nothing masks: no mask
]


def run(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kwargs)


def assert_same(got, want):
    assert len(got.attentions) == len(want.attentions) > 0
    for layer, (a, b) in enumerate(zip(got.attentions, want.attentions)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=lambda m, layer=layer: f"layer {layer}: {m}")
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("build,padding,length", CASES)
def test_weights_per_call_are_eagers(build, padding, length, attention):
    torch.manual_seed(0)
    stock = build().eval()
    model = apply_tempo(copy.deepcopy(stock), attention=attention)
    assert model.config._attn_implementation == IMPLEMENTATIONS[attention]
    ids, mask = batch(padding, length)
    want = run(stock, ids, mask, output_attentions=True)
    masked = padding != "none" or build is gpt2 or (build is modernbert and length > 4)
    assert bool((want.attentions[-1] == 0).any()) == masked  # the case masks keys (or none) as it says
    assert_same(run(model, ids, mask, output_attentions=True), want)
    plain = run(model, ids, mask)  # a call without weights runs Tempo's attention: same output
    assert plain.attentions is None
    # at real tokens: a padded query whose every key is masked gets eager's uniform row, the
    # efficient attention's zeros (both are garbage no loss reads)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(plain.last_hidden_state[real], want.last_hidden_state[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("build", [bert, gpt2, modernbert])
def test_weights_by_config_switch(build, attention):
    """``model.config.output_attentions = True`` works on a patched model (transformers 5.x refuses it
    for any implementation but eager); the weights are eager's; revert gives the config class back."""
    torch.manual_seed(0)
    stock = build().eval()
    model = apply_tempo(copy.deepcopy(stock), attention=attention)
    config_class = type(stock.config)
    ids, mask = batch("right")
    model.config.output_attentions = True
    assert model.config.output_attentions is True
    stock.config.output_attentions = True
    assert_same(run(model, ids, mask), run(stock, ids, mask))
    model.config.output_attentions = False
    assert run(model, ids, mask).attentions is None
    # Only this instance accepts it: another config of the same class still refuses, as transformers does.
    other = config_class(attn_implementation="sdpa")
    with pytest.raises(ValueError, match="output_attentions"):
        other.output_attentions = True
    revert_tempo(model)
    assert type(model.config) is config_class and tempo_patched(model)["attention"] == 0
    assert model.config._attn_implementation == "eager"


def test_patched_config_copies_pickles_saves_and_validates(tmp_path):
    model = apply_tempo(bert(), gelu=False)
    config = model.config
    config.output_attentions = True
    assert type(config).__name__ == "BertConfig" and isinstance(config, transformers.BertConfig)
    for copied in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert type(copied) is type(config) and copied == config and copied.output_attentions is True
    config.validate()
    config.save_pretrained(tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is transformers.BertConfig and loaded.output_attentions is True
    revert_tempo(model)
    assert type(config) is transformers.BertConfig


def test_eager_attention_mask_from_sdpa_masks():
    """The conversion itself: bool -> 0 / finfo.min in the parameters' dtype; None -> causal when causal."""
    module = torch.nn.Linear(2, 2).to(torch.float64)
    q, k = torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)
    keep = torch.tensor([[True, False, True]]).view(1, 1, 1, 3)
    mask = hf_attention.eager_attention_mask(module, q, k, keep, is_causal=False)
    assert mask.dtype == torch.float64
    assert mask.tolist() == [[[[0.0, torch.finfo(torch.float64).min, 0.0]]]]
    assert hf_attention.eager_attention_mask(module, q, k, None, is_causal=False) is None
    causal = hf_attention.eager_attention_mask(module, q, k, None, is_causal=True)
    assert (causal == 0).squeeze().tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    additive = torch.randn(1, 1, 3, 3)
    assert hf_attention.eager_attention_mask(module, q, k, additive, is_causal=True) is additive
    one_query = hf_attention.eager_attention_mask(module, q[:, :, :1], k, None, is_causal=True)
    assert one_query is None  # a single query (decoding) attends every cached key


def test_deberta_v2_attention_is_not_reported_as_patched(caplog):
    """DeBERTa-v2 computes attention itself (no AttentionInterface): apply_tempo must not claim the
    interface; it swaps the attention core module by module (tests/test_encoders.py) and says so."""
    import logging

    config = transformers.DebertaV2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=100, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.DebertaV2ForMaskedLM(config).eval()
    assert not hf_attention.model_dispatches_attention(model)
    assert hf_attention.model_dispatches_attention(modernbert())
    ids = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(model)  # the default swaps what runs and says what it left
    counts = tempo_patched(model)
    assert counts["attention"] == 0 and model.config._attn_implementation == "eager"
    assert counts["InplaceLayerNorm"] > 0 and counts["InplaceGelu"] > 0 and counts["DebertaEfficientAttention"] == 2
    assert sum("replaced 2 DeBERTa attention -> DebertaEfficientAttention" in m for m in caplog.messages) == 1
    assert not any("tempo_efficient" in m for m in caplog.messages)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference, atol=1e-5, rtol=0)
        model.config.output_attentions = True  # its own eager attention: transformers accepts it
        assert len(model(input_ids=ids).attentions) == 2


@pytest.mark.parametrize("attention", list(IMPLEMENTATIONS))
def test_weights_of_a_padding_free_batch_stay_within_each_sequence(attention):
    """A call asking for weights runs eager attention; on a padding-free row (position_ids
    restarting) it masks every cross-sequence pair too, as Tempo's attention does: the weights are
    0 across sequences, each sequence's block is that sequence's own eager weights, and the output
    is the one without weights."""
    torch.manual_seed(0)
    stock = bert().eval()
    model = apply_tempo(copy.deepcopy(stock), attention=attention)
    lengths = [4, 6, 3]
    ids = torch.randint(3, 100, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=positions, output_attentions=True)
        plain = model(input_ids=ids, position_ids=positions)
    torch.testing.assert_close(got.last_hidden_state, plain.last_hidden_state, atol=1e-5, rtol=0)
    start = 0
    for n in lengths:
        with torch.no_grad():
            alone = stock(input_ids=ids[:, start:start + n], output_attentions=True)
        for layer, weights in enumerate(got.attentions):
            block = weights[..., start:start + n, :]
            torch.testing.assert_close(block[..., start:start + n], alone.attentions[layer], atol=1e-6, rtol=0)
            assert float(block.sum(-1).sub(1).abs().max()) < 1e-6  # nothing outside its own sequence
        start += n
