"""``python -m tempo.bench layer``: one BERT encoder layer, forward / backward / both.

Shapes (batch x seq): ``--shapes substation`` (default): Substation's two BERT-large shapes,
b8 l512 and b96 l128, i.e. s=512 and s=128; ``--shapes tiny``: b2 l32 of bert_tiny (for CPU
tests); or ``--shape 8x512 --shape 32x128``. Config: bert_large unless --config names another.

Variants: original (eager attention, nn.GELU/nn.LayerNorm), tempo (the paper's three Tempo
layers), sdpa (original + sdpa attention), tempo-sdpa (Tempo GELU/LayerNorm + sdpa), tempo-floor
(TempoChoice.floor(): every Tempo layer with efficient attention), compiled (original under
torch.compile), hf-eager and hf-sdpa (HF transformers' BertLayer, when installed). There is no
padding, so each gets the mask the full model would give it: none for sdpa/efficient attention
(their fused kernels, flash included, can run), an all-zero additive mask in the compute dtype
for eager and Tempo attention; HF's layer gets none. Each: p20 /
p50 / p80 ms over --repeats after --warmup calls, under autocast in --precision, and the
activation ledger's bytes for one forward (what the layer keeps for backward; the compiled
variant has none: the ledger sees the eager graph only). "bwd" times backward alone (the
forward that builds its graph runs untimed before each call).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable

import torch

from tempo.choices import TempoChoice
from tempo.bench.timing import on_device, spread, time_fn
from tempo.utils import non_negative_int, positive_int

SHAPES = {"substation": [(8, 512), (96, 128)], "tiny": [(2, 32)]}
VARIANTS = ("original", "tempo", "sdpa", "tempo-sdpa", "tempo-floor", "compiled", "hf-eager", "hf-sdpa")
MODES = ("fwd", "bwd", "fwd+bwd")
# variant -> (ledger variant name in tempo.memory.tables, options)
_LEDGER_NAME = {"original": "original", "tempo": "tempo", "sdpa": "original+sdpa", "tempo-sdpa": "tempo+sdpa",
                "tempo-floor": "tempo-floor", "hf-eager": "hf-eager", "hf-sdpa": "hf-sdpa"}


def _parse_shape(text: str) -> tuple[int, int]:
    """``--shape BATCHxSEQ``: two positive integers."""
    try:
        b, s = text.lower().split("x")
        return positive_int(b), positive_int(s)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"shape must look like 8x512 (positive batch x seq), got {text!r}") from None


def build_layer(variant: str, config: Any, device: str) -> tuple[Callable[..., torch.Tensor], bool, bool]:
    """(callable(hidden, mask) -> output, whether its input comes in the autocast dtype,
    whether it takes an additive mask when there is no padding)."""
    from tempo.bert.model import BertLayer

    if variant.startswith("hf-"):
        try:
            from transformers.models.bert.modeling_bert import BertLayer as HFBertLayer
        except ImportError:
            raise RuntimeError("HF transformers is not installed") from None
        from tempo.presets import hf_bert_config

        hf_config = hf_bert_config(config, attention=variant[3:])
        layer = HFBertLayer(hf_config).to(device).train()

        def hf_call(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            out = layer(hidden)  # no padding: HF skips the mask entirely
            return out[0] if isinstance(out, tuple) else out

        return hf_call, False, False
    options = {
        "original": TempoChoice.original("eager"),
        "compiled": TempoChoice.original("eager"),
        "tempo": TempoChoice.full(attention="tempo"),
        "sdpa": TempoChoice.original("sdpa"),
        "tempo-sdpa": TempoChoice.full(attention="sdpa"),
        "tempo-floor": TempoChoice.floor(),
    }[variant]
    layer = BertLayer(config, options).to(device).train()
    # As tempo.bert.model.BertModel: sdpa/efficient get no mask without padding, the others an additive one.
    wants_mask = options.attention not in ("sdpa", "efficient")
    if variant == "compiled":
        return torch.compile(layer), False, wants_mask
    return layer, options.layernorm or options.dropout_add_layernorm, wants_mask


def bench_variant(variant: str, config: Any, batch: int, seq: int, device: str, dtype: torch.dtype,
                  modes: tuple[str, ...], warmup: int, repeats: int, config_name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    layer, low_precision_input, wants_mask = build_layer(variant, config, device)
    device_type = torch.device(device).type  # autocast takes "cuda", not "cuda:0"
    autocast = (torch.autocast(device_type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    in_dtype = dtype if low_precision_input else torch.float32
    base = torch.randn(batch, seq, config.hidden_size, device=device, dtype=in_dtype)
    # No padding. Eager/Tempo attention get an all-zero additive mask in the compute dtype, as the
    # model's additive_attention_mask builds it (an fp32 mask would promote bf16/fp16 scores to
    # fp32: an extra cast and twice the bytes of the s x s scores); sdpa/efficient get none, so
    # sdpa may pick its flash kernel. HF's layer is called without a mask.
    mask = torch.zeros(batch, 1, 1, seq, device=device, dtype=dtype) if wants_mask else None
    state: dict[str, torch.Tensor] = {}

    def fresh_input() -> None:
        state["x"] = base.clone().requires_grad_()

    def forward() -> None:
        with autocast:
            state["out"] = layer(state["x"], mask)

    def backward() -> None:
        state["out"].backward(state["grad"])

    with autocast:
        probe_out = layer(base.clone().requires_grad_(), mask)
    state["grad"] = torch.randn_like(probe_out)
    del probe_out
    result: dict[str, Any] = {"variant": variant, "batch": batch, "seq_len": seq}
    for mode in modes:
        if mode == "fwd":
            times = time_fn(forward, device, warmup, repeats, setup=fresh_input)
        elif mode == "bwd":
            times = time_fn(backward, device, warmup, repeats, setup=lambda: (fresh_input(), forward()))
        else:
            times = time_fn(lambda: (forward(), backward()), device, warmup, repeats, setup=fresh_input)
        result[mode] = {"ms": spread(times), "raw_ms": times}
    state.clear()
    ledger_name = _LEDGER_NAME.get(variant)
    result["ledger_bytes"] = None
    if ledger_name is not None:
        from tempo.memory.tables import bert_layer_ledger

        result["ledger_bytes"] = bert_layer_ledger(ledger_name, seq, batch, dtype, device,
                                                   config_name=config_name).activation_bytes
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", choices=sorted(SHAPES), default=None, help="named shape set (default substation)")
    p.add_argument("--shape", type=_parse_shape, action="append", default=None, help="BATCHxSEQ, repeatable")
    p.add_argument("--config", default=None, help="config name (default bert_large; bert_tiny with --shapes tiny)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of fwd,bwd,fwd+bwd")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--device", default=None)
    p.add_argument("--warmup", type=non_negative_int, default=3)
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--out", default=None, help="JSON output file")


def main(args: argparse.Namespace) -> int:
    from tempo.bench.common import BenchError, resolve_our_config
    from tempo.bench.hardware import bench_device, environment
    from tempo.bench.results import write_json

    shapes = args.shape or SHAPES[args.shapes or "substation"]
    config_name = args.config or ("bert_tiny" if args.shapes == "tiny" else "bert_large")
    config = resolve_our_config(config_name)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.precision]
    try:
        device = bench_device(args.device)  # "cuda" becomes the current GPU's "cuda:N"
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if dtype == torch.float16 and device.type == "cpu":
        raise BenchError("--precision fp16 needs a CUDA GPU")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    bad = (set(variants) - set(VARIANTS)) | (set(modes) - set(MODES))
    if bad:
        raise BenchError(f"unknown variants/modes {sorted(bad)}")
    rows = []
    # With the benchmark's GPU current (tempo.bench.timing.on_device): the layer, its inputs, the
    # Tempo launches, the timing events and empty_cache after an OOM all on that one device.
    with on_device(device):
        for batch, seq in shapes:
            for variant in variants:
                try:
                    row = bench_variant(variant, config, batch, seq, str(device), dtype, modes, args.warmup,
                                        args.repeats, f"{config_name}.json")
                    row["status"] = "ok"
                except torch.OutOfMemoryError:
                    row = {"variant": variant, "batch": batch, "seq_len": seq, "status": "oom"}
                    torch.cuda.empty_cache()
                except (ImportError, RuntimeError) as exc:  # HF missing, a Tempo layer missing, compile failing
                    row = {"variant": variant, "batch": batch, "seq_len": seq, "status": "skipped",
                           "message": str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}
                rows.append(row)
                print(_format_row(row, modes), flush=True)
    record = {"kind": "layer", "env": environment(device), "config": config_name, "precision": args.precision,
              "modes": list(modes), "rows": rows}
    if args.out:
        write_json(args.out, record)
    return 0


def _format_row(row: dict[str, Any], modes: tuple[str, ...]) -> str:
    head = f"b{row['batch']:<3} l{row['seq_len']:<4} {row['variant']:<11}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row.get('message', '')}"
    cells = "  ".join(f"{m} {row[m]['ms']['p20']:.2f}/{row[m]['ms']['p50']:.2f}/{row[m]['ms']['p80']:.2f} ms"
                      for m in modes)
    ledger = f"{row['ledger_bytes'] / 2**20:.1f} MiB" if row.get("ledger_bytes") is not None else "-"
    return f"{head} {cells}  ledger {ledger}"
