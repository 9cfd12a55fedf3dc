"""``python -m tempo.bench max-batch``: the largest batch that fits, each probe in a fresh process.

Search: double from ``--start`` until a probe fails (or ``--max`` is reached), then bisect
between the largest batch that fitted and the smallest that did not. A probe that fails at
``--start`` bisects downwards to 1. Every probe is a new subprocess, so an OOM (and the
allocator state, the CUDA context, fragmentation it leaves) never affects the next probe.

Two ways to probe:
  * our training benchmark (default): ``python -m tempo.bench train <your flags> --batch-size N
    --steps 3 --warmup 0``. With ``--memory-budget`` (on machines without a GPU) a probe fits
    iff weights + gradients + optimizer states + ledger activations <= budget, computed in the
    probe process by the same code (train_bench), which exits "out of memory (simulated ...)".
  * ``--command "<any command line with {batch}>"``: exit status 0 = fits; a non-zero exit whose
    output mentions an out-of-memory condition (see OOM_MARKERS) = does not fit; any other
    failure stops the search and is reported (exit status 2), with the output's tail.

Writes ``{"max_batch": N, "probes": [{"batch", "fits", "seconds"}, ...], ...}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import asdict
from typing import Callable

# OOM_MARKERS/is_oom_output: one rule for "did not fit", shared with tempo.plan.confirm's probes.
from tempo.train.max_batch import OOM_MARKERS, ProbeError, SearchError, is_oom_output, search_max_batch  # noqa: F401


def command_probe(template: str, timeout: float | None = None, verbose: bool = True) -> Callable[[int], bool]:
    """Probe running ``template`` (a shell command line) with {batch} replaced."""
    if "{batch}" not in template:
        raise ValueError("--command must contain {batch}")

    def probe(batch: int) -> bool:
        command = template.replace("{batch}", str(batch))
        try:
            proc = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ProbeError(batch, f"timed out after {timeout} s: {command}") from None
        output = (proc.stdout or "") + (proc.stderr or "")
        if proc.returncode == 0:
            fits = True
        elif is_oom_output(output):
            fits = False
        else:
            tail = "\n".join(output.strip().splitlines()[-15:])
            raise ProbeError(batch, f"exit status {proc.returncode} (not an out-of-memory): {command}\n{tail}")
        if verbose:
            print(f"  batch {batch}: {'fits' if fits else 'out of memory'}", flush=True)
        return fits

    return probe


def train_probe_template(train_argv: list[str]) -> str:
    """The shell command of one training probe: 3 steps at {batch}, in a fresh interpreter."""
    argv = [sys.executable, "-m", "tempo.bench", "train", *train_argv, "--steps", "3", "--warmup", "0"]
    return " ".join(shlex.quote(a) for a in argv) + " --batch-size {batch}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tempo.bench.train_bench import add_train_args
    from tempo.utils import positive_int, positive_number

    p.add_argument("--command", default=None,
                   help='generic mode: a command line containing {batch}, e.g. "python run_squad.py --train_batch_size {batch}"')
    p.add_argument("--start", type=positive_int, default=1, help="first batch tried")
    p.add_argument("--max", dest="max_batch", type=positive_int, default=None, help="never try more than this")
    p.add_argument("--timeout", type=positive_number, default=None, help="seconds per probe")
    p.add_argument("--out", default=None, help="write the JSON result here")
    add_train_args(p, with_batch_size=False)


def main(args: argparse.Namespace) -> int:
    from tempo.bench.results import write_json
    from tempo.bench.train_bench import config_from_args, config_to_argv

    if args.command is not None:
        template = args.command
    else:
        cfg = config_from_args(args, steps=3, warmup=0)
        cfg.validate()
        # batch size comes from {batch}; steps/warm-up are the probe's own
        argv = _drop_flags(config_to_argv(cfg), ("--batch-size", "--steps", "--warmup"))
        template = train_probe_template(argv)
    print(f"max-batch: probing {template}", flush=True)
    record = {"kind": "max_batch", "command": template, "start": args.start, "max": args.max_batch}
    status = 0
    try:
        answer, probes = search_max_batch(command_probe(template, args.timeout), args.start, args.max_batch)
        record["max_batch"] = answer
        print(f"max-batch: largest batch that fits: {answer}"
              + (" (the --max cap)" if args.max_batch is not None and answer == args.max_batch else ""))
    except SearchError as exc:
        probes = exc.probes
        record["max_batch"] = None
        record["error"] = str(exc)
        print(f"max-batch: error: probe failed for a reason other than memory, search stopped:\n{exc}",
              file=sys.stderr)
        status = 2
    record["probes"] = [asdict(p) for p in probes]
    if args.out:
        write_json(args.out, record)
    return status


def _drop_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out
