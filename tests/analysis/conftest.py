"""Synthetic sweeps for the table and report tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.analysis.synthetic import columns, make_record, write_sweep


@pytest.fixture
def main_sweep(tmp_path) -> Path:
    """Table 1 layout: EAGLE-3 and ConFu at (30, 0.0), (30, 0.7), and ConFu alone at (60, 0.0)."""
    recs = [
        # two EAGLE-3 runs of one setting: averaged, τ (2.9 + 3.1)/2 = 3.0, SR (1.4 + 1.6)/2 = 1.5
        make_record(label="EAGLE-3", temperature=0.0, cols=columns(2.9, 1.4, override={("CODE", "tau"): 5.5})),
        make_record(label="ConFu", temperature=0.0, cols=columns(3.4, 1.7)),
        make_record(label="EAGLE-3", temperature=0.0, cols=columns(3.1, 1.6, override={("CODE", "tau"): 5.5})),
        make_record(label="EAGLE-3", temperature=0.7, cols=columns(2.8, 1.3, override={("HUM", "speedup"): 2.0})),
        # RAG missing; STEM τ ties with EAGLE-3's (3.2 = 2.8 + 0.4) once printed
        make_record(label="ConFu", temperature=0.7, cols=columns(3.2, 1.5, skip=("RAG",),
                                                                 override={("STEM", "tau"): 3.2})),
        make_record(label="ConFu", nodes=60, temperature=0.0, cols=columns(3.6, 1.8)),
        make_record(label="ConFu", kind="train", history=[{"step": 0, "train/loss": 2.0}]),
    ]
    root = write_sweep(tmp_path / "main", recs)
    (root / "6" / "notes").mkdir()
    (root / "6" / "notes" / "record.json").write_text(json.dumps({"something": "else"}))
    return root


@pytest.fixture
def ablation_sweep(tmp_path) -> Path:
    recs = []
    for t in (0.0, 0.7):
        for label, tau0, sr0 in (("EAGLE-3", 3.0, 1.5), ("ConFu", 3.4, 1.7), ("-MoE", 3.3, 1.7),
                                 ("-MoE & Replicate", 3.2, 1.6)):
            recs.append(make_record(label=label, temperature=t, cols=columns(tau0 - t, sr0 - t / 2)))
    return write_sweep(tmp_path / "ablation", recs)


@pytest.fixture
def length_sweep(tmp_path) -> Path:
    recs = []
    for t in (0.0, 0.7):
        for length, tau0 in ((4, 3.3), (7, 3.4), (10, 3.35)):
            recs.append(make_record(label="ConFu", temperature=t, ttt_length=length,
                                    cols=columns(tau0 - t, 1.7, override={("AVG", "tau"): 4.0})))
    return write_sweep(tmp_path / "lengths", recs)
