"""Test setup shared by every test file.

Without a GPU the Triton kernels are tested on the CPU through Triton's interpreter, which must
be switched on before any kernel module is imported: that is why it happens here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tempo.ops._backend import TRITON_AVAILABLE, TRITON_IMPORT_ERROR, triton_interpreting  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def interpreter_numpy_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels with this numpy, or None.

    Triton 3.6's interpreter turns a runtime loop bound into an int with ``int(array)`` of a
    one-element 1-d array, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be
    converted to Python scalars"); triton 3.7 on squeezes the array first. pyproject.toml cannot
    say "numpy<2.4 with triton<3.7" (a requirement cannot depend on another package's version),
    so the test run checks it here instead of failing ~70 kernel tests with that TypeError."""
    if not (TRITON_AVAILABLE and triton_interpreting()):
        return None
    import numpy
    import triton

    def major_minor(version: str) -> tuple[int, int]:
        return tuple(int(part) for part in version.split(".")[:2])  # type: ignore[return-value]

    if major_minor(triton.__version__) < (3, 7) and major_minor(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1, how the kernels are tested "
                f"without a GPU) breaks with numpy {numpy.__version__}: install 'numpy<2.4' (or triton>=3.7)")
    return None


def pytest_configure(config):
    problem = interpreter_numpy_problem()
    if problem is not None:
        raise pytest.UsageError(problem)


def triton_runs_on(device: str) -> bool:
    if not TRITON_AVAILABLE:
        return False
    return device == "cuda" or triton_interpreting()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def _names_cuda(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    if isinstance(value, (tuple, list)):
        return any(_names_cuda(v) for v in value)
    return False


def touches_cuda(item: pytest.Item) -> bool:
    """True for a test case parametrized on a CUDA device (the ``device`` fixture's "cuda" case,
    or any parameter naming "cuda"/"cuda:N"/torch.device("cuda"))."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(_names_cuda(v) for v in callspec.params.values())


def pytest_collection_modifyitems(config, items):
    # The GPU suite selects its tests with -m gpu: the CUDA cases of the CPU test files belong
    # there as much as tests/test_gpu.py does, so they carry the marker too (collected only
    # where CUDA is visible, like the "cuda" parameter itself).
    for item in items:
        if item.get_closest_marker("gpu") is None and touches_cuda(item):
            item.add_marker(pytest.mark.gpu)


def triton_blocker(device: str):
    """Why the Triton case cannot run on ``device`` here: ("fail" | "skip", reason), or None.

    A Triton that is missing or fails to import, or a CPU-only machine without the interpreter,
    is a broken setup and fails the Triton cases (CI must not go green by skipping them). The
    one legitimate skip: the CPU copies on a CUDA machine, where the kernels are tested on CUDA.
    """
    if TRITON_IMPORT_ERROR is not None:
        return "fail", f"Triton cannot be imported: {TRITON_IMPORT_ERROR!r}"
    if device == "cuda" or triton_interpreting():
        return None
    if torch.cuda.is_available():
        return "skip", "the Triton kernels are tested on CUDA here (TRITON_INTERPRET is off)"
    return "fail", "no CUDA and TRITON_INTERPRET is not 1: the Triton kernels could not run anywhere"


@pytest.fixture(params=["reference", "triton"])
def backend(request, device):
    """Run a test once per implementation; the Triton case fails where Triton should run but cannot."""
    if request.param == "triton":
        blocked = triton_blocker(device)
        if blocked is not None:
            action, reason = blocked
            (pytest.fail if action == "fail" else pytest.skip)(f"Triton case on {device}: {reason}")
    from tempo.ops._backend import use_backend

    with use_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
