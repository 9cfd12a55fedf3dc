"""A patched model is the stock model in every way a user touches it (issue 26), for every family
apply_tempo handles: dropout switched off through its nn.Dropout modules (TRL's idiom), models built
from one config, the model's own _init_weights, apply_tempo twice / nested / with another choice,
the numerical guards, and the libraries around a model (TRL, PEFT, accelerate, the HF Trainer's
weight-decay rule, pickle and deepcopy)."""

import copy
import io
import logging
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations.patch import apply_tempo, revert_tempo, tempo_patched  # noqa: E402
from tempo.integrations.recipe import is_replacement  # noqa: E402
from tempo.memory import ActivationLedger  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)


def _bert(cls_name="BertForMaskedLM", config_name="BertConfig", **overrides):
    config = getattr(transformers, config_name)(**{**SMALL, "attn_implementation": "eager", **overrides})
    return getattr(transformers, cls_name)(config)


def bert(**o):
    return _bert(**o)


def roberta(**o):
    return _bert("RobertaForMaskedLM", "RobertaConfig", **o)


def electra(**o):
    return _bert("ElectraForMaskedLM", "ElectraConfig", embedding_size=16, **o)


def distilbert(**o):
    o = {{"hidden_dropout_prob": "dropout", "attention_probs_dropout_prob": "attention_dropout"}.get(k, k): v
         for k, v in o.items()}
    return transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        **{**dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=100, attn_implementation="eager"), **o}))


def gpt2(**o):
    o = {{"hidden_dropout_prob": "resid_pdrop", "attention_probs_dropout_prob": "attn_pdrop"}.get(k, k): v
         for k, v in o.items()}
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**dict(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager"), **o}))


def modernbert(**o):
    o = {{"hidden_dropout_prob": "mlp_dropout", "attention_probs_dropout_prob": "attention_dropout"}.get(k, k): v
         for k, v in o.items()}
    o.pop("mlp_dropout", None)  # ModernBERT's MLP dropout stays 0, as in its checkpoints
    return transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, vocab_size=100,
        global_attn_every_n_layers=2, local_attention=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, embedding_dropout=0.1, attention_dropout=0.1,
        attn_implementation="eager"), **o}))


def deberta(**o):
    return transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**{**SMALL, **dict(
        relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=-1,
        norm_rel_ebd="layer_norm", share_att_key=True), **o}))


def _decoder(cls_name, config_name, **extra):
    """The RMSNorm + SwiGLU/GeGLU families (tiny configs): no hidden dropout, an attention dropout."""
    def build(**o):
        o = {{"attention_probs_dropout_prob": "attention_dropout"}.get(k, k): v for k, v in o.items()
             if k != "hidden_dropout_prob"}
        return getattr(transformers, cls_name)(getattr(transformers, config_name)(**{**SMALL, **dict(
            num_key_value_heads=1, max_position_embeddings=64, attn_implementation="eager"), **extra, **o}))
    return build


llama = _decoder("LlamaForCausalLM", "LlamaConfig")
qwen3 = _decoder("Qwen3ForCausalLM", "Qwen3Config", head_dim=16)
gemma3 = _decoder("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=16, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"])

FAMILIES = {"bert": bert, "roberta": roberta, "electra": electra, "distilbert": distilbert, "gpt2": gpt2,
            "modernbert": modernbert, "deberta": deberta, "llama": llama, "qwen3": qwen3, "gemma3": gemma3}
BASE = {"bert": "bert", "roberta": "roberta", "electra": "electra", "distilbert": "distilbert",
        "gpt2": "transformer", "modernbert": "model", "deberta": "deberta", "llama": "model", "qwen3": "model",
        "gemma3": "model"}
