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


def test_padding_free_refuses_the_convolution_layer_and_padding():
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
    masks only), and a call asking for the probabilities: the original forward, logged once."""
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
    monkeypatch.setattr(deberta_module, "_logged_weights", False)
    with caplog.at_level(logging.INFO, logger="tempo.integrations.deberta"), torch.no_grad():
        got = layer_t(hidden, pairs, rel_embeddings=rel)[0]
        want = layer_s(hidden, pairs, rel_embeddings=rel)[0]
        weights = patched(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(weights) == 2 and weights[0].shape == (3, 2, 40, 40)
    assert sum("runs the model's own attention" in m for m in caplog.messages) == 1


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
