"""The coverage table of issue 33: bytes kept for backward per token per added layer, every family of
``tempo.presets.FAMILIES`` at its published geometry, stock / stock with an O(s) attention /
Liger-Kernel's modules / ``apply_tempo(model)`` / the no-recompute floor, block by block.

A measurement script, not part of Tempo: Liger-Kernel is not a dependency. Install its wheel into a
folder of its own (never into the project's venv), then run from the repository root:

    pip install --no-deps --target /tmp/liger liger_kernel-0.8.5-py3-none-any.whl
    PYTHONPATH=/tmp/liger TRITON_INTERPRET=1 python scripts/liger_counts.py --out results/coverage

It writes ``coverage_bf16.md`` (the table, with this command, the versions and the commit at the top)
and ``coverage_bf16.json`` (every number, per block) into ``--out``. About 90 s on 2 CPU cores:
every count runs on fake tensors (``tempo.memory.fake``: the bytes autograd keeps depend on shapes,
dtypes and code paths, not on values).

How Liger is counted. Its Triton kernels do not run on the CPU (not even in triton 3.9's interpreter:
SwiGLU calls ``.to`` on a Python float, GeGLU calls libdevice's tanh), but what its autograd Functions
keep is decided in their Python (``ctx.save_for_backward`` in ``LigerRMSNormFunction``,
``LigerSiLUMulFunction``, ``LigerGELUMulFunction``, ``LigerLayerNormFunction``, ``LigerRopeFunction``):
so the Functions run as shipped and only their kernel launchers (``rms_norm_forward``,
``swiglu_forward``, ``geglu_forward``, ``layer_norm_forward``, ``rope_forward``) are replaced by torch
ops that return the same tensors: new outputs, the same views of the inputs, fp32 statistics of the
same shapes. ``check_launchers`` holds each replaced model to the stock one numerically (fp32,
real tensors, tiny configs) and its fake count to its real count, before anything is counted.

Liger's modules per family: its own ``apply_liger_kernel_to_llama`` / ``_qwen3`` / ``_gemma3_text``
(RMSNorm, SwiGLU or tanh GeGLU, RoPE; module-level patches undone after each count) where it has
one; elsewhere its modules put in by hand where Liger has a kernel for the block (RMSNorm and SwiGLU
of EuroBERT, SwiGLU of NomicBERT, every ``nn.LayerNorm`` as its Triton LayerNorm). Liger has no
kernel for GELU, exact-GELU GeGLU (ModernBERT, GTE), attention or dropout: those stay stock.

Attention. The stock column is transformers' eager attention (s x s kept). On a GPU the stock model
runs sdpa's flash/memory-efficient kernels, which keep q, k, v, the output, one number per row and a
seed; the CPU has no such backward, so the "O(s) attention" columns stand it in with Tempo's efficient
attention alone (``apply_tempo(model, gelu=False, layernorm=False, dropout_add_layernorm=False)``),
which keeps those tensors. Liger's column uses the same attention: it is Liger's norms and MLPs
beside a flash-like attention, as Liger's users train.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

os.environ.setdefault("TRITON_INTERPRET", "1")  # Tempo's kernels, where a check runs one

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tempo.memory.tables import SMALL_VOCAB, format_swaps, swaps_per_added_layer  # noqa: E402
from tempo.presets import FAMILIES, family_config, family_unavailable, longest_seq_len  # noqa: E402

SEQ_LENS = (512, 2048)
VARIANTS = ("stock", "stock+O(s)", "liger+O(s)", "tempo")
LIGER_APPLY = {"llama-3.2-1b": "llama", "qwen3-0.6b": "qwen3", "embeddinggemma-300m": "gemma3_text"}
BLOCKS = ("norms", "q/k norms", "attention", "MLP", "dropout", "layer's own forward", "outside the layer")


# ---------------------------------------------------------------------------------------------
# Liger's kernel launchers as torch ops: the same returned tensors (outputs new, inputs as views)
# ---------------------------------------------------------------------------------------------
def _rms_norm_forward(X, W, eps, offset, casting_mode, row_mode):
    from liger_kernel.ops import rms_norm as ops

    if not isinstance(casting_mode, int):
        casting_mode = ops._str_to_casting_mode[casting_mode]
    shape = X.shape
    X = X.view(-1, shape[-1])
    fp32_stats = casting_mode in (ops._CASTING_MODE_LLAMA.value, ops._CASTING_MODE_GEMMA.value)
    rstd = torch.rsqrt(X.float().pow(2).mean(-1) + eps).to(torch.float32 if fp32_stats else X.dtype)
    if casting_mode == ops._CASTING_MODE_GEMMA.value:  # everything in fp32, cast back at the end
        Y = (X.float() * rstd[:, None] * (offset + W.float())).to(X.dtype)
    elif casting_mode == ops._CASTING_MODE_LLAMA.value:  # rstd in fp32, x * rstd cast back, then * W
        Y = (X.float() * rstd[:, None]).to(X.dtype) * (offset + W if W is not None else 1.0)
    else:
        Y = X * rstd[:, None] * (offset + W if W is not None else 1.0)
    Y = Y.to(X.dtype)
    return Y.view(*shape), X, rstd, 0, 0, casting_mode


def _swiglu_forward(a, b, gate_multiplier: float = 1.0):
    shape = a.shape
    a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
    c = (torch.nn.functional.silu(a.float() * gate_multiplier) * b.float()).to(a.dtype)
    return a, b, c.view(*shape)


def _geglu_forward(a, b):
    shape = a.shape
    a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
    c = (torch.nn.functional.gelu(a.float(), approximate="tanh") * b.float()).to(a.dtype)
    return a, b, c.view(*shape)


def _layer_norm_forward(X, W, B, eps):
    shape = X.shape
    X = X.view(-1, shape[-1])
    x = X.float()
    mean = x.mean(-1)
    rstd = torch.rsqrt(x.var(-1, unbiased=False) + eps)
    Y = ((x - mean[:, None]) * rstd[:, None] * W.float() + B.float()).to(X.dtype)
    return Y.view(*shape), X, mean, rstd, 0, 0


def _rope_forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """Liger's layout steps as shipped (transpose to the physical layout, contiguous), then the
    rotation written into q and k in place, as its kernel does."""
    if cos.ndim == 4:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()

    def rotate(x):  # x: [b, s, heads, d]; cos/sin: [b or 1, s, d]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos[:, :, None] + rotated.float() * sin[:, :, None]).to(x.dtype)

    with torch.no_grad():
        q.copy_(rotate(q))
        k.copy_(rotate(k))
    return q.transpose(1, 2), k.transpose(1, 2), cos, sin


def _liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """What Liger's dispatcher calls on NVIDIA GPUs without CuTe DSL (its Triton RoPE)."""
    from liger_kernel.ops.rope import LigerRopeFunction

    return LigerRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


