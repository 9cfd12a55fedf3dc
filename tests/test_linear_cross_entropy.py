"""tempo.ops.linear_cross_entropy (the head and loss without logits) and the causal LMs apply_tempo
switches to it (tempo.integrations.lm_loss): exact against F.linear + F.cross_entropy and against the
stock models, every mode, every guard, nothing [tokens, vocab] kept, one graph under torch.compile."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tempo.ops.linear_cross_entropy import vocab_block, linear_cross_entropy

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo import apply_tempo, revert_tempo  # noqa: E402
from tempo.bert.hf_interop import minilm_dir  # noqa: E402
from tempo.integrations.lm_loss import FusedLossLM, fused_loss_reason  # noqa: E402

MODES = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "z-loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 2.5},
    "all": {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 4.0},
}


def reference(x, w, t, b=None, label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean",
              num_items_in_batch=None):
    """The materialised head and loss, as transformers computes them (logits upcast, then the loss)."""
    z = F.linear(x, w, b).float() if x.dtype != torch.float64 else F.linear(x, w, b)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    red = "sum" if num_items_in_batch is not None else reduction
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), t.reshape(-1), label_smoothing=label_smoothing, reduction=red)
    if z_loss:
        kept = t.reshape(-1) != -100
        extra = z_loss * torch.logsumexp(z.reshape(-1, z.shape[-1]), -1).square() * kept
        loss = loss + (extra.sum() / kept.sum() if red == "mean" else extra.sum() if red == "sum" else extra)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def case(n=37, h=16, v=50, dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(v, h, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::3] = -100
    return x, w, b, t


def grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none", "num_items"])
@pytest.mark.parametrize("block", [1, 7, None])
def test_fp64_equals_the_materialised_head_and_loss(mode, reduction, block):
    x, w, b, t = case()
    kw = dict(MODES[mode], **({"num_items_in_batch": torch.tensor(7.0)} if reduction == "num_items" else
                              {"reduction": reduction}))
    ours, ref = linear_cross_entropy(x, w, t, b, block=block, **kw), reference(x, w, t, b, **kw)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    seed = torch.randn(ref.shape, dtype=ref.dtype) if reduction == "none" else None
    for a, r in zip(torch.autograd.grad(ours, (x, w, b), seed), torch.autograd.grad(ref, (x, w, b), seed)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_triton_path_gives_the_reference_paths_values(mode, dtype):
    """The kernels (Triton's interpreter) against the reference path on the same GEMM outputs: rows
    longer than the kernels' 1024-column step (the online log-sum-exp over several steps), targets on
    the blocks' first and last columns, ignored rows, a bias; 16 bits under autocast. fp32 within
    2e-6 of the largest value (online log-sum-exp, exp-based tanh); 16 bits within one rounding of
    the 16-bit gradient (the interpreter truncates where CUDA rounds)."""
    from tempo.ops._backend import use_backend

    x, w, b, t = case(n=23, h=16, v=2600, dtype=torch.float32)
    t[1], t[2], t[4], t[5] = 0, 1299, 1300, 2599  # first / last columns of blocks of 1300
    results = {}
    for backend in ("reference", "triton"):
        with use_backend(backend), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = linear_cross_entropy(x, w, t, b, block=1300, reduction="none", **MODES[mode])
        results[backend] = [loss, *grads(loss.sum(), x, w, b)]
    tolerance = 2e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for ref, kernel in zip(results["reference"], results["triton"]):
        assert (kernel - ref).abs().max() <= tolerance * ref.abs().max()


def test_gradcheck_every_mode_at_once():
    x, w, b, t = case(n=11, h=4, v=9)
    assert torch.autograd.gradcheck(lambda x, w, b: linear_cross_entropy(
        x, w, t, b, block=3, label_smoothing=0.1, z_loss=0.01, softcap=2.0), (x, w, b))


def test_the_real_minilm_embedding_as_a_tied_head_in_fp32():
    """MiniLM's own [30522, 384] word embeddings (γ and β of its real LayerNorms shaped the
    hidden states it gives), tied: one Parameter used as embedding and head, one gradient."""
    weights = load_file(str(minilm_dir() / "model.safetensors"))
    emb = torch.nn.Parameter(weights["embeddings.word_embeddings.weight"].float())
    ids = torch.randint(0, emb.shape[0], (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100

    def loss_and_grad(fused):
        emb.grad = None
        x = F.layer_norm(F.embedding(ids, emb), (384,)) * 3.0  # a real embedding row scale, normalised
        loss = linear_cross_entropy(x, emb, labels) if fused else F.cross_entropy(
            F.linear(x, emb).flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.detach(), emb.grad.clone()

    (l0, g0), (l1, g1) = loss_and_grad(False), loss_and_grad(True)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=0)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-5 * g0.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_the_gemm_runs_in_the_autocast_dtype_as_stocks_linear(dtype):
    """One block (the whole vocabulary): the logits are the stock head's 16-bit ones, so the loss per
    row equals stock's to fp32 rounding, and differs from the fp32 head's by the 16-bit rounding; the
    gradients too (backward, outside the autocast region, recomputes the logits in 16 bits; no bias,
    whose 16-bit gradient stock sums in 16 bits)."""
    x, w, b, t = case(n=64, h=32, v=300, dtype=torch.float32, bias=False)
    fp32 = reference(x, w, t, b, reduction="none")
    with torch.autocast("cpu", dtype=dtype):
        stock = reference(x, w, t, b, reduction="none")
        ours = linear_cross_entropy(x, w, t, b, reduction="none")
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-6)
    assert (ours - fp32).abs().max() > 100 * (ours - stock).abs().max()
    for mine, theirs, exact in zip(grads(ours.sum(), x, w, b), grads(stock.sum(), x, w, b), grads(fp32.sum(), x, w, b)):
        assert (mine - theirs).abs().max() < 0.1 * (theirs - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_no_further_from_fp32_than_the_stock_head(dtype):
    x, w, b, t = case(n=64, h=32, v=300, dtype=torch.float32)
    exact = reference(x, w, t, b, softcap=3.0)
    exact_grads = grads(exact, x, w, b)
    with torch.autocast("cpu", dtype=dtype):
        stock = reference(x, w, t, b, softcap=3.0)
        ours = linear_cross_entropy(x, w, t, b, block=16, softcap=3.0)
    assert ours.dtype == torch.float32
    assert (ours - exact).abs() <= 1.5 * (stock - exact).abs() + 1e-6
    for a, s, e in zip(grads(ours, x, w, b), grads(stock, x, w, b), exact_grads):
        assert a.dtype == e.dtype and (a - e).abs().max() <= 1.5 * (s - e).abs().max() + 1e-6


def test_nothing_of_tokens_by_vocabulary_is_kept_for_backward():
    """Saved for backward: the inputs themselves, 4 bytes of log-sum-exp per row, the count of kept
    rows (8 bytes, on the CPU) and the mean's divisor (the count of rows not ignored, 8 bytes), exactly."""
    x, w, b, t = case(n=40, h=8, v=1000, dtype=torch.float32)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        linear_cross_entropy(x, w, t, b)
    inputs = {x.data_ptr(), w.data_ptr(), b.data_ptr(), t.data_ptr()}
    new = [s for s in saved if s.data_ptr() not in inputs]
    assert sum(s.numel() * s.element_size() for s in new) == 40 * 4 + 8 + 8


