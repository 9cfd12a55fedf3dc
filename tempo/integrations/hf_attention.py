"""Tempo's attentions as transformers attention implementations: "tempo" and "tempo_efficient".

Models whose attention layers dispatch through ``ALL_ATTENTION_FUNCTIONS`` (BERT, RoBERTa,
ELECTRA, DistilBERT, GPT-2, Llama, T5, ... in recent transformers) call the function registered
under ``config._attn_implementation``. ``register_tempo_attention()`` registers

  * ``tempo_attention_forward`` ("tempo") with ``AttentionInterface``: scores = q·kᵀ·scaling
    (+ position_bias) + mask, then ``combined_softmax_dropout_matmul`` with v, which keeps only the
    softmax output, v and a seed for backward (eager attention also keeps the dropout mask and the
    dropout output);
  * ``tempo_efficient_attention_forward`` ("tempo_efficient"): ``tempo.efficient_attention``, O(s)
    kept per row; a position_bias goes in as its ``attn_bias`` (kept as given, shared by the batch,
    its gradient summed into its own shape);
  * the mask functions eager and sdpa attention use with ``AttentionMaskInterface``. Without them,
    transformers 5.x builds no mask at all for an unknown implementation name: padding would be
    silently ignored.

Keyword arguments (transformers 5.17 to 5.24, every model's call scanned; the lists are
``IMPLEMENTED_ARGUMENTS``, ``NO_EFFECT_ARGUMENTS``, ``EAGER_ONLY_ARGUMENTS``, ``REFUSED_ARGUMENTS``):
scaling, dropout, is_causal, head_mask and ``position_bias`` (T5 and its kin: scores·scaling +
position_bias + mask, eager's order) are computed; the packing arguments are read (below);
``sliding_window`` and flash-only switches change nothing eager computes (the window is in the
mask). ``softcap`` (Gemma-2) and attention sinks (``s_aux``, ``sinks``: GPT-OSS) are not computed:
such a call runs the model's own eager attention, logged once per argument, as does any argument
not on these lists unless it is None. ``indices`` / ``block_indices`` (sparse attention whose
sparsity the model builds into the mask only for "eager" and "sdpa") raise ValueError.

Attention weights: Tempo's attentions keep no probabilities, so a call that asks for them
(``output_attentions=True``, which transformers 5.x records with output-capturing hooks and older
versions pass as a keyword) runs the model's own eager attention for that call instead, logged
once on ``logging.getLogger("tempo.integrations.hf_attention")``, and returns its weights, as an
unpatched eager model would. Without this, transformers would hand back an empty tuple. Eager
attention *adds* its mask to the scores, so it gets the additive mask eager's own mask function
builds (0 where a key is attended, ``finfo(dtype).min`` where not): "tempo" registers eager's mask
function, so its mask already is that; "tempo_efficient" registers sdpa's (a boolean mask, or
None when causality or nothing masks), which ``eager_attention_mask`` turns into eager's: the same
boolean pattern (padding, causality, sliding windows) as 0 / min, a causal mask built when sdpa's
function left causality to ``is_causal``, None where nothing is masked. The dtype is that of the
module's parameters, which is what eager's mask function gets (the embeddings' output dtype).
``accept_output_attentions`` lets ``config.output_attentions = True`` be set on a patched model
(transformers 5.x refuses it for any implementation but "eager"): apply_tempo gives the config an
instance-level subclass (same name, same fields; pickled and copied as itself) whose setter and
validation accept Tempo's implementations, and revert_tempo gives the original class back.

Padding-free batches (sequences packed back to back, as ``DataCollatorWithFlattening`` makes
them): transformers passes ``position_ids`` (restarting at each sequence's first token) and, with
``return_flash_attn_kwargs=True``, ``cu_seq_lens_q/k`` down to the attention function, but its
eager and sdpa attention of encoder models read neither: up to transformers 5.24 every token
attends across the sequence boundaries, silently (from 5.25 the encoders' mask builder packs from
``position_ids`` when no 2D mask is given, a dense [B, 1, L, L] mask; "tempo_efficient"'s mask
function returns None for a mask that only packs, ``_efficient_mask_function``). Tempo's attentions read them: ``cu_seq_lens_q`` when given, else boundaries
wherever a position is not the previous one + 1 (any start, so RoBERTa's ``padding_idx + 1``
works). Then "tempo_efficient" runs ``efficient_attention_varlen`` (O(T) kept, Σ L² work, causal
per sequence for decoders) when no other mask or bias applies, and both attentions otherwise AND
the block-diagonal packing into the mask they got (GPT-2's packed causal mask from transformers
already is; for it that changes nothing). Where it is read: once per model call, by the call hooks
apply_tempo's attention switch puts on every transformers model of the tree (``install_call_hooks``:
module-level functions, found again by identity on revert), outside any torch.compile graph; the
layers take it from a thread-local call stack, so they make no host read and torch.compile traces
them whole. Only the model's own arguments are read there (transformers models hand their layers
the call's position_ids, or ones counting up from the cache length). A layer run outside a hooked
call (the function called on its own; a layer recomputed by gradient checkpointing in backward)
reads its own position_ids / cu_seq_lens (``packed_sequences``), once per tensor.

Versions: ``AttentionInterface`` appeared in transformers 4.50 and ``AttentionMaskInterface`` in
4.53; before 4.53 each model builds its own eager-style additive mask, so registering the
attention function is enough there. BERT-family models dispatch through the interface from about
4.54 (DistilBERT a little later); ``model_dispatches_attention`` checks the model's own source
instead of trusting a version number. Tested with transformers 5.17 and 5.25; the 4.5x paths (no mask
interface, GPT-2 layers that apply their causal mask inside eager attention) are written from
those versions' APIs but not run here.
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from tempo.integrations import model_calls
from tempo.ops.attention import expand_kv_heads
from tempo.ops.combined import combined_softmax_dropout_matmul

logger = logging.getLogger("tempo.integrations.hf_attention")

TEMPO_ATTENTION = "tempo"  # the paper's Combined softmax -> dropout -> matmul
TEMPO_EFFICIENT_ATTENTION = "tempo_efficient"  # tempo.efficient_attention: O(s) kept per row
TEMPO_IMPLEMENTATIONS = (TEMPO_ATTENTION, TEMPO_EFFICIENT_ATTENTION)
MIN_ATTENTION_INTERFACE_VERSION = "4.50"
MIN_MASK_INTERFACE_VERSION = "4.53"


def transformers_version() -> Optional[str]:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def _attention_interface():
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return None
    return AttentionInterface


def _mask_interface():
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return None
    return AttentionMaskInterface


def require_attention_interface() -> None:
    """Raise ImportError unless transformers can dispatch to a registered attention function."""
    version = transformers_version()
    if version is None:
        raise ImportError("Tempo attention for HF models needs transformers "
                          f">= {MIN_ATTENTION_INTERFACE_VERSION}, which is not installed; "
                          "apply_tempo(model, attention=False) still patches GELU and LayerNorm")
    if _attention_interface() is None:
        raise ImportError(f"Tempo attention needs transformers >= {MIN_ATTENTION_INTERFACE_VERSION} "
                          f"(AttentionInterface); transformers {version} is installed. "
                          "apply_tempo(model, attention=False) still patches GELU and LayerNorm")


def register_tempo_attention() -> None:
    """Register "tempo" and "tempo_efficient" with the attention (and, where it exists, the mask)
    interface. Idempotent."""
    require_attention_interface()
    _attention_interface().register(TEMPO_ATTENTION, tempo_attention_forward)
    _attention_interface().register(TEMPO_EFFICIENT_ATTENTION, tempo_efficient_attention_forward)
    masks = _mask_interface()
    if masks is not None:
        # "tempo": whatever eager uses in this version, a 4D additive float mask (0 / dtype min).
        masks.register(TEMPO_ATTENTION, masks._global_mapping["eager"])
        # "tempo_efficient": sdpa's, a boolean mask (True = attend), or None when nothing is masked
        # or causality alone masks (then is_causal is used), so fused kernels can take the call.
        masks.register(TEMPO_EFFICIENT_ATTENTION, _efficient_mask_function(masks._global_mapping["sdpa"]))


def _efficient_mask_function(sdpa_mask: Callable[..., Any]) -> Callable[..., Any]:
    """sdpa's mask function for "tempo_efficient", less the mask that only packs.

    From transformers 5.25 the mask builders read ``position_ids`` themselves: for a padding-free
    batch without a 2D mask they AND the block-diagonal packing into the base mask, so an encoder
    hands its layers a dense [B, 1, L, L] mask where 5.17-5.24 handed None. Tempo's layers know the
    packing already (the call hook read it) and run the variable-length op only without a mask. So
    when the current call is packed, no 2D mask was given, and the mask function is nothing but
    transformers' packing over a bidirectional or causal base (``_only_packing``: its composition
    read from the closures, no tensor read, nothing for a host or torch.compile to wait on), this
    returns None: the layers apply the packing (and causality, by ``is_causal``) themselves, exactly.
    Anything else (padding, windows, chunks, a user's overlay, a compiled trace) gets sdpa's mask."""

    def mask_function(*args: Any, **kwargs: Any) -> Any:
        if not args and not torch.compiler.is_compiling() and kwargs.get("attention_mask") is None:
            call = _current_call()
            packing = call.packing if call is not None else None
            if (isinstance(packing, tuple) and tuple(packing[1].shape[:2]) == (
                    kwargs.get("batch_size"), kwargs.get("q_length")) and kwargs.get("kv_length") ==
                    kwargs.get("q_length") and not kwargs.get("q_offset") and not kwargs.get("kv_offset")
                    and _only_packing(kwargs.get("mask_function"))):
                return None
        return sdpa_mask(*args, **kwargs)

    mask_function.__wrapped__ = sdpa_mask
    return mask_function


_BASE_MASKS = ("bidirectional_mask_function", "causal_mask_function")  # what the layers apply without a mask
_COMPOSERS = ("and_masks.", "remap_positions_for_packed_sequence.")  # closures over other mask functions
_PACKING = "packed_sequence_mask_function."


def _only_packing(mask_function: Any) -> bool:
    """True when ``mask_function`` is transformers' packed-sequence mask ANDed with a bidirectional
    or causal base, nothing more (qualnames in ``transformers.masking_utils``; the composers' closures
    walked down to their leaves)."""
    todo, packs = [mask_function], False
    while todo:
        fn = todo.pop()
        name = getattr(fn, "__qualname__", "")
        if not callable(fn) or getattr(fn, "__module__", None) != "transformers.masking_utils":
            return False
        if name.startswith(_PACKING):
            packs = True
        elif name.startswith(_COMPOSERS):
            for cell in fn.__closure__ or ():
                value = cell.cell_contents
                if callable(value):
                    todo.append(value)
                elif isinstance(value, tuple):
                    todo.extend(value)
        elif name not in _BASE_MASKS:
            return False
    return packs


def _modeling_file_dispatches(module_name: str) -> bool:
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (OSError, TypeError, KeyError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def _is_hf_modeling_module(module_name: str) -> bool:
    # transformers' own models, and remote-code models (trust_remote_code loads them as transformers_modules.*)
    return module_name.startswith(("transformers.models.", "transformers_modules."))


def model_dispatches_attention(model: nn.Module) -> bool:
    """True when ``model`` has HF attention layers and each comes from a modeling file that routes
    attention through the interface (so ``config._attn_implementation`` decides what runs).

    The same source heuristic transformers uses for ``set_attn_implementation``: a modeling file
    that defines attention layers but never calls ``ALL_ATTENTION_FUNCTIONS`` computes attention
    itself (DeBERTa-v2's DisentangledSelfAttention) and would ignore the setting. Only the files
    of attention layers (class names containing "Attention") are judged, not the file of the
    model's root or heads; a model with no such layer does not dispatch (nothing would run Tempo's
    attention).
    """
    verdicts: dict[str, bool] = {}
    for module in model.modules():
        cls = type(module)
        if "Attention" not in cls.__name__ or not _is_hf_modeling_module(cls.__module__):
            continue
        if cls.__module__ not in verdicts:
            verdicts[cls.__module__] = _modeling_file_dispatches(cls.__module__)
        if not verdicts[cls.__module__]:
            return False
    return bool(verdicts)


# ---------------------------------------------------------------------------------------------
# config.output_attentions = True on a patched model
# ---------------------------------------------------------------------------------------------
_BASE_CONFIG_CLASS = "_tempo_base_config_class"  # on an accepting subclass: the class it extends
_ACCEPTING_CLASSES: dict[type, type] = {}


def _rebuild_config(base: type) -> Any:
    """pickle/copy: an empty instance of ``base``'s accepting subclass (its state is set after)."""
    return object.__new__(_accepting_class(base))


def _accepting_class(base: type) -> type:
    """A subclass of the config class ``base`` whose ``output_attentions`` setter and validation
    accept Tempo's implementations (transformers 5.x accepts only "eager"): under them a call that
    asks for weights runs the model's eager attention, so the weights are eager's."""
    if base in _ACCEPTING_CLASSES:
        return _ACCEPTING_CLASSES[base]
    stock = getattr(base, "output_attentions")

    def set_output_attentions(self, value: bool) -> None:
        if value and self._attn_implementation in TEMPO_IMPLEMENTATIONS:
            self.__dict__["_output_attentions"] = value  # what transformers' setter stores
            if stock.fget(self) != value:
                raise RuntimeError(f"tempo: {base.__name__}.output_attentions does not read back what was set "
                                   "in this transformers version; set output_attentions=True per call instead")
            return
        stock.fset(self, value)

    def validate(self) -> None:
        wanted = self.__dict__.get("_output_attentions")
        if not (wanted and self._attn_implementation in TEMPO_IMPLEMENTATIONS):
            return base.validate(self)
        # The one validator that looks at output_attentions refuses every implementation but eager's:
        # validate everything else as it is, with that flag off for the duration.
        self.__dict__["_output_attentions"] = False
        try:
            return base.validate(self)
        finally:
            self.__dict__["_output_attentions"] = wanted

    def reduce_ex(self, protocol: int) -> Any:
        reduced = base.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[1][:1] == (type(self),):
            return (_rebuild_config, (base,)) + tuple(reduced[2:])
        return reduced

    namespace = {
        "output_attentions": property(stock.fget, set_output_attentions, doc=stock.__doc__),
        "__reduce_ex__": reduce_ex,
        _BASE_CONFIG_CLASS: base,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,  # transformers finds model classes by the config's class name
        "__doc__": base.__doc__,
    }
    if callable(getattr(base, "validate", None)):
        namespace["validate"] = validate
    cls = type(base.__name__, (base,), namespace)
    _ACCEPTING_CLASSES[base] = cls
    return cls


def accept_output_attentions(config: Any) -> Optional[type]:
    """Give ``config`` (one instance) the accepting subclass; returns the class revert must give
    back, or None when nothing changed (already accepting, or a transformers whose
    ``output_attentions`` is a plain attribute that accepts anything)."""
    cls = type(config)
    if _BASE_CONFIG_CLASS in cls.__dict__:
        return None
    stock = getattr(cls, "output_attentions", None)
    if not isinstance(stock, property) or stock.fset is None:
        return None
    config.__class__ = _accepting_class(cls)
    return cls


def restore_config_class(config: Any, original: type) -> None:
    """Undo ``accept_output_attentions``."""
    config.__class__ = original


def _default_scaling(module: nn.Module, head_dim: int) -> float:
    # GPT-2 in transformers 4.4x did not pass `scaling`: it is implied by these attributes.
    if hasattr(module, "scale_attn_weights"):
        scaling = head_dim ** -0.5 if module.scale_attn_weights else 1.0
        if getattr(module, "scale_attn_by_inverse_layer_idx", False):
            scaling /= float(module.layer_idx + 1)
        return scaling
    return head_dim ** -0.5


def attention_weights_requested(kwargs: dict[str, Any]) -> bool:
    """Whether the running forward asks for attention weights: an ``output_attentions`` keyword
    (transformers 4.x), or transformers 5.x's output collector recording "attentions"."""
    if kwargs.get("output_attentions"):
        return True
    if torch.compiler.is_compiling():
        # Dynamo does not trace ContextVar reads, and transformers' output capture does not run
        # under torch.compile either: nothing to detect there.
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    try:
        collected = _active_collector.get()
    except LookupError:
        return False
    return isinstance(collected, dict) and "attentions" in collected


_fallback_logged = False  # the attention-weights fallback, logged once
_logged_arguments: set[str] = set()  # the arguments whose eager fallback was logged (once each)

# ---------------------------------------------------------------------------------------------
# The keyword arguments of a call, by what Tempo's attentions do with them
# ---------------------------------------------------------------------------------------------
# Found by scanning transformers 5.17 and 5.24 (every models/*/modeling_*.py call of
# attention_interface(...), the parameters of each eager_attention_forward and what it reads, the
# TransformersKwargs and FlashAttentionKwargs a model's forward hands down, and sdpa_attention_forward).
# Computed here: scaling, dropout, head_mask (named parameters) and
IMPLEMENTED_ARGUMENTS = frozenset({
    "is_causal",  # causality where the mask leaves it to the flag (sdpa's mask function)
    "position_bias",  # T5, LongT5, mT5, UMT5, UDOP, Pix2Struct, LayoutLMv3, ...: added to the scores as eager does
    "output_attentions",  # weights asked for: the model's eager attention for that call
    "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",  # padding-free batches
})
# Change nothing eager computes (eager ignores them as well): the mask already holds them, or they
# steer other kernels or other parts of the model.
NO_EFFECT_ARGUMENTS = frozenset({
    "sliding_window",  # transformers' mask functions build the window into the mask for eager and sdpa
    "encoder_hidden_states",  # cross-attention: its keys and values are made from them before the call
    "deterministic",  # flash-attention's determinism switch (ModernBERT)
    "max_seqlen_q", "max_seqlen_k", "block_table", "cache_seqlens",  # flash / paged-attention bookkeeping
    "output_hidden_states", "output_router_logits", "use_cache", "return_dict", "num_items_in_batch", "seq_idx",
    "cache_position", "logits_to_keep",
})
# Change the scores; the model's own eager attention computes them and Tempo's does not: that call
# runs eager attention (logged once per argument). Softcapping is exact only where the scores are
# materialised, and a sink's gradient needs each row's log-sum-exp, which efficient_attention does
# not return.
EAGER_ONLY_ARGUMENTS = {
    "softcap": "Gemma-2-style logit soft-capping, tanh(scores / c) * c",
    "s_aux": "attention sinks (GPT-OSS-style: one logit per head in every row's softmax)",
    "sinks": "attention sinks (one logit per head in every row's softmax)",
}
# Stand for sparsity that the model builds into the mask only when its implementation is "eager"
# or "sdpa": under any other name neither Tempo's nor eager attention would apply it.
REFUSED_ARGUMENTS = {
    "indices": "DeepSeek-V3.2-style sparse attention's top-k keys",
    "block_indices": "block-sparse attention's selected key blocks",
}


def _eager_only_arguments(kwargs: dict[str, Any]) -> list[str]:
    """The arguments of this call that only the model's eager attention computes (see above; any
    argument not named above counts, unless it is None). Raises ValueError for a refused one."""
    found = []
    for name, value in kwargs.items():
        if value is None or name in IMPLEMENTED_ARGUMENTS or name in NO_EFFECT_ARGUMENTS:
            continue
        if name in REFUSED_ARGUMENTS:
            raise ValueError(f"tempo attention: argument '{name}' ({REFUSED_ARGUMENTS[name]}) is given: the model "
                             f"builds that sparsity into the attention mask only under attn_implementation "
                             f"'eager' or 'sdpa', so Tempo's attention (and eager's, which ignores '{name}') would "
                             f"attend every key; patch this model with apply_tempo(model, attention=False)")
        found.append(name)
    return found


def _log_argument_fallback(name: str, value: Any) -> None:
    if name in _logged_arguments:
        return
    _logged_arguments.add(name)
    what = EAGER_ONLY_ARGUMENTS.get(name, "an argument Tempo's attention does not know")
    if isinstance(value, Tensor):
        given = f"{name} (a tensor of shape {tuple(value.shape)})"
    else:
        given = f"{name}={value!r}"[:80]
    logger.warning("tempo attention: this call passes %s: %s, which Tempo's attention does not compute; running "
                   "the model's own eager attention for such calls (they keep the full attention matrix for "
                   "backward)", given, what)


def _eager_function(module: nn.Module, needs_own: list[str]) -> Callable[..., tuple[Tensor, Optional[Tensor]]]:
    """The eager attention of the module's own modeling file, else the generic one below, which
    computes position_bias and softcap but nothing else: then arguments only the model's own
    eager would compute are refused (ValueError naming them)."""
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if callable(own):
        return own
    unknown = [name for name in needs_own if name != "softcap"]
    if unknown:
        raise ValueError(f"tempo attention: argument(s) {', '.join(repr(n) for n in unknown)} of "
                         f"{type(module).__name__}'s attention call are not computed by Tempo's attention, and its "
                         f"modeling file ({type(module).__module__}) has no eager_attention_forward to run instead; "
                         f"patch this model with apply_tempo(model, attention=False)")
    return _generic_eager


def _generic_eager(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                   scaling: Optional[float] = None, dropout: float = 0.0, position_bias: Optional[Tensor] = None,
                   softcap: Optional[float] = None, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """transformers' eager attention (T5's position_bias, Gemma-2's softcap in their order)."""
    if key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = nn.functional.dropout(torch.softmax(scores, dim=-1).to(value.dtype), p=dropout,
                                    training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _eager_mask_dtype(module: nn.Module, query: Tensor) -> torch.dtype:
    # Eager's mask function gets the embeddings' output dtype: the parameters' dtype, also under autocast.
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return query.dtype


def eager_attention_mask(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Optional[Tensor],
                         is_causal: bool) -> Optional[Tensor]:
    """The additive mask the model's eager attention expects, from the mask its Tempo attention got.

    A float mask is eager's already ("tempo" registers eager's mask function) and is returned as it
    is. A boolean one (sdpa's, True = attend; "tempo_efficient") becomes 0 / ``finfo(dtype).min``,
    as eager's mask function converts it. None with ``is_causal``: sdpa's function left causality
    to the flag (no padding, q_len == k_len or q_len == 1), so the causal mask is built here,
    bottom-right aligned as transformers' cache positions are. None otherwise: nothing is masked.
    """
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return attention_mask
    q_len, k_len = query.shape[-2], key.shape[-2]
    keep = attention_mask
    if keep is None:
        if not is_causal or q_len == 1:
            return None
        keep = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)[None, None]
    dtype = _eager_mask_dtype(module, query)
    return torch.where(keep, torch.zeros((), dtype=dtype, device=keep.device), torch.finfo(dtype).min)


# The packing of the batch being run: (weak references to the tensors it was read from, their
# (version, data pointer), the call's (batch, length, device), the answer). Every layer of a
# forward gets the same position_ids / cu_seq_lens tensors, so one slot is enough: the host read
# happens once per tensor, not per layer.
_packed_cache: list = []
_packing_mask_cache: list = []  # [(weak reference to cu, its state, tokens, batch, device, the mask)]


def _tensor_state(t: Tensor) -> tuple[int, int]:
    return t._version, t.data_ptr()


def _packed_lookup(tensors: tuple[Tensor, ...], extra: tuple) -> tuple[bool, Any]:
    if _packed_cache:
        refs, states, cached_extra, answer = _packed_cache[0]
        if (cached_extra == extra and len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors))
                and states == tuple(_tensor_state(t) for t in tensors)):
            return True, answer
    return False, None


