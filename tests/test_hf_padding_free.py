"""Padding-free batches in transformers' models after apply_tempo (issue 19).

A batch from ``DataCollatorWithFlattening`` is one row of sequences packed back to back with
``position_ids`` restarting per sequence (and ``cu_seq_lens_q/k`` when asked for). transformers'
own eager and sdpa attention of encoders read neither and attend across the boundaries; Tempo's
attentions must give what each sequence gives alone: outputs and every parameter's gradient,
fp32, dropout off.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.integrations.patch import apply_tempo  # noqa: E402

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
LENGTHS = [5, 1, 9, 3]
CHOICES = {"default": {}, "paper": dict(attention="tempo", dropout_add_layernorm=False)}


def bert():
    return transformers.BertModel(transformers.BertConfig(**TINY, attn_implementation="eager"))


def roberta():
    return transformers.RobertaModel(transformers.RobertaConfig(**TINY, attn_implementation="eager"))


def electra():
    return transformers.ElectraModel(transformers.ElectraConfig(**{**TINY, "embedding_size": 32},
                                                                 attn_implementation="eager"))


def gpt2():
    return transformers.GPT2Model(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))


def llama():
    return transformers.LlamaModel(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64, attention_dropout=0.0, attn_implementation="eager"))


def gemma3():
    # A sliding layer whose window (4) is shorter than the longest sequence (9), and a global one.
    return transformers.Gemma3TextModel(transformers.Gemma3TextConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, vocab_size=100, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0, attn_implementation="eager"))


MODELS = {"bert": bert, "roberta": roberta, "electra": electra, "gpt2": gpt2, "llama": llama, "gemma3": gemma3}


def sequences(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (n,), generator=g) for n in LENGTHS]


def position_start(model):
    # RoBERTa's positions start at padding_idx + 1 (DataCollatorWithFlattening's position_ids_start).
    return model.config.pad_token_id + 1 if model.config.model_type == "roberta" else 0


def packed_batch(model, seqs, flash_kwargs):
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs,
                                                      position_ids_start=position_start(model))
    batch = collator([{"input_ids": s.tolist()} for s in seqs])
    batch.pop("labels", None)
    return batch


def run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch).last_hidden_state
    weights = torch.linspace(-1, 1, out.shape[-1])
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("name", list(MODELS))
def test_packed_batch_equals_each_sequence_alone(name, choice, flash_kwargs):
    torch.manual_seed(0)
    model = apply_tempo(MODELS[name](), **CHOICES[choice]).train()
    seqs = sequences()
    packed_out, packed_grads = run(model, packed_batch(model, seqs, flash_kwargs))
    # Each sequence alone (no padding, no packing): outputs concatenated, gradients summed.
    outs, grads = [], {}
    for s in seqs:
        start = position_start(model)
        o, g = run(model, {"input_ids": s[None], "position_ids": torch.arange(start, start + len(s))[None]})
        outs.append(o[0])
        for key, value in g.items():
            grads[key] = grads.get(key, 0) + value
    assert rel(packed_out[0], torch.cat(outs)) < 1e-5
    assert packed_grads.keys() == grads.keys()
    # Key biases' gradients are 0 in exact arithmetic (softmax ignores a per-row shift): rounding
    # noise of ~1e-10 there, judged against the whole gradient's scale instead of their own.
    scale = torch.cat([g.flatten() for g in grads.values()]).norm()
    for key in grads:
        err = (packed_grads[key] - grads[key]).norm()
        assert err <= 1e-5 * grads[key].norm() + 1e-8 * scale, key


def encoder_masks_read_positions() -> bool:
    """transformers 5.25 and later: the bidirectional mask builder takes position_ids and packs."""
    import inspect

    from transformers.masking_utils import create_bidirectional_mask

    return "position_ids" in inspect.signature(create_bidirectional_mask).parameters


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_stock_attention_crosses_the_boundaries_before_transformers_5_25(name):
    """The gap, shown per version: without Tempo, an encoder's eager attention mixes packed
    sequences up to transformers 5.24 (what Tempo fixes there); from 5.25 transformers builds the
    packed mask for encoders too. GPT-2: causal and packed from position_ids in every version, so
    the first sequence sees nothing later."""
    torch.manual_seed(0)
    model = MODELS[name]().train()
    seqs = sequences()
    packed_out, _ = run(model, packed_batch(model, seqs, False))
    first, _ = run(model, {"input_ids": seqs[0][None]})
    differs = rel(packed_out[0, :LENGTHS[0]], first[0]) > 1e-3
    assert differs == (name == "bert" and not encoder_masks_read_positions())


def test_one_position_row_shared_by_a_batch_of_packed_rows():
    """position_ids of shape [1, L] for a batch of B packed rows (each row packed alike): the row
    applies to every row of the batch, as it does for the model's position embeddings."""
    torch.manual_seed(0)
    model = apply_tempo(bert()).eval()
    packed = packed_batch(model, sequences(), False)
    ids = packed["input_ids"].expand(2, -1)
    with torch.no_grad():
        shared = model(input_ids=ids, position_ids=packed["position_ids"]).last_hidden_state
        each = model(input_ids=ids, position_ids=packed["position_ids"].expand(2, -1)).last_hidden_state
        alone = model(**packed).last_hidden_state
    torch.testing.assert_close(shared, each)
    torch.testing.assert_close(shared[1], alone[0])


