"""``python -m tempo.bench train``: a training-step benchmark on synthetic data.

One run = build the model (ours, or HF's via hf_provider), the optimizer and a few synthetic
batches already on the device (so the data pipeline is not what we time), then ``warmup``
untimed steps and ``steps`` timed ones. Every step is synchronized and timed on its own, so the
result carries the raw per-step times and their p20/p50/p80, not just a mean.

Reported: samples/s (timed steps only), model TFLOPS and MFU (flops.py; against the dense peak
of the detected GPU for the precision, hardware.py), allocator peaks, retries and OOMs (GPU),
and the memory anatomy (anatomy.py). The activation ledger runs on extra forwards before the
timed loop (at the micro-batch and, for the marginal per-sample cost, at batch 1), on the
eager model: with --compile the compiled graph may keep different tensors (the allocator
peak then tells the truth).

``--memory-budget`` (for ``max-batch`` on machines without a GPU): after the first step, a run
whose weights + gradients + optimizer states + ledger activations exceed the budget stops with
"out of memory (simulated ...)" and exit status 3, the way a real OOM stops it on a GPU.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch
from torch import nn

from tempo.choices import ATTENTIONS, PAPER_KINDS, LAYER_KINDS, ChoiceError, TempoChoice, parse_kinds
from tempo.bench import anatomy as anat
from tempo.bench.flops import FORMULAS, bert_pretraining_flops, flops_per_sequence, mfu
from tempo.bench.hardware import device_name, environment, peak_tflops
from tempo.choices import PRECISIONS
from tempo.bench.common import BenchError, SimulatedOOM, resolve_our_config
from tempo.bench.timing import spread
from tempo.presets import default_max_predictions
from tempo.train.flags import add_training_flags
from tempo.train.runtime import autocast_context, configure_matmul_precision, peak_memory_bytes, wrap_ddp
from tempo.train.step import StepClock, TrainStep
from tempo.utils import (format_bytes, non_negative_int, number_in, positive_int, positive_number,
                         positive_size)

OPTIMIZERS = ("adamw", "adamw_fused", "lamb", "adafactor", "adamw8bit")

@dataclass
class TrainBenchConfig:
    model: str = "bert_large"        # our config name or JSON path, or hf:<size>/hf:<dir>
    seq_len: int = 128
    batch_size: int = 8              # micro-batch per device
    max_predictions: int | None = None  # None: 15% of seq_len, rounded up to a multiple of 4
    precision: str = "bf16"
    optimizer: str = "adamw"
    lr: float = 1e-4
    grad_ckpt: bool = False
    grad_accum: int = 1
    steps: int = 20                  # timed steps
    warmup: int = 5                  # untimed steps before them
    tempo_layers: str = ""           # comma list of gelu,layernorm,attention
    attention: str | None = None     # None: "tempo" when attention is a Tempo layer, else eager
    compile: bool = False
    device: str | None = None        # None: cuda when available (per local rank), else cpu
    seed: int = 1234
    memory_budget: int | None = None
    flops_formula: str = "gemm"
    peak_tflops: float | None = None  # override the table (e.g. an unknown GPU)
    hf_head: str = "pretraining"
    unpad: bool = False              # run on the real tokens only (our BERT)
    padding: float = 0.0             # share of padding tokens in the synthetic batches, 0..0.5
    max_grad_norm: float = 1.0       # the trainers' clipping policy (tempo/train/step.py)

    @property
    def predictions(self) -> int:
        return self.max_predictions if self.max_predictions is not None else default_max_predictions(self.seq_len)

    @property
    def tempo_kinds(self) -> tuple[str, ...]:
        return parse_kinds(self.tempo_layers, flag="--tempo-layers")

    @property
    def choice(self) -> TempoChoice:
        """The benchmark's Tempo choice: the kinds listed in tempo_layers are on (--tempo: all)."""
        return TempoChoice.from_flags(bool(self.tempo_kinds), self.tempo_kinds, self.attention)

    @property
    def attention_impl(self) -> str:
        return self.choice.attention

    def validate(self) -> None:
        for name in ("seq_len", "batch_size", "grad_accum", "steps"):
            if getattr(self, name) <= 0:
                raise BenchError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.warmup < 0:
            raise BenchError("--warmup cannot be negative")
        if self.precision not in PRECISIONS:
            raise BenchError(f"--precision must be one of {PRECISIONS}")
        if self.optimizer not in OPTIMIZERS:
            raise BenchError(f"--optimizer must be one of {OPTIMIZERS}")
        try:
            self.choice
        except ChoiceError as exc:
            raise BenchError(str(exc)) from None
        if not 0 < self.predictions <= self.seq_len:
            raise BenchError("--max-predictions must be in [1, seq-len]")
        if self.unpad and self.model.startswith("hf:"):
            raise BenchError("--unpad runs our BERT only; for transformers' models use apply_tempo's padding-free "
                             "path (DataCollatorWithFlattening)")
        if not 0.0 <= self.padding <= 0.5:
            raise BenchError(f"--padding must be in [0, 0.5], got {self.padding}")
        if self.flops_formula not in FORMULAS:
            raise BenchError(f"--flops-formula must be one of {FORMULAS}")


