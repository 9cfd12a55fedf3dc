"""Contracts that a wrong count, key, mapping or boundary breaks (issue 43's test gaps).

Each test states the contract it pins, written from the code's documented behaviour, with values
where the bug could show: a cache key varied one field at a time, grouped heads that differ, a batch
that fills its budget exactly, a check whose failure path is tripped.
"""

import pytest
import torch
from torch import nn

from tempo.bert.data.token_budget import TokenBudget, plan_steps
from tempo.integrations import hf_attention
from tempo.integrations.recipe import same_output
from tempo.ops.linear import linear_keeping_input


# ---------------------------------------------------------------------------------------------
# Attention: the packing mask's cache key, grouped heads in the eager fallback, head_mask packed
# ---------------------------------------------------------------------------------------------
def test_the_packing_mask_cache_is_keyed_by_tokens_batch_and_device():
    """One cu_seqlens describes [batch · tokens] tokens; the same cu read as another (tokens, batch)
    or for another device is another mask: each field varied alone gives a fresh, right mask."""
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    one_row = hf_attention._packing_mask(cu, 6, 1, torch.device("cpu"))
    assert one_row.shape == (1, 1, 6, 6)
    assert hf_attention._packing_mask(cu, 6, 1, torch.device("cpu")) is one_row  # cached
    two_rows = hf_attention._packing_mask(cu, 3, 2, torch.device("cpu"))  # tokens and batch changed together
    assert two_rows.shape == (2, 1, 3, 3)
    seq = torch.tensor([0, 0, 1, 2, 2, 2])
    want = torch.stack([seq[:3, None] == seq[None, :3], seq[3:, None] == seq[None, 3:]])[:, None]
    assert torch.equal(two_rows, want)
    # Tokens alone (a cu over 6 tokens read as 1 row of 6, then as 6 rows of 1) and batch alone.
    assert hf_attention._packing_mask(cu, 1, 6, torch.device("cpu")).shape == (6, 1, 1, 1)
    assert hf_attention._packing_mask(cu, 6, 1, torch.device("cpu")).shape == (1, 1, 6, 6)
    assert hf_attention._packing_mask(cu, 6, 1, torch.device("meta")).device.type == "meta"  # device alone
    # A cu with the same values but another tensor is another key (weak reference by identity).
    same_values = cu.clone()
    first = hf_attention._packing_mask(cu, 6, 1, torch.device("cpu"))
    assert hf_attention._packing_mask(same_values, 6, 1, torch.device("cpu")) is not first
    cu[1] = 3  # written in place: its version changes, so the mask is made again
    again = hf_attention._packing_mask(cu, 6, 1, torch.device("cpu"))
    assert bool(again[0, 0, 2, 0]) and not bool(first[0, 0, 2, 0])


def _reference_attention(q, k, v, scaling):
    return torch.softmax(q @ k.transpose(-1, -2) * scaling, dim=-1) @ v