CHOICES = {"default": {}, "paper": dict(attention="tempo", dropout_add_layernorm=False),
           "no-attention": dict(attention=False), "gelu-only": dict(layernorm=False, attention=False,
                                                                    dropout_add_layernorm=False)}


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def loss_and_grads(model, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # the same dropout stream for every model (matters where dropout is on)
    loss = model(**batch(seed)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def total_relative_l2(a, b):
    assert a.keys() == b.keys()
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def structure(model):
    return [(name, id(module), type(module)) for name, module in model.named_modules(remove_duplicate=False)]


def stock_and_patched(family, attention_dropout=None, **choice):
    torch.manual_seed(0)
    stock = FAMILIES[family](**({} if attention_dropout is None else {"attention_probs_dropout_prob": attention_dropout}))
    patched = copy.deepcopy(stock)
    apply_tempo(patched, **choice)
    return stock.train(), patched.train()


# ---------------------------------------------------------------------------------------------
# 1. Dropout switched off through the nn.Dropout modules
# ---------------------------------------------------------------------------------------------
def disable_by_hand(model):
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def disable_with_trl(model):
    from trl.trainer.utils import disable_dropout_in_model

    disable_dropout_in_model(model)


@pytest.mark.parametrize("idiom", [disable_with_trl, disable_by_hand], ids=["trl", "hand"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dropout_switched_off_through_its_modules_is_off(family, idiom):
    # ModernBERT's attention dropout is a float attribute (config.attention_dropout), not an
    # nn.Dropout: the idiom leaves it on in the stock model too; here it is 0 for both.
    stock, patched = stock_and_patched(family, attention_dropout=0.0 if family == "modernbert" else None)
    assert tempo_patched(patched) != {"attention": 0}
    idiom(stock)
    idiom(patched)
    loss_s, grads_s = loss_and_grads(stock)
    loss_t, grads_t = loss_and_grads(patched)
    torch.testing.assert_close(loss_t, loss_s, rtol=1e-5, atol=1e-6)
    assert total_relative_l2(grads_t, grads_s) < 1e-5


def test_dropout_switched_back_on_drops_again():
    stock, patched = stock_and_patched("bert")
    disable_by_hand(patched)
    off = loss_and_grads(patched)[0]
    for module in patched.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.1
    on = loss_and_grads(patched)[0]
    assert not torch.equal(on, off)
    fused = patched.bert.encoder.layer[0].output
    assert fused.LayerNorm.dropout is fused.dropout and fused.LayerNorm.p == 0.1


@pytest.mark.parametrize("family", ["bert", "gpt2", "deberta"])
def test_dropout_off_before_patching_and_on_after_reaches_the_tempo_layers(family):
    """Dropout switched off through the modules before apply_tempo (p = 0 held by the fused
    layers), then on again after it: the Tempo layers drop at the rate set later, as the stock
    model's modules do (they hold the modules, not a copy of the rate)."""
    torch.manual_seed(0)
    stock = FAMILIES[family]()
    disable_by_hand(stock)
    patched = apply_tempo(copy.deepcopy(stock))
    for model in (stock, patched):
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.2
    fused = [m for m in patched.modules() if is_replacement(m) and isinstance(getattr(m, "dropout", None), nn.Dropout)]
    assert (len(fused) > 0) == (family != "gpt2") and all(m.dropout.p == 0.2 for m in fused)  # GPT-2: no fused block
    off = copy.deepcopy(patched)
    disable_by_hand(off)
    assert not torch.equal(loss_and_grads(patched)[0], loss_and_grads(off)[0])
    if family == "bert":  # the fused layer holds the block's own module: one switch, one object
        block = patched.bert.encoder.layer[0].output
        assert block.LayerNorm.dropout is block.dropout


def test_modernbert_mlp_dropout_switched_on_after_the_swap_reaches_the_gated_mlp():
    """ModernBERT's MLP dropout (0 in its configs) switched on through its nn.Dropout after the
    swap: the gated MLP drops out inside its op (a seeded mask, replayed by the same RNG state);
    switched off again, the stock numbers, gradients included."""
    stock, patched = stock_and_patched("modernbert", attention_dropout=0.0)
    for model in (stock, patched):
        disable_by_hand(model)
    loss_s, grads_s = loss_and_grads(stock)
    for layer in patched.model.layers:
        layer.mlp.drop.p = 0.3
    loss_on = loss_and_grads(patched)[0]
    assert not torch.equal(loss_on, loss_s)  # the switch reached the fused op
    assert torch.equal(loss_and_grads(patched)[0], loss_on)  # the same RNG state, the same mask
    disable_by_hand(patched)
    loss_t, grads_t = loss_and_grads(patched)
    torch.testing.assert_close(loss_t, loss_s, rtol=1e-5, atol=1e-6)
    assert total_relative_l2(grads_t, grads_s) < 1e-5


# ---------------------------------------------------------------------------------------------
# 2. Models built from one config
# ---------------------------------------------------------------------------------------------
def kept_bytes(model):
    with ActivationLedger(model) as ledger:
        loss_and_grads(model)
    return ledger.activation_bytes


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patching_one_model_leaves_another_built_from_its_config_alone(family):
    torch.manual_seed(0)
    stock = FAMILIES[family](attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    cfg = stock.config
    implementation = cfg._attn_implementation
    twin = type(stock)(cfg)
    twin.load_state_dict(stock.state_dict())
    before = kept_bytes(stock)
    apply_tempo(twin)
    assert stock.config is cfg and cfg._attn_implementation == implementation
    assert all(m.config is cfg for m in stock.modules() if "config" in m.__dict__)
    assert kept_bytes(stock) == before
    if family != "deberta":  # DeBERTa's attention is a module swap; no config changes
        assert twin.config is not cfg and twin.config._attn_implementation == "tempo_efficient"
    # Inside the patched model the configs are still one object where they were one.
    assert len({id(m.config) for m in twin.modules() if "config" in m.__dict__}) == \
        len({id(m.config) for m in stock.modules() if "config" in m.__dict__})
    revert_tempo(twin)
    assert twin.config is cfg and all(m.config is cfg for m in twin.modules() if "config" in m.__dict__)


# ---------------------------------------------------------------------------------------------
# 3. The model's own _init_weights
# ---------------------------------------------------------------------------------------------
def randomize(model):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 3 + 1)


@pytest.mark.parametrize("how", ["apply", "initialize_weights"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_reinitialised_by_its_own_init_weights_as_the_stock_model(family, how):
    stock, patched = stock_and_patched(family)
    randomize(stock)
    patched.load_state_dict(stock.state_dict())
    randomized = {k: v.clone() for k, v in stock.state_dict().items()}
    for model in (stock, patched):
        torch.manual_seed(3)
        if how == "apply":
            model.apply(model._init_weights)
        else:  # transformers' own walk, after clearing its "already initialised" flags
            for obj in (*model.modules(), *model.parameters(), *model.buffers()):
                obj.__dict__.pop("_is_hf_initialized", None)
            model.initialize_weights()
    want, got = stock.state_dict(), patched.state_dict()
    assert want.keys() == got.keys()
    changed = [k for k in want if not torch.equal(got[k], want[k])]
    assert not changed, changed
    # And they really were re-initialised (not left as randomized).
    assert sum(not torch.equal(want[k], randomized[k]) for k in want) > len(want) // 2


def test_modernbert_mlp_is_initialised_as_modernbert_mlp():
    stock, patched = stock_and_patched("modernbert")
    mlp = patched.model.layers[0].mlp
    assert type(mlp).__name__ == "GatedMLP" and isinstance(mlp, transformers.models.modernbert.modeling_modernbert.ModernBertMLP)
    torch.manual_seed(0)
    patched.apply(patched._init_weights)
    std = patched.config.initializer_range / (2 * patched.config.num_hidden_layers) ** 0.5
    assert float(mlp.Wo.weight.detach().std()) == pytest.approx(std, rel=0.15)  # not the generic 0.02


# ---------------------------------------------------------------------------------------------
# 4. Idempotent, nested, another choice, revert
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_apply_twice_nested_and_revert(family, choice):
    torch.manual_seed(0)
    stock = FAMILIES[family]()
    original = structure(stock)
    direct = copy.deepcopy(stock)
    configs = {"direct": direct.config}
    apply_tempo(direct, **CHOICES[choice])
    patched_once = structure(direct)
    apply_tempo(direct, **CHOICES[choice])  # the same choice again: nothing changes
    assert structure(direct) == patched_once

    nested = copy.deepcopy(stock)
    configs["nested"] = nested.config
    base = getattr(nested, BASE[family])
    apply_tempo(base, **CHOICES[choice])
    apply_tempo(nested, **CHOICES[choice])  # the head model after its base: the rest, same rules
    assert [(n, t) for n, _, t in structure(nested)] == [(n, t) for n, _, t in structure(direct)]
    assert tempo_patched(nested) == tempo_patched(direct)
    assert nested.config is base.config
    ids = batch()
    nested.eval(), direct.eval()
    with torch.no_grad():
        torch.testing.assert_close(nested(**ids).logits, direct(**ids).logits)

    for name, model in (("direct", direct), ("nested", nested)):
        revert_tempo(model)
        assert [(n, t) for n, _, t in structure(model)] == [(n, t) for n, _, t in original]
        assert all(m.config is configs[name] for m in model.modules() if "config" in m.__dict__)
    apply_tempo(direct, **CHOICES[choice])  # and it patches again after a revert
    assert structure(direct) != structure(stock)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_in_a_mode_every_module_is_in_that_mode(family, choice, mode):
    """from_pretrained returns a model in eval mode: patched so, it must not start dropping (every
    module Tempo builds, its new parts included, takes the mode of the module it replaces), and one
    patched in train mode must drop as the stock model does."""
    torch.manual_seed(0)
    stock = FAMILIES[family](attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.3)
    stock.train(mode == "train")
    patched = copy.deepcopy(stock)
    apply_tempo(patched, **CHOICES[choice])
    wrong = [name for name, m in patched.named_modules() if m.training != (mode == "train")]
    assert not wrong, f"patched in {mode} mode, these modules are not: {wrong}"
    if mode == "eval":
        with torch.no_grad():
            torch.testing.assert_close(patched(**batch()).logits, stock(**batch()).logits, rtol=1e-4, atol=1e-4)


def test_a_module_shared_by_two_parents_stays_one_module_through_patch_and_revert(caplog):
    """One LayerNorm (and one GELU) registered under two parents (weights shared between blocks):
    one replacement held by both after apply_tempo, the one original held by both after revert."""
    norm, act = nn.LayerNorm(8), nn.GELU()
    model = nn.ModuleDict({"a": nn.Sequential(nn.Linear(8, 8), norm, act), "b": nn.Sequential(nn.Linear(8, 8), norm, act)})
    apply_tempo(model)
    assert model["a"][1] is model["b"][1] and model["a"][1] is not norm
    assert model["a"][2] is model["b"][2] and model["a"][2] is not act
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        revert_tempo(model)
    assert "revert_tempo: restored 1 LayerNorm" in caplog.messages  # one module, restored once
    assert model["a"][1] is norm and model["b"][1] is norm
    assert model["a"][2] is act and model["b"][2] is act


@pytest.mark.parametrize("family", list(FAMILIES))
def test_another_choice_on_a_patched_model_is_refused_with_nothing_changed(family):
    stock, patched = stock_and_patched(family)
    before = structure(patched)
    with pytest.raises(ValueError, match=r"already patched with apply_tempo\(model, gelu=True, layernorm=True, "
                                         r"attention='efficient'.*revert_tempo\(model\) first"):
        apply_tempo(patched, attention="tempo", dropout_add_layernorm=False)
    assert structure(patched) == before


def test_deberta_tempo_attention_twice_and_on_a_head_whose_base_is_patched():
    stock = deberta()
    model = copy.deepcopy(stock)
    apply_tempo(model, attention="tempo")
    apply_tempo(model, attention="tempo")  # raised ImportError before (issue 26.4)
    nested = copy.deepcopy(stock)
    apply_tempo(nested.deberta, attention="tempo")
    apply_tempo(nested, attention="tempo")
    assert tempo_patched(nested) == tempo_patched(model)


def test_modernbert_second_apply_leaves_the_geglu_activation_alone():
    _, patched = stock_and_patched("modernbert")
    acts = [type(m.mlp.act) for m in patched.model.layers]
    apply_tempo(patched)
    nested = copy.deepcopy(patched)
    apply_tempo(nested.model)
    assert [type(m.mlp.act) for m in patched.model.layers] == acts == [type(m.mlp.act) for m in nested.model.layers]
    assert all(t.__name__ == "GELUActivation" for t in acts)


# ---------------------------------------------------------------------------------------------
# 5. Bad arguments: one clear line, nothing changed
# ---------------------------------------------------------------------------------------------
def test_non_module_arguments_and_bad_options():
    with pytest.raises(TypeError, match=r"apply_tempo: argument 'model' must be a torch.nn.Module .*got str "
                                        r"'bert-base-uncased'.*from_pretrained\('bert-base-uncased'\)"):
        apply_tempo("bert-base-uncased")
    with pytest.raises(TypeError, match="revert_tempo: argument 'model'"):
        revert_tempo({"not": "a model"})
    model = bert()
    before = structure(model)
    with pytest.raises(TypeError, match="argument 'gelu' must be True or False, got 'yes'"):
        apply_tempo(model, gelu="yes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'attn'"):
        apply_tempo(model, attn="tempo")
    with pytest.raises(ValueError, match="argument 'attention' must be"):
        apply_tempo(model, attention="flash")
    assert structure(model) == before and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_failure_while_applying_leaves_the_model_and_its_config_as_they_were(family, monkeypatch):
    """apply_tempo is all or nothing: the last step failing (a model-level hook, after the swaps and
    the attention switch) puts back every module, the original config objects and their attention."""
    import dataclasses

    import tempo.integrations.patch as patch_module

    def failing_hook(model):
        raise RuntimeError("hook failed")

    every_recipe = patch_module.recipes
    monkeypatch.setattr(patch_module, "recipes",
                        lambda: [dataclasses.replace(r, model_hook=failing_hook) for r in every_recipe()])
    model = FAMILIES[family]()
    configs, before = {id(m): m.config for m in model.modules() if "config" in m.__dict__}, structure(model)
    with pytest.raises(RuntimeError, match="hook failed"):
        apply_tempo(model)
    assert structure(model) == before
    assert all(m.config is configs[id(m)] for m in model.modules() if "config" in m.__dict__)
    assert all(c._attn_implementation == "eager" for c in configs.values())
    assert not any(tempo_patched(model).values())


# ---------------------------------------------------------------------------------------------
# 6. Every numerical guard refuses a module with the right structure and a different forward
# ---------------------------------------------------------------------------------------------
def _override(module, forward):
    module.forward = forward  # an instance-level forward: same class and structure, other numbers
    return module


def _guard_cases():
    def residual():
        model = bert()
        block = model.bert.encoder.layer[0].output
        _override(block, lambda h, r: block.LayerNorm(block.dense(h) - r))
        return model, block, "dropout-add-LayerNorm"

    def geglu():
        model = modernbert()
        mlp = model.model.layers[0].mlp
        _override(mlp, lambda x: mlp.Wo(mlp.act(mlp.Wi(x).chunk(2, -1)[1]) * 2.0))
        return model, mlp, "gated MLP"

    def deberta_core():
        model = deberta()
        core = model.deberta.encoder.layer[0].attention.self
        cls = type(core)
        _override(core, lambda *a, **k: (cls.forward(core, *a, **k)[0] * 1.5, None))
        return model, core, "DeBERTa attention core"

    def layernorm():
        model = bert()
        ln = model.bert.embeddings.LayerNorm
        _override(ln, lambda x: nn.functional.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, 1e-2))
        return model, ln, "LayerNorm"

    return {"residual": residual, "geglu": geglu, "deberta": deberta_core, "layernorm": layernorm}


@pytest.mark.parametrize("case", list(_guard_cases()))
def test_a_module_computing_something_else_is_left_alone_and_logged(case, caplog):
    model, module, kind = _guard_cases()[case]()
    attention = "tempo" if case == "deberta" else None
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(model, attention=attention)
    assert any(m is module for m in model.modules()), f"{kind} was replaced although it computes something else"
    assert any(f"left 1 {kind} module alone" in m for m in caplog.messages), caplog.messages


# ---------------------------------------------------------------------------------------------
# 7. The libraries around a model
# ---------------------------------------------------------------------------------------------
def test_peft_lora_on_a_patched_bert_trains_merges_and_matches_stock_plus_lora():
    import peft  # the test extra installs it: a missing PEFT fails this test
    torch.manual_seed(0)
    stock = bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    patched = apply_tempo(copy.deepcopy(stock))
    models = []
    for model in (stock, patched):
        torch.manual_seed(5)  # LoRA's A matrices: the same draw for both
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0)
        models.append(peft.get_peft_model(model, config))
    losses = []
    for model in models:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        trace = []
        for step in range(3):
            optimizer.zero_grad()
            loss = model(**batch(step)).loss
            loss.backward()
            optimizer.step()
            trace.append(float(loss))
        losses.append(trace)
    assert losses[1][-1] < losses[1][0]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    grads = [loss_and_grads(m)[1] for m in models]
    lora = [k for k in grads[0] if "lora_" in k]
    assert lora and total_relative_l2({k: grads[1][k] for k in lora}, {k: grads[0][k] for k in lora}) < 1e-5
    merged = [m.merge_and_unload().eval() for m in models]
    assert tempo_patched(merged[1])["FusedResidualOutput"] == 4
    with torch.no_grad():
        torch.testing.assert_close(merged[1](**batch()).logits, merged[0](**batch()).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accelerate_prepare_wraps_a_patched_model_like_the_stock_one(precision):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    stock, patched = stock_and_patched("bert")
    for m in (stock, patched):
        disable_by_hand(m)
    outs = []
    AcceleratorState._reset_state(True)  # an earlier test's Trainer may have set another precision
    try:
        for model in (stock, patched):
            accelerator = Accelerator(mixed_precision=precision, cpu=True)
            prepared = accelerator.prepare(model)
            loss = prepared(**batch()).loss
            accelerator.backward(loss)
            outs.append((float(loss), {n: p.grad.float() for n, p in model.named_parameters()}))
            AcceleratorState._reset_state(True)
    finally:
        AcceleratorState._reset_state(True)
    assert outs[1][0] == pytest.approx(outs[0][0], rel=2e-2)
    assert total_relative_l2(outs[1][1], outs[0][1]) < 5e-2  # 16-bit autocast both ways


@pytest.mark.parametrize("family", ["gpt2", "bert", "modernbert"])
def test_hf_trainer_weight_decay_rule_sees_the_same_layernorms(family, tmp_path):
    stock, patched = stock_and_patched(family)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    names = [transformers.Trainer(model=m, args=args).get_decay_parameter_names(m) for m in (stock, patched)]
    assert names[1] == names[0]


@pytest.mark.parametrize("family", ["bert", "modernbert", "deberta"])
def test_pickle_and_deepcopy_keep_the_replacements(family):
    stock, patched = stock_and_patched(family, attention="tempo" if family == "deberta" else None)
    patched.eval()
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for clone in (loaded, copy.deepcopy(patched)):
        assert [(n, type(m)) for n, m in clone.named_modules()] == [(n, type(m)) for n, m in patched.named_modules()]
        with torch.no_grad():
            torch.testing.assert_close(clone(**batch()).logits, patched(**batch()).logits)
        revert_tempo(clone)
        assert [(n, type(m)) for n, m in clone.named_modules()] == [(n, type(m)) for n, m in stock.named_modules()]


# ---------------------------------------------------------------------------------------------
# The project's own BERT: every Tempo choice honours the idiom too
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["paper", "default"])
@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
def test_our_bert_dropout_switched_off_through_its_modules(choice, unpad):
    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertForPreTraining
    from tempo.choices import TempoChoice

    config = BertConfig.from_name("bert_tiny")
    config.vocab_size = 128
    torch.manual_seed(0)
    stock = BertForPreTraining(config, TempoChoice.none("eager"), unpad=unpad).train()
    tempo = BertForPreTraining(config, getattr(TempoChoice, choice)(), unpad=unpad).train()
    tempo.load_state_dict(stock.state_dict())
    for model in (stock, tempo):
        disable_with_trl(model)
    ids = batch()
    inputs = dict(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                  masked_lm_labels=ids["labels"], next_sentence_labels=torch.tensor([0, 1, 0]))
    grads = []
    for model in (stock, tempo):
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert total_relative_l2(grads[1], grads[0]) < 1e-5