def test_efficient_attention_runs_the_variable_length_op(monkeypatch):
    from tempo.ops import attention as attn_mod

    calls = []
    real = attn_mod.efficient_attention_varlen
    monkeypatch.setattr(attn_mod, "efficient_attention_varlen", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    model = apply_tempo(bert()).train()
    run(model, packed_batch(model, sequences(), False))
    assert len(calls) == 2  # one per layer
    assert calls[0].tolist() == [0, 5, 6, 15, 18]


def test_plain_padded_batches_are_not_taken_for_packed():
    from tempo.integrations.hf_attention import packed_sequences

    q = torch.zeros(2, 2, 6, 8)
    assert packed_sequences(q, q, {}) is None
    assert packed_sequences(q, q, {"position_ids": torch.arange(6)[None]}) is None
    assert packed_sequences(q, q, {"position_ids": torch.arange(6).expand(2, 6)}) is None
    cu, max_len = packed_sequences(q, q, {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)})
    assert cu.tolist() == [0, 3, 6, 9, 12] and max_len == 3
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packed_sequences(q, q, {"cu_seq_lens_q": torch.tensor([0, 3, 6])})  # two rows: not one packed row


def test_hf_trainer_padding_free_example_trains(tmp_path, capsys):
    import os
    import sys

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    sys.path.insert(0, examples)
    try:
        import hf_trainer_padding_free as example
    finally:
        sys.path.remove(examples)
    argv = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_documents", "10", "--hidden_size", "32",
            "--output_dir", str(tmp_path)]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "padded        train_samples_per_second=" in out and "padding-free  train_samples_per_second=" in out


