from __future__ import annotations

import json

import pytest

from draftlab.data import (
    Conversation,
    DataError,
    load_conversations,
    load_gsm8k,
    load_hf_dataset,
    load_role_content_jsonl,
    load_sharegpt,
    normalize,
)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def sharegpt_row(id_, *turns):
    return {"id": id_, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_data_error_formats_location():
    err = DataError("unknown role 'x'", file="a.jsonl", line=3, field="conversations[1].from")
    assert str(err) == "a.jsonl:3: field 'conversations[1].from': unknown role 'x'"
    assert (err.file, err.line, err.field, err.message) == (
        "a.jsonl",
        3,
        "conversations[1].from",
        "unknown role 'x'",
    )
    assert isinstance(err, ValueError)
    assert str(DataError("no conversations", file="b.json")) == "b.json: no conversations"
    assert str(DataError("bad", file="c.json", record=4)) == "c.json: record 4: bad"


def test_load_sharegpt_jsonl_maps_roles(tmp_path):
    path = write_jsonl(
        tmp_path / "sg.jsonl",
        [
            sharegpt_row(
                "a", ("system", "S"), ("human", "Q"), ("gpt", "A"), ("user", "Q2"), ("chatgpt", "A2")
            ),
            "",  # blank lines are tolerated
            sharegpt_row(
                "b", ("human", "Q"), ("bing", "A"), ("function", "F"), ("Model", "A3"), ("observation", "O")
            ),
            {"conversations": [{"from": "human", "value": None}, {"from": "bard", "value": "A"}]},
        ],
    )
    convs = load_sharegpt(path)
    assert [c.id for c in convs] == ["a", "b", "sg-4"]  # missing id -> <stem>-<line>
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in convs[1].messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert convs[2].messages[0] == {"role": "user", "content": ""}


def test_load_sharegpt_json_array(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([sharegpt_row(1, ("human", "Q"), ("gpt", "A"))]))
    (conv,) = load_sharegpt(path)
    assert conv == Conversation(
        "1", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    )


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl", [sharegpt_row("a", ("human", "Q")), sharegpt_row("b"), '{"id": "c", ']
    )
    with pytest.raises(DataError) as exc:
        load_sharegpt(path)
    assert exc.value.file == str(path) and exc.value.line == 3
    assert str(exc.value).startswith(f"{path}:3: malformed JSON")


def test_unknown_role_names_field_and_line(tmp_path):
    turns = [("human", "Q"), ("gpt", "A"), ("human", "Q"), ("wizard", "A")]
    path = write_jsonl(
        tmp_path / "roles.jsonl", [sharegpt_row("a", ("human", "Q")), sharegpt_row("b", *turns)]
    )
    with pytest.raises(DataError) as exc:
        load_sharegpt(path)
    assert (exc.value.line, exc.value.field) == (2, "conversations[3].from")
    assert "wizard" in str(exc.value) and f"{path}:2: field 'conversations[3].from'" in str(exc.value)


def test_unknown_role_in_json_array_names_record(tmp_path):
    path = tmp_path / "roles.json"
    path.write_text(json.dumps([sharegpt_row("a", ("human", "Q")), sharegpt_row("b", ("robot", "A"))]))
    with pytest.raises(DataError) as exc:
        load_sharegpt(path)
    assert (exc.value.record, exc.value.line, exc.value.field) == (1, None, "conversations[0].from")


@pytest.mark.parametrize(
    "row, field",
    [
        ({"id": "x"}, "conversations"),
        ({"id": "x", "conversations": "hi"}, "conversations"),
        ({"id": "x", "conversations": [{"value": "Q"}]}, "conversations[0].from"),
        ({"id": "x", "conversations": [{"from": "human", "value": 3}]}, "conversations[0].value"),
    ],
)
def test_bad_fields(tmp_path, row, field):
    path = write_jsonl(tmp_path / "f.jsonl", [row])
    with pytest.raises(DataError) as exc:
        load_sharegpt(path)
    assert exc.value.field == field and exc.value.line == 1


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match="no conversations"):
        load_conversations(path)


def test_role_content_jsonl_accepts_messages_key(tmp_path):
    path = write_jsonl(
        tmp_path / "rc.jsonl",
        [
            {
                "id": "a",
                "conversations": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
            },
            {"id": "b", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]},
        ],
    )
    convs = load_role_content_jsonl(path)
    assert [len(c.messages) for c in convs] == [2, 2]
    assert convs[1].messages[0] == {"role": "system", "content": "S"}
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"id": "a", "messages": [{"role": "narrator", "content": "x"}]}]
    )
    with pytest.raises(DataError) as exc:
        load_role_content_jsonl(bad)
    assert exc.value.field == "messages[0].role"


def test_load_conversations_auto_detects(tmp_path):
    sg = write_jsonl(tmp_path / "sg.jsonl", [sharegpt_row("a", ("human", "Q"), ("gpt", "A"))])
    rc = write_jsonl(
        tmp_path / "rc.jsonl", [{"id": "a", "conversations": [{"role": "user", "content": "Q"}]}]
    )
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"}])
    assert load_conversations(sg)[0].messages[1]["role"] == "assistant"
    assert load_conversations(rc)[0].messages[0]["role"] == "user"
    assert load_conversations(gsm)[0].messages[1]["content"] == "1+1=2\n#### 2"
    assert load_conversations(sg, format="sharegpt")[0].id == "a"
    with pytest.raises(DataError, match="unknown format"):
        load_conversations(sg, format="csv")


