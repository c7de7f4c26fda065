"""SPEED-Bench from a local copy: synthetic files in the dataset's layout (hub parquet per config folder,
NVIDIA's prepared parquet, JSONL with turns or messages), split and category selection, placeholder rows,
the absent-data error, malformed rows named by file, line / record and field, and ``bench=speedbench`` composed
from the real ``conf/``."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from draftlab.data.errors import DataError
from draftlab.data.speed_bench import PLACEHOLDER, SpeedBench
from draftlab.utils.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
QUALITATIVE = ("coding", "math", "multilingual")
TIERS = ("low_entropy", "mixed", "high_entropy")


def _row(qid: str, category: str, turns: list[str], **extra) -> dict:
    # every column of the hub dataset, as its dataset_info declares them
    return {"question_id": qid, "category": category, "sub_category": "", "turns": turns, "source": "synthetic",
            "src_id": qid, "difficulty": "easy", "multiturn": len(turns) > 1} | extra


def _qualitative_rows() -> list[dict]:
    rows = []
    for c in QUALITATIVE:
        for i in range(3):
            turns = [f"{c} question {i}"] + ([f"{c} follow-up {i}"] if i == 0 else [])
            rows.append(_row(f"{c}{i:030d}", c, turns))
    return rows


def _throughput_rows(size: str) -> list[dict]:
    return [_row(f"{size}-{t}-{i}", t, [f"{t} prompt {i} " * 4]) for t in TIERS for i in range(2)]


def _parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _jsonl(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def hub_copy(tmp_path) -> Path:
    """The layout ``huggingface-cli download nvidia/SPEED-Bench --local-dir`` leaves: one folder per config."""
    root = tmp_path / "speed_bench"
    _parquet(root / "qualitative" / "test-00000-of-00001.parquet", _qualitative_rows())
    _parquet(root / "throughput_1k" / "test-00000-of-00001.parquet", _throughput_rows("1k"))
    _parquet(root / "throughput_8k" / "test-00000-of-00001.parquet", _throughput_rows("8k"))
    (root / "README.md").write_text("dataset card\n")
    return root


def test_qualitative_split_loads_every_turn(hub_copy):
    qs = SpeedBench(path=str(hub_copy)).load()
    assert [q.category for q in qs] == [c for c in QUALITATIVE for _ in range(3)]
    first = qs[0]
    assert first.question_id == "coding" + "0" * 30 and first.turns == ["coding question 0", "coding follow-up 0"]
    assert qs[1].turns == ["coding question 1"] and first.reference is None


def test_split_categories_per_category_and_limit(hub_copy):
    qs = SpeedBench(path=str(hub_copy), split="throughput_8k", categories=["mixed", "low_entropy"]).load()
    assert {q.category for q in qs} == {"mixed", "low_entropy"} and len(qs) == 4
    assert all(str(q.question_id).startswith("8k-") for q in qs)
    qs = SpeedBench(path=str(hub_copy), per_category=1).load()
    assert [q.category for q in qs] == list(QUALITATIVE)
    assert len(SpeedBench(path=str(hub_copy), split="throughput_1k", limit=2).load()) == 2
    with pytest.raises(DataError, match="unknown categories"):
        SpeedBench(path=str(hub_copy), categories=["mixed"]).load()  # a throughput tier, not a qualitative one


def test_a_split_that_is_not_there_names_the_present_ones(hub_copy):
    with pytest.raises(DataError) as err:
        SpeedBench(path=str(hub_copy), split="throughput_32k").load()
    message = str(err.value)
    assert err.value.file == str(hub_copy) and "'throughput_32k'" in message
    assert "present: qualitative, throughput_1k, throughput_8k" in message


def test_unknown_split_and_option_are_config_errors(hub_copy):
    with pytest.raises(ConfigError, match="throughput_4k") as err:
        SpeedBench(path=str(hub_copy), split="throughput_4k")
    assert err.value.field == "bench.split"
    with pytest.raises(ConfigError) as err:
        SpeedBench(path=str(hub_copy), unresolved="fill")
    assert err.value.field == "bench.unresolved"


def test_absent_copy_says_where_and_how_to_get_it(tmp_path):
    missing = tmp_path / "nowhere" / "speed_bench"
    with pytest.raises(DataError) as err:
        SpeedBench(path=str(missing)).load()
    message = str(err.value)
    assert err.value.file == str(missing)
    assert f"huggingface-cli download nvidia/SPEED-Bench --repo-type dataset --local-dir {missing}" in message
    assert "bench.path" in message


def test_prepared_and_jsonl_layouts(tmp_path):
    # NVIDIA's prepare_data.py: <output_dir>/speed/<config>/test.parquet
    prepared = tmp_path / "data" / "speed"
    _parquet(prepared / "qualitative" / "test.parquet", _qualitative_rows())
    assert len(SpeedBench(path=str(prepared)).load()) == 9
    # one JSONL per split beside each other; AIPerf's rows carry messages instead of turns
    flat = tmp_path / "flat"
    rows = [{"question_id": "a" * 32, "category": "mixed",
             "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one"},
                          {"role": "assistant", "content": "ignored"}, {"role": "user", "content": "two"}]},
            _row("b" * 32, "high_entropy", ["three"])]
    _jsonl(flat / "throughput_2k.jsonl", rows)
    qs = SpeedBench(path=str(flat), split="throughput_2k").load()
    assert [q.turns for q in qs] == [["one", "two"], ["three"]]


def test_placeholder_rows_fail_by_default_or_are_left_out(hub_copy):
    rows = _qualitative_rows()
    rows[4]["turns"] = [f"{PLACEHOLDER}\n\nSolve: {{question}}"]
    path = hub_copy / "qualitative" / "test-00000-of-00001.parquet"
    _parquet(path, rows)
    with pytest.raises(DataError) as err:
        SpeedBench(path=str(hub_copy)).load()
    assert (err.value.file, err.value.record, err.value.field) == (str(path), 4, "turns")
    assert "prepare_data.py" in str(err.value) and "bench.unresolved=skip" in str(err.value)
    qs = SpeedBench(path=str(hub_copy), unresolved="skip").load()
    assert len(qs) == 8 and rows[4]["question_id"] not in {q.question_id for q in qs}
    _parquet(path, [_row("x", "math", [PLACEHOLDER])])
    with pytest.raises(DataError, match="no usable questions.*1 placeholder"):
        SpeedBench(path=str(hub_copy), unresolved="skip").load()


@pytest.mark.parametrize("row, field", [
    ({"category": "math", "turns": ["q"]}, "question_id"),
    ({"question_id": True, "category": "math", "turns": ["q"]}, "question_id"),
    ({"question_id": "q1", "turns": ["q"]}, "category"),
    ({"question_id": "q1", "category": "math"}, "turns"),
    ({"question_id": "q1", "category": "math", "turns": []}, "turns"),
    ({"question_id": "q1", "category": "math", "turns": ["ok", 3]}, "turns[1]"),
    ({"question_id": "q1", "category": "math", "turns": ["   "]}, "turns[0]"),
    ({"question_id": "q1", "category": "math", "messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({"question_id": "q1", "category": "math", "messages": [{"content": "hi"}]}, "messages[0]"),
    ({"question_id": "q1", "category": "math", "messages": [{"role": "assistant", "content": "hi"}]}, "messages"),
])
def test_malformed_jsonl_rows_name_file_line_and_field(tmp_path, row, field):
    path = tmp_path / "qualitative" / "test.jsonl"
    _jsonl(path, [_row("fine", "math", ["q"]), row])
    with pytest.raises(DataError) as err:
        SpeedBench(path=str(tmp_path)).load()
    assert (err.value.file, err.value.line, err.value.field) == (str(path), 2, field)


def test_malformed_json_and_duplicate_ids(tmp_path):
    path = tmp_path / "qualitative" / "test.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_row("a", "math", ["q"])) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(DataError, match="malformed JSON") as err:
        SpeedBench(path=str(tmp_path)).load()
    assert err.value.line == 2
    _jsonl(path, [_row("a", "math", ["q"]), _row("a", "coding", ["r"])])
    with pytest.raises(DataError, match=r"already used at .*test.jsonl:1") as err:
        SpeedBench(path=str(tmp_path)).load()
    assert (err.value.line, err.value.field) == (2, "question_id")


def test_malformed_parquet_row_names_its_record(tmp_path):
    path = tmp_path / "qualitative" / "test-00000-of-00001.parquet"
    _parquet(path, [_row("a", "math", ["q"]), _row("b", "", ["r"])])
    with pytest.raises(DataError) as err:
        SpeedBench(path=str(tmp_path)).load()
    assert (err.value.file, err.value.record, err.value.field) == (str(path), 1, "category")
    assert str(err.value).startswith(f"{path}: record 1: field 'category'")


def _compose_bench(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=["bench=speedbench", *overrides])
    GlobalHydra.instance().clear()
    return cfg


def test_bench_speedbench_composes_with_the_real_conf(hub_copy, monkeypatch):
    cfg = _compose_bench([])
    assert cfg.bench.path.endswith("/speed_bench") and cfg.bench.split == "qualitative"
    assert OmegaConf.to_container(cfg.bench, resolve=True)["name"] == "speedbench_qualitative"
    monkeypatch.setenv("DRAFTLAB_SHARED_DATA", str(hub_copy.parent))  # the default path, pointed at the copy
    bench = instantiate(_compose_bench([]).bench, _convert_="object")
    assert isinstance(bench, SpeedBench) and len(bench.load()) == 9
    cfg = _compose_bench([f"bench.path={hub_copy}", "bench.split=throughput_1k", "bench.categories=[mixed]",
                          "bench.per_category=1"])
    bench = instantiate(cfg.bench, _convert_="object")
    assert bench.name == "speedbench_throughput_1k"
    assert [q.category for q in bench.load()] == ["mixed"]
