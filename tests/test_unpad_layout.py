"""TokenLayout: the unpadded batch's description, its round trips and its errors."""

import pytest
import torch

from tempo.unpad import LayoutError, TokenLayout


def test_right_and_left_padding_round_trip():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]])
    layout = TokenLayout.from_mask(mask)
    assert layout.lengths == (3, 3, 5, 1) and layout.total_tokens == 12 and layout.padding_tokens == 8
    assert layout.cu_seqlens.tolist() == [0, 3, 6, 11, 12] and layout.cu_seqlens.dtype == torch.int32
    assert layout.max_seqlen == 5 and not layout.is_full
    assert layout.positions().tolist() == [0, 1, 2, 2, 3, 4, 0, 1, 2, 3, 4, 1]
    assert layout.first_tokens().tolist() == [0, 3, 6, 11]
    assert layout.sequence_ids().tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3]
    x = torch.randn(4, 5, 3)
    packed = layout.unpad(x)
    assert packed.shape == (12, 3)
    back = layout.pad(packed)
    assert torch.equal(back[mask.bool()], x[mask.bool()]) and torch.equal(back[~mask.bool()], torch.zeros(8, 3))
    assert torch.equal(layout.real_mask(), mask.bool())
    # Positions in the padded rows -> token indices (left padding shifts by the row's first position).
    assert layout.token_index(torch.tensor([[0, 2], [2, 4], [0, 4], [1, 1]])).tolist() == [[0, 2], [3, 5], [6, 10], [11, 11]]


def test_full_and_cu_seqlens_layouts():
    full = TokenLayout.full(2, 3, "cpu")
    assert full.is_full and full.cu_seqlens.tolist() == [0, 3, 6] and full.max_seqlen == 3
    packed = TokenLayout.from_cu_seqlens(torch.tensor([0, 2, 7]), 7)
    assert packed.lengths == (2, 5) and packed.batch_size == 1 and packed.seq_len == 7


@pytest.mark.parametrize("mask,message", [
    (torch.tensor([[1, 0, 1, 0]]), "row 0's real tokens are not contiguous"),
    (torch.tensor([[1, 1], [0, 0]]), "row 1 has no real token"),
    (torch.tensor([[1, 2]]), "0 and 1 only"),
    (torch.ones(2, 3, 4), r"\[batch, seq_len\]"),
])
def test_bad_masks_are_named(mask, message):
    with pytest.raises(LayoutError, match=message) as err:
        TokenLayout.from_mask(mask)
    assert "attention_mask" in str(err.value)


@pytest.mark.parametrize("cu,total,message", [
    (torch.tensor([1, 3]), 3, "must start at 0"),
    (torch.tensor([0, 3, 3]), 3, "increase strictly"),
    (torch.tensor([0, 2, 4]), 5, "ends at 4 but there are 5 tokens"),
    (torch.tensor([0.0, 2.0]), 2, "integer tensor"),
    (torch.tensor([0]), 0, "at least 2"),
])
def test_bad_cu_seqlens_are_named(cu, total, message):
    with pytest.raises(LayoutError, match=message):
        TokenLayout.from_cu_seqlens(cu, total)


def test_one_host_read_per_batch_and_none_in_the_layers():
    """from_mask reads the lengths once (no nonzero, no host-to-device copy of cu_seqlens); the
    layout knows min_seqlen and max_seqlen and records its cu_seqlens with the attention ops, so
    they never read it back (issue 28)."""
    from test_host_reads import HostReadCounter

    from tempo.ops.attention import sequence_facts

    def reads(fn):
        counter = HostReadCounter()
        with counter.installed(), counter.counting():
            result = fn()
        return counter.total, result

    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]])
    n, layout = reads(lambda: TokenLayout.from_mask(mask))
    assert n == 1
    assert (layout.min_seqlen, layout.max_seqlen) == (1, 5)
    n, facts = reads(lambda: sequence_facts(layout.cu_seqlens))
    assert n == 0 and facts.offsets == (0, 3, 6, 11, 12) and (facts.min_seqlen, facts.max_seqlen) == (1, 5)
    full = TokenLayout.full(2, 3, "cpu")
    assert (full.min_seqlen, full.max_seqlen) == (3, 3) and reads(lambda: sequence_facts(full.cu_seqlens))[0] == 0
    n, packed = reads(lambda: TokenLayout.from_cu_seqlens(torch.tensor([0, 2, 7]), 7))
    assert n == 1 and (packed.min_seqlen, packed.max_seqlen) == (2, 5)
    assert reads(lambda: sequence_facts(packed.cu_seqlens))[0] == 0
