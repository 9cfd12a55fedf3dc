"""The on/off switch for Tempo layers in the trainers, and the state the patch scripts flip.

The original Tempo workflow copied a patched modeling.py over DLE's (``patch_tempo.sh``) and
back (``unpatch_tempo.sh``). Here nothing is copied: the scripts write one word, "tempo" or
"original", to a state file, and ``run_pretraining.py``/``run_squad.py`` read it to choose their
default. ``--tempo``/``--no-tempo`` and ``--attention`` on the command line always win.

State file: ``$TEMPO_PATCH_FILE`` if set, else ``.tempo_patch`` in the current working directory
(where the scripts and the trainers are run from: the checkout for DLE-style use, any folder for an
installed package, never inside the installed package); absent means "original", as an unpatched
DLE checkout.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tempo.bert.data.token_budget import POLICIES, TokenBudget, TokenBudgetError
from tempo.choices import ATTENTIONS, PAPER_KINDS, LAYER_KINDS, ChoiceError, TempoChoice
from tempo.train.runtime import UsageError

from tempo.utils import atomic_write_text, non_negative_number, positive_int, positive_size

STATES = ("tempo", "original")


def patch_state_file() -> Path:
    env = os.environ.get("TEMPO_PATCH_FILE")
    if env:
        return Path(env)
    return Path.cwd() / ".tempo_patch"


def patched_default() -> bool:
    """True when the patch scripts switched Tempo on."""
    path = patch_state_file()
    try:
        word = path.read_text().strip()
    except FileNotFoundError:
        return False
    if word not in STATES:
        raise UsageError(f"{path}: expected 'tempo' or 'original', found {word!r}; "
                         f"rerun scripts/tempo/patch_tempo.sh or unpatch_tempo.sh")
    return word == "tempo"


def write_patch_state(state: str) -> Path:
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
    return atomic_write_text(patch_state_file(), state + "\n")


def add_tempo_flags(parser: argparse.ArgumentParser, default_enabled: bool | None = None,
                    unpad_default: bool = True) -> None:
    """--tempo/--no-tempo, --tempo_layers, --attention, --unpad/--no-unpad: the same flags for the
    trainers and the bench.

    ``default_enabled`` None means: as the patch scripts set it (the trainers); the benchmark
    passes False so that a measurement never depends on a state file. ``unpad_default``: the
    trainers unpad by default (as MLPerf's BERT); the benchmark measures padded batches unless told.
    """
    group = parser.add_argument_group("Tempo")
    group.add_argument("--tempo", action=argparse.BooleanOptionalAction, default=default_enabled,
                       help="use Tempo layers (default: as set by scripts/tempo/patch_tempo.sh, else off)"
                       if default_enabled is None else "use Tempo layers")
    group.add_argument("--tempo_layers", "--tempo-layers", dest="tempo_layers", type=str, default=None,
                       help=f"comma-separated layer kinds Tempo replaces when on, of {','.join(LAYER_KINDS)} "
                            f"(default: all of them, with efficient attention; the paper's layers are "
                            f"--tempo_layers {','.join(PAPER_KINDS)} --attention tempo)")
    group.add_argument("--attention", choices=ATTENTIONS, default=None,
                       help="attention implementation (default: efficient with --tempo, tempo with "
                            "--tempo_layers ...,attention, else eager)")
    group.add_argument("--unpad", action=argparse.BooleanOptionalAction, default=unpad_default,
                       help="compute on the real tokens only: a padded batch becomes its T real tokens "
                            "before the embeddings and every layer runs on [T, hidden] (tempo.unpad; "
                            "same loss and gradients as the padded batch, to rounding)"
                            + (" (default: on)" if unpad_default else " (default: off)"))


ON_NONFINITE = ("stop", "skip")


def add_training_flags(parser: argparse.ArgumentParser, dashes: bool = False, nonfinite_flag: bool = False) -> None:
    """Flags of the one training step (tempo/train/step.py) every trainer and the benchmark share.

    ``nonfinite_flag``: add ``--on_nonfinite {stop,skip}`` (the trainers; the benchmark keeps the
    step's default, stop)."""
    name = "--max-grad-norm" if dashes else "--max_grad_norm"
    parser.add_argument(name, dest="max_grad_norm", type=non_negative_number, default=1.0,
                        help="clip gradients to this global L2 norm (after fp16 unscaling; 0 = no clipping; "
                             "LAMB applies it inside its step)")
    if nonfinite_flag:
        parser.add_argument("--on-nonfinite" if dashes else "--on_nonfinite", dest="on_nonfinite",
                            choices=ON_NONFINITE, default="stop",
                            help="a step whose loss or gradient norm is NaN/inf (fp32/bf16): 'stop' reports "
                                 "it and exits with status 1 (default), 'skip' leaves the weights, optimizer "
                                 "state and schedule as they were and goes on (each skip is logged and "
                                 "counted). fp16 runs keep GradScaler's own skip-and-rescale")


# -- token-budget batches (--max_tokens): tempo/bert/data/token_budget.py does the batching ------------------
def max_tokens_flag(text: str) -> int | str:
    """``--max_tokens``: a positive number of tokens, or "auto" (the planner's, see ``planned_max_tokens``)."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive number of tokens or 'auto', got {text!r}") from None


def add_token_budget_flags(parser: argparse.ArgumentParser) -> None:
    """--max_tokens and its options, the same for run_pretraining.py and run_squad.py."""
    group = parser.add_argument_group("token-budget batches")
    group.add_argument("--max_tokens", type=max_tokens_flag, default=None,
                       help="fill each micro-batch with whole sequences up to N tokens per GPU instead of "
                            "--train_batch_size sequences (real tokens with --unpad, the padded batch with "
                            "--no-unpad); 'auto': the planner's tokens per step (tempo.plan). An optimizer step "
                            "is --gradient_accumulation_steps such micro-batches on each of the world size GPUs")
    group.add_argument("--token_batching", choices=POLICIES, default="bucket",
                       help="with --max_tokens: 'bucket' sorts by length and fills batches of similar lengths "
                            "(default), 'pack' packs first-fit decreasing (fuller batches, mixed lengths: "
                            "--unpad only)")
    group.add_argument("--max_sequences_per_batch", type=positive_int, default=None,
                       help="with --max_tokens: at most this many sequences per micro-batch")
    group.add_argument("--memory_budget", type=positive_size, default=None,
                       help="with --max_tokens auto: the memory a step's tensors may use, e.g. 24GiB (default: "
                            "90%% of the GPU's; needed on the CPU)")
    group.add_argument("--pad_to_multiple_of", type=positive_int, default=8,
                       help="with --max_tokens: a micro-batch is cut to its longest sequence rounded up to this "
                            "multiple (default 8)")


def token_budget_from_args(args: argparse.Namespace, max_tokens: int) -> TokenBudget:
    """The TokenBudget of the flags: real tokens counted with --unpad, the padded batch with --no-unpad
    (what each path's activation memory grows with)."""
    try:
        return TokenBudget(max_tokens, args.token_batching, args.max_sequences_per_batch, args.pad_to_multiple_of,
                           count="real" if args.unpad else "padded")
    except TokenBudgetError as exc:
        hint = " (--token_batching pack needs --unpad)" if args.token_batching == "pack" and not args.unpad else ""
        raise UsageError(f"--max_tokens: {exc}{hint}") from None


def check_max_tokens(args: argparse.Namespace, max_seq_length: int) -> None:
    """Before any work: a number must hold one sequence of --max_seq_length; 'auto' needs the planner."""
    if args.max_tokens is None:
        return
    if args.max_tokens == "auto":
        _planner()
        return
    budget = token_budget_from_args(args, args.max_tokens)
    need = budget.cost([max_seq_length])
    if args.max_tokens < need:
        raise UsageError(f"--max_tokens {args.max_tokens} cannot hold one sequence of --max_seq_length "
                         f"{max_seq_length} ({need} tokens as counted): pass at least {need}")


def _planner():
    """The module tempo.plan, or a UsageError saying that 'auto' needs it."""
    import importlib

    try:
        plan = importlib.import_module("tempo.plan")
    except ModuleNotFoundError as exc:
        if exc.name != "tempo.plan":
            raise  # the planner exists but lacks a dependency: say so, do not hide it
        raise UsageError("--max_tokens auto needs the planner (tempo.plan), which this installation does not "
                         "have; pass a number of tokens per micro-batch, e.g. --max_tokens 8192") from None
    if not callable(getattr(plan, "tokens_per_step", None)):
        raise UsageError("--max_tokens auto needs tempo.plan.tokens_per_step(...), which tempo.plan does not define")
    return plan


def planned_max_tokens(model, lengths, device, precision: str, optimizer: str, budget: str | None = None,
                       world_size: int = 1, parallel: str | None = None) -> int:
    """--max_tokens auto: the planner's tokens per step for this run; the trainers' one call site of
    tempo.plan. The run's terms become the planner's: ``device`` (a torch.device) its kind, "cuda" (the
    current GPU; without ``budget`` (--memory_budget) the planner's default share of its memory) or
    "cpu" (a budget is needed); ``precision`` tf32 counts as fp32; ``optimizer`` adamw_fused is
    "adamw-fused". ``lengths``: a sample of the data's sequence lengths. The model is planned as it
    will run (its Tempo layers are the --tempo flags', not apply_tempo's). The planner's own refusal
    (its PlanError) becomes one line. ``world_size`` and ``parallel`` ("ddp", "fsdp2"): planned per
    rank (tempo.plan.parallel)."""
    plan = _planner()
    try:
        tokens = plan.tokens_per_step(model, budget=budget, lengths=lengths,
                                      device="cuda" if device.type == "cuda" else "cpu",
                                      precision="fp32" if precision == "tf32" else precision,
                                      optimizer=optimizer.replace("_", "-"), tempo=False,
                                      **({"world_size": world_size, "parallel": parallel} if parallel else {}))
    except getattr(plan, "PlanError", ()) as exc:
        raise UsageError(f"--max_tokens auto: {exc}") from None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise UsageError(f"--max_tokens auto: tempo.plan.tokens_per_step returned {tokens!r}, not a positive number "
                         "of tokens")
    return tokens


def tempo_choice_from_args(args: argparse.Namespace) -> TempoChoice:
    enabled = patched_default() if args.tempo is None else args.tempo
    try:
        return TempoChoice.from_flags(enabled, args.tempo_layers, args.attention)
    except ChoiceError as exc:
        raise UsageError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    """`python -m tempo.train.flags {patch,unpatch,check}`: what the shell scripts call."""
    parser = argparse.ArgumentParser(prog="python -m tempo.train.flags")
    parser.add_argument("action", choices=("patch", "unpatch", "check"))
    args = parser.parse_args(argv)
    if args.action == "check":
        print("Tempo" if patched_default() else "Original")
        return 0
    path = write_patch_state("tempo" if args.action == "patch" else "original")
    print(f"{'Tempo' if args.action == 'patch' else 'Original'} layers are now the default "
          f"for run_pretraining.py and run_squad.py ({path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
