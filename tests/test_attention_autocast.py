"""Tempo's attention under mixed precision follows sdpa's autocast policy (issue 33, point 4).

Before: the first bf16-autocast training step of a RoPE model (Llama, Qwen3, EuroBERT, Gemma3)
after ``apply_tempo`` raised "efficient_attention: arguments 'q', 'k', 'v' must have the same
dtype": RoPE leaves q and k in fp32 beside a bf16 v, which stock sdpa casts (it is on autocast's
lower-precision list). Here: the op against sdpa itself (dtypes, casts, refusals), then a training
step of every family that dispatches through AttentionInterface, under bf16 and fp16 autocast and
with 16-bit weights, against the stock model (sdpa) and an fp64 copy of it.
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from tempo.ops.attention import MixedDtypeError, autocast_like_sdpa, efficient_attention, efficient_attention_varlen

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations.patch import apply_tempo  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _qkv(*dtypes, b=2, h=2, s=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g).to(dt) for dt in dtypes]


# ------------------------------------------------------------------------------------------------
# The op against sdpa
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("autocast", ["bf16", "fp16"])
@pytest.mark.parametrize("dtypes", [("f32", "f32", "bf16"), ("f32", "bf16", "f16"), ("bf16", "bf16", "bf16"),
                                    ("f16", "f32", "f32")], ids="-".join)
@pytest.mark.parametrize("grad", [False, True], ids=["no_backward", "backward"])
def test_autocast_casts_q_k_v_as_sdpa(autocast, dtypes, grad):
    """Every non-fp64 q, k, v is cast to the autocast dtype, whatever mix it came in (RoPE's fp32 q,
    k beside a bf16 v among them); output dtype and values as sdpa's under the same autocast; the
    gradients come back in each input's own dtype."""
    named = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    q, k, v = (t.requires_grad_(grad) for t in _qkv(*(named[d] for d in dtypes)))
    with torch.autocast("cpu", dtype=HALF[autocast]):
        want = F.scaled_dot_product_attention(q, k, v)
        got = efficient_attention(q, k, v)
    assert got.dtype == want.dtype == HALF[autocast]
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    if grad:
        got.float().sum().backward()
        assert [t.grad.dtype for t in (q, k, v)] == [t.dtype for t in (q, k, v)]


@pytest.mark.parametrize("autocast", ["bf16", "fp16"])
def test_autocast_casts_a_float_mask_as_sdpa(autocast):
    """sdpa's autocast casts a float attn_mask too: finfo(float32).min becomes -inf in bf16 and
    fp16, so a row masked only by it gives 0 (eager, without autocast, would attend uniformly)."""
    q, k, v = _qkv(torch.float32, torch.float32, torch.float32)
    mask = torch.zeros(2, 1, 7, 7)
    mask[0, 0, 2] = torch.finfo(torch.float32).min
    mask[:, :, :, 5:] = torch.finfo(torch.float32).min
    for grad in (False, True):
        leaf = mask.clone().requires_grad_(grad)
        with torch.autocast("cpu", dtype=HALF[autocast]):
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            got = efficient_attention(q, k, v, attn_mask=leaf)
        assert got.dtype == want.dtype == HALF[autocast]
        assert torch.equal(got[0, :, 2], torch.zeros_like(got[0, :, 2])) and torch.equal(want[0, :, 2], got[0, :, 2])
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        if grad:
            got.float().sum().backward()
            assert leaf.grad.dtype == torch.float32  # through the cast, as sdpa's


def test_autocast_leaves_fp64_alone_and_refuses_the_mix_as_sdpa():
    """fp64 is not autocast-eligible: an fp64 q beside fp32 k, v is a dtype error in sdpa and here."""
    q, k, v = _qkv(torch.float64, torch.float32, torch.float32)
    assert autocast_like_sdpa(q, k, v) == (q, k, v)  # no autocast: unchanged
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = autocast_like_sdpa(q, k, v, None)
        assert [t.dtype if t is not None else None for t in cast] == [torch.float64, torch.bfloat16, torch.bfloat16,
                                                                       None]
        with pytest.raises(RuntimeError, match="same dtype"):
            F.scaled_dot_product_attention(q, k, v)
        with pytest.raises(MixedDtypeError, match="only fp64 tensors keep their dtype"):
            efficient_attention(q, k, v)
        out = efficient_attention(*(t.double() for t in (q, k, v)))  # all fp64: runs in fp64, as sdpa
        assert out.dtype == torch.float64


