"""Every code block of README.md and docs/ runs (issue 27.3), so no snippet can go stale.

The rules, for a fenced block in README.md or docs/**/*.md:
  * ``python``: executed in a fresh interpreter from a scratch folder (the package installed, the
    repository's ``examples/`` on the path, no network), unless the line before it is
    ``<!-- docs-test: gpu -->`` (needs CUDA). A block that raises fails with its file and line.
    ``<!-- docs-test: continue -->`` runs it after the previous python block of the same page.
  * shell (``bash``, ``sh``, ``console``): the line before it must say what it is:
    ``<!-- docs-test: smoke -->`` (short commands, run from the repository root by the slow tests),
    ``<!-- docs-test: ci -->`` (the README's install commands: .ci/run runs each of them verbatim),
    ``<!-- docs-test: gpu -->`` (needs CUDA) or ``<!-- docs-test: long -->`` (minutes to hours:
    the full runs the docs describe). An unmarked shell block fails this test.
  * anything else (``text``, output, tables in code fences): not code, not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHELLS = {"bash", "sh", "shell", "console"}
MARKS = {"smoke", "ci", "gpu", "long", "continue", "output"}
_FENCE = re.compile(r"^(\s*)```(\S*)")
_MARK = re.compile(r"^\s*<!--\s*docs-test:\s*(\S+)\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    mark: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").split("\n")
    found, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = match.group(1), match.group(2).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(prev)
        found.append(Block(path, start + 1, lang, mark.group(1) if mark else None, "\n".join(body)))
        i += 1
    return found


ALL = [b for path in doc_files() for b in blocks(path)]
PYTHON = [b for b in ALL if b.lang == "python" and b.mark != "gpu"]
SHELL = [b for b in ALL if b.lang in SHELLS]


def test_every_marker_is_known_and_every_shell_block_is_marked():
    unknown = [f"{b.where}: docs-test: {b.mark}" for b in ALL if b.mark is not None and b.mark not in MARKS]
    unmarked = [b.where for b in SHELL if b.mark not in {"smoke", "ci", "gpu", "long"}]
    assert not unknown, "unknown docs-test marks: " + ", ".join(unknown)
    assert not unmarked, ("shell blocks without a <!-- docs-test: smoke|ci|gpu|long --> line before them: "
                          + ", ".join(unmarked))


def _commands(text: str) -> list[str]:
    """The simple commands of shell lines (comments dropped, split at &&)."""
    out = []
    for line in text.split("\n"):
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def test_ci_blocks_are_what_ci_runs():
    """Every command of a ``ci`` block is one .ci/run runs: the same, or with arguments appended
    (CI shortens the main job with --quick)."""
    ci = _commands((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    missing = []
    for block in (b for b in SHELL if b.mark == "ci"):
        for command in _commands(block.code):
            if not any(c == command or c.startswith(command + " ") for c in ci):
                missing.append(f"{block.where}: {command}")
    assert not missing, "commands the docs say CI runs, missing from .ci/run: " + "; ".join(missing)


def _python_source(block: Block) -> str:
    """The block, after the earlier python blocks of its page it continues."""
    page = [b for b in PYTHON if b.path == block.path]
    chain = [block]
    index = page.index(block)
    while chain[0].mark == "continue" and index > 0:
        index -= 1
        chain.insert(0, page[index])
    return "\n\n".join(b.code for b in chain)


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "examples"))
    env.pop("TRITON_INTERPRET", None)  # a user's session: the reference path on the CPU
    return env


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_block_runs(block, tmp_path):
    result = subprocess.run([sys.executable, "-c", _python_source(block)], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{block.where}: the python block raised\n{result.stderr[-3000:]}"


SMOKE = [b for b in SHELL if b.mark == "smoke"]


@pytest.mark.slow
@pytest.mark.parametrize("block", SMOKE, ids=[b.where for b in SMOKE])
def test_smoke_block_runs(block):
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{block.where}: the smoke commands failed\n{result.stderr[-3000:]}"