def _packed_store(tensors: tuple[Tensor, ...], extra: tuple, answer: Any) -> None:
    _packed_cache[:] = [(tuple(weakref.ref(t) for t in tensors), tuple(_tensor_state(t) for t in tensors), extra,
                         answer)]


def _cu_from_positions(position_ids: Tensor, batch: int) -> Optional[tuple[Tensor, int]]:
    """(cu_seqlens int32, max length) over the flattened [B·L] tokens: a sequence starts at each
    row start and wherever a position is not the previous one + 1. None when every row is one
    sequence (nothing is packed). One host read (the start flags) per position tensor: every layer
    of a forward gets the same tensor object, so the answer is cached for that object (and its
    version) only. The offsets are recorded with the attention ops (``remember_sequences``), so
    the variable-length attention reads nothing more."""
    hit, answer = _packed_lookup((position_ids,), ("positions", batch))
    if hit:
        return answer
    pos = position_ids.reshape(-1, position_ids.shape[-1]).long()
    if pos.shape[0] != batch:  # one row of positions shared by the batch
        pos = pos.expand(batch, pos.shape[1])
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    flat = starts.reshape(-1)
    begins = flat.cpu().numpy().nonzero()[0]  # the one host read
    answer = None
    if len(begins) != pos.shape[0]:
        from tempo.ops.attention import remember_sequences

        # The same starts on the device, without another transfer: a stable sort puts the flagged
        # positions first, in order; the row end is appended as a constant (no host-to-device copy).
        begin = torch.sort(flat.to(torch.uint8), stable=True, descending=True).indices[:len(begins)]
        cu = torch.nn.functional.pad(begin, (0, 1), value=flat.numel()).to(torch.int32)
        facts = remember_sequences(cu, [int(b) for b in begins] + [flat.numel()])
        answer = (cu, facts.max_seqlen)
    _packed_store((position_ids,), ("positions", batch), answer)
    return answer


