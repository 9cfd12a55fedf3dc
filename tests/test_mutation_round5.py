"""Tests written for the survivors of mutation round 5 (results/mutation/README.md, round5.json):
each fails under the mutant named in its docstring and states the contract that mutant broke."""

from __future__ import annotations

import copy
import importlib
import types

import pytest
import torch
from torch import nn

from tempo.integrations import model_calls
from tempo.integrations.recompute import recompute_of, set_recompute


# -- V11: set_recompute(block, "none") is a no-op on a block under transformers' gradient checkpointing --------
def test_none_on_a_block_under_transformers_checkpointing_is_allowed():
    """V11: only a recompute mode conflicts with transformers' gradient checkpointing; "none" (what
    revert_tempo's remove_recompute sets) must not raise on such a block."""
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32))
    model.gradient_checkpointing_enable()
    block = model.encoder.layer[0]
    assert set_recompute(block, "none") is block
    assert recompute_of(block) == "none"
    with pytest.raises(ValueError, match="already has transformers' gradient checkpointing"):
        set_recompute(block, "full")


# -- V31: a test that errors is listed among the failing ids of the GPU suite's summary ------------------------
def test_junit_counts_lists_an_erroring_test_as_failing(tmp_path):
    """V31: ``failing`` holds every test that failed or errored, in file order."""
    from tempo.bench.gpu_suite import junit_counts

    path = tmp_path / "t.xml"
    path.write_text('<testsuites><testsuite>'
                    '<testcase classname="t" name="a"/>'
                    '<testcase classname="t" name="b"><failure message="x"/></testcase>'
                    '<testcase classname="t" name="c"><error message="y"/></testcase>'
                    '<testcase classname="t" name="d"><skipped/></testcase>'
                    '</testsuite></testsuites>')
    assert junit_counts(path) == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1,
                                  "failing": ["t::b", "t::c"]}


# -- V28: DefaultMeasure's rate is the real tokens the timed steps ran, per second ----------------------------
class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x).pow(2).mean()


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return _Stack()


def _fewer_tokens(tokens: int) -> torch.Tensor:
    return torch.randn(tokens // 8 - 1, 8, generator=torch.Generator().manual_seed(tokens))  # 8 fewer than asked


def test_the_measured_rate_counts_the_real_tokens(monkeypatch):
    """V28: tokens_per_second = the real tokens of the timed steps / their seconds (the clock is a
    stand-in that says 2 s passed: no timing is asserted)."""
    confirm = importlib.import_module("tempo.plan.confirm")  # tempo.plan.confirm is also a function's name
    ticks = iter([10.0, 12.0])
    monkeypatch.setattr(confirm, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    measured = confirm.DefaultMeasure(_fewer_tokens, device="cpu", steps=3)(_stack, 48)
    assert measured.real_tokens == 40
    assert measured.tokens_per_second == 3 * 40 / 2.0


# -- V09: a call with inputs_embeds and a [B, S] mask builds its layers' mask ----------------------------------
def test_mask_per_token_reads_the_batch_shape_from_inputs_embeds():
    """V09: the batch's [B, S] comes from inputs_embeds when input_ids is absent."""
    positions = {"input_ids": 0, "attention_mask": 1, "inputs_embeds": 3}
    embeds, mask = torch.zeros(2, 5, 4), torch.ones(2, 5, dtype=torch.long)
    assert model_calls.mask_per_token((), {"inputs_embeds": embeds, "attention_mask": mask}, positions)
    assert not model_calls.mask_per_token((), {"inputs_embeds": embeds, "attention_mask": torch.ones(2, 1, 5, 5)},
                                          positions)


# -- V15: inside an MPNet call given a 4-D mask, the mask is not reduced to its first row ----------------------
def test_an_mpnet_model_called_with_a_4d_mask_whose_rows_differ_keeps_every_row():
    """V15: only a call whose mask MPNet builds (absent or [B, S]) has a key-padding mask; a 4-D mask
    the caller built reaches the layers whole, so the patched model computes what the stock one does."""
    transformers = pytest.importorskip("transformers")
    from tempo.integrations.patch import apply_tempo

    torch.manual_seed(0)
    config = transformers.MPNetConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    stock = transformers.MPNetModel(config).eval()
    patched = apply_tempo(copy.deepcopy(stock))
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 1, 6, 6)
    mask[0, 0, 1, 3:] = torch.finfo(torch.float32).min  # only query row 1 of sample 0 masks keys 3..5
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).last_hidden_state
        got = patched(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- V06: the generic eager attention shares each kv head among consecutive query heads -----------------------
def test_generic_eager_groups_query_heads_as_repeat_kv():
    """V06: with 4 query heads and 2 kv heads, query heads 0-1 use kv head 0 and 2-3 kv head 1
    (transformers' repeat_kv), in the output and in the returned weights."""
    from tempo.integrations.hf_attention import _generic_eager

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 5, 8, generator=g) for h in (4, 2, 2))
    out, weights = _generic_eager(nn.Module().eval(), q, k, v, None)
    for head in range(4):
        kv = head // 2
        want_w = torch.softmax(q[:, head] @ k[:, kv].transpose(-1, -2) * 8 ** -0.5, dim=-1)
        torch.testing.assert_close(weights[:, head], want_w)
        torch.testing.assert_close(out[:, :, head], want_w @ v[:, kv])