def test_ignored_rows_never_reach_the_gemm(monkeypatch):
    x, w, b, t = case(n=30, h=8, v=20, dtype=torch.float32)
    rows = []
    original = F.linear
    monkeypatch.setattr(F, "linear", lambda a, *r: rows.append(a.shape[0]) or original(a, *r))
    linear_cross_entropy(x, w, t, b, block=4).backward()
    # forward and backward's recompute, 5 blocks of 4 columns each, the labelled rows only
    assert rows == [int((t != -100).sum())] * 10


def test_every_row_ignored_gives_what_cross_entropy_gives():
    x, w, b, t = case(n=6, h=4, v=5, dtype=torch.float32)
    t[:] = -100
    assert torch.isnan(linear_cross_entropy(x, w, t, b)) and torch.isnan(reference(x, w, t, b))
    loss = linear_cross_entropy(x, w, t, b, reduction="sum")
    assert loss.item() == 0.0
    assert all(g.abs().sum() == 0 for g in grads(loss, x, w, b))


def test_a_vocabulary_divisible_by_nothing_and_no_bias():
    x, w, _b, t = case(n=13, h=7, v=9973, bias=False)
    torch.testing.assert_close(linear_cross_entropy(x, w, t, block=4), reference(x, w, t), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad, match", [(50, r"a target is 50, outside \[0, 50\)"), (-1, "a target is -1")])
def test_a_target_outside_the_vocabulary_is_refused_in_one_line(bad, match):
    x, w, b, t = case()
    t[4] = bad
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(x, w, t, b)


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(w=a["w"][:, :3]), "do not multiply"),
    (lambda a: a.update(b=a["b"][:4]), "bias has shape"),
    (lambda a: a.update(t=a["t"][:3]), "target must be integers"),
    (lambda a: a.update(t=a["t"].float()), "target must be integers"),
    (lambda a: a.update(reduction="avg"), "reduction='avg'"),
    (lambda a: a.update(label_smoothing=1.5), "label_smoothing=1.5"),
    (lambda a: a.update(softcap=0.0), "softcap=0.0 must be positive"),
    (lambda a: a.update(block=0), "block=0"),
    (lambda a: a.update(x=a["x"].long()), "x"),
])
def test_bad_arguments_are_refused_naming_them(change, match):
    x, w, b, t = case()
    args = {"x": x, "w": w, "b": b, "t": t}
    change(args)
    x, w, b, t = args.pop("x"), args.pop("w"), args.pop("b"), args.pop("t")
    with pytest.raises((ValueError, TypeError), match=match):
        linear_cross_entropy(x, w, t, b, **args)


