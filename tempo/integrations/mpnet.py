"""MPNet's attention (all-mpnet-base-v2) in O(s): its relative position bias as a bias of the
efficient attention, shared by the batch.

transformers' ``MPNetSelfAttention`` computes its attention itself, not through
``AttentionInterface``: scores q·kᵀ/√d, plus ``position_bias``, plus the additive padding mask,
softmax, ``nn.Dropout``, ·v, then the output projection ``o``. ``MPNetEncoder`` computes the bias
once per forward, ``relative_attention_bias(bucket(j − i))`` ([S, S, heads]: a learned value per
head and bucket of the distance), permutes it to [1, heads, S, S] and copies it to every batch
element ([B, heads, S, S], ``expand(...).contiguous()``) for all its layers. Eager autograd keeps,
per layer, the fp32 probabilities and the dropout's mask and output: O(s²) per row of every layer.

``MPNetEfficientSelfAttention`` (the recipe below) holds the original's ``q``, ``k``, ``v``, ``o``
and ``dropout`` (the same objects, in its order) and runs ``tempo.ops.attention.efficient_attention``
with ``attn_bias`` = the position bias and ``attn_mask`` = the padding mask, each as given: kept
for backward, q, k, v, the output, two fp32 numbers per (row, head) and a seed per layer, plus the
[1, heads, S, S] bias and the [B, 1, 1, S] padding row once per forward (every layer gets the same
tensors). The bias's gradient is the scores' gradient summed over the batch, accumulated tile by
tile in one [1, heads, S, S] buffer (never [B, heads, S, S]), and flows to ``relative_attention_bias``
through the encoder's own embedding lookup. Dropout: the held ``nn.Dropout``'s rate and flag, read at
every forward (TRL's ``m.p = 0`` switches it off), drawn from a seed (a no-grad pass and its replay
from the same RNG state draw the same mask). On CUDA the op runs its tiled reference path for this
call (see "CUDA dispatch" in tempo/ops/attention.py: what it keeps and what is transient).

The batch copy of the bias: ``install_shared_position_bias`` (the recipe's model hook) gives each
``MPNetEncoder`` holding Tempo attentions an instance-level ``compute_position_bias`` that returns
the bias once, [1, heads, S, S], instead of its [B, heads, S, S] copy (checked equal to the
original's before it is installed; the stock attention, for calls asking for the probabilities,
adds it with the same broadcast). ``revert_tempo`` removes it (``remove_shared_position_bias``).

The padding mask: MPNet builds eager's additive mask, [B, 1, S, S] of 0 / finfo.min per key, the
same row for every query. The attention takes its [B, 1, 1, S] row, made once per model call and
shared by the layers. The call hooks (``install_call_hooks``, put on every ``MPNetModel`` holding
Tempo's attention) note, outside any read, whether the call's ``attention_mask`` is absent or
[B, S]: then ``create_bidirectional_mask`` built the layers' mask, a key-padding mask whose query
rows are all the same, and the layers take its row with no host read, so torch.compile traces them
whole. A mask the model did not build (a 4-D mask a caller passed, a layer called on its own) is
checked in eager mode (one host read per mask tensor) and passed whole when its rows differ; under
torch.compile nothing can be read inside the graph, so it is passed whole, unchecked: kept for
backward, O(B·S²) bytes (both logged once; under torch.compile at the model call when there is one).
Under autocast the op casts it as sdpa would (finfo.min → −inf): identical probabilities except
for a sample with no real token at all (stock: uniform; here: 0).

A call asking for the probabilities (``output_attentions=True``) runs the original forward on the
same modules (logged once). ``apply_tempo`` checks the replacement against the original numerically
(eval mode, a padded row, a random bias) before it swaps it in.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from tempo.integrations import model_calls
from tempo.integrations.recipe import Options, Recipe, output_check, restore_children, sample

logger = logging.getLogger("tempo.integrations.mpnet")

_MODULE = "transformers.models.mpnet."
_PROJECTIONS = ("q", "k", "v", "o")
_SHARED_BIAS = "compute_position_bias"  # the encoder's method the model hook overrides per instance
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info("MPNet attention: %s (logged once)", message)


def is_mpnet_self_attention(module: nn.Module) -> bool:
    """transformers' ``MPNetSelfAttention`` with the parts the replacement uses."""
    cls = type(module)
    if cls.__name__ != "MPNetSelfAttention" or not cls.__module__.startswith(_MODULE):
        return False
    if not all(isinstance(getattr(module, name, None), nn.Linear) for name in _PROJECTIONS):
        return False
    return type(getattr(module, "dropout", None)) is nn.Dropout and all(
        isinstance(getattr(module, name, None), int) for name in ("num_attention_heads", "attention_head_size"))


