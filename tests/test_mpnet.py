"""apply_tempo on MPNet (all-mpnet-base-v2's architecture; issue 33, point 2): the attention with its
relative position bias in O(s). The patched model against transformers' eager MPNet (fp32, dropout
off: outputs and every gradient, the bias table's included, with adversarial inputs and padding),
bf16 autocast against fp64, dropout (rate read at every forward, seeded replay: GradCache), what
each added layer keeps (exact bytes, the same per token at every s), and the stock-parity idioms."""

import copy
import io
import logging
import os
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations import mpnet as mpnet_module  # noqa: E402
from tempo.integrations.mpnet import MPNetEfficientSelfAttention  # noqa: E402
from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched  # noqa: E402
from tempo.memory import ActivationLedger  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASE = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=600, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
HEADS, HIDDEN = BASE["num_attention_heads"], BASE["hidden_size"]


def mpnet(cls="MPNetModel", **overrides):
    torch.manual_seed(0)
    return getattr(transformers, cls)(transformers.MPNetConfig(**{**BASE, **overrides})).train()


def padded_batch(length=40, batch=4):
    """Real tokens: all, 27, 9 and none (a sample of padding only: stock attends uniformly there)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 27:] = 0
    if batch > 2:
        mask[2, 9:] = 0
    if batch > 3:
        mask[3] = 0
    return ids, mask


def run(model, ids, mask=None, dtype=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(input_ids=ids, attention_mask=mask)
    hidden = out.logits if hasattr(out, "logits") else out.last_hidden_state
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (hidden.double() * weights).sum().backward()
    return hidden.detach().double(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
                                      if p.grad is not None}


def relative_l2(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
        return (num / sum(float(b[k].pow(2).sum()) for k in b)) ** 0.5
    return float((a - b).norm() / b.norm())


def adversarial(model):
    """A bias table of ±20 (peaked rows, some keys far below the rest), sharp queries, LayerNorms with
    γ near 0 beside large β (the recovery Tempo's LayerNorm must not make)."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "MPNetEncoder":
                module.relative_attention_bias.weight.normal_(0, 20)
            if isinstance(module, nn.LayerNorm):
                module.weight[:3] = torch.tensor([0.0, 1e-30, 1e-6])
                module.bias[:3] = torch.tensor([10.0, -10.0, 3.0])
            if type(module).__name__ == "MPNetSelfAttention":
                module.q.weight.mul_(8)
    return model


# ------------------------------------------------------------------------------------------------
# Exactness against transformers' eager MPNet
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [40, 150], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("weights", ["init", "adversarial"])
def test_outputs_and_every_gradient_equal_stock_eager(weights, length, caplog):
    stock = mpnet("MPNetForMaskedLM")
    if weights == "adversarial":
        adversarial(stock)
    keys = list(stock.state_dict())
    patched = copy.deepcopy(stock)
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(patched)
    assert tempo_patched(patched)["MPNetEfficientSelfAttention"] == 2, caplog.messages
    assert list(patched.state_dict()) == keys
    ids, mask = padded_batch(length)
    out_s, grads_s = run(stock, ids, mask)
    out_t, grads_t = run(patched, ids, mask)
    assert relative_l2(out_t, out_s) < 1e-5  # every row: padded ones and the all-padding sample too
    assert relative_l2(grads_t, grads_s) < 1e-5
    table = "mpnet.encoder.relative_attention_bias.weight"
    assert grads_s[table].norm() > 0
    floor = 1e-6 * sum(float(g.pow(2).sum()) for g in grads_s.values()) ** 0.5  # key biases: exactly 0, noise
    for name, g in grads_s.items():
        if name == table and weights == "adversarial":
            continue  # below, against fp64
        assert float((grads_t[name] - g).norm()) <= 1e-5 * float(g.norm()) + floor, name
    if weights == "adversarial":
        # Rows this peaked (bias ±20, sharp queries: |S - m| up to ~100) are where recovering P =
        # exp((S - m) - log l) costs most (relative error up to (2|S - m| + ...)·2^-24, the op's
        # documented bound), and the table's gradient sums dS over every row and the batch, with
        # cancellation: measured 2.2e-5 from fp64 (stock's 8e-6). Bounded against fp64 here.
        exact = copy.deepcopy(stock).double()
        _, grads_e = run(exact, ids, mask)
        assert relative_l2({table: grads_t[table]}, {table: grads_e[table]}) < 5e-5
        assert relative_l2({table: grads_s[table]}, {table: grads_e[table]}) < 2e-5
    revert_tempo(patched)
    assert not any(isinstance(m, MPNetEfficientSelfAttention) for m in patched.modules())
    assert "compute_position_bias" not in patched.mpnet.encoder.__dict__


def test_bf16_autocast_gradients_no_farther_from_fp64_than_stock_bf16():
    """The attention alone (the other swaps store 16-bit LayerNorm outputs under autocast, which a
    post-LN encoder at init, whose residual stream the sublayers barely move, shows above stock's
    error: tests/test_attention_autocast.py covers the whole patch)."""
    stock = mpnet()
    exact_model = copy.deepcopy(stock).double()
    patched = apply_tempo(copy.deepcopy(stock), gelu=False, layernorm=False, dropout_add_layernorm=False)
    ids, mask = padded_batch(batch=3)
    out_exact, exact = run(exact_model, ids, mask)
    out_stock, stock_bf16 = run(stock, ids, mask, dtype=torch.bfloat16)
    out_tempo, tempo_bf16 = run(patched, ids, mask, dtype=torch.bfloat16)
    assert relative_l2(tempo_bf16, exact) <= 1.5 * relative_l2(stock_bf16, exact)
    assert relative_l2(out_tempo, out_exact) <= 1.5 * relative_l2(out_stock, out_exact)


def test_the_bias_reaches_every_layer_once_per_forward_without_a_batch_copy():
    """The encoder's bias is [1, heads, S, S] (the original's is [B, heads, S, S]); every layer gets
    the same tensor; the stock attention (a call asking for probabilities) adds it as well."""
    model = apply_tempo(mpnet())
    seen = []
    for layer in model.encoder.layer:
        layer.attention.attn.register_forward_pre_hook(lambda m, args: seen.append(args[2]))
    ids, mask = padded_batch(batch=3)
    model(input_ids=ids, attention_mask=mask)
    assert [tuple(b.shape) for b in seen] == [(1, HEADS, 40, 40)] * 2 and seen[0] is seen[1]
    stock = mpnet()
    stock.load_state_dict(model.state_dict())
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        want = stock(input_ids=ids, attention_mask=mask, output_attentions=True)
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-5, atol=1e-5)


