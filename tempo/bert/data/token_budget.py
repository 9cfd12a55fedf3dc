"""Token-budget batches: every step filled with whole sequences up to a budget of tokens.

With Tempo's unpadded layers the activation bytes of a step grow with its real tokens, whatever the
lengths, so a memory budget is a token budget. A fixed batch of B sequences padded to S uses B·S
token slots of memory and fills them with real tokens only as far as the lengths allow (SQuAD v1.1
at s = 384: 45 %). ``TokenBudgetBatchSampler`` fills each batch with sequences until ``max_tokens``
real tokens (fairseq's ``--max-tokens``; the classic bucket samplers), so the same memory holds about
twice the sequences, and an epoch takes about half the steps.

Two policies, both deterministic in (``seed``, epoch), both giving every index exactly once per epoch:

* ``"bucket"`` (default): the epoch's indices in a random order, sorted by length (stably: equal
  lengths stay in random order) within chunks of ``sort_chunk`` sequences (None: the whole epoch, as
  fairseq sorts; then the number of batches is the same every epoch), then cut into batches greedily:
  a batch takes the next sequences while they fit. Sequences of a batch have similar lengths, so a
  padded model wastes little padding too.
* ``"pack"``: first-fit decreasing. Sequences longest first; each goes into the first batch that
  still has room for it. Fewer batches, fuller ones, lengths mixed: for unpadded models only (a
  padded model would pad every short sequence to the longest), so it refuses ``count="padded"``.

The batches are then dealt out to the ``num_replicas`` ranks of a DDP run: consecutive batches (of
similar lengths under "bucket") form a step, one batch per rank, and the steps are shuffled. When the
number of batches is not a multiple of ``num_replicas``, the batches holding the most sequences are
split in two until it is, so every rank runs the same number of steps and no sequence is dropped or
repeated. ``max_tokens`` is per rank per batch (it bounds one device's memory); a step of W ranks
holds up to W · max_tokens tokens, times the gradient-accumulation steps per optimizer step.

What a batch costs (``count``): ``"real"`` (default) its real tokens, the sum of its lengths, for
unpadded models; ``"padded"`` the padded tensor a padded model sees, sequences × the longest length
rounded up to ``pad_to_multiple_of``. A single sequence that costs more than ``max_tokens`` is an
error naming its index and length (``TokenBudgetError``), raised when the sampler is made: no
sequence is dropped or cut silently. Truncate or drop such sequences before sampling, or raise the
budget; splitting one is not offered, because it would change the training example (an NSP pair,
a SQuAD window).

``max_sequences`` caps the sequences of a batch (a model or loss may need it: in-batch negatives,
a kernel's batch limit). ``TrimPadding`` collates samples that are stored padded to a fixed length
(the HDF5 shards, SQuAD features) and cuts the columns past the batch's longest sequence, rounded up
to ``pad_to_multiple_of``. Lengths come from ``pretraining_dataset.shard_lengths`` (a DLE HDF5 shard: one pass over its
``input_mask``), ``mask_lengths`` (any [N, L] 0/1 mask, e.g. ``SquadFeatures.input_mask``) or
``token_lengths`` (texts through a tokenizer, for the HF Trainer and sentence-transformers).

``python -m tempo.bert.data.token_budget --report`` prints the padding waste and steps per epoch
of both policies against fixed batches at the same memory, on the project's generated
Wikipedia-like and SQuAD-like data.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler, default_collate

from .tokenization import DataError

POLICIES = ("bucket", "pack")
COUNTS = ("real", "padded")


class TokenBudgetError(DataError):
    """Lengths or settings a token budget cannot serve (a sequence over the budget, too few sequences
    for the ranks, a bad option)."""


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


@dataclass(frozen=True)
class TokenBudget:
    """How batches are filled; see the module docstring. Checked on construction."""

    max_tokens: int
    policy: str = "bucket"
    max_sequences: Optional[int] = None
    pad_to_multiple_of: int = 1
    count: str = "real"
    sort_chunk: Optional[int] = None

    def __post_init__(self) -> None:
        def positive(name: str, value: Any, optional: bool = False) -> None:
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise TokenBudgetError(f"{name} must be a positive integer{' or None' if optional else ''}, "
                                       f"got {value!r}")

        positive("max_tokens", self.max_tokens)
        positive("max_sequences", self.max_sequences, optional=True)
        positive("pad_to_multiple_of", self.pad_to_multiple_of)
        positive("sort_chunk", self.sort_chunk, optional=True)
        if self.policy not in POLICIES:
            raise TokenBudgetError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.count not in COUNTS:
            raise TokenBudgetError(f"count must be one of {COUNTS}, got {self.count!r}")
        if self.policy == "pack" and self.count == "padded":
            raise TokenBudgetError("policy 'pack' mixes lengths in a batch, which a padded model pays as padding: "
                                   "use it with count='real' (unpadded models), or policy 'bucket' for padded ones")
        if self.policy == "pack" and self.sort_chunk is not None:
            raise TokenBudgetError("sort_chunk applies to policy 'bucket'; 'pack' packs the whole epoch")

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens a batch of these lengths counts against ``max_tokens``."""
        if self.count == "real":
            return int(sum(lengths))
        return len(lengths) * round_up(int(max(lengths)), self.pad_to_multiple_of)