def _is_mpnet_encoder(module: nn.Module) -> bool:
    cls = type(module)
    return (cls.__name__ == "MPNetEncoder" and cls.__module__.startswith(_MODULE)
            and isinstance(getattr(module, "relative_attention_bias", None), nn.Embedding)
            and callable(getattr(cls, "relative_position_bucket", None)))


class MPNetEfficientSelfAttention(nn.Module):
    """``MPNetSelfAttention`` as one O(s) ``efficient_attention`` call (see the module docstring)."""

    def __init__(self, original: nn.Module):
        super().__init__()
        if not is_mpnet_self_attention(original):
            raise TypeError(f"{type(self).__name__}: expected transformers' MPNetSelfAttention, got "
                            f"{type(original).__module__}.{type(original).__name__}")
        for key in ("num_attention_heads", "attention_head_size", "all_head_size"):
            setattr(self, key, getattr(original, key))
        for name, child in original._modules.items():  # the same objects, in its order
            self._modules[name] = child
        self._original_class = type(original)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_bias: Optional[torch.Tensor] = None, output_attentions: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor, ...]:
        if output_attentions:
            _log_once("a call asking for the attention probabilities runs the model's own attention (it keeps "
                      "the s x s probabilities for backward)")
            return self._original_class.forward(self, hidden_states, attention_mask, position_bias,
                                                output_attentions, **kwargs)
        from tempo.ops.attention import efficient_attention

        b, s = hidden_states.shape[:2]
        shape = (b, s, -1, self.attention_head_size)
        q = self.q(hidden_states).view(shape).transpose(1, 2)
        k = self.k(hidden_states).view(shape).transpose(1, 2)
        v = self.v(hidden_states).view(shape).transpose(1, 2)
        # The held nn.Dropout's rate and flag, read now: TRL's disable_dropout_in_model (m.p = 0) works.
        out = efficient_attention(q, k, v, attn_mask=key_padding(attention_mask, s), dropout_p=float(self.dropout.p),
                                  scale=1.0 / math.sqrt(self.attention_head_size), training=self.dropout.training,
                                  attn_bias=position_bias)
        # Stored as (b, s, heads, d): merging the heads is a view.
        return (self.o(out.transpose(1, 2).reshape(b, s, self.all_head_size)),)

    def extra_repr(self) -> str:
        return f"heads={self.num_attention_heads}, p={self.dropout.p}"


# -- the padding mask: its [B, 1, 1, S] row, once per model call (every layer gets the same one) ----
_padding_cache: list = []  # [(weak reference to the mask, its version, the answer)]: a mask checked outside a call


_PASSED_WHOLE = ("under torch.compile, a 4-D attention mask with a row per query that the MPNet model did not build "
                 "from a [B, S] mask is passed whole, unchecked (kept for backward once per forward: O(B·S²) bytes)")


@torch.compiler.disable
def _log_outside_graph(message: str) -> None:
    # torch.compile cannot trace a logger call (a graph break in the layer); it does not trace into this
    # function, which runs as plain Python. The callers test _logged first, so it is called until logged only.
    _log_once(message)