def _cu_from_kwargs(cu_q: Tensor, cu_k: Optional[Tensor], batch: int, q_len: int,
                    device: torch.device) -> tuple[Tensor, int]:
    """(cu_seqlens int32 on ``device``, max length) from transformers' cu_seq_lens_q/k, checked
    (equal, one packed row ending at its length) with one host read per pair of tensors."""
    tensors = (cu_q,) if cu_k is None else (cu_q, cu_k)
    extra = ("cu", batch, q_len, device)
    hit, answer = _packed_lookup(tensors, extra)
    if hit:
        return answer
    flat_q = cu_q.reshape(-1)
    both = flat_q if cu_k is None else torch.cat([flat_q, cu_k.reshape(-1).to(flat_q.device, flat_q.dtype)])
    host = [int(o) for o in both.tolist()]  # the one host read
    offsets, offsets_k = host[:flat_q.numel()], host[flat_q.numel():]
    if cu_k is not None and offsets_k != offsets:
        raise ValueError("tempo attention: cu_seq_lens_q and cu_seq_lens_k differ; packed cross-attention "
                         "is not supported")
    if batch != 1 or offsets[-1] != q_len:
        raise ValueError(f"tempo attention: cu_seq_lens_q ends at {offsets[-1]} but the packed row has "
                         f"{q_len} tokens in a batch of {batch} (DataCollatorWithFlattening packs one row)")
    from tempo.ops.attention import remember_sequences

    cu = cu_q.to(device=device, dtype=torch.int32)
    facts = remember_sequences(cu, offsets)
    answer = (cu, facts.max_seqlen)
    _packed_store(tensors, extra, answer)
    return answer


