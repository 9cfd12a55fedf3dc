"""BERT configuration in the Google/DLE JSON format (also readable from HF config.json)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tempo.utils import atomic_write_text

# The configs ship inside the package (the repository's configs/ links here), so an installed
# wheel finds them too.
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


def shipped_config_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("bert_*.json"))


class ConfigError(ValueError):
    """A BERT config file or dict is missing a field or has an invalid value."""


# Round the vocabulary up so the embedding / decoder GEMMs hit tensor-core friendly shapes (as DLE).
VOCAB_PAD_MULTIPLE = 8

_SUPPORTED_ACTIVATIONS = ("gelu",)


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        self.validate()

    @property
    def padded_vocab_size(self) -> int:
        m = VOCAB_PAD_MULTIPLE
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    # ---- validation -------------------------------------------------------------------
    def validate(self, source: str = "<dict>") -> None:
        """Raise ConfigError naming `source` and the offending field if anything is invalid."""

        def fail(field: str, why: str) -> None:
            raise ConfigError(f"{source}: field '{field}' {why}")

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = _FIELD_KINDS[f.name]
            # bool is a subclass of int in Python; a JSON true/false is never a valid size.
            if isinstance(value, bool):
                fail(f.name, f"must be {kind.__name__}, got bool {value!r}")
            if kind is int and not isinstance(value, int):
                fail(f.name, f"must be an int, got {type(value).__name__} {value!r}")
            if kind is float and not isinstance(value, (int, float)):
                fail(f.name, f"must be a number, got {type(value).__name__} {value!r}")
            if kind is str and not isinstance(value, str):
                fail(f.name, f"must be a string, got {type(value).__name__} {value!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            if getattr(self, name) <= 0:
                fail(name, f"must be positive, got {getattr(self, name)}")
        for name in ("initializer_range", "layer_norm_eps"):
            if not getattr(self, name) > 0:
                fail(name, f"must be positive, got {getattr(self, name)}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                fail(name, f"must be in [0, 1), got {p}")
        if self.hidden_size % self.num_attention_heads != 0:
            fail("hidden_size", f"({self.hidden_size}) must be divisible by "
                 f"num_attention_heads ({self.num_attention_heads})")
        if self.hidden_act not in _SUPPORTED_ACTIVATIONS:
            fail("hidden_act", f"must be one of {_SUPPORTED_ACTIVATIONS}, got {self.hidden_act!r}")

    # ---- (de)serialization --------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> "BertConfig":
        """Build from a dict; unknown keys (HF configs carry many) are ignored."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        for name, f in known.items():
            if name not in kwargs and f.default is dataclasses.MISSING:
                raise ConfigError(f"{source}: required field '{name}' is missing")
        # Bypass __post_init__ so the error message can name the source.
        obj = cls.__new__(cls)
        for name, f in known.items():
            setattr(obj, name, kwargs.get(name, f.default))
        obj.validate(source)
        return obj

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "BertConfig":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config file ({e})") from e
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON ({e})") from e
        return cls.from_dict(d, source=str(path))

    @classmethod
    def from_name(cls, name: str | os.PathLike) -> "BertConfig":
        """A config JSON path, or the name of one shipped with the package (``bert_large``)."""
        path = Path(name)
        if path.exists():
            return cls.from_json_file(path)
        shipped = CONFIGS_DIR / (path.name if path.suffix == ".json" else f"{name}.json")
        if path.suffix and path.parent != Path("."):  # a path the user gave that is not there
            return cls.from_json_file(path)
        if not shipped.is_file():
            raise ConfigError(f"{name!r}: no such config file; shipped configs: {', '.join(shipped_config_names())}")
        return cls.from_json_file(shipped)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.to_json_string())


_FIELD_KINDS = {
    "vocab_size": int,
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "intermediate_size": int,
    "hidden_act": str,
    "hidden_dropout_prob": float,
    "attention_probs_dropout_prob": float,
    "max_position_embeddings": int,
    "type_vocab_size": int,
    "initializer_range": float,
    "layer_norm_eps": float,
}