LAUNCHER_CALLS: dict[str, int] = defaultdict(int)  # how often each replaced launcher ran


def _counted(name: str, fn: Callable) -> Callable:
    def launcher(*args, **kwargs):
        LAUNCHER_CALLS[name] += 1
        return fn(*args, **kwargs)

    return launcher


@contextlib.contextmanager
def torch_launchers() -> Iterator[None]:
    """Liger's kernel launchers replaced by the torch ops above (undone on exit)."""
    replaced = {"liger_kernel.ops.rms_norm": ("rms_norm_forward", _rms_norm_forward),
                "liger_kernel.ops.swiglu": ("swiglu_forward", _swiglu_forward),
                "liger_kernel.ops.geglu": ("geglu_forward", _geglu_forward),
                "liger_kernel.ops.layer_norm": ("layer_norm_forward", _layer_norm_forward),
                "liger_kernel.ops.rope": ("rope_forward", _rope_forward),
                "liger_kernel.transformers.monkey_patch": ("liger_rotary_pos_emb", _liger_rope)}
    saved = []
    for module_name, (name, fn) in replaced.items():
        module = importlib.import_module(module_name)
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, _counted(name, fn))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


# ---------------------------------------------------------------------------------------------
# Liger's modules in a model
# ---------------------------------------------------------------------------------------------
def _liger_layer_norm(module: nn.LayerNorm) -> None:
    from liger_kernel.ops import LigerLayerNormFunction

    def forward(self, x):  # Liger's Triton LayerNorm (its nvidia-triton impl); no bias: zeros, as its functional
        bias = self.bias if self.bias is not None else torch.zeros_like(self.weight)
        return LigerLayerNormFunction.apply(x, self.weight, bias, self.eps)

    module.__dict__["forward"] = forward.__get__(module, type(module))


