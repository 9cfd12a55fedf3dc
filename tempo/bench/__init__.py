"""``python -m tempo.bench``: training, memory and kernel benchmarks for Tempo and BERT.

Subcommands (see ``python -m tempo.bench -h``): train, max-batch, sweep, layer, ops, profile,
report. Modules: timing (repeat/percentile helpers), hardware (GPU detection, peak TFLOPS,
copy bandwidth, environment), flops (the model-FLOP count behind MFU), anatomy (where the
memory goes), train_bench, max_batch, sweep, layer_bench, ops_bench, profile, report,
results (output folders, JSON/CSV), hf_provider (HF transformers models as a baseline).
"""
