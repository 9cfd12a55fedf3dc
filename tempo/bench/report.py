"""``python -m tempo.bench report DIR``: PNG plots and a markdown table from a results directory.

Reads every result record (``*.json`` with a "kind": sweep, layer, ops, max_batch, profile,
train) under DIR, writes next to them (or to --out-dir):
  report.md                markdown tables of all of them
  throughput_vs_batch.png  samples/s against batch size (sweep's batch rows)
  techniques.png           samples/s and the memory anatomy per technique row (sweep)
  layer.png                p50 ms of one encoder layer per variant and shape (layer)
  ops.png                  achieved GB/s per op and implementation vs copy bandwidth (ops)
  profile.png              share of time per kernel class (profile)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ANATOMY_PARTS = ("weights", "gradients", "optimizer_states", "activations", "temporaries")


def load_records(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    records = []
    for path in sorted(root.rglob("*.json")):
        if path.name == "trace.json" or "rows" in path.relative_to(root).parts:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "kind" in data:
            records.append((path, data))
    return records


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _num(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _label(row: dict[str, Any]) -> str:
    c = row.get("config", {})
    tempo = ",".join(row.get("tempo_layers") or []) or "-"
    return f"{c.get('precision')} {c.get('optimizer')} tempo[{tempo}] {row.get('attention', c.get('attention'))}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _train_cells(r: dict[str, Any]) -> list[str]:
    a = r.get("anatomy") or {}
    t = r.get("step_time_ms") or {}
    m = r.get("memory") or {}
    return [_num(r.get("samples_per_s")), _num(t.get("p50"), ".1f"), _num(r.get("model_tflops_per_device")),
            _num(r["mfu"] * 100, ".1f") if r.get("mfu") is not None else "-",
            *(_mib(a.get(k)) for k in ANATOMY_PARTS), _mib(m.get("peak_allocated_bytes"))]


TRAIN_HEADER = ["samples/s", "step p50 ms", "TFLOPS", "MFU %", "weights MiB", "grads MiB", "optim MiB",
                "activations MiB", "temporaries MiB", "peak alloc MiB"]


def sweep_section(path: Path, rec: dict[str, Any], out: Path, plt: Any) -> list[str]:
    env = rec.get("env", {})
    md = [f"## Sweep ({path.parent.name}, {env.get('device_name')}, torch {env.get('torch')})", ""]
    rows = [[r["group"], r["name"], r["status"], str(r["config"]["batch_size"]),
             *(_train_cells(r) if r["status"] == "ok" else ["-"] * len(TRAIN_HEADER))] for r in rec["rows"]]
    md += [_table(["group", "row", "status", "batch", *TRAIN_HEADER], rows), ""]
    batch_rows = [r for r in rec["rows"] if r["group"] == "batch" and r["status"] == "ok"]
    if batch_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["config"]["batch_size"] for r in batch_rows]
        ax.plot(xs, [r["samples_per_s"] for r in batch_rows], marker="o", label=_label(batch_rows[0]))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batch size")
        ax.set_ylabel("samples/s")
        ax.set_title("Throughput vs batch size")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_batch.png", dpi=120)
        plt.close(fig)
        md += ["![throughput vs batch](throughput_vs_batch.png)", ""]
    tech = [r for r in rec["rows"] if r["group"] == "technique" and r["status"] == "ok"]
    if tech:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        names = [r["name"] for r in tech]
        ax1.barh(names, [r["samples_per_s"] for r in tech])
        ax1.set_xlabel("samples/s")
        ax1.invert_yaxis()
        left = [0.0] * len(tech)
        for part in ANATOMY_PARTS:
            values = [max((r["anatomy"].get(part) or 0), 0) / 2**20 for r in tech]
            ax2.barh(names, values, left=left, label=part)
            left = [a + b for a, b in zip(left, values)]
        ax2.set_xlabel("MiB")
        ax2.invert_yaxis()
        ax2.legend(fontsize=7)
        fig.suptitle("Techniques: speed and memory anatomy")
        fig.tight_layout()
        fig.savefig(out / "techniques.png", dpi=120)
        plt.close(fig)
        md += ["![techniques](techniques.png)", ""]
    return md


def layer_section(path: Path, rec: dict[str, Any], out: Path, plt: Any) -> list[str]:
    modes = rec["modes"]
    md = [f"## Encoder layer ({rec['config']}, {rec['precision']}, {rec['env'].get('device_name')})", ""]
    rows = []
    for r in rec["rows"]:
        cells = [f"b{r['batch']} l{r['seq_len']}", r["variant"], r["status"]]
        cells += [_num(r[m]["ms"]["p50"], ".3f") if r["status"] == "ok" else "-" for m in modes]
        cells.append(_mib(r.get("ledger_bytes")))
        rows.append(cells)
    md += [_table(["shape", "variant", "status", *(f"{m} p50 ms" for m in modes), "ledger MiB"], rows), ""]
    ok = [r for r in rec["rows"] if r["status"] == "ok"]
    if ok:
        mode = "fwd+bwd" if "fwd+bwd" in modes else modes[0]
        shapes = sorted({(r["batch"], r["seq_len"]) for r in ok})
        variants = list(dict.fromkeys(r["variant"] for r in ok))
        fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            vals = {r["variant"]: r[mode]["ms"]["p50"] for r in ok if (r["batch"], r["seq_len"]) == shape}
            ax.bar([v for v in variants if v in vals], [vals[v] for v in variants if v in vals])
            ax.set_title(f"b{shape[0]} l{shape[1]}: {mode}")
            ax.set_ylabel("p50 ms")
            ax.tick_params(axis="x", rotation=45)
        fig.tight_layout()
        fig.savefig(out / "layer.png", dpi=120)
        plt.close(fig)
        md += ["![layer](layer.png)", ""]
    return md


def ops_section(path: Path, rec: dict[str, Any], out: Path, plt: Any) -> list[str]:
    modes = rec["modes"]
    md = [f"## Tempo ops ({rec['shapes']}, {rec['dtype']}, {rec['env'].get('device_name')}; "
          f"copy bandwidth {rec['copy_bandwidth_gb_per_s']:.0f} GB/s)", ""]
    rows = []
    for r in rec["rows"]:
        cells = [r["op"], r["impl"], r["status"]]
        for m in modes:
            cells += ([_num(r[m]["ms"]["p50"], ".3f"), _num(r[m]["gb_per_s"], ".1f")] if r["status"] == "ok"
                      else ["-", "-"])
        rows.append(cells)
    header = ["op", "impl", "status"] + [h for m in modes for h in (f"{m} p50 ms", f"{m} GB/s")]
    md += [_table(header, rows), ""]
    ok = [r for r in rec["rows"] if r["status"] == "ok"]
    if ok:
        mode = "both" if "both" in modes else modes[0]
        labels = [f"{r['op']}\n{r['impl']}" for r in ok]
        fig, ax = plt.subplots(figsize=(max(6, len(ok)), 4))
        ax.bar(labels, [r[mode]["gb_per_s"] for r in ok])
        ax.axhline(rec["copy_bandwidth_gb_per_s"], color="k", linestyle="--", label="copy bandwidth")
        ax.set_ylabel(f"GB/s ({mode})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ops.png", dpi=120)
        plt.close(fig)
        md += ["![ops](ops.png)", ""]
    return md


def profile_section(path: Path, rec: dict[str, Any], out: Path, plt: Any) -> list[str]:
    md = [f"## Profile ({path.parent.name}, {rec['time_source']})", ""]
    md += [_table(["class", "share"], [[c, f"{s:.1%}"] for c, s in rec["class_share"].items()]), ""]
    md += [_table(["kernel", "class", "calls", "share"],
                  [[r["name"][:80].replace("|", "/"), r["class"], str(r["calls"]), f"{r['share']:.1%}"]
                   for r in rec["top"][:15]]), ""]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(list(rec["class_share"]), [v * 100 for v in rec["class_share"].values()])
    ax.set_ylabel("% of profiled time")
    fig.tight_layout()
    fig.savefig(out / "profile.png", dpi=120)
    plt.close(fig)
    md += ["![profile](profile.png)", ""]
    return md


def max_batch_section(path: Path, rec: dict[str, Any]) -> list[str]:
    probes = ", ".join(f"{p['batch']}{'✓' if p['fits'] else '✗'}" for p in rec.get("probes", []))
    return [f"## Max batch ({path.name})", "", f"`{rec.get('command')}`", "",
            f"largest batch that fits: **{rec.get('max_batch')}**; probes: {probes}"
            + (f"; error: {rec['error']}" if rec.get("error") else ""), ""]


def train_section(path: Path, rec: dict[str, Any]) -> list[str]:
    return [f"## Train ({path.name}: {rec['config']['model']}, s={rec['config']['seq_len']}, "
            f"b={rec['config']['batch_size']}, {_label(rec)})", "", _table(TRAIN_HEADER, [_train_cells(rec)]), ""]


def write_report(root: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = out or root
    out.mkdir(parents=True, exist_ok=True)
    records = load_records(root)
    md = [f"# Tempo benchmark report: {root}", ""]
    if not records:
        md.append("No result records found.")
    for path, rec in records:
        kind = rec["kind"]
        if kind == "sweep":
            md += sweep_section(path, rec, out, plt)
        elif kind == "layer":
            md += layer_section(path, rec, out, plt)
        elif kind == "ops":
            md += ops_section(path, rec, out, plt)
        elif kind == "profile":
            md += profile_section(path, rec, out, plt)
        elif kind == "max_batch":
            md += max_batch_section(path, rec)
        elif kind == "train":
            md += train_section(path, rec)
    report = out / "report.md"
    report.write_text("\n".join(md) + "\n")
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results_dir", help="a results directory (e.g. results/cpu/20250101-120000)")
    p.add_argument("--out-dir", default=None, help="write plots and report.md here instead")


def main(args: argparse.Namespace) -> int:
    from tempo.bench.common import BenchError

    root = Path(args.results_dir)
    if not root.is_dir():
        raise BenchError(f"{root} is not a directory")
    report = write_report(root, Path(args.out_dir) if args.out_dir else None)
    print(f"report: {report}")
    return 0
