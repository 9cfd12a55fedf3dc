"""torch.compile of patched models (issue 35.3): a training forward traces as one graph (no graph
break inside a Transformer layer), a few aot_eager training steps with changing batch sizes give
the eager gradients without recompiling, and one inductor step runs for BERT.

The break that was everywhere: Tempo's LayerNorm forward ops returned the x̂ of K kept columns,
K decided inside the op from γ/β (a data-dependent shape). Now the plan is an input of the ops,
held by each module and kept current outside the graph (optimizer steps, load_state_dict, .to(),
apply_tempo, eager forwards); the op checks it against the current γ/β when it runs. The tests
below hold that contract: a plan changed behind a compiled model's back raises naming the layer,
and the refresh points make the compiled gradient that of the stock model.
"""

from __future__ import annotations

import collections
import copy
import os

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

import tempo  # noqa: E402
from tempo.integrations.patch import apply_tempo  # noqa: E402
from tempo.ops.layernorm import LayerNormParameters  # noqa: E402

from test_stock_parity import FAMILIES  # noqa: E402  (the tiny configs of every family)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMPILED_FAMILIES = ["bert", "roberta", "distilbert", "gpt2", "modernbert", "deberta", "llama", "qwen3", "gemma3"]
# Where a patched family still breaks its graph, by file (the stock model breaks there too, or the
# code is not Tempo's). None now: GPT-2's loss (transformers' loss_function, stock too) broke until
# apply_tempo fused the causal LMs' head and loss (tempo.integrations.lm_loss). Before, the packing
# detection of tempo/integrations/hf_attention.py broke every layer of the families whose layers
# get position_ids (GPT-2 15 breaks, Llama 15, Qwen3 15, Gemma3 19 with the default patch): now the
# packing is read once per model call by the call hooks, outside the graph, and the layers read none.
KNOWN_BREAKS: dict[str, set[str]] = {}
# The Tempo ops a 2-layer patched model's training forward must hold in its graph(s): a frame
# dynamo skipped would leave them out without counting a break.
TEMPO_OPS = {
    "bert": {"layernorm_fwd": 2, "dropout_add_layernorm_fwd": 4, "efficient_attention_fwd": 2},
    "roberta": {"layernorm_fwd": 2, "dropout_add_layernorm_fwd": 4, "efficient_attention_fwd": 2},
    "distilbert": {"layernorm_fwd": 6, "efficient_attention_fwd": 2},
    "gpt2": {"layernorm_fwd": 5, "efficient_attention_fwd": 2, "linear_cross_entropy_fwd": 1},
    "modernbert": {"layernorm_fwd": 6, "efficient_attention_fwd": 2},
    "deberta": {"layernorm_fwd": 3, "dropout_add_layernorm_fwd": 4},
    "llama": {"linear_cross_entropy_fwd": 1, "rmsnorm_fwd": 5, "gated_linear_fwd": 2, "efficient_attention_fwd": 2},
    "qwen3": {"linear_cross_entropy_fwd": 1, "rmsnorm_fwd": 9, "gated_linear_fwd": 2, "efficient_attention_fwd": 2},
    "gemma3": {"linear_cross_entropy_fwd": 1, "rmsnorm_fwd": 13, "gated_linear_fwd": 2, "efficient_attention_fwd": 2},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def patched(family: str, dropout: bool = True) -> tuple[nn.Module, nn.Module]:
    """(stock, patched) of ``family``'s tiny config, in training mode; dropout off when asked (for a
    comparison with the stock model, whose masks are drawn differently)."""
    torch.manual_seed(0)
    off = {} if dropout else dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    stock = FAMILIES[family](**off).train()
    return stock, apply_tempo(copy.deepcopy(stock)).train()


def batch(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (rows, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def loss_and_grads(model: nn.Module, run, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # the same dropout stream for the eager and the compiled run
    loss = run(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Each gradient within ``rtol`` of its largest entry (floored at 1e-6 of the largest entry of
    all: a gradient that is 0 in exact arithmetic, as a key bias's, holds rounding noise only)."""
    assert got.keys() == want.keys()
    floor = 1e-6 * max(float(g.abs().max()) for g in want.values())
    for name in want:
        scale = max(float(want[name].abs().max()), floor)
        err = float((got[name] - want[name]).abs().max())
        assert err <= rtol * scale, f"{name}: max |Δ| {err:.3g} against max |grad| {scale:.3g}"


def layernorms(model: nn.Module) -> list[LayerNormParameters]:
    return [m for m in model.modules() if isinstance(m, LayerNormParameters)]


def _break_site(user_stack) -> str:
    """The file of the innermost frame of a break that is not torch's own (dynamo's polyfills of a
    comparison, in torch 2.11)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    for frame in reversed(user_stack or []):
        if not frame.filename.startswith(torch_dir):
            return os.path.basename(frame.filename)
    return "?"


# ---------------------------------------------------------------------------------------------
# No graph break in a training forward; aot_eager steps with changing batch sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", COMPILED_FAMILIES)
def test_a_training_forward_traces_without_a_graph_break(family):
    """torch._dynamo.explain of a patched training forward (dropout on, loss included): no graph
    break, and every Tempo op of the model inside the graph (a frame dynamo skipped would drop them
    without counting a break). GPT-2 still breaks once, outside its layers: in its loss (the file of
    KNOWN_BREAKS; this fails once that is fixed, to be updated). No break passes through Tempo's
    attention functions."""
    _stock, model = patched(family)
    explained = torch._dynamo.explain(lambda **b: model(**b).loss)(**batch(3))
    ops = collections.Counter(str(op).split(".")[1] for graph in explained.ops_per_graph for op in graph
                              if str(op).startswith("tempo."))
    assert {op: ops[op] for op in TEMPO_OPS[family]} == TEMPO_OPS[family], ops
    sites = {_break_site(r.user_stack) for r in explained.break_reasons}
    ops_dir = os.path.join("tempo", "ops") + os.sep
    from_ops = [str(r.reason).splitlines()[0] for r in explained.break_reasons
                if any(ops_dir in frame.filename for frame in r.user_stack)]
    assert from_ops == []
    through_attention = [str(r.reason).splitlines()[0] for r in explained.break_reasons
                         if any(frame.filename.endswith("hf_attention.py") for frame in r.user_stack)]
    assert through_attention == []
    if family in KNOWN_BREAKS:
        assert sites == KNOWN_BREAKS[family] and explained.graph_break_count == len(KNOWN_BREAKS[family])
    else:
        reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
        assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "gpt2", "modernbert", "llama", "qwen3",
                                    "gemma3"])
def test_aot_eager_training_steps_with_changing_batch_sizes_give_the_eager_gradients(family):
    """Three batch sizes, the batch dimension marked dynamic: no recompilation (recompile limit 1,
    failing when hit), one graph, and the eager model's loss and gradients, dropout included
    (aot_eager draws the same random numbers in the same order). GPT-2 (see KNOWN_BREAKS): the
    frames its breaks leave (transformers' shared wrappers) are compiled per caller, so there the
    limit is torch's default (8), still failing when hit."""
    _stock, model = patched(family)
    compiled = torch.compile(model, backend="aot_eager")
    limit = torch._dynamo.config.recompile_limit if family in KNOWN_BREAKS else 1
    with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        for step, rows in enumerate((3, 5, 2)):
            inputs = batch(rows, seed=step)
            for t in inputs.values():
                torch._dynamo.maybe_mark_dynamic(t, 0)
            loss_e, grads_e = loss_and_grads(model, model, inputs)
            loss_c, grads_c = loss_and_grads(model, compiled, inputs)
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
            assert_same_gradients(grads_c, grads_e)
    if family not in KNOWN_BREAKS:
        assert counters["stats"]["unique_graphs"] == 1


def packed_row(lengths: list[int], seed: int, start: int = 0) -> dict[str, torch.Tensor]:
    """One row of sequences packed back to back, position_ids restarting (DataCollatorWithFlattening's
    form), with the row as its own labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) + start for n in lengths])[None]
    return dict(input_ids=ids, position_ids=positions, labels=ids.clone())


PACKED_ROWS = [[5, 3, 4], [7, 2, 2, 4], [6, 6, 1], [3, 9, 2], [2, 2, 2, 2, 5], [4, 11]]


@pytest.mark.parametrize("family", ["bert", "roberta", "gpt2", "llama", "qwen3", "gemma3"])
def test_padding_free_batches_compile_without_a_break_in_the_layers_and_give_the_eager_gradients(family):
    """Padding-free rows (position_ids restarting) of changing lengths and sequence counts under
    aot_eager: the eager model's loss and every gradient at each step, the recompile limit (torch's
    default) never hit, and a traced forward whose only breaks are at the model call (the packing
    read, outside the layers) or GPT-2's loss: none passes through a layer. Dropout off: under
    torch.compile transformers 5.17's sdpa mask function builds an all-True mask where the eager
    call gets None (its skip is off while tracing), so compiled BERT runs the dense op with the
    packing in that mask and eager BERT the variable-length op: the same attention, other dropout
    streams (transformers 5.24 gives None in both)."""
    _stock, model = patched(family, dropout=False)
    start = model.config.pad_token_id + 1 if model.config.model_type == "roberta" else 0
    explained = torch._dynamo.explain(lambda **b: model(**b).loss)(**packed_row(PACKED_ROWS[0], 0, start))
    in_attention = [str(r.reason).splitlines()[0] for r in explained.break_reasons
                    if any(frame.filename.endswith("hf_attention.py") and frame.name != "_call_pre_hook"
                           for frame in r.user_stack)]
    assert in_attention == []
    assert {_break_site(r.user_stack) for r in explained.break_reasons} <= KNOWN_BREAKS.get(family, set()) | {
        "hf_attention.py"}  # the call hook's read, before the model's first op
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for step, lengths in enumerate(PACKED_ROWS):
            inputs = packed_row(lengths, step, start)
            loss_e, grads_e = loss_and_grads(model, model, inputs)
            loss_c, grads_c = loss_and_grads(model, compiled, inputs)
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
            assert_same_gradients(grads_c, grads_e)


def test_autocast_bf16_training_forward_traces_without_a_graph_break():
    """Under bf16 autocast the layers hand their op the plan of a bf16 output (held per dtype)."""
    _stock, model = patched("bert")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(lambda **b: model(**b).loss)(**batch(3))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.slow  # about a minute on 2 CPU cores (inductor compiles C++)
def test_inductor_training_step_gives_the_eager_gradients():
    """One inductor step of BERT (dropout off: inductor draws its own random numbers)."""
    stock, model = patched("bert", dropout=False)
    inputs = batch(3)
    loss_e, grads_e = loss_and_grads(model, model, inputs)
    loss_c, grads_c = loss_and_grads(model, torch.compile(model, backend="inductor"), inputs)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert_same_gradients(grads_c, grads_e, rtol=1e-4)  # inductor fuses, so it rounds differently
    assert counters["stats"]["unique_graphs"] == 1


def test_the_plans_are_no_buffers():
    """The held plans are plain attributes: named_buffers and the state dict stay the stock model's
    (buffers would be broadcast by DDP and saved)."""
    stock, model = patched("bert")
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in stock.named_buffers()]
    assert model.state_dict().keys() == stock.state_dict().keys()
    assert all(isinstance(ln.tempo_kept_columns, dict) for ln in layernorms(model))


# ---------------------------------------------------------------------------------------------
# The plan a compiled forward is handed: refreshed outside the graph, checked inside the op
# ---------------------------------------------------------------------------------------------
def _unrecoverable_column(ln: nn.Module, column: int, gamma: float = 1e-30) -> None:
    with torch.no_grad():
        ln.bias[column] = 0.5
        ln.weight[column] = gamma  # |γ| < |β|: x̂ of this column cannot come back from y


def _compiled_matches_stock(model: nn.Module, compiled, stock: nn.Module, inputs: dict) -> None:
    stock.load_state_dict(model.state_dict())
    loss_s, grads_s = loss_and_grads(stock, stock, inputs)
    loss_c, grads_c = loss_and_grads(model, compiled, inputs)
    torch.testing.assert_close(loss_c, loss_s, rtol=1e-5, atol=1e-6)
    assert_same_gradients(grads_c, grads_s, rtol=2e-5)


def test_a_plan_changed_behind_a_compiled_model_raises_naming_the_layer():
    """γ written under no_grad (no refresh point sees it) so that one more column is kept: the
    compiled forward refuses with a RuntimeError naming the layer and the fix; after
    tempo.refresh_kept_column_plans(model) it recompiles for the new K and the gradient is the
    stock model's."""
    stock, model = patched("bert", dropout=False)
    compiled = torch.compile(model, backend="aot_eager")
    inputs = batch(3)
    _compiled_matches_stock(model, compiled, stock, inputs)
    ln = model.bert.encoder.layer[1].output.LayerNorm
    _unrecoverable_column(ln, 7)
    with pytest.raises(RuntimeError, match=r"^bert\.encoder\.layer\.1\.output\.LayerNorm: .* plan of 0 column\(s\) "
                                           r"but γ/β now need 1 .*tempo\.refresh_kept_column_plans\(model\)"):
        compiled(**inputs)
    tempo.refresh_kept_column_plans(model)
    assert ln.tempo_kept_columns[torch.float32].tolist() == [7]
    _compiled_matches_stock(model, compiled, stock, inputs)


def test_an_optimizer_step_that_makes_a_column_unrecoverable_refreshes_the_plan():
    """AdamW(fused=True) (no version-counter bump) moves γ_5 of one LayerNorm to ~1e-8 against
    β_5 = 0.5: torch's optimizer post-step hook makes that layer's plan K = 1 before the next
    compiled forward (no error), and the compiled gradient is the stock model's."""
    stock, model = patched("bert", dropout=False)
    compiled = torch.compile(model, backend="aot_eager")
    inputs = batch(3)
    ln = model.bert.embeddings.LayerNorm
    with torch.no_grad():
        ln.bias[5] = 0.5
    tempo.refresh_kept_column_plans(model)
    _compiled_matches_stock(model, compiled, stock, inputs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.0, fused=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ln.weight.grad[5] = 1.0  # Adam's first step moves γ_5 by lr·g/(|g| + ε): to ~1e-8
    version = ln.weight._version
    optimizer.step()
    assert ln.weight._version == version and abs(float(ln.weight[5].detach())) < 1e-6  # the fused step bumps nothing
    assert ln.tempo_kept_columns[torch.float32].tolist() == [5]
    _compiled_matches_stock(model, compiled, stock, inputs)


def test_load_state_dict_refreshes_the_plan():
    """A state dict with an unrecoverable column, loaded into a compiled model: the next compiled
    forward uses its plan (no error) and gives the stock gradient."""
    stock, model = patched("bert", dropout=False)
    compiled = torch.compile(model, backend="aot_eager")
    inputs = batch(3)
    _compiled_matches_stock(model, compiled, stock, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["bert.encoder.layer.0.attention.output.LayerNorm.weight"][2] = 0.0
    state["bert.encoder.layer.0.attention.output.LayerNorm.bias"][2] = 0.25
    model.load_state_dict(state)
    assert model.bert.encoder.layer[0].attention.output.LayerNorm.tempo_kept_columns[torch.float32].tolist() == [2]
    _compiled_matches_stock(model, compiled, stock, inputs)


def test_to_another_dtype_refreshes_the_plan():
    """.to(float64) gives γ/β new storage: the held plans follow (fp64 output included), and the
    compiled fp64 gradient is the stock one."""
    stock, model = patched("bert", dropout=False)
    _unrecoverable_column(model.bert.embeddings.LayerNorm, 4)
    stock, model = stock.double(), model.double()
    assert model.bert.embeddings.LayerNorm.tempo_kept_columns[torch.float64].tolist() == [4]
    _compiled_matches_stock(model, torch.compile(model, backend="aot_eager"), stock, batch(3))


def test_a_non_finite_parameter_raises_in_a_compiled_forward_naming_the_layer():
    _stock, model = patched("bert", dropout=False)
    compiled = torch.compile(model, backend="aot_eager")
    inputs = batch(3)
    compiled(**inputs)
    with torch.no_grad():
        model.bert.encoder.layer[0].output.LayerNorm.weight[3] = float("nan")
    with pytest.raises(ValueError, match=r"^bert\.encoder\.layer\.0\.output\.LayerNorm: weight \(γ\) holds a "
                                         r"non-finite value \(nan\) at column 3"):
        compiled(**inputs)


def test_the_held_plan_is_the_one_of_the_output_dtype():
    """γ_2 = 1e-5 is recoverable for an fp32 output and not for fp16 (λ_D = 6.1e-5): a compiled
    forward under fp16 autocast is handed the fp16 plan (a plan of another dtype would fail the
    op's check), and its gradient is the eager one."""
    from tempo.inplace_layernorm import InplaceLayerNorm

    ln = InplaceLayerNorm(8)
    with torch.no_grad():
        ln.weight[2] = 1e-5
    tempo.refresh_kept_column_plans(ln)
    assert ln.tempo_kept_columns[torch.float32].tolist() == []
    assert ln.tempo_kept_columns[torch.float16].tolist() == [2]
    compiled = torch.compile(ln, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8)
    grad = torch.randn(4, 8).half()
    results = []
    for run in (ln, compiled):
        ln.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            y = run(xr)
        assert y.dtype == torch.float16
        y.backward(grad)
        results.append((xr.grad, ln.weight.grad.clone()))
    torch.testing.assert_close(results[1], results[0])


def test_the_functional_form_under_compile_plans_in_the_graph_and_says_so(caplog):
    """inplace_layernorm without a module has no held plan: under torch.compile it plans from γ/β in
    the graph (a data-dependent shape torch.compile may break on), logged once; the result is the
    eager one."""
    from tempo.ops.layernorm import inplace_layernorm

    weight = nn.Parameter(torch.ones(8))
    bias = nn.Parameter(torch.zeros(8))
    with torch.no_grad():
        weight[1], bias[1] = 1e-30, 0.5

    def f(x):
        return inplace_layernorm(x, (8,), weight, bias, name="functional")

    x = torch.randn(3, 8, requires_grad=True)
    with caplog.at_level("WARNING", logger="tempo"):
        y = torch.compile(f, backend="aot_eager")(x)
        torch.compile(f, backend="aot_eager")(x)
    torch.testing.assert_close(y, f(x))
    logged = [r for r in caplog.records if "functional: under torch.compile the kept-column plan" in r.message]
    assert len(logged) == 1


def test_a_compiled_step_reads_the_host_once_in_the_optimizer_step_only():
    """The CUDA path (Triton kernels, here through the interpreter): a compiled training forward
    and backward read nothing from the device; the optimizer step reads once (the post-step hook
    making the plans of every stepped LayerNorm), whatever the number of layers, and its new plans
    recompile nothing. Reads counted:
    Tensor.cpu/item/tolist called from Tempo's code (the optimizer's own .item() calls are torch's)."""
    import contextlib
    import sys

    from tempo.inplace_layernorm import InplaceLayerNorm
    from tempo.ops._backend import use_backend
    from tempo.ops.dropout_add_layernorm import DropoutAddLayerNorm

    from conftest import triton_runs_on

    if not triton_runs_on("cpu"):
        pytest.fail("the Triton path cannot run here (TRITON_INTERPRET=1 and triton are needed)")
    tempo_dir = os.path.dirname(tempo.__file__) + os.sep

    @contextlib.contextmanager
    def counting(reads):
        originals = {name: getattr(torch.Tensor, name) for name in ("cpu", "item", "tolist")}

        def wrapped(name):
            def call(self, *args, **kwargs):
                if sys._getframe(1).f_code.co_filename.startswith(tempo_dir):
                    reads.append(name)
                return originals[name](self, *args, **kwargs)
            return call

        for name in originals:
            setattr(torch.Tensor, name, wrapped(name))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm = nn.Linear(16, 16), InplaceLayerNorm(16)
            self.fused = DropoutAddLayerNorm(16, p=0.1)

        def forward(self, x):
            h = self.norm(x)
            return self.fused(self.linear(h), h)

    for layers in (1, 3):
        torch._dynamo.reset()
        model = nn.Sequential(*[Block() for _ in range(layers)]).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        x = torch.randn(4, 16)
        # The plans the steps make anew are new tensors of the same shape: no recompilation.
        with use_backend("triton"), torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            compiled(x).square().sum().backward()  # compiles
            optimizer.step()
            for _ in range(2):
                in_step, in_forward = [], []
                with counting(in_forward):
                    compiled(x).square().sum().backward()
                with counting(in_step):
                    optimizer.step()
                optimizer.zero_grad()
                assert in_forward == [] and in_step == ["cpu"], (layers, in_forward, in_step)


def test_refresh_names_a_bad_argument():
    with pytest.raises(TypeError, match=r"^refresh_kept_column_plans: argument 'model' must be an nn.Module, got dict"):
        tempo.refresh_kept_column_plans({})


def test_the_optimizer_hook_reads_nothing_while_a_cuda_graph_is_captured(monkeypatch):
    """No host read can happen inside a CUDA graph capture: the post-step hook leaves the held plans
    as they were there (simulated capture), and the next forward, outside the capture, makes them."""
    from tempo.inplace_layernorm import InplaceLayerNorm

    ln = InplaceLayerNorm(8)
    optimizer = torch.optim.SGD(ln.parameters(), lr=1.0)
    with torch.no_grad():
        ln.bias[6] = 0.5
    tempo.refresh_kept_column_plans(ln)
    ln.weight.grad = torch.zeros(8).index_fill_(0, torch.tensor([6]), 1.0)  # γ_6: 1 -> 0
    ln.bias.grad = torch.zeros(8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    optimizer.step()
    assert ln.tempo_kept_columns[torch.float32].tolist() == []  # untouched during the capture
    monkeypatch.undo()
    ln(torch.randn(3, 8, requires_grad=True))
    assert ln.tempo_kept_columns[torch.float32].tolist() == [6]