def test_load_hf_dataset_local_json(tmp_path):
    rows = [
        {"id": "a", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Q2"}]},
    ]
    path = write_jsonl(tmp_path / "hf.jsonl", rows)
    convs = load_hf_dataset("json", data_files=str(path), cache_dir=str(tmp_path / "cache"))
    assert [c.id for c in convs] == ["a", "b"]
    assert convs[0].messages == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    # A path is enough: the builder follows the suffix. Role/content turns under "messages" are detected.
    rc = write_jsonl(
        tmp_path / "rc.jsonl", [{"prompt_id": "p1", "messages": [{"role": "user", "content": "Q"}]}]
    )
    (conv,) = load_conversations(rc, format="hf", cache_dir=str(tmp_path / "cache"))
    assert conv.id == "p1" and conv.messages == [{"role": "user", "content": "Q"}]


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def S(text):
    return {"role": "system", "content": text}


def test_normalize_rules():
    convs = [
        Conversation("empty", []),
        Conversation("blank", [U("  "), A("")]),
        Conversation("ok", [U("q"), A("a")]),
        Conversation("cont", [A("tail of an answer"), U("q"), A("a")]),
        Conversation("sys-cont", [S("s"), A("x"), {"role": "tool", "content": "t"}, U("q"), A("a")]),
        Conversation("merge", [U("q1"), U("q2"), A("a1"), A("a2"), U("dangling")]),
        Conversation("no-pair", [U("only a question")]),
        Conversation("only-assistant", [A("a")]),
    ]
    kept, report = normalize(convs)
    by_id = {c.id: c.messages for c in kept}
    assert list(by_id) == ["ok", "cont", "sys-cont", "merge"]
    assert by_id["cont"] == [U("q"), A("a")]
    assert by_id["sys-cont"] == [S("s"), U("q"), A("a")]
    assert by_id["merge"] == [U("q1\n\nq2"), A("a1\n\na2")]
    assert report.input == 8 and report.kept == 4
    assert (report.dropped_empty, report.dropped_no_pair, report.dropped_short) == (2, 2, 0)
    assert (report.reanchored, report.removed_leading_turns) == (3, 4)  # only-assistant counts too
    assert (report.merged_turns, report.trimmed_trailing_turns, report.removed_empty_turns) == (2, 1, 2)
    assert report.input == report.kept + report.dropped
    assert str(report).startswith("normalize: kept 4/8 conversations (")
    assert convs[5].messages[0] == U("q1")  # inputs are not modified


def test_normalize_system_prompt_and_min_turns():
    convs = [
        Conversation("a", [S("old"), U("q"), A("a")]),
        Conversation("b", [U("q"), A("a"), U("q"), A("a")]),
    ]
    kept, report = normalize(convs, system_prompt="new")
    assert kept[0].messages[0] == S("old") and kept[1].messages[0] == S("new") and report.added_system == 1
    kept, report = normalize(convs, system_prompt="new", drop_system=True)
    assert [c.messages[0] for c in kept] == [S("new"), S("new")] and report.removed_system == 1
    kept, report = normalize(convs, drop_system=True, min_turns=2)
    assert [c.id for c in kept] == ["b"] and report.dropped_short == 1 and kept[0].messages[0] == U("q")


def test_real_sharegpt_counts(shared_data):
    convs = load_conversations(shared_data / "conversations" / "sharegpt_v3_first5000.jsonl")
    assert len(convs) == 5000
    assert sum(not c.messages for c in convs) == 33  # as the data README says
    kept, report = normalize(convs)
    assert report.dropped_empty == 33 and report.input == report.kept + report.dropped
    assert all(
        c.messages[0]["role"] in ("system", "user") and c.messages[-1]["role"] == "assistant" for c in kept
    )
    assert all(a["role"] != b["role"] for c in kept for a, b in zip(c.messages, c.messages[1:]))
    # The ml-energy file holds prompts only (single human turns): nothing to train on.
    prompts = load_conversations(shared_data / "conversations" / "mlenergy_ShareGPT_V3_filtered_500.json")
    assert len(prompts) == 500 and normalize(prompts)[1].dropped_no_pair == 500


def test_gsm8k(shared_data):
    convs = load_gsm8k(shared_data / "gsm8k" / "train.jsonl")
    assert len(convs) == 7473
    first = convs[0]
    assert first.id == "gsm8k-1" and [m["role"] for m in first.messages] == ["user", "assistant"]
    assert "<<" not in first.messages[1]["content"] and first.messages[1]["content"].endswith("#### 72")
    raw = load_gsm8k(shared_data / "gsm8k" / "train.jsonl", strip_annotations=False)[0]
    assert "<<48/2=24>>" in raw.messages[1]["content"]


def test_gsm8k_bad_row(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "a"}, {"question": "q"}])
    with pytest.raises(DataError) as exc:
        load_gsm8k(path)
    assert (exc.value.line, exc.value.field) == (2, "answer")