def test_calls_asking_for_probabilities_run_the_original_forward_logged_once(caplog):
    model = apply_tempo(mpnet())
    mpnet_module._logged.clear()
    ids, mask = padded_batch(batch=3)
    with caplog.at_level(logging.INFO, logger="tempo.integrations.mpnet"):
        for _ in range(2):
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (3, HEADS, 40, 40)
    assert sum("asking for the attention probabilities" in m for m in caplog.messages) == 1


def test_a_mask_whose_rows_differ_is_passed_whole_and_logged():
    """The layer called with a 4-D mask a caller built (rows differ): correct, kept whole, logged."""
    stock = mpnet()
    patched = apply_tempo(copy.deepcopy(stock))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, HIDDEN, generator=g)
    mask = torch.zeros(2, 1, 6, 6)
    mask[0, 0, 1, 3:] = torch.finfo(torch.float32).min  # only row 1 masks keys 3..5
    bias = torch.randn(1, HEADS, 6, 6, generator=g)
    assert mpnet_module.key_padding(mask, 6) is mask
    torch.testing.assert_close(patched.encoder.layer[0].attention.attn(hidden, mask, bias)[0],
                               stock.encoder.layer[0].attention.attn(hidden, mask, bias)[0], rtol=1e-5, atol=1e-6)


def test_a_mask_written_in_place_is_read_again():
    mask = torch.zeros(2, 1, 5, 5)
    row = mpnet_module.key_padding(mask, 5)
    assert row.shape == (2, 1, 1, 5) and mpnet_module.key_padding(mask, 5) is row  # once per tensor
    mask[1, :, :, 3:] = torch.finfo(torch.float32).min
    again = mpnet_module.key_padding(mask, 5)
    assert again is not row and torch.equal(again[1, 0, 0, 3:], mask[1, 0, 0, 3:])


