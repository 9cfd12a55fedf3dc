"""Contrastive sentence-transformers training (all-MiniLM-L6-v2, all-mpnet-base-v2's geometry) with and without Tempo.

MultipleNegativesRankingLoss (InfoNCE with in-batch negatives) gets better with bigger batches:
every other pair in the batch is a negative. The batch is bounded by memory, so this example
measures what Tempo buys there, then trains both ways:

1. Largest batch. The bytes autograd keeps for backward over one training forward of B pairs
   (tempo.memory.ActivationLedger; anchors and positives padded to --max_seq_length, so 2B
   sequences of exactly that many tokens), and from them the largest B whose activations plus
   the training state (fp32 weights + gradients + two Adam moments = 16 bytes per parameter)
   fit --memory_budget (activations are linear in the batch; ``tempo.plan`` counts a whole step's
   peak instead).
2. Training. ``SentenceTransformerTrainer`` + ``MultipleNegativesRankingLoss`` for --max_steps,
   stock and ``apply_tempo(model)`` (same seed, same data): the final loss and samples/s each.
3. GradCache check. ``CachedMultipleNegativesRankingLoss`` embeds mini-batches under no_grad,
   then replays each with grad after restoring the RNG state it saved; its gradient is exact only
   if the replay draws the same dropout masks. With dropout on (train mode, MiniLM's 0.1), its
   gradient is compared with a direct one (the same mini-batches in the same order, with grad,
   from the same seed), stock model (the control) and Tempo model.

The pairs are local (no download): the project's generated corpus, anchor = a document's first
sentence, positive = another sentence of the document that names its subject again.

``--model mpnet``: all-mpnet-base-v2's geometry (the most-downloaded sentence-transformers model:
MPNetModel, 12 layers, h 768, 12 heads, relative position bias, dropout 0.1, mean pooling,
normalised) built from its config with random weights (no download; the shipped MiniLM's uncased
WordPiece tokenizer stands in for MPNet's, whose 30527 ids include its 30522). Its losses say
nothing about quality; the bytes, the largest batch and the GradCache check are the point.

    python examples/st_contrastive_batch.py                              # all three parts
    python examples/st_contrastive_batch.py --memory_budget 4GiB --max_seq_length 256
    python examples/st_contrastive_batch.py --only tempo --max_steps 50  # train one variant
    python examples/st_contrastive_batch.py --max_steps 0                # no training
    python examples/st_contrastive_batch.py --model mpnet --max_steps 0 --max_seq_length 384 --memory_budget 24GiB

Exit status 1 when a GradCache check fails. The trainer needs `accelerate`; without it the
script says so and exits with 2.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_trainer_mlm import NEEDS_ACCELERATE, accelerate_available, non_negative_int, positive_int  # noqa: E402

VARIANTS = ("stock", "tempo")
REPLAY_TOLERANCE = 1e-5  # relative L2; fp32 reorderings stay far below, one different mask far above


# -- data ----------------------------------------------------------------------------------------------
def document_pairs(out_dir: Path, num_documents: int, seed: int) -> tuple[list[str], list[str]]:
    """(anchors, positives): a document's first sentence, which introduces its subject ("Zuksav is
    a city in the west of Poustfiwi."), and another sentence of it that names the subject again
    ("The main industry of Zuksav is textiles."), picked at random.

    The other pairs of the batch are the negatives; their sentences share the templates and often
    the country, so what tells the positive apart is the invented name (several word pieces).
    Documents whose subject is not named again are left out, repeated anchors kept once."""
    from tempo.bert.data.sample_corpus import write_sample_corpus

    rng = random.Random(seed)
    anchors, positives, seen = [], [], set()
    for path in write_sample_corpus(out_dir, num_documents=num_documents, seed=seed):
        for block in path.read_text(encoding="utf-8").split("\n\n"):
            sentences = [s.strip() for s in block.split("\n") if s.strip()]
            if not sentences or sentences[0] in seen:
                continue
            subject = [w.strip("(),.") for w in sentences[0].split()[:2] if w[:1].isupper() and w != "The"]
            naming = [s for s in sentences[1:] if any(re.search(rf"\b{re.escape(w)}\b", s) for w in subject)]
            if naming:
                seen.add(sentences[0])
                anchors.append(sentences[0])
                positives.append(rng.choice(naming))
    return anchors, positives


def load_minilm():
    from sentence_transformers import SentenceTransformer

    from tempo.bert.hf_interop import minilm_dir

    return SentenceTransformer(str(minilm_dir()), device="cpu")


# all-mpnet-base-v2's config.json (what MPNetConfig does not default to the same value)
MPNET_BASE = dict(vocab_size=30527, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, max_position_embeddings=514, relative_attention_num_buckets=32,
                  hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, layer_norm_eps=1e-5)
MPNET_POSITION_OFFSET = 2  # MPNet's positions start at padding_idx + 1 = 2


def build_mpnet(seed: int = 0, **overrides: Any):
    """A SentenceTransformer of all-mpnet-base-v2's geometry (``MPNET_BASE``, ``overrides`` on top),
    random weights: MPNetModel, mean pooling, normalisation, as all-mpnet-base-v2 is; the shipped
    MiniLM's tokenizer (see the module docstring)."""
    from transformers import MPNetConfig, MPNetModel

    model = load_minilm()
    torch.manual_seed(seed)
    config = MPNetConfig(**{**MPNET_BASE, **overrides})
    model[0].model = MPNetModel(config, add_pooling_layer=False)
    model[0].max_seq_length = config.max_position_embeddings - MPNET_POSITION_OFFSET
    model[1] = type(model[1])(config.hidden_size, pooling_mode="mean")
    return model