@pytest.mark.parametrize("grad", [False, True], ids=["no_backward", "backward"])
def test_mixed_dtypes_outside_autocast_are_refused_as_sdpa_refuses_them(grad):
    """Without autocast sdpa raises for q, k, v of different dtypes; so does this op, with an error
    that is both the TypeError of Tempo's dtype checks and sdpa's RuntimeError."""
    q, k, v = (t.requires_grad_(grad) for t in _qkv(torch.float32, torch.float32, torch.bfloat16))
    with pytest.raises(RuntimeError, match="same dtype"):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(MixedDtypeError, match="refuses them too outside torch.autocast") as info:
        efficient_attention(q, k, v)
    assert isinstance(info.value, TypeError) and isinstance(info.value, RuntimeError)
    flat = [t.detach().transpose(1, 2).reshape(14, 2, 8) for t in (q, k, v)]
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    with pytest.raises(MixedDtypeError):
        efficient_attention_varlen(*flat, cu, 7)


def test_varlen_autocast_casts_mixed_q_k_v():
    flat = [t.transpose(1, 2).reshape(14, 2, 8) for t in _qkv(torch.float32, torch.float32, torch.bfloat16)]
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = efficient_attention_varlen(*flat, cu, 7, dropout_p=0.0)
    assert out.dtype == torch.bfloat16
    dense = [t.reshape(2, 7, 2, 8).transpose(1, 2).bfloat16() for t in flat]
    want = F.scaled_dot_product_attention(*dense).transpose(1, 2).reshape(14, 2, 8)
    torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("implementation", ["tempo_efficient", "tempo"])
