"""revert_tempo undoes a recompute plan, set_recompute(block, "none") round-trips to the stock block,
and a block under "full" recompute runs without a KV cache (tempo.integrations.recompute)."""

import copy
import functools
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tempo.integrations.patch import apply_tempo, revert_tempo  # noqa: E402
from tempo.integrations.recompute import (MODES, RecomputedBlock, apply_recompute, recompute_of, remove_recompute,  # noqa: E402
                                  set_recompute, transformer_blocks)

HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


def bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def llama(**o):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0), **o}))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=2))


FAMILIES = {"bert": bert, "llama": llama}
from test_plan_recompute import batch  # noqa: E402  (two rows, one padded: the recompute tests' batch)

BLOCK = {"bert": transformers.models.bert.modeling_bert.BertLayer,
         "llama": transformers.models.llama.modeling_llama.LlamaDecoderLayer,
         "gpt2": transformers.models.gpt2.modeling_gpt2.GPT2Block}


def cache_argument(model):
    """What the model's forward calls its cache: ``cache`` from transformers 5.25,
    ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def cache_seen(arguments):
    """The cache a block's forward got, under whichever name its version gives it."""
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if name in arguments:
            return arguments[name]
    return None


def step(model, **extra):
    """One training forward+backward: (loss, {name: grad})."""
    model.train().zero_grad(set_to_none=True)
    loss = model(**batch(), **extra).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def calls(monkeypatch):
    """Counts every run of a block class's own forward (the recomputation inside backward too, which
    a hook on the block would not see); each entry: the arguments it got, by parameter name."""
    seen = []

    def count(cls):
        original = cls.forward
        signature = inspect.signature(original)

        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            seen.append(signature.bind(self, *args, **kwargs).arguments)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", forward)
        return seen
    return count


def hook_counts(model):
    return [(name, [len(m.__dict__[d]) for d in HOOK_DICTS]) for name, m in model.named_modules()]


def assert_stock(model, twin):
    """``model`` is the never-patched ``twin`` again: classes, instance attributes, hooks."""
    pairs = list(zip(model.named_modules(), twin.named_modules(), strict=True))
    for (name, m), (twin_name, t) in pairs:
        assert name == twin_name
        assert type(m) is type(t), name
        assert not isinstance(m, RecomputedBlock), name
        assert recompute_of(m) == "none", name
        assert set(m.__dict__) == set(t.__dict__), name  # no mark left (the mode lives in __dict__)
    assert hook_counts(model) == hook_counts(twin)


def assert_same_step(model, twin):
    want_loss, want = step(twin)
    got_loss, got = step(model)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


# -- 1. revert_tempo takes the plan off ------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_revert_after_apply_tempo_and_recompute_gives_the_stock_model(family, mode, calls):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    twin = copy.deepcopy(model)
    seen = calls(BLOCK[family])
    apply_tempo(model)
    apply_recompute(model, [mode] * 2)
    step(model)
    assert len(seen) == (4 if mode == "full" else 2)  # the counter sees the recomputation (the witness)
    revert_tempo(model)
    assert [type(b) for b in transformer_blocks(model)] == [BLOCK[family]] * 2
    assert_stock(model, twin)
    seen.clear()
    step(model)
    assert len(seen) == 2  # each block's forward once
    assert_same_step(model, twin)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_revert_takes_off_a_recompute_set_without_apply_tempo(family, mode, calls):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    twin = copy.deepcopy(model)
    for block in transformer_blocks(model):
        set_recompute(block, mode)
    revert_tempo(model)
    assert_stock(model, twin)
    seen = calls(BLOCK[family])
    step(model)
    assert len(seen) == 2
    assert_same_step(model, twin)


