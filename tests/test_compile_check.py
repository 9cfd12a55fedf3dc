"""The Triton compile gate: launches recorded under the interpreter, one compiled for sm_90.

Not skipped without Triton: the gate exists to fail when the kernels cannot be compiled.
"""

import json
import os
import subprocess
import sys

import torch
import triton  # noqa: F401 (a missing Triton fails this file, it does not skip it)

from tempo.ops._backend import use_backend
from tempo.ops.compile_check import (
    Launch,
    LaunchRecorder,
    _representative_int,
    defined_kernels,
    failures,
    format_table,
)
from tempo.ops.layernorm import inplace_layernorm


def _record_layernorm():
    x = torch.randn(8, 40, requires_grad=True)
    weight = torch.ones(40, requires_grad=True)
    with LaunchRecorder() as recorder, use_backend("triton"):
        for _ in range(2):  # the same launches twice: recorded once
            inplace_layernorm(x, 40, weight).sum().backward()
    return recorder.launches


def test_records_each_launch_once_with_its_specialization():
    launches = _record_layernorm()
    assert [launch.qualname for launch in launches] == ["_layernorm_fwd_kernel", "_layernorm_bwd_kernel"]
    fwd = launches[0]
    assert fwd.module == "tempo.ops.layernorm" and fwd.num_warps == 4
    args = {name: (kind, value) for name, kind, value in fwd.args}
    assert args["X"] == ("ptr", ("float32", True)) and args["Y"] == ("ptr", ("float32", True))
    assert args["HAS_WEIGHT"] == ("constexpr", True) and args["HAS_BIAS"] == ("constexpr", False)
    assert args["BLOCK_N"] == ("constexpr", 64)
    assert args["N"] == ("int", 17)  # 40: 32-bit, not a multiple of 16
    assert args["eps"] == ("float", None)
    assert fwd.config == "HAS_WEIGHT=1 HAS_BIAS=0 HAS_KEPT=0 BLOCK_N=64 ptr:f32x6 int:___"
    assert Launch.from_json(json.loads(json.dumps(fwd.to_json()))) == fwd


def test_representative_ints_specialize_like_the_originals():
    assert _representative_int(1) == 1  # a constexpr on the GPU
    assert _representative_int(4096) == 16 and _representative_int(0) == 16
    assert _representative_int(1000 + 7) == 17
    assert _representative_int(2**33) == 2**40 and _representative_int(2**33 + 3) == 2**40 + 1


def test_compiles_a_recorded_launch_for_sm90(tmp_path):
    launch = _record_layernorm()[0]
    src, dst = str(tmp_path / "launches.json"), str(tmp_path / "rows.json")
    with open(src, "w") as f:
        json.dump({"launches": [launch.to_json()]}, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile
    proc = subprocess.run([sys.executable, "-m", "tempo.ops.compile_check", "--compile-from", src, "--rows-to", dst,
                           "--arch", "90", "--jobs", "1"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(dst) as f:
        (row,) = json.load(f)
    assert row["error"] is None
    assert row["kernel"] == "_layernorm_fwd_kernel" and row["arch"] == "sm_90a" and row["num_warps"] == 4
    assert row["config"] == launch.config
    assert 0 < row["registers"] <= 255
    assert row["spill_stores"] == 0 and row["spill_loads"] == 0
    assert isinstance(row["shared"], int) and row["shared"] >= 0
    assert row["ptxas"].startswith("ptxas")
    assert failures([row]) == []
    assert "_layernorm_fwd_kernel" in format_table([row])


def test_failures_name_kernel_config_and_arch():
    base = {"kernel": "k", "config": "BLOCK=8", "num_warps": 4, "arch": "sm_80", "error": None,
            "spill_stores": 0, "spill_loads": 0}
    assert failures([base]) == []
    spill = dict(base, spill_stores=16, spill_loads=8)
    (line,) = failures([spill])
    assert line.startswith("SPILL k [BLOCK=8 w4] on sm_80: 16 bytes")
    assert failures([spill], max_spill_bytes=16) == []
    (line,) = failures([dict(base, error="CompilationError: boom")])
    assert line.startswith("COMPILE ERROR k [BLOCK=8 w4] on sm_80") and "boom" in line


def test_device_functions_are_not_counted_as_kernels():
    kernels = defined_kernels()
    assert ("tempo.ops.combined", "_softmax_dropout_fwd_kernel") in kernels
    assert ("tempo.ops.layernorm", "_layernorm_bwd_wide_kernel") in kernels
    assert ("tempo.ops.combined", "_keep_from_seed") not in kernels  # called by the kernels