def test_the_generic_eager_fallback_groups_query_heads_as_repeat_kv_does():
    """Grouped-query attention: kv head j serves query heads j·g .. j·g + g − 1 (transformers'
    repeat_kv, sdpa's enable_gqa), not j, j + kv_heads, ... (round robin). kv heads that differ."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out, _ = hf_attention._generic_eager(nn.Module(), q, k, v, None, scaling=0.3)
    for head in range(4):
        want = _reference_attention(q[:, head], k[:, head // 2], v[:, head // 2], 0.3)
        torch.testing.assert_close(out[:, :, head], want, atol=1e-6, rtol=0)
    from tempo.ops.attention import expand_kv_heads

    assert torch.equal(expand_kv_heads(k, 4)[:, 1], k[:, 0]) and torch.equal(expand_kv_heads(k, 4)[:, 2], k[:, 1])


class _Attention(nn.Module):
    is_causal = False


def test_a_packed_call_applies_head_mask_on_the_variable_length_path(monkeypatch):
    """The packed (variable-length) path multiplies each head's output by head_mask, as the dense
    path and eager do: the packed row equals each sequence alone with the same head_mask."""
    from tempo.ops import attention as attn_mod

    calls = []
    real = attn_mod.efficient_attention_varlen
    monkeypatch.setattr(attn_mod, "efficient_attention_varlen", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(0)
    lengths = [3, 2, 4]
    q, k, v = (torch.randn(1, 2, sum(lengths), 8) for _ in range(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    head_mask = torch.tensor([0.25, 1.0]).view(1, 2, 1, 1)
    module = _Attention().eval()
    out, _ = hf_attention.tempo_efficient_attention_forward(module, q, k, v, None, scaling=0.5, head_mask=head_mask,
                                                            position_ids=positions)
    assert calls, "the packed call did not take the variable-length op"
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        want = _reference_attention(q[:, :, part], k[:, :, part], v[:, :, part], 0.5) * head_mask
        torch.testing.assert_close(out[:, part], want.transpose(1, 2), atol=1e-6, rtol=0)
        start += n


# ---------------------------------------------------------------------------------------------
# Swaps: the input-keeping Linear's gradients whatever is frozen; the 16-bit check trips on NaN
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("needs", [(1, 1, 1), (1, 0, 1), (0, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1)],
                         ids=lambda n: "x%d-w%d-b%d" % n)
def test_the_input_keeping_linear_gives_every_gradient_whatever_is_frozen(needs):
    """Under bf16 autocast, each of x, weight, bias gets exactly the stock F.linear's gradient (bitwise,
    None where stock gives None) for every combination of requires_grad: a frozen weight with a
    trained bias is LoRA's bias="all"."""
    results = []
    for fn in (torch.nn.functional.linear, linear_keeping_input):
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(3, 5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
        for t, need in zip((x, w, b), needs):
            t.requires_grad_(bool(need))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, w, b)
        out.float().pow(2).sum().backward()
        results.append((out, [t.grad for t in (x, w, b)]))
    (stock_out, stock), (out, grads) = results
    assert torch.equal(out, stock_out)
    for name, got, want in zip(("x", "weight", "bias"), grads, stock):
        assert (got is None) == (want is None), name
        if want is not None:
            assert torch.equal(got, want), name


class _NanInBf16(nn.Linear):
    """The formula exactly (fp32), a NaN in one element of its bf16 output."""

    def forward(self, x):
        out = super().forward(x)
        if out.dtype == torch.bfloat16:
            out = out.clone()
            out.view(-1)[0] = float("nan")
        return out


def test_the_16_bit_check_refuses_a_nan_in_the_module_dtype():
    torch.manual_seed(0)
    original = nn.Linear(8, 4).to(torch.bfloat16)
    replacement = _NanInBf16(8, 4).to(torch.bfloat16)
    replacement.load_state_dict(original.state_dict())
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert same_output(original, original, x)  # the yardstick passes itself
    result = same_output(original, replacement, x)
    assert not result and "torch.bfloat16" in result.reason and "nan" in result.reason


# ---------------------------------------------------------------------------------------------
# Data: a batch whose tokens equal the budget exactly is one batch
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, count, lengths, budget", [
    ("bucket", "real", [4, 4, 8], 16), ("bucket", "real", [16], 16), ("pack", "real", [10, 6], 16),
    ("bucket", "padded", [7, 8], 16)])
def test_lengths_that_sum_to_the_budget_exactly_fill_one_batch(policy, count, lengths, budget):
    spec = TokenBudget(budget, policy, pad_to_multiple_of=8 if count == "padded" else 1, count=count)
    steps = plan_steps(lengths, spec, shuffle=False)
    assert len(steps) == 1 and sorted(steps[0][0]) == list(range(len(lengths)))
    assert spec.cost([lengths[i] for i in steps[0][0]]) == budget
    # One token more and it no longer fits: two batches.
    over = TokenBudget(budget - 1, policy, pad_to_multiple_of=spec.pad_to_multiple_of, count=count)
    if max(lengths) <= budget - 1 and count == "real":
        assert len(plan_steps(lengths, over, shuffle=False)) == 2
