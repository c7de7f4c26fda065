"""``draftlab-table --layout served``: one row per run and chain length, nothing pooled."""

from __future__ import annotations

import pytest

from analysis.table import main
from tests.analysis.synthetic import make_record, write_sweep


def _chain(k: int, served_tau: float, draftlab_tau: float, *, flagged: bool = False) -> dict:
    return {"n_prompts": 13, "num_speculative_tokens": k, "engine": "vllm",
            "served": {"tau": served_tau}, "draftlab": {"tau": draftlab_tau},
            "parity": {"gap": served_tau - draftlab_tau, "ci": [served_tau - draftlab_tau - 0.01,
                                                                served_tau - draftlab_tau + 0.01], "flagged": flagged},
            "identical_to_plain": 13, "same_tokens_as_draftlab": 12,
            "speed": {"served_speedup": 0.9 + k / 100, "draftlab_speedup": 0.5}}


def _served_record(label: str, chains: list[dict]) -> dict:
    rec = make_record(label=label, nodes=None)
    rec["eval"] = {"bench": "specbench", "method": "eagle3", "label": label, "temperature": 0.0,
                   "axes": {"nodes": 60}, "served": chains}
    return rec


def test_served_layout_has_a_row_per_chain(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s", [_served_record("EAGLE-3", [_chain(3, 1.5, 1.5), _chain(1, 1.3, 1.31)]),
                                         _served_record("DFlash", [_chain(2, 1.1, 1.4, flagged=True)])])
    assert main([str(sweep), "--layout", "served"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| EAGLE") or
            line.startswith("| DFlash")]
    assert len(rows) == 3
    assert [r.split(" | ")[4] for r in rows] == ["1", "3", "2"]  # chains in order within a run
    assert "1.30 | 1.31" in rows[0] and "13/13 | 12/13 | 0.91 | 0.50" in rows[0]
    assert rows[2].count("GAP") == 1 and "GAP" not in rows[0]


def _sampled(k: int, temperature: float, served_tau: float, draftlab_tau: float, verdict: str = "agree") -> dict:
    return {"temperature": temperature, "seeds": [0, 1, 2], "num_speculative_tokens": k, "n_prompts": 13,
            "served": {"tau": served_tau}, "draftlab": {"tau": draftlab_tau}, "verdict": verdict}


def test_served_layout_shows_the_chain_sampled_at_t1(tmp_path, capsys):
    rec = _served_record("EAGLE-3", [_chain(3, 1.5, 1.5), _chain(1, 1.3, 1.31)])
    rec["eval"]["served_sampled"] = [_sampled(3, 1.0, 1.62, 1.35, "differ"), _sampled(1, 0.7, 1.2, 1.2),
                                     _sampled(1, 1.0, 1.25, 1.24)]
    sweep = write_sweep(tmp_path / "s", [rec, _served_record("DFlash", [_chain(2, 1.1, 1.1)])])
    assert main([str(sweep), "--layout", "served"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("| T=1 τ served / draftlab |")
    cells = {(r.split(" | ")[0], r.split(" | ")[4]): r.split(" | ")[-1] for r in out[2:]}
    assert cells[("| EAGLE-3", "3")] == "1.62 / 1.35 differ |"
    assert cells[("| EAGLE-3", "1")] == "1.25 / 1.24 agree |"  # the T = 1 entry, not the T = 0.7 one
    assert cells[("| DFlash", "2")] == "– |"  # a run that sampled nothing


def test_served_records_point_the_default_layout_to_served(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s", [_served_record("EAGLE-3", [_chain(3, 1.5, 1.5)])])
    assert main([str(sweep)]) == 2
    assert "--layout served" in capsys.readouterr().err
    plain = write_sweep(tmp_path / "p", [make_record(label="EAGLE-3")])
    with pytest.raises(SystemExit):
        main([str(plain), "--layout", "nonsense"])
    assert main([str(plain), "--layout", "served"]) == 2
    assert "no served evaluation" in capsys.readouterr().err
