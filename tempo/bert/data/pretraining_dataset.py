"""DLE HDF5 shards -> batches of tensors, resumable and DDP-aware.

A shard holds ``input_ids``, ``input_mask``, ``segment_ids`` [N, L], ``masked_lm_positions``,
``masked_lm_ids`` [N, P] (zero padded) and ``next_sentence_labels`` [N], any integer dtype
(existing DLE shards load unchanged). Each sample becomes:

    input_ids, segment_ids, input_mask   [L] int64
    masked_lm_positions                  [P] int64 (0 in padded slots)
    masked_lm_labels                     [P] int64, -1 = no prediction in this slot
    next_sentence_labels                 []  int64 (1 = B is a random segment)

Position 0 is [CLS] and never masked, so the first 0 position ends the real predictions.
Arrays stay in the shard's dtype in memory (int16 shards take a quarter of the int64 size)
and are widened per sample.

Every shard is checked when it is opened: its header (datasets, integer dtypes, shapes) and,
once it is in memory, its values (``check_shard_values``: token and segment ids inside the model
config's vocab_size / type_vocab_size, input_mask 0/1 with a real token in every row, prediction
positions on real tokens, labels inside the vocabulary, next_sentence_labels 0 or 1 -- DLE has no
-1 label). A bad value is a ``ShardError`` naming the shard, the dataset, the row and the value;
so is damage h5py reports (OSError, KeyError, RuntimeError, ValueError). The value checks are
vectorised reductions, once per shard: 23 ms for 100,000 rows of length 128 (0.23 us a row;
0.8 us at length 512) on a 2-core CPU, against the seconds a shard's batches take to train.

``PretrainingBatches(input_dir, batch_size, seed, rank, world_size, num_workers)`` walks the
shards in an order shuffled per epoch, each shard's samples in an order shuffled per (epoch,
shard), and gives rank r the samples r, r + world_size, ... of that order. With that striding,
the union of the ranks' k-th batches is exactly the k-th batch of one process with
world_size × batch_size, so DDP and a single process see the same data. It is infinite
(epoch after epoch); ``state_dict()`` -> ``{"epoch", "shard_index", "sample_offset"}`` names
the next batch (``shard_index``: position in that epoch's shard order; ``sample_offset``: batches
of this rank already taken from that shard), so a resumed run continues with exactly the batches
the uninterrupted run would have seen::

    batches = PretrainingBatches("shards/", batch_size=32, seed=1, rank=0, world_size=1)
    for step, batch in zip(range(1000), batches):
        ...
    state = batches.state_dict()          # store it in the checkpoint
    resumed = PretrainingBatches("shards/", batch_size=32, seed=1)
    resumed.load_state_dict(state)        # yields batch 1000, 1001, ... of the first run

Every rank must use the same ``seed`` and ``batch_size``; each gets ``len(shard) // world_size``
samples per shard, so the ranks stay in step (at most ``world_size - 1`` samples per shard and
the incomplete last batch are left out of an epoch; different ones every epoch).

``token_budget`` (a ``token_budget.TokenBudget``, with ``batch_size=None``) fills each batch with
whole sequences up to its tokens instead: each shard's batches are planned from its lengths per
(seed, shard, epoch) and dealt to the ranks with the same number of batches each, every sample of
the shard exactly once per epoch (``token_budget.plan_steps``); a batch is cut to its longest
sequence (``token_budget.TrimPadding``). The resume state means the same.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .create_pretraining_data import SHARD_KEYS
from .token_budget import TokenBudget, TokenBudgetError, TrimPadding, mask_lengths, plan_steps
from .tokenization import DataError


class ShardError(DataError):
    """A shard is missing, unreadable, truncated, or not in the DLE layout."""


def list_shards(input_dir: str | os.PathLike) -> list[Path]:
    """The .hdf5/.h5 files of ``input_dir``, sorted; an error naming the directory if none."""
    directory = Path(input_dir)
    if not directory.is_dir():
        raise ShardError(f"input directory {directory} does not exist or is not a directory")
    shards = sorted(p for p in directory.iterdir() if p.suffix in (".hdf5", ".h5") and p.is_file()
                    and not p.name.startswith("."))  # dot files are unfinished writes
    if not shards:
        raise ShardError(f"no .hdf5/.h5 shards in {directory}")
    return shards


# What h5py raises on a damaged file: OSError (truncated, bad superblock, failed filter),
# KeyError (a corrupt object header or link table), RuntimeError (B-tree / heap errors),
# ValueError (bad dataspace or dtype metadata).
H5_ERRORS = (OSError, KeyError, RuntimeError, ValueError)


def _open(path: Path):
    import h5py

    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ShardError(f"cannot read shard {path}: it is truncated or not an HDF5 file ({exc})") from None


def shard_shapes(path: Path) -> tuple[int, int, int]:
    """(samples N, sequence length L, predictions P) from a shard's header, checked."""
    try:
        return _shard_shapes(path)
    except ShardError:
        raise
    except H5_ERRORS as exc:
        raise ShardError(f"cannot read shard {path}: its HDF5 structure is damaged "
                         f"({type(exc).__name__}: {exc})") from None


