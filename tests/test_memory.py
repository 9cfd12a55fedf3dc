"""The activation ledger: storage deduplication, parameters set apart, attribution, the table."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tempo import presets
from tempo.memory import ActivationLedger, marginal_bytes_per_token, saved_bytes
from tempo.memory.cli import main
from tempo.memory.tables import format_table, ledger_table


def test_views_of_one_storage_count_once():
    x = torch.randn(8, 16, requires_grad=True)

    def f():
        a = x.sin()  # sin keeps x
        b = a[:, :8] * a[:, 8:]  # keeps two views of a's storage: counted once, whole storage
        return b.sum()

    ledger = saved_bytes(f)
    assert ledger.activation_bytes == 2 * 8 * 16 * 4  # x and a


def test_parameters_are_set_apart_and_modules_attributed():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with ActivationLedger(model) as ledger:
        model(x).sum()
    # Linear 0 keeps its input x; ReLU keeps its output; Linear 2 keeps that same output again.
    assert ledger.by_module() == {"0": 3 * 4 * 4, "1": 3 * 8 * 4}
    assert ledger.activation_bytes == 3 * 4 * 4 + 3 * 8 * 4
    # The second Linear's weight is kept for the input gradient: a parameter, not an activation.
    assert ledger.parameter_bytes == 8 * 2 * 4


def test_marginal_bytes_exclude_the_fixed_part():
    weight = torch.randn(16, 16, requires_grad=True)

    def run(batch: int) -> ActivationLedger:
        x = torch.randn(batch, 10, 16, requires_grad=True)
        fixed = weight * 1.0  # a batch-independent tensor kept for backward, like autocast's casts
        return saved_bytes(lambda: torch.tanh(x @ fixed).sum())

    per_token, fixed = marginal_bytes_per_token(run, tokens_per_sample=10)
    assert per_token == 16 * 4 * 2  # x and tanh's output, per token
    assert fixed == 16 * 16 * 4  # the product kept by the matmul


def test_ledger_table_for_a_small_config_and_cli(capsys):
    # The BERT-large table is the CLI's job; a two-row table at s=16 checks the plumbing fast.
    rows = ledger_table(seq_lens=(16,), variants=("original", "tempo", "tempo-floor"), dtype=torch.bfloat16)
    assert rows[0]["seq_len"] == 16 and rows[0]["tempo-floor"] < rows[0]["tempo"] < rows[0]["original"]
    text = format_table(rows)
    assert "| 16 |" in text and "%" in text and "Tempo (paper's 3 layers)" in text
    assert main(["--seq-lens", "16", "--no-hf"]) == 0
    out = capsys.readouterr().out
    assert "Tempo (all layers) saves" in out and "| 16 |" in out
    assert "Left out: the HF columns and the transformers families table (--no-hf)." in out


# -- the transformers families (tempo.presets.FAMILIES) ---------------------------------------------
# What apply_tempo swaps in one added layer of each family, at least: the coverage table's column
# (results/coverage/coverage_bf16.md, docs/huggingface.md). Every family of FAMILIES must be here.
EXPECTED_SWAPS = {
    "bert-large": {"FusedResidualOutput": 2, "InplaceGelu": 1, "attention": 1},
    "minilm": {"FusedResidualOutput": 2, "InplaceGelu": 1, "attention": 1},
    "deberta-v3-large": {"FusedResidualOutput": 2, "InplaceGelu": 1, "DebertaEfficientAttention": 1},
    "modernbert-large": {"InplaceLayerNorm": 2, "GatedMLP": 1, "attention": 1},
    "mpnet-base": {"InplaceLayerNorm": 1, "FusedResidualOutput": 1, "InplaceGelu": 1, "MPNetEfficientSelfAttention": 1},
    "eurobert-210m": {"InplaceRMSNorm": 2, "GatedMLP": 1, "attention": 1},
    "embeddinggemma-300m": {"InplaceRMSNorm": 6, "GatedMLP": 1, "attention": 1},  # 4 + q_norm, k_norm
    "nomicbert": {"InplaceLayerNorm": 2, "GatedMLP": 1, "attention": 1},
    "gte-multilingual-base": {"InplaceLayerNorm": 2, "GatedMLP": 1, "attention": 1},
    "jina-v3": {"InplaceLayerNorm": 2, "InplaceGelu": 1, "attention": 1},
    "llama-3.2-1b": {"InplaceRMSNorm": 2, "GatedMLP": 1, "attention": 1},
    "qwen3-0.6b": {"InplaceRMSNorm": 4, "GatedMLP": 1, "attention": 1},  # 2 + q_norm, k_norm
}
NEWEST_TRANSFORMERS = "5.24"  # the release the table was measured with: every family must build there


def _skip_if_unavailable(family):
    """One line, never silently: a family whose config class this transformers lacks (GTE in the GPU
    image's 5.17) is skipped; on the newest release it must build."""
    import transformers
    from packaging.version import Version

    why = presets.family_unavailable(family)
    if why is not None:
        assert Version(transformers.__version__) < Version(NEWEST_TRANSFORMERS), f"{family}: {why}"
        pytest.skip(f"{family}: {why}")


def _available_families():
    return [f for f in presets.FAMILIES if presets.family_unavailable(f) is None]


def tiny_fields(family):
    """The family's fields at a small width (h = 64, 4 heads, I = 128), the same config class: real models
    build in milliseconds; grouped kv heads stay grouped, sliding windows shorter than the test's s."""
    FAMILIES = presets.FAMILIES
    fields = dict(FAMILIES[family][2], hidden_size=64, num_attention_heads=4, intermediate_size=128)
    if "num_key_value_heads" in fields:
        grouped = FAMILIES[family][2]["num_key_value_heads"] < FAMILIES[family][2]["num_attention_heads"]
        fields["num_key_value_heads"] = (1 if family == "embeddinggemma-300m" else 2) if grouped else 4
    if "head_dim" in fields:
        fields.update(head_dim=16)
    if "query_pre_attn_scalar" in fields:
        fields.update(query_pre_attn_scalar=16, sliding_window=8)
    if "local_attention" in fields:
        fields.update(local_attention=8)
    return fields


def test_every_family_has_its_expected_swaps_and_a_depth():
    assert set(EXPECTED_SWAPS) == set(presets.FAMILIES) == set(presets.FAMILY_DEPTH)


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("family", sorted(EXPECTED_SWAPS))
def test_every_family_builds_and_gets_the_swaps_the_table_says(family, device, monkeypatch):
    """Each family's config class at a tiny width, built on the meta device (as the ledger builds it) and
    on the CPU with real weights (the recipes' numerical checks run on values), is patched by apply_tempo
    with at least the swaps of the coverage table, per added layer."""
    pytest.importorskip("transformers")
    _skip_if_unavailable(family)
    import transformers

    from tempo.integrations.patch import apply_tempo
    from tempo.memory import tables as table

    label, cls, _fields = presets.FAMILIES[family]
    monkeypatch.setitem(presets.FAMILIES, family, (label, cls, tiny_fields(family)))
    models = {}
    for layers in (1, 2):
        config = presets.family_config(family, layers, vocab=table.SMALL_VOCAB, attention="eager")
        with torch.device(device):
            models[layers] = apply_tempo(transformers.AutoModel.from_config(config))
    swaps = table.swaps_per_added_layer(models[1], models[2])
    for kind, count in EXPECTED_SWAPS[family].items():
        assert swaps.get(kind, 0) >= count, (family, device, swaps)


def test_family_table_shows_what_apply_tempo_saves():
    pytest.importorskip("transformers")  # the hf extra; CI installs it
    from tempo.memory.tables import family_table

    available = _available_families()
    text = family_table(seq_lens=(16,), families=available)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "| 16 |" in line]
    assert [row.split(" | ")[0][2:] for row in rows] == [presets.FAMILIES[f][0] for f in available]  # one per family
    for row in rows:
        before, after = (float(cell.strip().rstrip(" h")) for cell in row.split("|")[3:5])
        assert 0 < after < before, row


