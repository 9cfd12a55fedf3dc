"""``tempo-convert SRC DST``: BERT weights between NVIDIA DLE .pt files, Hugging Face folders and
Tempo training checkpoints.

    tempo-convert ckpt_8601.pt bert_hf/ --config bert_config.json --gelu_approximate tanh   # DLE -> HF
    tempo-convert bert_hf/ bert_dle.pt                                                      # HF -> DLE
    tempo-convert results/phase1 bert_hf/        # a run_pretraining.py output_dir (its newest checkpoint) -> HF

Sources: a DLE/torch file (.pt/.pth/.bin: ``{"model": state_dict, ...}`` or a bare state dict,
``module.``/``_orig_mod.`` prefixes, ``dense_act`` names, LayerNorm gamma/beta), an HF folder or
.safetensors file, or a Tempo training checkpoint (``ckpt_N`` folder, or the output_dir holding
``checkpoints/``). Destinations: ``--to hf`` (a folder: model.safetensors + a config.json that
transformers' ``BertForPreTraining.from_pretrained`` loads) or ``--to dle`` (``{"model":
state_dict}`` named exactly as DLE's modeling.py, vocabulary padded to a multiple of 8, loadable by
DLE's BertForPreTraining with strict=True); by default the DST suffix decides (.pt/.pth: dle).

The config comes from ``--config FILE`` (DLE or HF JSON), else the source's own (HF config.json,
the checkpoint's meta.json/training state); a DLE file has none, so it needs ``--config``. Its
hidden_act decides the GELU form written to config.json, ``--gelu_approximate`` overrides it (DLE
configs say "gelu" for both forms: see tempo.bert.config.GELU_APPROXIMATE_HELP).

Tensors are copied as they are (dtype and values): DLE -> HF -> DLE gives the same tensors, byte for
byte. HF folders hold ``vocab_size`` vocabulary rows, as transformers expects; DLE's padded rows
are dropped unless ``--keep_padded_vocab`` (config.json then says the padded vocab_size), and
written back as zeros. Torch files are read with ``weights_only=True``; one that pickles other
objects needs ``--allow-pickle``, only for files you trust. Every write is atomic; an existing DST
is refused unless ``--overwrite``. Errors are one line naming the file, field or flag, exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from tempo.bert.config import BertConfig, ConfigError, add_gelu_approximate_flag
from tempo.bert.hf_interop import (CONFIG_NAME, SAFETENSORS_NAME, CheckpointError,
                                   _normalize_key, _read_hf_weights, dle_gelu_note, read_torch_state_dict,
                                   write_hf_files)
from tempo.utils import atomic_path

PROG = "tempo-convert"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
FORMATS = ("dle", "hf")

_WORD_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"
_MLM_BIAS = "cls.predictions.bias"
_DECODER = "cls.predictions.decoder.weight"
_DECODER_BIAS = "cls.predictions.decoder.bias"
_VOCAB_KEYS = (_WORD_EMBEDDINGS, _MLM_BIAS)
_BACKBONE = re.compile(r"^bert\.(embeddings|encoder)\.")
# DLE's modeling.py fuses these Linear layers with their activation (LinearActivation, `dense_act`).
_DLE_FUSED = re.compile(r"^(bert\.encoder\.layer\.\d+\.intermediate|bert\.pooler|cls\.predictions\.transform)"
                        r"\.dense\.")


@dataclass
class Weights:
    """A BERT checkpoint in canonical form: HF/Tempo names with the ``bert.`` prefix, the tied
    decoder folded into the word embedding, vocabulary rows as the file had them."""

    tensors: dict[str, Tensor]
    config: BertConfig
    config_source: str
    source: Path
    format: str  # "dle", "torch", "hf" or "tempo"

    @property
    def has_mlm_head(self) -> bool:
        return any(k.startswith("cls.") for k in self.tensors)

    @property
    def has_qa_head(self) -> bool:
        return any(k.startswith("qa_outputs.") for k in self.tensors)

    @property
    def architecture(self) -> str:
        if self.has_mlm_head:
            return "BertForPreTraining"
        return "BertForQuestionAnswering" if self.has_qa_head else "BertModel"

    @property
    def vocab_rows(self) -> int:
        return self.tensors[_WORD_EMBEDDINGS].shape[0]


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def _tempo_checkpoint_dir(path: Path) -> Optional[Path]:
    """The ckpt_N folder `path` names (itself, or the newest under path/checkpoints), else None."""
    from tempo.train.checkpointing import META_FILE, MODEL_FILE, latest_checkpoint

    if (path / META_FILE).is_file() and (path / MODEL_FILE).is_file():
        return path
    if (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{path}: no complete checkpoint under {path / 'checkpoints'}")
        return latest
    return None


def _tempo_config(ckpt: Path) -> Optional[dict]:
    """The config a run_pretraining.py/run_squad checkpoint recorded: meta.json, else its training state."""
    from tempo.train.checkpointing import META_FILE, STATE_FILE

    try:
        meta = json.loads((ckpt / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt / META_FILE}: unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{ckpt / META_FILE}: not a JSON object")
    expected = (meta.get("file_sizes") or {}).get(SAFETENSORS_NAME)
    actual = (ckpt / SAFETENSORS_NAME).stat().st_size
    if expected is not None and expected != actual:
        raise CheckpointError(f"{ckpt / SAFETENSORS_NAME}: {actual} bytes, but {expected} were written; "
                              "the file is truncated or corrupt")
    if isinstance(meta.get("config"), dict):
        return meta["config"]
    if (ckpt / STATE_FILE).is_file():
        from tempo.bert.hf_interop import _torch_load

        state = _torch_load(ckpt / STATE_FILE)
        extra = state.get("extra") if isinstance(state, dict) else None
        if isinstance(extra, dict) and isinstance(extra.get("config"), dict):
            return extra["config"]
    return None


def _raw_source(path: Path, allow_pickle: bool) -> tuple[dict[str, Tensor], str, Path, Optional[BertConfig], str]:
    """(tensors, format, file read, the source's own config or None, where that config came from)."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix.lower() in TORCH_SUFFIXES:
        state = read_torch_state_dict(path, allow_pickle=allow_pickle)
        beside = path.parent / CONFIG_NAME
        fmt = "torch" if path.suffix.lower() == ".bin" else "dle"
        if fmt == "torch" and beside.is_file():  # HF's legacy pytorch_model.bin in its folder
            return state, fmt, path, BertConfig.from_json_file(beside), str(beside)
        return state, fmt, path, None, ""
    if path.is_dir():
        ckpt = _tempo_checkpoint_dir(path)
        if ckpt is not None:
            state, file = _read_hf_weights(ckpt / SAFETENSORS_NAME)
            recorded = _tempo_config(ckpt)
            where = str(ckpt)
            config = BertConfig.from_dict(recorded, source=f"{where} (recorded config)") if recorded else None
            return state, "tempo", file, config, where
    if path.is_dir() or path.suffix.lower() == ".safetensors" or path.name == CONFIG_NAME:
        state, file = _read_hf_weights(path)
        folder = path if path.is_dir() else path.parent
        config_file = folder / CONFIG_NAME
        config = BertConfig.from_json_file(config_file) if config_file.is_file() else None
        return state, "hf", file, config, str(config_file) if config is not None else ""
    raise CheckpointError(f"{path}: unknown checkpoint type; expected a .pt/.pth/.bin file, a .safetensors "
                          "file, an HF folder or a Tempo checkpoint folder")


def canonical_tensors(state: dict[str, Tensor], source: Path) -> dict[str, Tensor]:
    """HF/Tempo names with the ``bert.`` prefix; the tied decoder weight folded into the word
    embedding (an untied one is refused); HF's decoder bias is the MLM bias."""
    out: dict[str, Tensor] = {}
    for raw, tensor in state.items():
        if raw.endswith("position_ids"):  # an HF buffer, not a weight
            continue
        key = _normalize_key(raw, model_has_bert_prefix=True)
        if key in out:
            raise CheckpointError(f"{source}: tensor '{key}' appears twice (as '{raw}' too)")
        out[key] = tensor
    decoder = out.pop(_DECODER, None)
    if decoder is not None:
        embedding = out.setdefault(_WORD_EMBEDDINGS, decoder)
        same = decoder is embedding or (decoder.shape == embedding.shape and torch.equal(decoder, embedding))
        if not same:
            raise CheckpointError(f"{source}: '{_DECODER}' differs from '{_WORD_EMBEDDINGS}'; BERT ties them, "
                                  "and an untied MLM decoder cannot be written in either format")
    decoder_bias = out.pop(_DECODER_BIAS, None)
    if decoder_bias is not None:
        out.setdefault(_MLM_BIAS, decoder_bias)
    return out


def expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a BERT with heads may hold (canonical names) and its shape, in module order:
    BertForPreTraining's (backbone, pooler, MLM and NSP heads), then the SQuAD head."""
    from tempo.bert.model import BertForPreTraining
    from tempo.choices import TempoChoice

    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        reference = BertForPreTraining(config, TempoChoice.original())
    shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    shapes["qa_outputs.weight"] = (2, config.hidden_size)
    shapes["qa_outputs.bias"] = (2,)
    return shapes


def check_fits(tensors: dict[str, Tensor], config: BertConfig, source: Path, config_source: str) -> None:
    """Raise CheckpointError (one line, naming the file) unless the tensors are a BERT of this config."""
    shapes = expected_shapes(config)
    where = f"the config ({config_source})" if config_source else "the config"

    def listed(keys: list[str]) -> str:
        return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

    unknown = [k for k in tensors if k not in shapes]
    if unknown:
        raise CheckpointError(f"{source}: {len(unknown)} tensor(s) have no place in a BERT: {listed(unknown)}")
    groups = {
        "embedding/encoder": [k for k in shapes if _BACKBONE.match(k)],
        "pooler": [k for k in shapes if k.startswith("bert.pooler.")],
        "MLM/NSP head": [k for k in shapes if k.startswith("cls.") and k != _DECODER],
        "SQuAD head": [k for k in shapes if k.startswith("qa_outputs.")],
    }
    for name, keys in groups.items():
        missing = [k for k in keys if k not in tensors]
        if missing and (name == "embedding/encoder" or len(missing) < len(keys)):
            raise CheckpointError(f"{source}: lacks {len(missing)} {name} tensor(s) {where} needs: {listed(missing)}")
    for key, tensor in tensors.items():
        want = shapes[key]
        if key in _VOCAB_KEYS:
            rows_ok = tensor.shape[0] in (config.vocab_size, config.padded_vocab_size)
            if tensor.dim() == len(want) and tuple(tensor.shape[1:]) == want[1:] and rows_ok:
                continue
            raise CheckpointError(
                f"{source}: tensor '{key}' has shape {tuple(tensor.shape)}, which does not fit {where}: "
                f"expected {(config.vocab_size,) + want[1:]} (vocab_size) or {want} (padded to a multiple of 8)")
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{source}: tensor '{key}' has shape {tuple(tensor.shape)}, "
                                  f"{where} needs {want}")
    rows = {tensors[k].shape[0] for k in _VOCAB_KEYS if k in tensors}
    if len(rows) > 1:
        raise CheckpointError(f"{source}: '{_WORD_EMBEDDINGS}' and '{_MLM_BIAS}' have different vocabulary sizes "
                              f"({sorted(rows)})")


