"""The small-row matmul choice: measured per machine on whole passes, cached, numerically the same product."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from draftlab.targets import row_kernels
from draftlab.targets.row_kernels import GEMM, ROW_GRID, WEIGHT_MAJOR, RowKernels


def test_both_products_compute_the_same_linear():
    torch.manual_seed(0)
    w, b = torch.randn(96, 40), torch.randn(96)
    x = torch.randn(1, 5, 40)
    ref = F.linear(x, w, b)
    with torch.no_grad():
        for mode in (GEMM, WEIGHT_MAJOR):
            torch.testing.assert_close(RowKernels(mode).linear(x, w, b), ref, rtol=1e-5, atol=1e-5)


def test_table_picks_per_row_count():
    k = RowKernels("table", {str(r): (WEIGHT_MAJOR if 4 <= r <= 8 else GEMM) for r in ROW_GRID})
    assert k.pick(1) == GEMM  # one row: always the GEMV
    assert k.pick(2) == k.pick(3) == GEMM and k.pick(4) == k.pick(8) == WEIGHT_MAJOR
    assert k.pick(7) == WEIGHT_MAJOR  # between grid points: the largest measured count below
    assert k.pick(12) == GEMM and k.pick(1000) == GEMM
    assert "[4, 6, 8]" in k.describe()
    with pytest.raises(ValueError, match="every row count"):
        RowKernels("table", {"2": GEMM})


def test_grad_mode_always_uses_f_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(row_kernels, "weight_major", lambda x, w: calls.append(1) or torch.mm(w, x.T).T)
    k = RowKernels(WEIGHT_MAJOR)
    x, w = torch.randn(4, 8), torch.randn(6, 8, requires_grad=True)
    k.linear(x, w).sum().backward()  # training: autograd through F.linear
    assert calls == [] and w.grad is not None
    with torch.no_grad():
        k.linear(x, w)
    assert calls == [1]


def test_measurement_keeps_the_faster_product_and_is_cached(tmp_path, monkeypatch):
    """A fake pass whose weight-major product is slow below 8 rows and fast from 8: the table says so, the
    second request reads the cache, a corrupt file or another thread count measures again."""
    import time

    passes = []

    def run(rows, kernels):
        passes.append(rows)
        slow = (kernels.pick(rows) == WEIGHT_MAJOR) == (rows < 8)
        time.sleep(0.004 if slow else 0.0)

    ident = {"target": "fake", "dtype": "float32"}
    first = RowKernels.measured(run, ident, cache_dir=tmp_path, reps=3)
    assert first.table == {str(r): (GEMM if r < 8 else WEIGHT_MAJOR) for r in ROW_GRID}
    n = len(passes)
    again = RowKernels.measured(run, ident, cache_dir=tmp_path, reps=3)
    assert len(passes) == n and again.table == first.table  # read, not measured
    (path,) = (tmp_path / "row_kernels").glob("*.json")
    path.write_text("{not json")
    RowKernels.measured(run, ident, cache_dir=tmp_path, reps=3)
    assert len(passes) == 2 * n and json.loads(path.read_text())["table"] == first.table
    RowKernels.measured(run, {**ident, "target": "other"}, cache_dir=tmp_path, reps=3)
    assert len(passes) == 3 * n  # another target: its own entry
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    RowKernels.measured(run, ident, cache_dir=tmp_path, reps=3)
    assert len(passes) == 4 * n  # another thread count: another machine setting


def test_target_measures_on_first_use_and_forced_modes_do_not(monkeypatch, tmp_path):
    from draftlab.targets.tiny import tiny_random_target

    monkeypatch.setattr("draftlab.targets.hf.cache_root", lambda: tmp_path / "cache")
    auto = tiny_random_target(row_kernels="auto")
    assert auto.row_kernels.mode == "table" and set(auto.row_kernels.table) == {str(r) for r in ROW_GRID}
    assert list((tmp_path / "cache" / "row_kernels").glob("*.json"))
    monkeypatch.setattr(row_kernels, "measure", lambda *a, **k: pytest.fail("measured"))
    assert tiny_random_target(row_kernels=GEMM).row_kernels.mode == GEMM
    assert tiny_random_target(row_kernels="auto").row_kernels.table == auto.row_kernels.table  # the cached table
    with pytest.raises(ValueError, match="row_kernels"):
        tiny_random_target(row_kernels="fastest")


def test_target_outputs_agree_across_kernels(tiny_target):
    """A verify-sized pass gives the same logits whichever product the target uses (to float rounding)."""
    ids = torch.arange(1, 25)[None] % tiny_target.geometry.vocab_size  # [1, 24]
    outs = {}
    saved = tiny_target._row_kernels
    try:
        for mode in (GEMM, WEIGHT_MAJOR):
            tiny_target._row_kernels = RowKernels(mode)
            outs[mode] = tiny_target.forward(ids).logits
    finally:
        tiny_target._row_kernels = saved
    torch.testing.assert_close(outs[GEMM], outs[WEIGHT_MAJOR], rtol=1e-4, atol=1e-4)
