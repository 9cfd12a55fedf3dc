"""A language model's head and loss through ``tempo.ops.linear_cross_entropy``: no logits in training (issue 41).

transformers' ``*ForCausalLM`` (and GPT-2's ``GPT2LMHeadModel``) computes ``lm_head(hidden)`` for every
position, [tokens, vocab] in the autocast dtype, then ``ForCausalLMLoss`` upcasts it to fp32, and
autograd keeps both for backward: at Qwen3's 152k vocabulary that is most of a step's memory.
``*ForMaskedLM`` does the same for every position although ~15 % carry a label. apply_tempo switches
such a model's class (``as_original_class``: the same object, still an instance of its own class,
under its own name, pickled as itself) to one whose forward, **in training, with labels, with a
backward to run**, runs the base model and then:

  * causal LM: shifts the labels as ``ForCausalLMLoss`` does (or takes ``shift_labels``) and computes
    the loss with the fused op from the hidden states, the head's weight (tied or not) and bias,
    ``num_items_in_batch``, ``ignore_index`` and Gemma's ``final_logit_softcapping``;
  * masked LM (BERT, RoBERTa, XLM-R, CamemBERT, MPNet, ModernBERT, EuroBERT, DeBERTa v1/v2: ``MLM_HEADS``): gathers
    the labelled positions, runs the family's prediction transform on them alone, and the fused op
    with the decoder; the mean over labelled positions as the family's own loss (``num_items_in_batch``
    where the family's loss_function takes it). Under ``torch.compile`` every position goes through
    the transform (a gather of data-dependent size would break the graph); the op still drops the
    unlabelled rows before the decoder.

Then ``outputs.logits`` is None: the logits are never formed. Everything else (eval, ``no_grad``,
generation, calls without labels) is the model's own forward, so logits are there where a user reads
them. A training loop that reads logits in training needs ``lm_loss=False``; TRL's SFTTrainer (1.16)
installs its own fused head on the model instance, which then runs instead of this one.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tempo.integrations.recipe import Switched, as_original_class, stands_for
from tempo.ops.linear_cross_entropy import labelled_rows, linear_cross_entropy

logger = logging.getLogger("tempo.integrations.patch")

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_NOT_FOR_THE_BASE = ("labels", "logits_to_keep")


def _dense_gelu_norm(head: nn.Module) -> Callable:
    return lambda x: head.layer_norm(F.gelu(head.dense(x)))  # RobertaLMHead.forward's transform


def _dense_act_norm(head: nn.Module) -> Callable:
    return lambda x: head.LayerNorm(head.transform_act_fn(head.dense(x)))  # DebertaV2LMPredictionHead's


def _linear(layer: nn.Module) -> tuple:
    return layer.weight, layer.bias


# A masked LM's head, by the class of the model's child holding it -> (the prediction transform as a
# function of the model, the decoder's (weight, bias) as one): each family's forward, read in
# transformers 5.17 and 5.25, and tested against the stock model (tests/test_linear_cross_entropy.py).
# DeBERTa's non-legacy head multiplies by the word embeddings and adds its own bias (no Linear).
MLM_HEADS: dict[str, tuple[Callable[[nn.Module], Callable], Callable[[nn.Module], tuple]]] = {
    **{name: (lambda m: m.cls.predictions.transform, lambda m: _linear(m.cls.predictions.decoder))
       for name in ("BertOnlyMLMHead", "LegacyDebertaV2OnlyMLMHead", "LegacyDebertaOnlyMLMHead")},
    **{name: (lambda m: _dense_gelu_norm(m.lm_head), lambda m: _linear(m.lm_head.decoder))
       for name in ("RobertaLMHead", "XLMRobertaLMHead", "CamembertLMHead", "MPNetLMHead")},
    **{name: (lambda m: _dense_act_norm(m.lm_predictions.lm_head),
              lambda m: (m.base_model.embeddings.word_embeddings.weight, m.lm_predictions.lm_head.bias))
       for name in ("DebertaV2OnlyMLMHead", "DebertaOnlyMLMHead")},
    "ModernBertPredictionHead": (lambda m: m.head, lambda m: _linear(m.decoder)),
}


def _mlm_head(model: nn.Module) -> Optional[tuple[Callable[[nn.Module], Callable], Callable[[nn.Module], tuple]]]:
    kinds = [type(child).__name__ for child in model.children()]
    found = [MLM_HEADS[k] for k in kinds if k in MLM_HEADS]
    if found:
        return found[0]
    if type(model).__name__ == "EuroBertForMaskedLM" and isinstance(getattr(model, "lm_head", None), nn.Linear):
        return (lambda m: (lambda x: x)), (lambda m: _linear(m.lm_head))
    return None


def fused_loss_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` is not a language model whose head and loss apply_tempo fuses, or None when it
    is: a transformers ``*ForCausalLM`` / ``*LMHeadModel`` with a Linear output embedding, the stock
    causal-LM loss, a forward taking ``labels`` and ``logits_to_keep`` and no router (MoE) loss; or a
    ``*ForMaskedLM`` with a head of ``MLM_HEADS``."""
    name = type(model).__name__
    if name.endswith("ForMaskedLM"):
        if _mlm_head(model) is None:
            return f"{name}'s masked-LM head is not one Tempo knows (tempo.integrations.lm_loss.MLM_HEADS)"
        return None
    if not name.endswith(_CAUSAL_SUFFIXES) or not hasattr(model, "get_output_embeddings"):
        return f"{name} is not a transformers causal or masked LM"
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        return f"{name}'s loss is {model.loss_type}, not the causal-LM cross-entropy"
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        return f"{name}'s output embedding is not an nn.Linear"
    parameters = inspect.signature(type(model).forward).parameters
    if not all(p in parameters for p in _NOT_FOR_THE_BASE):
        return f"{name}.forward takes no {' or '.join(p for p in _NOT_FOR_THE_BASE if p not in parameters)}"
    if getattr(model.config, "output_router_logits", False):
        return f"{name} adds a router loss to the cross-entropy"
    return None