def test_a_family_the_installed_transformers_lacks_or_a_too_long_s_is_refused_by_name(monkeypatch):
    from tempo.memory import tables as table

    monkeypatch.setitem(presets.FAMILIES, "future", ("Future-1B (h=64)", "NoSuchFutureConfig",
                                                     dict(hidden_size=64, max_position_embeddings=512)))
    assert "has no NoSuchFutureConfig" in presets.family_unavailable("future")
    with pytest.raises(ValueError, match=r"family 'future' \(Future-1B \(h=64\)\) cannot be built: transformers "
                                         r".* has no NoSuchFutureConfig"):
        table.family_rows(seq_lens=(16,), families=("future",))
    with pytest.raises(ValueError, match="family 'minilm' takes sequences of at most 512 tokens .* got seq_len 513"):
        table.family_rows(seq_lens=(513,), families=("minilm",))
    with pytest.raises(ValueError, match="family 'mpnet-base' takes sequences of at most 512 tokens"):
        table.family_batch_rows(1 << 30, 513, ("mpnet-base",))
    assert presets.longest_seq_len("mpnet-base") == 512  # 514 positions counted from padding_idx + 1


def test_cli_leaves_out_unavailable_families_and_too_long_lengths_in_its_one_line(monkeypatch, capsys):
    pytest.importorskip("transformers")
    FAMILIES, FAMILY_DEPTH = presets.FAMILIES, presets.FAMILY_DEPTH
    monkeypatch.setitem(FAMILIES, "future", ("Future-1B (h=64)", "NoSuchFutureConfig",
                                             dict(hidden_size=64, max_position_embeddings=512)))
    monkeypatch.setitem(FAMILY_DEPTH, "future", (2, 100))
    monkeypatch.setitem(FAMILIES, "minilm", (FAMILIES["minilm"][0], "BertConfig",
                                             dict(tiny_fields("minilm"), max_position_embeddings=16)))
    monkeypatch.setitem(FAMILIES, "nomicbert", (FAMILIES["nomicbert"][0], "NomicBertConfig",
                                                tiny_fields("nomicbert")))
    monkeypatch.setitem(FAMILY_DEPTH, "nomicbert", (2, 100))
    assert main(["--seq-lens", "16", "32", "--no-stack", "--families", "minilm", "nomicbert", "future",
                 "--batch-seq-len", "32"]) == 0
    out = capsys.readouterr().out
    left_out = [line for line in out.splitlines() if line.startswith("Left out:")]
    assert len(left_out) == 1
    for said in ("Future-1B (h=64): transformers ", "has no NoSuchFutureConfig",
                 "s = 32 for minilm (16): longer than their position tables",
                 "the largest-batch table at s = 32 for minilm (16): longer than their position tables"):
        assert said in left_out[0]
    assert "| MiniLM-L6 (BERT, h=384) | 16 |" in out and "| MiniLM-L6 (BERT, h=384) | 32 |" not in out
    assert "| NomicBERT, nomic-embed-text-v1.5 (h=768) | 32 |" in out
    assert "| NomicBERT, nomic-embed-text-v1.5 (h=768) | 2 | 32 |" in out  # the largest-batch table
    assert "Future" not in out.replace(left_out[0], "")