def test_hf_attention_functions_take_ropes_mixed_dtypes_under_autocast(implementation):
    """The registered functions, called as a RoPE model's attention calls them: fp32 q, k, bf16 v."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tempo.integrations.hf_attention import tempo_attention_forward, tempo_efficient_attention_forward

    fn = tempo_efficient_attention_forward if implementation == "tempo_efficient" else tempo_attention_forward
    module = torch.nn.Module().train()
    module.is_causal = True
    q, k, v = _qkv(torch.float32, torch.float32, torch.bfloat16, s=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=8 ** -0.5, is_causal=True)
        got, _ = fn(module, q, k, v, None, dropout=0.0, scaling=8 ** -0.5)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------
# Every family that dispatches through AttentionInterface: a training step
# ------------------------------------------------------------------------------------------------
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
             attn_implementation="sdpa")


def _config(name, **overrides):
    return getattr(transformers, name)(**{**SMALL, **overrides})


# family: (model class, its config with dropout off: the stock model's dropout cannot be Tempo's).
FAMILIES = {
    "bert": ("BertModel", lambda: _config("BertConfig", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "roberta": ("RobertaModel", lambda: _config("RobertaConfig", hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0)),
    "modernbert": ("ModernBertModel", lambda: _config(
        "ModernBertConfig", intermediate_size=48, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    "gpt2": ("GPT2Model", lambda: transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0, attn_implementation="sdpa")),
    "llama": ("LlamaModel", lambda: _config("LlamaConfig", num_key_value_heads=1, max_position_embeddings=64)),
    "qwen3": ("Qwen3Model", lambda: _config("Qwen3Config", num_key_value_heads=1, head_dim=16,
                                            max_position_embeddings=64)),
    "eurobert": ("EuroBertModel", lambda: _config("EuroBertConfig", num_key_value_heads=2, max_position_embeddings=64,
                                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3)),
    # EmbeddingGemma: Gemma3TextModel with use_bidirectional_attention, sliding and global layers.
    "gemma3_bidirectional": ("Gemma3TextModel", lambda: _config(
        "Gemma3TextConfig", num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        use_bidirectional_attention=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "nomicbert": ("NomicBertModel", lambda: _config("NomicBertConfig")),
    "gte": ("GteModel", lambda: _config("GteConfig", hidden_dropout_prob=0.0)),
    "jina_v3": ("JinaEmbeddingsV3Model", lambda: _config("JinaEmbeddingsV3Config", hidden_dropout_prob=0.0,
                                                         attention_probs_dropout_prob=0.0)),
}


def _family_params():
    """One param per family; a family whose class this transformers lacks is skipped with one line
    saying so (GteModel is not in transformers 5.17, the GPU image's)."""
    for name, (cls, _) in FAMILIES.items():
        missing = not hasattr(transformers, cls)
        yield pytest.param(name, id=name, marks=pytest.mark.skipif(
            missing, reason=f"transformers {transformers.__version__} has no {cls}: {name} is not in this version"))


MODES = ["bf16_autocast", "fp16_autocast", "bf16_weights", "fp16_weights"]
# Tempo's attention against the stock (sdpa) model, relative L2 over the output and over every
# gradient: measured at most 1.1e-2 (bf16) and 1.5e-3 (fp16) for the attention alone, 1.1e-2 and
# 1.4e-3 for the whole default patch (its LayerNorms store 16-bit outputs under autocast): ~3x.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _build(family):
    cls, config = FAMILIES[family]
    torch.manual_seed(0)
    return getattr(transformers, cls)(config()).train()


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a padded row (right padding, as the decoders' tokenizers pad for training)
    return ids, mask


def _step(model, mode, optimizer_step=False):
    """One training step: forward in ``mode``, a loss over the real tokens, backward (and an SGD
    step). Returns the output (fp64) and every gradient (fp64)."""
    ids, mask = _batch()
    model.zero_grad(set_to_none=True)
    dtype = HALF[mode[:4]]
    with torch.autocast("cpu", dtype=dtype, enabled=mode.endswith("autocast")):
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss = (hidden.double() * weight * mask[..., None]).sum()
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    if optimizer_step:
        torch.optim.SGD(model.parameters(), lr=1e-3).step()
    return hidden.detach().double()[mask.bool()], grads


def _relative(got, want):
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want)
        return (num / sum(float(w.pow(2).sum()) for w in want.values())) ** 0.5
    return float((got - want).norm() / want.norm())


def _stock_in(family, mode):
    stock = _build(family)
    return stock.to(HALF[mode[:4]]) if mode.endswith("weights") else stock


@pytest.mark.parametrize("choice", ["efficient", "tempo"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(_family_params()))
def test_attention_training_step_matches_stock_sdpa(family, mode, choice):
    """Tempo's attention alone (no other swap): a training step under ``mode`` matches the stock
    model's (sdpa) within the dtype's tolerance, and is as close to the fp64 model as stock's."""
    stock = _stock_in(family, mode)
    patched = apply_tempo(copy.deepcopy(stock), attention=choice, gelu=False, layernorm=False,
                          dropout_add_layernorm=False)
    assert patched.config._attn_implementation == {"efficient": "tempo_efficient", "tempo": "tempo"}[choice]
    exact = _build(family).double()
    exact.load_state_dict({k: v.double() for k, v in stock.state_dict().items()})
    (out, grads), (out_stock, grads_stock) = _step(patched, mode), _step(stock, mode)
    out_exact, grads_exact = _exact_step(exact)
    tol = TOLERANCE[HALF[mode[:4]]]
    assert _relative(out, out_stock) < tol and _relative(grads, grads_stock) < tol
    # As exact as the stock model: within 1.5x its distance to fp64 (measured <= 1.25x), plus the unit
    # roundoff's share where stock is nearly exact (post-LN encoders under autocast: ~1e-4).
    unit = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[HALF[mode[:4]]]
    assert _relative(out, out_exact) <= 1.5 * _relative(out_stock, out_exact) + 0.02 * unit
    assert _relative(grads, grads_exact) <= 1.5 * _relative(grads_stock, grads_exact) + 0.02 * unit


def _exact_step(model):
    ids, mask = _batch()
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (hidden * weight * mask[..., None]).sum().backward()
    return hidden.detach()[mask.bool()], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(_family_params()))
def test_default_patch_trains_under_mixed_precision_like_stock(family, mode):
    """``apply_tempo(model)`` (every swap, the default efficient attention): a training step with
    an optimizer step runs under ``mode`` and matches the stock model's within the tolerance."""
    stock = _stock_in(family, mode)
    patched = apply_tempo(copy.deepcopy(stock))
    assert patched.config._attn_implementation == "tempo_efficient"
    (out, grads), (out_stock, grads_stock) = _step(patched, mode, True), _step(stock, mode, True)
    assert all(torch.isfinite(g).all() for g in grads.values())
    tol = TOLERANCE[HALF[mode[:4]]]
    assert _relative(out, out_stock) < tol and _relative(grads, grads_stock) < tol
    for (name, p), (_, p_stock) in zip(patched.named_parameters(), stock.named_parameters()):
        assert p.dtype == p_stock.dtype, name  # the step left every parameter in its dtype
