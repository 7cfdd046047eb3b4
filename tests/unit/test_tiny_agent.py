"""The tiny agent's parts: the calculator task and its traces, its warm-start sampler with the
calculator in the loop, the episode metrics of a step, the held-out tool rates, the config."""

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.orchestrator.evaluation import EvalKey, Evaluator, eval_records, eval_summary, format_eval_summary
from asyncrl.orchestrator.step_stats import StepStats
from asyncrl.tiny import tool_measure, tool_task
from asyncrl.tiny.tokenizer import build_tokenizer
from asyncrl.types import EpisodeRecord, EpisodeStatus, PromptItem, Sample


def test_the_splits_are_disjoint_two_digit_problems_and_the_trace_reads_the_calculator():
    train, held_out = set(tool_task.all_problems("train")), set(tool_task.all_problems("eval"))
    assert not train & held_out and len(train | held_out) == 90 * 90
    assert 0.15 < len(held_out) / 8100 < 0.25
    assert tool_task.trace(23, 47) == [("model", "<calc>23*47</calc>"), ("env", "<result>1081</result>"),
                                       ("model", "\\boxed{1081}")]
    tok = build_tokenizer()
    ids, labels = tool_task.encode_trace(23, 47, tok)
    assert tok.decode(ids, skip_special_tokens=True) == "23*47=<calc>23*47</calc><result>1081</result>\\boxed{1081}"
    learned = tok.decode([t for t, y in zip(ids, labels) if y != -100], skip_special_tokens=True)
    assert learned == "<calc>23*47</calc>\\boxed{1081}"  # neither the prompt nor the calculator's answer
    assert labels[-1] == tok.eos_token_id and len(ids) < 64  # within the tiny model's context


class Scripted(torch.nn.Module):
    """A "model" that writes a fixed text (one-hot logits), whatever it is fed: what the
    sampler does with it is what the test checks."""

    def __init__(self, tok, text):
        super().__init__()
        self.script = tok.encode(text) + [tok.eos_token_id]
        self.vocab, self.pos = len(tok), 0

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        token = self.script[min(self.pos, len(self.script) - 1)]  # one call per position
        self.pos += 1
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        logits[:, :, token] = 0.0
        return type("Out", (), {"logits": logits, "past_key_values": None})()


def test_the_warm_start_sampler_feeds_the_calculator_answer_in_and_scores_the_episode():
    tok = build_tokenizer()
    rec = tool_task.make_record(23, 47)
    # the model writes its call, then (while the calculator's 21 tokens are fed in, its own
    # choices ignored) anything, then the box: the script must line up with those positions
    call, box = "<calc>23*47</calc>", "\\boxed{1081}"
    model = Scripted(tok, call + "x" * len("<result>1081</result>") + box)
    [ep] = tool_measure.sample_episodes(model, tok, [rec], torch.Generator().manual_seed(0))
    assert ep.text == "<calc>23*47</calc><result>1081</result>\\boxed{1081}"
    assert ep.calls == [call] and ep.correct and ep.good_call
    wrong = Scripted(tok, "<calc>23*46</calc>" + "x" * len("<result>1058</result>") + "\\boxed{1058}")
    [ep] = tool_measure.sample_episodes(wrong, tok, [rec], torch.Generator().manual_seed(0))
    assert (ep.correct, ep.good_call, ep.text.count("<result>1058</result>")) == (False, False, 1)


def episode_sample(turns, calls, errors, obs, model_tokens, error=None):
    mask = [1] * model_tokens + [0] * obs
    record = EpisodeRecord("calculator", EpisodeStatus.FAILED if error else EpisodeStatus.DONE, turns=turns,
                           tool_calls=calls, tool_errors=errors, env_s=0.5, observation_tokens=obs, error=error)
    return Sample("p", "g", 0, [1], [2] * len(mask), [0.0] * len(mask), [0] * len(mask), "stop", 0,
                  loss_mask=mask, episode=record)


def test_a_steps_row_holds_the_episode_metrics():
    stats = StepStats(0)
    stats.add_sample(episode_sample(2, 1, 0, obs=10, model_tokens=30), 1.0, {})
    stats.add_sample(episode_sample(3, 2, 1, obs=20, model_tokens=40, error="KeyError: 'x'"), 0.0, {})
    row = stats.flush({})
    assert row["episode/turns_mean"] == 2.5 and row["episode/tool_calls_mean"] == 1.5
    assert row["episode/tool_error_frac"] == pytest.approx(1 / 3) and row["episode/error_frac"] == 0.5
    assert row["episode/env_s_mean"] == 0.5
    assert (row["episode/model_tokens_mean"], row["episode/observation_tokens_mean"]) == (35, 15)
    assert row["episode/masked_frac"] == pytest.approx(30 / 100)
    assert stats.flush({})["episode/turns_mean"] is None  # the column stays, empty, in a row without episodes


class Events:
    def event(self, step, kind, **fields):
        pass


def test_heldout_tool_rates_and_the_summary():
    cfg = load_config(None, ["eval.n=2"])
    ev = Evaluator(cfg, [PromptItem("a", [1], {}), PromptItem("b", [2], {})], Events())
    ev._version, ev._expected = 0, 4

    def episode(calls, errors):
        return EpisodeRecord("calculator", tool_calls=calls, tool_errors=errors)

    for index, reward, e in [(0, 1.0, episode(1, 0)), (0, 1.0, episode(0, 0)), (1, 0.0, episode(1, 0)),
                             (1, 1.0, episode(2, 1))]:
        ev.on_scored(EvalKey(index, 3, "r", {}, e), reward)
    m = ev.take_metrics(step=1)
    assert m["eval/tool_call_rate"] == 0.75  # 3 of 4 episodes called the calculator
    assert m["eval/tool_success_rate"] == 0.25  # and one solved it with calls that all answered
    s = eval_summary([{"eval/step": 0, "eval/avg@2": 0.3, "eval/tool_success_rate": 0.25},
                      {"eval/step": 50, "eval/avg@2": 0.6, "eval/tool_success_rate": 0.5}])
    assert format_eval_summary(s).endswith("(step 50); tool success 0.250 -> 0.500")


def test_the_tool_demo_config_loads_and_its_task_needs_the_calculator_and_the_tool_model():
    cfg = load_config("configs/tiny_tool.yaml")
    assert (cfg.env.type, cfg.data.type, cfg.model.tiny.task) == ("calculator", "tiny_calc", "calc_tool")
    records = eval_records(cfg)
    assert len(records) == 64 and all(r["data_source"] == "tiny_calc" for r in records)
    with pytest.raises(ConfigError, match="go together"):
        load_config(None, ["data.type=tiny_calc", "env.type=calculator"])
    with pytest.raises(ConfigError, match="env.type calculator"):
        load_config("configs/tiny_tool.yaml", ["env.type=null"])
    # a recipe based on tiny_tool with data of one's own: the error says how to take the model along
    with pytest.raises(ConfigError, match=r"python tools/build_tiny_model.py --config tiny_tool"):
        load_config("configs/tiny_tool.yaml", ["data.type=jsonl", "data.path=mine.jsonl"])
    mine = load_config("configs/tiny_tool.yaml", ["data.type=jsonl", "data.path=mine.jsonl",
                                                  "model.path=/models/tiny-tool"])
    assert (mine.model.path, mine.env.type) == ("/models/tiny-tool", "calculator")
    with pytest.raises(ConfigError, match="decoupled"):
        load_config("configs/tiny_tool.yaml", ["algo.decoupled=true"])
