"""SQuAD reading, windows, answer mapping, max-context, cache, and the generated QA set."""

import json
import warnings

import numpy as np
import pytest

from tempo.bert.data.qa_generator import _PRODUCTS, _split_of, generate_split, write_qa_set
from tempo.bert.data.squad import (
    SquadFormatError,
    build_features,
    feature_cache_path,
    load_or_build_features,
    read_squad,
)
from tempo.bert.data.tokenization import SPECIAL_TOKENS, WordPieceTokenizer

WORDS = [f"w{i}" for i in range(40)] + ["where", "is", "what", "q", "a", "the", "##x", "?", "."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t in [*SPECIAL_TOKENS, *WORDS]))
    return WordPieceTokenizer(vocab, lower_case=True)


def _squad(path, paragraphs, version="1.1"):
    path.write_text(json.dumps({"version": version, "data": [{"title": "t", "paragraphs": paragraphs}]}))
    return path


def _context(n):
    return " ".join(f"w{i}" for i in range(n))


def _char_start(context, token_index):
    return context.index(f"w{token_index} ") if token_index < len(context.split()) - 1 else context.rindex(f"w{token_index}")


# -- reading -------------------------------------------------------------------------------------
def test_read_valid_file(tmp_path):
    ctx = _context(5)
    path = _squad(tmp_path / "ok.json", [{"context": ctx, "qas": [
        {"id": "q1", "question": "what", "answers": [{"text": "w2", "answer_start": 6}]}]}])
    data = read_squad(path, for_training=True)
    assert data.has_gold and data.examples[0].answer_start == 6 and data.examples[0].answer_text == "w2"


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    ('{"version": "1.1"}', "missing key 'data'"),
    ('{"data": [{"paragraphs": [{"qas": []}]}]}', "article 0 paragraph 0: missing key 'context'"),
    ('{"data": [{"paragraphs": [{"context": "w1", "qas": [{"id": "qq", "answers": []}]}]}]}',
     "question 'qq': missing key 'question'"),
    ('{"data": [{"paragraphs": [{"context": "  ", "qas": [{"id": "e1", "question": "q"}]}]}]}',
     "question 'e1': its context is empty"),
    ('{"data": [{"paragraphs": [{"context": "w1", "qas": [{"id": "d", "question": "q"}, '
     '{"id": "d", "question": "q"}]}]}]}', "'d' appears twice"),
])
def test_malformed_files_name_file_and_place(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SquadFormatError) as err:
        read_squad(path)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_v2_data_needs_the_flag(tmp_path):
    path = _squad(tmp_path / "v2.json", [{"context": _context(3), "qas": [
        {"id": "has", "question": "q", "answers": [{"text": "w1", "answer_start": 3}]},
        {"id": "none", "question": "q", "answers": [], "is_impossible": True}]}], version="v2.0")
    with pytest.raises(SquadFormatError, match=r"question 'none'.*--version_2_with_negative"):
        read_squad(path)
    data = read_squad(path, version_2_with_negative=True, for_training=True)
    assert [e.is_impossible for e in data.examples] == [False, True]


