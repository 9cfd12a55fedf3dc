"""A 16-bit model gets the same swaps as an fp32 one (issue 35.1).

The recipes' numerical check compares the formula in fp32 (on the module's own parameters, cast for
the check only) and the module's own dtype against the rounding that dtype allows (the stock
module's own error as the yardstick): a replacement is dropped only when it computes something else,
never for bf16/fp16 rounding. Before, a BERT loaded in bf16 kept every stock residual block and in
fp16 every stock LayerNorm, logged as "transformers' forward differs".
"""

import copy
import logging

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from test_stock_parity import FAMILIES, _guard_cases, _override, batch, bert  # noqa: E402

from tempo.integrations.patch import apply_tempo, tempo_patched  # noqa: E402
from tempo.integrations.recipe import CheckResult, same_output, sample  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _swaps(family, dtype, **choice):
    torch.manual_seed(0)
    model = FAMILIES[family]().to(dtype)
    apply_tempo(model, **choice)
    return tempo_patched(model)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_16_bit_model_gets_every_swap_an_fp32_model_gets(family, dtype):
    fp32 = _swaps(family, torch.float32)
    assert sum(v for k, v in fp32.items() if k != "attention") > 0
    assert _swaps(family, dtype) == fp32


@pytest.mark.parametrize("family", ["bert", "deberta", "modernbert", "gpt2"])
def test_the_paper_choice_on_16_bit_models_as_on_fp32(family):
    choice = dict(attention="tempo", dropout_add_layernorm=False)
    fp32 = _swaps(family, torch.float32, **choice)
    for dtype in DTYPES[1:]:
        assert _swaps(family, dtype, **choice) == fp32, dtype


def test_efficient_attention_named_on_a_bf16_deberta_patches_it():
    """Before: the check refused bf16 rounding, and attention='efficient' raised an ImportError
    saying DeBERTa could not be patched."""
    model = FAMILIES["deberta"]().to(torch.bfloat16)
    apply_tempo(model, attention="efficient")
    assert tempo_patched(model).get("DebertaEfficientAttention") == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("family", ["bert", "deberta", "modernbert"])
def test_a_patched_16_bit_model_trains_as_the_stock_one_within_its_rounding(family, dtype):
    """Loss and gradients of the patched model in ``dtype`` are as close to the fp32 stock model's
    as the stock model in ``dtype`` is (dropout off): the swap costs no more than rounding."""
    torch.manual_seed(0)
    off = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    fp32 = FAMILIES[family](**off, **({"embedding_dropout": 0.0} if family == "modernbert" else {})).train()
    stock = copy.deepcopy(fp32).to(dtype)
    patched = apply_tempo(copy.deepcopy(fp32).to(dtype))
    results = {}
    for name, model in (("fp32", fp32), ("stock", stock), ("patched", patched)):
        model.zero_grad(set_to_none=True)
        loss = model(**batch()).loss
        loss.backward()
        grads = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
        results[name] = (float(loss.detach()), grads)
    want_loss, want = results["fp32"]
    for name in ("stock", "patched"):
        assert torch.isfinite(results[name][1]).all(), name
    stock_error = float((results["stock"][1] - want).norm() / want.norm())
    patched_error = float((results["patched"][1] - want).norm() / want.norm())
    floor = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert patched_error <= max(2.0 * stock_error, floor), (patched_error, stock_error)
    assert abs(results["patched"][0] - want_loss) <= max(2.0 * abs(results["stock"][0] - want_loss),
                                                         floor * abs(want_loss))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", list(_guard_cases()))
def test_a_module_computing_something_else_is_refused_in_every_dtype_with_its_numbers(case, dtype, caplog):
    """The guard still refuses a different forward in 16 bits, and the log line names the module,
    the measured difference and the tolerance."""
    model, module, kind = _guard_cases()[case]()
    model.to(dtype)
    attention = "tempo" if case == "deberta" else None
    with caplog.at_level(logging.INFO, logger="tempo.integrations.patch"):
        apply_tempo(model, attention=attention)
    assert any(m is module for m in model.modules()), f"{kind} was replaced although it computes something else"
    qualified = next(n for n, m in model.named_modules() if m is module)
    line = next((m for m in caplog.messages if f"left {qualified} ({type(module).__name__}) alone" in m), None)
    assert line is not None, caplog.messages
    assert "differs by" in line and "allows" in line, line


def test_a_16_bit_replacement_off_by_more_than_rounding_is_refused():
    """The second comparison: the formula agrees in fp32, but the 16-bit forward is off by more than
    the dtype's rounding allows (here: an output rounded through fp8-like coarseness)."""
    ln = nn.LayerNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)

    class Coarse(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x)
            if y.dtype == torch.bfloat16:  # only the 16-bit forward is wrong
                y = (y.float() * 8).round() / 8
            return y.to(x.dtype)

    x = sample((4, 7, 64), ln.weight)
    result = same_output(ln, Coarse(ln), x)
    assert isinstance(result, CheckResult) and not result
    assert "relative L2 error" in result.reason and "bfloat16" in result.reason
    assert same_output(ln, ln, x)  # the module against itself passes in bf16


def test_a_replacement_returning_another_dtype_is_refused():
    ln = nn.LayerNorm(16).to(torch.float16)

    class Upcast(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x).float()

    result = same_output(ln, Upcast(ln), sample((2, 3, 16), ln.weight))
    assert not result and "returns torch.float32" in result.reason


def test_a_forward_that_raises_is_refused_with_the_error():
    ln = nn.LayerNorm(16)
    broken = _override(copy.deepcopy(ln), lambda x: x.view(-1, 5))
    result = same_output(ln, broken, sample((2, 3, 16), ln.weight))
    assert not result and "failed to run" in result.reason and "RuntimeError" in result.reason


def test_the_check_leaves_parameters_and_train_flags_as_they_were():
    model = bert().to(torch.bfloat16).train()
    before = {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    apply_tempo(model)
    assert all(m.training for m in model.modules())
    for n, p in model.named_parameters():
        assert p.dtype == before[n][0] and torch.equal(p.detach(), before[n][1]), n


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("where", ["one element", "every element"])
def test_a_replacement_whose_output_is_not_finite_is_refused(dtype, where):
    """A NaN compares false with every tolerance: a difference check alone would pass a replacement
    that returns NaN (or inf) where the original is finite. The check refuses it in every dtype."""
    ln = nn.LayerNorm(32).to(dtype)

    class NotFinite(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x).clone()
            if where == "one element":
                y.view(-1)[3] = float("nan")
            else:
                y.fill_(float("inf"))
            return y

    result = same_output(ln, NotFinite(ln), sample((2, 5, 32), ln.weight))
    assert isinstance(result, CheckResult) and not result, result


def test_a_replacement_wrong_in_one_element_is_refused():
    """The check takes the worst element, not an average: one output element off by 100x the
    formula's tolerance (1e-5 + 1e-5·|y|), or by 0.5, is refused although every other element agrees
    exactly (an average of the excess over the 1,152 elements would be negative for the first)."""
    ln = nn.LayerNorm(32)

    class OneOff(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x).clone()
            y.view(-1)[7] += self.off
            return y

    x = sample((4, 9, 32), ln.weight)
    for off in (2e-3, 0.5):
        wrong = OneOff(ln)
        wrong.off = off
        result = same_output(ln, wrong, x)
        assert isinstance(result, CheckResult) and not result, (off, result)