# ------------------------------------------------------------------------------------------------
# Dropout: the held nn.Dropout, seeded and replayable
# ------------------------------------------------------------------------------------------------
def test_dropout_switched_off_through_its_modules_matches_stock():
    """TRL's idiom (m.p = 0 on every nn.Dropout) after patching: identical to stock without dropout;
    switched back on, the attention drops again."""
    stock = mpnet(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1)
    patched = apply_tempo(copy.deepcopy(stock))
    for model in (stock, patched):
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    ids, mask = padded_batch(batch=3)
    out_s, grads_s = run(stock, ids, mask)
    out_t, grads_t = run(patched, ids, mask)
    assert relative_l2(out_t, out_s) < 1e-5 and relative_l2(grads_t, grads_s) < 1e-5
    for layer in patched.encoder.layer:
        layer.attention.attn.dropout.p = 0.3  # the attention's own dropout only
    torch.manual_seed(0)
    on, _ = run(patched, ids, mask)
    assert relative_l2(on, out_s) > 1e-3


def test_attention_dropout_is_unbiased_at_the_modules_rate():
    """Averaged over many draws the dropped attention is the undropped one (kept probabilities scaled
    by 1/(1 - p)); one draw differs from it; eval draws nothing."""
    attn = apply_tempo(mpnet(attention_probs_dropout_prob=0.5)).encoder.layer[0].attention.attn
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 16, HIDDEN, generator=g)
    bias = torch.randn(1, HEADS, 16, 16, generator=g)
    with torch.no_grad():
        attn.eval()
        clean = attn(hidden, None, bias)[0]
        attn.train()
        draws = torch.stack([attn(hidden, None, bias)[0] for _ in range(400)])
    assert relative_l2(draws[0].double(), clean.double()) > 0.05
    assert relative_l2(draws.mean(0).double(), clean.double()) < 0.05


def test_a_no_grad_pass_and_its_replay_draw_the_same_masks():
    """GradCache / CachedMNRL / reentrant checkpointing: a no-grad forward and a forward with grad
    from the same RNG state give the same output (dropout 0.1 everywhere)."""
    model = apply_tempo(mpnet(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1))
    ids, mask = padded_batch(length=150, batch=3)
    torch.manual_seed(7)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.manual_seed(7)
    replay = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.manual_seed(8)
    other = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.allclose(replay.detach(), first, rtol=1e-5, atol=1e-6)
    assert relative_l2(other.detach().double(), first.double()) > 1e-3


def test_sentence_transformers_cached_mnrl_replay_on_mpnet(tmp_path):
    """The example's GradCache check on a small MPNet SentenceTransformer, dropout 0.1: the cached
    loss's gradient is the direct one (the replay redraws every dropout mask)."""
    pytest.importorskip("sentence_transformers")
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    sys.path.insert(0, examples)
    try:
        import st_contrastive_batch as example
    finally:
        sys.path.remove(examples)
    anchors, positives = example.document_pairs(tmp_path, num_documents=40, seed=0)
    model = apply_tempo(example.build_mpnet(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=128))
    assert tempo_patched(model)["MPNetEfficientSelfAttention"] == 2
    result = example.cached_mnrl_replay_check(model, anchors[:8], positives[:8], 2, 64)
    assert result["passed"], result


# ------------------------------------------------------------------------------------------------
# What an added layer keeps
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_an_added_layers_attention_keeps_exact_o_s_bytes(dtype):
    """Layer 1's attention keeps, per token, q, k, v and the output (4·h elements) and two fp32
    numbers per head, plus an 8-byte seed: the same per token at s = 128 and 512. Layer 0's keeps
    that plus the shared bias [1, H, S, S] (fp32) and the padding row [B, 1, 1, S] once per forward."""
    model = apply_tempo(mpnet(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1))
    item = 4 if dtype is None else 2
    b = 2
    for s in (128, 512):
        ids, mask = padded_batch(length=s, batch=b)
        with ActivationLedger(model) as ledger, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            model(input_ids=ids, attention_mask=mask).last_hidden_state.float().sum()
        kept = ledger.by_module(depth=10)
        own = b * s * (4 * HIDDEN * item + HEADS * 2 * 4) + 8
        assert kept["encoder.layer.1.attention.attn"] == own, s
        assert kept["encoder.layer.0.attention.attn"] == own + HEADS * s * s * 4 + b * s * item, s


