"""Dataset loading: MarsRL's AIME 2025 file, other formats, and bad rows with line numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marsrl_core.agents.problems import DatasetError, load_problems
from marsrl_core.agents.rewards import answers_match

AIME = Path(__file__).parents[2] / "shared" / "data" / "aime2025.jsonl"
LOCAL_AIME = Path(__file__).with_name("data") / "aime2025.jsonl"


def _aime() -> Path:
    return AIME if AIME.exists() else LOCAL_AIME


def test_aime_loads_and_answers_check_against_themselves():
    loaded = load_problems(_aime())
    assert len(loaded.problems) == 30 and not loaded.rejected
    assert all(answers_match(p.answer, p.answer) for p in loaded.problems)
    by_answer = {p.answer for p in loaded.problems}
    assert "336^\\circ" in by_answer
    # Equivalent forms check as correct, a different number does not.
    assert answers_match("336", "336^\\circ") and answers_match("\\boxed{204}", "204")
    assert answers_match("204.0", "204") and not answers_match("205", "204")


def test_bad_rows_are_rejected_with_line_numbers_and_good_rows_load(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"query": "1+1", "ans_box": "2"}).encode(),
        b"{not json",
        json.dumps({"query": "no answer"}).encode(),
        json.dumps({"query": "  ", "ans_box": "3"}).encode(),
        b'{"query": "caf\xe9", "ans_box": "1"}',
        json.dumps({"query": "x" * 50, "ans_box": "1"}).encode(),
        json.dumps(["a list"]).encode(),
        json.dumps({"query": "2+2", "ans_box": 4, "qid": 9}).encode(),
    ]
    path.write_bytes(b"\n".join(lines))
    loaded = load_problems(path, count_tokens=len, max_prompt_tokens=20)
    assert [(p.prompt, p.answer, p.problem_id) for p in loaded.problems] == [("1+1", "2", "1"), ("2+2", "4", "9")]
    reasons = {r.location: r.reason for r in loaded.rejected}
    assert set(reasons) == {"line 2", "line 3", "line 4", "line 5", "line 6", "line 7"}
    assert "invalid JSON" in reasons["line 2"] and "'ans_box'" in reasons["line 3"]
    assert "empty 'query'" in reasons["line 4"] and "not UTF-8" in reasons["line 5"]
    assert "50 tokens" in reasons["line 6"] and all(r.source == str(path) for r in loaded.rejected)


def test_text_that_cannot_be_stored_lists_and_duplicate_ids_are_rejected_and_recorded(tmp_path, store):
    path = tmp_path / "odd.jsonl"
    lines = [
        '{"query": "1+1", "ans_box": "2", "qid": 1}',
        '{"query": "bad \\ud800 surrogate", "ans_box": "2", "qid": 2}',  # valid JSON, not valid Unicode
        '{"query": "a \\u0000 NUL", "ans_box": "2", "qid": 3}',
        '{"query": "2+2", "ans_box": ["4", "5"], "qid": 4}',
        '{"query": "2+3", "ans_box": true, "qid": 5}',
        '{"query": "1+1 again", "ans_box": "2", "qid": 1}',
    ]
    path.write_text("\n".join(lines))
    loaded = load_problems(path)
    assert [p.problem_id for p in loaded.problems] == ["1"]
    reasons = {r.location: r.reason for r in loaded.rejected}
    assert "not valid Unicode" in reasons["line 2"] and "NUL" in reasons["line 3"]
    assert "'ans_box' must be text or a number, got list" == reasons["line 4"]
    assert "got bool" in reasons["line 5"] and "duplicate problem id '1' (first at line 1)" == reasons["line 6"]
    store.reject("r", loaded.rejected)  # every rejection, the surrogate's payload too, is storable
    assert store.count("rejected_inputs", "r") == 5


def test_rejections_are_recorded_in_the_store(tmp_path, store):
    path = tmp_path / "d.jsonl"
    path.write_text('{"query": "1+1", "ans_box": "2"}\n{"query": "1+2"}\n')
    loaded = load_problems(path)
    store.reject("r", loaded.rejected)
    rows = store.query("SELECT location, reason FROM rejected_inputs").to_pylist()
    assert rows == [{"location": "line 2", "reason": "missing field(s) 'ans_box'"}]


def test_parquet_and_saved_dataset_folder_with_custom_fields(tmp_path):
    table = pa.table({"question": ["3+4", "5+5"], "answer": ["7", "0"]})
    pq.write_table(table, tmp_path / "d.parquet")
    loaded = load_problems(tmp_path / "d.parquet", question_field="question", answer_field="answer")
    assert [p.answer for p in loaded.problems] == ["7", "0"]
    folder = tmp_path / "saved"
    folder.mkdir()
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    loaded = load_problems(folder, question_field="question", answer_field="answer")
    assert [p.prompt for p in loaded.problems] == ["3+4", "5+5"]


def test_unusable_datasets_raise_naming_the_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match="empty.jsonl.*no usable problems"):
        load_problems(empty)
    with pytest.raises(DatasetError, match="no such file"):
        load_problems(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n')
    with pytest.raises(DatasetError, match="line 1: missing field"):
        load_problems(bad)
