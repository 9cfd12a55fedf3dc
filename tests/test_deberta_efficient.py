"""apply_tempo on DeBERTa-v2/v3 with the O(s) disentangled attention (issue 25): the patched model
against transformers' eager DeBERTa (fp32, dropout off) for every relative-position setting, with
padding and with adversarial LayerNorms; padding-free batches attend within each sequence; the
position dropout; bf16 autocast against fp64; what each layer keeps."""

import copy
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations.deberta import DebertaEfficientAttention  # noqa: E402
from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched  # noqa: E402
from tempo.memory import ActivationLedger  # noqa: E402

BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, relative_attention=True,
            pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16, norm_rel_ebd="layer_norm",
            share_att_key=True, max_position_embeddings=64, position_biased_input=False)
# Relative-position settings: v3's (buckets, shared keys), either term alone, separate position
# projections (v2), no buckets (positions clamped at +-span), content only.
SETTINGS = {
    "v3": {},
    "c2p-only": dict(pos_att_type=["c2p"]),
    "p2c-only": dict(pos_att_type=["p2c"]),
    "separate-keys": dict(share_att_key=False),
    "no-buckets": dict(position_buckets=-1, max_relative_positions=6),
    "v2-absolute": dict(position_buckets=-1, max_relative_positions=-1, position_biased_input=True,
                        share_att_key=False, norm_rel_ebd="none"),
    "content-only": dict(relative_attention=False, pos_att_type=[]),
}


def deberta(**overrides):
    return transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**{**BASE, **overrides}))


def padded_batch(length=40):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 27:] = 0
    mask[2, 9:] = 0
    return ids, mask


def run(model, ids, mask=None, dtype=None, **kwargs):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits
    weights = torch.linspace(-1, 1, logits.shape[-1], dtype=torch.float64)
    loss = (logits.double() * weights).sum() if mask is None else (logits.double() * weights * mask[..., None]).sum()
    loss.backward()
    return logits.detach(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
                             if p.grad is not None}


def relative_l2(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a)
        den = sum(float(b[k].double().pow(2).sum()) for k in b)
        return (num / den) ** 0.5
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("adversarial", [False, True], ids=["init", "gamma-near-zero"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_outputs_and_every_gradient_equal_stock_eager(setting, adversarial, caplog):
    torch.manual_seed(0)
    stock = deberta(**SETTINGS[setting]).train()
    if adversarial:
        with torch.no_grad():
            for module in stock.modules():
                if isinstance(module, torch.nn.LayerNorm):
                    module.weight[:3] = torch.tensor([0.0, 1e-30, 1e-6])
                    module.bias[:3] = torch.tensor([10.0, -10.0, 3.0])
    keys = list(stock.state_dict())
    patched = copy.deepcopy(stock)
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(patched)
    assert tempo_patched(patched)["DebertaEfficientAttention"] == 2, caplog.messages
    assert list(patched.state_dict()) == keys
    ids, mask = padded_batch()
    out_s, grads_s = run(stock, ids, mask)
    out_t, grads_t = run(patched, ids, mask)
    real = mask.bool()
    assert relative_l2(out_t[real], out_s[real]) < 1e-5
    assert relative_l2(out_t, out_s) < 1e-5  # padded rows too: uniform attention, as transformers'
    assert relative_l2(grads_t, grads_s) < 1e-5
    revert_tempo(patched)
    assert not any(isinstance(m, DebertaEfficientAttention) for m in patched.modules())


def test_bf16_autocast_gradients_no_farther_from_fp64_than_stock_bf16():
    torch.manual_seed(0)
    stock = deberta().train()
    exact_model = copy.deepcopy(stock).double()
    patched = apply_tempo(copy.deepcopy(stock))
    ids, mask = padded_batch()
    _, exact = run(exact_model, ids, mask)
    _, stock_bf16 = run(stock, ids, mask, dtype=torch.bfloat16)
    _, tempo_bf16 = run(patched, ids, mask, dtype=torch.bfloat16)
    assert relative_l2(tempo_bf16, exact) <= 1.5 * relative_l2(stock_bf16, exact)


@pytest.mark.parametrize("form", ["position_ids", "cu_seq_lens"])
def test_padding_free_batch_attends_within_each_sequence(form):
    """A DataCollatorWithFlattening row: transformers' DeBERTa attends across the sequences
    (relative positions run over the whole row); after apply_tempo each sequence gets what it gets
    alone, outputs and every gradient."""
    torch.manual_seed(0)
    stock = deberta().train()
    patched = apply_tempo(copy.deepcopy(stock))
    lengths = [7, 30, 12]
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, 100, (1, n), generator=g) for n in lengths]
    row = torch.cat(sequences, 1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 7, 37, 49], dtype=torch.int32)
    packing = (dict(position_ids=positions) if form == "position_ids" else
               dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30))

    alone_out, alone_grads = [], []
    for seq in sequences:
        out, grads = run(stock, seq)
        alone_out.append(out)
        alone_grads.append(grads)
    alone = torch.cat(alone_out, 1)
    summed = {k: sum(g[k] for g in alone_grads) for k in alone_grads[0]}
    packed_out, packed_grads = run(patched, row, **packing)
    assert relative_l2(packed_out, alone) < 1e-5
    assert relative_l2(packed_grads, summed) < 1e-5
    crossed, _ = run(stock, row, **packing)
    assert relative_l2(crossed, alone) > 1e-3  # the stock model mixes the sequences


