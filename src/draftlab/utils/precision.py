"""``trainer.precision: auto``: bf16 autocast where the hardware computes bf16 natively, fp32 elsewhere.

On a CPU without native bf16 (AVX2 only, no AVX512-BF16 / AMX-BF16) PyTorch emulates bf16 matmuls, and a draft
trained under bf16 autocast ran about 10x slower than in fp32 (experiments/draft_opd/README.md). Where the
CPU has the instructions, bf16 autocast was 1.03-1.33x faster (experiments/train_ablation). So a config that
wants "the fast one" says ``auto`` and each machine gets its own; the resolved value enters the training key,
since the two train different weights.

In a config: ``precision: ${auto_precision:${trainer.accelerator}}`` (the resolver is registered when
draftlab is imported), so every reader of the config, Lightning included, sees a value it accepts;
``trainer.precision=auto`` on the command line is resolved the same way by the train stage.
"""

from __future__ import annotations

from pathlib import Path

AUTO = "auto"
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16_cpu(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 instructions (the ``flags`` line of ``/proc/cpuinfo``; False where unreadable)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return any(f in flags for f in _NATIVE_BF16_FLAGS)
    return False


def resolve_precision(precision, accelerator: str | None = "cpu") -> str:
    """``precision`` as Lightning takes it: ``auto`` becomes ``bf16-mixed`` on a GPU or a CPU with native bf16,
    ``32-true`` on any other CPU; every other value is returned unchanged."""
    if str(precision) != AUTO:
        return precision
    if str(accelerator) in ("gpu", "cuda"):
        return "bf16-mixed"
    return "bf16-mixed" if native_bf16_cpu() else "32-true"