MODELS = {"minilm": ("all-MiniLM-L6-v2", load_minilm),
          "mpnet": ("all-mpnet-base-v2's geometry (random weights)", build_mpnet)}


def padded_features(model, texts: list[str], max_seq_length: int) -> dict[str, Any]:
    """The model's inputs for ``texts``, every row padded (or cut) to exactly ``max_seq_length``."""
    return model.preprocess(texts, processing_kwargs={"text": {"padding": "max_length", "truncation": True,
                                                              "max_length": max_seq_length}})


# -- 1. largest batch ----------------------------------------------------------------------------------
def kept_bytes(model, anchors: list[str], positives: list[str], max_seq_length: int, seed: int) -> int:
    """Bytes autograd keeps for backward over one MNRL training forward of these pairs."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from tempo.memory import ActivationLedger

    loss_fn = MultipleNegativesRankingLoss(model)
    features = [padded_features(model, texts, max_seq_length) for texts in (anchors, positives)]
    model.train()
    torch.manual_seed(seed)
    with ActivationLedger(model) as ledger:
        loss = loss_fn(features, None)
    del loss
    return ledger.activation_bytes


def training_state_bytes(model) -> int:
    """fp32 weights + gradients + Adam's two moments: what a step keeps besides activations."""
    return sum(p.numel() for p in model.parameters()) * 4 * 4


