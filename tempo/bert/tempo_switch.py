"""The on/off switch for Tempo layers in the trainers, and the state the patch scripts flip.

The original Tempo workflow copied a patched modeling.py over DLE's (``patch_tempo.sh``) and
back (``unpatch_tempo.sh``). Here nothing is copied: the scripts write one word, "tempo" or
"original", to a state file, and ``run_pretraining.py``/``run_squad.py`` read it to choose their
default. ``--tempo``/``--no-tempo`` and ``--attention`` on the command line always win.

State file: ``$TEMPO_PATCH_FILE`` if set, else ``.tempo_patch`` at the repository root (the
folder holding run_pretraining.py); absent means "original", as an unpatched DLE checkout.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tempo.bert.model import TempoOptions
from tempo.bert.runtime import UsageError

LAYER_KINDS = ("gelu", "layernorm", "attention")
STATES = ("tempo", "original")


def patch_state_file() -> Path:
    env = os.environ.get("TEMPO_PATCH_FILE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".tempo_patch"


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
    path = patch_state_file()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(state + "\n")
    os.replace(tmp, path)
    return path


def add_tempo_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Tempo")
    group.add_argument("--tempo", action=argparse.BooleanOptionalAction, default=None,
                       help="use Tempo layers (default: as set by scripts/tempo/patch_tempo.sh, else off)")
    group.add_argument("--tempo_layers", type=str, default=",".join(LAYER_KINDS),
                       help="comma-separated layer kinds Tempo replaces when on: gelu,layernorm,attention")
    group.add_argument("--attention", choices=("eager", "tempo", "sdpa"), default=None,
                       help="attention backend (default: tempo with --tempo, else eager)")


def tempo_options_from_args(args: argparse.Namespace) -> TempoOptions:
    enabled = patched_default() if args.tempo is None else args.tempo
    kinds = {k.strip() for k in args.tempo_layers.split(",") if k.strip()}
    unknown = kinds - set(LAYER_KINDS)
    if unknown:
        raise UsageError(f"--tempo_layers: unknown layer kind(s) {sorted(unknown)}; choose from {LAYER_KINDS}")
    attention = args.attention
    if attention is None:
        attention = "tempo" if enabled and "attention" in kinds else "eager"
    return TempoOptions(gelu=enabled and "gelu" in kinds, layernorm=enabled and "layernorm" in kinds,
                        attention=attention)


def main(argv: list[str] | None = None) -> int:
    """`python -m tempo.bert.tempo_switch {patch,unpatch,check}`: what the shell scripts call."""
    parser = argparse.ArgumentParser(prog="python -m tempo.bert.tempo_switch")
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
