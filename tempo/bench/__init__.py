"""The benchmark commands: training, memory and kernel measurements of Tempo against stock PyTorch.

What a user runs (each prints its own ``-h``):
  python -m tempo.bench SUBCOMMAND     train, max-batch, sweep, layer, ops, profile, report, gpu-suite,
                                       compare (``__main__.py`` lists them and the module of each)
  python -m tempo.bench.torch_policies what torch's own policies keep and recompute, as a table
  python -m tempo.bench.gelu_bench     In-place GELU on the CPU: timing, and its derivative against fp64
  python -m tempo.bench.squad_benchmark  original vs Tempo SQuAD fine-tuning at the largest batch
The GPU check (``gpu-suite``, scripts/gpu_check.sh) is the gpu_*.py files; docs/gpu.md runs a stage alone.

What they share (no command of its own): train_bench (the training run behind train, max-batch,
sweep and profile), timing (repeats, percentiles), hardware (GPU detection, peak TFLOPS, copy
bandwidth, environment), flops (the model-FLOP count behind MFU), anatomy (where the memory goes),
results (output folders, JSON/CSV), common (errors, exit status), hf_provider (transformers' BERT as
a baseline).

The model presets are ``tempo.presets``; ``python -m tempo.plan`` and ``python -m tempo.memory`` live
with their packages.
"""
