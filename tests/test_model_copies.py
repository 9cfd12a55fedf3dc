"""Patched models are models like any other (issue 35.2): every family deep-copies, pickles
(``torch.save(model)`` / ``torch.load(..., weights_only=False)``) and saves with
``save_pretrained`` as the stock model does, and a copy and its original are two independent
models: each reverts without touching the other, and after revert each is the stock model.

What made a copy share state with its original before: the DeBERTa call hooks' undo was a closure
over the original's hook handles (reverting a copy removed the original's hooks: it then attended
across the sequences of a padding-free batch, 5e-3 off), and a local function in the model's
state (a patched DeBERTa did not pickle); the attention switch kept the configs it copied keyed by
``id()`` in the model and in a registry outside it (a copy of a head whose base was patched got a
second config copy). Now the state a patch leaves is data over objects of the model itself, and
the hooks are module-level functions found again by identity.
"""

import copy
import enum
import io
import json
import os
import types

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched  # noqa: E402
from tempo.integrations.recipe import is_replacement  # noqa: E402

from test_stock_parity import BASE, FAMILIES as PARITY_FAMILIES, batch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def deberta_v2(**o):
    # DeBERTa-v2's layout: no position buckets, separate position projections, absolute positions too.
    return PARITY_FAMILIES["deberta"](**{**dict(position_buckets=-1, max_relative_positions=-1, share_att_key=False,
                                                norm_rel_ebd="none", position_biased_input=True), **o})


FAMILIES = {**PARITY_FAMILIES, "deberta-v2": deberta_v2}
BASE = {**BASE, "deberta-v2": "deberta"}


def _stock(family):
    torch.manual_seed(0)
    return FAMILIES[family]().eval()


def _patched(stock):
    return apply_tempo(copy.deepcopy(stock)).eval()


def _packed_row(model):
    """One row of three sequences, position_ids restarting (DataCollatorWithFlattening's form)."""
    start = model.config.pad_token_id + 1 if model.config.model_type == "roberta" else 0
    lengths = [4, 6, 2]
    ids = torch.randint(3, 100, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(n) + start for n in lengths])[None]
    return dict(input_ids=ids, position_ids=positions)


def _inputs(model):
    """The padded batch, and for models whose forward takes position_ids, a padding-free row."""
    inputs = {"padded": {k: v for k, v in batch().items() if k != "labels"}}
    import inspect

    if "position_ids" in inspect.signature(model.forward).parameters:
        inputs["packed"] = _packed_row(model)
    return inputs


@torch.no_grad()
def _outputs(model, inputs):
    model.eval()
    return {name: model(**x).logits.clone() for name, x in inputs.items()}


