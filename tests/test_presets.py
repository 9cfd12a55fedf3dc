"""tempo.presets: the one place every command builds its models from, and its guards."""

from __future__ import annotations

import pytest
import torch

from tempo import presets

transformers = pytest.importorskip("transformers")


def test_a_family_builds_on_the_meta_device_at_its_published_depth_and_vocabulary():
    model = presets.build_family("minilm", task="mlm")
    depth, vocab = presets.FAMILY_DEPTH["minilm"]
    assert type(model).__name__ == "BertForMaskedLM"
    assert model.config.num_hidden_layers == depth == 6 and model.config.vocab_size == vocab == 30522
    assert model.config.hidden_size == presets.FAMILIES["minilm"][2]["hidden_size"] == 384
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_layers_attention_and_task_pass_through():
    model = presets.build_family("bert-large", task="encoder", layers=2, attention="eager")
    assert type(model).__name__ == "BertModel" and len(model.encoder.layer) == 2
    assert model.config._attn_implementation == "eager"
    config = presets.family_config("modernbert-large", 3, vocab=1000, attention="sdpa")
    assert (config.num_hidden_layers, config.vocab_size, config._attn_implementation) == (3, 1000, "sdpa")


def test_an_unknown_family_or_task_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown family 'bert-base'; valid: bert-large, minilm, "):
        presets.family_config("bert-base")
    with pytest.raises(ValueError, match=r"unknown task 'qa'; valid: mlm, causal-lm, encoder, classification"):
        presets.build_family("minilm", task="qa")


def test_a_family_this_transformers_lacks_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(presets.FAMILIES, "future", ("Future-1B (h=64)", "NoSuchFutureConfig",
                                                     dict(hidden_size=64, max_position_embeddings=512)))
    monkeypatch.setitem(presets.FAMILY_DEPTH, "future", (2, 100))
    with pytest.raises(ValueError, match=r"family 'future' \(Future-1B \(h=64\)\) cannot be built: transformers "
                                         r"\S+ has no NoSuchFutureConfig"):
        presets.build_family("future")


def test_the_plan_command_names_a_family_this_transformers_lacks(monkeypatch):
    from tempo.plan.cli import main

    monkeypatch.setitem(presets.FAMILIES, "future", ("Future-1B (h=64)", "NoSuchFutureConfig",
                                                     dict(hidden_size=64, max_position_embeddings=512)))
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "future"])
    assert str(exit_info.value).startswith("python -m tempo.plan: --model future: transformers ")
    assert str(exit_info.value).endswith(" has no NoSuchFutureConfig")


def test_a_decoder_has_no_mlm_head_said_in_one_line_with_the_task_it_has():
    from tempo.plan.cli import main

    with pytest.raises(SystemExit, match=r"^python -m tempo.plan: --model llama-3.2-1b: llama-3.2-1b \(LlamaConfig\) "
                                         r"has no mlm head in transformers \S+; a decoder: --task causal-lm$"):
        main(["--model", "llama-3.2-1b"])
    model = presets.build_family("qwen3-0.6b", task="causal-lm", layers=1)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.lm_head.weight.device.type == "meta"


def test_a_local_config_or_model_folder_builds_the_users_model(tmp_path):
    presets.family_config("minilm", layers=2).save_pretrained(tmp_path)
    for path in (tmp_path, tmp_path / "config.json"):
        model = presets.model_on_meta(presets.local_config(str(path)), "mlm", str(path))
        assert type(model).__name__ == "BertForMaskedLM" and model.config.num_hidden_layers == 2


@pytest.mark.parametrize("make, message", [
    (lambda d: d, "no config.json there"),
    (lambda d: (d / "weights.json").write_text("{}") and d / "weights.json", "must be a file named config.json"),
    (lambda d: (d / "config.json").write_text('{"model_type": "no-such-model"}') and d, "transformers cannot read it"),
])
def test_a_path_without_a_readable_config_is_named(tmp_path, make, message):
    from tempo.plan.cli import main

    path = make(tmp_path)
    with pytest.raises(SystemExit, match=f"^python -m tempo.plan: --model {path}: .*{message}"):
        main(["--model", str(path)])


def test_position_limits_and_sdpa_support():
    assert presets.longest_seq_len("bert-large") == 512
    assert presets.longest_seq_len("mpnet-base") == 512  # 514 positions counted from padding_idx + 1
    assert presets.longest_seq_len("modernbert-large") == 8192
    assert presets.supports_sdpa("bert-large") and not presets.supports_sdpa("deberta-v3-large")


def test_a_policy_asking_for_sdpa_runs_eager_where_the_family_has_none_and_says_so():
    from tempo.plan.torch_policies import POLICIES, _attention_note, policy_attention

    assert policy_attention(POLICIES["sdpa"], "bert-large") == "sdpa"
    assert policy_attention(POLICIES["sdpa"], "deberta-v3-large") == "eager"
    assert policy_attention(POLICIES["eager"], "deberta-v3-large") == "eager"
    assert _attention_note(POLICIES["sdpa"], "deberta-v3-large") == "deberta-v3-large has no sdpa: eager attention"
    assert _attention_note(POLICIES["sdpa"], "bert-large") == ""


def test_transformers_bert_takes_every_field_of_our_config():
    from tempo.bert.config import BertConfig

    ours = BertConfig.from_name("bert_tiny")
    hf = presets.hf_bert_config(ours, layers=5, attention="sdpa")
    for field, value in ours.to_dict().items():
        assert getattr(hf, field) == (5 if field == "num_hidden_layers" else value), field
    assert hf._attn_implementation == "sdpa"
    assert presets.hf_bert_config(ours).num_hidden_layers == ours.num_hidden_layers == 2
    with torch.device("meta"):
        model = transformers.BertModel(presets.hf_bert_config(ours, layers=1))
    assert len(model.encoder.layer) == 1 and model.config.hidden_size == 128


def test_bert_pretraining_masks_fifteen_percent_in_multiples_of_four():
    assert presets.default_max_predictions(128) == 20 and presets.default_max_predictions(512) == 80
    assert presets.default_max_predictions(2) == 2  # never more positions than tokens (4 rounded up)


def test_the_plan_command_plans_a_local_model_folder_with_its_task(tmp_path, capsys):
    """``python -m tempo.plan --model FOLDER --task T``: the user's config with the head T, planned."""
    from tempo.plan.cli import main

    presets.family_config("minilm", layers=2).save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--task", "encoder", "--seq-len", "64", "--budget", "2GiB",
                 "--device", "cpu", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "tokens per step" in out and "BertModel" in out