def _checked_lengths(lengths: Any, budget: TokenBudget) -> np.ndarray:
    array = np.asarray(lengths.detach().cpu() if isinstance(lengths, torch.Tensor) else lengths)
    if array.size == 0:
        raise TokenBudgetError("lengths is empty: no sample to batch")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TokenBudgetError(f"lengths must be a 1-D array of integers (one per sample), got dtype {array.dtype} "
                               f"and shape {array.shape}")
    array = array.astype(np.int64)
    if array.min() < 1:
        index = int(np.argmin(array))
        raise TokenBudgetError(f"sample {index} has length {int(array[index])}: every sample needs at least one token")
    single = array if budget.count == "real" else -(-array // budget.pad_to_multiple_of) * budget.pad_to_multiple_of
    over = single > budget.max_tokens
    if over.any():
        index = int(np.argmax(over))
        padded = f" (padded to {int(single[index])})" if single[index] != array[index] else ""
        more = int(over.sum()) - 1
        raise TokenBudgetError(
            f"sample {index} has {int(array[index])} tokens{padded}, more than max_tokens={budget.max_tokens}: it fits "
            f"no batch" + (f" ({more} other sample(s) too)" if more else "") + f". Raise max_tokens to at least "
            f"{int(single.max())}, or truncate or drop such samples before batching")
    return array


# -- the two policies: lists of index arrays, in the order they were filled ---------------------------------
def _fill_sorted(indices: np.ndarray, lengths: np.ndarray, budget: TokenBudget) -> list[np.ndarray]:
    """Cut ``indices`` (sorted by ascending length) into consecutive batches, each as long as fits."""
    n, batches, start = len(indices), [], 0
    cap = budget.max_sequences or n
    if budget.count == "real":
        cumulative = np.concatenate(([0], np.cumsum(lengths)))
        while start < n:
            # Largest end with cumulative[end] - cumulative[start] <= max_tokens (a single sequence always fits).
            end = int(np.searchsorted(cumulative, cumulative[start] + budget.max_tokens, side="right")) - 1
            end = min(max(end, start + 1), start + cap, n)
            batches.append(indices[start:end])
            start = end
        return batches
    padded = -(-lengths // budget.pad_to_multiple_of) * budget.pad_to_multiple_of
    while start < n:
        # Ascending lengths: a batch [start, end) costs (end - start) * padded[end - 1], monotone in end.
        low, high = start + 1, min(start + cap, n)
        while low < high:
            mid = (low + high + 1) // 2
            if (mid - start) * padded[mid - 1] <= budget.max_tokens:
                low = mid
            else:
                high = mid - 1
        batches.append(indices[start:low])
        start = low
    return batches


def _bucket(order: np.ndarray, lengths: np.ndarray, budget: TokenBudget) -> list[np.ndarray]:
    chunk = budget.sort_chunk or len(order)
    batches = []
    for begin in range(0, len(order), chunk):
        part = order[begin:begin + chunk]
        part = part[np.argsort(lengths[part], kind="stable")]  # stable: ties keep the random order
        batches += _fill_sorted(part, lengths[part], budget)
    return batches


def _pack(order: np.ndarray, lengths: np.ndarray, budget: TokenBudget) -> list[np.ndarray]:
    """First-fit decreasing. A segment tree over the batches' free tokens finds the first batch with
    room in O(log batches); equal lengths are placed together (the first batch with room for one takes
    as many as fit), so the work grows with batches × distinct lengths, not with sequences."""
    order = order[np.argsort(-lengths[order], kind="stable")]
    sorted_lengths = lengths[order]
    cap = budget.max_sequences or len(order)
    # First fit leaves at most one batch at most half full, besides batches closed by the cap.
    slots = min(len(order), 2 * math.ceil(int(lengths.sum()) / budget.max_tokens) + math.ceil(len(order) / cap) + 1)
    size = 1 << max(0, (slots - 1).bit_length())
    free = [-1] * (2 * size)  # free tokens of each batch (leaves), max over children (inner nodes); -1: closed
    members: list[list[int]] = []
    counts: list[int] = []

    def set_free(batch: int, value: int) -> None:
        node = size + batch
        free[node] = value
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2

    def first_with(room: int) -> int:
        """The first batch with at least ``room`` free tokens, or -1."""
        if free[1] < room:
            return -1
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= room else 2 * node + 1
        return node - size

    position, n = 0, len(order)
    while position < n:
        length = int(sorted_lengths[position])
        run_end = position
        while run_end < n and sorted_lengths[run_end] == length:
            run_end += 1
        while position < run_end:
            batch = first_with(length)
            if batch < 0:  # no open batch has room: open one
                batch = len(members)
                members.append([])
                counts.append(0)
                room = budget.max_tokens
            else:
                room = free[size + batch]
            take = min(run_end - position, room // length, cap - counts[batch])
            members[batch] += order[position:position + take].tolist()
            counts[batch] += take
            position += take
            set_free(batch, room - take * length if counts[batch] < cap else -1)
    return [np.asarray(m, dtype=np.int64) for m in members]


def _deal(batches: list[np.ndarray], num_replicas: int, lengths: np.ndarray) -> list[list[np.ndarray]]:
    """Consecutive batches as steps of ``num_replicas``; the most crowded batches are halved until the
    count is a multiple of ``num_replicas`` (each half costs no more than the whole)."""
    batches = list(batches)
    while len(batches) % num_replicas:
        crowded = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[crowded]) < 2:
            raise TokenBudgetError(
                f"{int(len(lengths))} sample(s) make {len(batches)} batch(es) of one sample each, which cannot be "
                f"dealt equally to {num_replicas} ranks without dropping or repeating a sample: use fewer ranks, "
                "more samples or a larger max_tokens")
        half = len(batches[crowded]) // 2
        whole = batches[crowded]
        batches[crowded:crowded + 1] = [whole[:half], whole[half:]]
    return [batches[i:i + num_replicas] for i in range(0, len(batches), num_replicas)]


def plan_steps(lengths: Any, budget: TokenBudget, seed: int | Sequence[int] = 0, epoch: int = 0,
               num_replicas: int = 1, shuffle: bool = True) -> list[list[list[int]]]:
    """The batches of one epoch: ``steps[k][r]`` is the list of indices rank r trains on in step k.

    The same on every rank for the same arguments (no communication). ``seed``: a non-negative int, or
    a tuple of them (e.g. (seed, shard)). ``shuffle=False``: indices in their given order before
    sorting, and the steps in the order they were filled."""
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise TokenBudgetError(f"num_replicas must be a positive integer, got {num_replicas!r}")
    lengths = _checked_lengths(lengths, budget)
    seeds = [int(s) for s in (seed if isinstance(seed, (tuple, list)) else (seed,))]
    if any(s < 0 for s in seeds) or epoch < 0:
        raise TokenBudgetError(f"seed and epoch must be non-negative, got seed={seed!r}, epoch={epoch!r}")
    rng = np.random.default_rng([*seeds, int(epoch)]) if shuffle else None
    order = rng.permutation(len(lengths)) if rng is not None else np.arange(len(lengths))
    batches = (_bucket if budget.policy == "bucket" else _pack)(order, lengths, budget)
    steps = _deal(batches, num_replicas, lengths)
    if rng is not None:
        steps = [steps[i] for i in rng.permutation(len(steps))]
    return [[batch.tolist() for batch in step] for step in steps]


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of indices whose tokens fit ``max_tokens``; a ``batch_sampler`` for a DataLoader.

    ``lengths``: one length per sample of the dataset (real tokens). Options as ``TokenBudget``
    (``policy``, ``max_sequences``, ``pad_to_multiple_of``, ``count``, ``sort_chunk``). ``seed`` and
    ``set_epoch(epoch)`` decide the epoch's batches. DDP: ``num_replicas`` ranks, this one ``rank``
    (as ``DistributedSampler``, but never read from torch.distributed: pass both); each rank gets
    ``len(self)`` batches, disjoint from the others'. ``rank=None`` yields every rank's batches, step by
    step in rank order: the order accelerate's ``BatchSamplerShard`` (the HF Trainer's and
    sentence-transformers' loaders under DDP) deals out, batch i to process i mod num_replicas.
    A sequence over the budget raises ``TokenBudgetError`` here, naming it.
    """

    def __init__(self, lengths: Any, max_tokens: int, *, policy: str = "bucket", max_sequences: Optional[int] = None,
                 pad_to_multiple_of: int = 1, count: str = "real", sort_chunk: Optional[int] = None,
                 shuffle: bool = True, seed: int | Sequence[int] = 0, num_replicas: int = 1,
                 rank: Optional[int] = None):
        self.budget = TokenBudget(max_tokens, policy, max_sequences, pad_to_multiple_of, count, sort_chunk)
        self.lengths = _checked_lengths(lengths, self.budget)
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise TokenBudgetError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < num_replicas):
            raise TokenBudgetError(f"rank must be None or in [0, num_replicas={num_replicas}), got {rank!r}")
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self._plan: Optional[tuple[int, list[list[list[int]]]]] = None
        self.steps()  # fail now, not in the first epoch, if the ranks cannot be served

    @classmethod
    def from_budget(cls, lengths: Any, budget: TokenBudget, **options: Any) -> "TokenBudgetBatchSampler":
        """The sampler of a ``TokenBudget`` (``options``: shuffle, seed, num_replicas, rank)."""
        return cls(lengths, budget.max_tokens, policy=budget.policy, max_sequences=budget.max_sequences,
                   pad_to_multiple_of=budget.pad_to_multiple_of, count=budget.count, sort_chunk=budget.sort_chunk,
                   **options)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def steps(self) -> list[list[list[int]]]:
        """This epoch's plan for all ranks: ``steps()[k][r]``, the indices of rank r in step k."""
        if self._plan is None or self._plan[0] != self.epoch:
            self._plan = (self.epoch, plan_steps(self.lengths, self.budget, self.seed, self.epoch,
                                                 self.num_replicas, self.shuffle))
        return self._plan[1]

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.steps():
            if self.rank is None:
                yield from step
            else:
                yield step[self.rank]

    def __len__(self) -> int:
        steps = len(self.steps())
        return steps if self.rank is not None else steps * self.num_replicas


# -- lengths ------------------------------------------------------------------------------------------------
def mask_lengths(mask: Any) -> np.ndarray:
    """Real tokens per row of a [N, L] 0/1 padding mask (numpy or torch), as int64."""
    array = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask)
    if array.ndim != 2:
        raise TokenBudgetError(f"a padding mask must be [samples, length], got shape {array.shape}")
    return np.count_nonzero(array, axis=1).astype(np.int64)


def token_lengths(tokenizer: Callable[..., Any], *columns: Sequence[str],
                  max_length: Optional[int] = None) -> np.ndarray:
    """Tokens per sample of text columns through a transformers tokenizer (special tokens included,
    truncated to ``max_length`` as the model's collator will), summed over the columns: a pair of
    anchor and positive costs both. ``token_lengths(model.tokenizer, data["anchor"], data["positive"])``."""
    if not columns:
        raise TokenBudgetError("token_lengths needs at least one column of texts")
    total = None
    for column in columns:
        encoded = tokenizer(list(column), truncation=max_length is not None, max_length=max_length)["input_ids"]
        lengths = np.asarray([len(ids) for ids in encoded], dtype=np.int64)
        if total is not None and len(lengths) != len(total):
            raise TokenBudgetError(f"text columns differ in length: {len(total)} and {len(lengths)} samples")
        total = lengths if total is None else total + lengths
    return total


def trainer_dataloader(trainer: Any, lengths: Any, max_tokens: int, **options: Any) -> Any:
    """The training DataLoader of a transformers ``Trainer`` with token-budget batches: return it from a
    subclass's ``get_train_dataloader`` (``options``: ``TokenBudgetBatchSampler``'s). As the Trainer's own
    loader: its collator, unused columns removed, its workers and pinning, prepared by accelerate; the
    sampler is seeded with ``args.seed`` and made for ``accelerator.num_processes`` ranks with
    ``rank=None``, so accelerate's per-process dealing gives each process its disjoint share. The
    Trainer calls ``set_epoch`` on it every epoch. ``lengths``: one per sample of ``trainer.train_dataset``."""
    from torch.utils.data import DataLoader

    for hook in ("_remove_unused_columns", "_get_collator_with_removed_columns", "accelerator"):
        if not hasattr(trainer, hook):
            raise TokenBudgetError(f"trainer_dataloader needs a transformers Trainer (5.17 or newer): "
                                   f"{type(trainer).__name__} has no {hook}")
    dataset, collator, args = trainer.train_dataset, trainer.data_collator, trainer.args
    if dataset is None or not hasattr(dataset, "__len__"):
        raise TokenBudgetError("trainer_dataloader needs a train_dataset with a length (one per entry of lengths), "
                               f"got {type(dataset).__name__}")
    datasets = sys.modules.get("datasets")  # imported by the Trainer when installed
    if datasets is not None and isinstance(dataset, datasets.Dataset):  # drop the columns forward() does not take
        dataset = trainer._remove_unused_columns(dataset, description="Training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="Training")
    if len(dataset) != len(lengths):
        raise TokenBudgetError(f"lengths has {len(lengths)} entries but the train_dataset {len(dataset)} samples")
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=args.seed,
                                      num_replicas=trainer.accelerator.num_processes, rank=None, **options)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collator, num_workers=args.dataloader_num_workers,
                        pin_memory=args.dataloader_pin_memory,
                        persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0)
    return trainer.accelerator.prepare(loader)


