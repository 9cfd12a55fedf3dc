"""tempo-convert and DLE checkpoints: a DLE-style model written here as DLE's modeling.py computes
(LinearActivation `dense_act` layers, F.gelu in the tanh form, vocabulary padded to a multiple of
8), loaded into ours with the tanh GELU; DLE -> HF -> DLE round trips; Tempo training
checkpoints as a source; and every bad input the converter refuses, each in one line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tempo.train import convert
from tempo.bert.config import BertConfig
from tempo.bert.hf_interop import CheckpointError, load_pretrained
from tempo.bert.model import BertForPreTraining
from tempo.choices import TempoChoice

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]

DLE_CONFIG = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                  max_position_embeddings=16, type_vocab_size=2, initializer_range=0.02)
PADDED_VOCAB = 104


# ---------------------------------------------------------------------------------------------
# A DLE-style BertForPreTraining, as DLE's modeling.py (2022-03 and later) computes it
# ---------------------------------------------------------------------------------------------
def dle_gelu(x):
    return F.gelu(x, approximate="tanh")  # DLE: torch.nn.functional.gelu(x, approximate=True), NGC's spelling


class LinearActivation(nn.Module):
    def __init__(self, in_features, out_features, act):
        super().__init__()
        self.act_fn = act
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x):
        return self.act_fn(F.linear(x, self.weight, self.bias))


class DleEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], c["hidden_size"])
        self.token_type_embeddings = nn.Embedding(c["type_vocab_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=1e-12)

    def forward(self, ids, types):
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(types)
        return self.LayerNorm(x)


class DleSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.size = c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]
        self.query, self.key, self.value = (nn.Linear(c["hidden_size"], c["hidden_size"]) for _ in range(3))

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, self.heads, self.size).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.size) + mask
        return (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, -1)


class DleDenseNorm(nn.Module):
    def __init__(self, c, inner):
        super().__init__()
        self.dense = nn.Linear(inner, c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=1e-12)

    def forward(self, x, residual):
        return self.LayerNorm(self.dense(x) + residual)


class DleAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = DleSelfAttention(c)
        self.output = DleDenseNorm(c, c["hidden_size"])

    def forward(self, x, mask):
        return self.output(self.self(x, mask), x)


class DleIntermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense_act = LinearActivation(c["hidden_size"], c["intermediate_size"], dle_gelu)

    def forward(self, x):
        return self.dense_act(x)


class DleLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = DleAttention(c)
        self.intermediate = DleIntermediate(c)
        self.output = DleDenseNorm(c, c["intermediate_size"])

    def forward(self, x, mask):
        attended = self.attention(x, mask)
        return self.output(self.intermediate(attended), attended)


class DleEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList(DleLayer(c) for _ in range(c["num_hidden_layers"]))


class DlePooler(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense_act = LinearActivation(c["hidden_size"], c["hidden_size"], torch.tanh)


class DleBertModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embeddings = DleEmbeddings(c)
        self.encoder = DleEncoder(c)
        self.pooler = DlePooler(c)

    def forward(self, ids, types, mask):
        additive = (1.0 - mask[:, None, None, :].float()) * -10000.0
        x = self.embeddings(ids, types)
        for layer in self.encoder.layer:
            x = layer(x, additive)
        return x, self.pooler.dense_act(x[:, 0])


class DleTransform(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense_act = LinearActivation(c["hidden_size"], c["hidden_size"], dle_gelu)
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=1e-12)


class DleLMHead(nn.Module):
    def __init__(self, c, embedding_weight):
        super().__init__()
        self.transform = DleTransform(c)
        self.decoder = nn.Linear(embedding_weight.shape[1], embedding_weight.shape[0], bias=False)
        self.decoder.weight = embedding_weight
        self.bias = nn.Parameter(torch.zeros(embedding_weight.shape[0]))

    def forward(self, x):
        return self.decoder(self.transform.LayerNorm(self.transform.dense_act(x))) + self.bias


class DleHeads(nn.Module):
    def __init__(self, c, embedding_weight):
        super().__init__()
        self.predictions = DleLMHead(c, embedding_weight)
        self.seq_relationship = nn.Linear(c["hidden_size"], 2)


class DleBertForPreTraining(nn.Module):
    """Same parameter names and order as DLE's BertForPreTraining; DLE's run_pretraining.py builds
    it with config.vocab_size rounded up to a multiple of 8."""

    def __init__(self, config: dict):
        super().__init__()
        c = {**config, "vocab_size": (config["vocab_size"] + 7) // 8 * 8}
        self.bert = DleBertModel(c)
        self.cls = DleHeads(c, self.bert.embeddings.word_embeddings.weight)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.randn_like(p) * 0.05 + (1.0 if name.endswith("LayerNorm.weight") else 0.0))

    def forward(self, ids, types, mask):
        sequence, pooled = self.bert(ids, types, mask)
        return self.cls.predictions(sequence), self.cls.seq_relationship(pooled)


def dle_model(zero_padded_rows=True) -> DleBertForPreTraining:
    model = DleBertForPreTraining(DLE_CONFIG).eval()
    if zero_padded_rows:  # as after loading an HF file; a DLE-trained file has learned values there
        with torch.no_grad():
            model.bert.embeddings.word_embeddings.weight[DLE_CONFIG["vocab_size"]:] = 0
            model.cls.predictions.bias[DLE_CONFIG["vocab_size"]:] = 0
    return model


def save_dle(model, path, **extra):
    torch.save({"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "grad_scaler": {},
                "epoch": 1, **extra}, path)
    return path


def write_dle_config(tmp_path) -> Path:
    path = tmp_path / "bert_config.json"
    path.write_text(json.dumps(DLE_CONFIG))
    return path


def batch(length=10):
    torch.manual_seed(3)
    ids = torch.randint(1, DLE_CONFIG["vocab_size"], (3, length))
    types = torch.zeros_like(ids)
    types[:, length // 2:] = 1
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return ids, types, mask


def run_cli(*args):
    """tempo-convert's main in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = convert.main([str(a) for a in args])
    return status, out.getvalue(), err.getvalue()