def test_the_ledger_table_row_is_o_s_and_fake_counts_equal_real_ones(monkeypatch):
    """tempo.memory's MPNet row: bytes per added layer the same at every s after apply_tempo, below
    stock's; on fake tensors exactly the real ledger's (small width, so the real models build fast)."""
    from tempo.memory import tables as table
    from tempo.presets import FAMILIES

    label, cls, fields = FAMILIES["mpnet-base"]
    monkeypatch.setitem(FAMILIES, "mpnet-base", (label, cls, dict(fields, hidden_size=64, num_attention_heads=4,
                                                                  intermediate_size=128)))
    fake = table.family_rows(seq_lens=(16, 64), families=("mpnet-base",), fake=True)
    real = table.family_rows(seq_lens=(16, 64), families=("mpnet-base",), fake=False)
    assert fake == real
    assert fake[0]["after"] == fake[1]["after"] < fake[0]["before"] < fake[1]["before"]


# ------------------------------------------------------------------------------------------------
# Stock-parity idioms
# ------------------------------------------------------------------------------------------------
def test_patching_one_model_leaves_another_built_from_its_config_alone():
    config = transformers.MPNetConfig(**BASE)
    torch.manual_seed(0)
    first, second = transformers.MPNetModel(config), transformers.MPNetModel(config)
    apply_tempo(first)
    assert not any(isinstance(m, MPNetEfficientSelfAttention) for m in second.modules())
    assert "compute_position_bias" not in second.encoder.__dict__
    ids, mask = padded_batch(batch=3)
    with ActivationLedger(second) as ledger:
        second(input_ids=ids, attention_mask=mask).last_hidden_state.sum()
    assert ledger.activation_bytes > 0 and type(second.encoder.layer[0].attention.attn).__name__ == "MPNetSelfAttention"


@pytest.mark.parametrize("how", ["apply", "initialize_weights"])
def test_reinitialised_by_its_own_init_weights_as_the_stock_model(how):
    stock = mpnet("MPNetForMaskedLM")
    patched = apply_tempo(copy.deepcopy(stock))
    for model in (stock, patched):
        torch.manual_seed(3)
        model.apply(model._init_weights) if how == "apply" else model.initialize_weights()
    for (name, a), (_, b) in zip(stock.state_dict().items(), patched.state_dict().items()):
        assert torch.equal(a, b), name


def test_apply_twice_is_a_no_op_and_revert_restores_the_same_objects():
    model = mpnet()
    originals = [layer.attention.attn for layer in model.encoder.layer]
    apply_tempo(model)
    replaced = [layer.attention.attn for layer in model.encoder.layer]
    hook = model.encoder.__dict__["compute_position_bias"]
    apply_tempo(model)
    assert [layer.attention.attn for layer in model.encoder.layer] == replaced
    assert model.encoder.__dict__["compute_position_bias"] is hook
    revert_tempo(model)
    assert [layer.attention.attn for layer in model.encoder.layer] == originals
    assert "compute_position_bias" not in model.encoder.__dict__
    ids, mask = padded_batch(batch=3)
    model(input_ids=ids, attention_mask=mask)  # the stock model runs again


def test_attention_tempo_named_on_mpnet_is_refused_before_changing_anything():
    """Only the efficient attention has an MPNet recipe; the paper's Combined named on MPNet raises
    (MPNet computes attention itself), with nothing changed."""
    model = mpnet()
    with pytest.raises(ImportError, match="computes attention in its own layers"):
        apply_tempo(model, attention="tempo")
    assert not any(isinstance(m, MPNetEfficientSelfAttention) for m in model.modules())


