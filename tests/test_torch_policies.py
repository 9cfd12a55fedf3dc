"""tempo.plan.torch_policies: what torch's own policies keep, counted on fake tensors, held to real runs.

The counts run on fake tensors; here each is held, byte for byte, to a real CPU run of a tiny BERT
(``semantics="cpu"``: the CPU's code paths on both sides): compiled policies to the saved tensors of a real
``torch.compile`` (aot_eager; Inductor in the slow test), checkpointed ones to torch's own MemTracker.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
import transformers

from tempo.bench import torch_policies as command
from tempo.memory import ActivationLedger
from tempo.plan import torch_policies as tp
from tempo.presets import FAMILIES, FAMILY_DEPTH, family_config

TINY = "tiny-bert"  # h = 64, 4 heads (head dim 16: sdpa's flash kernel takes it), I = 128, 2 layers
WIDE = "tiny-bert-wide-activations"  # activations far above parameters: the budget knob acts
MODERN = "tiny-modernbert"  # a global attention every third layer, the others a sliding window
S, B = 16, 2


@pytest.fixture(autouse=True)
def tiny_families(monkeypatch):
    monkeypatch.setitem(FAMILIES, TINY, ("tiny BERT", "BertConfig", dict(
        hidden_size=64, num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)))
    monkeypatch.setitem(FAMILY_DEPTH, TINY, (2, 100))
    monkeypatch.setitem(FAMILIES, WIDE, ("tiny BERT, long sequences", "BertConfig", dict(
        hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=256)))
    monkeypatch.setitem(FAMILY_DEPTH, WIDE, (2, 50))
    monkeypatch.setitem(FAMILIES, MODERN, ("tiny ModernBERT", "ModernBertConfig", dict(
        hidden_size=64, num_attention_heads=4, intermediate_size=96, global_attn_every_n_layers=3, local_attention=8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, max_position_embeddings=64)))
    monkeypatch.setitem(FAMILY_DEPTH, MODERN, (9, 100))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _real_model(family: str, layers: int, checkpoint_kind=None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.BertModel(family_config(family, layers, attention="sdpa"), add_pooling_layer=False).train()
    if checkpoint_kind is not None:
        tp.checkpoint_blocks(model, checkpoint_kind)
    return model


def _real_compiled_saved_bytes(family: str, seq_len: int, batch: int, budget: float, backend: str = "aot_eager") -> int:
    """A real training step of torch.compile(model): the bytes its compiled forward saves for backward."""
    model = _real_model(family, 2)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    ids = tp._ids(family, batch, seq_len)
    with torch._functorch.config.patch(activation_memory_budget=budget):
        with ActivationLedger(tp._with_inputs(model, ids)) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(input_ids=ids).last_hidden_state
        out.sum().backward()  # the step trains: the saved tensors are the ones backward used
    assert all(p.grad is not None for p in model.encoder.parameters())
    torch._dynamo.reset()
    return ledger.activation_bytes


def test_compile_count_equals_a_real_aot_eager_compile():
    step, partitions = tp.compiled_step(TINY, 2, B, S, tp.POLICIES["compile+sdpa"], semantics="cpu",
                                        pipeline="aot_eager")
    real = _real_compiled_saved_bytes(TINY, S, B, 1.0)
    assert step.kept == step.graph_saved == partitions[0].saved_bytes == real
    assert real > 0


def test_budget_count_equals_a_real_budgeted_compile():
    seq_len, batch = 128, 4
    policy = tp.POLICIES["compile-budget-0.5"]
    step, partitions = tp.compiled_step(WIDE, 2, batch, seq_len, policy, semantics="cpu", pipeline="aot_eager",
                                        budgets=(0.5, 1.0))
    real = _real_compiled_saved_bytes(WIDE, seq_len, batch, 0.5)
    assert step.kept == partitions[0].saved_bytes == real
    assert partitions[0].saved_bytes < partitions[1].saved_bytes  # the knob acted: the test tests something
    assert sum(partitions[0].recomputed.values()) > sum(partitions[1].recomputed.values())


@pytest.mark.slow
def test_inductor_pipeline_count_equals_a_real_inductor_compile():
    """The counts' pipeline (Inductor's decompositions, joint-graph passes and partitioner, no code
    generation) against a real Inductor compile on the CPU (C++ code generation: minutes)."""
    seq_len, batch = 128, 4
    for budget in (1.0, 0.5):
        step, _ = tp.compiled_step(WIDE, 2, batch, seq_len, tp.Policy("x", "", compiled=True, budget=budget),
                                   semantics="cpu", pipeline="inductor")
        assert step.kept == _real_compiled_saved_bytes(WIDE, seq_len, batch, budget, backend="inductor"), budget


@pytest.mark.parametrize("kind", [None, "full", "matmuls", "every-second-matmul"])
def test_checkpointed_counts_equal_what_a_real_run_holds(kind):
    """Live bytes after forward on fake tensors == torch's MemTracker on a real run (activations it
    tracked, still alive when forward ends: the inputs a checkpoint holds, a selective cache)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    fake = tp.eager_step(TINY, 2, B, S, tp.Policy("x", "", checkpoint=kind), semantics="cpu")
    model = _real_model(TINY, 2, kind)
    ids = tp._ids(TINY, B, S)
    seed = torch.randn(B, S, 64)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids).last_hidden_state
        loss = (out * seed).sum()
        del out
        gc.collect()
        held = tracker.get_tracker_snapshot("current")[torch.device("cpu")][_MemRefType.ACT]
        loss.backward()
    assert fake.kept == held - loss.untyped_storage().nbytes()  # the count leaves the loss out
    assert fake.kept > 0
    if kind is None:  # nothing checkpointed: the ledger sees the same, on both sides
        with ActivationLedger(tp._with_inputs(model, ids)) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids)
        assert fake.ledger == ledger.activation_bytes == fake.kept


