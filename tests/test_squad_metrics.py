"""SQuAD scoring against hand-computed cases, and answer extraction from window logits."""

import math

import numpy as np
import pytest

from tempo.tasks.squad_metrics import (
    WindowLogits,
    evaluate_v1,
    evaluate_v2,
    exact_match_score,
    extract_answers,
    f1_score_v1,
    f1_score_v2,
    normalize_answer,
)


def _dataset(questions):
    """[(id, [gold texts])] -> the official JSON's "data" list."""
    qas = [{"id": qid, "question": "?", "answers": [{"text": t, "answer_start": 0} for t in golds]}
           for qid, golds in questions]
    return [{"title": "t", "paragraphs": [{"context": "c", "qas": qas}]}]


@pytest.mark.parametrize("text, expected", [
    ("The  Quick, brown fox!", "quick brown fox"),
    ("an apple a day", "apple day"),
    ("Theatre of the Absurd", "theatre of absurd"),  # "the" only as a whole word
    ("A.D. 1066", "ad 1066"),
    ("  \t", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_and_f1_by_hand():
    assert exact_match_score("the Denver Broncos.", "Denver Broncos") == 1.0
    # pred tokens [cat, sat, on, mat], gold [cat, on, mat]: P = 3/4, R = 1, F1 = 6/7
    assert f1_score_v1("the cat sat on the mat", "cat on mat") == pytest.approx(6 / 7)
    # repeated tokens count with multiplicity: pred [a1, a1], gold [a1]: common 1, P=1/2, R=1
    assert f1_score_v1("x x", "x") == pytest.approx(2 / 3)
    assert f1_score_v1("dog", "cat") == 0.0


def test_empty_answers_differ_between_v1_and_v2():
    assert f1_score_v1("", "") == 0.0
    assert f1_score_v2("", "") == 1.0
    assert f1_score_v2("the", "") == 1.0  # normalises to empty
    assert f1_score_v2("Paris", "") == 0.0


def test_evaluate_v1_takes_best_gold_and_counts_missing_as_zero():
    data = _dataset([("q1", ["Broncos", "Denver Broncos"]), ("q2", ["1999"]), ("q3", ["red"])])
    preds = {"q1": "Denver Broncos", "q2": "in 1999"}  # q3 missing
    result = evaluate_v1(data, preds)
    assert result["exact_match"] == pytest.approx(100 * 1 / 3)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3 + 0) / 3)


def test_evaluate_v2_scores_and_threshold_search():
    data = _dataset([("q1", ["Paris"]), ("q2", ["1999"]), ("q3", []), ("q4", [])])
    preds = {"q1": "Paris", "q2": "in 1999", "q3": "", "q4": "London"}
    na = {"q1": 0.1, "q2": 0.3, "q3": 0.9, "q4": 0.6}
    r = evaluate_v2(data, preds, na)
    assert r["total"] == 4 and r["HasAns_total"] == 2 and r["NoAns_total"] == 2
    assert r["exact"] == pytest.approx(50.0)
    assert r["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 + 0) / 4)
    assert r["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert r["NoAns_exact"] == pytest.approx(50.0)
    # Threshold sweep from "abstain everywhere" (2 points): q1 +1 -> 3 @0.1, q2 +0 (exact) or
    # +2/3 (f1) @0.3, q4 answered wrongly -1, q3 predicted empty 0.
    assert r["best_exact"] == pytest.approx(75.0) and r["best_exact_thresh"] == pytest.approx(0.1)
    assert r["best_f1"] == pytest.approx(100 * (3 + 2 / 3) / 4) and r["best_f1_thresh"] == pytest.approx(0.3)
    # Abstaining above 0.5 makes q4 right.
    assert evaluate_v2(data, preds, na, na_prob_thresh=0.5)["exact"] == pytest.approx(75.0)


def test_evaluate_v2_leaves_missing_predictions_out():
    data = _dataset([("q1", ["Paris"]), ("q2", [])])
    r = evaluate_v2(data, {"q1": "Paris"})
    assert r["total"] == 1 and r["exact"] == 100.0 and "NoAns_total" not in r


def _window(context_tokens, start, end, max_context=None):
    """Window over whitespace tokens of a context, laid out as [CLS] q [SEP] tokens... [SEP]."""
    offsets, pos = [[-1, -1]] * 3, 0
    context = " ".join(context_tokens)
    for tok in context_tokens:
        offsets.append([pos, pos + len(tok)])
        pos += len(tok) + 1
    offsets.append([-1, -1])
    n = len(offsets)
    s, e = np.full(n, -5.0), np.full(n, -5.0)
    for i, v in start.items():
        s[i] = v
    for i, v in end.items():
        e[i] = v
    mc = np.ones(n, bool) if max_context is None else np.asarray(max_context)
    return context, WindowLogits(s, e, np.asarray(offsets), mc)


def test_extract_best_span_and_nbest():
    context, win = _window(["Paris", "is", "the", "capital", "of", "France"],
                           start={3: 4.0, 8: 2.0}, end={3: 3.0, 8: 2.5})
    text, nbest, diff = extract_answers(context, [win], n_best_size=3)
    assert text == "Paris" and diff is None
    assert [c["text"] for c in nbest] == ["Paris", "Paris is the capital of France", "France"]
    assert sum(c["probability"] for c in nbest) == pytest.approx(1.0)
    assert nbest[0]["start_logit"] == 4.0 and nbest[0]["end_logit"] == 3.0


def test_extract_respects_length_order_and_max_context():
    tokens = ["a1", "b2", "c3", "d4"]  # positions 3..6 after [CLS] q [SEP]
    # end before start is never valid: the best pair (5, 4) loses to (5, 6)
    context, win = _window(tokens, start={5: 9.0}, end={4: 9.0, 6: 0.5})
    assert extract_answers(context, [win])[0] == "c3 d4"
    # a span longer than max_answer_length is dropped
    context, win = _window(tokens, start={3: 5.0}, end={6: 5.0, 3: 0.0})
    assert extract_answers(context, [win], max_answer_length=4)[0] == "a1 b2 c3 d4"
    assert extract_answers(context, [win], max_answer_length=3)[0] == "a1"
    # start token without max context in this window: not a candidate
    context, win = _window(tokens, start={3: 9.0, 4: 1.0}, end={4: 1.0}, max_context=[1, 1, 1, 0, 1, 1, 1, 1])
    assert extract_answers(context, [win])[0] == "b2"


def test_extract_dedupes_text_across_windows():
    context, w1 = _window(["x", "y"], start={3: 2.0}, end={3: 2.0})
    _, w2 = _window(["x", "y"], start={3: 1.0}, end={3: 1.0})
    _, nbest, _ = extract_answers(context, [w1, w2], n_best_size=5)
    assert [c["text"] for c in nbest].count("x") == 1 and nbest[0]["start_logit"] == 2.0


def test_extract_v2_null_threshold():
    context, win = _window(["Paris", "is"], start={0: 3.0, 3: 1.0}, end={0: 3.0, 3: 1.0})
    text, nbest, diff = extract_answers(context, [win], version_2_with_negative=True)
    assert diff == pytest.approx(6.0 - 2.0) and text == ""
    assert "" in [c["text"] for c in nbest]
    text, _, _ = extract_answers(context, [win], version_2_with_negative=True, null_score_diff_threshold=5.0)
    assert text == "Paris"


def test_extract_without_candidates():
    context, win = _window(["a"], start={}, end={}, max_context=[1, 1, 1, 0, 1])
    text, nbest, diff = extract_answers(context, [win])
    assert text == "" and len(nbest) == 1 and diff is None
    _, _, diff = extract_answers(context, [win], version_2_with_negative=True)
    assert math.isfinite(diff) and diff > 0
