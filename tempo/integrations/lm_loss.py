"""A causal LM's head and loss through ``tempo.ops.linear_cross_entropy``: no logits in training (issue 41).

transformers' ``*ForCausalLM`` (and GPT-2's ``GPT2LMHeadModel``) computes ``lm_head(hidden)`` for every
position, [tokens, vocab] in the autocast dtype, then ``ForCausalLMLoss`` upcasts it to fp32, and
autograd keeps both for backward: at Qwen3's 152k vocabulary that is most of a step's memory. apply_tempo
switches such a model's class (``as_original_class``: the same object, still an instance of its own
class, pickled as itself) to one whose forward, **in training, with labels, with a backward to run**,
runs the base model, shifts the labels as ``ForCausalLMLoss`` does (or takes ``shift_labels``), and
computes the loss with the fused op from the hidden states, the head's weight (tied or not) and bias,
``num_items_in_batch``, ``ignore_index`` and Gemma's ``final_logit_softcapping``.

Then ``outputs.logits`` is None: the logits are never formed. Everything else (eval, ``no_grad``,
generation, calls without labels) is the model's own forward, so logits are there where a user reads
them. What a training loop needs from logits in training (TRL's token-accuracy and entropy metrics)
is not there: pass ``lm_loss=False`` to apply_tempo for those.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tempo.integrations.recipe import _STANDS_FOR, Switched, as_original_class
from tempo.ops.linear_cross_entropy import linear_cross_entropy

logger = logging.getLogger("tempo.integrations.patch")

_HEAD_CLASS_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_NOT_FOR_THE_BASE = ("labels", "logits_to_keep")


def fused_loss_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` is not a causal LM whose head and loss apply_tempo fuses, or None when it is:
    a ``*ForCausalLM`` / ``*LMHeadModel`` of transformers with a Linear output embedding, the stock
    causal-LM loss and a forward taking ``labels`` and ``logits_to_keep``, no router (MoE) loss."""
    name = type(model).__name__
    if not name.endswith(_HEAD_CLASS_SUFFIXES) or not hasattr(model, "get_output_embeddings"):
        return f"{name} is not a transformers causal LM"
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


class FusedLossCausalLM(nn.Module):
    """A causal LM whose forward, in training with labels, computes the loss without the logits
    (module docstring); its own forward everywhere else. The switched model's class keeps the
    original's name and forward signature (``as_original_class``)."""

    keeps_original_name = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        own = super(FusedLossCausalLM, self).forward
        if not (self.training and torch.is_grad_enabled() and kwargs.get("labels") is not None):
            return own(*args, **kwargs)
        names, output_class, fields = _SPECS[type(self).__dict__[_STANDS_FOR]]
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}.forward takes {len(names)} positional arguments, got {len(args)}")
        call = {**dict(zip(names, args)), **kwargs}
        labels = call.pop("labels")
        call.pop("logits_to_keep", None)
        return_dict = call.pop("return_dict", None)
        outputs = self.base_model(**call)
        head = self.get_output_embeddings()
        ignore_index = call.get("ignore_index", -100)
        shift_labels = call.get("shift_labels")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = linear_cross_entropy(outputs[0], head.weight, shift_labels.to(outputs[0].device), head.bias,
                                    ignore_index=ignore_index, num_items_in_batch=call.get("num_items_in_batch"),
                                    softcap=getattr(self.config, "final_logit_softcapping", None))
        carried = {k: v for k, v in outputs.items() if k in fields}
        result = output_class(loss=loss, logits=None, **carried)
        return result.to_tuple() if return_dict is False else result


# Per original class, read once at the switch (dynamo cannot trace inspect or dataclasses.fields):
# forward's positional parameter names, its output class and the fields carried over from the base's.
_SPECS: dict[type, tuple[list[str], type, frozenset]] = {}


def _spec(cls: type) -> tuple[list[str], type, frozenset]:
    signature = inspect.signature(cls.forward)
    names = [n for n, p in signature.parameters.items() if n != "self" and p.kind in
             (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    output_class = signature.return_annotation
    if not dataclasses.is_dataclass(output_class):  # a string (postponed annotations) or none
        from transformers.modeling_outputs import CausalLMOutputWithPast as output_class
    fields = frozenset(f.name for f in dataclasses.fields(output_class)) - {"loss", "logits"}
    return names, output_class, fields


def fuse_lm_loss(model: nn.Module) -> list[Switched]:
    """Switch ``model`` (the root a user called apply_tempo on) to ``FusedLossCausalLM`` when
    ``fused_loss_reason`` finds nothing against it; returns the switch for ``restore_classes``."""
    reason = fused_loss_reason(model)
    if reason is not None:
        if type(model).__name__.endswith(_HEAD_CLASS_SUFFIXES):
            logger.info("lm_loss: %s; its head and loss are left as they are", reason)
        return []
    original = type(model)
    if isinstance(model, FusedLossCausalLM):
        return []
    _SPECS.setdefault(original, _spec(original))
    model.__class__ = as_original_class(FusedLossCausalLM, original)
    return [(model, original)]


__all__ = ["FusedLossCausalLM", "fuse_lm_loss", "fused_loss_reason"]