def packed_sequences(query: Tensor, key: Tensor, kwargs: dict[str, Any]) -> Optional[tuple[Tensor, int]]:
    """(cu_seqlens, max_seqlen) when the call's tokens are several sequences packed back to back
    (see the module docstring), else None. Only for self-attention over the whole packed row
    (q_len == k_len; a cached decode step is never packed). One host read per position_ids or
    cu_seq_lens tensor (a forward), none per layer."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    if q_len != k_len or q_len <= 1:
        return None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return _cu_from_kwargs(cu, kwargs.get("cu_seq_lens_k"), query.shape[0], q_len, query.device)
    position_ids = kwargs.get("position_ids")
    if not isinstance(position_ids, Tensor) or position_ids.shape[-1] != q_len:
        return None
    if position_ids.numel() not in (q_len, query.shape[0] * q_len):
        return None
    found = _cu_from_positions(position_ids, query.shape[0])
    if found is None:
        return None
    if found[0].device != query.device:
        from tempo.ops.attention import remember_sequences, sequence_facts

        moved = found[0].to(query.device)
        remember_sequences(moved, sequence_facts(found[0]).offsets)
        return moved, found[1]
    return found


def packing_of_call(batch: int, length: int, kwargs: dict[str, Any], position_ids: Optional[Tensor],
                    device: torch.device) -> Optional[tuple[Tensor, int]]:
    """(cu_seqlens int32 on ``device``, max length) of a model call's padding-free batch — its
    ``cu_seq_lens_q`` (and _k), else ``position_ids`` restarting — or None when it is not packed.
    For models whose attention does not see those arguments (DeBERTa): read at the model's call,
    with the same rules and caches as ``packed_sequences``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return _cu_from_kwargs(cu, kwargs.get("cu_seq_lens_k"), batch, length, device)
    if not isinstance(position_ids, Tensor) or position_ids.shape[-1] != length or length <= 1:
        return None
    if position_ids.numel() not in (length, batch * length):
        return None
    found = _cu_from_positions(position_ids, batch)
    if found is None or found[0].device == device:
        return found
    from tempo.ops.attention import remember_sequences, sequence_facts

    moved = found[0].to(device)
    remember_sequences(moved, sequence_facts(found[0]).offsets)
    return moved, found[1]


