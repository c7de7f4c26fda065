"""Which CPU matmul a pass of a few rows should use, measured on the machine that runs it.

A verify pass multiplies a handful of rows (the draft tree) by every weight matrix of the target. On CPU,
MKL runs ``x @ W.T`` for 2..~32 rows as a GEMM whose cost depends on the CPU and the row count: on one
2-core machine it cost about two weight passes and the weight-major product ``(W @ x.T).T`` stayed near
one (2 rows 42 vs 100 ms over SmolLM2's layers); on another ``F.linear`` is the faster one up to 8 rows
and the weight-major one from 16 (whole passes, experiments/engine_baseline part b). A constant in the code
is right on one machine and wrong on the next, so the choice is measured.

It is measured on whole passes of the target itself, not on one matrix at a time: a matrix timed alone
stays in the CPU's caches, while a pass streams every matrix from memory once (a 576 x 576 matrix timed
alone favoured the weight-major product at 4 rows; the whole pass did not). For each row count of the
grid, passes with either product alternate and the faster median is kept. The table is cached per (CPU,
torch version, threads, target) under ``<cache>/row_kernels/`` and reused by every later process.

One row always uses ``F.linear`` (a GEMV either way); more rows than the grid's last entry too (a real
GEMM, where MKL is at its best). Autograd always uses ``F.linear``. Both products compute the same sums
in a different order: outputs agree to float rounding, as they would across machines.
"""

from __future__ import annotations

import hashlib
import json
import platform
from bisect import bisect_right
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

GEMM, WEIGHT_MAJOR = "gemm", "weight_major"
MODES = ("auto", GEMM, WEIGHT_MAJOR)
ROW_GRID = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def weight_major(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 [R, in] @ weight.T`` computed as ``(weight @ x2.T).T``: one pass over the weights."""
    return torch.mm(weight, x2.T).T  # [R, out]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class RowKernels:
    """``linear(x, W, b)`` with the product chosen per row count: forced (``gemm`` / ``weight_major``) or from
    a measured ``table`` (``{"<rows>": "gemm" | "weight_major"}`` over ``ROW_GRID``)."""

    def __init__(self, mode: str = GEMM, table: dict[str, str] | None = None, rows: tuple[int, ...] = ROW_GRID):
        if mode not in (GEMM, WEIGHT_MAJOR, "table"):
            raise ValueError(f"row kernel mode must be one of {MODES}, got {mode!r}")
        if mode == "table" and (table is None or any(str(r) not in table for r in rows)):
            raise ValueError(f"a measured table needs a choice for every row count of {rows}, got {table}")
        self.mode, self.rows, self.table = mode, tuple(rows), dict(table or {})
        self._choice = [self.table.get(str(r), mode) for r in self.rows]  # list lookup on the hot path

    @classmethod
    def measured(cls, run_pass: Callable[[int, RowKernels], None], identity: dict, *,
                 cache_dir: str | Path | None = None, rows: tuple[int, ...] = ROW_GRID, reps: int = 5) -> RowKernels:
        """The table for this machine and this target (``identity``: what names the target's matrices),
        read from ``cache_dir`` or measured with ``run_pass(rows, kernels)`` (one whole pass)."""
        key = json.dumps({"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "rows": list(rows), **identity}, sort_keys=True, default=str)
        path = None
        if cache_dir is not None:
            path = Path(cache_dir) / "row_kernels" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
            try:
                stored = json.loads(path.read_text())
                if stored.get("key") == key:
                    return cls("table", stored["table"], rows)
            except (OSError, ValueError, KeyError, TypeError):
                pass  # absent or unreadable: measure again
        table = measure(run_pass, rows, reps)
        if path is not None:
            from draftlab.utils.atomic import atomic_write_text

            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({"key": key, "table": table}, indent=1))
        return cls("table", table, rows)

    def pick(self, rows: int) -> str:
        if rows < 2 or rows > self.rows[-1]:
            return GEMM
        return self._choice[bisect_right(self.rows, rows) - 1]  # the largest measured count <= rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if x.device.type != "cpu" or torch.is_grad_enabled() or self.pick(rows) == GEMM:
            return F.linear(x, weight, bias)
        y = weight_major(x.reshape(rows, x.shape[-1]), weight)  # [rows, out]
        if bias is not None:
            y = y + bias
        return y.contiguous().view(*x.shape[:-1], weight.shape[0])

    def describe(self) -> str:
        if self.mode != "table":
            return f"row kernels: {self.mode} for 2..{self.rows[-1]} rows"
        wm = [r for r in self.rows if self.table[str(r)] == WEIGHT_MAJOR]
        return f"row kernels (measured on this machine): weight-major at rows {wm or 'none'}, F.linear elsewhere"


def measure(run_pass: Callable[[int, RowKernels], None], rows: tuple[int, ...] = ROW_GRID, reps: int = 5) -> dict[str, str]:
    """Per row count, the product whose whole passes are faster (medians; the two alternate)."""
    import time

    table = {}
    kernels = {GEMM: RowKernels(GEMM, rows=rows), WEIGHT_MAJOR: RowKernels(WEIGHT_MAJOR, rows=rows)}
    for r in rows:
        times = {m: [] for m in kernels}
        for rep in range(reps + 1):  # the first round warms up
            for m, k in kernels.items():
                t0 = time.perf_counter()
                run_pass(r, k)
                if rep:
                    times[m].append(time.perf_counter() - t0)
        med = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
        table[str(r)] = WEIGHT_MAJOR if med[WEIGHT_MAJOR] < med[GEMM] else GEMM
    return table
