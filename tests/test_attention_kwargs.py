"""What transformers hands an attention function besides q, k, v and the mask, and what Tempo's
attentions do with each (issues 33 and 35; tempo/integrations/hf_attention.py's argument lists).

Before: every keyword argument but scaling, dropout, is_causal, head_mask and the packing ones was
dropped silently. T5's learned relative position bias (``position_bias``) never reached the scores:
``apply_tempo(T5EncoderModel)`` moved the output by 0.30 and ``relative_attention_bias`` got no
gradient. Gemma-2's ``softcap`` and GPT-OSS's attention sinks (``s_aux``) were dropped the same way,
and DeepSeek-V3.2's sparse ``indices`` too (the model builds that sparsity into the mask only for
"eager" and "sdpa"). One test per class of argument: computed exactly (position_bias, with and
without dropout), no effect on what eager computes (sliding_window: the mask holds the window),
computed by the model's own eager attention only (softcap, s_aux; any argument Tempo does not
know), refused (indices).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations import hf_attention  # noqa: E402
from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched  # noqa: E402

CHOICES = {"efficient": {}, "tempo": dict(attention="tempo")}
LOGGER = "tempo.integrations.hf_attention"


@pytest.fixture(autouse=True)
def _fresh_logs(monkeypatch):
    monkeypatch.setattr(hf_attention, "_logged_arguments", set())


def t5_config(**overrides):
    return transformers.T5Config(**{**dict(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager"), **overrides})


def t5(cls_name, **overrides):
    """A tiny T5 whose relative position bias is large (std 3): a bias left out moves everything."""
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(t5_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.normal_(0.0, 3.0)
    return model.train()


def t5_inputs(cls_name, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    inputs = dict(input_ids=ids, attention_mask=mask)
    if cls_name != "T5EncoderModel":
        inputs["decoder_input_ids"] = torch.randint(3, 100, (3, 7), generator=g)
    return inputs


def output_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    y = out.last_hidden_state if hasattr(out, "last_hidden_state") and out.last_hidden_state is not None \
        else out.logits
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(got, want, rtol=1e-5):
    """Each gradient within ``rtol`` of its largest entry (floored at 1e-6 of the largest of all: a
    gradient that is 0 in exact arithmetic holds rounding noise only)."""
    assert got.keys() == want.keys()
    floor = 1e-6 * max(float(g.abs().max()) for g in want.values())
    for name in want:
        scale = max(float(want[name].abs().max()), floor)
        err = float((got[name] - want[name]).abs().max())
        assert err <= rtol * scale, f"{name}: max |Δ| {err:.3g} against max |grad| {scale:.3g}"


# ---------------------------------------------------------------------------------------------
# Computed: T5's position_bias
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("cls_name", ["T5EncoderModel", "T5ForConditionalGeneration"])
def test_t5_is_stock_eager_with_its_position_bias(cls_name, choice):
    """fp32, dropout off, a padded batch (and the decoder's causal self-attention and its
    cross-attention, whose bias is zeros): the output and every gradient, relative_attention_bias's
    included, within 1e-5 of stock eager."""
    stock = t5(cls_name)
    model = apply_tempo(copy.deepcopy(stock), **CHOICES[choice])
    assert tempo_patched(model)["attention"] == 1
    inputs = t5_inputs(cls_name)
    want, want_grads = output_and_grads(stock, inputs)
    got, got_grads = output_and_grads(model, inputs)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    biases = [n for n in want_grads if "relative_attention_bias" in n]
    assert len(biases) == (1 if cls_name == "T5EncoderModel" else 2)
    assert all(float(want_grads[n].abs().max()) > 1e-3 for n in biases)
    assert_same_gradients(got_grads, want_grads)


def test_t5s_bias_reaches_efficient_attention_as_its_attn_bias(monkeypatch):
    """"tempo_efficient" hands the bias over as efficient_attention's attn_bias (kept as given,
    [1, heads, s, s], its gradient summed into that shape), never merged with the padding mask
    into a [batch, heads, s, s] one; the same tensor in every layer."""
    from tempo.ops import attention as attention_module

    seen = []
    real = attention_module.efficient_attention

    def spy(q, k, v, attn_mask=None, *args, attn_bias=None, **kwargs):
        seen.append((attn_mask, attn_bias))
        return real(q, k, v, attn_mask, *args, attn_bias=attn_bias, **kwargs)

    monkeypatch.setattr(attention_module, "efficient_attention", spy)
    model = apply_tempo(t5("T5EncoderModel"))
    output_and_grads(model, t5_inputs("T5EncoderModel"))
    assert len(seen) == 2
    (mask0, bias0), (mask1, bias1) = seen
    assert bias0 is bias1 and tuple(bias0.shape) == (1, 4, 12, 12) and bias0.requires_grad
    assert mask0.dtype == torch.bool and tuple(mask0.shape[-2:]) in ((1, 12), (12, 12)) and mask0.shape[1] == 1


def test_t5_keeps_o_of_s_per_added_layer():
    """Bytes kept for backward per added encoder layer grow linearly with s (the shared bias is the
    first layer's, once per forward): from s = 32 to 64 they double, where the stock model's s×s
    tensors per layer make them grow by 2.8 (they quadruple as s outgrows d_model)."""
    from tempo.memory import ActivationLedger

    def per_layer(patch, s):
        kept = []
        for layers in (2, 3):
            torch.manual_seed(0)
            model = transformers.T5EncoderModel(t5_config(num_layers=layers, dropout_rate=0.1)).train()
            if patch:
                apply_tempo(model)
            ids = torch.randint(3, 100, (2, s))
            with ActivationLedger(model) as ledger:
                model(input_ids=ids).last_hidden_state.sum().backward()
            kept.append(ledger.activation_bytes)
        return kept[1] - kept[0]

    tempo_ratio = per_layer(True, 64) / per_layer(True, 32)
    stock_ratio = per_layer(False, 64) / per_layer(False, 32)
    assert tempo_ratio < 2.05 and stock_ratio > 2.5, (tempo_ratio, stock_ratio)


@pytest.mark.parametrize("choice", list(CHOICES))
def test_t5_with_dropout_replays_its_masks(choice):
    """Dropout 0.1: a no-grad forward and a forward with grad from the same RNG state give the same
    output (the bias lacks requires_grad in the first: the same masks all the same), another state
    other masks; and reentrant gradient checkpointing gives the gradients of the plain run."""
    model = apply_tempo(t5("T5EncoderModel", dropout_rate=0.1), **CHOICES[choice])
    inputs = t5_inputs("T5EncoderModel")
    torch.manual_seed(7)
    with torch.no_grad():
        first = model(**inputs).last_hidden_state
    torch.manual_seed(7)
    replay = model(**inputs).last_hidden_state
    torch.manual_seed(8)
    other = model(**inputs).last_hidden_state
    torch.testing.assert_close(replay.detach(), first, rtol=1e-5, atol=1e-6)
    assert float((other.detach() - first).abs().max()) > 1e-2

    results = []
    for checkpointed in (False, True):
        run = copy.deepcopy(model)
        if checkpointed:
            run.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        torch.manual_seed(3)
        results.append(output_and_grads(run, inputs))
    (plain_out, plain), (ckpt_out, ckpt) = results
    torch.testing.assert_close(ckpt_out, plain_out, rtol=1e-5, atol=1e-6)
    assert_same_gradients(ckpt, plain, rtol=1e-4)


@pytest.mark.parametrize("implementation", ["tempo_efficient", "tempo"])
def test_a_bias_beside_causality_left_to_the_flag_is_t5s_eager(implementation):
    """sdpa's mask function leaves an unpadded decoder's causality to is_causal (no mask):
    efficient_attention takes a bias and the flag only apart, so the causal mask is made."""
    from transformers.models.t5.modeling_t5 import eager_attention_forward

    fn = hf_attention.tempo_efficient_attention_forward if implementation == "tempo_efficient" else \
        hf_attention.tempo_attention_forward
    module = nn.Module().train()
    module.is_causal = True
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 3, 6, 6, generator=g, requires_grad=True)
    causal = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(module, q, k, v, causal[None, None], scaling=1.0, position_bias=bias)
    got, _ = fn(module, q, k, v, None, scaling=1.0, dropout=0.0, position_bias=bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v, bias))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v, bias))
    for g_got, g_want in zip(grads, want_grads):  # fp32 rounding of either: within 1e-5 of the largest entry
        assert float((g_got - g_want).abs().max()) <= 1e-5 * float(g_want.abs().max())


# ---------------------------------------------------------------------------------------------
# No effect on what eager computes: sliding_window (the mask holds the window)
# ---------------------------------------------------------------------------------------------
def gemma3(window):
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, vocab_size=100, max_position_embeddings=64, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0,
        attn_implementation="eager")).train()


@pytest.mark.parametrize("choice", list(CHOICES))
def test_sliding_window_is_in_the_mask(choice, monkeypatch):
    """Gemma3 hands sliding_window=4 to its sliding layers and eager ignores it: the mask function
    builds the window. The patched model is the stock one for 12 tokens (the window matters: a
    window of 16 gives other outputs), no call falls back to eager, and nothing is logged."""
    seen = []
    real = hf_attention._eager_only_arguments
    monkeypatch.setattr(hf_attention, "_eager_only_arguments", lambda kw: seen.append(kw.get("sliding_window"))
                        or real(kw))
    stock = gemma3(4)
    model = apply_tempo(copy.deepcopy(stock), **CHOICES[choice])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 12), generator=g)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    want, want_grads = output_and_grads(stock, inputs)
    got, got_grads = output_and_grads(model, inputs)
    assert 4 in seen and hf_attention._logged_arguments == set()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_same_gradients(got_grads, want_grads)
    wide, _ = output_and_grads(gemma3(16), inputs)
    assert float((wide - want).abs().max()) > 1e-3


# ---------------------------------------------------------------------------------------------
# Computed by the model's own eager attention only: softcap, attention sinks, unknown arguments
# ---------------------------------------------------------------------------------------------
def gemma2():
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, vocab_size=100, max_position_embeddings=64, sliding_window=4,
        attn_logit_softcapping=2.0, attention_dropout=0.0, attn_implementation="eager")).train()


def gpt_oss():
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=100, sliding_window=4,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_dropout=0.0, attn_implementation="eager"))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 2.0)  # sinks that matter
    return model.train()


@pytest.mark.parametrize("build, argument", [(gemma2, "softcap"), (gpt_oss, "s_aux")], ids=["softcap", "s_aux"])
def test_arguments_only_eager_computes_run_the_models_eager_attention_logged_once(build, argument, caplog):
    """Gemma-2's softcap, GPT-OSS's sinks: each call runs the model's own eager attention, so the
    patched model is the stock one (output and every gradient, the sinks' included); one warning
    naming the argument, over both layers and two forwards."""
    stock = build()
    model = apply_tempo(copy.deepcopy(stock))
    assert tempo_patched(model)["attention"] == 1
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    inputs = dict(input_ids=ids, attention_mask=mask)
    want, want_grads = output_and_grads(stock, inputs)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got, got_grads = output_and_grads(model, inputs)
        output_and_grads(model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_same_gradients(got_grads, want_grads)
    logged = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(logged) == 1 and f"passes {argument}" in logged[0] and "own eager attention" in logged[0], logged


def test_an_argument_set_to_none_is_no_argument(monkeypatch):
    """softcap=None (Gemma-2 configs without capping) and s_aux=None change nothing: Tempo's
    attention runs, nothing is logged."""
    from tempo.ops import attention as attention_module

    calls = []
    real = attention_module.efficient_attention
    monkeypatch.setattr(attention_module, "efficient_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    module = nn.Module().train()
    q = torch.randn(2, 2, 5, 8)
    out, weights = hf_attention.tempo_efficient_attention_forward(module, q, q, q, None, softcap=None, s_aux=None)
    assert calls == [1] and weights is None and hf_attention._logged_arguments == set()


def _bert_self_attention():
    """A module whose modeling file has an eager_attention_forward (BERT's)."""
    from transformers.models.bert.modeling_bert import BertSelfAttention

    config = transformers.BertConfig(hidden_size=16, num_attention_heads=2, attn_implementation="eager")
    return BertSelfAttention(config).eval()


def test_an_unknown_argument_runs_the_models_eager_attention_logged_once(caplog):
    """An argument on none of the lists (a newer transformers, remote code): Tempo cannot know what
    it does to the scores, so the model's own eager attention runs (what the stock eager model
    does with it), logged once naming it; with weights returned, as eager's."""
    from transformers.models.bert.modeling_bert import eager_attention_forward

    module = _bert_self_attention()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    want, want_weights = eager_attention_forward(module, q, k, v, None, scaling=0.3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for fn in (hf_attention.tempo_efficient_attention_forward, hf_attention.tempo_attention_forward):
            got, weights = fn(module, q, k, v, None, scaling=0.3, logit_temperature=0.5)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(weights, want_weights)
    logged = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(logged) == 1 and "passes logit_temperature=0.5" in logged[0], logged


def test_an_argument_no_eager_of_the_model_computes_is_refused():
    """A module whose file has no eager_attention_forward: the generic eager computes
    position_bias and softcap only; anything else is a ValueError naming the argument."""
    module = nn.Module().train()
    q = torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match=r"argument\(s\) 's_aux' of Module's attention call .* no "
                                         r"eager_attention_forward"):
        hf_attention.tempo_efficient_attention_forward(module, q, q, q, None, s_aux=torch.zeros(2))
    capped, _ = hf_attention.tempo_efficient_attention_forward(module, q, q, q, None, scaling=1.0, softcap=0.5)
    scores = torch.tanh(q @ q.transpose(-1, -2) / 0.5) * 0.5
    torch.testing.assert_close(capped, (scores.softmax(-1) @ q).transpose(1, 2))


# ---------------------------------------------------------------------------------------------
# Refused: sparsity the model builds into the mask only for "eager" and "sdpa"
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argument", ["indices", "block_indices"])
@pytest.mark.parametrize("implementation", ["tempo_efficient", "tempo"])
def test_sparse_attention_indices_are_refused(argument, implementation):
    fn = hf_attention.tempo_efficient_attention_forward if implementation == "tempo_efficient" else \
        hf_attention.tempo_attention_forward
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=rf"argument '{argument}' .* only under attn_implementation 'eager' or "
                                         rf"'sdpa'.*apply_tempo\(model, attention=False\)"):
        fn(_bert_self_attention(), q, q, q, None, **{argument: torch.zeros(1, 5, 2, dtype=torch.int32)})


def test_the_argument_lists_are_disjoint():
    lists = [hf_attention.IMPLEMENTED_ARGUMENTS, hf_attention.NO_EFFECT_ARGUMENTS,
             set(hf_attention.EAGER_ONLY_ARGUMENTS), set(hf_attention.REFUSED_ARGUMENTS)]
    assert sum(len(x) for x in lists) == len(set().union(*lists))


def test_revert_gives_t5_its_eager_attention_back():
    stock = t5("T5EncoderModel")
    model = apply_tempo(copy.deepcopy(stock))
    revert_tempo(model)
    assert model.config._attn_implementation == "eager"
    assert all(not m._forward_pre_hooks for m in model.modules())
    inputs = t5_inputs("T5EncoderModel")
    torch.testing.assert_close(output_and_grads(model, inputs)[0], output_and_grads(stock, inputs)[0])


@pytest.mark.parametrize("implementation", ["tempo", "tempo_efficient"])
def test_a_packed_row_with_a_position_bias_keeps_the_bias(implementation):
    """A padding-free row (position_ids restarting at each sequence) together with a position bias:
    the bias is added and every sequence attends only to itself, as eager attention on each sequence
    alone with its own block of the bias. (The variable-length kernel takes no bias: such a call must
    not be routed to it.)"""
    from tempo.integrations.hf_attention import tempo_attention_forward, tempo_efficient_attention_forward

    forward = tempo_attention_forward if implementation == "tempo" else tempo_efficient_attention_forward
    torch.manual_seed(0)
    heads, dim, lengths = 2, 8, (5, 7)
    total = sum(lengths)
    q, k, v = (torch.randn(1, heads, total, dim, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, heads, total, total, dtype=torch.float64)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    module = nn.Module()
    module.is_causal = False
    module.training = False
    got, _ = forward(module, q, k, v, None, scaling=dim ** -0.5, dropout=0.0, position_bias=bias,
                     position_ids=position_ids)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        scores = q[:, :, part] @ k[:, :, part].transpose(-1, -2) * dim ** -0.5 + bias[:, :, part, part]
        want = (torch.softmax(scores, -1) @ v[:, :, part]).transpose(1, 2)
        assert torch.allclose(got[:, part], want, rtol=1e-9, atol=1e-9), (implementation, n)
        start += n


def test_a_v_that_views_a_fused_qkv_buffer_is_kept_compact(monkeypatch):
    """ModernBERT's v is a slice of the fused Wqkv output: kept as given it keeps the whole [b, s, 3h]
    buffer, q's and k's pre-RoPE columns included. Tempo's attention keeps a compact copy: per layer
    exactly 2h elements per token fewer, the same outputs and the same gradients to fp32 rounding."""
    from tempo.memory import ActivationLedger

    config = transformers.ModernBertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=48, vocab_size=100, global_attn_every_n_layers=2,
                                           local_attention=8, pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = apply_tempo(transformers.ModernBertModel(config))
    ids = torch.randint(3, 100, (2, 9))
    results = []
    for compact in (True, False):
        if not compact:
            monkeypatch.setattr(hf_attention, "_compact_views", lambda *qkv: qkv)
        with ActivationLedger(model) as ledger:
            out = model(input_ids=ids).last_hidden_state
        grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
        results.append((out, grads, ledger.activation_bytes))
    (out1, g1, kept1), (out0, g0, kept0) = results
    assert torch.equal(out1, out0)
    for a, b in zip(g1, g0):  # the GEMMs read v in another layout: equal to fp32 rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kept0 - kept1 == config.num_hidden_layers * ids.numel() * 2 * config.hidden_size * 4
    monkeypatch.undo()
    # Only v viewing a wider buffer beside compact q and k is copied: a [b, s, h, d] -> [b, h, s, d]
    # transpose of one projection's output passes as it is, as do q, k, v all viewing one fused buffer
    # and a q viewing one beside compact k and v (GPT-2's layout, where copying q kept more).
    x = torch.randn(2, 9, 2, 16).transpose(1, 2)
    fused = torch.randn(2, 9, 3, 2, 16).transpose(3, 1).unbind(dim=2)
    q, k = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    for unchanged in ((x, x, x), fused, (fused[0], k, k)):
        assert all(a is b for a, b in zip(hf_attention._compact_views(*unchanged), unchanged))
    out = hf_attention._compact_views(q, k, fused[2])
    assert out[0] is q and out[1] is k and out[2].is_contiguous() and torch.equal(out[2], fused[2])