# -- V01: a packed call that also passes a 2-D mask keeps sdpa's mask -----------------------------------------
def test_the_efficient_mask_function_keeps_the_mask_when_a_2d_mask_is_given():
    """V01: "tempo_efficient"'s mask function returns None only when no 2-D mask was given; with one
    (padding inside a packed row) it returns sdpa's mask, whatever the composition of mask_function.
    transformers' builders do not pack when a 2-D mask is given; a caller of the mask interface may."""
    mu = pytest.importorskip("transformers.masking_utils")
    from tempo.integrations import hf_attention as ha

    mask_fn = ha._efficient_mask_function(mu.sdpa_mask)
    packs = mu.and_masks(mu.bidirectional_mask_function,
                         mu.packed_sequence_mask_function(torch.tensor([[0, 0, 1, 1, 1]])))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    owner = nn.Module()
    ha._CALLS.push(ha._Call(owner, (None, cu), (cu, cu.new_empty(1, 5, 0), cu.new_empty(3, 0), cu.new_empty(2, 0))))
    try:
        assert mask_fn(batch_size=1, q_length=5, kv_length=5, mask_function=packs) is None  # packing only
        padding = torch.tensor([[True, True, True, True, False]])
        got = mask_fn(batch_size=1, q_length=5, kv_length=5, mask_function=packs, attention_mask=padding)
    finally:
        ha._CALLS.pop(owner)
    assert got is not None and got.shape == (1, 1, 5, 5)
    assert not got[0, 0, :, 4].any() and got[0, 0, 2, 3] and not got[0, 0, 0, 2]  # padding and packing masked


# -- V03: the packing mask is made again for cu_seqlens written in place --------------------------------------
def test_the_packing_mask_of_cu_seqlens_written_in_place_is_made_again():
    """V03: the cache of ``_packing_mask`` is keyed by the cu tensor and its version: the same tensor
    holding other boundaries gets their mask, not the cached one."""
    from tempo.integrations.hf_attention import _packing_mask

    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    first = _packing_mask(cu, 5, 1, cu.device)
    assert _packing_mask(cu, 5, 1, cu.device) is first  # once per tensor
    cu[1] = 3
    again = _packing_mask(cu, 5, 1, cu.device)
    same = torch.tensor([0, 0, 0, 1, 1])
    assert torch.equal(again[0, 0], same[:, None] == same[None, :])


# -- V04: a call whose packing could not be read at the call lets each layer read its own ---------------------
def test_a_call_with_packing_per_layer_reads_the_layers_position_ids():
    """V04: ``_layer_packing`` inside a call marked ``_PER_LAYER`` reads the layer's own position_ids."""
    from tempo.integrations import hf_attention as ha

    q = torch.randn(1, 2, 5, 8)
    owner = nn.Module()
    ha._CALLS.push(ha._Call(owner, (None, None), ha._PER_LAYER))
    try:
        found = ha._layer_packing(q, q, {"position_ids": torch.tensor([[0, 1, 0, 1, 2]])})
    finally:
        ha._CALLS.pop(owner)
    assert found is not None and found[0].tolist() == [0, 2, 5] and found[1:] == (3, None)


# -- V07: the post hook pops the call record even when the forward raises -------------------------------------
class _Raises(nn.Module):
    def forward(self, x):
        raise RuntimeError("forward failed")


def test_a_forward_that_raises_leaves_no_call_on_the_stack():
    """V07: ``install`` registers the post hook with ``always_call``: a forward that raises pops its
    record, so the next call's layers never read a stale one."""
    stack = model_calls.CallStack()
    module = _Raises()

    def pre(m, args, kwargs):
        stack.push(types.SimpleNamespace(owner=m))

    def post(m, args, kwargs, output):
        stack.pop(m)

    assert model_calls.install(module, pre, post) and not model_calls.install(module, pre, post)
    with pytest.raises(RuntimeError, match="forward failed"):
        module(torch.zeros(1))
    assert stack.current() is None


# -- V08: an argument past the positional ones is absent, not an IndexError -----------------------------------
def test_argument_past_the_positional_ones_is_none():
    """V08: ``argument(args, kwargs, name, position)`` is the keyword, else ``args[position]`` when
    there are more than ``position`` positional arguments, else None."""
    ids = torch.zeros(2, 3)
    assert model_calls.argument((ids,), {}, "attention_mask", 1) is None
    assert model_calls.argument((ids,), {}, "input_ids", 0) is ids
    assert model_calls.argument((ids, "m"), {}, "attention_mask", 1) == "m"
    assert model_calls.argument((ids, "m"), {"attention_mask": "k"}, "attention_mask", 1) == "k"


# -- V13: revert_tempo takes off selective-recompute hooks left on a module it puts back ----------------------
def test_revert_removes_recompute_hooks_from_modules_it_puts_back():
    """V13: a block set to "selective" (hooks on its Linears and activations), then patched (some of
    those modules replaced, so out of the tree), then set back to "none", then reverted: the originals
    revert_tempo puts back carry no hook of the recompute module."""
    transformers = pytest.importorskip("transformers")
    from tempo.integrations.patch import apply_tempo, revert_tempo
    from tempo.integrations.recompute import transformer_blocks

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        attn_implementation="eager"))
    block = transformer_blocks(model)[0]
    set_recompute(block, "selective")
    hooked = [m for m in block.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooked
    apply_tempo(model)
    set_recompute(block, "none")
    revert_tempo(model)
    assert [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks] == []
    assert all(not (m._forward_hooks or m._forward_pre_hooks) for m in hooked)
