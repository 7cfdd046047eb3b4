"""The built-in tiny task: deterministic, correct, well-formatted, with a disjoint eval split."""

import re

import pytest

from asyncrl.tiny import task


def test_same_seed_same_problems_and_different_seed_differs():
    assert task.make_problems(50, seed=3) == task.make_problems(50, seed=3)
    assert task.make_problems(50, seed=3) != task.make_problems(50, seed=4)


def test_answers_are_correct():
    for record in task.make_problems(200, seed=0, spec=task.TinyTaskSpec(ops="+-*")):
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", record["prompt"]).groups()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert record["answer"] == str(expected)
        assert record["data_source"] == "tiny_arith"
        assert expected >= 0


def test_response_has_exactly_one_boxed_answer():
    for record in task.make_problems(20, seed=1):
        response = task.format_response(record["answer"])
        assert response.count("\\boxed{") == 1
        assert response.endswith("\\boxed{" + record["answer"] + "}")
        assert task.extract_boxed(response) == record["answer"]
        assert task.is_correct(response, record["answer"])


def test_is_correct_takes_the_last_boxed_and_rejects_wrong_or_missing():
    assert task.is_correct("\\boxed{3} no, \\boxed{4}", "4")
    assert not task.is_correct("\\boxed{5}", "4")
    assert not task.is_correct("4", "4")


def test_eval_split_is_disjoint_from_train_and_stable():
    spec = task.TinyTaskSpec()
    train, held_out = set(task.all_problems(spec, "train")), set(task.all_problems(spec, "eval"))
    assert train.isdisjoint(held_out)
    assert len(train | held_out) == spec.max_operand**2
    # a hash split: the held-out share is near eval_fraction, not exact (21 of 100 by default)
    assert abs(len(held_out) / len(train | held_out) - spec.eval_fraction) < 0.1
    eval_prompts = {r["prompt"] for r in task.make_problems(200, seed=0, split="eval")}
    train_prompts = {r["prompt"] for r in task.make_problems(2000, seed=0, split="train")}
    assert eval_prompts.isdisjoint(train_prompts)


def test_bad_split_and_operator_are_rejected():
    with pytest.raises(ValueError, match="split"):
        task.make_problems(1, seed=0, split="test")
    with pytest.raises(ValueError, match="operator"):
        task.solve(1, "/", 2)


def test_alphabet_covers_prompts_and_responses():
    alphabet = set(task.task_alphabet())
    for record in task.make_problems(100, seed=2):
        assert set(record["prompt"] + task.format_response(record["answer"])) <= alphabet