def _same_sequence(cu: Tensor, tokens: int, batch: int, device: torch.device) -> Tensor:
    """Bool [B, 1, L, L]: True where query and key are in the same packed sequence (on the device,
    no host read)."""
    seq = torch.zeros(batch * tokens, dtype=torch.int64, device=device)
    seq[cu[1:-1].long()] = 1
    seq = seq.cumsum(0).reshape(batch, tokens)
    return (seq[:, :, None] == seq[:, None, :]).unsqueeze(1)


def _packing_mask(cu: Tensor, tokens: int, batch: int, device: torch.device) -> Tensor:
    """``_same_sequence``, made once per cu_seqlens tensor: every layer gets the same one. Under
    torch.compile it is made in the graph (the cache compares weak references and data pointers)."""
    if torch.compiler.is_compiling():
        return _same_sequence(cu, tokens, batch, device)
    if _packing_mask_cache:
        ref, state, cached_tokens, cached_batch, cached_device, mask = _packing_mask_cache[0]
        if (ref() is cu and state == _tensor_state(cu) and (cached_tokens, cached_batch, cached_device)
                == (tokens, batch, device)):
            return mask
    mask = _same_sequence(cu, tokens, batch, device)
    _packing_mask_cache[:] = [(weakref.ref(cu), _tensor_state(cu), tokens, batch, device, mask)]
    return mask


