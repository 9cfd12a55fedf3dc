"""The workloads counted: a BERT encoder layer, a whole pretraining or SQuAD step, per Tempo choice.

Each is traced once on fake tensors (tempo/movement/trace.py) and turned into kernels per GPU
(tempo/movement/declarations.py). A whole model of L encoder layers is traced with 1 and with 2
layers and counted as trace(1) + (L − 1)·(trace(2) − trace(1)): every encoder layer runs the same
kernels, so this equals the L-layer trace (tests/test_movement.py checks it against a 3-layer
trace) at the cost of two small traces.

Inputs mirror what ``BertModel.forward`` hands a layer: the layer input in the autocast dtype
when a Tempo LayerNorm produced it (fp32 from ``nn.LayerNorm`` under autocast); the attention mask
``BertModel.forward`` makes (its ``layer_attention_mask``); with ``unpad`` the T real tokens and
their ``TokenLayout``. A padded batch has every
sequence ``round(s · (1 − padding_share))`` real tokens long (right padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from tempo.choices import TempoChoice
from tempo.movement.declarations import ELEMENTWISE, Kernel, Target, kernels_of
from tempo.movement.trace import FakeSession, OpCall, Trace, build_on_meta

# The choices the issue names, by the labels the table and the JSON use.
CHOICES: dict[str, TempoChoice] = {
    "original": TempoChoice.none(),
    "sdpa": TempoChoice.none("sdpa"),
    "paper": TempoChoice.full(),
    "floor": TempoChoice.floor(),
}
HF_VARIANTS = ("hf-eager", "hf-sdpa", "hf-paper", "hf-floor")


@dataclass
class Workload:
    """What was traced and how to weigh the traces (see the module docstring)."""

    label: str  # "original", "floor+unpad", "hf-floor", ...
    scope: str  # "layer", "pretraining", "squad"
    batch: int
    seq_len: int
    layers: int
    real_tokens: int
    padding_share: float
    parts: list[tuple[Trace, float]] = field(default_factory=list)
    extra: list[tuple[Kernel, float]] = field(default_factory=list)  # kernels no trace holds (the optimizer)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def kernels(self, target: Target) -> list[tuple[Kernel, float, OpCall]]:
        """(kernel, weight, the op it belongs to) for every kernel of every weighted trace."""
        traced = [(k, weight, call) for trace, weight in self.parts for call in trace.calls
                  for k in kernels_of(call, target) if k.moved or k.flops]
        return traced + [(k, weight, None) for k, weight in self.extra]

    def weighted(self, target: Target) -> list[tuple[Kernel, float]]:
        return [(k, w) for k, w, _ in self.kernels(target)]


def _config(name: str, layers: Optional[int] = None):
    from tempo.bert.config import BertConfig

    config = BertConfig.from_name(name)
    return config if layers is None else replace(config, num_hidden_layers=layers)


def padding_mask(batch: int, seq_len: int, padding_share: float) -> torch.Tensor:
    """A real [batch, seq_len] 0/1 mask: every row ``round(seq_len · (1 − padding_share))`` real
    tokens, then padding."""
    if not 0.0 <= padding_share < 1.0:
        raise ValueError(f"padding_share must be in [0, 1), got {padding_share}")
    real = max(1, round(seq_len * (1.0 - padding_share)))
    mask = torch.zeros(batch, seq_len, dtype=torch.int64)
    mask[:, :real] = 1
    return mask


def trace_layer(choice: TempoChoice, batch: int, seq_len: int, *, padding_share: float = 0.0,
                unpad: bool = False, config: str = "bert_large",
                dtype: torch.dtype = torch.bfloat16) -> tuple[Trace, int]:
    """One encoder layer's forward + backward in training mode (dropout on) under ``dtype``
    autocast -> (trace, real tokens)."""
    from tempo.bert.model import BertLayer, layer_attention_mask
    from tempo.unpad import TokenLayout

    cfg = _config(config)
    session = FakeSession()
    layer = session.fake_module(build_on_meta(lambda: BertLayer(cfg, choice).train()))
    attention_mask = padding_mask(batch, seq_len, padding_share)
    layout = TokenLayout.from_mask(attention_mask) if unpad else None
    input_dtype = dtype if (choice.layernorm or choice.dropout_add_layernorm) else torch.float32
    shape = (layout.total_tokens, cfg.hidden_size) if layout is not None else (batch, seq_len, cfg.hidden_size)
    hidden = session.fake_tensor(shape, input_dtype, requires_grad=True)
    mask = layer_attention_mask(choice.attention, attention_mask, layout, dtype)  # as BertModel.forward
    trace = session.trace(lambda: layer(hidden, mask, layout), autocast_dtype=dtype)
    return trace, int(attention_mask.sum())


def _pretraining_inputs(batch: int, seq_len: int, padding_share: float, predictions: int) -> dict[str, torch.Tensor]:
    mask = padding_mask(batch, seq_len, padding_share)
    real = int(mask[0].sum())
    if predictions > real:
        raise ValueError(f"{predictions} masked positions do not fit in {real} real tokens")
    positions = torch.arange(predictions).repeat(batch, 1)  # real positions (right padding)
    return {"input_ids": torch.zeros(batch, seq_len, dtype=torch.int64),
            "token_type_ids": torch.zeros(batch, seq_len, dtype=torch.int64), "attention_mask": mask,
            "masked_lm_positions": positions, "masked_lm_labels": torch.zeros(batch, predictions, dtype=torch.int64),
            "next_sentence_labels": torch.zeros(batch, dtype=torch.int64)}


def _squad_inputs(batch: int, seq_len: int, padding_share: float) -> dict[str, torch.Tensor]:
    mask = padding_mask(batch, seq_len, padding_share)
    return {"input_ids": torch.zeros(batch, seq_len, dtype=torch.int64),
            "token_type_ids": torch.zeros(batch, seq_len, dtype=torch.int64), "attention_mask": mask,
            "start_positions": torch.ones(batch, dtype=torch.int64), "end_positions": torch.ones(batch, dtype=torch.int64)}


def trace_model(factory: Callable[[], torch.nn.Module], inputs: dict[str, Any],
                dtype: torch.dtype = torch.bfloat16, loss: Callable[[Any], torch.Tensor] = lambda out: out.loss) -> Trace:
    """A training step's forward + backward of any model (ours, or a transformers model after
    ``tempo.apply_tempo``): ``factory`` builds it (on the meta device: no memory, no init), its
    parameters become fake, ``model(**inputs)`` runs under ``dtype`` autocast with CUDA's semantics,
    and ``loss(output).backward()`` is recorded. ``inputs`` stay real (token ids and masks)."""
    session = FakeSession()
    model = session.fake_module(build_on_meta(factory))
    model.train()
    trace = session.trace(lambda: loss(model(**inputs)), autocast_dtype=dtype)
    trace.parameters = sum(p.numel() for p in model.parameters())  # .parameters() yields tied ones once
    return trace


def adam_update(parameters: int) -> Kernel:
    """One fused Adam/LAMB step over fp32 parameters (apex FusedAdam, torch's fused AdamW): reads the
    parameter, its gradient and the two moments, writes the parameter and the moments, 28 bytes per
    parameter (a lower bound: an fp16 loss scaler's unscale pass and the norms are left out)."""
    return Kernel("optimizer step (fused Adam, fp32)", ELEMENTWISE, 16 * parameters, 12 * parameters)


def _our_model(task: str, choice: TempoChoice, layers: int, unpad: bool, config: str):
    from tempo.bert.model import BertForPreTraining, BertForQuestionAnswering

    cfg = _config(config, layers)
    cls = BertForPreTraining if task == "pretraining" else BertForQuestionAnswering
    return lambda: cls(cfg, choice, unpad=unpad)


def _hf_model(task: str, variant: str, layers: int, config: str):
    import transformers

    from tempo.integrations.patch import apply_tempo

    from tempo.presets import hf_bert_config

    attn = "sdpa" if variant == "hf-sdpa" else "eager"
    hf_config = hf_bert_config(_config(config), layers, attention=attn)
    cls = transformers.BertForPreTraining if task == "pretraining" else transformers.BertForQuestionAnswering

    def build():
        model = cls(hf_config)
        if variant == "hf-paper":
            apply_tempo(model, gelu=True, layernorm=True, attention="tempo", dropout_add_layernorm=False)
        elif variant == "hf-floor":
            apply_tempo(model, gelu=True, layernorm=True, attention="efficient", dropout_add_layernorm=True)
        return model
    return build


def _hf_inputs(task: str, batch: int, seq_len: int, padding_share: float, predictions: int) -> dict[str, Any]:
    mask = padding_mask(batch, seq_len, padding_share)
    common = {"input_ids": torch.zeros(batch, seq_len, dtype=torch.int64),
              "token_type_ids": torch.zeros(batch, seq_len, dtype=torch.int64), "attention_mask": mask}
    if task == "pretraining":
        labels = torch.full((batch, seq_len), -100, dtype=torch.int64)
        labels[:, :predictions] = 0
        return {**common, "labels": labels, "next_sentence_label": torch.zeros(batch, dtype=torch.int64)}
    return {**common, "start_positions": torch.ones(batch, dtype=torch.int64),
            "end_positions": torch.ones(batch, dtype=torch.int64)}


def label_of(name: str, unpad: bool) -> str:
    return f"{name}+unpad" if unpad else name


def layer_workload(name: str, batch: int, seq_len: int, *, padding_share: float = 0.0, unpad: bool = False,
                   config: str = "bert_large", dtype: torch.dtype = torch.bfloat16) -> Workload:
    """One encoder layer of choice ``name`` (a key of CHOICES)."""
    trace, real = trace_layer(CHOICES[name], batch, seq_len, padding_share=padding_share, unpad=unpad,
                              config=config, dtype=dtype)
    return Workload(label_of(name, unpad), "layer", batch, seq_len, 1, real, padding_share, [(trace, 1.0)])


def model_workload(name: str, task: str, batch: int, seq_len: int, *, layers: Optional[int] = None,
                   padding_share: float = 0.0, unpad: bool = False, predictions: Optional[int] = None,
                   config: str = "bert_large", dtype: torch.dtype = torch.bfloat16,
                   optimizer: bool = False) -> Workload:
    """A whole training step (forward + backward; the optimizer is not counted) of our BERT with
    choice ``name`` (a key of CHOICES), or of transformers' BERT (``name`` in HF_VARIANTS: eager and
    sdpa as transformers builds them, paper and floor after ``tempo.apply_tempo``). ``task``:
    "pretraining" (MLM on ``predictions`` positions per sequence, DLE's 15 % by default, plus NSP)
    or "squad" (start/end logits). ``layers`` defaults to the config's. ``optimizer``: add one fused
    Adam update of every parameter (``adam_update``) to the step."""
    from tempo.presets import default_max_predictions

    if task not in ("pretraining", "squad"):
        raise ValueError(f"task must be 'pretraining' or 'squad', got {task!r}")
    layers = layers if layers is not None else _config(config).num_hidden_layers
    predictions = predictions if predictions is not None else default_max_predictions(seq_len)
    hf = name in HF_VARIANTS
    if hf and unpad:
        raise ValueError("unpad is a constructor option of our BERT; transformers' BERT has none")
    if not hf and name not in CHOICES:
        raise ValueError(f"unknown choice {name!r}; choose one of {tuple(CHOICES) + HF_VARIANTS}")
    parts = []
    for traced_layers, weight in ((1, 2.0 - layers), (2, layers - 1.0)):
        if weight == 0:
            continue
        if hf:
            factory = _hf_model(task, name, traced_layers, config)
            inputs = _hf_inputs(task, batch, seq_len, padding_share, predictions)
        else:
            factory = _our_model(task, CHOICES[name], traced_layers, unpad, config)
            inputs = (_pretraining_inputs(batch, seq_len, padding_share, predictions) if task == "pretraining"
                      else _squad_inputs(batch, seq_len, padding_share))
        parts.append((trace_model(factory, inputs, dtype), weight))
    real = int(padding_mask(batch, seq_len, padding_share).sum())
    workload = Workload(label_of(name, unpad), task, batch, seq_len, layers, real, padding_share, parts)
    if optimizer:
        parameters = sum(weight * trace.parameters for trace, weight in parts)
        workload.extra.append((adam_update(round(parameters)), 1.0))
    return workload


# DeBERTa-v3-large (microsoft/deberta-v3-large's config) as transformers builds it, and after apply_tempo.
DEBERTA_VARIANTS = ("deberta-eager", "deberta-tempo-combined", "deberta-tempo")


def _deberta_config(layers: int):
    import transformers

    return transformers.DebertaV2Config(
        vocab_size=128100, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16, intermediate_size=4096,
        relative_attention=True, position_buckets=256, max_relative_positions=-1, max_position_embeddings=512,
        pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
        type_vocab_size=0, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=2)


def deberta_workload(name: str, batch: int, seq_len: int, *, padding_share: float = 0.0,
                     dtype: torch.dtype = torch.bfloat16) -> Workload:
    """One DeBERTa-v3-large encoder layer in a stack (a DebertaV2ForSequenceClassification step
    traced with 2 and 1 layers, counted as the difference), training mode, dropout on: transformers'
    eager model ("deberta-eager"), after ``apply_tempo(model, attention="tempo")`` (Combined core) or
    ``apply_tempo(model)`` (the O(s) disentangled attention)."""
    import transformers

    from tempo.integrations.patch import apply_tempo

    if name not in DEBERTA_VARIANTS:
        raise ValueError(f"unknown DeBERTa variant {name!r}; choose one of {DEBERTA_VARIANTS}")
    mask = padding_mask(batch, seq_len, padding_share)
    inputs = {"input_ids": torch.zeros(batch, seq_len, dtype=torch.int64), "attention_mask": mask,
              "labels": torch.zeros(batch, dtype=torch.int64)}

    def factory(layers: int):
        def build():
            model = transformers.DebertaV2ForSequenceClassification(_deberta_config(layers))
            if name == "deberta-tempo-combined":
                apply_tempo(model, attention="tempo")
            elif name == "deberta-tempo":
                apply_tempo(model)
            return model
        return build

    parts = [(trace_model(factory(2), inputs, dtype), 1.0), (trace_model(factory(1), inputs, dtype), -1.0)]
    return Workload(name, "layer", batch, seq_len, 1, int(mask.sum()), padding_share, parts)


__all__ = ["CHOICES", "DEBERTA_VARIANTS", "HF_VARIANTS", "Workload", "deberta_workload", "adam_update", "layer_workload", "model_workload", "padding_mask",
           "trace_layer", "trace_model"]
