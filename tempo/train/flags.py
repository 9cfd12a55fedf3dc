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
import math
import os
from pathlib import Path
from typing import Callable

from tempo.choices import ATTENTIONS, PAPER_KINDS, LAYER_KINDS, ChoiceError, TempoChoice
from tempo.train.runtime import UsageError

from tempo.utils import atomic_write_text

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


# -- numeric flags: argparse ``type=`` functions, so NaN, inf and out-of-range values are refused
# when the command line is parsed (argparse prints "argument --x: ..." and exits with status 2).
def number_in(low: float | None = None, high: float | None = None, *, low_open: bool = False,
              high_open: bool = False) -> Callable[[str], float]:
    """A ``type=`` for a finite float in [low, high] (``low_open``/``high_open``: that end excluded)."""
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high:g}")
    want = "a finite number" + (" " + " and ".join(bounds) if bounds else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if not math.isfinite(value) or (low is not None and (value <= low if low_open else value < low)) or (
                high is not None and (value >= high if high_open else value > high)):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return value

    parse.__name__ = "number"  # argparse names the type in its fallback message
    return parse


finite_number = number_in()
positive_number = number_in(0.0, low_open=True)  # learning rates, log frequencies
non_negative_number = number_in(0.0)  # weight decay, clipping norm, epochs
proportion = number_in(0.0, 1.0, high_open=True)  # warm-up proportions: [0, 1)
_max_grad_norm = non_negative_number

ON_NONFINITE = ("stop", "skip")


def add_training_flags(parser: argparse.ArgumentParser, dashes: bool = False, nonfinite_flag: bool = False) -> None:
    """Flags of the one training step (tempo/train/step.py) every trainer and the benchmark share.

    ``nonfinite_flag``: add ``--on_nonfinite {stop,skip}`` (the trainers; the benchmark keeps the
    step's default, stop)."""
    name = "--max-grad-norm" if dashes else "--max_grad_norm"
    parser.add_argument(name, dest="max_grad_norm", type=_max_grad_norm, default=1.0,
                        help="clip gradients to this global L2 norm (after fp16 unscaling; 0 = no clipping; "
                             "LAMB applies it inside its step)")
    if nonfinite_flag:
        parser.add_argument("--on-nonfinite" if dashes else "--on_nonfinite", dest="on_nonfinite",
                            choices=ON_NONFINITE, default="stop",
                            help="a step whose loss or gradient norm is NaN/inf (fp32/bf16): 'stop' reports "
                                 "it and exits with status 1 (default), 'skip' leaves the weights, optimizer "
                                 "state and schedule as they were and goes on (each skip is logged and "
                                 "counted). fp16 runs keep GradScaler's own skip-and-rescale")


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
