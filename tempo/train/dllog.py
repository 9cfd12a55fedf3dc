"""DLLogger-style logging without the dllogger package.

DLE's scripts write JSON lines prefixed with ``DLLL `` to ``--json-summary``; tools that parse
those files keep working on ours. Each record:

    DLLL {"timestamp": 1700000000.0, "elapsedtime": 1.2, "type": "LOG", "step": 10, "data": {...}}

``step`` is an int for per-step records, a list (e.g. ``[]``) for summaries, or "PARAMETER" for
the run's configuration, as DLLogger does.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible instead of crashing
    if hasattr(value, "item") and callable(value.item):
        return _jsonable(value.item())
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class JsonLogger:
    """Appends DLLL records to ``path``; a no-op when ``path`` is None (non-zero ranks)."""

    def __init__(self, path: str | None):
        self.path = path
        self.start = time.time()
        self._fh = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fh = open(path, "a", buffering=1)  # line-buffered: a killed run keeps its log

    def _write(self, step: Any, data: dict[str, Any]) -> None:
        if self._fh is None:
            return
        now = time.time()
        record = {"timestamp": now, "elapsedtime": now - self.start, "type": "LOG",
                  "step": step, "data": _jsonable(data)}
        self._fh.write("DLLL " + json.dumps(record) + "\n")

    def parameters(self, params: dict[str, Any]) -> None:
        self._write("PARAMETER", params)

    def log(self, step: int, data: dict[str, Any]) -> None:
        self._write(step, data)

    def summary(self, data: dict[str, Any]) -> None:
        self._write([], data)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_dllog(path: str) -> list[dict[str, Any]]:
    """Parse a DLLL file back into records (used by tests and the benchmark scripts)."""
    records = []
    with open(path) as fh:
        for line in fh:
            if line.startswith("DLLL "):
                records.append(json.loads(line[5:]))
    return records
