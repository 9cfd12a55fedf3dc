"""Test setup shared by every test file.

Without a GPU the Triton kernels are tested on the CPU through Triton's interpreter, which must
be switched on before any kernel module is imported: that is why it happens here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tempo.ops._backend import TRITON_AVAILABLE, triton_interpreting  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def triton_runs_on(device: str) -> bool:
    if not TRITON_AVAILABLE:
        return False
    return device == "cuda" or triton_interpreting()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=["reference", "triton"])
def backend(request, device):
    """Run a test once per implementation; the Triton one is skipped where it cannot run."""
    if request.param == "triton" and not triton_runs_on(device):
        pytest.skip(f"Triton cannot run on {device} here")
    from tempo.ops._backend import use_backend

    with use_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