def test_full_checkpoint_keeps_the_block_inputs_only():
    full = tp.eager_step(TINY, 2, B, S, tp.POLICIES["full-checkpoint"], semantics="cpu")
    one = tp.eager_step(TINY, 1, B, S, tp.POLICIES["full-checkpoint"], semantics="cpu")
    assert full.kept - one.kept == B * S * 64 * 4  # one more block: its fp32 input (the LayerNorm output below)


def test_recompute_runs_under_the_forwards_cuda_semantics():
    """The autograd engine drops torch function modes, so without re-entering CudaSemantics a recomputed
    block would run sdpa's CPU math path: the recompute must run the fused kernel the forward ran."""
    step = tp.eager_step(TINY, 1, B, S, tp.POLICIES["full-checkpoint"])
    assert step.backward_ops["aten._scaled_dot_product_flash_attention"] == 1
    assert step.backward_ops["aten.native_dropout"] == 2  # the two hidden dropouts (the embeddings' is outside)
    assert "aten.bmm" not in step.backward_ops


def test_per_added_layer_fit_is_exact_at_another_depth_and_batch():
    count = tp.count_policy("sdpa", TINY, S)
    three = tp.eager_step(TINY, 3, 3, S, tp.POLICIES["sdpa"])
    assert count.kept_bytes(3, 3 * S) == pytest.approx(three.kept, abs=1e-6)
    assert count.scope == "per added layer" and count.counted


def test_a_stack_that_repeats_every_third_layer_is_counted_a_period_at_a_time():
    """ModernBERT: one global attention layer, then two sliding-window ones (each with its own
    batch-independent window mask): added layers are counted three at a time, exact at 3, 6, 9 layers."""
    assert tp.layer_period(MODERN) == 3 and tp.layer_period(TINY) == 1
    count = tp.count_policy("sdpa", MODERN, 32)
    nine = tp.eager_step(MODERN, 9, 3, 32, tp.POLICIES["sdpa"])
    assert count.kept_bytes(9, 3 * 32) == pytest.approx(nine.kept, abs=1e-6)
    assert count.fixed >= 0 and count.fixed_per_layer >= 0


def test_recompute_policies_in_miniature():
    """The ordering the issue's table shows, on the tiny BERT as a GPU runs it (fp32 LayerNorm outputs,
    bool dropout masks, fused attention)."""
    rows = {name: tp.count_policy(name, TINY, S) for name in (
        "eager", "sdpa", "sac-matmuls", "sac-every-second-matmul", "full-checkpoint", "tempo",
        "tempo+full-checkpoint", "tempo+sac-every-second-matmul")}
    kept = {name: row.kept_h for name, row in rows.items()}
    assert kept["full-checkpoint"] == pytest.approx(4.0)  # the fp32 block input
    assert kept["tempo+full-checkpoint"] == pytest.approx(2.0)  # Tempo's bf16 LayerNorm output
    assert kept["eager"] > kept["sdpa"] > kept["sac-matmuls"] > kept["tempo"] > kept["sac-every-second-matmul"]
    assert kept["tempo+sac-every-second-matmul"] < kept["tempo"]
    assert rows["eager"].backward_ratio == 1.0
    assert rows["full-checkpoint"].backward_ratio > rows["sac-every-second-matmul"].backward_ratio \
        > rows["sac-matmuls"].backward_ratio == rows["sdpa"].backward_ratio > 1.0  # sdpa: QKᵀ again in backward
    assert rows["sac-every-second-matmul"].recomputed["matmul"] == 3  # of 6 per BERT layer
    assert rows["sac-every-second-matmul"].forward_kinds["matmul"] == 6
    assert "matmul" not in rows["sac-matmuls"].recomputed
    assert rows["sac-matmuls"].recomputed == {"LayerNorm": 2, "GELU": 1, "dropout": 2}
    assert rows["full-checkpoint"].recomputed_text.startswith("the whole block")
    assert rows["full-checkpoint"].transient_per_token > rows["sdpa"].transient_per_token > 0


