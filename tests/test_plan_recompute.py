"""Per-block recompute (tempo.integrations.recompute): every mode trains exactly, keeps what it says, and
leaves the model the model (issue 32: "every plan the planner can emit trains exactly")."""

import contextlib
import copy
import io
import pickle

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from tempo.integrations.patch import apply_tempo  # noqa: E402
from tempo.integrations.recompute import (apply_recompute, recompute_of, recomputed_parts, set_recompute,  # noqa: E402
                                  transformer_blocks)
from tempo.plan.trace import trace_step  # noqa: E402

SMALL = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=96, vocab_size=100)


def bert(**o):
    return transformers.BertForMaskedLM(transformers.BertConfig(**{**SMALL, **o}))


def deberta(**o):
    return transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**{**SMALL, **dict(
        relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=-1,
        norm_rel_ebd="layer_norm", share_att_key=True), **o}))


def modernbert(**o):
    return transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**{**dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48, vocab_size=100,
        global_attn_every_n_layers=2, local_attention=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, embedding_dropout=0.1, attention_dropout=0.1), **o}))


def llama(**o):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, intermediate_size=80,
        vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2), **o}))


FAMILIES = {"bert": bert, "deberta": deberta, "modernbert": modernbert, "llama": llama}
MODES = {"full": ["full"] * 3, "selective": ["selective"] * 3, "mixed": ["none", "selective", "full"]}


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def loss_and_grads(model):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout stream for every run
    loss = model(**batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tempo", [True, False], ids=["tempo", "stock"])
@pytest.mark.parametrize("modes", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_recompute_mode_gives_the_gradients_of_none_bitwise_with_dropout_on(family, modes, tempo):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    if tempo:
        apply_tempo(model)
    model.train()
    want_loss, want = loss_and_grads(model)
    apply_recompute(model, MODES[modes])
    assert [recompute_of(b) for b in transformer_blocks(model)] == MODES[modes]
    got_loss, got = loss_and_grads(model)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _kept_after_forward(model):
    """Bytes alive at the end of forward that were made during it (the activations kept), real tensors."""
    trace = trace_step(model, list(transformer_blocks(model)), batch(), contextlib.nullcontext(), semantics="cpu",
                       autocast_dtype=None)
    return trace.segments[("fwd_end",)].start


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_selective_drops_the_mlp_intermediate_and_full_keeps_the_inputs_only(family):
    torch.manual_seed(0)
    model = apply_tempo(FAMILIES[family]()).train()
    kept = {}
    for mode in ("none", "selective", "full"):
        apply_recompute(model, [mode] * 3)
        kept[mode] = _kept_after_forward(model)
    tokens = 2 * 12
    intermediate = 96 if family == "bert" else 2 * 80  # BERT's GELU output; Llama's gate and up
    # What selective saves per block: the intermediate (fp32, no autocast here), nothing else.
    assert kept["none"] - kept["selective"] == 3 * tokens * intermediate * 4
    assert kept["full"] < kept["selective"]


def test_eval_and_no_grad_run_the_block_as_it_is():
    model = apply_recompute(bert(), ["full", "selective", "full"]).eval()
    stock = copy.deepcopy(model)
    apply_recompute(stock, ["none"] * 3)
    with torch.no_grad():
        assert torch.equal(model(**batch()).logits, stock(**batch()).logits)


def test_recomputed_blocks_keep_their_class_name_isinstance_state_dict_and_pickle():
    model = bert()
    keys = list(model.state_dict())
    apply_recompute(model, ["full", "selective", "none"])
    blocks = transformer_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["BertLayer"] * 3
    assert all(isinstance(b, transformers.models.bert.modeling_bert.BertLayer) for b in blocks)
    assert list(model.state_dict()) == keys
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert [recompute_of(b) for b in transformer_blocks(copied)] == ["full", "selective", "none"]
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [recompute_of(b) for b in transformer_blocks(loaded)] == ["full", "selective", "none"]


def test_none_gives_the_block_its_class_back_and_removes_every_hook():
    model = bert()
    before = [(type(m), dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()]
    apply_recompute(model, ["selective"] * 3)
    assert any(m._forward_hooks for m in model.modules())
    apply_recompute(model, ["none"] * 3)
    assert [(type(m), dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()] == before


def test_a_copy_set_back_to_none_leaves_the_original_recomputing():
    model = apply_recompute(bert(), ["selective"] * 3)
    twin = copy.deepcopy(model)
    apply_recompute(twin, ["none"] * 3)
    assert [recompute_of(b) for b in transformer_blocks(model)] == ["selective"] * 3
    assert any(m._forward_hooks for m in model.modules())


def test_selective_recomputes_the_widest_linears_and_their_activation():
    block = transformer_blocks(bert())[0]
    linears, activations = recomputed_parts(block)
    assert linears == [block.intermediate.dense]
    assert activations == [block.intermediate.intermediate_act_fn]


# -- guards ----------------------------------------------------------------------------------
def test_an_unknown_mode_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="argument 'mode' must be one of"):
        set_recompute(transformer_blocks(bert())[0], "partial")


def test_a_wrong_number_of_modes_is_refused():
    with pytest.raises(ValueError, match="2 modes for 3 Transformer blocks"):
        apply_recompute(bert(), ["full", "full"])


def test_selective_on_a_block_without_an_expanding_linear_is_refused():
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    with pytest.raises(ValueError, match="no Linear wider than its input"):
        set_recompute(block, "selective")


def test_a_block_under_transformers_gradient_checkpointing_is_refused():
    model = bert()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="already has transformers' gradient checkpointing"):
        set_recompute(transformer_blocks(model)[0], "full")


def test_an_activation_saving_something_shaped_like_its_output_fails_before_backward():
    """An activation that saves another tensor of its output's size (not its output) cannot be
    recomputed from the Linear's input: the forward raises, no wrong gradient is ever made."""
    class Tricky(nn.Module):
        def forward(self, x):
            helper = torch.tanh(x)  # saved by the multiplication below; same size and dtype as the output
            return x * helper + 0.0

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.act, self.down = nn.Linear(4, 16), Tricky(), nn.Linear(16, 4)

        def forward(self, x):
            return self.down(self.act(self.up(x)))

    Tricky.__name__ = "TrickyActivation"  # a name the structure rule takes for an activation
    block = set_recompute(Block().train(), "selective")
    with pytest.raises(RuntimeError, match="cannot be recomputed selectively"):
        block(torch.randn(3, 4, requires_grad=True))


@pytest.mark.parametrize("family", ["deberta", "bert"])
def test_full_recompute_of_a_padding_free_batch_sees_the_call_it_ran_in(family):
    """A block recomputed in backward runs after its model call has returned; the packing the call
    handed its layers (DeBERTa's and Tempo's attention read it from the call) is re-entered for the
    recomputation, so "full" recompute of a packed row gives the loss and every gradient of the run
    without recompute, bitwise (DeBERTa raised a CheckpointError: 43 tensors saved, 42 recomputed)."""
    torch.manual_seed(0)
    if family == "deberta":
        model = transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, relative_attention=True, position_buckets=8, max_relative_positions=16,
            pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model = apply_tempo(model).train()
    lengths = [5, 3, 7]
    ids = torch.randint(3, 100, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]

    def run(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, position_ids=positions, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    want_loss, want = run(model)
    recomputed = apply_recompute(copy.deepcopy(model), ["full", "full"])
    got_loss, got = run(recomputed)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