# -- collating fixed-length samples -------------------------------------------------------------------------
class TrimPadding:
    """Collate samples stored padded to one length, then cut the padding columns no sequence of the
    batch reaches: up to the last real token of any row (``mask``), rounded up to ``pad_to_multiple_of``
    and never past the stored length. ``columns``: the keys (dict samples) or positions (tuple samples,
    a TensorDataset's) of the [L] tensors to cut, the mask among them; others (labels, positions) are
    left as collated. Picklable, for DataLoader workers."""

    def __init__(self, columns: Sequence[Any], mask: Any, pad_to_multiple_of: int = 1):
        if mask not in columns:
            raise TokenBudgetError(f"the mask column {mask!r} must be one of the columns to trim {list(columns)}")
        if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
            raise TokenBudgetError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}")
        self.columns, self.mask, self.pad_to_multiple_of = tuple(columns), mask, pad_to_multiple_of

    def __call__(self, samples: list[Any]) -> Any:
        batch = default_collate(samples)
        mask = batch[self.mask]
        stored = mask.shape[1]
        used = mask.any(dim=0).nonzero()
        reach = int(used[-1]) + 1 if len(used) else 1
        keep = min(stored, round_up(reach, self.pad_to_multiple_of))
        if keep == stored:
            return batch
        if isinstance(batch, dict):
            return {k: v[:, :keep] if k in self.columns else v for k, v in batch.items()}
        return type(batch)(v[:, :keep] if i in self.columns else v for i, v in enumerate(batch))


