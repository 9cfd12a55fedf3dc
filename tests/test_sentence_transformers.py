"""Tempo in sentence-transformers models: the shipped all-MiniLM-L6-v2 (issue, part 4).

apply_tempo on a SentenceTransformer leaves its embeddings and state_dict as they were and
reverts cleanly; CachedMultipleNegativesRankingLoss (GradCache: a no_grad pass, then a replay
with grad from the saved RNG state) gives the direct gradient with dropout on, which needs Tempo's
dropout layers to draw the same masks with and without a backward; and the example
(examples/st_contrastive_batch.py) trains both variants and fits a bigger batch with Tempo.

sentence-transformers is a test dependency: without it these tests fail, they do not skip.

    python -m pytest tests/test_sentence_transformers.py -q
"""

import copy
import logging
import os
import re
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it: nothing is downloaded

from sentence_transformers import SentenceTransformer  # noqa: E402

from tempo.bert.hf_interop import minilm_dir  # noqa: E402
from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def import_example():
    sys.path.insert(0, EXAMPLES)
    try:
        import st_contrastive_batch
    finally:
        sys.path.remove(EXAMPLES)
    return st_contrastive_batch


@pytest.fixture(scope="module")
def shipped_minilm():
    return SentenceTransformer(str(minilm_dir()), device="cpu")


@pytest.fixture
def minilm(shipped_minilm):
    return copy.deepcopy(shipped_minilm)  # each test may patch or train its own copy


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return import_example().document_pairs(tmp_path_factory.mktemp("corpus"), num_documents=40, seed=0)


def test_apply_tempo_keeps_embeddings_and_state_dict_and_reverts(minilm, pairs, caplog):
    sentences = pairs[0][:6] + pairs[1][:6]
    stock_embeddings = minilm.encode(sentences, convert_to_tensor=True)
    stock_keys = list(minilm.state_dict())
    stock_attention = minilm[0].auto_model.config._attn_implementation

    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        assert apply_tempo(minilm) is minilm
    assert any("apply_tempo: replaced" in r.getMessage() for r in caplog.records), caplog.text
    patched = tempo_patched(minilm)
    assert patched["FusedResidualOutput"] == 12 and patched["InplaceGelu"] == 6 and patched["attention"] == 1, patched
    assert list(minilm.state_dict()) == stock_keys
    tempo_embeddings = minilm.encode(sentences, convert_to_tensor=True)
    assert (tempo_embeddings - stock_embeddings).abs().max().item() <= 1e-5

    revert_tempo(minilm)
    assert not any(count for kind, count in tempo_patched(minilm).items()), tempo_patched(minilm)
    assert minilm[0].auto_model.config._attn_implementation == stock_attention
    assert type(minilm[0].auto_model.encoder.layer[0].output).__name__ == "BertOutput"
    assert list(minilm.state_dict()) == stock_keys
    assert (minilm.encode(sentences, convert_to_tensor=True) - stock_embeddings).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", ["stock", "tempo"])
def test_cached_mnrl_replay_reproduces_dropout_masks(minilm, pairs, variant):
    """GradCache is exact only if the replay with grad draws the no_grad pass's dropout masks.
    The stock model is the control: torch's dropout draws alike with and without grad."""
    example = import_example()
    model = apply_tempo(minilm) if variant == "tempo" else minilm
    anchors, positives = pairs
    result = example.cached_mnrl_replay_check(model, anchors[:8], positives[:8], mini_batch_size=2,
                                              max_seq_length=32, seed=0)
    report = example.format_check(variant, result)
    assert result["dropout_effect"] > 1e-2, report  # dropout really is on: the masks matter
    assert result["replay_vs_no_grad"] <= example.REPLAY_TOLERANCE, report
    assert result["reference_vs_no_grad"] <= example.REPLAY_TOLERANCE, report
    assert result["grad"] <= example.REPLAY_TOLERANCE, report
    assert result["worst_param_grad"] <= example.REPLAY_TOLERANCE, report
    assert result["passed"], report


def largest_batches(out: str) -> dict[str, int]:
    return {name: int(pairs) for name, pairs in re.findall(r"^\| (stock|tempo) +\|[^|]+\| (\d+) pairs", out, re.M)}


def test_example_trains_both_and_tempo_fits_a_bigger_batch(tmp_path, capsys):
    example = import_example()
    argv = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--max_seq_length", "32",
            "--num_documents", "40", "--measure_pairs", "2", "--check_pairs", "4", "--mini_batch_size", "2",
            "--output_dir", str(tmp_path)]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    fits = largest_batches(out)
    assert fits.keys() == {"stock", "tempo"}, out
    assert fits["tempo"] > fits["stock"] > 0, out
    assert re.search(r"^stock +final_loss=\d", out, re.M) and re.search(r"^tempo +final_loss=\d", out, re.M), out
    assert re.search(r"^stock +PASS", out, re.M) and re.search(r"^tempo +PASS", out, re.M), out


@pytest.mark.parametrize("argv, named", [(["--memory_budget", "lots"], "--memory_budget"),
                                         (["--max_seq_length", "0"], "--max_seq_length"),
                                         (["--max_seq_length", "1000"], "--max_seq_length"),  # MiniLM has 512
                                         (["--check_pairs", "500"], "--num_documents"),
                                         (["--only", "both"], "--only")])
def test_example_rejects_bad_input_naming_the_argument(argv, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        import_example().main(argv + ["--max_steps", "0", "--num_documents", "40", "--output_dir", str(tmp_path)])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