def test_a_block_of_logits_is_four_times_the_hidden_width():
    assert (vocab_block(151936, 1024), vocab_block(100, 8), vocab_block(1000, 8)) == (4096, 100, 512)


def test_compiled_fullgraph_gives_the_eager_loss_and_gradients():
    x, w, b, t = case(dtype=torch.float32)
    fn = torch.compile(lambda x, w, b: linear_cross_entropy(x, w, t, b, label_smoothing=0.1), fullgraph=True,
                       backend="aot_eager")
    torch.testing.assert_close(fn(x, w, b), linear_cross_entropy(x, w, t, b, label_smoothing=0.1))
    for a, e in zip(grads(fn(x, w, b), x, w, b), grads(linear_cross_entropy(x, w, t, b, label_smoothing=0.1), x, w, b)):
        torch.testing.assert_close(a, e)


# ---------------------------------------------------------------------------------------------
# The causal LMs apply_tempo switches (tempo.integrations.lm_loss)
# ---------------------------------------------------------------------------------------------
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=97, head_dim=8)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, tie_word_embeddings=True)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SMALL, final_logit_softcapping=5.0)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=97, bos_token_id=0, eos_token_id=0)),
}


def pair(name):
    torch.manual_seed(0)
    stock = MODELS[name]().train()
    for m in stock.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return stock, apply_tempo(copy.deepcopy(stock)).train()


def step(model, *args, **kwargs):
    model.zero_grad()
    out = model(*args, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("call", ["labels", "num_items_in_batch", "shift_labels", "tuple"])
def test_a_causal_lm_step_equals_the_stock_one_without_logits(name, call):
    stock, tempo = pair(name)
    assert isinstance(tempo, FusedLossLM) and isinstance(tempo, type(stock))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :3] = -100
    kwargs = {"labels": labels}
    if call == "num_items_in_batch":
        kwargs["num_items_in_batch"] = torch.tensor(7)
    if call == "shift_labels":
        kwargs["shift_labels"] = labels.roll(1, 1)
    if call == "tuple":
        kwargs["return_dict"] = False
        (l0, logits0, *_), (l1, *rest) = stock(ids, **kwargs), tempo(ids, **kwargs)
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=0)
        assert logits0.shape == (2, 9, 97) and all(not isinstance(r, torch.Tensor) or r.dim() != 3 for r in rest)
        return
    (o0, g0), (o1, g1) = step(stock, ids, **kwargs), step(tempo, ids, **kwargs)
    torch.testing.assert_close(o1.loss, o0.loss, rtol=1e-5, atol=0)
    assert o1.logits is None and o0.logits.shape == (2, 9, 97) and g1.keys() == g0.keys()
    for key in g0:
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-5, atol=1e-5 * g0[key].abs().max().item())