def _is_fake(t: torch.Tensor) -> bool:
    """A fake tensor (the ledger's and movement counter's traces): no values to read."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or t.is_meta


def key_padding(mask: Optional[torch.Tensor], s: int) -> Optional[torch.Tensor]:
    """MPNet's additive [B, 1, S, S] mask as its [B, 1, 1, S] row when every query row is the same
    (a key-padding mask: what MPNet builds from a [B, S] attention_mask), else the mask as it is.
    Under autocast the row is cast here, once, as sdpa's autocast casts a float mask (the op would
    cast it again in every layer: one copy kept per layer). The same row tensor for every layer.
    Inside a call of an MPNet model that built the mask (see ``_Call``): no host read, the row made
    by the first layer. Otherwise, in eager mode, one host read per mask tensor and version; under
    torch.compile the mask as it is (nothing can be read inside the graph)."""
    if mask is None or mask.dim() != 4 or mask.shape[2] != s or mask.shape[2] == 1:
        return mask
    from tempo.ops.attention import autocast_like_sdpa

    target = autocast_like_sdpa(mask[:, :, :1, :1])[0].dtype  # the dtype sdpa's autocast gives it
    call = current_call()
    if call is not None and call.builds_mask:
        if call.row is None or call.row[0] is not mask or call.row[1] != target:
            # Its own storage: the [B, 1, S, S] mask is not kept alive by it.
            call.row = (mask, target, mask[:, :, :1, :].to(target, copy=True))
        return call.row[2]
    if torch.compiler.is_compiling():
        if call is None and _PASSED_WHOLE not in _logged:  # a layer run on its own (else the call hook logs)
            _log_outside_graph(_PASSED_WHOLE)
        return mask
    if _padding_cache:
        ref, state, answer = _padding_cache[0]
        if ref() is mask and state == (mask._version, target):
            return answer
    row = mask[:, :, :1, :]
    if _is_fake(mask) or bool((mask == row).all()):
        answer = row.to(target, copy=True)  # its own storage: the [B, 1, S, S] mask is not kept alive by it
    else:
        _log_once("a 4-D attention mask whose query rows differ is passed whole (kept for backward once per "
                  "forward: O(B·S²) bytes)")
        answer = mask
    _padding_cache[:] = [(weakref.ref(mask), (mask._version, target), answer)]
    return answer


# -- what one call of an MPNet model tells its layers: model-level hooks -----------------------------
# Module-level functions (pickled by reference, shared by deep copies); revert finds them again by
# identity: no handle, no closure, nothing that refers to one model instance is kept anywhere.
class _Call:
    """One call of an ``MPNetModel`` running in this thread."""

    def __init__(self, owner: nn.Module, builds_mask: bool):
        self.owner = owner
        # Its attention_mask is absent or [B, S]: create_bidirectional_mask builds the layers' mask from it,
        # a key-padding mask (every query row the same; a 4-D mask it would return as given).
        self.builds_mask = builds_mask
        self.row: Optional[tuple] = None  # (the layers' mask, the row's dtype, its row): made by the first layer


_CALLS = model_calls.CallStack()
_POSITIONS = {"input_ids": 0, "attention_mask": 1, "inputs_embeds": 3}  # MPNetModel.forward's


def current_call() -> Optional[_Call]:
    """The innermost MPNet model call running in this thread, or None."""
    return _CALLS.current()


def _call_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    builds_mask = model_calls.mask_per_token(args, kwargs, _POSITIONS)
    if not builds_mask and torch.compiler.is_compiling() and _PASSED_WHOLE not in _logged:
        mask = model_calls.argument(args, kwargs, "attention_mask", 1)
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[2] > 1:  # what key_padding passes whole
            _log_outside_graph(_PASSED_WHOLE)  # here, at the model call: no break in the layers
    _CALLS.push(_Call(module, builds_mask))  # popped by the post hook, always


def _call_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    _CALLS.pop(module)


def _is_mpnet_model(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "MPNetModel" and cls.__module__.startswith(_MODULE)


def install_call_hooks(model: nn.Module) -> None:
    """The call hooks on every ``MPNetModel`` of the tree (the module that builds the mask) whose
    layers hold Tempo's MPNet attention and that lacks them. Idempotent."""
    for module in model.modules():
        if _is_mpnet_model(module) and any(isinstance(m, MPNetEfficientSelfAttention) for m in module.modules()):
            model_calls.install(module, _call_pre_hook, _call_post_hook)


def remove_call_hooks(model: nn.Module) -> None:
    """Take the call hooks out of every module of the tree: the entries whose function is this
    module's hook (by identity; a user's hooks stay), as their RemovableHandle would."""
    model_calls.remove(model.modules(), _call_pre_hook, _call_post_hook)


# -- the position bias once per forward, not per batch element (one of the recipe's model hooks) -----
def shared_position_bias(encoder: nn.Module, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                         num_buckets: int = 32) -> torch.Tensor:
    """``MPNetEncoder.compute_position_bias`` without the copy per batch element: [1, heads, S, S]
    (contiguous). With ``position_ids`` (per-sample positions) the original's per-sample bias."""
    cls = type(encoder)
    if position_ids is not None:
        return cls.compute_position_bias(encoder, x, position_ids, num_buckets)
    positions = torch.arange(x.size(1), dtype=torch.long, device=x.device)
    relative = positions[None, :] - positions[:, None]  # memory - context, as the original
    bucket = cls.relative_position_bucket(relative, num_buckets=num_buckets)
    return encoder.relative_attention_bias(bucket).permute(2, 0, 1).unsqueeze(0).contiguous()