def run_process(*args):
    """``python -m tempo.train.convert`` in a fresh process: (exit status, stdout, stderr)."""
    result = subprocess.run([sys.executable, "-m", "tempo.train.convert", *map(str, args)], capture_output=True,
                            text=True, cwd=REPO, timeout=300)
    return result.returncode, result.stdout, result.stderr


def assert_one_line_error(stderr: str, *needles: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("tempo-convert: error: ") and "\x1b" not in lines[0]
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ---------------------------------------------------------------------------------------------
# DLE checkpoints into our model: the GELU form is an explicit choice
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [TempoChoice.original(), TempoChoice.full()], ids=["original", "tempo"])
def test_dle_checkpoint_gives_dle_logits_with_the_tanh_form(tmp_path, options):
    source = dle_model(zero_padded_rows=False)
    path = save_dle(source, tmp_path / "ckpt_100.pt")
    config = BertConfig.from_json_file(write_dle_config(tmp_path))
    assert config.hidden_act == "gelu" and config.gelu_approximate == "none"  # what DLE's config says

    ours = BertForPreTraining(config.with_gelu("tanh"), options).eval()
    report = load_pretrained(ours, path, strict=True)
    assert report.format == "dle" and report.missing_keys == [] and report.unexpected_keys == []
    ids, types, mask = batch()
    with torch.no_grad():
        want_mlm, want_nsp = source(ids, types, mask)
        got = ours(ids, types, mask)
    torch.testing.assert_close(got.prediction_scores, want_mlm, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.seq_relationship_score, want_nsp, atol=1e-5, rtol=0)

    exact = BertForPreTraining(config, options).eval()  # the config's literal "gelu": the other form
    load_pretrained(exact, path, strict=True)
    with torch.no_grad():
        assert (exact(ids, types, mask).prediction_scores - want_mlm).abs().max() > 1e-5


