"""The pure parts of offline evaluation (asyncrl/lab/offline/eval_policy.py): finding a policy's run config
and aggregating scored samples; generation itself is exercised by tests/e2e/test_launch_run.py."""

import pytest

from asyncrl.lab.offline.eval_policy import EvalSample, run_config_path, summarize


def test_run_config_is_found_above_final_and_above_a_checkpoints_policy(tmp_path):
    run = tmp_path / "run"
    policy = run / "checkpoints" / "step_4" / "learner" / "policy"
    policy.mkdir(parents=True)
    (run / "final").mkdir()
    (run / "config.yaml").write_text("name: run\n")
    (run / "checkpoints" / "step_4" / "config.yaml").write_text("name: run\n")
    assert run_config_path(run / "final") == run / "config.yaml"
    assert run_config_path(policy) == run / "checkpoints" / "step_4" / "config.yaml"
    # Any other directory, or a run without its config.yaml, has no run config.
    assert run_config_path(tmp_path) is None
    (run / "config.yaml").unlink()
    assert run_config_path(run / "final") is None


def sample(index: int, source: str, reward: float, num_tokens: int = 4, outcome: str = "wrong") -> EvalSample:
    return EvalSample(index, f"p{index}", {"data_source": source}, "r", num_tokens, "stop", reward,
                      {"outcome": outcome})


def test_summarize_gives_overall_and_per_source_figures():
    samples = [
        sample(0, "add", 1.0, 2, "verified"), sample(0, "add", 0.0, 4),  # c=1 of 2
        sample(1, "add", 1.0, 6, "verified"), sample(1, "add", 1.0, 8, "verified"),  # c=2 of 2
        sample(2, "mul", 0.0, 4), sample(2, "mul", 0.0, 4, "timeout"),  # c=0 of 2
    ]
    r = summarize(samples, n=2, ks=[1, 2])
    assert r["avg@2"] == pytest.approx(3 / 6)
    assert r["pass@1"] == pytest.approx((1 / 2 + 1 + 0) / 3)
    assert r["pass@2"] == pytest.approx((1 + 1 + 0) / 3)
    assert r["num_prompts"] == 3 and r["num_incomplete"] == 0
    assert r["by_source"]["add"]["avg@2"] == pytest.approx(3 / 4)
    assert r["by_source"]["add"]["pass@2"] == pytest.approx(1.0)
    assert r["by_source"]["mul"] == {"avg@2": 0.0, "pass@1": 0.0, "pass@2": 0.0, "num_prompts": 1,
                                     "num_incomplete": 0}
    assert r["mean_response_tokens"] == pytest.approx((2 + 4 + 6 + 8 + 4 + 4) / 6)
    assert r["outcomes"] == {"verified": 3, "wrong": 2, "timeout": 1}


class ScriptedEngine:
    """Answers each prompt's first turn with a calculator call, the next with a boxed number."""

    def __init__(self, tok, box):
        self.tok, self.box, self.prompts = tok, box, []

    async def generate(self, prompt_ids, spec, request_id):
        from asyncrl.rollout.engine import Completion

        self.prompts.append(self.tok.decode(prompt_ids))
        first = request_id.endswith("-t0")
        assert spec.stop == ("</calc>",)  # the environment's stop string reaches the engine
        ids = self.tok.encode("<calc>12*34</calc>" if first else f"\\boxed{{{self.box}}}")
        ids += [] if first else [self.tok.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), "stop")


def test_an_environment_task_is_evaluated_by_episodes_and_reports_tool_use():
    import asyncio

    from asyncrl.config import load_config
    from asyncrl.lab.offline.eval_policy import generate, prompt_items
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.tiny.tokenizer import build_tokenizer

    cfg = load_config("configs/tiny_tool.yaml", ["model.max_model_len=64"])  # as resolve() fills it
    tok = build_tokenizer()
    records = [{"prompt": "12*34=", "answer": "408", "data_source": "tiny_calc"}]
    items = prompt_items(cfg, tok, records, 56)
    engine = ScriptedEngine(tok, 408)
    samples = asyncio.run(generate(cfg, records, items, 2, SamplingSpec(1.0, 1.0, 56), tok, lambda _: None, engine))
    assert [s.response for s in samples] == ["<calc>12*34</calc><result>408</result>\\boxed{408}"] * 2
    # each episode's second turn is prompted with the first and the calculator's answer
    assert sorted(engine.prompts) == ["12*34="] * 2 + ["12*34=<calc>12*34</calc><result>408</result>"] * 2
    for s in samples:
        s.reward = 1.0
    summary = summarize(samples, 2, [1])
    assert summary["tool_call_rate"] == 1.0 and summary["tool_success_rate"] == 1.0


def test_an_eval_entry_keeps_the_tool_rates_of_an_environment_task(tmp_path):
    from asyncrl.lab.offline.run_policies import SavedPolicy, eval_entry

    entry = eval_entry(SavedPolicy("final", 8, tmp_path), {"avg@8": 0.5, "tool_call_rate": 1.0,
                                                          "tool_success_rate": 0.5, "outcomes": {}})
    assert entry == {"policy": "final", "step": 8, "avg@8": 0.5, "tool_call_rate": 1.0, "tool_success_rate": 0.5}
