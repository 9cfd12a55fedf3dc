"""SeededDropout (tempo/ops/dropout.py) and the nn.Dropout modules apply_tempo switches to it
(tempo/integrations/dropouts.py): dropout keeping an 8-byte seed instead of its mask, the mask drawn
again in backward, bit for bit the forward's."""

import copy
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tempo import apply_tempo, revert_tempo
from tempo.integrations.dropouts import seed_dropouts
from tempo.integrations.recipe import restore_classes, switch_class
from tempo.memory import ActivationLedger
from tempo.ops.dropout import SeededDropout, seeded_dropout, seeded_dropout_keep_mask, seeded_dropout_op

from test_movement import _check_against_interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_backward_apply_the_one_mask_the_seed_draws(backend, dtype):
    """y = x · keep / (1 − p) and dx = dy · keep / (1 − p) with the keep mask the seed draws on the
    path that ran, each rounded once to the dtype; the dropped fraction is p."""
    p, shape = 0.3, (3, 50, 40)  # 6,000 elements: an odd number of Triton blocks
    x = (torch.randn(shape) * 5).to(dtype).requires_grad_()
    seed = torch.tensor(1234)
    y = seeded_dropout(x, p, True, seed=seed)
    keep = seeded_dropout_keep_mask(seed, shape, p, "cpu", backend)
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    assert y.dtype == dtype and y.shape == shape
    # Bitwise, except 16-bit outputs of Triton's interpreter, whose casts round toward zero (a GPU's
    # round to nearest even): within one unit in the last place there.
    ulp = torch.finfo(dtype).eps if backend == "triton" and dtype != torch.float32 else 0.0
    assert torch.equal(y != 0, keep)
    torch.testing.assert_close(y, torch.where(keep, x.detach().float() * scale, 0.0).to(dtype), rtol=ulp, atol=0)
    dy = torch.randn(shape).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx != 0, keep)
    torch.testing.assert_close(dx, torch.where(keep, dy.float() * scale, 0.0).to(dtype), rtol=ulp, atol=0)
    dropped = 1 - keep.float().mean().item()
    assert abs(dropped - p) < 4 * (p * (1 - p) / keep.numel()) ** 0.5  # four standard deviations


def test_it_keeps_a_seed_not_a_mask():
    """A stock nn.Dropout keeps its mask (on the CPU a float of the input's dtype per element); the
    switched module keeps one 0-d int64 seed: 8 bytes."""
    x = torch.randn(4, 9, 32, requires_grad=True)
    kept = {}
    for cls in (nn.Dropout, SeededDropout):
        module = cls(0.1)
        with ActivationLedger(module) as ledger:
            module(x * 1.0).sum().backward()
        kept[cls] = ledger.activation_bytes
    assert kept[nn.Dropout] == x.numel() * 4
    assert kept[SeededDropout] == 8


def test_a_no_grad_pass_and_its_replay_with_grad_draw_one_mask():
    module = SeededDropout(0.4)
    x = torch.randn(6, 16)
    state = torch.get_rng_state()
    with torch.no_grad():
        first = module(x)
    torch.set_rng_state(state)
    second = module(x.clone().requires_grad_())
    assert second.grad_fn is not None and torch.equal(first, second.detach())
    assert not torch.equal(first, x)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_recompute_draws_the_forward_mask(use_reentrant):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), SeededDropout(0.3), nn.Linear(16, 16))
    grads = []
    for checkpointed in (False, True):
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        block.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        out = (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant) if checkpointed
               else block(x))
        out.square().sum().backward()
        grads.append([out.detach(), x.grad, *(p.grad for p in block.parameters())])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_eval_p_zero_in_place_and_integers_are_f_dropout(caplog):
    x = torch.randn(3, 8)
    module = SeededDropout(0.5).eval()
    assert module(x) is x or torch.equal(module(x), x)
    module.train()
    module.p = 0.0
    assert torch.equal(module(x), x)
    module.p = 1.0  # every element dropped: F.dropout's zeros, logged once
    with caplog.at_level(logging.WARNING, logger="tempo"):
        assert torch.equal(module(x), torch.zeros_like(x))
    assert "drops every element" in caplog.text
    inplace = SeededDropout(0.5, inplace=True)
    y = x.clone()
    torch.manual_seed(3)
    out = inplace(y)
    torch.manual_seed(3)
    assert out is y and torch.equal(out, F.dropout(x, 0.5, True))  # the stock in-place op, its own mask


def test_bad_arguments_name_what_is_wrong():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="'p' must be in"):
        seeded_dropout(x, 1.0)
    with pytest.raises(TypeError, match="'x' must be a floating-point tensor"):
        seeded_dropout(torch.ones(4, dtype=torch.int64), 0.1)
    with pytest.raises(TypeError, match="'seed' must be a one-element integer tensor"):
        seeded_dropout(x, 0.1, seed=torch.tensor([1.5]))
    with pytest.raises(ValueError, match="'backend' must be 'triton' or 'reference'"):
        seeded_dropout_keep_mask(torch.tensor(1), (4,), 0.1, "cpu", "auto")
    with pytest.raises(ValueError, match="'backend' must be 'triton' or 'reference'"):
        seeded_dropout_op(x, torch.tensor(1), 0.1, "cuda")