def shard_lengths(path: str | os.PathLike, rows_per_read: int = 65536) -> np.ndarray:
    """Real tokens of every sample of a DLE HDF5 shard: its ``input_mask`` read in slices of rows,
    nothing else (a shard of 100,000 rows at s = 512 reads 51 MB of int8 mask)."""
    try:
        with _open(Path(path)) as f:
            if "input_mask" not in f:
                raise ShardError(f"shard {path} has no input_mask dataset: cannot read its lengths")
            mask = f["input_mask"]
            parts = [mask_lengths(mask[i:i + rows_per_read]) for i in range(0, mask.shape[0], rows_per_read)]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    except ShardError:
        raise
    except H5_ERRORS as exc:
        raise ShardError(f"cannot read the input_mask of shard {path}: {type(exc).__name__}: {exc}") from None


def _shard_shapes(path: Path) -> tuple[int, int, int]:
    with _open(path) as f:
        missing = [k for k in SHARD_KEYS if k not in f]
        if missing:
            raise ShardError(f"shard {path} lacks dataset(s) {missing}; expected {list(SHARD_KEYS)}")
        for key in SHARD_KEYS:  # all six, input_ids included: a float one would be cast silently
            dtype = getattr(f[key], "dtype", None)  # None: an HDF5 group, not an array
            if dtype is None or dtype.kind not in "iub":
                raise ShardError(f"shard {path}: {key} must hold integers, got {dtype}")
        for key in ("input_ids", "masked_lm_positions"):  # the shapes the others are checked against
            if f[key].ndim != 2:
                raise ShardError(f"shard {path}: {key} must be 2-D [N, L] / [N, P], got shape {f[key].shape}")
        n, length = f["input_ids"].shape
        predictions = f["masked_lm_positions"].shape[-1]
        expected = {"input_mask": (n, length), "segment_ids": (n, length), "masked_lm_positions": (n, predictions),
                    "masked_lm_ids": (n, predictions), "next_sentence_labels": (n,)}
        for key, shape in expected.items():
            if tuple(f[key].shape) != shape:
                raise ShardError(f"shard {path}: {key} has shape {tuple(f[key].shape)}, expected {shape}")
    return n, length, predictions


def _signed(array: np.ndarray) -> np.ndarray:
    """Keep the stored integer width; make unsigned/bool types signed so torch can hold them."""
    if array.dtype == np.bool_ or array.dtype in (np.uint8, np.int8):
        return array.astype(np.int16)  # int16: -1 labels and widening stay simple
    if array.dtype.kind == "u":
        return array.astype(np.int64 if array.dtype.itemsize >= 4 else np.int32)
    return np.ascontiguousarray(array)


def _first(bad: np.ndarray) -> tuple[int, ...]:
    """Index of the first True of a boolean array (only called once a check has failed)."""
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))