def test_positional_arguments_are_read_as_the_models_forward_names_them():
    """DebertaV2ForMaskedLM.forward(input_ids, attention_mask, token_type_ids, position_ids, ...):
    a packed row's position_ids given positionally packs as the keyword does, and token_type_ids
    given positionally are never taken for positions (all zeros would split every token apart)."""
    torch.manual_seed(0)
    patched = apply_tempo(deberta()).eval()
    g = torch.Generator().manual_seed(1)
    row = torch.randint(3, 100, (1, 30), generator=g)
    positions = torch.cat([torch.arange(12), torch.arange(18)])[None]
    types = torch.zeros_like(row)
    with torch.no_grad():
        torch.testing.assert_close(patched(row, None, None, positions).logits,
                                   patched(input_ids=row, position_ids=positions).logits)
        torch.testing.assert_close(patched(row, None, types).logits, patched(input_ids=row).logits)
        assert not torch.allclose(patched(input_ids=row, position_ids=positions).logits, patched(input_ids=row).logits)


def test_padding_free_refuses_the_convolution_layer_padding_and_gradient_checkpointing():
    model = apply_tempo(deberta(conv_kernel_size=3))
    row = torch.randint(3, 100, (1, 12))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="convolution layer"):
        model(input_ids=row, position_ids=positions)
    model(input_ids=row)  # an ordinary batch still runs
    plain = apply_tempo(deberta())
    mask = torch.ones_like(row)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="padding-free batch .* with padding"):
        plain(input_ids=row, attention_mask=mask, position_ids=positions)
    # Gradient checkpointing recomputes the layers in backward, after the call that carries the packing.
    plain.train().gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="cannot run with gradient checkpointing"):
        plain(input_ids=row, position_ids=positions)
    with torch.no_grad():
        plain(input_ids=row, position_ids=positions)  # nothing is recomputed without a backward
    plain.gradient_checkpointing_disable()
    plain(input_ids=row, position_ids=positions).logits.sum().backward()


def test_position_dropout_is_the_models_own():
    """The relative embeddings go through the layer's own pos_dropout: with only that dropout on,
    the patched model draws the very masks the stock model draws (same RNG, same order)."""
    torch.manual_seed(0)
    stock = deberta(hidden_dropout_prob=0.5).train()
    patched = apply_tempo(copy.deepcopy(stock))
    calls = []
    for model in (stock, patched):
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Dropout) and not name.endswith("pos_dropout"):
                module.p = 0.0
            elif name.endswith("pos_dropout") and model is patched:
                module.register_forward_hook(lambda *_: calls.append(1))
    ids, mask = padded_batch()
    torch.manual_seed(3)
    out_s, grads_s = run(stock, ids, mask)
    torch.manual_seed(3)
    out_t, grads_t = run(patched, ids, mask)
    assert len(calls) == 2  # once per layer
    assert relative_l2(out_t, out_s) < 1e-5 and relative_l2(grads_t, grads_s) < 1e-5
    torch.manual_seed(4)
    _, grads_other = run(patched, ids, mask)
    rel = "deberta.encoder.rel_embeddings.weight"
    assert relative_l2({rel: grads_other[rel]}, {rel: grads_t[rel]}) > 1e-3  # the dropout really acts


