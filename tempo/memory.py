"""The activation ledger: exactly which bytes autograd keeps for backward.

Every tensor autograd saves passes through ``torch.autograd.graph.saved_tensors_hooks``. The
ledger counts each underlying storage once (a view of a tensor that is already kept costs
nothing more; a view keeps its whole storage alive), attributes it to the innermost module that
was running when it was saved, and sets parameters apart, since they are kept anyway.

The count is exact and device-independent for eager code: it is what a bigger batch has to
pay for, which is the figure the Tempo layers exist to reduce. It does not see tensors kept
outside autograd (e.g. the inputs ``torch.utils.checkpoint`` holds on to), nor temporaries that
live only during forward or backward: the allocator's peak measures those.

    with ActivationLedger(model) as ledger:
        loss = model(batch).loss
    print(ledger.activation_bytes, ledger.by_module())

``python -m tempo.memory`` prints the per-layer table for a BERT-large encoder layer.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class SavedTensor:
    """One storage autograd kept, the first time it was seen."""

    module: str  # qualified name of the innermost running module ("" = outside any module)
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # bytes of the whole storage
    is_parameter: bool


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of the memory behind ``t``; None when it has none we can name."""
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without real storage
        return None
    if ptr == 0:  # empty tensors and meta tensors: no bytes, and not comparable
        return None
    return (t.device.type, t.device.index, ptr)


def _storage_nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


class ActivationLedger:
    """Context manager recording the storages autograd saves for backward.

    ``model`` (optional) lets the ledger attribute tensors to submodules and recognise the
    model's parameters; without it everything is attributed to "" and only tensors that are
    ``nn.Parameter`` instances are treated as parameters.
    """

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self.records: list[SavedTensor] = []
        self._seen: set[tuple[Any, ...]] = set()
        self._param_keys: set[tuple[Any, ...]] = set()
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._hooks_cm: contextlib.AbstractContextManager | None = None

    # -- recording ------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._seen:
            self._seen.add(key)
            self.records.append(
                SavedTensor(
                    module=self._stack[-1] if self._stack else "",
                    shape=tuple(t.shape),
                    dtype=t.dtype,
                    nbytes=_storage_nbytes(t),
                    is_parameter=key in self._param_keys or isinstance(t, nn.Parameter),
                )
            )
        return t  # keep the tensor itself: the ledger observes, it never changes what is saved

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "ActivationLedger":
        if self.model is not None:
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                key = _storage_key(tensor)
                if key is not None:
                    self._param_keys.add(key)
            for name, module in self.model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
                self._handles.append(module.register_forward_hook(self._leave_module, always_call=True))
        self._hooks_cm = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks_cm is not None
        self._hooks_cm.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter_module(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)

        return hook

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    # -- results --------------------------------------------------------------------------
    @property
    def activation_bytes(self) -> int:
        """Bytes kept for backward, parameters and buffers excluded."""
        return sum(r.nbytes for r in self.records if not r.is_parameter)

    @property
    def parameter_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if r.is_parameter)

    def by_module(self, depth: int | None = None) -> "OrderedDict[str, int]":
        """Activation bytes per module, in first-saved order; ``depth`` truncates dotted names."""
        totals: OrderedDict[str, int] = OrderedDict()
        for r in self.records:
            if r.is_parameter:
                continue
            name = r.module if depth is None else ".".join(r.module.split(".")[:depth])
            totals[name] = totals.get(name, 0) + r.nbytes
        return totals

    def per_token_per_layer(self, tokens: int, layers: int, hidden: int) -> float:
        """Activation bytes per token per layer in units of the hidden size h (bytes / h)."""
        return self.activation_bytes / (tokens * layers * hidden)


def saved_bytes(fn: Callable[..., Any], *args: Any, model: nn.Module | None = None, **kwargs: Any) -> ActivationLedger:
    """Run ``fn(*args, **kwargs)`` under a ledger and return the ledger (the output is dropped)."""
    with ActivationLedger(model) as ledger:
        fn(*args, **kwargs)
    return ledger


def marginal_bytes_per_token(run_batch: Callable[[int], ActivationLedger], tokens_per_sample: int,
                             batches: tuple[int, int] = (1, 2)) -> tuple[float, float]:
    """(activation bytes per token, fixed bytes) from ledgers at two batch sizes.

    Under autocast, autograd also keeps the low-precision copies of the weights; they cost the
    same at every batch size, so a single ledger divided by tokens overstates what each extra
    sample costs. The difference between two batch sizes is the figure that decides how large a
    batch fits; what is left at batch 0 is reported separately as the fixed part.
    """
    small, large = batches
    bytes_small = run_batch(small).activation_bytes
    bytes_large = run_batch(large).activation_bytes
    per_token = (bytes_large - bytes_small) / ((large - small) * tokens_per_sample)
    fixed = bytes_small - per_token * small * tokens_per_sample
    return per_token, fixed