def _where(key: str, index: tuple[int, ...]) -> str:
    return f"dataset {key} row {index[0]}" + (f" column {index[1]}" if len(index) > 1 else "")


def check_shard_values(path: str | os.PathLike, arrays: dict[str, np.ndarray], vocab_size: int | None = None,
                       type_vocab_size: int | None = None, real: np.ndarray | None = None) -> None:
    """Raise ShardError naming the shard, the dataset, the row and the value of the first bad entry.

    The rules (DLE's shard format, which create_pretraining_data writes):
      * input_ids in [0, vocab_size); segment_ids in [0, type_vocab_size) (the model config's);
      * input_mask 0 or 1, with at least one 1 per row (a row of padding only has no token to attend to);
      * masked_lm_positions: the predictions come first, then 0s (the first 0 ends them, as DLE's
        loader reads it; slots after it are ignored). A prediction's position lies inside the
        sequence, on a real token: 1 <= position < L (0 is [CLS]) and input_mask[position] == 1;
      * masked_lm_ids in [0, vocab_size) wherever a prediction exists;
      * next_sentence_labels 0 (B follows A) or 1 (B is random). DLE's writer never stores anything
        else; its loss shares ignore_index=-1 with the MLM labels, so a -1 there would silently drop
        the row's NSP loss. Here -1, like any other value, is an error naming the row.

    Vectorised: a min/max reduction per dataset, plus one gather for the positions; the location of
    a failure is searched only once a reduction has found one. ``vocab_size``/``type_vocab_size``
    None skip the upper bounds that need them. ``real``: the [N, P] mask of prediction slots, if
    the caller has it already.
    """

    def fail(key: str, bad: np.ndarray, values: np.ndarray, why: str) -> None:
        index = _first(bad)
        raise ShardError(f"shard {path}: {_where(key, index)} holds {values[index]}; {why}")

    def in_range(key: str, low: int, high: int | None, why: str) -> None:
        a = arrays[key]
        if a.size and (a.min() < low or (high is not None and a.max() >= high)):
            fail(key, (a < low) | (a >= high) if high is not None else a < low, a, why)

    vocab = f"vocab_size={vocab_size}" if vocab_size is not None else "vocab size"
    in_range("input_ids", 0, vocab_size, f"token ids must lie in [0, {vocab}) of the model config")
    in_range("segment_ids", 0, type_vocab_size,
             f"segment ids must lie in [0, type_vocab_size={type_vocab_size}) of the model config"
             if type_vocab_size is not None else "segment ids cannot be negative")
    in_range("input_mask", 0, 2, "input_mask holds 0 (padding) or 1 (a real token)")
    mask = arrays["input_mask"]
    if mask.size:
        has_token = mask.max(axis=1) > 0
        if not has_token.all():
            row = int(np.argmin(has_token))
            raise ShardError(f"shard {path}: dataset input_mask row {row} has no real token (all 0): "
                             "every row needs at least [CLS]")
    in_range("next_sentence_labels", 0, 2,
             "next_sentence_labels holds 0 (B follows A) or 1 (B is random); DLE's format has no "
             "other label (-1 would silently drop the row's NSP loss)")

    positions, ids = arrays["masked_lm_positions"], arrays["masked_lm_ids"]
    if positions.size:
        if real is None:
            real = np.cumprod(positions != 0, axis=1).astype(bool)
        length = mask.shape[1]
        outside = real & ((positions < 1) | (positions >= length))
        if outside.any():
            fail("masked_lm_positions", outside, positions,
                 f"a prediction's position must lie in [1, {length}) (0 is [CLS] and ends the predictions)")
        on_padding = real & (np.take_along_axis(mask, np.where(real, positions, 0).astype(np.intp), axis=1) == 0)
        if on_padding.any():
            fail("masked_lm_positions", on_padding, positions,
                 "it points at padding (input_mask 0) instead of a real token")
        label_bad = real & ((ids < 0) | (ids >= vocab_size if vocab_size is not None else False))
        if label_bad.any():
            fail("masked_lm_ids", label_bad, ids,
                 f"a prediction's label must be a token id in [0, {vocab}) of the model config")