def test_packing_is_read_once_per_tensor_not_per_layer():
    """The boundaries come from one host read per position_ids tensor (or per cu_seq_lens_q/k
    pair, which is also where the two are checked equal and ending at the row length); every
    layer of the forward gets the same tensors and reads nothing; the offsets are recorded with
    the attention ops, which then read nothing either (issue 28)."""
    from test_host_reads import HostReadCounter

    from tempo.integrations.hf_attention import _packing_mask, packed_sequences
    from tempo.ops.attention import sequence_facts

    def reads(fn):
        counter = HostReadCounter()
        with counter.installed(), counter.counting():
            result = fn()
        return counter.total, result

    q = torch.zeros(1, 2, 6, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    n, (cu, max_len) = reads(lambda: packed_sequences(q, q, {"position_ids": positions}))
    assert n == 1 and cu.tolist() == [0, 3, 5, 6] and max_len == 3
    assert reads(lambda: [packed_sequences(q, q, {"position_ids": positions}) for _ in range(3)])[0] == 0
    n, facts = reads(lambda: sequence_facts(cu))
    assert n == 0 and (facts.min_seqlen, facts.max_seqlen) == (1, 3)
    assert reads(lambda: _packing_mask(cu, 6, 1, q.device))[0] == 0
    assert _packing_mask(cu, 6, 1, q.device) is _packing_mask(cu, 6, 1, q.device)  # made once per cu

    kwargs = {"cu_seq_lens_q": torch.tensor([0, 2, 6], dtype=torch.int32),
              "cu_seq_lens_k": torch.tensor([0, 2, 6], dtype=torch.int32), "max_length_q": 4}
    n, (cu, max_len) = reads(lambda: packed_sequences(q, q, kwargs))
    assert n == 1 and cu.tolist() == [0, 2, 6] and max_len == 4
    assert reads(lambda: [packed_sequences(q, q, kwargs) for _ in range(3)])[0] == 0
    for other in ([0, 3, 6], [0, 2, 5], [0, 2, 4, 6]):  # a middle offset, the last one, the count
        with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
            packed_sequences(q, q, {**kwargs, "cu_seq_lens_k": torch.tensor(other, dtype=torch.int32)})
    with pytest.raises(ValueError, match="ends at 5"):
        packed_sequences(q, q, {"cu_seq_lens_q": torch.tensor([0, 2, 5])})


# ---------------------------------------------------------------------------------------------
# Read once per model call, by the call hooks (torch.compile traces the layers whole)
# ---------------------------------------------------------------------------------------------
def _host_reads(fn):
    from test_host_reads import HostReadCounter

    counter = HostReadCounter()
    with counter.installed(), counter.counting():
        result = fn()
    return counter.sites, result


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_the_packing_is_read_once_per_model_call_and_never_in_a_layer(name):
    """apply_tempo hooks the model (head and base); a call with position_ids restarting reads its
    packing once, at the call (a fresh position tensor each time: no cache across calls), the
    layers read nothing; a call without position_ids reads nothing at all (GPT-2's layers get
    positions the model made: they are not read)."""
    from tempo.integrations import hf_attention

    model = apply_tempo(MODELS[name](), gelu=False, layernorm=False, dropout_add_layernorm=False).train()
    assert [type(m).__name__ for m in model.modules() if hf_attention._hooked(m)] == [type(model).__name__]
    for _ in range(2):
        batch = packed_batch(model, sequences(), False)
        sites, _ = _host_reads(lambda: model(**batch).last_hidden_state.sum().backward())
        assert list(sites.values()) == [1] and "_cu_from_positions" in next(iter(sites)), sites
    ids = torch.randint(3, 100, (2, 7))
    sites, _ = _host_reads(lambda: model(input_ids=ids).last_hidden_state.sum().backward())
    assert sum(sites.values()) == 0, sites


def test_the_call_checks_cu_seq_lens_as_the_layers_did():
    model = apply_tempo(bert()).train()
    batch = packed_batch(model, sequences(), True)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
        model(**{**batch, "cu_seq_lens_k": batch["cu_seq_lens_k"] + torch.tensor([0, 1, 0, 0, 0])})
    with pytest.raises(ValueError, match="ends at 17 but the packed row has 18 tokens"):
        model(**{**batch, "cu_seq_lens_q": torch.tensor([0, 5, 6, 15, 17]), "cu_seq_lens_k": None})


@pytest.mark.parametrize("choice", list(CHOICES))
def test_layers_recomputed_outside_the_call_read_their_own_packing(choice):
    """Gradient checkpointing (reentrant) recomputes each layer in backward, after the model call
    that carried the packing: the layer reads the position_ids it was given, so the gradients are
    those of the plain run (and of each sequence alone)."""
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = apply_tempo(transformers.BertModel(transformers.BertConfig(**TINY)), **CHOICES[choice]).train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        results.append(run(model, packed_batch(model, sequences(), False)))
    (plain_out, plain), (ckpt_out, ckpt) = results
    torch.testing.assert_close(ckpt_out, plain_out)
    assert ckpt.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(ckpt[key], plain[key], rtol=1e-5, atol=1e-7, msg=key)


def test_a_model_called_inside_another_with_its_own_positions_reads_its_own_packing():
    """A base model called by its head with the head's position_ids inherits the head's packing;
    a model called inside another call with other position_ids reads its own."""
    torch.manual_seed(0)
    outer = apply_tempo(bert()).eval()
    inner = apply_tempo(bert()).eval()
    packed = packed_batch(inner, sequences(), False)
    with torch.no_grad():
        alone = inner(**packed).last_hidden_state
    seen = []
    outer.encoder.layer[0].register_forward_hook(lambda *a: seen.append(inner(**packed).last_hidden_state))
    with torch.no_grad():
        outer(input_ids=torch.randint(3, 100, (2, 6)))
    torch.testing.assert_close(seen[0], alone)
    head = apply_tempo(transformers.BertForMaskedLM(transformers.BertConfig(**TINY))).eval()
    with torch.no_grad():
        via_head = head(**packed, output_hidden_states=True).hidden_states[-1]
        direct = head.bert(**packed).last_hidden_state
    torch.testing.assert_close(via_head, direct)


def test_position_ids_passed_positionally_are_read_too():
    """BertModel(input_ids, attention_mask, token_type_ids, position_ids): the call hook binds the
    arguments to the model's signature, so positional position_ids pack the call as keywords do."""
    torch.manual_seed(0)
    model = apply_tempo(bert()).eval()
    packed = packed_batch(model, sequences(), False)
    with torch.no_grad():
        by_keyword = model(**packed).last_hidden_state
        by_position = model(packed["input_ids"], None, None, packed["position_ids"]).last_hidden_state
        unpacked = model(packed["input_ids"]).last_hidden_state
    torch.testing.assert_close(by_position, by_keyword)
    assert float((unpacked - by_keyword).abs().max()) > 1e-3


def test_the_efficient_mask_drops_only_a_mask_that_packs():
    """"tempo_efficient"'s mask function gives None only for transformers' packing over a
    bidirectional or causal base (the layers apply both exactly); padding, a sliding window, a
    user's overlay or a call that is not packed keep sdpa's mask. On transformers before 5.25 the
    encoders' builder never packs, so BERT's layers get None from sdpa's own skip."""
    from transformers import masking_utils as mu

    from tempo.integrations.hf_attention import _only_packing

    seq = torch.tensor([[0, 0, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 0, 1, 2]])
    packs = mu.packed_sequence_mask_function(seq)
    # 5.25 evaluates the base on positions within each sequence; 5.17-5.24 on the row's indices.
    remap = getattr(mu, "remap_positions_for_packed_sequence", lambda fn, positions: fn)
    for base in (mu.bidirectional_mask_function, mu.causal_mask_function):
        assert _only_packing(mu.and_masks(remap(base, pos), packs))
        assert not _only_packing(base)  # nothing packs: sdpa's own skip decides
    window = mu.sliding_window_causal_mask_function(2)
    assert not _only_packing(mu.and_masks(remap(window, pos), packs))
    assert not _only_packing(mu.and_masks(mu.bidirectional_mask_function, packs, mu.padding_mask_function(seq > 0)))
    assert not _only_packing(mu.and_masks(mu.bidirectional_mask_function, packs, lambda b, h, q, kv: q >= kv))

    # Through a model: a packed BERT call gets None; the same rows padded get sdpa's mask.
    model = apply_tempo(bert()).train()
    seen = []
    for layer in model.encoder.layer:
        layer.attention.self.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")),
                                                       with_kwargs=True)
    run(model, packed_batch(model, sequences(), False))
    assert seen == [None, None]
    seen.clear()
    run(model, {"input_ids": torch.randint(3, 100, (2, 6)), "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])})
    assert len(seen) == 2 and all(m is not None and m.dtype == torch.bool for m in seen)