@pytest.mark.parametrize("name", ["qwen3", "gpt2"])
def test_eval_no_grad_and_no_labels_return_the_stock_logits(name):
    stock, tempo = pair(name)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(tempo(ids).logits, stock(ids).logits)
    with torch.no_grad():
        torch.testing.assert_close(tempo(ids, labels=ids).logits, stock(ids, labels=ids).logits)
    stock.eval(), tempo.eval()
    out = tempo(ids, labels=ids)
    torch.testing.assert_close(out.logits, stock(ids, labels=ids).logits)
    assert out.loss is not None


def test_revert_pickle_and_deepcopy_of_a_switched_lm():
    stock, tempo = pair("llama")
    for other in (copy.deepcopy(tempo), pickle.loads(pickle.dumps(tempo))):
        assert type(other) is type(tempo)
    revert_tempo(tempo)
    assert type(tempo) is type(stock)


def test_a_subclass_of_a_switched_lm_still_runs_the_fused_head():
    """FSDP2's fully_shard gives each module its own subclass of its class (FSDP<name>): the switched
    forward finds the original class it stands for through it (tests/test_fsdp2.py runs fully_shard)."""
    from tempo.integrations.recipe import stands_for

    stock, tempo = pair("llama")
    tempo.__class__ = type("FSDP" + type(tempo).__name__, (type(tempo),), {})
    assert stands_for(type(tempo)) is type(stock)
    ids = torch.randint(0, 97, (2, 9))
    (o0, _), (o1, _) = step(stock, input_ids=ids, labels=ids), step(tempo, input_ids=ids, labels=ids)
    assert o1.logits is None
    torch.testing.assert_close(o1.loss, o0.loss, rtol=1e-5, atol=0)


def test_a_patched_lm_asked_for_another_lm_loss_choice_is_refused_and_the_same_is_idempotent():
    model = apply_tempo(MODELS["llama"]())
    with pytest.raises(ValueError, match=r"already patched with .*lm_loss=True.*revert_tempo.*lm_loss=False"):
        apply_tempo(model, lm_loss=False)
    assert apply_tempo(model) is model and isinstance(model, FusedLossLM)


def test_lm_loss_false_leaves_the_head_and_loss_alone():
    model = apply_tempo(MODELS["llama"](), lm_loss=False).train()
    assert not isinstance(model, FusedLossLM)
    assert model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).logits is not None
    with pytest.raises(TypeError, match="argument 'lm_loss' must be True or False"):
        apply_tempo(MODELS["llama"](), lm_loss="yes")


def test_what_is_not_fused_says_why(caplog):
    moe = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SMALL, output_router_logits=True))
    assert fused_loss_reason(moe) == "Qwen3MoeForCausalLM adds a router loss to the cross-entropy"
    assert fused_loss_reason(transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))) == \
        "BertModel is not a transformers causal or masked LM"
    with caplog.at_level("INFO", logger="tempo.integrations.patch"):
        assert not isinstance(apply_tempo(moe), FusedLossLM)
    assert any("adds a router loss" in m for m in caplog.messages)