def test_tempo_compiles_and_keeps_what_it_keeps_uncompiled():
    eager = tp.eager_step(TINY, 1, B, S, tp.POLICIES["tempo"])
    compiled, partitions = tp.compiled_step(TINY, 1, B, S, tp.POLICIES["tempo+compile"])
    assert compiled.kept == compiled.graph_saved and eager.ledger == eager.kept
    # torch 2.13's partitioner saves exactly what Tempo's ops keep; 2.11's (the GPU image) saves 16
    # bytes more (one more two-element int64 tensor beside them): a scalar, not an activation.
    assert 0 <= compiled.kept - eager.kept <= 16
    assert tp._kinds(partitions[0].recomputed) == {}


@pytest.mark.slow
def test_compiled_policies_in_miniature():
    rows = {name: tp.count_policy(name, TINY, S) for name in ("sdpa", "compile+sdpa", "tempo", "tempo+compile")}
    assert rows["compile+sdpa"].kept_h < rows["sdpa"].kept_h
    assert rows["tempo+compile"].counted and rows["tempo+compile"].kept_h == pytest.approx(rows["tempo"].kept_h)
    assert "dropout masks saved (bool)" in rows["compile+sdpa"].recomputed_text
    assert rows["compile+sdpa"].recomputed == {"GELU": 1}
    assert rows["compile+sdpa"].transient_per_token is None  # not counted for compiled policies
    assert rows["compile+sdpa"].backward_ratio == pytest.approx(rows["sdpa"].backward_ratio)


def test_whole_model_budget_rows_share_one_trace():
    rows = tp.count_whole_model_budgets(False, WIDE, 128, (0.5, 1.0), tokens=512)
    half, full = rows
    assert (half.policy, full.policy) == ("compile-budget-0.5", "compile+sdpa (whole model)")
    assert half.scope == full.scope == "whole model" and half.tokens == 512 and half.layers == 2
    assert half.per_token_per_layer < full.per_token_per_layer
    # torch 2.13 recomputes a matmul at budget 0.5 here; 2.11 only element-wise ops (no FLOPs counted)
    assert half.backward_ratio >= full.backward_ratio >= 1.0
    assert half.kept_bytes(2, 512) == pytest.approx(half.per_token_per_layer * 512 * 2)
    with pytest.raises(ValueError, match="whole model at 2 layers and 512 tokens only"):
        half.kept_bytes(3, 512)


@pytest.mark.slow
def test_budgeted_compile_redraws_dropout_masks_as_its_row_says():
    """The row's words against a real Inductor run: at budget 0.5 the partitioner runs Inductor's seed
    draw again in backward, so with dropout on the gradients differ from the unbudgeted compile's (the
    forward outputs agree), and with dropout off they agree."""
    row = tp.count_whole_model_budgets(False, WIDE, 128, (0.5,), tokens=512, semantics="cpu")[0]
    assert "fresh seeds" in row.recomputed_text

    def step(budget, dropout):
        config = family_config(WIDE, 2, attention="sdpa")
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = dropout
        torch.manual_seed(0)
        model = transformers.BertModel(config, add_pooling_layer=False).train()
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=budget):
            torch.manual_seed(1)
            out = torch.compile(model, fullgraph=True, dynamic=False)(input_ids=tp._ids(WIDE, 4, 128)).last_hidden_state
            out.pow(2).sum().backward()
        return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    for dropout, exact in ((0.0, True), (0.1, False)):
        (out_full, grad_full), (out_half, grad_half) = step(1.0, dropout), step(0.5, dropout)
        assert torch.equal(out_full, out_half)
        relative = ((grad_half - grad_full).abs().max() / grad_full.abs().max()).item()
        assert (relative < 1e-6) == exact, (dropout, relative)