def loss_weights(counts: Sequence[float], total: float, accumulation: int, world_size: int = 1) -> list[float]:
    """Weights that make a step's loss the mean over all its counted items (masked tokens for MLM,
    sequences for NSP or SQuAD), whatever the micro-batch sizes.

    A trainer averages the micro-batches' losses (dividing each by ``accumulation``) and DDP averages
    the ranks' gradients (dividing by ``world_size``); each micro-batch's loss is itself a mean over its
    own ``counts[i]`` items. Multiplied by ``accumulation · world_size · counts[i] / total`` (``total``:
    the items of the whole step, all ranks), the sum is Σ counts[i]·mean_i / total: the mean over the
    step's items, as one batch of all of them gives. 0 when the step has no item (its loss is 0 too)."""
    if total <= 0:
        return [0.0 for _ in counts]
    return [accumulation * world_size * float(c) / float(total) for c in counts]


# -- the report: padding waste and steps per epoch ---------------------------------------------------------
@dataclass
class EpochStats:
    steps: int                 # optimizer steps of one epoch (one batch per step, one rank)
    sequences_per_step: float  # mean
    real_tokens: int           # over the epoch
    padded_tokens: int         # over the epoch, each batch padded to its longest (rounded up) or to a fixed length
    slots: int                 # token slots of memory over the epoch: steps × the budget

    @property
    def padding_waste(self) -> float:
        return (self.padded_tokens - self.real_tokens) / self.padded_tokens

    @property
    def fill(self) -> float:
        return self.real_tokens / self.slots


