"""jsonl records checked before the run: file, line, the missing field and the closest present one."""

import json

import pytest

from asyncrl.data import records
from asyncrl.data.records import RecordError, check_file, normalize, read_records


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def math(_source):
    return "math_verify"


def test_missing_answer_names_file_line_and_the_likely_field(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "solution": "4"}])
    with pytest.raises(RecordError) as e:
        read_records(path, verifier_of=math)
    assert str(e.value) == (f"{path}:2: no 'answer' field, which the math_verify verifier of data source "
                            "'unknown' needs; did you mean 'solution'? set data.answer_field=solution")


def test_missing_prompt_suggests_a_known_alias_or_lists_the_fields(tmp_path):
    with pytest.raises(RecordError, match=r":1: no 'prompt' field \(and no 'messages'\); did you mean 'question'\?"):
        read_records(_jsonl(tmp_path / "q.jsonl", [{"question": "x", "answer": "1"}]))
    with pytest.raises(RecordError, match=r"the record has 'zzz', 'answer'"):
        read_records(_jsonl(tmp_path / "z.jsonl", [{"zzz": "x", "answer": "1"}]))


def test_configured_fields_are_mapped_to_prompt_and_answer(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "3*4=", "solution": "12", "domain": "math"}])
    [rec] = read_records(path, prompt_field="question", answer_field="solution", verifier_of=math)
    assert rec["prompt"] == "3*4=" and rec["answer"] == "12" and rec["domain"] == "math"


def test_ground_truth_alias_and_messages_records(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}], "ground_truth": "5"}])
    [rec] = read_records(path, verifier_of=math)
    assert rec["answer"] == "5" and "prompt" not in rec


def test_answer_only_required_by_verifiers_that_read_it(tmp_path):
    rows = [{"prompt": "p", "data_source": "mine"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    assert read_records(path, verifier_of=lambda s: "import:m:f")[0]["answer"] is None
    with pytest.raises(RecordError, match="no 'tests' field .* code verifier"):
        read_records(path, verifier_of=lambda s: "code")


@pytest.mark.parametrize("line, message", [
    ("not json", r":1: not valid JSON"),
    ("[1, 2]", r":1: a record must be a JSON object, got list"),
    ('{"prompt": "", "answer": "1"}', r":1: 'prompt' must be a non-empty string"),
    ('{"messages": [], "answer": "1"}', r":1: 'messages' must be a non-empty list"),
])
def test_malformed_lines(tmp_path, line, message):
    with pytest.raises(RecordError, match=message):
        read_records(_jsonl(tmp_path / "d.jsonl", [line]))


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(RecordError, match="no records"):
        read_records(_jsonl(tmp_path / "e.jsonl", []))
    with pytest.raises(RecordError, match="does not exist"):
        check_file(tmp_path / "nope.jsonl")


def test_a_large_file_is_checked_on_a_sample_first(tmp_path, monkeypatch):
    rows = [{"prompt": "p", "answer": "1"}] * 5 + [{"prompt": "p"}]
    path = _jsonl(tmp_path / "big.jsonl", rows)
    monkeypatch.setattr(records, "FULL_CHECK_BYTES", 10)
    monkeypatch.setattr(records, "SAMPLE_RECORDS", 5)
    assert check_file(path, verifier_of=math) == 5  # the bad 6th line is read when the run loads it
    monkeypatch.setattr(records, "FULL_CHECK_BYTES", 10 << 20)
    with pytest.raises(RecordError, match=":6: no 'answer'"):
        check_file(path, verifier_of=math)


def test_normalize_keeps_the_record_intact():
    rec = {"prompt": "p", "answer": 3, "metadata": {"k": 1}}
    out = normalize(rec, "here")
    assert out == {"prompt": "p", "answer": 3, "metadata": {"k": 1}} and out is not rec
