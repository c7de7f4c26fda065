"""Which CPU matmul a pass of a few rows should use, measured on the machine that runs it.

A verify pass multiplies a handful of rows (the draft tree) by every weight matrix of the target. On CPU,
MKL runs ``x @ W.T`` for 2..~32 rows as a GEMM whose cost depends on the CPU: on one 2-core machine it
cost about two weight passes and the weight-major product ``(W @ x.T).T`` stayed near one (2 rows 42 vs
100 ms over SmolLM2's layers), on another ``F.linear`` was the faster one up to 8 rows (2 rows 60 vs 96 ms
for a whole pass). A constant in the code is right on one machine and wrong on the next, so the choice is
measured: for each weight shape of the target and each row count of a grid, both products are timed and
the faster kept. The table is cached per (CPU, torch version, threads, dtype, shapes) under
``<cache>/row_kernels/`` and reused by every later process on the same machine.

One row always uses ``F.linear`` (a GEMV either way); more rows than the grid's last entry too (a real
GEMM, where MKL is at its best). Autograd always uses ``F.linear``. Both products compute the same sums
in a different order: outputs agree to float rounding, as they would across machines.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from bisect import bisect_right
from pathlib import Path

import torch
import torch.nn.functional as F

GEMM, WEIGHT_MAJOR = "gemm", "weight_major"
MODES = ("auto", GEMM, WEIGHT_MAJOR)
ROW_GRID = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def weight_major(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 [R, in] @ weight.T`` computed as ``(weight @ x2.T).T``: one pass over the weights."""
    return torch.mm(weight, x2.T).T  # [R, out]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _seconds(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure(shapes: list[tuple[int, int]], dtype: torch.dtype, rows: tuple[int, ...] = ROW_GRID,
            budget_s: float = 0.01) -> dict[str, dict[str, str]]:
    """Time both products per (shape, row count); ``{"OUTxIN": {"rows": "gemm"|"weight_major"}}``.

    The two products alternate (so a drift of the machine's speed hits both), each repeated until about
    ``budget_s`` of work per point (3 to 50 times, median kept): an LM head is timed a few times, a small
    matrix many times.
    """
    table: dict[str, dict[str, str]] = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for out_f, in_f in shapes:
            w = torch.randn(out_f, in_f, generator=gen).to(dtype)
            choice = {}
            for r in rows:
                x = torch.randn(r, in_f, generator=gen).to(dtype)
                _seconds(F.linear, x, w), _seconds(weight_major, x, w)  # warm-up: first touch, MKL buffers
                reps = int(min(max(3, budget_s / max(_seconds(F.linear, x, w), 1e-6)), 50))
                gemm, wm = [], []
                for _ in range(reps):
                    gemm.append(_seconds(F.linear, x, w))
                    wm.append(_seconds(weight_major, x, w))
                choice[str(r)] = WEIGHT_MAJOR if sorted(wm)[reps // 2] < sorted(gemm)[reps // 2] else GEMM
            table[f"{out_f}x{in_f}"] = choice
    return table


class RowKernels:
    """``linear(x, W, b)`` with the product chosen per (W's shape, row count) from a measured table."""

    def __init__(self, mode: str = GEMM, table: dict[str, dict[str, str]] | None = None,
                 rows: tuple[int, ...] = ROW_GRID):
        if mode not in (GEMM, WEIGHT_MAJOR, "table"):
            raise ValueError(f"row kernel mode must be one of {MODES}, got {mode!r}")
        self.mode, self.rows = mode, tuple(rows)
        self.table = table or {}
        # (out, in) -> choice per grid row count, for a lookup without string keys on the hot path.
        self._choice = {tuple(int(v) for v in k.split("x")): [c[str(r)] for r in self.rows] for k, c in self.table.items()}

    @classmethod
    def for_weights(cls, mode: str, weights: list[torch.Tensor], *, cache_dir: str | Path | None = None) -> RowKernels:
        """``mode`` ``auto``: the table for these weights' shapes, measured now or read from the cache."""
        if mode not in MODES:
            raise ValueError(f"row kernel mode must be one of {MODES}, got {mode!r}")
        if mode != "auto":
            return cls(mode)
        if not weights or weights[0].device.type != "cpu":
            return cls(GEMM)  # accelerators: the vendor GEMM is the small-row kernel
        shapes = sorted({tuple(w.shape) for w in weights})
        dtype = weights[0].dtype
        key = json.dumps({"cpu": _cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "dtype": str(dtype), "shapes": shapes, "rows": ROW_GRID}, sort_keys=True)
        path = None
        if cache_dir is not None:
            path = Path(cache_dir) / "row_kernels" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
            try:
                stored = json.loads(path.read_text())
                if stored.get("key") == key:
                    return cls("table", stored["table"])
            except (OSError, ValueError, KeyError):
                pass  # absent or unreadable: measure again
        table = measure(shapes, dtype)
        if path is not None:
            from draftlab.utils.atomic import atomic_write_text

            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({"key": key, "table": table}, indent=1))
        return cls("table", table)

    def pick(self, weight: torch.Tensor, rows: int) -> str:
        if rows < 2 or rows > self.rows[-1]:
            return GEMM
        if self.mode != "table":
            return self.mode
        choice = self._choice.get(tuple(weight.shape))
        if choice is None:
            return GEMM
        return choice[bisect_right(self.rows, rows) - 1]  # the largest measured count <= rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if x.device.type != "cpu" or torch.is_grad_enabled() or self.pick(weight, rows) == GEMM:
            return F.linear(x, weight, bias)
        y = weight_major(x.reshape(rows, x.shape[-1]), weight)  # [rows, out]
        if bias is not None:
            y = y + bias
        return y.contiguous().view(*x.shape[:-1], weight.shape[0])

    def describe(self) -> str:
        """One line per shape: the row counts that use the weight-major product."""
        if self.mode != "table":
            return f"row kernels: {self.mode} for 2..{self.rows[-1]} rows"
        parts = []
        for k, c in self.table.items():
            wm = [r for r in self.rows if c[str(r)] == WEIGHT_MAJOR]
            parts.append(f"{k}: weight-major at {wm if wm else 'no'} rows")
        return "row kernels (measured): " + "; ".join(parts)