def test_opcheck_and_compile_without_a_graph_break(backend):
    x = torch.randn(5, 24, requires_grad=True)
    torch.library.opcheck(seeded_dropout_op, (x, torch.tensor(5), 0.2, backend))
    module = SeededDropout(0.2)
    lin = nn.Linear(24, 24)

    def step(m):
        return lin(m(x)).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(lambda: step(module), fullgraph=True, backend="aot_eager")
    torch.manual_seed(11)
    loss = compiled()
    grads = torch.autograd.grad(loss, [x, lin.weight])
    torch.manual_seed(11)
    loss_eager = step(module)
    assert torch.equal(loss, loss_eager)
    for a, b in zip(grads, torch.autograd.grad(loss_eager, [x, lin.weight])):
        assert torch.equal(a, b)


def test_kernel_matches_its_movement_declaration():
    from tempo.ops._backend import use_backend

    x = torch.randn(3, 7, 41, dtype=torch.bfloat16, requires_grad=True)  # odd size: a partial block
    with use_backend("triton"):
        _check_against_interpreter(lambda: SeededDropout(0.1)(x).backward(torch.randn(3, 7, 41, dtype=torch.bfloat16)))


# ---------------------------------------------------------------------------------------------
# apply_tempo: which modules are switched, the bytes that saves, revert and copies
# ---------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, vocab_size=100,
             hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
# family: (model class, config class, what one layer's inline dropouts are)
INLINE = {
    "mpnet": ("MPNetModel", "MPNetConfig", ["attention.dropout"]),
    "gte": ("GteModel", "GteConfig", ["post_attention_dropout", "post_mlp_dropout"]),
    "jina_v3": ("JinaEmbeddingsV3Model", "JinaEmbeddingsV3Config", ["post_attention_dropout", "post_mlp_dropout"]),
}


def _family(name, layers=2, **overrides):
    cls_name, config_name, _ = INLINE[name]
    cls, config = getattr(transformers, cls_name, None), getattr(transformers, config_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}: {name} is not in this version")
    torch.manual_seed(0)
    return cls(config(**{**SMALL, "num_hidden_layers": layers, **overrides})).train()


def _layers(model):
    return model.encoder.layer if hasattr(model, "encoder") else model.layers


def _kept_bytes(model, ids):
    with ActivationLedger(model) as ledger:
        model(input_ids=ids).last_hidden_state.square().sum().backward()
    return ledger.activation_bytes


@pytest.mark.parametrize("name", list(INLINE))
def test_inline_residual_dropouts_are_switched_and_keep_no_mask(name):
    """Each layer's inline residual dropouts become SeededDropout; with them switched one more layer
    keeps exactly their masks less (fp32 on the CPU: 4 bytes per element) and 8 bytes per seed more
    than the same patch with those modules given back their nn.Dropout class."""
    ids = torch.randint(5, 100, (2, 12))
    added = {}
    for switched in (False, True):
        kept = []
        for layers in (1, 2):
            model = apply_tempo(_family(name, layers))
            for inline in INLINE[name][2]:
                assert type(_layers(model)[0].get_submodule(inline)) is SeededDropout
            if not switched:
                restore_classes([(m, nn.Dropout) for m in model.modules() if type(m) is SeededDropout])
            kept.append(_kept_bytes(model, ids))
        added[switched] = kept[1] - kept[0]
    masks = len(INLINE[name][2])
    assert added[False] - added[True] == masks * (ids.numel() * SMALL["hidden_size"] * 4 - 8)


def test_switch_follows_the_option_revert_and_copies():
    model = _family("gte")
    apply_tempo(model, dropout_add_layernorm=False)
    assert not any(type(m) is SeededDropout for m in model.modules())
    revert_tempo(model)
    apply_tempo(model)
    switched = [m for m in model.modules() if type(m) is SeededDropout]
    assert switched and all(isinstance(m, nn.Dropout) for m in switched)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert sum(type(m) is SeededDropout for m in twin.modules()) == len(switched)
    twin = copy.deepcopy(model)
    revert_tempo(model)
    assert not any(type(m) is SeededDropout for m in model.modules())
    assert all(type(m) is nn.Dropout for m in switched)
    assert any(type(m) is SeededDropout for m in twin.modules())  # the copy keeps its own


def test_disable_dropout_idiom_reaches_the_switched_modules():
    """TRL's disable_dropout_in_model sets p = 0 on every nn.Dropout: the patched model then equals
    the stock model's eval output in training mode."""
    # The attention's rate is a float its module copies from the config, not an nn.Dropout.
    model = apply_tempo(_family("jina_v3", attention_probs_dropout_prob=0.0))
    ids = torch.randint(5, 100, (2, 12))
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    train_out = model(input_ids=ids).last_hidden_state
    assert torch.equal(train_out, model.eval()(input_ids=ids).last_hidden_state)


def test_only_plain_not_in_place_dropouts_are_switched():
    class OtherDropout(nn.Dropout):
        pass

    model = nn.Sequential(nn.Dropout(0.1), nn.Dropout(0.1, inplace=True), OtherDropout(0.1), nn.Dropout1d(0.1))
    switched = seed_dropouts(model)
    assert switched == [(model[0], nn.Dropout)] and type(model[0]) is SeededDropout
    assert [type(m) for m in model[1:]] == [nn.Dropout, OtherDropout, nn.Dropout1d]
    restore_classes(switched)
    assert type(model[0]) is nn.Dropout
    with pytest.raises(TypeError, match="not a direct subclass of OtherDropout"):  # the guard: no state added
        switch_class(model[2], SeededDropout)
    assert type(model[2]) is OtherDropout