def test_calls_it_cannot_run_exactly_run_the_original_forward(caplog, monkeypatch):
    """A pair mask that is not m_i·m_j (the layer called directly: DeBERTa's model takes [B, S]
    masks only), and a call asking for the probabilities: the original forward, logged once per reason."""
    import tempo.integrations.deberta as deberta_module

    torch.manual_seed(0)
    stock = deberta().eval()
    patched = apply_tempo(copy.deepcopy(stock)).eval()
    ids, mask = padded_batch()
    pairs = (mask[:, None, :] * mask[:, :, None])[:, None].clone()
    pairs[0, 0, 3, 5] = 0
    layer_s, layer_t = (m.deberta.encoder.layer[0].attention.self for m in (stock, patched))
    assert isinstance(layer_t, DebertaEfficientAttention)
    hidden = torch.randn(3, 40, 32)
    rel = stock.deberta.encoder.get_rel_embedding()
    monkeypatch.setattr(deberta_module, "_logged_reasons", set())
    with caplog.at_level(logging.INFO, logger="tempo.integrations.deberta"), torch.no_grad():
        got = layer_t(hidden, pairs, rel_embeddings=rel)[0]
        layer_t(hidden, pairs, rel_embeddings=rel)
        want = layer_s(hidden, pairs, rel_embeddings=rel)[0]
        weights = patched(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(weights) == 2 and weights[0].shape == (3, 2, 40, 40)
    lines = [m for m in caplog.messages if "runs the model's own attention" in m]
    assert len(lines) == 2, lines  # two reasons, each once (two layers, two calls)
    assert "not a [B, S] padding mask" in lines[0] and "asking for the attention probabilities" in lines[1]


def test_a_mask_or_positions_written_in_place_are_read_again():
    """What the layer learns from a pair mask and from relative_pos is kept for the other layers of
    the forward; a buffer refilled in place (static input buffers, as CUDA graph replays use) must be
    read again: a new padding, and positions that are no longer the standard ones."""
    torch.manual_seed(0)
    stock = deberta().eval()
    patched = apply_tempo(copy.deepcopy(stock)).eval()
    layer_s, layer_t = (m.deberta.encoder.layer[0].attention.self for m in (stock, patched))
    encoder = stock.deberta.encoder
    hidden = torch.randn(3, 40, 32)
    _, mask = padded_batch()
    pairs = (mask[:, None, :] * mask[:, :, None])[:, None].clone()
    positions = encoder.get_rel_pos(hidden).clone()
    rel = encoder.get_rel_embedding()
    refills = [(mask, None), (mask.flip(0), None), (mask, positions.flip(-1).clone())]
    for refill, new_positions in refills:
        pairs.copy_((refill[:, None, :] * refill[:, :, None])[:, None])
        if new_positions is not None:
            positions.copy_(new_positions)
        with torch.no_grad():
            got = layer_t(hidden, pairs, relative_pos=positions, rel_embeddings=rel)[0]
            want = layer_s(hidden, pairs, relative_pos=positions, rel_embeddings=rel)[0]
        real = refill.bool()
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_each_layer_keeps_no_s_by_s_tensor():
    """bf16 autocast, dropout on: what the attention core of a layer keeps grows as s, not s²."""
    def kept_per_layer(model, s):
        ids = torch.randint(3, 100, (2, s), generator=torch.Generator().manual_seed(0))
        with ActivationLedger(model) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids).logits.float().sum()
        return ledger.by_module(depth=10)

    torch.manual_seed(0)
    model = apply_tempo(deberta(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1)).train()
    core = "deberta.encoder.layer.0.attention.self"
    short, long = (sum(v for k, v in kept_per_layer(model, s).items() if k.startswith(core)) for s in (32, 64))
    assert long <= 2 * short + 4096  # linear in s (an s x s tensor would make it ~4x)