def _with_packing(mask: Optional[Tensor], same: Tensor) -> Tensor:
    """``mask`` (None, bool True = attend, or additive) with every cross-sequence pair masked."""
    if mask is None:
        return same
    if mask.dtype == torch.bool:
        return mask & same
    return torch.where(same, mask, torch.finfo(mask.dtype).min)  # broadcasts a [B, 1, 1, L] mask too


# ---------------------------------------------------------------------------------------------
# What one model call tells its attention layers: the call hooks
# ---------------------------------------------------------------------------------------------
# apply_tempo's attention switch puts these module-level functions on every transformers model of
# the tree whose attention it switches (head and base); revert finds them again by identity. No
# handle, no closure: a deep copy or a pickled model carries its own, nothing refers to another
# model. The packing of a call (a padding-free batch) is read once, at the call, outside any
# torch.compile graph; the layers read it from the call stack and make no host read.
_PER_LAYER = "per layer"  # a call whose packing could not be read at the call: each layer reads its own


class _Call:
    """One call of a model with Tempo's attention, running in this thread."""

    def __init__(self, owner: nn.Module, sources: tuple, packing: Any):
        self.owner = owner
        self.sources = sources  # (position_ids, cu_seq_lens_q) of the call: an inner call given the same inherits
        # None (not packed), _PER_LAYER, or (cu_seqlens int32 over the B·L tokens, then three empty tensors whose
        # sizes are the call's [batch, row length], [longest sequence] and [shortest sequence]: sizes, which
        # torch.compile keeps symbolic, where ints read by the layers would be guarded on, one graph per value).
        self.packing = packing


_CALLS = model_calls.CallStack()


def _current_call() -> Optional[_Call]:
    return _CALLS.current()


def _empty_of_size(like: Tensor, *sizes: int) -> Tensor:
    return like.new_empty((*sizes, 0))