class PretrainingShardDataset(Dataset):
    """One shard, read into memory at construction (then the file is closed), its values checked.

    ``vocab_size``/``type_vocab_size``: the model config's, for the value checks (see
    ``check_shard_values``); None skips the bounds that need them.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int | None = None, type_vocab_size: int | None = None):
        self.path = Path(path)
        shard_shapes(self.path)
        try:
            with _open(self.path) as f:
                arrays = {k: _signed(f[k][...]) for k in SHARD_KEYS}
        except ShardError:
            raise
        except H5_ERRORS as exc:  # h5py raises these on damaged data
            raise ShardError(f"cannot read shard {self.path}: {type(exc).__name__}: {exc}") from None
        positions = arrays["masked_lm_positions"]
        real = np.cumprod(positions != 0, axis=1).astype(bool)
        check_shard_values(self.path, arrays, vocab_size, type_vocab_size, real=real)
        ids = arrays["masked_lm_ids"]
        labels = np.where(real, ids, -1).astype(np.int32 if ids.dtype.itemsize <= 4 else np.int64)
        self.tensors = {
            "input_ids": torch.from_numpy(arrays["input_ids"]),
            "segment_ids": torch.from_numpy(arrays["segment_ids"]),
            "input_mask": torch.from_numpy(arrays["input_mask"]),
            "masked_lm_positions": torch.from_numpy(np.where(real, positions, 0).astype(positions.dtype)),
            "masked_lm_labels": torch.from_numpy(labels),
            "next_sentence_labels": torch.from_numpy(arrays["next_sentence_labels"]),
        }

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[index].long() for k, v in self.tensors.items()}


class PretrainingBatches:
    """Infinite, resumable stream of batches from a directory of shards (see module docstring)."""

    def __init__(self, input_dir: str | os.PathLike, batch_size: int | None, seed: int = 0, rank: int = 0,
                 world_size: int = 1, num_workers: int = 0, max_seq_length: int | None = None,
                 max_predictions_per_seq: int | None = None, pin_memory: bool | None = None,
                 vocab_size: int | None = None, type_vocab_size: int | None = None,
                 token_budget: TokenBudget | None = None):
        if (batch_size is None) == (token_budget is None):
            raise ValueError("pass either batch_size (sequences per batch) or token_budget (tokens per batch)")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.shards = list_shards(input_dir)
        self.batch_size, self.token_budget, self.seed = batch_size, token_budget, seed
        self.vocab_size, self.type_vocab_size = vocab_size, type_vocab_size  # for the shards' value checks
        self.rank, self.world_size = rank, world_size
        # None: pin when CUDA is available, so the trainer's non_blocking host->device copies overlap.
        self.num_workers = num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.sizes = []
        for path in self.shards:  # headers only: cheap, and fails before training starts
            n, length, predictions = shard_shapes(path)
            if max_seq_length is not None and length != max_seq_length:
                raise ShardError(f"shard {path} has sequences of length {length}, but --max_seq_length is "
                                 f"{max_seq_length}")
            if max_predictions_per_seq is not None and predictions != max_predictions_per_seq:
                raise ShardError(f"shard {path} has {predictions} prediction slots, but "
                                 f"--max_predictions_per_seq is {max_predictions_per_seq}")
            self.sizes.append(n)
        if token_budget is None and sum(self._batches_in(n) for n in self.sizes) == 0:
            raise ShardError(f"the shards in {input_dir} hold {sum(self.sizes)} samples: not one batch of "
                             f"{batch_size} per rank for {world_size} rank(s)")
        self.epoch = self.shard_position = self.batch_in_shard = 0
        self._cached: tuple[int, PretrainingShardDataset] | None = None

    def _dataset(self, shard_index: int) -> PretrainingShardDataset:
        # Keep the last shard: with one shard (or a repeat across an epoch boundary) it is reused.
        if self._cached is None or self._cached[0] != shard_index:
            self._cached = None  # free the previous shard before reading the next
            self._cached = (shard_index, PretrainingShardDataset(self.shards[shard_index], self.vocab_size,
                                                                 self.type_vocab_size))
        return self._cached[1]

    def batches_per_epoch(self) -> int:
        """Batches this rank takes from one pass over all shards (with a token budget: in this epoch,
        read from the shards' input masks)."""
        if self.token_budget is not None:
            return sum(len(self._token_budget_steps(i, shard_lengths(path))) for i, path in enumerate(self.shards))
        return sum(self._batches_in(n) for n in self.sizes)

    def _token_budget_steps(self, shard_index: int, lengths: np.ndarray) -> list[list[list[int]]]:
        try:
            return plan_steps(lengths, self.token_budget, seed=(self.seed, shard_index), epoch=self.epoch,
                              num_replicas=self.world_size)
        except TokenBudgetError as exc:
            raise ShardError(f"shard {self.shards[shard_index]}: {exc}") from None

    def _batches_in(self, n: int) -> int:
        return (n // self.world_size) // self.batch_size

    def _shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.shards)))
        random.Random(f"shards:{self.seed}:{epoch}").shuffle(order)
        return order

    def _rank_batches(self, shard_index: int) -> list[list[int]]:
        if self.token_budget is not None:
            lengths = mask_lengths(self._dataset(shard_index).tensors["input_mask"])
            return [step[self.rank] for step in self._token_budget_steps(shard_index, lengths)]
        n = self.sizes[shard_index]
        order = list(range(n))
        random.Random(f"samples:{self.seed}:{self.epoch}:{shard_index}").shuffle(order)
        per_rank = n // self.world_size  # equal counts keep the ranks in step
        mine = order[self.rank::self.world_size][:per_rank]
        count = per_rank // self.batch_size  # drop the incomplete last batch: static shapes
        return [mine[i * self.batch_size:(i + 1) * self.batch_size] for i in range(count)]

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch this stream will yield."""
        return {"epoch": self.epoch, "shard_index": self.shard_position, "sample_offset": self.batch_in_shard}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # shard_position/batch_in_shard: the key names of checkpoints written before 2026-11-22.
        self.epoch = int(state["epoch"])
        self.shard_position = int(state["shard_index"] if "shard_index" in state else state["shard_position"])
        self.batch_in_shard = int(state["sample_offset"] if "sample_offset" in state else state["batch_in_shard"])
        if not 0 <= self.shard_position <= len(self.shards) or self.batch_in_shard < 0 or self.epoch < 0:
            raise ValueError(f"data state {dict(state)} does not fit {len(self.shards)} shard(s)")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            order = self._shard_order(self.epoch)
            while self.shard_position < len(order):
                shard_index = order[self.shard_position]
                batches = self._rank_batches(shard_index)[self.batch_in_shard:]
                if batches:
                    dataset = self._dataset(shard_index)
                    # A private generator: a DataLoader iterator otherwise draws its worker seed from
                    # the global RNG, which would shift the dropout stream of a resumed run.
                    generator = torch.Generator().manual_seed(hash((self.seed, self.epoch, shard_index)) % 2**63)
                    collate = (TrimPadding(("input_ids", "segment_ids", "input_mask"), "input_mask",
                                           self.token_budget.pad_to_multiple_of) if self.token_budget else None)
                    loader = DataLoader(dataset, batch_sampler=batches, num_workers=self.num_workers,
                                        pin_memory=self.pin_memory, generator=generator, collate_fn=collate)
                    for batch in loader:
                        self.batch_in_shard += 1  # counted before yielding: the state names the next batch
                        yield batch
                self.shard_position += 1
                self.batch_in_shard = 0
            self.epoch += 1
            self.shard_position = 0
