"""What every benchmark command shares: its error types, the OOM exit status and model lookup."""

from __future__ import annotations

OOM_EXIT = 3  # a probe that ran out of memory (real or simulated) exits with this status


class BenchError(Exception):
    """A configuration this machine or checkout cannot run: reported in one line, exit 1."""


class SimulatedOOM(Exception):
    """--memory-budget exceeded (the CPU stand-in for CUDA's OutOfMemoryError)."""


def resolve_our_config(name: str):
    """Our BERT config by shipped name (bert_large) or JSON path, as a BenchError when unknown."""
    from tempo.bert.config import BertConfig, ConfigError

    try:
        return BertConfig.from_name(name)
    except ConfigError as exc:
        raise BenchError(f"--model {exc} (or hf:...)") from None