def read_weights(path: str | os.PathLike, config: Optional[BertConfig] = None, config_source: str = "",
                 gelu_approximate: Optional[str] = None, allow_pickle: bool = False) -> Weights:
    """Read any supported source into canonical Weights, checked against its config."""
    path = Path(path)
    state, fmt, file, own_config, own_source = _raw_source(path, allow_pickle)
    if config is None:
        config, config_source = own_config, own_source
    if config is None:
        raise CheckpointError(f"{path}: a {'DLE' if fmt == 'dle' else fmt} checkpoint carries no config; pass "
                              "--config FILE (the BERT config JSON it was trained with)")
    config = config.with_gelu(gelu_approximate)
    tensors = canonical_tensors(state, file)
    check_fits(tensors, config, file, config_source)
    return Weights(tensors, config, config_source, file, fmt)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def _fit_rows(tensor: Tensor, rows: int) -> Tensor:
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows]
    padded = torch.zeros((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    return padded


def hf_tensors(weights: Weights, keep_padded_vocab: bool = False) -> tuple[dict[str, Tensor], BertConfig, list[str]]:
    """(tensors, config, notes) of the HF folder: HF names, `vocab_size` vocabulary rows (all of
    them with keep_padded_vocab, the config then saying so), no tied decoder."""
    import dataclasses

    config, notes = weights.config, []
    rows = weights.vocab_rows
    if keep_padded_vocab and rows != config.vocab_size:
        config = dataclasses.replace(config, vocab_size=rows)
    out = {}
    for key, tensor in weights.tensors.items():
        if key in _VOCAB_KEYS and tensor.shape[0] != config.vocab_size:
            extra = tensor[config.vocab_size:]
            if extra.numel() and bool(extra.ne(0).any()):
                notes.append(f"note: dropped {tensor.shape[0] - config.vocab_size} padded vocabulary rows of '{key}' "
                             "that are not zero (token ids no vocab.txt has, but they enter the MLM softmax); "
                             "--keep_padded_vocab keeps them")
            tensor = _fit_rows(tensor, config.vocab_size)
        out[key if weights.has_mlm_head or weights.has_qa_head else key.removeprefix("bert.")] = tensor
    return out, config, notes


def dle_key(key: str) -> str:
    """Canonical name -> DLE modeling.py's (LinearActivation layers are `dense_act`)."""
    return _DLE_FUSED.sub(lambda m: m.group(1) + ".dense_act.", key)


def dle_tensors(weights: Weights) -> tuple[dict[str, Tensor], list[str]]:
    """(state dict, notes) as DLE's modeling.py names it, in its module order: vocabulary rows padded
    to a multiple of 8 (zeros), the MLM decoder weight sharing the word embedding's storage."""
    config, notes = weights.config, []
    order = list(expected_shapes(config))
    padded = {k: _fit_rows(t, config.padded_vocab_size) if k in _VOCAB_KEYS else t
              for k, t in weights.tensors.items()}
    if weights.has_mlm_head:
        padded[_DECODER] = padded[_WORD_EMBEDDINGS]  # tied, as DLE's state_dict() has it
    state = {dle_key(k): padded[k] for k in order if k in padded}
    if not any(k.startswith("bert.pooler.") for k in weights.tensors):
        notes.append("note: DLE's BertModel always has a pooler, which this checkpoint lacks (HF and Tempo SQuAD "
                     "models have none): DLE's run_squad.py (strict=False) leaves it unused, a strict load misses it")
    if config.gelu_approximate == "none":
        notes.append("note: DLE's modeling.py computes 'gelu' in the tanh form since 2022-03; this checkpoint's "
                     f"config ({config.hidden_act!r}) is the exact erf form, which DLE's code before then computed")
    return state, notes


def _refuse_existing(dst: Path, overwrite: bool) -> None:
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise CheckpointError(f"{dst}: already exists; pass --overwrite to replace it")


def _write_folder_atomically(dst: Path, fill: Callable[[Path], None]) -> None:
    """Build the folder beside dst, then rename it into place (an old dst is moved aside first and
    deleted only once the new one is there)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    aside = None
    try:
        tmp.mkdir()
        fill(tmp)
        if dst.exists() or dst.is_symlink():
            aside = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(dst, aside)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not dst.exists():
            os.replace(aside, dst)
        raise
    if aside is not None:
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink(missing_ok=True)


def write_hf(weights: Weights, dst: Path, keep_padded_vocab: bool = False) -> list[str]:
    tensors, config, notes = hf_tensors(weights, keep_padded_vocab)
    _write_folder_atomically(dst, lambda folder: write_hf_files(tensors, config, weights.architecture, folder))
    return notes


def write_dle(weights: Weights, dst: Path) -> list[str]:
    if dst.is_dir():
        raise CheckpointError(f"{dst}: is a folder; a DLE checkpoint is one file (e.g. {dst / 'ckpt.pt'})")
    state, notes = dle_tensors(weights)
    with atomic_path(dst) as tmp:
        with open(tmp, "wb") as fh:
            torch.save({"model": state}, fh)
            fh.flush()
            os.fsync(fh.fileno())
    return notes


def destination_format(dst: Path, to: Optional[str]) -> str:
    by_suffix = "dle" if dst.suffix.lower() in (".pt", ".pth") else None
    if to is None:
        return by_suffix or "hf"
    if to == "hf" and by_suffix:
        raise CheckpointError(f"{dst}: --to hf writes a folder, but the name ends in {dst.suffix}; pick a folder name")
    return to


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: Optional[str] = None,
            config: Optional[str | os.PathLike] = None, gelu_approximate: Optional[str] = None,
            allow_pickle: bool = False, overwrite: bool = False, keep_padded_vocab: bool = False,
            log: Callable[[str], None] = print) -> Path:
    """The Python face of ``tempo-convert`` (see the module docstring). Returns dst."""
    src, dst = Path(src), Path(dst)
    fmt = destination_format(dst, to)
    _refuse_existing(dst, overwrite)
    cfg = BertConfig.from_json_file(config) if config is not None else None
    weights = read_weights(src, cfg, str(config) if config is not None else "", gelu_approximate, allow_pickle)
    c = weights.config
    log(f"read {len(weights.tensors)} tensors from {weights.source} ({weights.format}, {weights.architecture}; "
        f"config {weights.config_source}: {c.num_hidden_layers} layers, h={c.hidden_size}, vocab {c.vocab_size}, "
        f"hidden_act {c.hidden_act!r} = {'exact erf' if c.gelu_approximate == 'none' else 'tanh'} GELU)")
    if weights.format == "dle" and gelu_approximate is None:
        log(dle_gelu_note(c))
    notes = write_dle(weights, dst) if fmt == "dle" else write_hf(weights, dst, keep_padded_vocab)
    for note in notes:
        log(note)
    what = "DLE checkpoint {'model': state_dict}" if fmt == "dle" else f"HF folder ({SAFETENSORS_NAME}, {CONFIG_NAME})"
    log(f"wrote {dst}: {what}")
    return dst


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Convert BERT weights between NVIDIA DLE .pt, Hugging Face folders and Tempo "
                               "training checkpoints.")
    p.add_argument("src", help="DLE/torch file (.pt/.pth/.bin), HF folder or .safetensors file, or a Tempo "
                               "checkpoint (ckpt_N folder, or a run's output_dir: its newest checkpoint)")
    p.add_argument("dst", help="destination: a .pt/.pth file (DLE) or a folder (HF)")
    p.add_argument("--to", choices=FORMATS, default=None, help="destination format (default: from DST's suffix)")
    p.add_argument("--config", default=None,
                   help="BERT config JSON (DLE or HF); required for DLE files, which carry none; its hidden_act "
                        "decides the GELU form")
    add_gelu_approximate_flag(p)
    p.add_argument("--allow-pickle", "--allow_pickle", dest="allow_pickle", action="store_true",
                   help="read torch files with unrestricted unpickling, which can run code: only for files you "
                        "trust (without it they are read with weights_only=True)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--keep_padded_vocab", "--keep-padded-vocab", dest="keep_padded_vocab", action="store_true",
                   help="HF output: keep DLE's padded vocabulary rows (config.json's vocab_size becomes the padded "
                        "size) instead of dropping them")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def log(line: str) -> None:
        print(f"{PROG}: {line}", flush=True)

    try:
        if args.allow_pickle:
            print(f"{PROG}: warning: --allow-pickle: torch files are unpickled without restriction (only for files "
                  "you trust); only their tensors are kept", file=sys.stderr)
        convert(args.src, args.dst, to=args.to, config=args.config, gelu_approximate=args.gelu_approximate,
                allow_pickle=args.allow_pickle, overwrite=args.overwrite, keep_padded_vocab=args.keep_padded_vocab,
                log=log)
    except (CheckpointError, ConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"{PROG}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
