"""The activation ledger: storage deduplication, parameters set apart, attribution, the table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tempo.bench.ledger_table import format_table, ledger_table, main
from tempo.memory import ActivationLedger, marginal_bytes_per_token, saved_bytes


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


def test_ledger_table_for_a_small_config_and_cli(capsys, monkeypatch):
    # The BERT-large table is the CLI's job; a two-row table at s=16 checks the plumbing fast.
    rows = ledger_table(seq_lens=(16,), variants=("original", "tempo"), dtype=torch.bfloat16)
    assert rows[0]["seq_len"] == 16 and rows[0]["tempo"] < rows[0]["original"]
    text = format_table(rows)
    assert "| 16 |" in text and "%" in text
    assert main(["--seq-lens", "16", "--no-hf"]) == 0
    out = capsys.readouterr().out
    assert "Tempo saves" in out and "| 16 |" in out


def test_family_table_shows_what_apply_tempo_saves():
    pytest.importorskip("transformers")  # the hf extra; CI installs it
    from tempo.bench.ledger_table import family_table

    text = family_table(seq_lens=(16,))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "| 16 |" in line]
    assert len(rows) == 3  # MiniLM, DeBERTa-v3-large, ModernBERT-large
    for row in rows:
        before, after = (float(cell.strip().rstrip(" h")) for cell in row.split("|")[3:5])
        assert 0 < after < before, row
