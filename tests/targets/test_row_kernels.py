"""The small-row matmul choice: measured per machine, cached, and numerically the same product."""

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


def test_table_picks_per_shape_and_row_count():
    table = {"96x40": {str(r): (WEIGHT_MAJOR if r <= 8 else GEMM) for r in ROW_GRID}}
    k = RowKernels("table", table)
    w, other = torch.zeros(96, 40), torch.zeros(40, 96)
    assert k.pick(w, 1) == GEMM  # one row: always the GEMV
    assert k.pick(w, 2) == k.pick(w, 8) == WEIGHT_MAJOR
    assert k.pick(w, 10) == WEIGHT_MAJOR  # between grid points: the largest measured count below
    assert k.pick(w, 12) == GEMM and k.pick(w, 1000) == GEMM
    assert k.pick(other, 4) == GEMM  # an unmeasured shape
    assert "96x40" in k.describe()


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


def test_auto_measures_once_per_machine_and_reuses_the_cache(tmp_path, monkeypatch):
    measured = []
    real = row_kernels.measure

    def counting(shapes, dtype, **kw):
        measured.append(shapes)
        return real(shapes, dtype, rows=ROW_GRID, budget_s=1e-4)

    monkeypatch.setattr(row_kernels, "measure", counting)
    weights = [torch.randn(64, 32), torch.randn(32, 64), torch.randn(64, 32)]
    first = RowKernels.for_weights("auto", weights, cache_dir=tmp_path)
    again = RowKernels.for_weights("auto", weights, cache_dir=tmp_path)
    assert len(measured) == 1 and measured[0] == [(32, 64), (64, 32)]
    assert first.table == again.table and set(first.table) == {"32x64", "64x32"}
    assert all(c in (GEMM, WEIGHT_MAJOR) for choice in first.table.values() for c in choice.values())
    # A corrupt cache file is measured again and rewritten, not trusted.
    (path,) = (tmp_path / "row_kernels").glob("*.json")
    path.write_text("{not json")
    RowKernels.for_weights("auto", weights, cache_dir=tmp_path)
    assert len(measured) == 2 and set(json.loads(path.read_text())["table"]) == {"32x64", "64x32"}
    # Another thread count is another machine setting: its own entry.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    RowKernels.for_weights("auto", weights, cache_dir=tmp_path)
    assert len(measured) == 3


def test_forced_modes_do_not_measure(monkeypatch):
    monkeypatch.setattr(row_kernels, "measure", lambda *a, **k: pytest.fail("measured"))
    assert RowKernels.for_weights(GEMM, [torch.zeros(4, 4)]).mode == GEMM
    assert RowKernels.for_weights(WEIGHT_MAJOR, [torch.zeros(4, 4)]).mode == WEIGHT_MAJOR
    with pytest.raises(ValueError, match="row kernel mode"):
        RowKernels.for_weights("fastest", [torch.zeros(4, 4)])


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