def test_revert_takes_off_selective_set_before_apply_tempo():
    """The GELU's hooks stay on the stock GELU apply_tempo replaces; revert puts that module back,
    and its hooks must go too."""
    torch.manual_seed(0)
    model = bert()
    twin = copy.deepcopy(model)
    apply_recompute(model, ["selective"] * 2)
    act = transformer_blocks(model)[0].intermediate.intermediate_act_fn
    assert act._forward_hooks and act._forward_pre_hooks
    apply_tempo(model)
    assert transformer_blocks(model)[0].intermediate.intermediate_act_fn is not act
    revert_tempo(model)
    assert transformer_blocks(model)[0].intermediate.intermediate_act_fn is act
    assert_stock(model, twin)
    assert_same_step(model, twin)


def test_a_deep_copy_reverts_alone():
    model = apply_recompute(apply_tempo(bert()), ["full", "selective"])
    copied = revert_tempo(copy.deepcopy(model))
    assert [recompute_of(b) for b in transformer_blocks(copied)] == ["none", "none"]
    assert [recompute_of(b) for b in transformer_blocks(model)] == ["full", "selective"]
    assert all(isinstance(b, RecomputedBlock) for b in transformer_blocks(model))


def test_remove_recompute_counts_the_blocks_it_set_back():
    model = apply_recompute(bert(), ["full", "none"])
    assert remove_recompute(model) == 1
    assert remove_recompute(model) == 0


# -- 2. set_recompute(block, "none") round-trips ---------------------------------------------
def test_full_then_none_leaves_no_mode_and_the_stock_class():
    block = transformer_blocks(bert())[0]
    attributes = set(block.__dict__)
    set_recompute(block, "full")
    assert recompute_of(block) == "full" and type(block) is not BLOCK["bert"]
    set_recompute(block, "none")
    assert recompute_of(block) == "none"
    assert type(block) is BLOCK["bert"]
    assert set(block.__dict__) == attributes


def test_none_on_a_fresh_block_records_nothing():
    block = transformer_blocks(bert())[0]
    attributes = set(block.__dict__)
    assert set_recompute(block, "none") is block
    assert type(block) is BLOCK["bert"] and set(block.__dict__) == attributes


def test_selective_then_none_removes_its_hooks_and_keeps_a_users():
    block = transformer_blocks(bert())[0]
    block.intermediate.dense.register_forward_hook(lambda *a: None)  # a user's: stays
    before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in block.modules()]
    set_recompute(block, "selective")
    during = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in block.modules()]
    assert sum(h + p for h, p in during) == sum(h + p for h, p in before) + 3  # Linear: 1, activation: 2
    set_recompute(block, "none")
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in block.modules()] == before
    assert recompute_of(block) == "none" and type(block) is BLOCK["bert"]


# -- 3. "full" runs without a KV cache -------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_full_recompute_runs_the_block_without_the_callers_cache(family, calls):
    """Llama's model passes the cache to its blocks by keyword, GPT-2's by position (second): either
    way neither the forward nor the recomputation gets it, and the caller's cache stays empty."""
    torch.manual_seed(0)
    model = llama() if family == "llama" else gpt2()
    want_loss, want = step(copy.deepcopy(model), use_cache=False)
    apply_recompute(model, ["full"] * 2)
    seen = calls(BLOCK[family])
    cache = transformers.DynamicCache(config=model.config)
    got_loss, got = step(model, use_cache=True, **{cache_argument(model): cache})
    assert len(seen) == 4  # forward and recomputation of both blocks
    assert [(cache_seen(a), a.get("use_cache")) for a in seen] == [(None, False)] * 4
    assert cache.get_seq_length() == 0  # passed through, it would hold 12 positions (24 after backward)
    assert torch.equal(got_loss, want_loss)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_without_full_recompute_the_block_gets_the_cache(family, calls):
    """The witness for the test above: the same call without recompute passes the cache and fills it."""
    model = llama() if family == "llama" else gpt2()
    seen = calls(BLOCK[family])
    cache = transformers.DynamicCache(config=model.config)
    step(model, use_cache=True, **{cache_argument(model): cache})
    assert [(cache_seen(a), a.get("use_cache")) for a in seen] == [(cache, True)] * 2
    assert cache.get_seq_length() == 12
