"""SQuAD scoring and answer extraction.

Scoring follows the official evaluation scripts exactly (semantics recalled, code our own):

* v1.1 (``evaluate_v1``): a prediction is compared with every gold answer and the best score
  counts; a question without a prediction scores 0 and stays in the total. Keys: exact_match, f1.
* v2.0 (``evaluate_v2``): unanswerable questions have the gold answer "" and only an empty
  prediction is right; a question without a prediction is left out of the total (as the official
  script, which prints "Missing prediction"). With no-answer probabilities (``null_odds.json``),
  the best threshold for abstaining is searched and reported as best_exact/best_f1 and their
  thresholds. Keys: exact, f1, total, HasAns_*, NoAns_*, best_exact, best_exact_thresh, best_f1,
  best_f1_thresh.

Both share the normalisation: lower-case, drop punctuation, drop the articles a/an/the, collapse
whitespace. Their F1 differs in one corner: v2 scores an empty-vs-empty comparison as 1 (v1.1: 0).

``extract_answers`` turns per-window start/end logits into predictions, n-best lists and (v2)
null-score differences, as DLE's/Google's run_squad post-processing does, but maps tokens back to
the original context through character offsets instead of re-aligning whitespace tokens.
"""

from __future__ import annotations

import collections
import math
import re
import string
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


# ---------------------------------------------------------------------------------------------
# Normalisation and per-answer scores
# ---------------------------------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """Lower-case, remove punctuation, remove articles, collapse whitespace (official order)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def _token_overlap_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score_v1(prediction: str, gold: str) -> float:
    """v1.1 F1: bag-of-tokens overlap; 0 whenever nothing overlaps (empty strings included)."""
    return _token_overlap_f1(normalize_answer(prediction).split(), normalize_answer(gold).split())


def f1_score_v2(prediction: str, gold: str) -> float:
    """v2.0 F1: as v1.1, except that if either side is empty the score is 1 iff both are."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    return _token_overlap_f1(pred_tokens, gold_tokens)


# ---------------------------------------------------------------------------------------------
# Whole-dataset evaluation
# ---------------------------------------------------------------------------------------------
def _questions(dataset: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    """The questions of the official JSON's "data" list (articles -> paragraphs -> qas)."""
    for article in dataset:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


def evaluate_v1(dataset: Iterable[Mapping[str, Any]], predictions: Mapping[str, str]) -> dict[str, float]:
    """Official v1.1 metrics, in percent: {"exact_match", "f1"}; unanswered questions score 0."""
    exact = f1 = 0.0
    total = 0
    for qa in _questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            continue
        golds = [a["text"] for a in qa["answers"]]
        prediction = predictions[qa["id"]]
        exact += max(exact_match_score(prediction, g) for g in golds)
        f1 += max(f1_score_v1(prediction, g) for g in golds)
    if total == 0:
        return {"exact_match": 0.0, "f1": 0.0}
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


def _best_threshold(predictions: Mapping[str, str], raw_scores: Mapping[str, float],
                    na_probs: Mapping[str, float], has_answer: Mapping[str, bool]) -> tuple[float, float]:
    """Sweep the abstain threshold over the observed no-answer probabilities (official v2).

    Start by abstaining everywhere (score = number of unanswerable questions), then un-abstain
    questions in increasing order of no-answer probability, keeping the best running score.
    Ties are visited in ``na_probs`` order and the start counts every unanswerable question of
    the dataset, answered or not, both as the official script does.
    """
    score = best = float(sum(1 for has in has_answer.values() if not has))
    best_threshold = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in raw_scores:
            continue
        if has_answer[qid]:
            score += raw_scores[qid]
        elif predictions[qid]:
            score -= 1  # answering an unanswerable question loses its point
        if score > best:
            best = score
            best_threshold = na_probs[qid]
    return 100.0 * best / len(raw_scores), best_threshold