@pytest.mark.parametrize("rows, hidden, vocab, x_dtype, weight_dtype, dtype, softcap", [
    (64, 32, 1000, torch.float32, torch.float32, torch.bfloat16, False),
    (64, 32, 1000, torch.float32, torch.float32, torch.float32, False),
    (200, 64, 5000, torch.float32, torch.float32, torch.bfloat16, True),
    (16, 64, 5000, torch.bfloat16, torch.bfloat16, torch.bfloat16, False),
])
def test_the_declared_scratch_is_what_the_op_holds_inside(rows, hidden, vocab, x_dtype, weight_dtype, dtype, softcap):
    """scratch_bytes against the op's inside, counted storage by storage (tempo.plan.band's counter):
    forward exactly; backward an upper bound within 10 % (the planner adds it at the op)."""
    from tempo.ops.linear_cross_entropy import _backward_impl, _forward, scratch_bytes
    from tempo.plan.band import LiveStorages

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, hidden, generator=g).to(x_dtype), torch.randn(vocab, hidden, generator=g).to(weight_dtype)
    t, grad = torch.randint(0, vocab, (rows,), generator=g), torch.ones(rows)
    block, cap = vocab_block(vocab, hidden), 2.0 if softcap else 0.0

    def inside(fn, inputs):
        counter = LiveStorages(inputs)
        with counter:
            outputs = fn()
        return counter.peak() - sum(a.untyped_storage().nbytes() for a in {id(a): a for a in [*inputs, *outputs]}.values())

    loss, lse, count = _forward(x, w, None, t, -100, 0.0, 0.0, False, cap, dtype, block)
    forward = inside(lambda: _forward(x, w, None, t, -100, 0.0, 0.0, False, cap, dtype, block), [x, w, t])
    backward = inside(lambda: _backward_impl(grad, x, w, None, t, lse, count, -100, 0.0, 0.0, False, cap, dtype,
                                             block), [x, w, t, lse, grad])
    assert forward == scratch_bytes(rows, vocab, hidden, block, x_dtype, weight_dtype, dtype, softcap, False)
    declared = scratch_bytes(rows, vocab, hidden, block, x_dtype, weight_dtype, dtype, softcap, True)
    assert backward <= declared <= 1.1 * backward


ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=97,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
MASKED = {
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**ENCODER)),
    "roberta": lambda: transformers.RobertaForMaskedLM(transformers.RobertaConfig(**ENCODER)),
    "mpnet": lambda: transformers.MPNetForMaskedLM(transformers.MPNetConfig(**ENCODER)),
    "modernbert": lambda: transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=97,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    "eurobert": lambda: transformers.EuroBertForMaskedLM(transformers.EuroBertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=97, pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3)),
    # legacy (the default): a BERT-like head with a Linear decoder; not legacy: the word embeddings and a bias
    "deberta-v2-legacy": lambda: transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
        **ENCODER, relative_attention=True, position_buckets=8, pos_att_type=["c2p", "p2c"])),
    "deberta-v2": lambda: transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
        **ENCODER, relative_attention=True, position_buckets=8, pos_att_type=["c2p", "p2c"], legacy=False)),
    "deberta": lambda: transformers.DebertaForMaskedLM(transformers.DebertaConfig(**ENCODER, legacy=False)),
}


def masked_batch():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(4, 97, (2, 12), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("name", MASKED)
def test_a_masked_lm_step_equals_the_stock_one_through_the_labelled_positions_only(name):
    torch.manual_seed(0)
    stock = MASKED[name]().train()
    tempo = apply_tempo(copy.deepcopy(stock)).train()
    assert isinstance(tempo, FusedLossLM) and type(tempo).__name__ == type(stock).__name__
    (o0, g0), (o1, g1) = step(stock, **masked_batch()), step(tempo, **masked_batch())
    torch.testing.assert_close(o1.loss, o0.loss, rtol=1e-5, atol=0)
    assert o1.logits is None and g1.keys() == g0.keys()
    largest = max(g.abs().max().item() for g in g0.values())  # key biases: gradient 0 up to rounding
    for key in g0:
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-5, atol=1e-6 * largest)


@pytest.mark.parametrize("name", ["bert", "deberta-v2"])
def test_a_compiled_masked_lm_step_breaks_no_graph_and_gives_the_eager_loss(name):
    torch.manual_seed(0)
    model = apply_tempo(MASKED[name]()).train()
    batch = masked_batch()
    explained = torch._dynamo.explain(lambda **b: model(**b).loss)(**batch)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(**batch).loss, model(**batch).loss, rtol=1e-5, atol=0)