def _is_swiglu_mlp(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and "silu" in type(act).__name__.lower())


def liger_by_hand(model: nn.Module) -> list[str]:
    """Liger's modules where it has a kernel for the block and no apply_liger_kernel_to_<family>: every
    nn.LayerNorm (with weights), every Llama-form RMSNorm (x * rsqrt(mean x^2 + eps) in fp32, cast back,
    * w), every SwiGLU MLP with separate gate/up projections. Returns what it put in."""
    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    done = set()
    for module in model.modules():
        if isinstance(module, nn.LayerNorm) and module.weight is not None:
            _liger_layer_norm(module)
            done.add("LayerNorm")
        elif type(module).__name__ in ("EuroBertRMSNorm", "LlamaRMSNorm"):
            _patch_rms_norm_module(module, eps=module.variance_epsilon)
            done.add("RMSNorm")
        elif _is_swiglu_mlp(module):
            _patch_swiglu_module(module, LigerSwiGLUMLP)
            done.add("SwiGLU")
    return sorted(done)


@contextlib.contextmanager
def liger_prepare(family: str) -> Iterator[tuple[Callable[[nn.Module], None], str]]:
    """(prepare(model), what it puts in) for the family; module-level patches Liger's apply_* makes
    (its classes and apply_rotary_pos_emb in transformers' modeling module) undone on exit."""
    from liger_kernel.transformers import monkey_patch

    name = LIGER_APPLY.get(family)
    if name is None:
        what: list[str] = []

        def prepare(model):
            what[:] = [f"by hand: {', '.join(liger_by_hand(model))}"]

        yield prepare, what
        return
    modeling = importlib.import_module(f"transformers.models.{name.replace('_text', '')}.modeling_"
                                       f"{name.replace('_text', '')}")
    before = dict(vars(modeling))
    apply = getattr(monkey_patch, f"apply_liger_kernel_to_{name}")
    mlp = "geglu" if name == "gemma3_text" else "swiglu"

    def prepare(model):
        apply(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model,
              **{mlp: True})

    try:
        mlp_name = "GeGLU (tanh)" if mlp == "geglu" else "SwiGLU"
        yield prepare, [f"apply_liger_kernel_to_{name}: RMSNorm, {mlp_name}, RoPE"]
    finally:
        for key in set(vars(modeling)) - set(before):
            delattr(modeling, key)
        for key, value in before.items():
            if vars(modeling).get(key) is not value:
                setattr(modeling, key, value)


def _attention_only(model: nn.Module) -> None:
    from tempo.integrations.patch import apply_tempo

    apply_tempo(model, gelu=False, layernorm=False, dropout_add_layernorm=False)


# ---------------------------------------------------------------------------------------------
# Counting, per added layer and per block of it
# ---------------------------------------------------------------------------------------------
_LAYER_ONE = re.compile(r"(?:^|\.)(?:layers?|block|blocks)\.1(?:\.|$)")


