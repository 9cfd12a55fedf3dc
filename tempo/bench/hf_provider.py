"""HF transformers' BERT as a provider for the benchmarks: what most users train today.

``--model hf:bert-large`` (also hf:bert-base, hf:bert-mini, hf:bert-tiny) builds an HF
``BertConfig`` with the sizes of our ``configs/bert_*.json``; ``--model hf:<local dir>`` reads the
config.json in that folder (never downloads). Weights are random: throughput and memory do not
depend on them. ``--hf-head pretraining`` (default) is ``BertForPreTraining`` (MLM + NSP),
``mlm`` is ``BertForMaskedLM``; both run the MLM decoder on every position (what HF does), which
the FLOP count follows. Attention: "eager" or "sdpa" (HF's attn_implementation).

transformers is optional; without it these entry points raise ProviderError with a clear line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

HF_PREFIX = "hf:"
HF_ATTENTION = ("eager", "sdpa")
HF_HEADS = ("pretraining", "mlm")


class ProviderError(Exception):
    """Bad model spec or missing optional dependency."""


def is_hf_model(spec: str) -> bool:
    return spec.startswith(HF_PREFIX)


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise ProviderError("--model hf:...: HF transformers is not installed "
                            "(pip install 'tempo[hf]' or pip install transformers)") from None
    return transformers


def hf_config(spec: str, attention: str = "eager") -> Any:
    """HF BertConfig for ``hf:<size name>`` or ``hf:<local dir>``."""
    transformers = _require_transformers()
    if attention not in HF_ATTENTION:
        raise ProviderError(f"HF models support attention {HF_ATTENTION}, not {attention!r}")
    name = spec[len(HF_PREFIX):]
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ProviderError(f"--model {spec}: no config.json in {path}")
        config = transformers.BertConfig.from_pretrained(str(path), local_files_only=True)
        config._attn_implementation = attention
        return config
    from tempo.bench.common import resolve_our_config
    from tempo.presets import hf_bert_config

    return hf_bert_config(resolve_our_config(name.replace("-", "_")), attention=attention)


def build_hf_model(spec: str, attention: str = "eager", head: str = "pretraining",
                   grad_ckpt: bool = False) -> tuple[nn.Module, Any]:
    transformers = _require_transformers()
    if head not in HF_HEADS:
        raise ProviderError(f"--hf-head must be one of {HF_HEADS}, got {head!r}")
    config = hf_config(spec, attention)
    cls = transformers.BertForPreTraining if head == "pretraining" else transformers.BertForMaskedLM
    model = cls(config)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, config


def hf_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, L] MLM labels, -100 everywhere but the masked positions (HF's convention)."""
    ids = batch["input_ids"]
    labels = torch.full_like(ids, -100)
    positions = batch["masked_lm_positions"].long()
    targets = batch["masked_lm_labels"].long()
    targets = torch.where(targets < 0, torch.full_like(targets, -100), targets)
    labels.scatter_(1, positions, targets)
    return labels


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor], head: str) -> torch.Tensor:
    kwargs = dict(input_ids=batch["input_ids"], token_type_ids=batch["segment_ids"],
                  attention_mask=batch["input_mask"], labels=batch["hf_labels"])
    if head == "pretraining":
        kwargs["next_sentence_label"] = batch["next_sentence_labels"]
    return model(**kwargs).loss