def test_dle_note_names_the_flag():
    from tempo.bert.hf_interop import dle_gelu_note

    note = dle_gelu_note(BertConfig(**DLE_CONFIG))
    assert "exact erf" in note and "--gelu_approximate tanh" in note and "2022-03" in note


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------
def load_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_identical_states(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


def test_dle_to_hf_to_dle_is_byte_identical_and_transformers_loads_it(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    source = dle_model()
    dle = save_dle(source, tmp_path / "ckpt_100.pt")
    config = write_dle_config(tmp_path)
    hf_dir, back = tmp_path / "hf", tmp_path / "back.pt"

    assert convert.main([str(dle), str(hf_dir), "--config", str(config), "--gelu_approximate", "tanh"]) == 0
    out = capsys.readouterr().out
    assert "read 46 tensors" in out and "wrote" in out and "note:" not in out  # explicit form: no note
    hf_config = json.loads((hf_dir / "config.json").read_text())
    assert hf_config["hidden_act"] == "gelu_pytorch_tanh" and hf_config["vocab_size"] == 101
    assert hf_config["architectures"] == ["BertForPreTraining"]

    hf = transformers.BertForPreTraining.from_pretrained(str(hf_dir), attn_implementation="eager").eval()
    ids, types, mask = batch()
    with torch.no_grad():
        want_mlm, want_nsp = source(ids, types, mask)
        got = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    torch.testing.assert_close(got.prediction_logits, want_mlm[..., :101], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.seq_relationship_logits, want_nsp, atol=1e-5, rtol=0)

    assert convert.main([str(hf_dir), str(back)]) == 0
    out = capsys.readouterr().out
    assert "note: DLE's modeling.py computes 'gelu' in the tanh form" not in out  # the tanh form: as DLE
    written = load_state(back)
    assert_identical_states(written, load_state(dle))
    assert written["cls.predictions.decoder.weight"] is written["bert.embeddings.word_embeddings.weight"]
    assert written["bert.encoder.layer.1.intermediate.dense_act.weight"].shape == (64, 32)
    assert written["bert.embeddings.word_embeddings.weight"].shape[0] == PADDED_VOCAB

    strict = DleBertForPreTraining(DLE_CONFIG).eval()
    assert not strict.load_state_dict(written, strict=True).missing_keys  # DLE's strict load
    with torch.no_grad():
        again_mlm, again_nsp = strict(ids, types, mask)
    assert torch.equal(again_mlm, want_mlm) and torch.equal(again_nsp, want_nsp)


def test_padded_vocabulary_rows_dropped_with_a_note_or_kept(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    source = dle_model(zero_padded_rows=False)  # trained rows beyond vocab_size, as DLE files have
    dle = save_dle(source, tmp_path / "ckpt.pt")
    config = write_dle_config(tmp_path)

    assert convert.main([str(dle), str(tmp_path / "hf"), "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "padded vocabulary rows" in out and "--keep_padded_vocab" in out
    assert "--gelu_approximate tanh" in out  # a DLE source without an explicit form gets the note
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "back.pt")]) == 0
    written, original = load_state(tmp_path / "back.pt"), load_state(dle)
    for key in written:  # everything identical except the dropped rows, which come back as zeros
        if key in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias", "cls.predictions.decoder.weight"):
            assert torch.equal(written[key][:101], original[key][:101]) and not written[key][101:].any()
        else:
            assert torch.equal(written[key], original[key]), key

    assert convert.main([str(dle), str(tmp_path / "hf_kept"), "--config", str(config), "--keep_padded_vocab"]) == 0
    assert json.loads((tmp_path / "hf_kept" / "config.json").read_text())["vocab_size"] == PADDED_VOCAB
    transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf_kept"))
    assert convert.main([str(tmp_path / "hf_kept"), str(tmp_path / "kept.pt")]) == 0
    assert_identical_states(load_state(tmp_path / "kept.pt"), original)


def test_bare_state_dict_with_ddp_prefixes_and_fp16(tmp_path):
    source = dle_model()
    state = {"module." + k: v.half() for k, v in source.state_dict().items()}
    torch.save(state, tmp_path / "bare.pt")
    config = write_dle_config(tmp_path)
    assert convert.main([str(tmp_path / "bare.pt"), str(tmp_path / "hf"), "--config", str(config)]) == 0
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "out.pt")]) == 0
    written = load_state(tmp_path / "out.pt")
    assert all(t.dtype == torch.float16 for t in written.values())  # dtypes are kept, not cast
    assert_identical_states(written, {k.removeprefix("module."): v for k, v in state.items()})


