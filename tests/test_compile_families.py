"""torch.compile of every patched family, MPNet included: a 2-layer training forward (train mode, a
loss) whose graph breaks never pass through a Tempo layer, with the exact break count per family
(0: tests/test_compile_graphs.py's KNOWN_BREAKS), every Tempo op of the layers in
the graph, and an aot_eager step giving the eager loss and gradients (dropout off).

MPNet's layers used to break 13 times in 2 layers (14 graphs): their padding-mask row was checked
on the host per layer. Now the model's call hooks say, from shapes alone, that the model built the
mask from a [B, S] one (every query row the same) and the layers take its row with no read.
"""

from __future__ import annotations

import collections
import copy
import logging
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

import tempo  # noqa: E402
from tempo.integrations import mpnet as mpnet_module  # noqa: E402
from tempo.integrations.patch import apply_tempo, revert_tempo  # noqa: E402

from test_compile_graphs import (  # noqa: E402
    COMPILED_FAMILIES, KNOWN_BREAKS, TEMPO_OPS, _break_site, assert_same_gradients, batch, loss_and_grads)
from test_stock_parity import FAMILIES, SMALL  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEMPO_DIR = os.path.dirname(tempo.__file__) + os.sep
# The model-level call hooks: the one place outside the layers where Tempo may read the batch (the
# packing of a padding-free batch, hf_attention's and deberta's, in a function torch.compile skips).
CALL_HOOKS = {"_call_pre_hook", "_call_post_hook"}


def mpnet(**overrides) -> nn.Module:
    return transformers.MPNetForMaskedLM(transformers.MPNetConfig(**{**SMALL, "max_position_embeddings": 64,
                                                                     **overrides}))


BUILDERS = {**FAMILIES, "mpnet": mpnet}
ALL = [*COMPILED_FAMILIES, "mpnet"]
OPS = {**TEMPO_OPS, "mpnet": {"layernorm_fwd": 4, "dropout_add_layernorm_fwd": 2, "efficient_attention_fwd": 2}}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def patched(family: str, dropout: bool = True) -> nn.Module:
    """``family``'s tiny 2-layer config, patched, in training mode; dropout off when asked."""
    torch.manual_seed(0)
    off = {} if dropout else dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return apply_tempo(BUILDERS[family](**off).train()).train()


def through_a_layer(reason) -> bool:
    """A break whose user stack has a frame in a Tempo file other than a model's call hook."""
    return any(frame.filename.startswith(TEMPO_DIR) and frame.name not in CALL_HOOKS
               for frame in reason.user_stack or [])


@pytest.mark.parametrize("family", ALL)
def test_a_training_forward_breaks_nowhere_in_the_layers(family):
    """No break through a Tempo frame; the exact break count (KNOWN_BREAKS: none now; MPNet: 0, one graph); every Tempo op of the layers in the graph (a frame dynamo skipped
    would drop them without counting a break)."""
    model = patched(family)
    explained = torch._dynamo.explain(lambda **b: model(**b).loss)(**batch(3))
    reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    assert [str(r.reason).splitlines()[0] for r in explained.break_reasons if through_a_layer(r)] == []
    known = KNOWN_BREAKS.get(family, set())
    assert {_break_site(r.user_stack) for r in explained.break_reasons} == known, reasons
    assert explained.graph_break_count == len(known), reasons
    assert explained.graph_count == len(known) + 1, reasons
    ops = collections.Counter(str(op).split(".")[1] for graph in explained.ops_per_graph for op in graph
                              if str(op).startswith("tempo."))
    assert {op: ops[op] for op in OPS[family]} == OPS[family], ops


@pytest.mark.parametrize("family", ALL)
def test_an_aot_eager_step_gives_the_eager_loss_and_gradients(family):
    model = patched(family, dropout=False)
    inputs = batch(3)
    loss_e, grads_e = loss_and_grads(model, model, inputs)
    loss_c, grads_c = loss_and_grads(model, torch.compile(model, backend="aot_eager"), inputs)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert_same_gradients(grads_c, grads_e)