@torch.compiler.disable
def _packing_from_call(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The packing of a model call (see ``_Call.packing``), read with ``packing_of_call``'s rules
    from its arguments (input_ids or inputs_embeds for the batch and row length; position_ids;
    cu_seq_lens_q/k). One host read at most (cached per tensor), and torch.compile runs it outside
    the graph: a break before the model's first op, none in its layers."""
    try:
        signature = inspect.signature(module.forward)
        bound = dict(signature.bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return _PER_LAYER
    found = {}
    for name, parameter in signature.parameters.items():  # the **kwargs a model's forward takes, flattened
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            found.update(bound.pop(name, {}))
    found.update(bound)
    ids = found.get("input_ids")
    if not isinstance(ids, Tensor):
        ids = found.get("inputs_embeds")
    position_ids, cu = found.get("position_ids"), found.get("cu_seq_lens_q")
    if position_ids is None and cu is None:
        return None
    if not isinstance(ids, Tensor) or ids.dim() < 2:
        return _PER_LAYER  # no batch and row length to read the packing against: each layer reads its own
    batch, length = ids.shape[0], ids.shape[1]
    packing = packing_of_call(batch, length, found, position_ids, ids.device)
    if packing is None:
        return None
    cu_seqlens, longest = packing
    from tempo.ops.attention import sequence_facts

    shortest = sequence_facts(cu_seqlens).min_seqlen  # remembered by packing_of_call: no host read
    return (cu_seqlens, _empty_of_size(cu_seqlens, batch, length), _empty_of_size(cu_seqlens, longest),
            _empty_of_size(cu_seqlens, shortest))


def _call_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    outer = _CALLS.current()
    position_ids, cu = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    if outer is not None and (position_ids is None or position_ids is outer.sources[0]) and (
            cu is None or cu is outer.sources[1]):
        sources, packing = outer.sources, outer.packing  # a base model called by its head with the same batch
    elif position_ids is None and cu is None and len(args) <= 1:
        sources, packing = (None, None), None  # nothing that could pack (input_ids is the only positional one)
    else:
        sources, packing = (position_ids, cu), _packing_from_call(module, args, kwargs)
    _CALLS.push(_Call(module, sources, packing))  # popped by the post hook, always


def _call_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    _CALLS.pop(module)


def _hooked(module: nn.Module) -> bool:
    return model_calls.hooked(module, _call_pre_hook)


def install_call_hooks(model: nn.Module) -> list[nn.Module]:
    """The call hooks on every transformers model of the tree (head and base) whose attention is
    Tempo's and that lacks them; returns the modules that got them (what ``remove_call_hooks``
    takes them out of)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    hooked = []
    for module in model.modules():
        config = module.__dict__.get("config")
        if (isinstance(module, PreTrainedModel) and getattr(config, "_attn_implementation", None)
                in TEMPO_IMPLEMENTATIONS and model_calls.install(module, _call_pre_hook, _call_post_hook)):
            hooked.append(module)
    return hooked


def remove_call_hooks(modules) -> None:
    """Take the call hooks out of ``modules``: the entries whose function is this module's hook
    (by identity; a user's hooks stay), as their RemovableHandle would."""
    model_calls.remove(modules, _call_pre_hook, _call_post_hook)


def _layer_packing(query: Tensor, key: Tensor, kwargs: dict[str, Any]) -> Optional[tuple[Tensor, int, Optional[int]]]:
    """(cu_seqlens on the queries' device, longest, shortest or None) when this layer's tokens are
    packed sequences, else None. Inside a hooked model call: the call's packing, when this layer
    runs over the call's whole rows (self-attention, q_len == k_len == the row length, the same
    batch); no host read, nothing torch.compile breaks on. Outside one (the function called on its
    own, or a layer recomputed by gradient checkpointing in backward): the layer's own position_ids
    or cu_seq_lens (``packed_sequences``), with one host read per tensor."""
    call = _current_call()
    if call is None or call.packing is _PER_LAYER:
        found = packed_sequences(query, key, kwargs)
        return None if found is None else (found[0], found[1], None)
    if call.packing is None:
        return None
    cu, rows, longest, shortest = call.packing
    q_len = query.shape[-2]
    if q_len != key.shape[-2] or q_len <= 1 or query.shape[0] != rows.shape[0] or q_len != rows.shape[1]:
        return None
    if cu.device != query.device:  # a model spread over devices
        cu = cu.to(query.device)
    return cu, longest.shape[0], shortest.shape[0]


# ---------------------------------------------------------------------------------------------
# The attention functions
# ---------------------------------------------------------------------------------------------
def _attention_forward(core: Callable[..., Tensor], module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Optional[Tensor], scaling: Optional[float], dropout: float,
                       head_mask: Optional[Tensor], kwargs: dict[str, Any]) -> tuple[Tensor, Optional[Tensor]]:
    """What both Tempo attentions share around their core: the eager fallback (a call that asks
    for attention weights or passes an argument only eager computes), grouped-query heads, the
    default scaling, the mask cut to the key length, causality, a position bias, packed sequences
    and a per-head head_mask. ``core(query, key, value, mask, bias, scaling, dropout, is_causal,
    training)`` returns [batch, heads, q_len, head_dim]."""
    if scaling is None:
        scaling = _default_scaling(module, query.shape[-1])
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", False)
    eager_only = _eager_only_arguments(kwargs)
    if eager_only or attention_weights_requested(kwargs):
        return _run_eager(module, query, key, value, attention_mask, scaling, dropout, head_mask, bool(is_causal),
                          eager_only, kwargs)
    query, key, value = _compact_views(query, key, value)
    if key.shape[1] != query.shape[1] and core is not _efficient_core:
        # Grouped-query attention for Combined: each kv head shared by its query heads (repeat_kv's
        # copies). The efficient core takes k and v at their own heads (enable_gqa), never expanded.
        key, value = expand_kv_heads(key, query.shape[1]), expand_kv_heads(value, query.shape[1])
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, : key.shape[-2]]
    bias = kwargs.get("position_bias")
    packed = _layer_packing(query, key, kwargs)
    if packed is not None:
        cu, longest, shortest = packed
        b, h, l, _ = query.shape
        if mask is None and bias is None and core is _efficient_core:
            from tempo.ops.attention import efficient_attention_varlen

            key, value = expand_kv_heads(key, h), expand_kv_heads(value, h)  # the varlen op has no grouped heads
            q, k, v = (x.transpose(1, 2).reshape(b * l, h, x.shape[-1]) for x in (query, key, value))
            out = efficient_attention_varlen(q, k, v, cu, longest, dropout_p=float(dropout), training=module.training,
                                             scale=scaling, is_causal=bool(is_causal), min_seqlen=shortest)
            out = out.reshape(b, l, h, value.shape[-1]).transpose(1, 2)  # head_mask broadcasts on [b, h, l, d]
            if head_mask is not None:
                out = out * _per_head(head_mask)
            return out.transpose(1, 2), None
        if mask is None and is_causal:
            mask = _causal_keep(query, key)  # a mask is made: causality goes into it
        mask = _with_packing(mask, _packing_mask(cu, l, b, query.device))
    out = core(query, key, value, mask, bias, scaling, float(dropout), bool(is_causal), module.training)
    if head_mask is not None:
        out = out * _per_head(head_mask)
    return out.transpose(1, 2), None


def _is_compact(t: Tensor) -> bool:
    """Contiguous, or the [b, s, h, d] -> [b, h, s, d] transpose of a contiguous tensor (one
    projection's output split into heads)."""
    return t.is_contiguous() or t.transpose(1, 2).is_contiguous()


def _compact_views(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v, with a compact copy of v where v alone views a wider buffer. That is the fused-qkv +
    RoPE layout: ModernBERT's v is a slice of the Wqkv output ([b, s, 3, h, d] -> [b, h, s, d], a
    stride of 3·h·d along s) beside RoPE's fresh q and k, and kept as given it would keep q's and k's
    pre-RoPE columns alive too (4 h per layer). Any other layout is passed as it is: for GPT-2's q,
    a view of c_attn's output beside the k and v its cache made, a copy measured 8 h more per layer
    in the ledger (tests/test_patch.py's GPT-2 count), not less."""
    if _is_compact(query) and _is_compact(key) and not _is_compact(value):
        return query, key, value.contiguous()
    return query, key, value


def _run_eager(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
               scaling: float, dropout: float, head_mask: Optional[Tensor], is_causal: bool, eager_only: list[str],
               kwargs: dict[str, Any]) -> tuple[Tensor, Optional[Tensor]]:
    """The model's own eager attention for this call (logged once per reason), with the additive
    mask eager expects and, for a padding-free batch, every cross-sequence pair masked in it."""
    global _fallback_logged
    for name in eager_only:
        _log_argument_fallback(name, kwargs[name])
    if not eager_only and not _fallback_logged:
        _fallback_logged = True
        logger.warning("tempo attention: this call asks for attention weights (output_attentions=True), which "
                       "Tempo attention does not keep; running eager attention for such calls (they keep the "
                       "full attention matrix for backward)")
    eager = _eager_function(module, eager_only)
    if head_mask is not None:
        kwargs["head_mask"] = head_mask
    mask = eager_attention_mask(module, query, key, attention_mask, is_causal)
    packed = _layer_packing(query, key, kwargs)
    if packed is not None:
        b, _, l, _ = query.shape
        same = _packing_mask(packed[0], l, b, query.device)
        if mask is None:
            mask = torch.zeros((), dtype=_eager_mask_dtype(module, query), device=query.device)
        mask = _with_packing(mask[..., : key.shape[-2]] if mask.dim() == 4 else mask, same)
    return eager(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)


def _causal_keep(query: Tensor, key: Tensor) -> Tensor:
    """Bool [1, 1, q_len, k_len]: causality bottom-right aligned (the last query sees every key),
    as transformers' cache positions and eager's masks are."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    return torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)[None, None]


def _per_head(head_mask: Tensor) -> Tensor:
    """Eager multiplies the probabilities by a per-(batch, head) factor; on the output it is the same."""
    if head_mask.dim() < 2 or head_mask.shape[-1] != 1 or head_mask.shape[-2] != 1:
        raise ValueError(f"tempo attention: head_mask of shape {tuple(head_mask.shape)} is not "
                         "per head; only [.., heads, 1, 1] masks are supported")
    return head_mask


def _combined_core(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
                   scaling: float, dropout: float, is_causal: bool, training: bool) -> Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if bias is not None:  # eager's order: scores·scaling + position_bias + mask
        scores = scores + bias
    if mask is not None:
        if mask.dtype == torch.bool:  # True = attend, as sdpa masks
            mask = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device).masked_fill(
                ~mask, torch.finfo(scores.dtype).min)
        scores = scores + mask
    q_len, k_len = scores.shape[-2], scores.shape[-1]
    if is_causal and q_len > 1:
        # Usually already in the mask; setting it again is a no-op there (score + min rounds to
        # min), and it covers versions whose eager attention applied causality itself.
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).triu(k_len - q_len + 1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    return combined_softmax_dropout_matmul(scores, value, dim=-1, p=dropout, training=training)


def _efficient_core(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
                    scaling: float, dropout: float, is_causal: bool, training: bool) -> Tensor:
    from tempo.ops.attention import efficient_attention

    # With a mask, causality is in it (as for sdpa); without one, the flag applies it, except beside a
    # bias (efficient_attention takes the two only apart): then a causal mask is made.
    causal = is_causal and mask is None and query.shape[-2] > 1
    if causal and bias is not None:
        mask, causal = _causal_keep(query, key), False
    return efficient_attention(query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                               scale=scaling, training=training, attn_bias=bias,
                               enable_gqa=key.shape[1] != query.shape[1])


def tempo_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                            dropout: float = 0.0, head_mask: Optional[Tensor] = None,
                            **kwargs: Any) -> tuple[Tensor, Optional[Tensor]]:
    """Attention with Combined softmax -> dropout -> matmul; the AttentionInterface signature.

    query/key/value are [batch, heads, length, head_dim]; returns ([batch, q_len, heads, head_dim],
    None): attention probabilities are never materialised for the caller. A call that asks for
    them runs the model's eager attention and returns (output, weights) instead (see the module
    docstring).
    """
    out, weights = _attention_forward(_combined_core, module, query, key, value, attention_mask, scaling, dropout,
                                      head_mask, kwargs)
    return (out, weights) if weights is not None else (out.contiguous(), None)


def tempo_efficient_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                      attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                                      dropout: float = 0.0, head_mask: Optional[Tensor] = None,
                                      **kwargs: Any) -> tuple[Tensor, Optional[Tensor]]:
    """Attention through ``tempo.efficient_attention`` (keeps q, k, v, the output, an fp32
    log-sum-exp per row and a seed); the AttentionInterface signature. Returns
    ([batch, q_len, heads, head_dim], None) without a copy: the output is stored in that layout.
    """
    return _attention_forward(_efficient_core, module, query, key, value, attention_mask, scaling, dropout,
                              head_mask, kwargs)


__all__ = [
    "EAGER_ONLY_ARGUMENTS",
    "IMPLEMENTED_ARGUMENTS",
    "NO_EFFECT_ARGUMENTS",
    "REFUSED_ARGUMENTS",
    "install_call_hooks",
    "packing_of_call",
    "remove_call_hooks",
    "TEMPO_ATTENTION",
    "TEMPO_IMPLEMENTATIONS",
    "accept_output_attentions",
    "eager_attention_mask",
    "restore_config_class",
    "TEMPO_EFFICIENT_ATTENTION",
    "tempo_efficient_attention_forward",
    "MIN_ATTENTION_INTERFACE_VERSION",
    "MIN_MASK_INTERFACE_VERSION",
    "register_tempo_attention",
    "require_attention_interface",
    "model_dispatches_attention",
    "tempo_attention_forward",
    "attention_weights_requested",
    "packed_sequences",
]