def test_tempo_training_checkpoint_as_source(tmp_path):
    from safetensors.torch import load_file
    from tempo.train.checkpointing import save_checkpoint

    config = BertConfig(**{**DLE_CONFIG, "hidden_act": "gelu_new"})
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    out_dir = tmp_path / "run"
    save_checkpoint(out_dir, 7, model, extra={"phase": 1, "config": config.to_dict()})
    for src in (out_dir, out_dir / "checkpoints" / "ckpt_7"):  # the run's newest, or the one named
        dst = tmp_path / f"hf_{src.name}"
        assert convert.main([str(src), str(dst)]) == 0
        assert json.loads((dst / "config.json").read_text())["hidden_act"] == "gelu_new"
        tensors = load_file(dst / "model.safetensors")
        torch.testing.assert_close(tensors["bert.embeddings.word_embeddings.weight"],
                                   model.bert.embeddings.word_embeddings.weight[:101].detach(), atol=0, rtol=0)
    assert convert.main([str(out_dir), str(tmp_path / "dle.pt")]) == 0
    written = load_state(tmp_path / "dle.pt")
    strict = DleBertForPreTraining(DLE_CONFIG)
    strict.load_state_dict(written, strict=True)
    for key, value in model.state_dict().items():
        dle_key = convert.dle_key(key)
        assert torch.equal(written[dle_key], value), key


def test_console_script_is_declared():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tempo-convert"] == "tempo.train.convert:main"


# ---------------------------------------------------------------------------------------------
# Bad inputs: one line naming the file, field or flag; exit status 1; nothing written
# ---------------------------------------------------------------------------------------------
def test_dle_without_config_names_the_flag(tmp_path):
    dle = save_dle(dle_model(), tmp_path / "ckpt.pt")
    status, _, err = run_cli(dle, tmp_path / "hf")
    assert status == 1
    assert_one_line_error(err, str(dle), "--config")
    assert not (tmp_path / "hf").exists()


def test_pickled_checkpoint_needs_allow_pickle(tmp_path):
    import argparse

    source = dle_model()
    dle = save_dle(source, tmp_path / "pickled.pt", args=argparse.Namespace(lr=1e-3))
    config = write_dle_config(tmp_path)
    status, _, err = run_process(dle, tmp_path / "hf", "--config", config)  # the real command, stderr and all
    assert status == 1
    assert_one_line_error(err, str(dle), "--allow-pickle", "argparse.Namespace")
    assert "Weights only load failed" not in err and not (tmp_path / "hf").exists()

    status, out, err = run_cli(dle, tmp_path / "hf", "--config", config, "--allow-pickle")
    assert status == 0, err
    assert "only for files you trust" in err and "wrote" in out
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "clean.pt")]) == 0
    assert_identical_states(load_state(tmp_path / "clean.pt"), source.state_dict())  # now tensors only