# -- the table the README and the issue quote ----------------------------------------------
LEDGER_VARIANTS = ("original", "tempo", "original+sdpa", "tempo+sdpa")


def bert_layer_ledger(variant: str, seq_len: int, batch: int, dtype: torch.dtype, device: str,
                      config_name: str = "bert_large.json") -> ActivationLedger:
    """Ledger of one post-LN encoder layer's forward in training mode (dropout on)."""
    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertLayer, TempoOptions, additive_attention_mask

    config = BertConfig.from_json_file(_configs_dir() / config_name)
    if variant.startswith("hf-"):
        return _hf_layer_ledger(variant[3:], config, seq_len, batch, dtype, device)
    options = {
        "original": TempoOptions.original(attention="eager"),
        "tempo": TempoOptions.full(attention="tempo"),
        "original+sdpa": TempoOptions.original(attention="sdpa"),
        "tempo+sdpa": TempoOptions.full(attention="sdpa"),
    }[variant]
    torch.manual_seed(0)
    layer = BertLayer(config, options).to(device).train()
    # The layer's input is the previous layer's LayerNorm output: fp32 from nn.LayerNorm under
    # autocast, the autocast dtype from InplaceLayerNorm. Feed each variant what it would get.
    input_dtype = dtype if options.layernorm else torch.float32
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, dtype=input_dtype,
                         requires_grad=True)
    # The additive mask as the model builds it: in the compute dtype, so it does not promote
    # bf16 scores to fp32 (no padding here).
    mask = additive_attention_mask(torch.ones(batch, seq_len, device=device),
                                   dtype if dtype != torch.float32 else torch.float32)

    def forward() -> None:
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            layer(hidden, mask)

    return saved_bytes(forward, model=layer)


def _hf_layer_ledger(attn_impl: str, config: Any, seq_len: int, batch: int, dtype: torch.dtype,
                     device: str) -> ActivationLedger:
    """The same layer as HF transformers builds it (what most users train today)."""
    from transformers import BertConfig as HFBertConfig
    from transformers.models.bert.modeling_bert import BertLayer as HFBertLayer

    hf_config = HFBertConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                             intermediate_size=config.intermediate_size, attn_implementation=attn_impl)
    torch.manual_seed(0)
    layer = HFBertLayer(hf_config).to(device).train()
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, requires_grad=True)

    def forward() -> None:
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            layer(hidden)

    return saved_bytes(forward, model=layer)


def _transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _configs_dir():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "configs"


def ledger_table(seq_lens=(128, 512), variants=LEDGER_VARIANTS, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cpu", hidden: int = 1024) -> list[dict[str, Any]]:
    """Rows of marginal bytes kept per token per BERT-large encoder layer, in units of h."""
    rows = []
    for seq_len in seq_lens:
        row: dict[str, Any] = {"seq_len": seq_len}
        for variant in variants:
            per_token, _fixed = marginal_bytes_per_token(
                lambda b: bert_layer_ledger(variant, seq_len, b, dtype, device), seq_len)
            row[variant] = per_token / hidden
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    variants = [k for k in rows[0] if k != "seq_len"]
    header = "| s | " + " | ".join(variants) + " | Tempo saves |"
    lines = [header, "|" + "---|" * (len(variants) + 2)]
    for row in rows:
        saving = 1 - row["tempo"] / row["original"] if "tempo" in row and "original" in row else float("nan")
        cells = " | ".join(f"{row[v]:.1f} h" for v in variants)
        lines.append(f"| {row['seq_len']} | {cells} | {saving:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tempo.memory",
        description="Bytes autograd keeps for backward per token per BERT-large encoder layer (units of h).",
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                        help="autocast dtype (fp32 = no autocast)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers BertLayer column")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.device == "cpu" and dtype == torch.float16:
        parser.error("--dtype fp16 autocast needs --device cuda")
    variants = LEDGER_VARIANTS + (("hf-eager",) if _transformers_available() and not args.no_hf else ())
    rows = ledger_table(tuple(args.seq_lens), variants=variants, dtype=dtype, device=args.device)
    print(f"Activation ledger: one BERT-large post-LN encoder layer (h=1024, 16 heads, dropout 0.1), "
          f"{args.dtype} autocast.\nBytes kept for backward per token (marginal: batch 2 minus batch 1, "
          f"so autocast's fixed weight copies are excluded), in units of h = 1024 bytes")
    print(format_table(rows))
    if args.device == "cpu":
        print("On the CPU, scaled_dot_product_attention runs PyTorch's math fallback, which keeps the whole\n"
              "attention matrix; on a GPU its flash/memory-efficient kernels keep O(s) per row instead.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