def block_of(relative: str) -> str:
    """The block a module of a layer belongs to, by its name inside the layer."""
    low = relative.lower()
    last = low.rsplit(".", 1)[-1]
    if last in ("q_norm", "k_norm"):
        return "q/k norms"
    if "norm" in last:
        return "norms"
    if "dropout" in last:
        return "dropout"
    if relative == "":
        return "layer's own forward"
    if any(k in low for k in ("attn", "attention")):
        return "attention"
    if any(k in low for k in ("mlp", "intermediate", "output", "ffn")):
        return "MLP"
    return relative


def _by_block(ledger_2: Any, ledger_1: Any, seq_len: int) -> dict[str, float]:
    """Bytes per token kept by the modules of layer index 1, batch 2 minus batch 1, per block."""
    def per_module(ledger):
        kept: dict[str, int] = defaultdict(int)
        for record in ledger.records:
            if record.is_parameter:
                continue
            match = _LAYER_ONE.search(record.module)
            if match:
                kept[block_of(record.module[match.end():])] += record.nbytes
        return kept

    two, one = per_module(ledger_2), per_module(ledger_1)
    return {block: (two.get(block, 0) - one.get(block, 0)) / seq_len for block in sorted(set(two) | set(one))
            if two.get(block, 0) != one.get(block, 0)}


def added_layer(family: str, seq_len: int, prepare: Optional[Callable[[nn.Module], None]],
                fake: bool = True, config_of: Callable[[int], Any] = None) -> dict[str, Any]:
    """Bytes per token one more layer keeps (2 layers minus 1, batch 2 minus batch 1: autocast's
    weight copies and everything batch-independent drop out), per block, and the models."""
    import transformers

    from tempo.memory import ActivationLedger
    from tempo.memory.fake import FakeSession

    config_of = config_of or (lambda layers: family_config(family, layers, vocab=SMALL_VOCAB, attention="eager"))
    session = FakeSession() if fake else None
    models = {}
    for layers in (1, 2):
        config = config_of(layers)

        def build():
            return transformers.AutoModel.from_config(config).train()

        if fake:
            models[layers] = session.module(build, prepare)
        else:
            torch.manual_seed(0)
            models[layers] = build()
            if prepare is not None:
                prepare(models[layers])
    ledgers = {}
    for layers in (1, 2):
        for batch in (1, 2):
            ids = torch.randint(3, 1000, (batch, seq_len))
            counter = session.ledger(models[layers]) if fake else ActivationLedger(models[layers])
            with counter as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
                models[layers](input_ids=ids)
            ledgers[layers, batch] = ledger
    kept = {key: ledger.activation_bytes for key, ledger in ledgers.items()}
    per_token = (kept[2, 2] - kept[2, 1] - kept[1, 2] + kept[1, 1]) / seq_len
    return {"per_token": per_token, "blocks": _by_block(ledgers[2, 2], ledgers[2, 1], seq_len), "models": models}


# ---------------------------------------------------------------------------------------------
# The floor: what a layer must keep without recomputing a GEMM (bf16, per token, bytes)
# ---------------------------------------------------------------------------------------------
def floor_blocks(family: str, stock_two_layers: nn.Module, swaps: dict[str, int]) -> dict[str, float]:
    """Per block: a norm keeps its output (bf16) and one fp32 rstd per row; attention q, k, v (at the
    kv heads), its output (bf16), two fp32 numbers per row and head, a seed; a gated MLP gate and up
    (2 I bf16; the product recomputed for the down projection); a dense MLP its activation output
    (I bf16) and one bit per element (GELU is not one-to-one); dropout a seed (nothing per token).
    q/k norms (Qwen3, Gemma3) counted as norms of their width, per head (their output is the pre-RoPE
    q, k; recovering it from attention's kept q, k by the inverse rotation would leave only the rstd).
    The norms are those of the stock model's layer 1 (ModernBERT's layer 0 has no attention norm)."""
    config = family_config(family, 1, vocab=SMALL_VOCAB, attention="eager")
    h, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    inner = config.intermediate_size
    floor: dict[str, float] = defaultdict(float)
    for name, module in stock_two_layers.named_modules():
        match = _LAYER_ONE.search(name)
        if not match or "norm" not in type(module).__name__.lower():
            continue
        relative = name[match.end():]
        block = block_of(relative)
        if block == "q/k norms":
            rows = heads if relative.endswith("q_norm") else kv
            floor[block] += rows * (2 * module.weight.shape[0] + 4)
        else:
            floor[block] += 2 * h + 4
    floor["attention"] = 2 * (heads * d + 2 * kv * d + heads * d) + 2 * 4 * heads
    gated = any("Gated" in kind for kind in swaps)
    floor["MLP"] = 2 * 2 * inner if gated else 2 * inner + inner / 8
    return dict(floor)


