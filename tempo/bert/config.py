"""BERT configuration in the Google/DLE JSON format (also readable from HF config.json)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

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

# hidden_act -> the GELU form the model computes ("none": exact erf, "tanh": the tanh approximation),
# under the names Google/DLE and transformers' ACT2FN use. "gelu_fast" is transformers'
# FastGELUActivation: the tanh form written with sqrt(2/pi) rounded to 0.7978845608 (1e-11 apart
# in fp64, below fp32 resolution), so it is the tanh form. quick_gelu (x*sigmoid(1.702x)), the
# clipped gelu_10 and other activations are different functions and are refused.
GELU_FORMS = {
    "gelu": "none",               # Google BERT, HF; DLE's config says "gelu" for both forms (see below)
    "gelu_python": "none",        # transformers' erf GELU written in Python
    "gelu_new": "tanh",           # OpenAI GPT/GPT-2; transformers' NewGELUActivation
    "gelu_pytorch_tanh": "tanh",  # F.gelu(x, approximate="tanh"); transformers' GELUTanh
    "gelu_python_tanh": "tanh",   # the same in Python
    "gelu_fast": "tanh",          # transformers' FastGELUActivation (see above)
}
_SUPPORTED_ACTIVATIONS = tuple(GELU_FORMS)
GELU_APPROXIMATIONS = ("none", "tanh")
# The hidden_act with_gelu() writes for a form when the config names the other one.
_GELU_NAME_FOR = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}

# DLE's config.json says "gelu" whichever form its modeling.py computes: up to commit a9e2c1d5
# (2022-03-02) the exact erf form (the NGC checkpoints of 20.03 were trained so), since then
# F.gelu(x, approximate=True), the tanh form. A DLE file does not record which one it was
# trained with, so the form is an explicit choice (--gelu_approximate, BertConfig.with_gelu).
GELU_APPROXIMATE_HELP = (
    "GELU form, overriding the config's hidden_act: 'none' = exact erf GELU (Google/HF 'gelu', DLE before "
    "2022-03 and its NGC 20.03 checkpoints), 'tanh' = the tanh approximation (HF 'gelu_new'/"
    "'gelu_pytorch_tanh'; DLE's modeling.py since 2022-03, whose config still says 'gelu'). Default: the "
    "config's hidden_act")


def add_gelu_approximate_flag(parser: Any, name: str = "--gelu_approximate") -> None:
    """``--gelu_approximate {none,tanh}`` (default None: the config decides); see BertConfig.with_gelu."""
    parser.add_argument(name, dest="gelu_approximate", choices=GELU_APPROXIMATIONS, default=None,
                        help=GELU_APPROXIMATE_HELP)


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

    @property
    def gelu_approximate(self) -> str:
        """The GELU form hidden_act names: "none" (exact erf) or "tanh"."""
        return GELU_FORMS[self.hidden_act]

    def with_gelu(self, approximate: Optional[str]) -> "BertConfig":
        """A copy computing the given GELU form ("none" or "tanh"); None returns self unchanged.

        hidden_act keeps its name when it already names that form ("gelu_new" stays), otherwise
        it becomes "gelu" (none) or "gelu_pytorch_tanh" (tanh), names transformers reads too.
        """
        if approximate is None:
            return self
        if approximate not in GELU_APPROXIMATIONS:
            raise ConfigError(f"GELU form must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
        if self.gelu_approximate == approximate:
            return self
        return dataclasses.replace(self, hidden_act=_GELU_NAME_FOR[approximate])

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
            fail("hidden_act", f"must be one of {', '.join(map(repr, _SUPPORTED_ACTIVATIONS))} "
                 f"(exact erf GELU: 'gelu', 'gelu_python'; tanh GELU: the others), got {self.hidden_act!r}")

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
