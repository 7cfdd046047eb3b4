"""Held-out evaluation bookkeeping: which records, the metrics once every sample is scored, the
summary. (The loop itself: tests/e2e/test_first_hour.py and the demo.)"""

import json

import pytest

from asyncrl.config import load_config
from asyncrl.orchestrator.evaluation import EvalKey, Evaluator, eval_records, eval_summary, format_eval_summary
from asyncrl.tiny.task import TinyTaskSpec, all_problems
from asyncrl.types import PromptItem


class Events:
    def __init__(self):
        self.seen = []

    def event(self, step, kind, **fields):
        self.seen.append((step, kind, fields))


def test_records_are_the_heldout_split_or_the_eval_file(tmp_path):
    records = eval_records(load_config())
    assert len(records) == len(all_problems(TinyTaskSpec(), "eval"))
    held_out = {r["prompt"] for r in records}
    assert not held_out & {f"{a}{op}{b}=" for a, op, b in all_problems(TinyTaskSpec(), "train")}
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(5)))
    cfg = load_config(None, [f"eval.data={path}", "data.prompt_field=q", "data.answer_field=a", "eval.max_prompts=3"])
    assert [r["answer"] for r in eval_records(cfg)] == ["1", "2", "3"]
    assert eval_records(load_config(None, ["data.type=jsonl", "data.path=x.jsonl"])) is None  # no held-out data
    assert eval_records(load_config(None, ["eval.every_steps=0"])) is None


def test_metrics_once_every_sample_is_scored():
    cfg = load_config(None, ["eval.n=2", "eval.pass_k=[1, 2]"])
    events = Events()
    ev = Evaluator(cfg, [PromptItem("a", [1], {}), PromptItem("b", [2], {})], events)
    ev._version, ev._expected = 4, 4  # as after a started evaluation's samples were submitted
    for index, reward in [(0, 1.0), (1, 0.0), (0, 0.0), (1, 0.0)]:
        assert ev.take_metrics(step=5) == {}
        ev.on_scored(EvalKey(index, 3, "r", {}), reward)
    m = ev.take_metrics(step=5)
    assert m["eval/step"] == 4 and m["eval/avg@2"] == 0.25
    assert m["eval/pass@1"] == 0.25 and m["eval/pass@2"] == 0.5  # prompt a: 1 of 2 correct; b: none
    assert m["eval/num_prompts"] == 2 and m["eval/response_len_mean"] == 3
    assert events.seen == [(5, "eval", m)] and not ev.running and ev.take_metrics(step=6) == {}


def test_nothing_starts_without_heldout_data_or_before_it_is_due():
    class Pool:
        ids = [0]

    cfg = load_config(None, ["eval.every_steps=10"])
    assert not Evaluator(cfg, None, Events()).maybe_start(0, Pool(), None)
    ev = Evaluator(cfg, [PromptItem("a", [1], {})], Events())
    assert not ev.maybe_start(5, Pool(), None)  # not a multiple of every_steps
    with pytest.raises(ValueError, match="no eval prompt fits"):
        Evaluator(cfg, [], Events())


def test_summary_of_the_first_and_last_evaluation():
    history = [{"step": 1, "eval/step": 0, "eval/avg@8": 0.3}, {"step": 2},
               {"step": 3, "eval/step": 2, "eval/avg@8": 0.5}, {"step": 4, "eval/step": None}]
    s = eval_summary(history)
    assert s == {"eval_metric": "avg@8", "eval_first": 0.3, "eval_first_step": 0, "eval_last": 0.5, "eval_last_step": 2}
    assert format_eval_summary(s) == "  held-out avg@8: 0.300 (policy of step 0) -> 0.500 (step 2)"
    assert eval_summary([{"step": 1}]) == {} and format_eval_summary({}) == ""
