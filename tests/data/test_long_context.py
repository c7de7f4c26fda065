"""The long-context bench: the shared files load, prompts fit the budget as the engine renders them."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from draftlab.data.errors import DataError
from draftlab.data.long_context import (
    CUT_MARKER,
    LongContextBench,
    prompt_tokens,
    reference_found,
    truncate_middle,
)
from draftlab.data.template import render_prompt
from draftlab.utils.errors import ConfigError


def _bench(shared_data, **kw) -> LongContextBench:
    d = shared_data / "long_context"
    sources = [{"path": str(d / "leval_16k40k.jsonl"), "fit": "truncate"},
               {"path": str(d / "leval_long.jsonl"), "fit": "truncate"},
               {"path": str(d / "niah_pg.jsonl"), "fit": "drop"}]
    return LongContextBench(sources=sources, **kw)


def _row(**kw) -> dict:
    row = {"id": "niah-a", "question_id": 1, "category": "niah_16k", "turns": ["find 1234567"], "reference": "1234567"}
    row.update(kw)
    return row


def _write(tmp_path, rows, name="lc.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_shared_files_load_with_unique_string_ids(shared_data):
    qs = _bench(shared_data).load()  # no tokenizer: nothing fitted or dropped
    assert len(qs) == 132 + 13 + 26
    assert len({q.question_id for q in qs}) == len(qs) and all(isinstance(q.question_id, str) for q in qs)
    counts = Counter(q.category for q in qs)
    assert counts["niah_16k"] == 5 and counts["gov_report_summ"] == 11
    assert all(len(q.turns) == 1 and q.reference for q in qs)


@pytest.fixture(scope="module")
def fitted(shared_data, smollm2_tokenizer):
    bench = _bench(shared_data)
    return bench.load(tokenizer=smollm2_tokenizer), {q.question_id: q for q in bench.load()}


def test_fitted_prompts_fit_the_budget_as_rendered(fitted, smollm2_tokenizer):
    qs, raw = fitted
    cut = [q for q in qs if q.turns[0] != raw[q.question_id].turns[0]]
    assert cut and all(not q.category.startswith("niah") for q in cut)  # NIAH is never cut, only dropped
    # Uncut prompts were measured by this same rendering; the cut ones are re-measured as the engine sees them.
    for q in cut:
        ids = render_prompt(smollm2_tokenizer, [{"role": "user", "content": q.turns[0]}])
        assert 7936 - 8 <= len(ids) <= 7936, q.question_id  # fits, and is cut no more than needed
    # leval_long (40k+ characters) is over 8k tokens: every one of its prompts is cut, none dropped.
    assert {q.question_id for q in qs if q.question_id.startswith("leval-")} == \
        {i for i in raw if i.startswith("leval-")}
    for q in cut:
        text, original = q.turns[0], raw[q.question_id].turns[0]
        head, tail = text.split(CUT_MARKER)
        # The head holds the instruction, the tail the question; both are the original's own text.
        assert original.startswith(head) and original.endswith(tail)
        assert head.startswith("Now you are given a very long document") and "Instruction:" in tail


def test_niah_over_the_budget_is_dropped(fitted, smollm2_tokenizer):
    qs, raw = fitted
    kept = {q.question_id for q in qs}
    niah = [i for i in raw if i.startswith("niah-")]
    dropped = [i for i in niah if i not in kept]
    assert dropped and len(dropped) < len(niah)
    assert all(prompt_tokens(smollm2_tokenizer, raw[i].turns[0]) > 7936 for i in dropped)
    assert all(qs_q.turns == raw[qs_q.question_id].turns for qs_q in qs if qs_q.question_id.startswith("niah-"))


def test_selection_after_fitting_and_scored_patterns(tmp_path, smollm2_tokenizer):
    long = "word " * 400
    rows = [_row(id=f"n{i}", turns=[f"needle {i}. " + long]) for i in range(3)]
    rows += [_row(id=f"s{i}", category="news_summ", turns=["Summarise. " + long + " Question?"], reference="x")
             for i in range(3)]
    bench = LongContextBench(sources=[{"path": str(_write(tmp_path, rows)), "fit": "drop"}],
                             max_prompt_tokens=200, per_category=2)
    with pytest.raises(DataError, match="no prompt fits"):  # every prompt is over 200 tokens and dropped
        bench.load(tokenizer=smollm2_tokenizer)
    bench = LongContextBench(sources=[{"path": str(_write(tmp_path, rows)), "fit": "truncate"}],
                             max_prompt_tokens=200, per_category=2, categories=["news_summ"])
    qs = bench.load(tokenizer=smollm2_tokenizer)
    assert [q.question_id for q in qs] == ["s0", "s1"]
    assert all(prompt_tokens(smollm2_tokenizer, q.turns[0]) <= 200 for q in qs)
    assert bench.scored("niah_16k") and bench.scored("niah_128k") and not bench.scored("news_summ")
    assert LongContextBench(sources=bench.sources, score_categories=["*_summ"]).scored("news_summ")


def test_truncate_middle_keeps_both_ends(smollm2_tokenizer):
    text = "INSTRUCTION first. " + " ".join(f"w{i}" for i in range(2000)) + " QUESTION last?"
    cut = truncate_middle(smollm2_tokenizer, text, 100)
    assert cut.startswith("INSTRUCTION first.") and cut.endswith("QUESTION last?") and CUT_MARKER in cut
    assert 95 <= prompt_tokens(smollm2_tokenizer, cut) <= 100
    with pytest.raises(DataError, match="chat template alone"):
        truncate_middle(smollm2_tokenizer, text, 5)


@pytest.mark.parametrize(
    "row, field",
    [
        (_row(id=3), "id"),
        (_row(category=None), "category"),
        (_row(turns=["a", "b"]), "turns"),
        (_row(turns=[7]), "turns[0]"),
        (_row(reference=["1", 2]), "reference[1]"),
        (_row(reference=None), "reference"),  # a scored (niah_*) category needs one
        (_row(id="first"), "id"),  # the id of line 1 again
        ('{"id": "x", ', None),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path, row, field):
    path = _write(tmp_path, [_row(id="first"), row])
    with pytest.raises(DataError) as exc:
        LongContextBench(sources=[{"path": str(path)}]).load()
    assert exc.value.file == str(path) and exc.value.line == 2 and exc.value.field == field


def test_bad_config_is_a_config_error(tmp_path):
    path = str(_write(tmp_path, [_row()]))
    with pytest.raises(ConfigError, match=r"bench.sources\[0\].fit"):
        LongContextBench(sources=[{"path": path, "fit": "cut"}])
    with pytest.raises(ConfigError, match="bench.sources"):
        LongContextBench(sources=[])
    with pytest.raises(ConfigError, match="bench.max_prompt_tokens"):
        LongContextBench(sources=[{"path": path}], max_prompt_tokens=0)
    with pytest.raises(DataError, match="file not found"):
        LongContextBench(sources=[{"path": str(tmp_path / "missing.jsonl")}]).load()


def test_reference_found():
    assert reference_found("The number is 5614226.", "5614226")
    assert reference_found("The number is 5614226.", "5614226\n")
    assert not reference_found("The number is 561422.", "5614226")
    assert reference_found("it was blue", ["red", "blue"])
    assert not reference_found("it was green", ["red", "blue"])
    with pytest.raises(ValueError):
        reference_found("x", [])