# ---------------------------------------------------------------------------------------------
# The launchers' check: Liger's Functions with torch launchers compute the stock model's outputs, and
# their fake count is their real count (tiny configs, fp32, real tensors)
# ---------------------------------------------------------------------------------------------
TINY = dict(hidden_size=64, num_attention_heads=4, intermediate_size=96)


def _tiny_config(family: str, layers: int) -> Any:
    import transformers

    _label, cls_name, fields = FAMILIES[family]
    small = dict(fields, **TINY)
    if "num_key_value_heads" in fields:
        small["num_key_value_heads"] = 2 if fields["num_key_value_heads"] < fields["num_attention_heads"] else 4
    if "head_dim" in fields:
        small["head_dim"] = 16
    if family == "embeddinggemma-300m":
        small.update(num_key_value_heads=1, query_pre_attn_scalar=16, sliding_window=8)
    small["max_position_embeddings"] = 64
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if key in small:
            small[key] = 0.0  # dropout off: outputs compared value for value
    return getattr(transformers, cls_name)(vocab_size=1000, num_hidden_layers=layers, attn_implementation="eager",
                                           **small)


def check_launchers(families: list[str]) -> list[dict[str, Any]]:
    import transformers

    results = []
    for family in families:
        torch.manual_seed(0)
        stock = transformers.AutoModel.from_config(_tiny_config(family, 2)).eval()
        ids = torch.randint(3, 1000, (2, 16))
        with torch.no_grad():
            expected = stock(input_ids=ids).last_hidden_state
        with liger_prepare(family) as (prepare, what):
            prepare(stock)
            LAUNCHER_CALLS.clear()
            with torch.no_grad():
                got = stock(input_ids=ids).last_hidden_state
            calls = dict(LAUNCHER_CALLS)  # Liger's Functions ran: each replaced launcher, once per module
            real = added_layer(family, 16, prepare, fake=False, config_of=lambda n: _tiny_config(family, n))
        with liger_prepare(family) as (prepare, _):
            fake = added_layer(family, 16, prepare, fake=True, config_of=lambda n: _tiny_config(family, n))
        results.append({"family": family, "liger": list(what), "launcher_calls": calls,
                        "max_abs_diff": float((got - expected).abs().max()),
                        "real_per_token": real["per_token"], "fake_per_token": fake["per_token"]})
    return results


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def measure(families: list[str], seq_lens: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for family in families:
        h = FAMILIES[family][2]["hidden_size"]
        for s in (s for s in seq_lens if s <= longest_seq_len(family)):
            row: dict[str, Any] = {"family": family, "seq_len": s, "h": h}
            started = time.time()
            for variant in VARIANTS:
                if variant == "liger+O(s)":
                    with liger_prepare(family) as (prepare, what):
                        counted = added_layer(family, s, lambda m: (prepare(m), _attention_only(m)))
                    row["liger"] = list(what)
                else:
                    prepare = {"stock": None, "stock+O(s)": _attention_only, "tempo": _apply_tempo}[variant]
                    counted = added_layer(family, s, prepare)
                blocks = {b: v / h for b, v in counted["blocks"].items()}
                outside = counted["per_token"] / h - sum(blocks.values())  # kept elsewhere per added layer
                if abs(outside) > 1e-9:
                    blocks["outside the layer"] = outside
                row[variant] = {"per_token_h": counted["per_token"] / h, "blocks_h": blocks}
                if variant == "tempo":
                    row["swaps"] = swaps_per_added_layer(counted["models"][1], counted["models"][2])
                if variant == "stock":
                    stock_two = counted["models"][2]
            floor = floor_blocks(family, stock_two, row["swaps"])
            row["floor"] = {"per_token_h": sum(floor.values()) / h, "blocks_h": {b: v / h for b, v in floor.items()}}
            row["seconds"] = round(time.time() - started, 1)
            print(f"{family} s={s}: " + ", ".join(f"{v} {row[v]['per_token_h']:.1f} h" for v in (*VARIANTS, "floor"))
                  + f" ({row['seconds']} s)", file=sys.stderr)
            rows.append(row)
    return rows


def _apply_tempo(model: nn.Module) -> None:
    from tempo.integrations.patch import apply_tempo

    apply_tempo(model)


def _versions() -> dict[str, str]:
    import transformers
    import triton

    from tempo.utils import git_commit

    try:
        from importlib.metadata import version

        liger = version("liger_kernel")
    except Exception:  # noqa: BLE001 - a --target install has its dist-info beside the package
        liger = "unknown"
    commit = git_commit()
    return {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton.__version__,
            "liger_kernel": liger, "python": sys.version.split()[0],
            "commit": f"{commit['commit']}{' + uncommitted changes' if commit['dirty'] else ''}"}


def format_markdown(rows: list[dict[str, Any]], checks: list[dict[str, Any]], versions: dict[str, str],
                    command: str, skipped: list[str], seconds: float) -> str:
    out = ["# Coverage: bytes kept for backward per token per added layer, bf16 autocast", "",
           f"Command: `{command}` ({seconds:.0f} s on 2 shared CPU cores, fake tensors).",
           "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if k != "commit") + ".",
           f"Commit: {versions['commit']}.", "",
           "Units of each model's hidden size h: bytes one more layer keeps per token (a model of 2 layers minus 1 "
           "layer, batch 2 minus batch 1), random weights at the published geometry, fp32 weights under bf16 "
           "autocast, dropout as each model ships, training mode. Columns: transformers' eager model; the same with "
           "an O(s) attention (what sdpa's flash kernels keep on a GPU: q, k, v, output, per-row statistics, a "
           "seed; counted with Tempo's efficient attention alone); Liger-Kernel 0.8.5's modules with that "
           "attention; `apply_tempo(model)`; the no-recompute floor (block by block below). How Liger is counted: "
           "its autograd Functions run as shipped with their Triton launchers replaced by torch ops returning the "
           "same tensors (scripts/liger_counts.py). Dropout masks left stock are counted as the CPU keeps them, in "
           "the compute dtype (2 bytes per element); CUDA's dropout keeps 1-byte masks.", ""]
    if skipped:
        out += ["Skipped: " + "; ".join(skipped) + ".", ""]
    out += ["| model | s | apply_tempo swaps, per added layer | stock (eager) | stock, O(s) attention | "
            "Liger, O(s) attention | **Tempo** | floor | Tempo above the floor, by block |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[v]['per_token_h']:.1f} h" for v in VARIANTS]
        cells[3] = f"**{cells[3]}**"
        above = {b: r["tempo"]["blocks_h"].get(b, 0.0) - r["floor"]["blocks_h"].get(b, 0.0) for b in BLOCKS}
        above_text = ", ".join(f"{b} +{v:.1f} h" for b, v in above.items() if v > 0.05) or "at the floor"
        out.append(f"| {FAMILIES[r['family']][0]} | {r['seq_len']} | {format_swaps(r['swaps'])} | "
                   + " | ".join(cells) + f" | {r['floor']['per_token_h']:.1f} h | {above_text} |")
    out += ["", "Liger's modules per model: " + "; ".join(
        f"{FAMILIES[f][0].split(' (')[0]}: {', '.join(w) or 'none'}"
        for f, w in dict((r['family'], r['liger']) for r in rows).items()) + ".", ""]
    out += ["## Block by block (s = 512)", "",
            "The same bytes, by the block of the layer that keeps them (the module that saved a tensor first: a "
            "norm's output kept by the norm counts there, a copy a projection keeps counts in its block). "
            "Floors: a norm keeps its output and an fp32 rstd per row; attention q, k, v (at the kv heads), its "
            "output, two fp32 numbers per row and head and a seed; a gated MLP gate and up (2·I; the product "
            "recomputed for the down projection); a dense MLP its activation output and one bit per element; "
            "dropout a seed.", ""]
    for r in rows:
        if r["seq_len"] != 512:
            continue
        blocks = [b for b in BLOCKS if any(b in r[v]["blocks_h"] for v in VARIANTS) or b in r["floor"]["blocks_h"]]
        out += [f"**{FAMILIES[r['family']][0]}**", "",
                "| block | stock | stock, O(s) attention | Liger, O(s) attention | Tempo | floor |",
                "|---|---|---|---|---|---|"]
        for b in blocks:
            cells = [f"{r[v]['blocks_h'].get(b, 0.0):.2f}" for v in (*VARIANTS, "floor")]
            out.append(f"| {b} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["## The launchers' check", "",
            "Before counting: each model with Liger's modules (torch launchers) against the stock model, fp32, tiny "
            "configs (h = 64, 2 layers, s = 16, dropout off), largest output difference; and its bytes per added "
            "layer counted on real tensors and on fake ones (bytes per token).", "",
            "| model | Liger's modules | its launchers that ran (calls) | max abs diff | real count | fake count |",
            "|---|---|---|---|---|---|"]
    for c in checks:
        calls = ", ".join(f"{name} {n}" for name, n in sorted(c["launcher_calls"].items()))
        out.append(f"| {FAMILIES[c['family']][0]} | {', '.join(c['liger'])} | {calls} | {c['max_abs_diff']:.1e} | "
                   f"{c['real_per_token']:.0f} B | {c['fake_per_token']:.0f} B |")
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/coverage", help="folder for coverage_bf16.md/.json")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), help="default: every family")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    args = parser.parse_args(argv)
    try:
        import liger_kernel
    except ImportError:
        parser.error("liger_kernel is not importable: install its wheel with pip install --no-deps --target "
                     "/tmp/liger <wheel> and run with PYTHONPATH=/tmp/liger (see this script's docstring)")
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {', '.join(unknown)}; valid: {', '.join(FAMILIES)}")
    skipped = [f"{FAMILIES[f][0]} ({why})" for f in args.families if (why := family_unavailable(f))]
    families = [f for f in args.families if not family_unavailable(f)]
    started = time.time()
    with torch_launchers():
        checks = check_launchers([f for f in families if f in LIGER_APPLY or f in ("eurobert-210m", "nomicbert",
                                                                                       "bert-large")])
        for c in checks:
            if not c["launcher_calls"] or c["max_abs_diff"] > 1e-4 or c["real_per_token"] != c["fake_per_token"]:
                raise SystemExit(f"the launchers' check failed for {c['family']}: {c}")
        rows = measure(families, tuple(args.seq_lens))
    seconds = time.time() - started
    versions = _versions()
    liger_dir = Path(liger_kernel.__file__).resolve().parents[1]  # where its wheel was installed
    command = f"PYTHONPATH={liger_dir} TRITON_INTERPRET=1 python scripts/liger_counts.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coverage_bf16.md").write_text(format_markdown(rows, checks, versions, command.strip(), skipped, seconds))
    (out / "coverage_bf16.json").write_text(json.dumps({"command": command.strip(), "versions": versions,
                                                        "skipped": skipped, "checks": checks, "rows": rows},
                                                       indent=1) + "\n")
    print(f"wrote {out / 'coverage_bf16.md'} and coverage_bf16.json ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
