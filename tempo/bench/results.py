"""Where results go and in what shape: results/<gpu-or-cpu>/<timestamp>/, JSON and CSV.

Every JSON file is one record ``{"kind": ..., "env": {...}, ...}`` (env: GPU name, driver,
torch/triton versions, git commit, see hardware.environment) so a file read on its own says
what produced it. CSV files flatten the rows for spreadsheets; nested values become dotted
column names (``anatomy.weights``), lists become JSON strings.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any, Iterable

from tempo.bench.hardware import device_label

from tempo.utils import atomic_write_text


def new_results_dir(root: str | Path, device: Any) -> Path:
    """results/<label>/<YYYYmmdd-HHMMSS>/ (a -N suffix when two runs start in the same second)."""
    base = Path(root) / device_label(device)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = base / stamp
    n = 1
    while path.exists():
        path = base / f"{stamp}-{n}"
        n += 1
    path.mkdir(parents=True)
    return path


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str | Path, record: Any) -> Path:
    return atomic_write_text(path, json.dumps(_clean(record), indent=2, sort_keys=False) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(_clean(list(value)))
        else:
            out[name] = _clean(value)
    return out


def write_csv(path: str | Path, rows: Iterable[dict[str, Any]], leading: tuple[str, ...] = ()) -> Path:
    """Rows (nested dicts allowed) as CSV; ``leading`` columns first, the rest in first-seen order."""
    flat = [flatten(r) for r in rows]
    columns: list[str] = [c for c in leading]
    for row in flat:
        for c in row:
            if c not in columns:
                columns.append(c)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in flat:
            writer.writerow({c: row.get(c, "") for c in columns})
    return path
