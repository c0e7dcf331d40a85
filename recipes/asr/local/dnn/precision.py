"""Which training precision the main job uses: Lightning's ``bf16-mixed`` where the device computes
bfloat16 natively, else ``32-true``.

``bf16-mixed`` keeps the weights, their gradients (what GTC thresholds) and the optimizer in float32
and runs the matrix products in bfloat16 (``torch.autocast``). On a CPU with AVX512-BF16 or AMX
(``torch.ops.mkldnn._is_mkldnn_bf16_supported``) a bfloat16 product is several times faster than a
float32 one; on a CPU without them oneDNN emulates it and it is slower, so there the choice is float32.
On CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and later).

    python recipes/asr/local/dnn/precision.py    # prints the precision and why, as run.sh reads it
"""

from __future__ import annotations

import sys
from pathlib import Path


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bfloat16 matrix products natively (oneDNN's own test, else the flags)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN, or one that renamed the probe
        return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def default_precision(accelerator: str = "auto") -> tuple[str, str]:
    """``(precision, reason)``: ``bf16-mixed`` where ``accelerator`` ("auto", "cpu" or "gpu"/"cuda")
    computes bfloat16 natively, else ``32-true``."""
    import torch

    if accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise ValueError(f"accelerator={accelerator!r}; use auto, cpu, gpu or cuda")
    cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if cuda:
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16-mixed", f"{torch.cuda.get_device_name()} computes bfloat16"
        return "32-true", "no CUDA device that computes bfloat16"
    if native_bf16_cpu():
        return "bf16-mixed", "this CPU computes bfloat16 natively (AVX512-BF16 or AMX)"
    return "32-true", "this CPU has no native bfloat16 (no AVX512-BF16 or AMX): oneDNN would emulate it, slower than float32"


if __name__ == "__main__":
    precision, reason = default_precision(sys.argv[1] if len(sys.argv) > 1 else "auto")
    print(precision)
    print(f"precision {precision}: {reason}", file=sys.stderr)