def _bias_matches(encoder: nn.Module) -> bool:
    """The shared bias, broadcast over a batch of 2, equals the original's (a transformers version
    computing another bias is left with its own)."""
    weight = encoder.relative_attention_bias.weight
    if weight.is_meta or isinstance(weight, FakeTensor):  # a structure-only model (tempo.plan): no values to compare
        return True
    with torch.no_grad():
        x = torch.zeros(2, 9, 1, device=weight.device, dtype=weight.dtype)
        want = type(encoder).compute_position_bias(encoder, x)
        got = shared_position_bias(encoder, x)
    return want.shape == (2,) + tuple(got.shape[1:]) and torch.equal(want, got.expand_as(want))


def _holds_shared_bias(encoder: nn.Module) -> bool:
    entry = encoder.__dict__.get(_SHARED_BIAS)
    return isinstance(entry, functools.partial) and entry.func is shared_position_bias


def install_shared_position_bias(model: nn.Module) -> None:
    """Give every ``MPNetEncoder`` whose layers hold Tempo's MPNet attention, and that lacks it, the
    shared bias: an instance attribute (a partial of a module-level function: copied and pickled
    with the model, for the copy's own encoder); the class is untouched. Idempotent."""
    for encoder in model.modules():
        if not _is_mpnet_encoder(encoder) or _SHARED_BIAS in encoder.__dict__:
            continue
        if not any(isinstance(m, MPNetEfficientSelfAttention) for m in encoder.modules()):
            continue
        if not _bias_matches(encoder):
            _log_once(f"{type(encoder).__name__} computes another position bias than the one Tempo shares; its "
                      f"[B, heads, S, S] copy is kept")
            continue
        encoder.__dict__[_SHARED_BIAS] = functools.partial(shared_position_bias, encoder)


def remove_shared_position_bias(model: nn.Module) -> None:
    """Take the shared bias out of every encoder of the tree (found by identity)."""
    for module in model.modules():
        if _holds_shared_bias(module):
            del module.__dict__[_SHARED_BIAS]


# -- the recipe ----------------------------------------------------------------------------------
def check_inputs(original: nn.Module, seq_len: int = 5) -> tuple:
    """Hidden states, MPNet's additive mask with a padded second row (3 real tokens) and a random
    [1, heads, S, S] position bias, as the patched encoder passes them."""
    weight = original.q.weight
    hidden = sample((2, seq_len, original.q.in_features), weight, seed=0)
    real = torch.ones(2, seq_len, dtype=torch.bool, device=weight.device)
    real[1, 3:] = False
    mask = torch.zeros(2, 1, seq_len, seq_len, dtype=weight.dtype, device=weight.device)
    mask.masked_fill_(~real[:, None, None, :], torch.finfo(weight.dtype).min)
    bias = sample((1, original.num_attention_heads, seq_len, seq_len), weight, seed=1)
    return hidden, mask, bias


matches_original = output_check(check_inputs)  # the recipe's check: a padded row, eval mode, dropout off


def _build(old: nn.Module, options: Options) -> nn.Module:
    return MPNetEfficientSelfAttention(old)


def _install_model_hooks(model: nn.Module) -> None:
    install_shared_position_bias(model)
    install_call_hooks(model)


def _remove_model_hooks(model: nn.Module) -> None:
    remove_shared_position_bias(model)
    remove_call_hooks(model)


def mpnet_recipes() -> list[Recipe]:
    """MPNet's attention core, for attention="efficient" (the default)."""
    return [Recipe(kind="MPNet attention",
                   becomes="MPNetEfficientSelfAttention (O(s): the relative position bias as efficient_attention's "
                           "attn_bias, shared by the batch)",
                   option="attention", replacement=MPNetEfficientSelfAttention, recognise=is_mpnet_self_attention,
                   build=_build, check=matches_original, restore=restore_children,
                   enabled=lambda options: options.attention == "efficient",
                   model_hook=_install_model_hooks, model_unhook=_remove_model_hooks)]


__all__ = ["MPNetEfficientSelfAttention", "check_inputs", "current_call", "install_call_hooks",
           "install_shared_position_bias", "is_mpnet_self_attention", "key_padding", "matches_original",
           "mpnet_recipes", "remove_call_hooks", "remove_shared_position_bias", "shared_position_bias"]