# -- the fake-tensor count (what python -m tempo.memory prints) against the real-tensor ledger ----
def test_fake_tensors_count_storages_like_real_ones():
    from tempo.memory.fake import FakeSession

    session = FakeSession()
    x = session.tensor((8, 16), requires_grad=True)
    with session.ledger() as ledger:
        a = x.sin()  # keeps x
        (a[:, :8] * a[:, 8:]).sum()  # two views of a's storage: counted once, whole storage
    assert ledger.activation_bytes == 2 * 8 * 16 * 4
    model = session.module(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    with session.ledger(model) as ledger:
        model(session.tensor((3, 4))).sum()
    assert ledger.by_module() == {"0": 3 * 4 * 4, "1": 3 * 8 * 4}
    assert ledger.parameter_bytes == 8 * 2 * 4  # the second Linear's (fake) weight is set apart


def _hf_variants(variants):
    try:
        import transformers  # noqa: F401
    except ImportError:
        return tuple(v for v in variants if not v.startswith("hf-"))
    return tuple(variants)


def test_lone_layer_table_fake_count_equals_the_real_ledger():
    # Every column of the lone-layer table, BERT-large, at s = 16 (the bytes per token at batch 2 minus
    # batch 1 are exact at any s: the fake count runs the same code on the same shapes).
    from tempo.memory.tables import LEDGER_VARIANTS

    variants = _hf_variants(LEDGER_VARIANTS + ("hf-eager",))
    fake = ledger_table(seq_lens=(16,), variants=variants, fake=True)
    real = ledger_table(seq_lens=(16,), variants=variants, fake=False)
    assert fake == real


def test_stack_table_fake_count_equals_the_real_ledger():
    # Every column of the per-added-layer table (ours and transformers' BertModel before/after
    # apply_tempo), on the tiny config (same code paths, BERT-large's would only take longer to build).
    from tempo.memory.tables import STACK_VARIANTS, stack_table

    variants = _hf_variants(STACK_VARIANTS)
    fake = stack_table(seq_lens=(16,), variants=variants, config_name="bert_tiny", fake=True)
    real = stack_table(seq_lens=(16,), variants=variants, config_name="bert_tiny", fake=False)
    assert fake == real


@pytest.mark.parametrize("family", sorted(EXPECTED_SWAPS))
def test_family_table_fake_count_equals_the_real_ledger(family, monkeypatch):
    # Each family's row (before and after apply_tempo(model)) at a small width, so that the real
    # models build fast; sliding windows shorter than s, so those layers mask.
    pytest.importorskip("transformers")
    _skip_if_unavailable(family)
    from tempo.memory import tables as table

    label, cls, _fields = presets.FAMILIES[family]
    monkeypatch.setitem(presets.FAMILIES, family, (label, cls, tiny_fields(family)))
    fake = table.family_rows(seq_lens=(16,), families=(family,), fake=True)
    real = table.family_rows(seq_lens=(16,), families=(family,), fake=False)
    assert fake == real
    assert 0 < fake[0]["after"] <= fake[0]["before"]


# -- the command's input checks and what it leaves out --------------------------------------
def test_unknown_family_or_length_is_named_with_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--families", "minilm", "bert-base"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown family 'bert-base'" in err and f"valid: {', '.join(presets.FAMILIES)}" in err
    for bad, said in (("8193", "sequence length 8193 is out of range"), ("0", "sequence length 0 is out of range"),
                      ("long", "'long' is not a sequence length")):
        with pytest.raises(SystemExit) as exc:
            main(["--seq-lens", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert said in err and "valid: an integer from 1 to 8192" in err


def test_without_transformers_the_hf_tables_are_left_out_in_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert main(["--seq-lens", "16"]) == 0
    out = capsys.readouterr().out
    left_out = [line for line in out.splitlines() if line.startswith("Left out:")]
    assert left_out == ['Left out: the HF columns and the transformers families table: transformers is not '
                        'installed (pip install -e ".[hf]").']
    assert "HF eager" not in out and "DeBERTa" not in out
    assert "Tempo (all layers)" in out and "Per added layer" in out


def test_cli_prints_every_table_with_readable_headers(capsys):
    pytest.importorskip("transformers")
    assert main(["--seq-lens", "16", "--families", "minilm"]) == 0
    out = capsys.readouterr().out
    for header in ("| s | original | Tempo (paper's 3 layers) | original + sdpa | Tempo GELU + LayerNorm, sdpa | "
                   "Tempo (all layers) | HF eager | Tempo (all layers) saves |",
                   "| s | original | Tempo (paper's 3 layers) | Tempo (all layers) | HF eager | "
                   "HF + apply_tempo (paper's 3) | HF + apply_tempo (all layers) | Tempo (all layers) saves |",
                   "| model | s | HF eager | HF + apply_tempo(model) | saved | apply_tempo swaps, per added layer |"):
        assert header in out
    # SeededDropout: the attention-probability dropout module, switched, though Tempo's attention takes
    # its rate as an argument and never calls it (the eager attention a call asking for weights runs does).
    assert "| MiniLM-L6 (BERT, h=384) | 16 | 47.0 h | 20.8 h | 56% | 2 FusedResidualOutput, InplaceGelu, " \
           "SeededDropout, attention (config switch) |" in out and "Left out" not in out


def test_largest_batch_table_fake_count_equals_the_real_ledger(monkeypatch, capsys):
    """The whole-encoder rows (per sequence, the largest batch in a budget) are the same counted on
    fake or on real tensors, and the largest batch follows the main job's rule."""
    pytest.importorskip("transformers")
    from tempo.memory import tables as table

    label, cls, fields = presets.FAMILIES["deberta-v3-large"]
    monkeypatch.setitem(presets.FAMILIES, "deberta-v3-large",
                        (label, cls, dict(fields, hidden_size=64, num_attention_heads=1, intermediate_size=128)))
    monkeypatch.setitem(presets.FAMILY_DEPTH, "deberta-v3-large", (3, 500))
    budget = 64 << 20
    fake = table.family_batch_rows(budget, 32, ("deberta-v3-large",), fake=True)
    real = table.family_batch_rows(budget, 32, ("deberta-v3-large",), fake=False)
    assert fake == real
    row = fake[0]
    assert row["after"]["per_sequence"] < row["before"]["per_sequence"]
    assert row["after"]["largest"] > row["before"]["largest"] > 0
    assert "| DeBERTa-v3-large (h=1024) | 3 | 32 |" in table.format_batch_table(fake)
    with pytest.raises(SystemExit) as exc:
        main(["--budget", "lots"])
    assert exc.value.code == 2 and "--budget" in capsys.readouterr().err
