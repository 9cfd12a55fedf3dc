"""Kernels, reference paths and autograd functions of the Tempo layers, one file per layer.

``_backend`` decides between the Triton kernels and the PyTorch reference path;
``bitpack`` holds the 1-bit mask layout both paths share.
"""

from tempo.ops._backend import use_backend

__all__ = ["use_backend"]