# ---------------------------------------------------------------------------------------------
# MPNet: the padding row of a mask the model built, with no host read; any other mask, whole
# ---------------------------------------------------------------------------------------------
def test_mpnet_layers_read_nothing_inside_a_model_call(monkeypatch):
    """Eager, padded batch: the layers take the row of the model's mask without the host check
    (which would call _is_fake first), one row tensor for both layers, the stock model's output."""
    def no_check(t):
        raise AssertionError("the host check of the mask ran inside a model call")

    torch.manual_seed(0)
    stock = mpnet(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    model = apply_tempo(copy.deepcopy(stock)).train()
    masks = []
    for layer in model.mpnet.encoder.layer:
        attn = layer.attention.attn
        attn.register_forward_hook(lambda m, args, out: masks.append(mpnet_module.current_call().row[2]))
    monkeypatch.setattr(mpnet_module, "_is_fake", no_check)
    inputs = batch(3)
    loss_t, grads_t = loss_and_grads(model, model, inputs)
    assert len(masks) == 2 and masks[0] is masks[1] and masks[0].shape == (3, 1, 1, 12)
    assert mpnet_module.current_call() is None  # popped after the call
    loss_s, grads_s = loss_and_grads(stock, stock, inputs)
    torch.testing.assert_close(loss_t, loss_s, rtol=1e-5, atol=1e-6)
    assert_same_gradients(grads_t, grads_s)


def test_mpnet_compiled_with_a_4d_mask_it_did_not_build_passes_it_whole_logged(caplog):
    """A caller's 4-D additive mask (query rows differ) reaches the layers as given: under
    torch.compile nothing checks it, so it is passed whole, logged once at the model call (outside
    the graph: no break), and the output is the eager model's."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = apply_tempo(mpnet(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).mpnet).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 6), generator=g)
    mask = torch.zeros(2, 1, 6, 6)
    mask[0, 0, 1, 3:] = torch.finfo(torch.float32).min  # only query 1 of sample 0 masks keys 3..5
    logged = "did not build from a [B, S] mask is passed whole"
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="tempo.integrations.mpnet"):
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        mpnet_module._logged.clear()
        explained = torch._dynamo.explain(lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state)()
        assert explained.graph_break_count == 0 and sum(logged in m for m in caplog.messages) == 1
        torch._dynamo.reset()
        counters.clear()
        mpnet_module._logged.clear()
        compiled = torch.compile(model, backend="aot_eager")
        got = [compiled(input_ids=ids, attention_mask=mask).last_hidden_state for _ in range(2)]
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(logged in m for m in caplog.messages) == 2  # once per cleared log: the explain's, the compiled run's
    for out in got:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_mpnet_attention_compiled_on_its_own_passes_its_mask_whole_logged(caplog):
    """The attention compiled alone (no model call vouches for its mask): the mask passed whole,
    logged once, the eager attention's output."""
    torch.manual_seed(0)
    attn = apply_tempo(mpnet(attention_probs_dropout_prob=0.0)).mpnet.encoder.layer[0].attention.attn.eval()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, SMALL["hidden_size"], generator=g)
    bias = torch.randn(1, SMALL["num_attention_heads"], 6, 6, generator=g)
    mask = torch.zeros(2, 1, 6, 6)
    mask[1, :, :, 4:] = torch.finfo(torch.float32).min  # a key-padding mask: eager takes its row
    mpnet_module._logged.clear()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="tempo.integrations.mpnet"):
        want = attn(hidden, mask, bias)[0]
        compiled = torch.compile(attn, backend="aot_eager")
        got = [compiled(hidden, mask, bias)[0] for _ in range(2)]
    assert sum("did not build from a [B, S] mask is passed whole" in m for m in caplog.messages) == 1
    for out in got:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_mpnet_revert_takes_the_call_hooks_out():
    model = apply_tempo(mpnet())
    assert len(model.mpnet._forward_pre_hooks) == 1 and len(model.mpnet._forward_hooks) == 1
    revert_tempo(model)
    assert not model.mpnet._forward_pre_hooks and not model.mpnet._forward_hooks
    model(**batch(2))  # the stock model runs again