# -- command line, shared by train / max-batch / sweep / profile --------------------------------
def add_train_args(p: argparse.ArgumentParser, with_batch_size: bool = True) -> None:
    d = TrainBenchConfig()
    p.add_argument("--model", default=d.model,
                   help="bert_tiny/mini/base/large, a config JSON, hf:bert-large or hf:<local dir>")
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len)
    if with_batch_size:
        p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="micro-batch per device")
    p.add_argument("--max-predictions", type=positive_int, default=None, help="MLM positions (default 15%% of seq-len)")
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    p.add_argument("--lr", type=positive_number, default=d.lr)
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing per encoder layer")
    p.add_argument("--grad-accum", type=positive_int, default=d.grad_accum, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="timed steps")
    p.add_argument("--warmup", type=non_negative_int, default=d.warmup, help="untimed steps first")
    p.add_argument("--tempo", action="store_true", help=f"the default: every Tempo layer with efficient attention (= --tempo-layers "
                        f"{','.join(LAYER_KINDS)} --attention efficient); the paper's: --tempo-layers "
                        f"{','.join(PAPER_KINDS)} --attention tempo")
    p.add_argument("--tempo-layers", "--tempo_layers", dest="tempo_layers", default="",
                   help=f"comma list of Tempo layer kinds to turn on: {','.join(LAYER_KINDS)}")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="attention core (default: tempo when Tempo attention is on, else eager)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--unpad", action="store_true", help="compute on the real tokens only (our BERT; tempo.unpad)")
    p.add_argument("--padding", type=number_in(0.0, 0.5), default=d.padding,
                   help="share of padding tokens in the synthetic batches, 0..0.5: each sequence's length is "
                        "drawn uniformly from [L(1-2P), L] (default 0: packed data)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=non_negative_int, default=d.seed)
    p.add_argument("--memory-budget", type=positive_size, default=None,
                   help="simulate OOM above this many bytes of weights+grads+states+activations (e.g. 2GiB)")
    p.add_argument("--flops-formula", choices=FORMULAS, default=d.flops_formula)
    p.add_argument("--peak-tflops", type=positive_number, default=None,
                   help="peak for MFU when the GPU is not in the table")
    p.add_argument("--hf-head", choices=("pretraining", "mlm"), default=d.hf_head)
    add_training_flags(p, dashes=True)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> TrainBenchConfig:
    names = {f.name for f in fields(TrainBenchConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if getattr(args, "tempo", False):
        default = TempoChoice.default()  # --tempo: the one default, as in the trainers and apply_tempo
        values["tempo_layers"] = ",".join(default.kinds)
        if values.get("attention") is None:
            values["attention"] = default.attention
    values.update(overrides)
    return TrainBenchConfig(**values)


def config_to_argv(cfg: TrainBenchConfig) -> list[str]:
    """The ``train`` flags that rebuild ``cfg`` (for the subprocess probes of max-batch/sweep)."""
    argv: list[str] = []
    defaults = TrainBenchConfig()
    for f in fields(TrainBenchConfig):
        value = getattr(cfg, f.name)
        if value == getattr(defaults, f.name) and f.name not in ("model", "batch_size", "seq_len"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif value is not None and value != "":
            argv += [flag, str(value)]
    return argv


# -- building blocks -----------------------------------------------------------------------------
def synthetic_batches(vocab_size: int, batch: int, seq_len: int, predictions: int, device: torch.device,
                      count: int = 2, seed: int = 0, hf_labels: bool = False,
                      padding: float = 0.0) -> list[dict[str, torch.Tensor]]:
    """``count`` random pretraining batches in DLE's layout, already on ``device``.

    With ``padding`` 0 every token is real, as packed pretraining data is; otherwise each
    sequence's length is drawn uniformly from [L(1 - 2·padding), L] (right padding), so about that
    share of the tokens is padding. Masked positions are distinct, sorted and inside the real
    tokens (at most the sequence's length of them; the rest are label -1, as DLE pads them).
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    low = max(1, int(round(seq_len * (1 - 2 * padding))))
    for _ in range(count):
        lengths = torch.randint(low, seq_len + 1, (batch,), generator=g) if padding > 0 else torch.full((batch,), seq_len)
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        # Random keys, padding pushed past every real position: the first `predictions` are real.
        keys = torch.rand(batch, seq_len, generator=g) + (1 - mask) * 2
        positions = keys.argsort(dim=1)[:, :predictions].sort(dim=1).values
        labels = torch.randint(0, vocab_size, (batch, predictions), generator=g)
        labels = labels.masked_fill(mask.gather(1, positions) == 0, -1)
        positions = positions * mask.gather(1, positions)  # padding predictions point at token 0, label -1
        segment = (torch.arange(seq_len)[None, :] >= (lengths[:, None] // 2)).long() * mask
        b = {
            "input_ids": torch.randint(0, vocab_size, (batch, seq_len), generator=g) * mask,
            "segment_ids": segment.contiguous(),
            "input_mask": mask,
            "masked_lm_positions": positions,
            "masked_lm_labels": labels,
            "next_sentence_labels": torch.randint(0, 2, (batch,), generator=g),
        }
        if hf_labels:
            from tempo.bench.hf_provider import hf_labels as make_labels

            b["hf_labels"] = make_labels(b)
        out.append({k: v.to(device) for k, v in b.items()})
    return out


@dataclass
class BuiltModel:
    model: nn.Module
    config: Any
    loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    provider: str          # "tempo" (ours) or "hf"
    mlm_positions: int     # positions the MLM head runs on, per sequence
    nsp: bool


def build_model(cfg: TrainBenchConfig) -> BuiltModel:
    from tempo.bench import hf_provider

    if hf_provider.is_hf_model(cfg.model):
        if cfg.tempo_kinds or cfg.attention_impl == "tempo":
            raise BenchError("Tempo layers apply to our model only; HF models take --attention eager|sdpa")
        try:
            model, config = hf_provider.build_hf_model(cfg.model, cfg.attention_impl, cfg.hf_head, cfg.grad_ckpt)
        except hf_provider.ProviderError as exc:
            raise BenchError(str(exc)) from None
        head = cfg.hf_head
        return BuiltModel(model, config, lambda m, b: hf_provider.hf_loss(m, b, head), "hf",
                          mlm_positions=cfg.seq_len, nsp=head == "pretraining")

    from tempo.bert.model import BertForPreTraining

    config = resolve_our_config(cfg.model)
    kinds = cfg.tempo_kinds
    options = cfg.choice
    try:
        model = BertForPreTraining(config, options, checkpoint_activations=cfg.grad_ckpt, unpad=cfg.unpad)
    except ImportError as exc:  # a Tempo layer not in this checkout yet
        raise BenchError(f"Tempo layers {kinds} cannot be built here ({exc}); choose other --tempo-layers") from None

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return m(input_ids=b["input_ids"], token_type_ids=b["segment_ids"], attention_mask=b["input_mask"],
                 masked_lm_positions=b["masked_lm_positions"], masked_lm_labels=b["masked_lm_labels"],
                 next_sentence_labels=b["next_sentence_labels"]).loss

    return BuiltModel(model, config, loss_fn, "tempo", mlm_positions=cfg.predictions, nsp=True)


def build_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    from tempo.train.optim import bert_param_groups, make_optimizer

    groups = bert_param_groups(model, weight_decay=0.01)
    if name in ("adamw", "adamw_fused", "lamb"):
        return make_optimizer(name, groups, lr=lr)
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise BenchError(f"--optimizer adafactor: torch {torch.__version__} has no torch.optim.Adafactor")
        return torch.optim.Adafactor(groups, lr=lr)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise BenchError("--optimizer adamw8bit needs bitsandbytes, which is not installed") from None
        return bnb.optim.AdamW8bit(groups, lr=lr)
    raise BenchError(f"unknown optimizer {name!r}")


def _ledger_bytes(built: BuiltModel, batch: dict[str, torch.Tensor], precision: str, device: torch.device) -> int:
    """Bytes autograd keeps for one forward of ``batch`` (the graph is dropped unused)."""
    from tempo.memory import ActivationLedger

    with ActivationLedger(built.model) as ledger, autocast_context(precision, device):
        built.loss_fn(built.model, batch)
    return ledger.activation_bytes


def _slice_batch(batch: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: v[:n] for k, v in batch.items()}


# -- the run -------------------------------------------------------------------------------------
def run_train_bench(cfg: TrainBenchConfig, on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the benchmark in this process; returns the result record (see module docstring).

    ``on_step(i)`` is called after every step (the profiler's step hook).
    """
    from tempo.train.runtime import setup_runtime, teardown_runtime

    cfg.validate()
    try:
        wanted = torch.device(cfg.device) if cfg.device is not None else None
    except RuntimeError:
        raise BenchError(f"--device {cfg.device!r}: not a device; use cpu, cuda or cuda:N") from None
    if wanted is not None and wanted.type not in ("cpu", "cuda"):
        raise BenchError(f"--device {cfg.device!r}: must be cpu, cuda or cuda:N")
    if wanted is not None and wanted.type == "cuda" and not torch.cuda.is_available():
        raise BenchError(f"--device {cfg.device}: no CUDA GPU visible")
    rt = setup_runtime(local_rank_flag=wanted.index if wanted is not None and wanted.index is not None else -1,
                       force_cpu=wanted is not None and wanted.type == "cpu")
    try:
        return _run(cfg, rt, on_step)
    finally:
        teardown_runtime(rt)


def _run(cfg: TrainBenchConfig, rt, on_step: Callable[[int], None] | None) -> dict[str, Any]:
    device = rt.device
    configure_matmul_precision(cfg.precision)
    torch.manual_seed(cfg.seed)
    built = build_model(cfg)
    model = built.model.to(device).train()
    optimizer = build_optimizer(cfg.optimizer, model, cfg.lr)
    batches = synthetic_batches(built.config.vocab_size, cfg.batch_size, cfg.seq_len, cfg.predictions, device,
                                count=2, seed=cfg.seed + rt.rank, hf_labels=built.provider == "hf",
                                padding=cfg.padding)

    # Ledger first, on the eager model, before the allocator peak is reset.
    activations = _ledger_bytes(built, batches[0], cfg.precision, device)
    per_sample = fixed = None
    if cfg.batch_size > 1:
        one = _ledger_bytes(built, _slice_batch(batches[0], 1), cfg.precision, device)
        per_sample = (activations - one) / (cfg.batch_size - 1)
        fixed = int(round(activations - per_sample * cfg.batch_size))

    train_model: nn.Module = wrap_ddp(model, rt)
    if cfg.compile:
        train_model = torch.compile(train_model)
    # The trainers' own step: same autocast, scaler, clipping and skip rules as run_pretraining.py.
    train_step = TrainStep(model, optimizer, built.loss_fn, cfg.precision, device, max_grad_norm=cfg.max_grad_norm,
                           train_model=train_model, distributed=rt.distributed, measure_activations=False)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    weights = anat.weight_bytes(model)
    grads = states = 0
    clock = StepClock(device, excluded=cfg.warmup, per_step=True)
    loss_value = float("nan")
    for step in range(cfg.warmup + cfg.steps):
        clock.begin_step()
        micro = [batches[(step * cfg.grad_accum + i) % len(batches)] for i in range(cfg.grad_accum)]
        out = train_step(micro)
        if step == 0:
            grads = anat.gradient_bytes(model)
            states = anat.optimizer_state_bytes(optimizer)
            if cfg.memory_budget is not None:
                needed = weights + grads + states + activations
                if needed > cfg.memory_budget:
                    raise SimulatedOOM(f"out of memory (simulated): batch {cfg.batch_size} needs "
                                       f"{format_bytes(needed)} of weights+grads+states+activations, "
                                       f"budget {format_bytes(cfg.memory_budget)}")
        if step == cfg.warmup + cfg.steps - 1:
            loss_value = out.loss.item()
        clock.end_step(out.samples * rt.world_size, out.tokens * rt.world_size)
        if on_step is not None:
            on_step(step)
    clock.stop()
    step_times = clock.step_times

    timed = step_times[cfg.warmup:]
    samples_per_step = cfg.batch_size * cfg.grad_accum * rt.world_size
    samples_per_s = len(timed) * samples_per_step / sum(timed) if timed and sum(timed) > 0 else float("nan")
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    flop_parts = bert_pretraining_flops(built.config, cfg.seq_len, built.mlm_positions, nsp=built.nsp,
                                        grad_ckpt=cfg.grad_ckpt)
    per_seq = flops_per_sequence(cfg.flops_formula, built.config, cfg.seq_len, built.mlm_positions, nsp=built.nsp,
                                 grad_ckpt=cfg.grad_ckpt, num_parameters=num_params)
    tflops = per_seq * samples_per_s / 1e12
    tflops_per_device = tflops / rt.world_size
    name = device_name(device)
    peak = cfg.peak_tflops if cfg.peak_tflops is not None else (
        peak_tflops(name, cfg.precision) if device.type == "cuda" else None)

    memory: dict[str, Any] = {}
    peak_alloc = None
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        peak_alloc = torch.cuda.max_memory_allocated(device)
        memory = {"peak_allocated_bytes": peak_alloc, "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
                  "num_alloc_retries": stats.get("num_alloc_retries", 0), "num_ooms": stats.get("num_ooms", 0)}
    else:
        memory = peak_memory_bytes(device)
    anatomy = anat.MemoryAnatomy(weights=weights, gradients=grads, optimizer_states=states, activations=activations,
                                 activations_fixed=fixed, activations_per_sample=per_sample,
                                 peak_allocated=peak_alloc,
                                 activations_source="eager ledger" if cfg.compile else "ledger")
    return {
        "kind": "train",
        "config": asdict(cfg),
        "tempo_layers": list(cfg.tempo_kinds),
        "attention": cfg.attention_impl,
        "max_predictions": cfg.predictions,
        "env": environment(device),
        "provider": built.provider,
        "num_parameters": num_params,
        "world_size": rt.world_size,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * cfg.seq_len,
        "real_tokens_per_s": clock.timed_tokens / sum(timed) if timed and sum(timed) > 0 else float("nan"),
        "padding_share": 1.0 - sum(int(b["input_mask"].count_nonzero()) for b in batches)
                         / sum(b["input_mask"].numel() for b in batches),
        "unpad": cfg.unpad,
        "step_time_ms": {k: v * 1000 for k, v in spread(timed).items()},
        "step_times_s": step_times,
        "warmup_steps": cfg.warmup,
        "flops": {"formula": cfg.flops_formula, "per_sequence": per_seq, "gemm_breakdown": flop_parts},
        "model_tflops": tflops,
        "model_tflops_per_device": tflops_per_device,
        "peak_tflops": peak,
        "mfu": mfu(tflops_per_device, peak),
        "memory": memory,
        "anatomy": anatomy.to_dict(),
        "final_loss": loss_value,
        "is_main": rt.is_main,
    }


def format_summary(r: dict[str, Any]) -> str:
    c = r["config"]
    a = r["anatomy"]
    mfu_text = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "- (no peak for this device)"
    t = r["step_time_ms"]
    lines = [
        f"model {c['model']} ({r['provider']}), s={c['seq_len']}, micro-batch {c['batch_size']} x accum "
        f"{c['grad_accum']} x world {r['world_size']}, {c['precision']}, {c['optimizer']}, "
        f"tempo [{','.join(r['tempo_layers']) or '-'}], attention {r['attention']}, "
        f"grad_ckpt {c['grad_ckpt']}, compile {c['compile']}, {r['env']['device_name']}",
        f"  {r['samples_per_s']:.2f} samples/s | step p20/p50/p80 {t['p20']:.1f}/{t['p50']:.1f}/{t['p80']:.1f} ms "
        f"| {r['model_tflops_per_device']:.2f} TFLOPS/device ({r['flops']['per_sequence'] / 1e9:.1f} GFLOP/seq, "
        f"{r['flops']['formula']}; counts every position, padding too) | MFU {mfu_text}",
        f"  {r['real_tokens_per_s']:.0f} real tokens/s, padding {r['padding_share']:.1%} of the batch, "
        f"{'unpadded (real tokens only)' if r['unpad'] else 'padded'}",
        f"  memory: weights {format_bytes(a['weights'])}, grads {format_bytes(a['gradients'])}, "
        f"optimizer {format_bytes(a['optimizer_states'])}, activations {format_bytes(a['activations'])}, "
        f"temporaries {format_bytes(a['temporaries'])}",
    ]
    m = r["memory"]
    if "peak_allocated_bytes" in m:
        lines.append(f"  peak allocated {format_bytes(m['peak_allocated_bytes'])}, reserved "
                     f"{format_bytes(m['peak_reserved_bytes'])}, alloc retries {m['num_alloc_retries']}, "
                     f"OOMs {m['num_ooms']}")
    lines.append(f"  final loss {r['final_loss']:.4f}")
    return "\n".join(lines)