def test_the_classification_example_runs_and_reports_the_batch(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parent.parent / "examples"
    result = subprocess.run(
        [sys.executable, str(examples / "deberta_classification.py"), "--size", "tiny", "--layers", "1",
         "--max_seq_length", "64", "--max_steps", "1", "--num_documents", "40", "--output_dir", str(tmp_path)],
        cwd=examples, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| tempo / stock |" in result.stdout and "stock  final_loss=" in result.stdout
    assert "tempo  final_loss=" in result.stdout and "DebertaEfficientAttention" in result.stdout
    bad = subprocess.run([sys.executable, str(examples / "deberta_classification.py"), "--memory_budget", "lots"],
                         cwd=examples, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--memory_budget" in bad.stderr


def test_the_projects_unpadded_layout_reaches_deberta():
    """A padded batch unpadded with tempo.unpad.TokenLayout (the layout the project's trainers use)
    runs as one packed row with the layout's cu_seqlens: each sequence gets what the padded model
    gives its real tokens, outputs and every gradient."""
    from tempo.unpad import TokenLayout

    torch.manual_seed(0)
    patched = apply_tempo(deberta()).train()
    ids, mask = padded_batch()
    layout = TokenLayout.from_mask(mask)
    row = layout.unpad(ids).unsqueeze(0)  # [1, T]: the real tokens, sequence after sequence
    padded_out, padded_grads = run(patched, ids, mask)
    packed_out, packed_grads = run(patched, row, cu_seq_lens_q=layout.cu_seqlens, cu_seq_lens_k=layout.cu_seqlens,
                                   max_length_q=layout.max_seqlen, max_length_k=layout.max_seqlen)
    assert relative_l2(layout.pad(packed_out[0])[mask.bool()], padded_out[mask.bool()]) < 1e-5
    assert relative_l2(packed_grads, padded_grads) < 1e-5


# Configs transformers runs whose log buckets degenerate (issue 35.4): max_relative_positions - 1 <=
# position_buckets // 2 (small DeBERTa-v3 configs: max_position_embeddings <= 129 with 256 buckets).
DEGENERATE = {
    "v3-small-128-positions": dict(position_buckets=256, max_relative_positions=-1, max_position_embeddings=128),
    "129-positions": dict(position_buckets=256, max_relative_positions=-1, max_position_embeddings=129),
    "relative-64-buckets-256": dict(position_buckets=256, max_relative_positions=64, max_position_embeddings=512),
}


@pytest.mark.parametrize("setting", [*DEGENERATE, "130-positions"])
def test_small_v3_configs_run_the_op_where_exact_and_the_original_beyond(setting, caplog, monkeypatch):
    """Before: the op refused these position settings, the numerical check failed, and the log said
    "transformers' forward differs". transformers' buckets are the identity up to distance
    position_buckets // 2 = 128 (what every shorter sequence uses): the op runs them with identity
    buckets; a longer sequence (its buckets fold back) runs the original forward, logged with that
    reason. With 130 positions the log buckets are regular: the op runs every length."""
    import tempo.integrations.deberta as deberta_module

    overrides = DEGENERATE.get(setting, dict(position_buckets=256, max_relative_positions=-1,
                                             max_position_embeddings=130))
    torch.manual_seed(0)
    stock = deberta(**overrides).train()
    patched = copy.deepcopy(stock)
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(patched)
    assert tempo_patched(patched)["DebertaEfficientAttention"] == 2, caplog.messages
    op_calls = []
    real_op = deberta_module.disentangled_attention
    monkeypatch.setattr(deberta_module, "disentangled_attention", lambda *a, **k: op_calls.append(k) or real_op(*a, **k))
    monkeypatch.setattr(deberta_module, "_logged_reasons", set())
    caplog.clear()
    for length, runs_op in ((40, True), (129, True), (140, setting not in DEGENERATE)):
        op_calls.clear()
        ids, mask = padded_batch(length)
        with caplog.at_level(logging.INFO, logger="tempo.integrations.deberta"):
            out_t, grads_t = run(patched, ids, mask)
        out_s, grads_s = run(stock, ids, mask)
        assert len(op_calls) == (2 if runs_op else 0), (length, len(op_calls))
        assert relative_l2(out_t, out_s) < 1e-5 and relative_l2(grads_t, grads_s) < 1e-5, length
    expected = [m for m in caplog.messages if "log buckets degenerate" in m]
    assert len(expected) == (1 if setting in DEGENERATE else 0), caplog.messages


def test_one_position_bucket_is_left_alone_with_transformers_own_reason(caplog):
    """position_buckets=1: transformers' make_log_bucket_position divides by position_buckets // 2 = 0
    (transformers 5.2x raises ZeroDivisionError; 5.17's TorchScript makes inf buckets and runs on);
    apply_tempo leaves the attention alone and says why, never "transformers' forward differs"."""
    torch.manual_seed(0)
    model = deberta(position_buckets=1)
    ids, mask = padded_batch(12)
    try:
        stock = model(input_ids=ids, attention_mask=mask).logits
    except ZeroDivisionError:
        stock = None  # transformers 5.2x
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(model)
    assert "DebertaEfficientAttention" not in tempo_patched(model)
    reasons = [m for m in caplog.messages if "DeBERTa attention" in m and "alone" in m]
    assert len(reasons) == 1 and "divides by position_buckets // 2 = 0" in reasons[0], caplog.messages
    assert not any("forward differs" in m or "in its own layers" in m for m in caplog.messages), caplog.messages
    if stock is not None:  # where the stock model runs, the patched one gives its outputs
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits, stock, atol=1e-5)
    with pytest.raises(ImportError, match="divides by position_buckets // 2 = 0"):
        apply_tempo(deberta(position_buckets=1), attention="efficient")


# ---------------------------------------------------------------------------------------------
# Test-gap classes of issue 35's mutation run, as they live in DeBERTa's integration
# ---------------------------------------------------------------------------------------------
def _pair_mask(real):
    return (real[:, None, :, None] * real[:, None, None, :])


def _refill_mask_in_place(args, kwargs):  # an in-place write: the tensor's version changes
    mask = args[1]
    real = torch.ones(mask.shape[0], mask.shape[-1], dtype=mask.dtype)
    real[0, 5:] = 0
    mask.copy_(_pair_mask(real))


def _swap_mask_memory(args, kwargs):  # .data swapped for other memory: same version, dtype, geometry
    mask = args[1]
    real = torch.ones(mask.shape[0], mask.shape[-1], dtype=mask.dtype)
    real[2, 3:] = 0
    mask.data = _pair_mask(real).contiguous()


def _positions_read_as_another_dtype(args, kwargs):  # the same memory as float64: transformers reads 0s
    positions = kwargs["relative_pos"]
    positions.data = positions.data.view(torch.float64)


def _positions_transposed(args, kwargs):  # another view of the same memory: only the strides change
    positions = kwargs["relative_pos"]
    positions.data = positions.data.transpose(-1, -2)


CHANGES = {"version": _refill_mask_in_place, "data-pointer": _swap_mask_memory,
           "dtype": _positions_read_as_another_dtype, "geometry": _positions_transposed}


@pytest.mark.parametrize("field", list(CHANGES))
def test_what_a_call_remembers_of_its_mask_and_positions_is_keyed_on_every_field(field):
    """Class "a per-tensor cache key missing a field": within one model call the layers share what
    was checked of the pair mask and the relative positions (one host read each). A hook between
    the layers changes the tensors the next layer gets while the objects stay the same — an
    in-place write, other memory, the same memory as another dtype, another view of it: the next
    layer must see the change, as the stock model's does."""
    torch.manual_seed(0)
    stock = deberta().eval()
    with torch.no_grad():
        stock.deberta.encoder.LayerNorm.weight.mul_(10)  # positions weigh as much as content (not so at init)
    patched = apply_tempo(copy.deepcopy(stock)).eval()
    ids, mask = padded_batch(16)
    with torch.no_grad():
        unchanged = stock(input_ids=ids, attention_mask=mask).logits
    for model in (stock, patched):
        model.deberta.encoder.layer[1].register_forward_pre_hook(
            lambda module, args, kwargs: CHANGES[field](args, kwargs), with_kwargs=True)
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).logits
        got = patched(input_ids=ids, attention_mask=mask).logits
    assert relative_l2(unchanged, want) > 1e-4  # the change matters to the stock model (10x the tolerance below)
    assert relative_l2(got, want) < 1e-5


def _spy(monkeypatch, name, calls):
    import tempo.integrations.deberta as deberta_module

    real = getattr(deberta_module, name)

    def spy(*args, **kwargs):
        calls.append((kwargs["dropout_p"], kwargs["training"]))
        return real(*args, **kwargs)
    monkeypatch.setattr(deberta_module, name, spy)


@pytest.mark.parametrize("switch", ["rate", "dropout-module-off", "dropout-module-on"])
@pytest.mark.parametrize("path", ["padded", "varlen", "original-forward"])
def test_the_held_dropouts_rate_and_flag_reach_every_path(path, switch, monkeypatch):
    """Class "a held dropout's train flag or rate ignored in one path": the attention dropout is the
    nn.Dropout the layer held before the patch, read at every call on every path — the padded op,
    the variable-length op, the original forward (a call asking for the probabilities). Changed
    after the patch: its rate (0.1 -> 0.3), its own flag off in a training model, its own flag on in
    an eval model (nn.Dropout reads its own flag, so the stock model drops there too)."""
    torch.manual_seed(0)
    stock = deberta(attention_probs_dropout_prob=0.1)
    patched = apply_tempo(copy.deepcopy(stock), gelu=False, layernorm=False, dropout_add_layernorm=False)
    for model in (stock, patched):
        model.train(switch != "dropout-module-on")
        for layer in model.deberta.encoder.layer:
            held = layer.attention.self.dropout
            if switch == "rate":
                held.p = 0.3
            else:
                held.train(switch == "dropout-module-on")
    held = [layer.attention.self.dropout for layer in patched.deberta.encoder.layer]
    expected = [(d.p, d.training) for d in held]
    assert expected == [{"rate": (0.3, True), "dropout-module-off": (0.1, False),
                         "dropout-module-on": (0.1, True)}[switch]] * 2
    calls = []
    if path == "padded":
        _spy(monkeypatch, "disentangled_attention", calls)
        ids, mask = padded_batch(16)
        patched(input_ids=ids, attention_mask=mask)
        assert calls == expected
    elif path == "varlen":
        _spy(monkeypatch, "disentangled_attention_varlen", calls)
        patched(input_ids=torch.randint(3, 100, (1, 12)), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]))
        assert calls == expected
    else:  # the original forward: the stock model's draws, in the same order
        ids, _ = padded_batch(16)  # no padding: a 0 in the probabilities is a dropped one
        outputs = []
        for model in (stock, patched):
            torch.manual_seed(3)
            outputs.append(model(input_ids=ids, output_attentions=True).attentions[0])
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
        dropped = bool((outputs[0] == 0).any())
        assert dropped == expected[0][1]  # it really drops exactly when the flag says so


def test_a_packed_row_of_a_small_v3_config_attends_within_each_sequence():
    """A padding-free row longer than position_buckets // 2 + 1 in a degenerate config: its sequences
    are short, so the op runs them (identity buckets per sequence); a sequence longer than that
    cannot run exactly and the original forward would cross the sequences: refused."""
    torch.manual_seed(0)
    stock = deberta(**DEGENERATE["relative-64-buckets-256"]).train()  # buckets are the identity up to 128
    patched = apply_tempo(copy.deepcopy(stock))
    lengths = [100, 60]
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, 100, (1, n), generator=g) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    out, _ = run(patched, torch.cat(sequences, 1), position_ids=positions)
    alone = torch.cat([run(stock, seq)[0] for seq in sequences], 1)
    assert relative_l2(out, alone) < 1e-5
    long = torch.randint(3, 100, (1, 150), generator=g)
    with pytest.raises(ValueError, match="padding-free batch with a sequence longer than"):
        patched(input_ids=long, position_ids=torch.cat([torch.arange(140), torch.arange(10)])[None])