def test_tempos_own_bert_trains_through_the_fused_head_as_through_its_logits():
    """tempo.bert's pretraining head (DLE's masked positions, -1 for none): the default choice fuses
    the decoder and loss (prediction_scores None in training), the same loss and gradients as the
    materialised logits; eval still returns them."""
    from dataclasses import replace

    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertForPreTraining
    from tempo.choices import TempoChoice

    config = BertConfig.from_name("bert_tiny")
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    fused = BertForPreTraining(config, TempoChoice.default()).train()
    logits = BertForPreTraining(config, replace(TempoChoice.default(), lm_loss=False)).train()
    logits.load_state_dict(fused.state_dict())
    ids = torch.randint(5, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(5))
    batch = (ids, torch.zeros_like(ids), torch.ones_like(ids), torch.tensor([[1, 5, 9, 0], [2, 3, 0, 0]]),
             torch.tensor([[7, 8, 9, -1], [10, 11, -1, -1]]), torch.tensor([0, 1]))
    (o0, g0), (o1, g1) = step(logits, *batch), step(fused, *batch)
    assert TempoChoice.default().lm_loss and not TempoChoice.paper().lm_loss
    assert o1.prediction_scores is None and o0.prediction_scores.shape[:2] == (2, 4)
    torch.testing.assert_close(o1.mlm_loss, o0.mlm_loss, rtol=1e-5, atol=0)
    largest = max(g.abs().max().item() for g in g0.values())
    for key in g0:
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-5, atol=1e-6 * largest)
    fused.eval()
    assert fused(*batch).prediction_scores.shape[:2] == (2, 4)


def test_trls_sft_trainer_trains_a_patched_causal_lm_with_its_token_metrics(tmp_path):
    """TRL's SFTTrainer (1.16: it installs its own fused LM head on the model, over Tempo's) trains a
    patched Qwen3 and logs its entropy and token accuracy: no logits are needed from Tempo's head."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1",
                                                     unk_token="t2")
    torch.manual_seed(0)
    model = apply_tempo(MODELS["qwen3"]())
    data = datasets.Dataset.from_dict({"input_ids": [[2 + (i * 7 + j) % 90 for j in range(12)] for i in range(8)]})
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                         logging_steps=1, use_cpu=True, save_strategy="no",
                         dataset_kwargs={"skip_prepare_dataset": True})
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert {"loss", "entropy", "mean_token_accuracy"} <= logged.keys() and torch.isfinite(torch.tensor(logged["loss"]))


def test_a_peft_lora_model_trains_through_the_fused_head_as_the_stock_one():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    stock = MODELS["llama"]()
    tempo = apply_tempo(copy.deepcopy(stock))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    models = []
    for model in (stock, tempo):
        torch.manual_seed(1)
        models.append(peft.get_peft_model(model, config).train())
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    (o0, g0), (o1, g1) = step(models[0], input_ids=ids, labels=ids), step(models[1], input_ids=ids, labels=ids)
    assert o1.logits is None and g1.keys() == g0.keys() and all("lora" in k for k in g0)
    torch.testing.assert_close(o1.loss, o0.loss, rtol=1e-5, atol=0)
    for key in g0:
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-5, atol=1e-5 * g0[key].abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_is_switched_as_the_fp32_one_and_steps_under_autocast_too(dtype):
    stock, tempo = pair("qwen3")
    low = apply_tempo(copy.deepcopy(stock).to(dtype)).train()
    assert isinstance(low, FusedLossLM) and type(low).__mro__[1:] == type(tempo).__mro__[1:]
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    out = low(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits is None and torch.isfinite(out.loss) and low.lm_head.weight.grad.dtype == dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (o0, g0), (o1, g1) = step(stock, input_ids=ids, labels=ids), step(tempo, input_ids=ids, labels=ids)
    assert o1.logits is None and g1.keys() == g0.keys()
    torch.testing.assert_close(o1.loss, o0.loss, rtol=2e-2, atol=0)


def test_a_deep_copy_reverts_without_touching_the_original():
    _stock, tempo = pair("gpt2")
    copied = copy.deepcopy(tempo)
    revert_tempo(copied)
    assert not isinstance(copied, FusedLossLM) and isinstance(tempo, FusedLossLM)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(8))
    assert tempo(input_ids=ids, labels=ids).logits is None and copied(input_ids=ids, labels=ids).logits is not None
