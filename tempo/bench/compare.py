"""Model variants timed against each other in one process, alternately, on the same batches.

    python -m tempo.bench compare --variants original,all --mode train          # a training step
    python -m tempo.bench compare --variants original,all --mode predict        # prediction (no grad)
    python -m tempo.bench compare --variants original,original+unpad,all,all+unpad --seq-len 512 --padding 0.5

A variant is a Tempo choice (``original`` = no Tempo layer, ``paper`` = the paper's three,
``all`` = every Tempo layer, the --tempo default; ``sdpa`` = no Tempo layer with sdpa attention),
optionally ``+unpad`` (the model runs on the real tokens only). The model is the project's BERT for
question answering, by default loaded from the shipped all-MiniLM-L6-v2 (``--model`` names one of
our configs instead, randomly initialised). Each repeat times every variant once, in turn (so drift
of a shared machine hits them alike), after warm-up steps that are not timed; the table gives the
median and the spread (p20-p80) over repeats, and real tokens/s (padding excluded) beside
sequences/s. Timings are measurements of this machine, not of a GPU.

Batches: ``--padding P`` draws each sequence's length uniformly from [L·(1 − 2P), L] (P <= 0.5),
so that a share P of the batch is padding; the measured share is printed.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from tempo.bench.common import BenchError
from tempo.bench.timing import spread
from tempo.choices import TempoChoice
from tempo.utils import non_negative_int, number_in, positive_int, proportion

VARIANT_CHOICES = {
    "original": TempoChoice.none,
    "sdpa": lambda: TempoChoice.none("sdpa"),
    "paper": TempoChoice.full,
    "all": TempoChoice.floor,
}


@dataclass(frozen=True)
class Variant:
    name: str
    choice: TempoChoice
    unpad: bool


def parse_variants(spec: str) -> list[Variant]:
    variants = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        base, _, suffix = item.partition("+")
        if base not in VARIANT_CHOICES or suffix not in ("", "unpad"):
            raise BenchError(f"--variants: unknown variant {item!r}; use {sorted(VARIANT_CHOICES)} "
                             f"optionally followed by '+unpad'")
        variants.append(Variant(item, VARIANT_CHOICES[base](), suffix == "unpad"))
    if len(variants) < 1:
        raise BenchError("--variants: name at least one variant")
    return variants


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default="original,all", help="comma-separated variants (see above)")
    p.add_argument("--mode", choices=("train", "predict"), default="train")
    p.add_argument("--model", default="minilm", help="'minilm' (the shipped checkpoint) or one of our configs")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--padding", type=number_in(0.0, 0.5), default=0.0, help="share of padding tokens to draw, 0..0.5")
    p.add_argument("--steps", type=positive_int, default=3, help="steps per timed measurement")
    p.add_argument("--repeats", type=positive_int, default=5, help="measurements per variant (median taken)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps per variant first")
    p.add_argument("--dropout", type=proportion, default=None, help="override the config's dropout rates")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--seed", type=non_negative_int, default=0)


def _config(name: str, dropout):
    import dataclasses

    from tempo.bench.common import resolve_our_config
    from tempo.bert.config import BertConfig

    if name == "minilm":
        from tempo.bert.hf_interop import minilm_dir

        config = BertConfig.from_json_file(minilm_dir() / "config.json")
    else:
        config = resolve_our_config(name)
    if dropout is not None:
        config = dataclasses.replace(config, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return config


def make_batches(config, batch_size: int, seq_len: int, padding: float, count: int, seed: int):
    if not 0.0 <= padding <= 0.5:
        raise BenchError(f"--padding must be in [0, 0.5], got {padding}")
    g = torch.Generator().manual_seed(seed)
    low = max(1, int(round(seq_len * (1 - 2 * padding))))
    batches = []
    for _ in range(count):
        lengths = torch.randint(low, seq_len + 1, (batch_size,), generator=g)
        mask = (torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
        ids = torch.randint(1000 if config.vocab_size > 2000 else 5, config.vocab_size, (batch_size, seq_len),
                            generator=g) * mask
        types = torch.zeros_like(ids)
        start = torch.div(lengths, 2, rounding_mode="floor")
        batches.append(dict(input_ids=ids, token_type_ids=types, attention_mask=mask, start_positions=start,
                            end_positions=torch.minimum(start + 1, lengths - 1)))
    return batches


def build_model(config, variant: Variant, from_minilm: bool):
    from tempo.bert.model import BertForQuestionAnswering

    torch.manual_seed(0)
    model = BertForQuestionAnswering(config, variant.choice, unpad=variant.unpad)
    if from_minilm:
        from tempo.bert.hf_interop import load_hf_checkpoint, minilm_dir

        load_hf_checkpoint(model, minilm_dir())
    return model


def run(args) -> list[dict]:
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = parse_variants(args.variants)
    config = _config(args.model, args.dropout)
    batches = make_batches(config, args.batch_size, args.seq_len, args.padding, args.steps, args.seed)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    total = sum(b["attention_mask"].numel() for b in batches)
    models, optimizers = {}, {}
    for v in variants:
        model = build_model(config, v, args.model == "minilm")
        models[v.name] = model.train() if args.mode == "train" else model.eval()
        optimizers[v.name] = torch.optim.SGD(model.parameters(), lr=0.0) if args.mode == "train" else None

    def steps(name: str) -> None:
        model, optimizer = models[name], optimizers[name]
        for batch in batches:
            if args.mode == "train":
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    model(**{k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")})

    for v in variants:
        for _ in range(args.warmup):
            steps(v.name)
    seconds = {v.name: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:  # alternately: drift of a shared machine hits every variant alike
            start = time.perf_counter()
            steps(v.name)
            seconds[v.name].append(time.perf_counter() - start)
    rows = []
    for v in variants:
        s = spread(seconds[v.name])
        rows.append({"variant": v.name, "mode": args.mode, "seconds_per_step": s["p50"] / args.steps,
                     "p20": s["p20"] / args.steps, "p80": s["p80"] / args.steps,
                     "sequences_per_s": args.batch_size * args.steps / s["p50"],
                     "real_tokens_per_s": real / s["p50"], "padding_share": 1 - real / total})
    return rows


def format_rows(rows: list[dict], baseline: str) -> str:
    base = next(r for r in rows if r["variant"] == baseline)
    lines = [f"padding share of the batches: {rows[0]['padding_share']:.1%}",
             "| variant | mode | ms/step (median) | p20-p80 | sequences/s | real tokens/s | time vs "
             f"{baseline} |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['mode']} | {1e3 * r['seconds_per_step']:.1f} | "
                     f"{1e3 * r['p20']:.1f}-{1e3 * r['p80']:.1f} | {r['sequences_per_s']:.1f} | "
                     f"{r['real_tokens_per_s']:.0f} | {r['seconds_per_step'] / base['seconds_per_step']:.2f}x |")
    return "\n".join(lines)


def main(args) -> int:
    rows = run(args)
    print(format_rows(rows, rows[0]["variant"]))
    return 0