class _Spec(NamedTuple):
    """Per original class, read once at the switch (dynamo cannot trace inspect or dataclasses)."""

    names: list  # forward's positional parameter names
    output_class: type
    fields: frozenset  # the output's fields carried over from the base model's output
    masked: bool  # a masked LM (its head is looked up per instance: DeBERTa's depends on its config)
    items_divide: bool  # num_items_in_batch divides the sum (the family's loss_function takes it)


_SPECS: dict[type, _Spec] = {}


def _spec(cls: type) -> _Spec:
    signature = inspect.signature(cls.forward)
    names = [n for n, p in signature.parameters.items() if n != "self" and p.kind in
             (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    masked = cls.__name__.endswith("ForMaskedLM")
    output_class = signature.return_annotation
    if not dataclasses.is_dataclass(output_class):  # a string (postponed annotations) or a tuple union
        from transformers.modeling_outputs import CausalLMOutputWithPast, MaskedLMOutput

        output_class = MaskedLMOutput if masked else CausalLMOutputWithPast
    fields = frozenset(f.name for f in dataclasses.fields(output_class)) - {"loss", "logits"}
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        source = ""
    return _Spec(names, output_class, fields, masked, not masked or "self.loss_function(" in source)


class FusedLossLM(nn.Module):
    """A language model whose forward, in training with labels, computes the loss without the logits
    (module docstring); its own forward everywhere else. The switched model's class keeps the
    original's name and forward signature (``as_original_class``)."""

    keeps_original_name = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        own = super(FusedLossLM, self).forward
        if not (self.training and torch.is_grad_enabled() and kwargs.get("labels") is not None):
            return own(*args, **kwargs)
        spec = _SPECS[stands_for(type(self))]
        if len(args) > len(spec.names):
            raise TypeError(f"{type(self).__name__}.forward takes {len(spec.names)} positional arguments, "
                            f"got {len(args)}")
        call = {**dict(zip(spec.names, args)), **kwargs}
        labels = call.pop("labels")
        call.pop("logits_to_keep", None)
        return_dict = call.pop("return_dict", None)
        outputs = self.base_model(**call)
        items = call.get("num_items_in_batch") if spec.items_divide else None
        if spec.masked:
            loss = self._masked_lm_loss(outputs[0], labels, _mlm_head(self), items)
        else:
            loss = self._causal_lm_loss(outputs[0], labels, call, items)
        result = spec.output_class(loss=loss, logits=None, **{k: v for k, v in outputs.items() if k in spec.fields})
        return result.to_tuple() if return_dict is False else result

    def _causal_lm_loss(self, hidden: torch.Tensor, labels: torch.Tensor, call: dict, items: Any) -> torch.Tensor:
        head = self.get_output_embeddings()
        ignore_index = call.get("ignore_index", -100)
        shift_labels = call.get("shift_labels")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return linear_cross_entropy(hidden, head.weight, shift_labels.to(hidden.device), head.bias,
                                    ignore_index=ignore_index, num_items_in_batch=items,
                                    softcap=getattr(self.config, "final_logit_softcapping", None))

    def _masked_lm_loss(self, hidden: torch.Tensor, labels: torch.Tensor, head_of: tuple, items: Any) -> torch.Tensor:
        transform, decoder = head_of
        hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
        weight, bias = decoder(self)
        checked = not torch.compiler.is_compiling()
        if checked:  # only the labelled positions through the transform (one host read, the op's)
            rows = labelled_rows(labels, -100, weight.shape[0])
            hidden, labels = hidden.index_select(0, rows), labels.index_select(0, rows)
        return linear_cross_entropy(transform(self)(hidden), weight, labels, bias, num_items_in_batch=items,
                                    rows_checked=checked)


def fuse_lm_loss(model: nn.Module) -> list[Switched]:
    """Switch ``model`` (the root a user called apply_tempo on) to ``FusedLossLM`` when
    ``fused_loss_reason`` finds nothing against it; returns the switch for ``restore_classes``."""
    reason = fused_loss_reason(model)
    if reason is not None:
        if type(model).__name__.endswith((*_CAUSAL_SUFFIXES, "ForMaskedLM")):
            logger.info("lm_loss: %s; its head and loss are left as they are", reason)
        return []
    original = type(model)
    if isinstance(model, FusedLossLM):
        return []
    _SPECS.setdefault(original, _spec(original))
    model.__class__ = as_original_class(FusedLossLM, original)
    return [(model, original)]


__all__ = ["FusedLossLM", "MLM_HEADS", "fuse_lm_loss", "fused_loss_reason"]