def epoch_stats(lengths: np.ndarray, batches: Sequence[Sequence[int]], slots_per_step: int,
                pad_to_multiple_of: int = 8, padded_length: Optional[int] = None) -> EpochStats:
    """Statistics of one epoch's batches: ``padded_length`` None pads each batch to its longest length
    (rounded up to ``pad_to_multiple_of``), else every sequence to that fixed length."""
    real = padded = 0
    for batch in batches:
        batch_lengths = lengths[np.asarray(batch)]
        real += int(batch_lengths.sum())
        width = padded_length or round_up(int(batch_lengths.max()), pad_to_multiple_of)
        padded += len(batch) * width
    return EpochStats(len(batches), sum(len(b) for b in batches) / len(batches), real, padded,
                      len(batches) * slots_per_step)


def _wikipedia_like(work: Path, seq_len: int, documents: int, seed: int) -> np.ndarray:
    """Lengths of pretraining sequences from the project's generated corpus, documents joined four to
    an article as the main job joins them (tempo.tasks.demo: about 50 % padding at s = 512)."""
    from .create_pretraining_data import create_shards
    from .sample_corpus import generate_documents
    from .tokenization import train_wordpiece_vocab

    docs = generate_documents(documents, seed)
    articles = ["\n".join(s for doc in docs[i:i + 4] for s in doc) for i in range(0, len(docs), 4)]
    text = work / "articles"
    text.mkdir(parents=True, exist_ok=True)
    (text / "articles.txt").write_text("\n\n".join(articles) + "\n", encoding="utf-8")
    vocab = work / "vocab.txt"
    if not vocab.exists():
        train_wordpiece_vocab([text / "articles.txt"], 2048, vocab)
    shards = create_shards(text, work / f"shards_{seq_len}", vocab, max_seq_length=seq_len,
                           max_predictions_per_seq=max(2, seq_len * 15 // 100), dupe_factor=2, random_seed=seed)
    import h5py  # the shards just written: their input_mask, read whole

    lengths = []
    for path in shards:
        with h5py.File(path, "r") as f:
            lengths.append(mask_lengths(f["input_mask"][:]))
    return np.concatenate(lengths)


def _squad_like(work: Path, seq_len: int, questions: int, seed: int) -> np.ndarray:
    """Lengths of SQuAD training windows (doc_stride 128, questions up to 64 tokens) of the project's
    generated question set, tokenized with the shipped all-MiniLM-L6-v2 vocabulary (BERT's uncased one)."""
    from tempo.bert.hf_interop import minilm_dir

    from .qa_generator import write_qa_set
    from .squad import build_features, read_squad
    from .tokenization import WordPieceTokenizer

    train, _ = write_qa_set(work / "qa", num_train=questions, num_dev=1, seed=seed)
    tokenizer = WordPieceTokenizer(minilm_dir() / "vocab.txt", lower_case=True)
    features = build_features(read_squad(train, for_training=True).examples, tokenizer, max_seq_length=seq_len,
                              doc_stride=128, max_query_length=64, for_training=True, progress=False)
    return mask_lengths(features.input_mask)


def report(quick: bool = False, seed: int = 0, out: Any = None) -> list[dict[str, Any]]:
    """Print (and return) the table: fixed batches of B padded to S against a budget of B·S tokens."""
    out = out or sys.stdout
    settings = [  # (data, S, B): per-device batches in the range DLE's BERT-large recipes use
        ("Wikipedia-like", 128, 64), ("Wikipedia-like", 512, 16), ("SQuAD-like", 384, 32)]
    size = dict(documents=300 if quick else 1500, questions=400 if quick else 4000)
    rows = []
    with tempfile.TemporaryDirectory(prefix="token_budget_report_") as tmp:
        lengths_of = {}
        for name, seq_len, _ in settings:
            print(f"generating {name} data at s = {seq_len} ...", file=sys.stderr, flush=True)
            work = Path(tmp) / name
            lengths_of[(name, seq_len)] = (
                _wikipedia_like(work, seq_len, size["documents"], seed) if name.startswith("Wikipedia")
                else _squad_like(work, seq_len, size["questions"], seed))
        for name, seq_len, batch in settings:
            lengths = lengths_of[(name, seq_len)]
            budget = batch * seq_len
            order = np.random.default_rng(seed).permutation(len(lengths))
            fixed = [order[i:i + batch].tolist() for i in range(0, len(order), batch)]
            variants = [
                (f"fixed B = {batch}, padded to S", epoch_stats(lengths, fixed, budget, padded_length=seq_len)),
                (f"fixed B = {batch}, padded to longest", epoch_stats(lengths, fixed, budget)),
            ]
            for policy in POLICIES:
                plan = plan_steps(lengths, TokenBudget(budget, policy), seed=seed)
                variants.append((f"{budget} real tokens, {policy}", epoch_stats(lengths, [s[0] for s in plan], budget)))
            for label, stats in variants:
                rows.append({"data": name, "seq_len": seq_len, "sequences": len(lengths),
                             "mean_length": float(lengths.mean()), "batching": label, "steps": stats.steps,
                             "sequences_per_step": stats.sequences_per_step, "fill": stats.fill,
                             "padding_waste": stats.padding_waste})
    print("Padding waste and steps per epoch: fixed batches of B sequences padded to S against a token budget of "
          "B·S real tokens (the same activation memory for an unpadded model). Fill: real tokens / (steps · B·S). "
          "Padding waste: padded / all tokens of the batch a padded model would see (each batch padded to its "
          "longest, rounded up to 8, unless 'padded to S'); an unpadded model computes no padding at all.\n", file=out)
    print("| data | S | sequences (mean length) | batching | steps per epoch | sequences per step | fill | "
          "padding waste |", file=out)
    print("|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        print(f"| {r['data']} | {r['seq_len']} | {r['sequences']} ({r['mean_length']:.0f}) | {r['batching']} | "
              f"{r['steps']} | {r['sequences_per_step']:.1f} | {100 * r['fill']:.1f} % | "
              f"{100 * r['padding_waste']:.1f} % |", file=out)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tempo.bert.data.token_budget",
                                     description="Token-budget batching: the padding and steps report.")
    parser.add_argument("--report", action="store_true", help="print the padding waste and steps per epoch table")
    parser.add_argument("--quick", action="store_true", help="smaller generated data (seconds instead of a minute)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.report:
        parser.error("nothing to do: pass --report")
    report(quick=args.quick, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
