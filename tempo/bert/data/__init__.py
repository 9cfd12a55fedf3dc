"""BERT pretraining data: text -> DLE HDF5 shards -> batches.

Submodules are imported lazily so that shard-creation workers (spawned
processes) do not pay for importing torch.

- ``tokenization``: ``WordPieceTokenizer``, ``train_wordpiece_vocab``, ``load_vocab``
- ``create_pretraining_data``: ``create_shards`` and the CLI
- ``pretraining_dataset``: ``PretrainingShardDataset``, ``PretrainingBatches``, ``list_shards``
- ``synthetic``: ``SyntheticPretrainingBatches``
- ``sample_corpus``: ``write_sample_corpus``
"""

from importlib import import_module

_EXPORTS = {
    "DataError": "tokenization",
    "VocabError": "tokenization",
    "WordPieceTokenizer": "tokenization",
    "load_vocab": "tokenization",
    "train_wordpiece_vocab": "tokenization",
    "CorpusError": "create_pretraining_data",
    "create_shards": "create_pretraining_data",
    "ShardError": "pretraining_dataset",
    "PretrainingShardDataset": "pretraining_dataset",
    "PretrainingBatches": "pretraining_dataset",
    "list_shards": "pretraining_dataset",
    "SyntheticPretrainingBatches": "synthetic",
    "write_sample_corpus": "sample_corpus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
