"""The one guarded import of Triton: every kernel module asks here, so a CPU install never needs the package.

``TRITON_INTERPRET=1`` (set before Triton is imported) runs the kernels on CPU tensors with Triton's
interpreter: that is how CI tests them against their torch references.
"""

from __future__ import annotations

import os

try:  # triton is the [kernels] extra (and part of CUDA torch builds); absent on plain CPU installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device) -> bool:
    """Whether a Triton kernel can run on tensors of ``device``: CUDA with Triton installed, or any device
    under the interpreter."""
    if triton is None:
        return False
    return interpreting() or str(device).startswith("cuda")


def require(device) -> None:
    """A one-line error naming what is missing when a Triton kernel was asked for and cannot run."""
    if triton is None:
        raise RuntimeError("the Triton kernels need the 'triton' package: pip install -e '.[kernels]'")
    if not available(device):
        raise RuntimeError(f"Triton kernels run on CUDA tensors (got {device}); set TRITON_INTERPRET=1 before "
                           "importing triton to run them on the CPU with the interpreter (tests), or choose a "
                           "torch path")
