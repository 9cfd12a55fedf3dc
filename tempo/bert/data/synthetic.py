"""Random pretraining batches for benchmarks: same keys, dtypes and shapes as the shard reader.

Each batch is drawn from its own generator seeded by (seed, batch index), so the stream is
deterministic, resumable from ``state_dict()`` (the same ``{"epoch", "shard_index",
"sample_offset"}`` contract as ``PretrainingBatches``; here only ``sample_offset``, the batch
index, moves) and costs no disk I/O.

Rows are full length by default; ``min_seq_len`` gives each row a random real length in
[min_seq_len, seq_len] with zero padding after it, as real shards have. Masked positions are
distinct, sorted, inside the real tokens and never 0 ([CLS]); their labels are the tokens at
those positions; slots that do not fit a short row hold position 0 and label -1.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

FIRST_REGULAR_TOKEN = 5  # ids below are [PAD]/[UNK]/[CLS]/[SEP]/[MASK] in BERT vocabularies


class SyntheticPretrainingBatches:
    def __init__(self, batch_size: int, seq_len: int, max_predictions: int, vocab_size: int, seed: int = 0,
                 device: torch.device | str | None = None, min_seq_len: int | None = None):
        if max_predictions >= seq_len:
            raise ValueError(f"max_predictions ({max_predictions}) must be smaller than seq_len ({seq_len})")
        if vocab_size <= FIRST_REGULAR_TOKEN:
            raise ValueError(f"vocab_size must exceed {FIRST_REGULAR_TOKEN}, got {vocab_size}")
        if min_seq_len is not None and not 2 <= min_seq_len <= seq_len:
            raise ValueError(f"min_seq_len must be in [2, seq_len={seq_len}], got {min_seq_len}")
        self.min_seq_len = min_seq_len
        self.batch_size, self.seq_len, self.max_predictions = batch_size, seq_len, max_predictions
        self.vocab_size, self.seed, self.device = vocab_size, seed, device
        self.index = 0

    def make_batch(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        b, length, p = self.batch_size, self.seq_len, self.max_predictions
        input_ids = torch.randint(FIRST_REGULAR_TOKEN, self.vocab_size, (b, length), generator=g)
        if self.min_seq_len is None:
            lengths = torch.full((b,), length)
        else:
            lengths = torch.randint(self.min_seq_len, length + 1, (b,), generator=g)
        columns = torch.arange(length).expand(b, length)
        real = columns < lengths[:, None]
        input_ids = input_ids.masked_fill(~real, 0)
        segment_ids = ((columns >= (lengths // 2)[:, None]) & real).long()
        # Distinct positions in [1, length of the row): position 0 is [CLS]. Slots a short row
        # cannot fill sort last and become position 0 / label -1, as in a zero-padded shard.
        scores = torch.rand(b, length, generator=g).masked_fill(~real, 2.0)
        scores[:, 0] = 2.0
        picked = scores.argsort(dim=1)[:, :p]
        valid = scores.gather(1, picked) < 2.0
        positions = picked.masked_fill(~valid, length).sort(dim=1).values
        valid = positions < length
        positions = positions.masked_fill(~valid, 0)
        batch = {
            "input_ids": input_ids,
            "segment_ids": segment_ids,
            "input_mask": real.long(),
            "masked_lm_positions": positions,
            "masked_lm_labels": input_ids.gather(1, positions).masked_fill(~valid, -1),
            "next_sentence_labels": torch.randint(0, 2, (b,), generator=g),
        }
        if self.device is not None:
            batch = {k: v.to(self.device) for k, v in batch.items()}
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "shard_index": 0, "sample_offset": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # "index": the key of checkpoints written before 2026-11-22.
        self.index = int(state["sample_offset"] if "sample_offset" in state else state["index"])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            self.index += 1
            yield self.make_batch(self.index - 1)