def test_built_on_the_meta_device_then_loaded():
    stock = mpnet()
    with torch.device("meta"):
        model = transformers.MPNetModel(transformers.MPNetConfig(**BASE))
    apply_tempo(model)
    assert tempo_patched(model)["MPNetEfficientSelfAttention"] == 2
    model.to_empty(device="cpu")
    model.load_state_dict(stock.state_dict())
    model.embeddings.position_ids.copy_(stock.embeddings.position_ids)  # a non-persistent buffer
    ids, mask = padded_batch(batch=3)
    out_s, grads_s = run(stock, ids, mask)
    out_t, grads_t = run(model.train(), ids, mask)
    assert relative_l2(out_t, out_s) < 1e-5 and relative_l2(grads_t, grads_s) < 1e-5


def test_pickle_and_deepcopy_keep_the_shared_bias_on_the_copys_own_encoder():
    model = apply_tempo(mpnet())
    for copied in (copy.deepcopy(model), torch.load(io.BytesIO(_saved(model)), weights_only=False)):
        hook = copied.encoder.__dict__["compute_position_bias"]
        assert hook.args[0] is copied.encoder
        assert tempo_patched(copied)["MPNetEfficientSelfAttention"] == 2
        ids, mask = padded_batch(batch=3)
        with torch.no_grad():
            torch.testing.assert_close(copied.eval()(input_ids=ids, attention_mask=mask).last_hidden_state,
                                       model.eval()(input_ids=ids, attention_mask=mask).last_hidden_state)
        revert_tempo(copied)
        assert "compute_position_bias" in model.encoder.__dict__  # the original keeps its own


def _saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    return buffer.getvalue()


def test_peft_lora_on_q_and_v_trains_and_matches_stock_plus_lora():
    import peft  # the test extra installs it: a missing PEFT fails this test

    stock = mpnet()
    patched = apply_tempo(copy.deepcopy(stock))
    models = []
    for model in (stock, patched):
        torch.manual_seed(5)
        models.append(peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"],
                                                                 lora_dropout=0.0)))
    ids, mask = padded_batch(batch=3)
    # A fixed projection of the output: a LayerNorm'd output's mean square is 1 whatever LoRA learns,
    # so a loss of that kind could not show that training moved anything.
    weights = torch.randn(stock.config.hidden_size, generator=torch.Generator().manual_seed(1))
    traces = []
    for model in models:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        trace = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = (model(input_ids=ids, attention_mask=mask).last_hidden_state * weights).mean()
            loss.backward()
            optimizer.step()
            trace.append(float(loss))
        traces.append(trace)
    assert traces[0] == pytest.approx(traces[1], rel=1e-5) and traces[1][-1] != traces[1][0]
    assert any("lora_A" in n for n, _ in models[1].named_parameters())


# ------------------------------------------------------------------------------------------------
# Guards: what apply_tempo leaves alone
# ------------------------------------------------------------------------------------------------
def test_an_attention_computing_something_else_is_left_alone_and_logged(caplog):
    model = mpnet()
    attn = model.encoder.layer[0].attention.attn
    stock_forward = type(attn).forward
    attn.forward = lambda *a, **k: (stock_forward(attn, *a, **k)[0] * 2,)  # not what the recipe mirrors
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(model)
    assert model.encoder.layer[0].attention.attn is attn
    assert isinstance(model.encoder.layer[1].attention.attn, MPNetEfficientSelfAttention)
    assert any("MPNetSelfAttention" in m and "computes something else" in m for m in caplog.messages), caplog.text


def test_an_encoder_computing_another_bias_keeps_its_own_logged(caplog, monkeypatch):
    model = mpnet()
    monkeypatch.setattr(mpnet_module, "shared_position_bias", _other_bias)  # what a version's encoder would differ by
    mpnet_module._logged.clear()
    with caplog.at_level(logging.INFO, logger="tempo.integrations.mpnet"):
        apply_tempo(model)
    assert "compute_position_bias" not in model.encoder.__dict__
    assert any("another position bias" in m for m in caplog.messages), caplog.text
    ids, mask = padded_batch(batch=3)
    model(input_ids=ids, attention_mask=mask)  # its own [B, H, S, S] bias still runs


def _other_bias(encoder, x, position_ids=None, num_buckets=32):
    return torch.zeros(1, encoder.n_heads, x.size(1), x.size(1))
