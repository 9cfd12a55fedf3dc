"""Bytes moved: Substation's data-movement count for every Tempo choice, and a projected GPU time.

"Data Movement Is All You Need" (Ivanov et al., MLSys 2021): in a BERT layer the tensor
contractions are almost all of the FLOPs but far from all of the time; what the normalisations and
element-wise ops move decides the rest. This package counts, without a GPU, the FLOPs and the bytes
read and written by every kernel of a training step as the CUDA build would run it, and projects a
time per GPU from datasheet peaks and two efficiencies fitted on published measurements.

    python -m tempo.movement [--model] [--hf] [--components] [--per-op] [--json PATH]

Pieces, in data-flow order:
  trace.py         the step traced on fake CPU tensors with CUDA's autocast, dropout and sdpa
                   decisions (``FakeSession``, ``CudaSemantics``, ``Recorder``);
  declarations.py  one declaration per op whose CUDA kernels are not counted by its I/O: every
                   Tempo custom op (its Triton kernels' loads and stores, the host ops around them),
                   the fused attention kernels, LayerNorm's backward, gathers;
  interpreter.py   the count of a Triton kernel's loads and stores in Triton's interpreter, which the
                   tests hold every Triton-backed declaration to;
  workloads.py     BERT-large layers and whole steps (ours per ``TempoChoice``, transformers' after
                   ``apply_tempo``), padded or unpadded;
  projection.py    the roofline, the GPUs' peaks, the calibration points and the fit;
  components.py    each Tempo layer against the stock ops it replaces;
  report.py, cli.py  tables and the JSON.

What PyTorch already had and is used: ``torch.utils.flop_counter``'s FLOP formulas,
``torch._inductor.analysis.device_info``'s A100/H100 peaks, FakeTensorMode. What had to be added:
``torch.utils._runtime_estimation`` counts every op by its inputs and outputs and needs a GPU for
its peaks, and a CPU trace runs the CPU's decompositions (dropout with a float mask, sdpa as
math, autocast without CUDA's fp32 list) and Tempo's CPU reference paths; hence the CUDA semantics
and the declarations.
"""

from tempo.movement.declarations import CLASSES, DECLARATIONS, Kernel, Target, kernels_of
from tempo.movement.projection import CALIBRATION, Factors, fit_factors, gpus, project_seconds
from tempo.movement.trace import CudaSemantics, FakeSession, OpCall, Recorder, TensorMeta, Trace
from tempo.movement.workloads import CHOICES, HF_VARIANTS, Workload, layer_workload, model_workload, trace_model

__all__ = ["CALIBRATION", "CHOICES", "CLASSES", "CudaSemantics", "DECLARATIONS", "Factors", "FakeSession",
           "HF_VARIANTS", "Kernel", "OpCall", "Recorder", "Target", "TensorMeta", "Trace", "Workload", "fit_factors",
           "gpus", "kernels_of", "layer_workload", "model_workload", "project_seconds", "trace_model"]