def _assert_identical(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _structure(model):
    return [(name, type(module)) for name, module in model.named_modules(remove_duplicate=False)]


def _hooks(model):
    return [(name, len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()]


_ATOMIC = (type, types.ModuleType, types.BuiltinFunctionType, types.MethodWrapperType, str, bytes, int, float, bool,
           complex, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)


def _reachable(root):
    """Every object reachable from ``root`` through containers, instance dicts, bound methods and
    closure cells (not through classes or modules, which models share by design), id -> object."""
    seen, todo = {}, [root]
    while todo:
        obj = todo.pop()
        if isinstance(obj, _ATOMIC) or id(obj) in seen:
            continue
        seen[id(obj)] = obj
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, types.FunctionType):
            todo.extend(cell.cell_contents for cell in (obj.__closure__ or ()))
        elif isinstance(obj, types.MethodType):
            todo.append(obj.__self__)
        elif isinstance(obj, torch.Tensor):
            continue
        else:
            if hasattr(obj, "__dict__"):
                todo.append(vars(obj))
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    todo.append(getattr(obj, slot))
    return seen


def _shared_state(a, b):
    """Objects of one model's state that the other model's state reaches too (modules, tensors,
    configs, containers, closures): none may be, for the two to be independent."""
    mine, theirs = _reachable(a), _reachable(b)
    # Immutable containers may be shared (deepcopy returns a tuple of constants as it is); what they
    # hold is walked and reported itself.
    return sorted({type(mine[i]).__name__ for i in mine.keys() & theirs.keys()
                   if not isinstance(mine[i], (tuple, frozenset))
                   and (not isinstance(mine[i], types.FunctionType) or mine[i].__closure__)})


# ---------------------------------------------------------------------------------------------
# Deep copies
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("first", ["copy", "original"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_deep_copy_and_its_original_revert_independently(family, first):
    stock = _stock(family)
    original = _patched(stock)
    inputs = _inputs(stock)
    patched_outputs, patched_structure, patched_hooks = _outputs(original, inputs), _structure(original), \
        _hooks(original)
    clone = copy.deepcopy(original)
    assert _shared_state(clone, original) == []
    assert _structure(clone) == patched_structure and _hooks(clone) == patched_hooks
    _assert_identical(_outputs(clone, inputs), patched_outputs)

    stock_outputs = _outputs(stock, inputs)
    reverted, kept = (clone, original) if first == "copy" else (original, clone)
    revert_tempo(reverted)
    # The reverted one is the stock model; the other is exactly as it was: modules, hooks, config, numbers.
    assert _structure(reverted) == _structure(stock) and _hooks(reverted) == _hooks(stock)
    _assert_identical(_outputs(reverted, inputs), stock_outputs)
    assert _structure(kept) == patched_structure and _hooks(kept) == patched_hooks
    assert kept.config._attn_implementation == original.config._attn_implementation if first == "copy" else True
    _assert_identical(_outputs(kept, inputs), patched_outputs)
    revert_tempo(kept)
    _assert_identical(_outputs(kept, inputs), stock_outputs)
    _assert_identical(_outputs(reverted, inputs), stock_outputs)


@pytest.mark.parametrize("family", ["deberta", "deberta-v2"])
def test_deberta_original_attends_within_each_sequence_after_its_copy_reverted(family):
    """The issue's case: revert_tempo on a deep copy removed the original's packing hooks, and the
    original then attended across the sequences of a padding-free row (5e-3 off)."""
    stock = _stock(family)
    original = _patched(stock)
    row = _packed_row(stock)
    lengths, start = [4, 6, 2], 0
    with torch.no_grad():
        alone = []
        for n in lengths:
            alone.append(stock(input_ids=row["input_ids"][:, start:start + n]).logits)
            start += n
        alone = torch.cat(alone, 1)
        revert_tempo(copy.deepcopy(original))
        got = original(**row).logits
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_copy_patched_again_is_idempotent(family):
    stock = _stock(family)
    original = _patched(stock)
    clone = copy.deepcopy(original)
    before = (_structure(clone), _hooks(clone), tempo_patched(clone), clone.config)
    apply_tempo(clone)
    assert (_structure(clone), _hooks(clone), tempo_patched(clone), clone.config) == before

    # A copy of a head whose base model was patched first: patching the head shares the base's config copy.
    nested = copy.deepcopy(stock)
    apply_tempo(getattr(nested, BASE[family]))
    nested_copy = copy.deepcopy(nested)
    for model in (nested, nested_copy):
        apply_tempo(model)
        assert model.config is getattr(model, BASE[family]).config
        assert tempo_patched(model) == tempo_patched(original)
        assert _hooks(model) == _hooks(original)
    assert _shared_state(nested_copy, nested) == []
    revert_tempo(nested_copy)
    assert _structure(nested_copy) == _structure(stock) and _structure(nested) == _structure(original)


# ---------------------------------------------------------------------------------------------
# Pickling
# ---------------------------------------------------------------------------------------------
def _loss_and_grads(model, seed):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout stream for both models
    loss = model(**batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_pickled_patched_model_loads_trains_and_reverts_on_its_own(family):
    stock = _stock(family)
    original = _patched(stock)
    inputs = _inputs(stock)
    buffer = io.BytesIO()
    torch.save(original, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert _structure(loaded) == _structure(original) and _hooks(loaded) == _hooks(original)
    assert tempo_patched(loaded) == tempo_patched(original)
    _assert_identical(_outputs(loaded, inputs), _outputs(original, inputs))
    # It trains: the same loss and every gradient as the original, dropout on (the same RNG stream).
    loss_l, grads_l = _loss_and_grads(loaded, seed=7)
    loss_o, grads_o = _loss_and_grads(original, seed=7)
    assert torch.equal(loss_l, loss_o) and grads_l.keys() == grads_o.keys()
    for name in grads_o:
        assert torch.equal(grads_l[name], grads_o[name]), name
    before = _outputs(original, inputs)
    revert_tempo(loaded)
    assert _structure(loaded) == _structure(stock) and _hooks(loaded) == _hooks(stock)
    _assert_identical(_outputs(loaded, inputs), _outputs(stock, inputs))
    _assert_identical(_outputs(original, inputs), before)


# ---------------------------------------------------------------------------------------------
# save_pretrained / from_pretrained
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_pretrained_writes_the_stock_checkpoint(family, tmp_path):
    stock = _stock(family)
    patched = _patched(stock)
    inputs = _inputs(stock)
    before = _outputs(patched, inputs)
    patched.save_pretrained(tmp_path / "patched")
    stock.save_pretrained(tmp_path / "stock")
    from safetensors.torch import load_file

    saved, want = (load_file(tmp_path / name / "model.safetensors") for name in ("patched", "stock"))
    assert sorted(saved) == sorted(want)
    assert all(torch.equal(saved[k], want[k]) for k in want)
    config = json.loads((tmp_path / "patched" / "config.json").read_text())
    assert "tempo" not in json.dumps(config)  # the switched attention is Tempo's copy's, never saved as the model's
    loaded = type(stock).from_pretrained(tmp_path / "patched", attn_implementation="eager").eval()
    assert not any(is_replacement(m) for m in loaded.modules())
    assert list(loaded.state_dict()) == list(stock.state_dict())
    _assert_identical(_outputs(loaded, inputs), _outputs(stock, inputs))
    _assert_identical(_outputs(patched, inputs), before)  # saving changed nothing
    assert tempo_patched(apply_tempo(loaded)) == tempo_patched(patched)


# ---------------------------------------------------------------------------------------------
# What revert and idempotency compare (the mutation class "compared on too few fields")
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["gelu", "layernorm", "attention", "dropout_add_layernorm"])
def test_another_choice_in_any_one_field_is_refused(field):
    """apply_tempo on a patched model is a no-op only for the same choice: each field alone differing
    is another choice (refused, nothing changed)."""
    model = _patched(_stock("bert"))
    before = _structure(model)
    other = {"gelu": dict(gelu=False), "layernorm": dict(layernorm=False), "attention": dict(attention="tempo"),
             "dropout_add_layernorm": dict(dropout_add_layernorm=False)}[field]
    with pytest.raises(ValueError, match="already patched"):
        apply_tempo(model, **other)
    assert _structure(model) == before


def test_revert_takes_out_tempos_hooks_only():
    """revert finds Tempo's call hooks by identity: a user's hooks on the same module stay, and run."""
    stock = _stock("deberta")
    model = _patched(stock)
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    model.register_forward_hook(lambda module, args, out: calls.append("post"), always_call=True)
    model.deberta.register_forward_pre_hook(lambda module, args, kwargs: calls.append("inner"), with_kwargs=True)
    revert_tempo(model)
    assert _structure(model) == _structure(stock)
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in (model, model.deberta)] == [2, 1]
    assert len(model._forward_hooks_always_called) == 1 and len(model.deberta._forward_pre_hooks_with_kwargs) == 1
    with torch.no_grad():
        model(**_inputs(stock)["padded"])
    assert calls == ["pre", "inner", "post"]


def test_a_failed_apply_keeps_the_hooks_of_a_sub_model_patched_before(monkeypatch):
    """All or nothing: a head patched after its base fails at the last step; the base keeps the call
    hooks its own patch installed (and still attends within each sequence)."""
    import dataclasses

    import tempo.integrations.patch as patch_module

    stock = _stock("deberta")
    model = copy.deepcopy(stock)
    apply_tempo(model.deberta)
    hooks = _hooks(model)
    every_recipe = patch_module.recipes

    def failing(tree):
        raise RuntimeError("hook failed")

    monkeypatch.setattr(patch_module, "recipes", lambda: [dataclasses.replace(r, model_hook=failing)
                                                          if r.model_hook is not None else r for r in every_recipe()])
    with pytest.raises(RuntimeError, match="hook failed"):
        apply_tempo(model)
    assert _hooks(model) == hooks