@pytest.mark.parametrize("qa, needle", [
    ({"id": "s1", "question": "q", "answers": [{"text": "w1", "answer_start": 3}], "is_impossible": "false"},
     "question 's1': 'is_impossible' should be true or false, found 'false'"),
    ({"id": "s2", "question": "q", "answers": [{"text": "w1", "answer_start": 3}], "is_impossible": 0},
     "question 's2': 'is_impossible' should be true or false, found 0"),
    ({"id": "i1", "question": "q", "answers": [{"text": "w1", "answer_start": 3}], "is_impossible": True},
     "question 'i1': is_impossible is true but it has 1 answer(s)"),
    ({"id": "i2", "question": "q", "answers": [], "is_impossible": False},
     "question 'i2': is_impossible is false but its answer list is empty"),
])
def test_is_impossible_must_be_a_boolean_that_agrees_with_the_answers(tmp_path, qa, needle):
    path = _squad(tmp_path / "v2.json", [{"context": _context(3), "qas": [
        {"id": "fine", "question": "q", "answers": [{"text": "w2", "answer_start": 6}], "is_impossible": False},
        qa]}], version="v2.0")
    for training in (True, False):
        with pytest.raises(SquadFormatError) as err:
            read_squad(path, version_2_with_negative=True, for_training=training)
        assert str(path) in str(err.value) and needle in str(err.value)
    if "should be true or false" in needle:
        return  # a malformed value is never skipped
    with pytest.warns(UserWarning, match=rf"skipped 1 question.*'{qa['id']}'"):
        data = read_squad(path, version_2_with_negative=True, for_training=True, skip_inconsistent=True)
    assert [e.qas_id for e in data.examples] == ["fine"] and data.skipped == [qa["id"]]
    assert [q["id"] for q in data.dataset[0]["paragraphs"][0]["qas"]] == ["fine"]  # not scored either


@pytest.mark.parametrize("where", ["context", "question", "answer text", "id"])
def test_text_the_tokenizer_cannot_encode_names_the_question(tmp_path, tokenizer, where):
    lone = "\\ud800"  # a JSON escape that decodes to a lone surrogate
    qa = {"id": "u7", "question": "where", "answers": [{"text": "w1", "answer_start": 3}]}
    context = "w0 w1 w2"
    if where == "context":
        context = "w0 w1 w2 " + lone
    elif where == "question":
        qa["question"] = "where " + lone
    elif where == "answer text":
        qa["answers"][0]["text"] = "w1" + lone
    else:
        qa["id"] = "u" + lone
    path = tmp_path / "surrogate.json"
    text = json.dumps({"data": [{"paragraphs": [{"context": context, "qas": [qa]}]}]}).replace("\\\\ud800", "\\ud800")
    path.write_text(text)
    assert "\\ud800" in path.read_text()
    with pytest.raises(SquadFormatError) as err:
        read_squad(path, for_training=True)
    message = str(err.value)
    assert str(path) in message and f"the {where} holds '\\ud800'" in message and "lone surrogate" in message
    if where != "id":
        assert "'u7'" in message


def test_examples_built_in_code_with_bad_text_are_named(tokenizer):
    from tempo.bert.data.squad import SquadExample

    bad = SquadExample("code-1", "where", "w0 \ud800 w1")
    with pytest.raises(SquadFormatError, match="question 'code-1': context"):
        build_features([bad], tokenizer, max_seq_length=16, doc_stride=4, max_query_length=4, progress=False)


def test_answer_start_mismatch_is_moved_with_a_warning(tmp_path):
    ctx = "w1 w2 w3 w2"
    path = _squad(tmp_path / "shift.json", [{"context": ctx, "qas": [
        {"id": "m", "question": "q", "answers": [{"text": "w2", "answer_start": 8}]}]}])
    with pytest.warns(UserWarning, match=r"'m' \(8 -> 9\)"):
        data = read_squad(path, for_training=True)
    assert data.examples[0].answer_start == 9  # nearest occurrence, not the first
    # Prediction files are not checked: only the answer texts are scored.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_squad(path)
    path = _squad(tmp_path / "absent.json", [{"context": ctx, "qas": [
        {"id": "gone", "question": "q", "answers": [{"text": "w9", "answer_start": 0}]}]}])
    with pytest.raises(SquadFormatError, match="'gone': answer 'w9' does not occur"):
        read_squad(path, for_training=True)


def test_predict_file_without_answers(tmp_path):
    path = _squad(tmp_path / "test.json", [{"context": _context(3), "qas": [{"id": "x", "question": "q"}]}])
    data = read_squad(path)
    assert not data.has_gold and len(data.examples) == 1
    with pytest.raises(SquadFormatError, match="a training file needs them"):
        read_squad(path, for_training=True)


