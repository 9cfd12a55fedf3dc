"""The LM head and loss, side by side on the CPU: bytes kept for backward, the peak of a forward and
backward, and the error against fp64, for the stock head (F.linear + F.cross_entropy of the fp32
logits), torch 2.13's F.linear_cross_entropy (chunked: options=LinearCrossEntropyOptions()) and Tempo's
tempo.ops.linear_cross_entropy. Writes results/head/table.md (and prints it).

    python scripts/head_table.py            # 1,024 tokens, hidden 256, vocabularies 512 and 8,192

Liger-Kernel's FusedLinearCrossEntropy and Apple's Cut Cross-Entropy are Triton/CUDA kernels: they do
not run on a CPU, so they are not measured here (docs/head.md says what their documentation states).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tempo.ops.linear_cross_entropy import linear_cross_entropy
from tempo.plan.live import LiveStorages

TOKENS, HIDDEN = 1024, 256


def stock(x, w, t, **kw):
    return F.cross_entropy(F.linear(x, w).float(), t, **kw)


def torch_chunked(x, w, t, **kw):
    options = torch.nn.LinearCrossEntropyOptions()
    return F.linear_cross_entropy(x, w, t, ignore_index=-100, options=options, **kw)


def tempo(x, w, t, **kw):
    return linear_cross_entropy(x, w, t, **kw)


HEADS = {"stock (F.linear + F.cross_entropy)": stock, "torch 2.13 F.linear_cross_entropy (chunked)": torch_chunked,
         "Tempo linear_cross_entropy": tempo}


def measure(fn, vocab: int, dtype: torch.dtype, smoothing: float) -> tuple[int, int, float]:
    """(bytes kept for backward beyond the inputs, peak bytes of forward + backward above the inputs,
    the loss's and gradients' largest error relative to fp64)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=g).requires_grad_()
    w = (torch.randn(vocab, HIDDEN, generator=g) / HIDDEN ** 0.5).requires_grad_()
    t = torch.randint(0, vocab, (TOKENS,), generator=g)
    t[::7] = -100
    inputs = {x.untyped_storage().data_ptr(), w.untyped_storage().data_ptr(), t.untyped_storage().data_ptr()}
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: kept.append(s) or s, lambda s: s):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = fn(x, w, t, label_smoothing=smoothing)
    kept_bytes = sum({s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in kept
                      if s.untyped_storage().data_ptr() not in inputs}.values())
    del loss, kept
    counter = LiveStorages([x, w, t])
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = fn(x, w, t, label_smoothing=smoothing)
        grads = torch.autograd.grad(loss, (x, w))
    peak = counter.peak() - sum(a.nbytes for a in (x, w, t))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = F.cross_entropy(F.linear(x64, w64), t, label_smoothing=smoothing)
    exact_grads = torch.autograd.grad(exact, (x64, w64))
    error = max(abs(loss.item() - exact.item()) / abs(exact.item()),
                *(((a.double() - e).abs().max() / e.abs().max()).item() for a, e in zip(grads, exact_grads)))
    return kept_bytes, peak, error


def main() -> int:
    lines = [f"# The LM head and loss on the CPU ({TOKENS} tokens, hidden {HIDDEN}, 1 in 7 targets ignored)", "",
             f"`python scripts/head_table.py` (torch {torch.__version__}). Bytes above the inputs x, weight and "
             "targets; error: the largest of the loss's and both gradients' error relative to fp64.", "",
             "| head | vocab | dtype | label smoothing | kept for backward | peak of fwd + bwd | error vs fp64 |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for vocab in (512, 8192):
        for dtype in (torch.float32, torch.bfloat16):
            for smoothing in (0.0, 0.1):
                for name, fn in HEADS.items():
                    try:
                        kept, peak, error = measure(fn, vocab, dtype, smoothing)
                        row = f"{kept:,} | {peak:,} | {error:.1e}"
                    except Exception as exc:  # noqa: BLE001 - a head that refuses a mode is a row saying so
                        row = f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:80]} | | "
                    lines.append(f"| {name} | {vocab:,} | {str(dtype)[6:]} | {smoothing} | {row} |")
    text = "\n".join(lines) + "\n"
    out = Path(__file__).resolve().parent.parent / "results" / "head" / "table.md"
    out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
