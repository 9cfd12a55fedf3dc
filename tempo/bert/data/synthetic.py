"""Random pretraining batches for benchmarks: same keys, dtypes and shapes as the shard reader.

Each batch is drawn from its own generator seeded by (seed, batch index), so the stream is
deterministic, resumable from ``state_dict()`` and costs no disk I/O.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

FIRST_REGULAR_TOKEN = 5  # ids below are [PAD]/[UNK]/[CLS]/[SEP]/[MASK] in BERT vocabularies


class SyntheticPretrainingBatches:
    def __init__(self, batch_size: int, seq_len: int, max_predictions: int, vocab_size: int, seed: int = 0,
                 device: torch.device | str | None = None):
        if max_predictions >= seq_len:
            raise ValueError(f"max_predictions ({max_predictions}) must be smaller than seq_len ({seq_len})")
        self.batch_size, self.seq_len, self.max_predictions = batch_size, seq_len, max_predictions
        self.vocab_size, self.seed, self.device = vocab_size, seed, device
        self.index = 0

    def make_batch(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        b, length, p = self.batch_size, self.seq_len, self.max_predictions
        input_ids = torch.randint(FIRST_REGULAR_TOKEN, self.vocab_size, (b, length), generator=g)
        segment_ids = (torch.arange(length) >= length // 2).long().expand(b, length).clone()
        # Distinct masked positions in [1, L): position 0 is [CLS].
        positions = torch.rand(b, length - 1, generator=g).argsort(dim=1)[:, :p].sort(dim=1).values + 1
        batch = {
            "input_ids": input_ids,
            "segment_ids": segment_ids,
            "input_mask": torch.ones(b, length, dtype=torch.long),
            "masked_lm_positions": positions,
            "masked_lm_labels": torch.randint(FIRST_REGULAR_TOKEN, self.vocab_size, (b, p), generator=g),
            "next_sentence_labels": torch.randint(0, 2, (b,), generator=g),
        }
        if self.device is not None:
            batch = {k: v.to(self.device) for k, v in batch.items()}
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            self.index += 1
            yield self.make_batch(self.index - 1)
