"""A mutation run: apply each mutant of a mutants file (realistic one-to-three-line bugs) to the
checkout this script lives in, run the test files that exercise the mutated module (stop at the
first failure), revert, record. It tells how many bugs of each kind the default test run catches.

Run it in a CLONE (it reverts files with git checkout and refuses a checkout with changes):

    git clone -q . /tmp/mut && cd /tmp/mut
    python scripts/mutation/run_mutants.py results/mutation/round2.json            # every mutant
    python scripts/mutation/run_mutants.py results/mutation/round2.json N03 N07    # these only
    python scripts/mutation/run_mutants.py results/mutation/round2.json --full     # survivors: whole suite
    python scripts/mutation/run_mutants.py results/mutation/round2.json --report

A mutants file is a list of {id, file, old, new, why} (``old`` must occur once in ``file``); the
results go beside it (<name>.results.json, resumable), each run's pytest output to
mutation_logs/<id>[.full].txt. One pytest process at a time; tests import the clone through
PYTHONPATH. The files of results/mutation/ record the runs of issue 26 (their ``old`` texts match
the commits named in results/mutation/README.md, not necessarily today's code).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: scripts/mutation/ -> repository root
MUTANTS = RESULTS = Path()  # set by main() from its first argument
LOGS = ROOT / "mutation_logs"
# Seconds per mutant (MUTATION_TIMEOUT_S overrides: on 2 shared cores an integration file's targeted tests take longer)
TIMEOUT_S = int(os.environ.get("MUTATION_TIMEOUT_S", 900))
FULL_TIMEOUT_S = 2400
PYTEST = [sys.executable, "-m", "pytest", "-m", "not slow", "-x", "-q", "-p", "no:cacheprovider"]

# Test files run first for a mutated file (the most direct ones, fast first); the files that grep finds
# for the module's name follow (see targeted_tests).
INTEGRATION = ["test_patch.py", "test_encoders.py", "test_stock_parity.py", "test_hf_padding_free.py",
               "test_hf_attention_weights.py", "test_patch_floor.py", "test_gated_mlp.py", "test_dropout_replay.py",
               "test_deberta_efficient.py", "test_sentence_transformers.py", "test_memory.py",
               "test_host_reads.py", "test_exactness.py"]
FIRST = {
    "tempo/plan/confirm.py": ["test_plan_confirm.py"],
    "tempo/integrations/recompute.py": ["test_plan_recompute.py", "test_plan.py"],
    "tempo/plan/planner.py": ["test_plan.py", "test_token_budget.py", "test_plan_confirm.py", "test_demo.py"],
    "tempo/ops/rmsnorm.py": ["test_rmsnorm.py", "test_stock_parity.py", "test_compile_graphs.py", "test_dtype_swaps.py"],
    "tempo/integrations/recipe.py": ["test_dtype_swaps.py", "test_patch.py", "test_gated_mlp.py", "test_rmsnorm.py"],
    "tempo/integrations/layers.py": ["test_rmsnorm.py", "test_dtype_swaps.py"],
    "tempo/integrations/gated_mlp.py": ["test_gated_mlp.py"],
    "tempo/integrations/mpnet.py": ["test_mpnet.py"],
    "tempo/integrations/attention_switch.py": ["test_model_copies.py", "test_patch.py", "test_attention_kwargs.py"],
    "tempo/integrations/deberta.py": ["test_deberta_efficient.py"],
    "tempo/integrations/hf_attention.py": ["test_hf_padding_free.py", "test_hf_attention_weights.py",
                                           "test_attention_kwargs.py", "test_compile_graphs.py"],
    "tempo/ops/layernorm.py": ["test_layernorm.py", "test_host_reads.py", "test_dropout_add_layernorm.py",
                               "test_compile_graphs.py", "test_rmsnorm.py", "test_stock_parity.py", "test_patch.py"],
    "tempo/ops/dropout_add_layernorm.py": ["test_dropout_add_layernorm.py", "test_host_reads.py",
                                           "test_stock_parity.py", "test_patch.py"],
    "tempo/ops/gated_mlp.py": ["test_gated_mlp.py", "test_stock_parity.py", "test_host_reads.py", "test_encoders.py"],
    "tempo/ops/attention.py": ["test_attention_autocast.py", "test_mpnet.py", "test_attention_varlen.py",
                               "test_attention_dispatch.py",
                               "test_efficient_attention.py", "test_host_reads.py", "test_dropout_replay.py",
                               "test_unpad_layout.py", "test_unpad_model.py", "test_hf_padding_free.py"],
    "tempo/ops/combined.py": ["test_combined.py", "test_dropout_replay.py", "test_stock_parity.py"],
    "tempo/ops/disentangled_attention.py": ["test_disentangled_attention.py", "test_deberta_efficient.py"],
    "tempo/unpad.py": ["test_unpad_layout.py", "test_unpad_matrix.py", "test_unpad_model.py",
                       "test_attention_varlen.py", "test_host_reads.py"],
    "tempo/bert/model.py": ["test_bert_model.py", "test_unpad_model.py", "test_unpad_matrix.py",
                            "test_dropout_replay.py", "test_host_reads.py", "test_exactness.py"],
    "tempo/train/step.py": ["test_train_step.py", "test_optim.py", "test_pretraining.py"],
    "tempo/memory/__init__.py": ["test_memory.py", "test_movement.py"],
    "tempo/memory/tables.py": ["test_memory.py"],
    "tempo/tasks/demo.py": ["test_demo.py"],
    "tempo/ops/_backend.py": ["test_stock_parity.py", "test_dropout_add_layernorm.py", "test_combined.py",
                              "test_efficient_attention.py"],
    "tempo/movement/workloads.py": ["test_movement.py", "test_movement_hand_counts.py"],
    "tempo/movement/declarations.py": ["test_movement.py", "test_movement_hand_counts.py", "test_plan_heads.py"],
    "tempo/movement/trace.py": ["test_movement.py", "test_movement_hand_counts.py", "test_plan_heads.py"],
    "tempo/ops/linear_cross_entropy.py": ["test_linear_cross_entropy.py", "test_plan_heads.py", "test_movement.py"],
    "tempo/integrations/lm_loss.py": ["test_linear_cross_entropy.py", "test_plan_heads.py"],
    "tempo/plan/live.py": ["test_plan_parallel.py", "test_plan_band.py", "test_plan_confirm.py", "test_plan_heads.py"],
    "tempo/plan/parallel.py": ["test_plan_parallel.py"],
    "tempo/train/checkpointing.py": ["test_checkpointing.py", "test_fsdp2_in_process.py"],
    "tempo/plan/probe.py": ["test_plan_heads.py", "test_plan.py", "test_plan_band.py"],
    "tempo/plan/trace.py": ["test_plan_heads.py", "test_plan.py", "test_plan_contracts.py"],
    "tempo/plan/cli.py": ["test_plan_heads.py", "test_cli_numbers.py", "test_plan.py"],
    "tempo/presets.py": ["test_presets.py", "test_plan_heads.py"],
    "tempo/choices.py": ["test_bert_model.py", "test_pretraining.py"],
}
# grep patterns (fixed strings) naming a module in tests/: every file that matches is run too.
GREP = {
    "tempo/integrations/": ["apply_tempo", "tempo.integrations", "hf_attention", "revert_tempo"],
    "tempo/ops/layernorm.py": ["layernorm", "LayerNorm"],
    "tempo/ops/dropout_add_layernorm.py": ["dropout_add_layernorm", "DropoutAddLayerNorm"],
    "tempo/ops/gated_mlp.py": ["gated_linear", "GatedMLP"],
    "tempo/ops/rmsnorm.py": ["rmsnorm", "RMSNorm"],
    "tempo/plan/": ["tempo.plan"],
    "tempo/ops/attention.py": ["tempo.ops.attention", "efficient_attention", "EfficientAttention"],
    "tempo/ops/combined.py": ["combined", "Combined"],
    "tempo/ops/disentangled_attention.py": ["disentangled_attention"],
    "tempo/unpad.py": ["unpad", "TokenLayout"],
    "tempo/bert/model.py": ["tempo.bert.model", "key_padding_mask"],
    "tempo/train/step.py": ["tempo.train.step", "train_step"],
    "tempo/memory/": ["tempo.memory", "FakeSession", "ActivationLedger"],
    "tempo/presets.py": ["tempo.presets", "tempo import presets"],
    "tempo/tasks/demo.py": ["tempo.tasks.demo", "tasks import demo"],
    "tempo/movement/": ["tempo.movement"],
}
# Baseline seconds per file (the clean default run): grep-found files are run fastest first.
_BASELINE_ORDER_HINT = ["test_exactness.py", "test_pretraining.py", "test_gelu.py", "test_host_reads.py"]


def targeted_tests(file: str) -> list[str]:
    first = list(FIRST.get(file, []))
    if file.startswith("tempo/integrations/"):
        first += [t for t in INTEGRATION if t not in first]
    found: set[str] = set()
    for prefix, patterns in GREP.items():
        if file.startswith(prefix):
            for pattern in patterns:
                out = subprocess.run(["grep", "-l", "-F", pattern, "-r", "tests", "--include=test_*.py"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.split()
                found.update(Path(p).name for p in out)
    rest = sorted(found - set(first), key=lambda t: (t in _BASELINE_ORDER_HINT, t))
    return [f"tests/{t}" for t in first + rest if (ROOT / "tests" / t).exists()]


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def save_results(results: dict) -> None:
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(RESULTS)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def revert(file: str) -> None:
    git("checkout", "--", file)


def apply(mutant: dict) -> None:
    path = ROOT / mutant["file"]
    if git("status", "--porcelain", "--", mutant["file"]).strip():
        raise RuntimeError(f"{mutant['file']} is not clean before {mutant['id']}")
    text = path.read_text()
    if text.count(mutant["old"]) != 1:
        raise RuntimeError(f"{mutant['id']}: old text occurs {text.count(mutant['old'])} times in {mutant['file']}")
    path.write_text(text.replace(mutant["old"], mutant["new"], 1))


def first_failure(output: str) -> str:
    for pattern in (r"^(FAILED|ERROR) (\S+)", r"^(ERROR) collecting (\S+)"):
        hit = re.search(pattern, output, re.M)
        if hit:
            return hit.group(2)
    return ""


def run_pytest(args: list[str], log: Path, timeout: int) -> tuple[str, str, float, int]:
    """(status, first failing test, seconds, rc). status: killed, survived, timeout, error."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    started = time.time()
    with open(log, "w") as out:
        out.write("$ " + " ".join(PYTEST + args) + "\n")
        out.flush()
        proc = subprocess.Popen(PYTEST + args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the pytest process this script started, and its children
            proc.wait()
            rc = -9
    seconds = time.time() - started
    output = log.read_text()
    if rc == -9:
        return "timeout", "", seconds, rc
    if rc == 0:
        return "survived", "", seconds, rc
    if rc in (1, 2):  # tests failed / interrupted by -x or a collection error
        return "killed", first_failure(output), seconds, rc
    return "error", first_failure(output), seconds, rc


def check_clone() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    where = subprocess.run([sys.executable, "-c", "import tempo; print(tempo.__file__)"], cwd="/tmp", env=env,
                           capture_output=True, text=True).stdout.strip()
    if where != str(ROOT / "tempo" / "__init__.py"):
        raise SystemExit(f"tempo imports from {where!r}, not this clone: activate the venv, run from the clone")
    dirty = [l for l in git("status", "--porcelain").splitlines() if not l.startswith("??")]
    if dirty:
        raise SystemExit(f"the clone has changes to tracked files: {dirty}")


def main(argv: list[str]) -> int:
    global MUTANTS, RESULTS
    files = [a for a in argv if a.endswith(".json")]
    if len(files) != 1 or not Path(files[0]).is_file():
        raise SystemExit("usage: run_mutants.py MUTANTS.json [ID ...] [--full | --report] (see the docstring)")
    MUTANTS = Path(files[0]).resolve()
    RESULTS = MUTANTS.with_suffix(".results.json")
    argv = [a for a in argv if a != files[0]]
    full = "--full" in argv
    if "--report" in argv:
        return report()
    named = [a for a in argv if not a.startswith("--")]
    check_clone()
    mutants = json.loads(MUTANTS.read_text())
    if named:
        unknown = set(named) - {m["id"] for m in mutants}
        if unknown:
            raise SystemExit(f"unknown mutant ids: {sorted(unknown)}")
        mutants = [m for m in mutants if m["id"] in named]
    LOGS.mkdir(exist_ok=True)
    results = load_results()
    for mutant in mutants:
        mid = mutant["id"]
        entry = results.setdefault(mid, {"file": mutant["file"]})
        if full:
            if not named and entry.get("targeted", {}).get("status") != "survived":
                continue
            if not named and "full" in entry:
                continue
            args, log, timeout, key = [], LOGS / f"{mid}.full.txt", FULL_TIMEOUT_S, "full"
        else:
            if not named and "targeted" in entry:
                continue
            args = targeted_tests(mutant["file"])
            log, timeout, key = LOGS / f"{mid}.txt", TIMEOUT_S, "targeted"
        apply(mutant)
        try:
            status, test, seconds, rc = run_pytest(args, log, timeout)
        finally:
            revert(mutant["file"])
        entry[key] = {"status": status, "test": test, "seconds": round(seconds, 1), "rc": rc,
                      "files": len(args) if args else "all"}
        save_results(results)
        print(f"{mid} {key}: {status} {test} ({seconds:.0f} s)", flush=True)
    return 0


def report() -> int:
    results = load_results()
    mutants = {m["id"]: m for m in json.loads(MUTANTS.read_text())}
    killed = survived_targeted = survived_full = 0
    for mid, m in mutants.items():
        e = results.get(mid, {})
        t = e.get("targeted", {})
        f = e.get("full", {})
        status = t.get("status", "not run")
        final = f.get("status", status) if status == "survived" else status
        killed += final in ("killed", "timeout")
        survived_targeted += status == "survived"
        survived_full += final == "survived"
        print(f"{mid:4} {m['file']:40} {status:9} {f.get('status', ''):9} {t.get('seconds', '')!s:>6} "
              f"{(f.get('test') or t.get('test') or '')[:90]}")
    n = len(mutants)
    unconfirmed = sum(1 for mid in mutants if results.get(mid, {}).get("targeted", {}).get("status") == "survived"
                      and "full" not in results.get(mid, {}))
    print(f"\ntargeted: killed {n - survived_targeted}/{n}; counting the full default run of survivors: killed "
          f"{killed}/{n}, survived {survived_full}"
          + (f" ({unconfirmed} survivor(s) not yet run against the full suite: --full)" if unconfirmed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