def evaluate_v2(dataset: Iterable[Mapping[str, Any]], predictions: Mapping[str, str],
                na_probs: Mapping[str, float] | None = None, na_prob_thresh: float = 1.0) -> dict[str, float]:
    """Official v2.0 metrics, in percent. ``na_probs``: question id -> no-answer score
    (``null_odds.json``); without it every question gets 0 and the best threshold is 0."""
    has_answer: dict[str, bool] = {}
    exact_raw: dict[str, float] = {}
    f1_raw: dict[str, float] = {}
    for qa in _questions(dataset):
        qid = qa["id"]
        has_answer[qid] = bool(qa["answers"])  # official: the raw list, before normalising
        golds = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])]
        if qid not in predictions:
            continue  # official v2: reported as missing and left out of every total
        golds = golds or [""]
        prediction = predictions[qid]
        exact_raw[qid] = max(exact_match_score(prediction, g) for g in golds)
        f1_raw[qid] = max(f1_score_v2(prediction, g) for g in golds)
    if not exact_raw:
        return {"exact": 0.0, "f1": 0.0, "total": 0}
    na_probs = {qid: 0.0 for qid in has_answer} if na_probs is None else na_probs

    def thresholded(raw: Mapping[str, float]) -> dict[str, float]:
        # Above the threshold the system abstains: right exactly when there is no answer.
        return {qid: (float(not has_answer[qid]) if na_probs[qid] > na_prob_thresh else s)
                for qid, s in raw.items()}

    exact, f1 = thresholded(exact_raw), thresholded(f1_raw)

    def block(qids: Sequence[str], prefix: str = "") -> dict[str, float]:
        if not qids:
            return {}
        return {f"{prefix}exact": 100.0 * sum(exact[q] for q in qids) / len(qids),
                f"{prefix}f1": 100.0 * sum(f1[q] for q in qids) / len(qids),
                f"{prefix}total": len(qids)}

    scored = list(exact)
    result = block(scored)
    result.update(block([q for q in scored if has_answer[q]], "HasAns_"))
    result.update(block([q for q in scored if not has_answer[q]], "NoAns_"))
    result["best_exact"], result["best_exact_thresh"] = _best_threshold(predictions, exact_raw, na_probs, has_answer)
    result["best_f1"], result["best_f1_thresh"] = _best_threshold(predictions, f1_raw, na_probs, has_answer)
    return result


# ---------------------------------------------------------------------------------------------
# From logits to answers
# ---------------------------------------------------------------------------------------------
@dataclass
class WindowLogits:
    """One window's model output plus what is needed to map tokens back to the context."""

    start_logits: np.ndarray  # [L] float
    end_logits: np.ndarray    # [L] float
    offsets: np.ndarray       # [L, 2] int: character span in the context; -1 outside the context
    max_context: np.ndarray   # [L] bool: this window is the one with most context for the token


def _softmax(scores: Sequence[float]) -> list[float]:
    if not scores:
        return []
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def extract_answers(context: str, windows: Sequence[WindowLogits], n_best_size: int = 20,
                    max_answer_length: int = 30, version_2_with_negative: bool = False,
                    null_score_diff_threshold: float = 0.0) -> tuple[str, list[dict[str, Any]], float | None]:
    """Best answer text, its n-best list, and (v2) the null-score difference for one question.

    A span is a candidate when both ends lie in the context, its start token has its maximum
    context in this window, end >= start and it spans at most ``max_answer_length`` tokens; its
    score is start_logit + end_logit. v2 compares the best span with the smallest [CLS] score of
    any window: ``score_null - best_span_score > threshold`` means "no answer" (""). v1 returns ""
    when no span is valid (DLE writes the text "empty"; "" is scored the same and reads better).
    """
    candidates: list[tuple[float, int, int, int]] = []  # (score, window, start, end)
    null_score = math.inf
    null_logits = (0.0, 0.0)
    for w, win in enumerate(windows):
        if version_2_with_negative:
            score = float(win.start_logits[0] + win.end_logits[0])
            if score < null_score:
                null_score, null_logits = score, (float(win.start_logits[0]), float(win.end_logits[0]))
        starts = np.argsort(win.start_logits)[::-1][:n_best_size]
        ends = np.argsort(win.end_logits)[::-1][:n_best_size]
        for s in starts:
            if win.offsets[s, 0] < 0 or not win.max_context[s]:
                continue
            for e in ends:
                if win.offsets[e, 0] < 0 or e < s or e - s + 1 > max_answer_length:
                    continue
                candidates.append((float(win.start_logits[s] + win.end_logits[e]), w, int(s), int(e)))
    candidates.sort(key=lambda c: c[0], reverse=True)

    nbest: list[dict[str, Any]] = []
    seen: set[str] = set()
    for score, w, s, e in candidates:
        win = windows[w]
        text = context[int(win.offsets[s, 0]):int(win.offsets[e, 1])]
        if text in seen:  # the same text from another window or span: keep the best-scoring one
            continue
        seen.add(text)
        nbest.append({"text": text, "start_logit": float(win.start_logits[s]),
                      "end_logit": float(win.end_logits[e]), "score": score})
        if len(nbest) >= n_best_size:
            break

    score_diff = None
    best_text = nbest[0]["text"] if nbest else ""
    if version_2_with_negative:
        best_span_score = nbest[0]["score"] if nbest else -math.inf
        score_diff = null_score - best_span_score
        if "" not in seen:
            nbest.append({"text": "", "start_logit": null_logits[0], "end_logit": null_logits[1],
                          "score": null_score})
            nbest.sort(key=lambda c: c["score"], reverse=True)
        if score_diff > null_score_diff_threshold:
            best_text = ""
        if not math.isfinite(score_diff):
            score_diff = float(np.sign(score_diff)) * 1e9  # JSON-safe "certainly no answer"
    if not nbest:
        nbest.append({"text": "", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})
    for entry, p in zip(nbest, _softmax([c["score"] for c in nbest])):
        entry["probability"] = p
        del entry["score"]
    return best_text, nbest, score_diff