def test_existing_destination_refused_unless_overwrite(tmp_path):
    dle = save_dle(dle_model(), tmp_path / "ckpt.pt")
    config = write_dle_config(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("keep me")
    status, _, err = run_cli(dle, tmp_path / "hf", "--config", config)
    assert status == 1
    assert_one_line_error(err, str(tmp_path / "hf"), "--overwrite")
    assert (tmp_path / "hf" / "mine.txt").read_text() == "keep me"

    (tmp_path / "out.pt").write_bytes(b"old")
    status, _, err = run_cli(tmp_path / "hf", tmp_path / "out.pt")
    assert status == 1 and (tmp_path / "out.pt").read_bytes() == b"old"

    assert convert.main([str(dle), str(tmp_path / "hf"), "--config", str(config), "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_failed_write_leaves_the_old_destination(tmp_path, monkeypatch):
    dle = save_dle(dle_model(), tmp_path / "ckpt.pt")
    config = write_dle_config(tmp_path)
    assert convert.main([str(dle), str(tmp_path / "hf"), "--config", str(config)]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "hf"))

    monkeypatch.setattr(convert, "write_hf_files", fail)
    assert convert.main([str(dle), str(tmp_path / "hf"), "--config", str(config), "--gelu_approximate", "tanh",
                         "--overwrite"]) == 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_empty_or_truncated_file(tmp_path, damage):
    dle = save_dle(dle_model(), tmp_path / "ckpt.pt")
    data = dle.read_bytes()
    dle.write_bytes(b"" if damage == "empty" else data[: len(data) // 3])
    status, _, err = run_cli(dle, tmp_path / "hf", "--config", write_dle_config(tmp_path))
    assert status == 1
    assert_one_line_error(err, str(dle), damage)
    assert not (tmp_path / "hf").exists()


def test_truncated_safetensors_in_hf_folder(tmp_path):
    dle = save_dle(dle_model(), tmp_path / "ckpt.pt")
    assert convert.main([str(dle), str(tmp_path / "hf"), "--config", str(write_dle_config(tmp_path))]) == 0
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    status, _, err = run_cli(tmp_path / "hf", tmp_path / "out.pt")
    assert status == 1
    assert_one_line_error(err, str(weights))


@pytest.mark.parametrize("change, needle", [
    ({"hidden_size": 64, "intermediate_size": 128}, "bert.embeddings.word_embeddings.weight"),
    ({"num_hidden_layers": 3}, "encoder.layer.2"),
    ({"vocab_size": 200}, "vocab_size"),
    ({"intermediate_size": 48}, "intermediate.dense.weight"),
])
def test_shapes_that_do_not_fit_the_config(tmp_path, change, needle):
    dle = save_dle(dle_model(), tmp_path / "ckpt.pt")
    config = tmp_path / "other.json"
    config.write_text(json.dumps({**DLE_CONFIG, **change}))
    status, _, err = run_cli(dle, tmp_path / "hf", "--config", config)
    assert status == 1
    assert_one_line_error(err, str(dle), needle)
    assert not (tmp_path / "hf").exists()


def test_bad_config_and_paths(tmp_path):
    dle = save_dle(dle_model(), tmp_path / "ckpt.pt")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**DLE_CONFIG, "hidden_act": "quick_gelu"}))
    status, _, err = run_cli(dle, tmp_path / "hf", "--config", bad)
    assert status == 1
    assert_one_line_error(err, str(bad), "'hidden_act'", "'gelu_new'")

    status, _, err = run_cli(tmp_path / "absent.pt", tmp_path / "hf", "--config", write_dle_config(tmp_path))
    assert status == 1
    assert_one_line_error(err, "absent.pt")

    status, _, err = run_cli(dle, tmp_path / "x.pt", "--to", "hf", "--config", write_dle_config(tmp_path))
    assert status == 1
    assert_one_line_error(err, "x.pt", "--to hf")

    extra = {**dle_model().state_dict(), "bert.adapter.weight": torch.zeros(3)}
    torch.save({"model": extra}, tmp_path / "extra.pt")
    status, _, err = run_cli(tmp_path / "extra.pt", tmp_path / "hf", "--config", write_dle_config(tmp_path))
    assert status == 1
    assert_one_line_error(err, "extra.pt", "bert.adapter.weight")

    with pytest.raises(CheckpointError, match="untied"):
        untied = {k: v.clone() for k, v in dle_model().state_dict().items()}
        untied["cls.predictions.decoder.weight"] += 1
        convert.canonical_tensors(untied, tmp_path / "untied.pt")


# ---------------------------------------------------------------------------------------------
# The trainers: --gelu_approximate and the load report of --init_checkpoint
# ---------------------------------------------------------------------------------------------
def test_run_pretraining_reports_the_load_and_takes_the_gelu_form(tmp_path):
    dle = save_dle(dle_model(), tmp_path / "ckpt_100.pt")
    config = write_dle_config(tmp_path)

    def pretrain(out, *extra):
        cmd = [sys.executable, str(REPO / "run_pretraining.py"), "--synthetic_data", "--config_file", str(config),
               "--output_dir", str(out), "--max_seq_length", "16", "--max_predictions_per_seq", "3",
               "--train_batch_size", "2", "--max_steps", "1", "--num_workers", "0", "--disable_progress_bar",
               "--no_cuda", "--no-tempo", "--init_checkpoint", str(dle), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        saved = torch.load(out / "checkpoints" / "ckpt_1" / "training_state.pt", weights_only=True)
        return result.stdout, saved["extra"]["config"]["hidden_act"]

    out, hidden_act = pretrain(tmp_path / "tanh", "--gelu_approximate", "tanh")
    assert hidden_act == "gelu_pytorch_tanh"
    assert f"run_pretraining.py: init_checkpoint: loaded 46 tensors from {dle} (dle format)" in out
    assert "run_pretraining.py: init_checkpoint: missing keys (left as initialised) none" in out
    assert "run_pretraining.py: init_checkpoint: unused keys (in the file, not in the model) none" in out
    assert "--gelu_approximate tanh" not in out

    out, hidden_act = pretrain(tmp_path / "default")
    assert hidden_act == "gelu" and "note: DLE configs say 'gelu' for both GELU forms" in out


def test_run_squad_takes_the_gelu_form_from_the_flag(tmp_path, capsys):
    from tempo.bert.data.qa_generator import write_qa_set
    from tempo.bert.hf_interop import minilm_dir
    from tempo.bert.model import BertForQuestionAnswering
    from tempo.tasks.squad import main as squad_main

    try:
        vocab = minilm_dir() / "vocab.txt"
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    config = BertConfig.from_json_file(REPO / "configs" / "bert_tiny.json")
    state = {convert.dle_key(k): v for k, v in BertForQuestionAnswering(config).state_dict().items()}
    torch.save({"model": state}, tmp_path / "squad.pt")
    _, dev = write_qa_set(tmp_path / "qa", num_train=4, num_dev=4, seed=7)
    args = ["--init_checkpoint", str(tmp_path / "squad.pt"), "--config_file", str(REPO / "configs" / "bert_tiny.json"),
            "--vocab_file", str(vocab), "--do_predict", "--predict_file", str(dev), "--max_seq_length", "96",
            "--doc_stride", "32", "--max_query_length", "24", "--disable-progress-bar", "--num_workers", "0",
            "--no-tempo", "--skip_cache"]
    assert squad_main([*args, "--output_dir", str(tmp_path / "tanh"), "--gelu_approximate", "tanh"]) == 0
    out = capsys.readouterr().out
    assert "run_squad.py: init_checkpoint: missing keys (left as initialised) none" in out
    assert "note: DLE configs" not in out
    assert squad_main([*args, "--output_dir", str(tmp_path / "exact")]) == 0
    assert "note: DLE configs say 'gelu' for both GELU forms" in capsys.readouterr().out