def test_a_lever_that_fails_on_tempos_model_is_a_not_counted_row(monkeypatch, caplog):
    def fails(*args, **kwargs):
        raise RuntimeError("aten.diagonal.default encountered during backward but not found in storage")

    monkeypatch.setattr(tp, "_eager_family_fit", functools.partial(_fail_for, fails, tp._eager_family_fit))
    row = tp.count_policy("tempo+sac-every-second-matmul", TINY, S)
    assert not row.counted and row.kept_h is None
    assert row.note.startswith("not yet counted: torch.utils.checkpoint (every-second-matmul) fails on apply_tempo's")
    assert "aten.diagonal.default" in row.note and "not yet counted" in caplog.text
    with pytest.raises(ValueError, match="is not counted"):
        row.kept_bytes(2, S)
    with pytest.raises(RuntimeError, match="aten.diagonal"):  # a stock policy's failure is an error
        tp.count_policy("sac-every-second-matmul", TINY, S)

    def untraceable(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("Skip calling `torch.compiler.disable()`d function")

    monkeypatch.setattr(tp, "compiled_step", untraceable)
    row = tp.count_policy("tempo+compile", TINY, S)
    assert not row.counted and "torch.compile fails on apply_tempo's model (Unsupported" in row.note
    assert all(not r.counted for r in tp.count_whole_model_budgets(True, TINY, S, (0.5, 1.0), tokens=32))
    with pytest.raises(torch._dynamo.exc.Unsupported):
        tp.count_policy("compile+sdpa", TINY, S)


def _fail_for(failure, original, policy_name, *args):
    """``original`` except for checkpointed policies, which fail with ``failure``."""
    if tp.POLICIES[policy_name].checkpoint:
        failure()
    return original(policy_name, *args)


# -- guards -----------------------------------------------------------------------------------------
def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        tp.count_policy("nope", TINY, S)
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        tp.count_policy("eager", "nope", S)
    with pytest.raises(ValueError, match="seq_len 65 is out of range for tiny-bert: 1 to 64"):
        tp.count_policy("eager", TINY, 65)
    with pytest.raises(ValueError, match=r"tokens \(100\) must be a multiple of seq_len \(16\)"):
        tp.count_whole_model_budgets(False, TINY, 16, (0.5,), tokens=100)
    with pytest.raises(ValueError, match="unknown semantics 'gpu'"):
        tp.eager_step(TINY, 1, 1, S, tp.POLICIES["eager"], semantics="gpu")
    with pytest.raises(ValueError, match="unknown pipeline 'jit'"):
        tp.PartitionCapture("jit")
    with pytest.raises(ValueError, match="budgets: name at least one"):
        tp.PartitionCapture("inductor", ())
    with pytest.raises(ValueError, match="unknown checkpoint kind 'half'"):
        tp.checkpoint_blocks(_real_model(TINY, 1), "half")
    with pytest.raises(ValueError, match="has no list of encoder blocks"):
        tp.encoder_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="is compiled: use compiled_step"):
        tp.eager_step(TINY, 1, 1, S, tp.POLICIES["compile+sdpa"])
    with pytest.raises(ValueError, match="is not compiled: use eager_step"):
        tp.compiled_step(TINY, 1, 1, S, tp.POLICIES["sdpa"])


def test_a_missing_private_torch_api_is_a_clear_error(monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    tp._compile_api.cache_clear()
    monkeypatch.delattr(compile_fx, "partition_fn")
    try:
        with pytest.raises(tp.CompileUnavailable, match=r"lacks torch._inductor.compile_fx.partition_fn"):
            tp.PartitionCapture("inductor")
    finally:
        tp._compile_api.cache_clear()


def test_a_graph_break_is_an_error_not_a_partial_count(monkeypatch):
    original = transformers.models.bert.modeling_bert.BertIntermediate.forward

    def breaking(self, hidden_states):
        torch._dynamo.graph_break()
        return original(self, hidden_states)

    monkeypatch.setattr(transformers.models.bert.modeling_bert.BertIntermediate, "forward", breaking)
    with pytest.raises(Exception, match="graph_break|Graph break|graph break"):
        tp.compiled_step(TINY, 1, 1, S, tp.POLICIES["compile+sdpa"])


def test_command_prints_the_table(capsys):
    assert command.main(["--model", TINY, "--seq-len", str(S), "--tokens", "32", "--policies", "eager",
                    "compile-budget-0.5", "full-checkpoint"]) == 0
    out, err = capsys.readouterr()
    assert "| policy | bytes kept |" in out
    for name in ("eager", "compile-budget-0.5", "compile+sdpa (whole model)", "full-checkpoint"):
        assert f"| {name} |" in out
    assert "[3/3]" in err and "done" in err


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt-5"], "--model: unknown family 'gpt-5'"),
    (["--policies", "eager", "magic"], "--policies: unknown policy 'magic'"),
    (["--model", TINY, "--seq-len", "65"], "--seq-len: seq_len 65 is out of range"),
    (["--model", TINY, "--seq-len", "16", "--tokens", "20"], "--tokens 20 is not a multiple of --seq-len 16"),
    (["--seq-len", "0"], "must be a positive integer, got 0"),
])
def test_command_refuses_bad_input(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        command.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