def largest_batch(kept: int, batch: int, state_bytes: int, budget: int) -> int:
    """The largest batch whose activations (``kept`` for ``batch`` pairs, linear in the batch) plus
    the training state fit ``budget``."""
    return max(0, int((budget - state_bytes) // (kept / batch)))


def format_batch_table(rows: dict[str, int], pairs: int, state_bytes: int, budget: int) -> str:
    from tempo.utils import format_bytes

    header = ("variant", "bytes kept per pair", f"largest batch in {format_bytes(budget)}")
    lines = [header]
    fits = {name: largest_batch(kept, pairs, state_bytes, budget) for name, kept in rows.items()}
    for name, kept in rows.items():
        lines.append((name, format_bytes(kept / pairs), f"{fits[name]} pairs"))
    if "stock" in rows and "tempo" in rows:
        lines.append(("tempo / stock", f"{rows['tempo'] / rows['stock']:.2f}x",
                      f"{fits['tempo'] / max(1, fits['stock']):.2f}x"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)


# -- 2. training ---------------------------------------------------------------------------------------
class StepClock(TrainerCallback):
    """Notes the wall time at the end of every optimizer step."""

    def __init__(self):
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def train_once(args: argparse.Namespace, variant: str, base_model, dataset) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    from transformers import set_seed

    from tempo.integrations.patch import apply_tempo

    set_seed(args.seed)
    model = copy.deepcopy(base_model)  # both variants start from the same weights
    model.max_seq_length = args.max_seq_length
    if variant == "tempo":
        apply_tempo(model)  # before the trainer: it builds the optimizer from these modules
    training_args = SentenceTransformerTrainingArguments(
        output_dir=str(args.output_dir / variant), max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size, learning_rate=args.learning_rate,
        warmup_steps=max(1, args.max_steps // 10), logging_steps=max(1, args.max_steps // 5),
        # no duplicate texts in a batch: a duplicate would be a negative identical to the positive
        batch_sampler=BatchSamplers.NO_DUPLICATES, save_strategy="no", report_to="none", seed=args.seed,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True)
    step_ends = StepClock()
    trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset,
                                         loss=MultipleNegativesRankingLoss(model), callbacks=[step_ends])
    metrics = trainer.train().metrics
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # From the end of step 1: the first step also pays one-time setup, and whichever variant runs
    # first would pay more of it.
    timed = step_ends.times[-1] - step_ends.times[0] if len(step_ends.times) > 1 else float("nan")
    return {"variant": variant, "final_loss": logged[-1] if logged else float("nan"),
            "mean_loss": metrics.get("train_loss", float("nan")),
            "samples_per_second": (len(step_ends.times) - 1) * args.per_device_train_batch_size / timed}


# -- 3. GradCache replay check -------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cached_mnrl_replay_check(model, anchors: list[str], positives: list[str], mini_batch_size: int,
                             max_seq_length: int, seed: int = 0) -> dict[str, Any]:
    """CachedMultipleNegativesRankingLoss's gradient vs a direct one, dropout on.

    CachedMNRL (sentence_transformers.base.losses.gradcache) runs, per column (anchors, then
    positives) and per mini-batch in order: save the RNG state, embed under no_grad. It caches
    d loss / d embedding, then replays each mini-batch with grad from its saved RNG state. The
    reference does the forwards of step one with grad instead, from the same seed, so it draws
    the masks step one drew (provided a forward consumes the RNG alike with and without grad), and
    back-propagates MultipleNegativesRankingLoss directly. Returned: relative L2 differences of the
    replayed embeddings vs the no_grad ones (the GradCache invariant), of the reference embeddings
    vs the no_grad ones, of the gradients (all parameters as one vector, and the worst parameter),
    the loss difference, and ``passed``.
    """
    from sentence_transformers.base.losses.gradcache import _create_minibatch, _minibatch_ranges
    from sentence_transformers.sentence_transformer.losses import (CachedMultipleNegativesRankingLoss,
                                                                   MultipleNegativesRankingLoss)

    model.train()
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    # unpadded, as the trainer's collator gives them; _create_minibatch trims each mini-batch's padding
    features = [model.preprocess(texts, processing_kwargs={"text": {"max_length": max_seq_length}})
                for texts in (anchors, positives)]

    forwards: list[tuple[bool, torch.Tensor]] = []  # (grad enabled, sentence embedding) per model call
    hook = model.register_forward_hook(
        lambda module, args, output: forwards.append((torch.is_grad_enabled(),
                                                      output["sentence_embedding"].detach().clone())))
    try:
        cached_loss_fn = CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        cached_loss = cached_loss_fn(features, None)
        cached_loss.backward()  # the replay runs here, in the loss's backward hook
        cached_grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
        no_grad_embeddings = torch.cat([e for grad, e in forwards if not grad])
        replayed_embeddings = torch.cat([e for grad, e in forwards if grad])
    finally:
        hook.remove()

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    columns = [torch.cat([model(_create_minibatch(f, begin, end))["sentence_embedding"]
                          for begin, end in _minibatch_ranges(f, mini_batch_size)]) for f in features]
    reference_loss = MultipleNegativesRankingLoss(model).compute_loss_from_embeddings(columns, None)
    reference_loss.backward()
    reference_grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    reference_embeddings = torch.cat([c.detach() for c in columns])
    model.zero_grad(set_to_none=True)

    # Without dropout every mask question is moot and the check proves nothing: measure that it bites.
    model.eval()
    with torch.no_grad():
        eval_embeddings = torch.cat([model(f)["sentence_embedding"] for f in features])
    model.train()

    if cached_grads.keys() != reference_grads.keys():
        differ = sorted(cached_grads.keys() ^ reference_grads.keys())
        raise AssertionError(f"CachedMNRL and the reference gave gradients to different parameters: {differ}")
    cached_all = torch.cat([cached_grads[n].flatten() for n in reference_grads])
    reference_all = torch.cat([reference_grads[n].flatten() for n in reference_grads])
    # Per parameter, only those with a gradient: d loss / d (key bias) is 0 in exact arithmetic (the
    # softmax over keys ignores a shift common to all keys), so what is computed there is rounding
    # noise (~1e-9 of the total) and a relative error of it means nothing.
    floor = 1e-6 * reference_all.norm()
    per_param = {n: _rel(cached_grads[n], g) for n, g in reference_grads.items() if g.norm() > floor}
    worst = max(per_param, key=per_param.get)
    result = {
        "dropout_effect": _rel(no_grad_embeddings, eval_embeddings),
        "replay_vs_no_grad": _rel(replayed_embeddings, no_grad_embeddings),
        "reference_vs_no_grad": _rel(reference_embeddings, no_grad_embeddings),
        "grad": _rel(cached_all, reference_all),
        "worst_param": worst, "worst_param_grad": per_param[worst],
        "loss_diff": abs(cached_loss.item() - reference_loss.item()),
    }
    if result["dropout_effect"] < 1e-3:
        raise AssertionError(f"dropout changed the embeddings by {result['dropout_effect']:.1e} only: is it off?")
    result["passed"] = all(result[key] <= REPLAY_TOLERANCE
                           for key in ("grad", "worst_param_grad", "replay_vs_no_grad", "reference_vs_no_grad"))
    return result


def format_check(variant: str, r: dict[str, Any]) -> str:
    return (f"{variant:<6} {'PASS' if r['passed'] else 'FAIL'}  grad rel L2 {r['grad']:.2e} "
            f"(worst {r['worst_param']}: {r['worst_param_grad']:.2e})  embeddings rel L2: replay vs no_grad "
            f"{r['replay_vs_no_grad']:.2e}, reference vs no_grad {r['reference_vs_no_grad']:.2e}  "
            f"|loss diff| {r['loss_diff']:.2e}  (dropout moves the embeddings by {r['dropout_effect']:.2e})")


# -- main ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="minilm",
                        help="minilm: the shipped all-MiniLM-L6-v2; mpnet: all-mpnet-base-v2's geometry (random "
                             "weights)")
    parser.add_argument("--only", choices=VARIANTS, default=None, help="train one variant (default: both)")
    parser.add_argument("--max_steps", type=non_negative_int, default=20,
                        help="optimizer steps per run (0: no training)")
    parser.add_argument("--per_device_train_batch_size", type=positive_int, default=16, help="pairs per step")
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--max_seq_length", type=positive_int, default=128,
                        help="tokens per sequence: the measured batch is padded to it, training truncates to it")
    parser.add_argument("--memory_budget", default="2GiB",
                        help="budget for the largest batch (weights, gradients, Adam moments, activations)")
    parser.add_argument("--measure_pairs", type=positive_int, default=4,
                        help="pairs in the batch the ledger measures")
    parser.add_argument("--check_pairs", type=positive_int, default=16, help="pairs in the GradCache check")
    parser.add_argument("--mini_batch_size", type=positive_int, default=4,
                        help="CachedMNRL's mini-batch in the check")
    parser.add_argument("--num_documents", type=positive_int, default=400,
                        help="documents of the generated corpus")
    parser.add_argument("--output_dir", type=Path, default=Path("out/st_contrastive_batch"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from tempo.utils import parse_bytes

    try:
        budget = parse_bytes(args.memory_budget)
    except ValueError as exc:
        parser.error(f"--memory_budget: {exc}")
    if args.max_steps and not accelerate_available():  # say so before spending time on data
        print(NEEDS_ACCELERATE, file=sys.stderr)
        return 2
    from datasets import Dataset

    from tempo.integrations.patch import apply_tempo, tempo_patched

    anchors, positives = document_pairs(args.output_dir / "corpus", args.num_documents, args.seed)
    needed = max(args.measure_pairs, args.check_pairs)
    if len(anchors) < needed:
        parser.error(f"--num_documents: {args.num_documents} documents give {len(anchors)} pairs, fewer than "
                     f"the {needed} that --measure_pairs/--check_pairs need")
    model_name, load = MODELS[args.model]
    stock_model = load()
    config = stock_model[0].auto_model.config
    positions = config.max_position_embeddings - (MPNET_POSITION_OFFSET if args.model == "mpnet" else 0)
    if args.max_seq_length > positions:
        parser.error(f"--max_seq_length: {args.max_seq_length} is more than {model_name}'s {positions} positions")
    tempo_model = apply_tempo(copy.deepcopy(stock_model))
    print(f"{len(anchors)} (anchor, positive) pairs from {args.num_documents} generated documents; "
          f"{model_name}, {sum(w.numel() for w in stock_model.parameters()) / 1e6:.1f}M parameters, dropout "
          f"{config.hidden_dropout_prob} hidden / {config.attention_probs_dropout_prob} attention; "
          f"Tempo: {tempo_patched(tempo_model)}")

    # 1. bytes kept for backward -> largest in-batch-negatives batch
    state_bytes = training_state_bytes(stock_model)
    sample = (anchors[:args.measure_pairs], positives[:args.measure_pairs])
    kept = {name: kept_bytes(model, *sample, args.max_seq_length, args.seed)
            for name, model in (("stock", stock_model), ("tempo", tempo_model))}
    print(f"\nLargest MNRL batch: a batch of B pairs embeds 2B sequences of {args.max_seq_length} tokens (padded); "
          f"measured at B={args.measure_pairs}, train mode; training state {state_bytes / 2**20:.0f} MiB "
          f"(16 bytes per parameter)")
    print(format_batch_table(kept, args.measure_pairs, state_bytes, budget))

    # 2. training
    if args.max_steps:
        dataset = Dataset.from_dict({"anchor": anchors, "positive": positives})
        print(f"\nTraining: MultipleNegativesRankingLoss, {args.max_steps} steps of {args.per_device_train_batch_size} "
              f"pairs, max_seq_length {args.max_seq_length}, seed {args.seed}")
        for variant in [args.only] if args.only else VARIANTS:
            r = train_once(args, variant, stock_model, dataset)
            print(f"{variant:<6} final_loss={r['final_loss']:.4f} mean_loss={r['mean_loss']:.4f} "
                  f"samples_per_second={r['samples_per_second']:.2f}")

    # 3. GradCache: does CachedMNRL's replay redraw the dropout masks of its no_grad pass?
    n = args.check_pairs
    print(f"\nCachedMultipleNegativesRankingLoss replay vs a direct gradient: {n} pairs, mini_batch_size "
          f"{args.mini_batch_size}, dropout on; passes at rel L2 <= {REPLAY_TOLERANCE:g}")
    passed = True
    for name, model in (("stock", stock_model), ("tempo", tempo_model)):
        r = cached_mnrl_replay_check(model, anchors[:n], positives[:n], args.mini_batch_size,
                                     args.max_seq_length, args.seed)
        print(format_check(name, r))
        passed &= r["passed"]
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