# -- features ------------------------------------------------------------------------------------
def test_windows_answer_mapping_and_max_context(tmp_path, tokenizer):
    ctx = _context(20)
    path = _squad(tmp_path / "win.json", [{"context": ctx, "qas": [
        {"id": "a", "question": "q", "answers": [{"text": "w7 w8", "answer_start": ctx.index("w7 ")}]}]}])
    settings = dict(max_seq_length=10, doc_stride=3, max_query_length=4, progress=False)
    # [CLS] q [SEP] <6 context tokens> [SEP]: windows start at tokens 0, 3, 6, 9, 12, 15
    train = build_features(read_squad(path, for_training=True).examples, tokenizer, for_training=True, **settings)
    assert len(train) == 6
    # Only the windows starting at 3 and 6 hold all of w7..w8; the others point at [CLS].
    assert train.start_positions.tolist() == [0, 7, 4, 0, 0, 0]
    assert train.end_positions.tolist() == [0, 8, 5, 0, 0, 0]
    ids = tokenizer.convert_ids_to_tokens(train.input_ids[1].tolist())
    assert ids == ["[CLS]", "q", "[SEP]", "w3", "w4", "w5", "w6", "w7", "w8", "[SEP]"]
    assert train.segment_ids[1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    last = tokenizer.convert_ids_to_tokens(train.input_ids[5].tolist())
    assert last[:8] == ["[CLS]", "q", "[SEP]", "w15", "w16", "w17", "w18", "w19"] and last[8] == "[SEP]"
    assert train.input_mask[5].tolist() == [1] * 9 + [0] and train.input_ids[5, 9] == tokenizer.pad_id

    pred = build_features(read_squad(path).examples, tokenizer, for_training=False, **settings)
    assert pred.start_positions is None and pred.offsets.shape == (6, 10, 2)
    assert (pred.offsets[:, :3] == -1).all()  # [CLS] question [SEP] map to no context
    assert ctx[slice(*pred.offsets[1, 7])] == "w7"
    # w7 has equal context (1 token) in windows 3 and 6: the first keeps it; w8 belongs to window 6.
    assert pred.max_context[1, 7] and not pred.max_context[2, 4]
    assert not pred.max_context[1, 8] and pred.max_context[2, 5]
    # Every context token is max-context in exactly one window.
    counts = np.zeros(20, int)
    for row in range(len(pred)):
        for pos in np.flatnonzero(pred.max_context[row]):
            counts[ctx[:pred.offsets[row, pos, 0]].count(" ")] += 1
    assert counts.tolist() == [1] * 20


def test_answer_inside_words_snaps_to_tokens_and_query_is_truncated(tmp_path, tokenizer):
    ctx = _context(20)
    start = ctx.index("w10 w11") + 2  # "0 w1": starts inside w10, ends inside w11
    path = _squad(tmp_path / "snap.json", [{"context": ctx, "qas": [
        {"id": "s", "question": "w30 w31 w32 w33 w34 w35", "answers": [{"text": "0 w1", "answer_start": start}]}]}])
    f = build_features(read_squad(path, for_training=True).examples, tokenizer, max_seq_length=32,
                       doc_stride=8, max_query_length=4, for_training=True, progress=False)
    tokens = tokenizer.convert_ids_to_tokens(f.input_ids[0].tolist())
    assert tokens[:6] == ["[CLS]", "w30", "w31", "w32", "w33", "[SEP]"]
    assert tokens[f.start_positions[0]:f.end_positions[0] + 1] == ["w10", "w11"]


def test_unanswerable_training_question_points_at_cls(tmp_path, tokenizer):
    path = _squad(tmp_path / "v2.json", [{"context": _context(4), "qas": [
        {"id": "n", "question": "q", "answers": [], "is_impossible": True}]}])
    f = build_features(read_squad(path, True, for_training=True).examples, tokenizer, max_seq_length=16,
                       doc_stride=4, max_query_length=4, for_training=True, progress=False)
    assert f.start_positions.tolist() == [0] and f.end_positions.tolist() == [0]


# -- cache ---------------------------------------------------------------------------------------
def test_cache_round_trip_and_invalidation(tmp_path, tokenizer):
    ctx = _context(12)
    path = _squad(tmp_path / "c.json", [{"context": ctx, "qas": [
        {"id": "c", "question": "q", "answers": [{"text": "w3", "answer_start": ctx.index("w3")}]}]}])
    cache_dir = tmp_path / "cache"
    kw = dict(max_seq_length=12, doc_stride=4, max_query_length=4, for_training=False, cache_dir=str(cache_dir),
              progress=False)
    data = read_squad(path)
    built, cache = load_or_build_features(data, tokenizer, **kw)
    assert cache is not None and cache.is_file() and cache.suffix == ".npz"
    loaded, cache2 = load_or_build_features(data, tokenizer, **kw)
    assert cache2 == cache
    for name, array in built.arrays().items():
        np.testing.assert_array_equal(getattr(loaded, name), array)
    # Any setting, the vocabulary or the file's bytes change the key.
    assert feature_cache_path(path, tokenizer.vocab_file, cache_dir, **{**_settings(kw), "doc_stride": 5}) != cache
    assert feature_cache_path(path, tokenizer.vocab_file, cache_dir, **_settings(kw)) == cache
    path.write_text(path.read_text().replace("w3\"", "w4\"").replace('"question": "q"', '"question": "w1"'))
    _, cache3 = load_or_build_features(read_squad(path), tokenizer, **kw)
    assert cache3 != cache
    # A corrupt entry is rebuilt with a warning; --skip_cache writes nothing.
    cache3.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="unreadable"):
        load_or_build_features(read_squad(path), tokenizer, **kw)
    good = cache3.read_bytes()
    for damage, error in ((good[: len(good) // 2], "BadZipFile"),  # truncated: np.load's zipfile raises it
                          (good[:60] + bytes(b ^ 0xFF for b in good[60:200]) + good[200:], "")):
        cache3.write_bytes(damage)
        with pytest.warns(UserWarning, match=f"unreadable.*{error}"):
            rebuilt, _ = load_or_build_features(read_squad(path), tokenizer, **kw)
        assert len(rebuilt) == len(built)
    np.savez(cache3, input_ids=np.zeros((1, 3), np.int32))  # readable, but not features of this file
    with pytest.warns(UserWarning, match="unreadable"):
        load_or_build_features(read_squad(path), tokenizer, **kw)
    before = sorted(p.name for p in cache_dir.iterdir())
    load_or_build_features(read_squad(path), tokenizer, **{**kw, "doc_stride": 3}, use_cache=False)
    assert sorted(p.name for p in cache_dir.iterdir()) == before


def _settings(kw):
    return dict(max_seq_length=kw["max_seq_length"], doc_stride=kw["doc_stride"],
                max_query_length=kw["max_query_length"], for_training=kw["for_training"], lower_case=True)


# -- generated QA set ----------------------------------------------------------------------------
def test_generated_set_is_valid_and_dev_entities_are_held_out(tmp_path):
    train_path, dev_path = write_qa_set(tmp_path, num_train=120, num_dev=40, seed=5)
    train = read_squad(train_path, for_training=True)
    dev = read_squad(dev_path)
    assert len(train.examples) == 120 and len(dev.examples) == 40 and dev.has_gold

    def answers(path):  # the entities asked about: people, cities, rivers, companies, inventions
        return {qa["answers"][0]["text"] for a in json.loads(path.read_text())["data"]
                for p in a["paragraphs"] for qa in p["qas"] if not any(c.isdigit() for c in qa["answers"][0]["text"])}

    assert answers(train_path) & answers(dev_path) <= set(_PRODUCTS)  # "ropes", "radios": generic goods
    assert all(_split_of(name.removesuffix(" River")) == "dev" for name in answers(dev_path) - set(_PRODUCTS))
    # Deterministic for a seed, different across seeds.
    assert generate_split("dev", 10, seed=5) == generate_split("dev", 10, seed=5)
    assert generate_split("dev", 10, seed=5) != generate_split("dev", 10, seed=6)
