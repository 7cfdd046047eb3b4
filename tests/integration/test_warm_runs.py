"""Runs one after another on the same processes (asyncrl/orchestrator/warm.py), with Ray, a real
vLLM-CPU actor and the torch learner: the second run takes over the first's engine and learner
rank, starts from the base model again (the parity probe on the engine agrees with the reset
learner, far from where the first run ended), trains with another algorithm (CISPO, the off-policy
metrics on), and a take-over whose push silently does not reach the engine is caught."""

import json

import pytest
import ray

from asyncrl.config import load_config
from asyncrl.orchestrator.orchestrator import Orchestrator

STEPS = 4


def config(tiny_model_path, out, name, *extra):
    return load_config(None, [
        f"model.path={tiny_model_path}", "buffer.token_budget=128", f"total_steps={STEPS}", "learner.lr=3e-3",
        "algo.drop_zero_variance_groups=false", "observe.console=off", "observe.tensorboard=false",
        "eval.every_steps=0", f"observe.output_dir={out}", f"name={name}", "save_final=false", *extra])


def base_logprobs(model_path, token_ids):
    """log p(token_i | tokens_<i) of the base model, as the learner's parity probe computes it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


def events(cfg):
    return [json.loads(x) for x in (cfg.run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("warm")
    first_cfg = config(tiny_model_path, out, "first", "seed=0")
    second_cfg = config(tiny_model_path, out, "second", "seed=1", "algo.policy_loss=cispo", "algo.eps_high=0.3")
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    first = Orchestrator(first_cfg)
    warm = second = None
    try:
        first.run()
        ended = first.learner.prompt_logprobs(first.driver.probe_ids).result()  # the first run's final policy
        warm = first.release()
        second = Orchestrator(second_cfg)
        second.run(warm)
        base = base_logprobs(tiny_model_path, first.driver.probe_ids)
        yield first, second, (first_cfg, second_cfg), (ended, base), warm
    finally:
        if second is not None:
            warm = second.release()
        if warm is not None:
            warm.shutdown()
        ray.shutdown()


def test_the_second_run_takes_over_the_processes_and_starts_from_the_base_model(runs):
    first, second, (first_cfg, second_cfg), (ended, base), _ = runs
    start = [e for e in events(second_cfg) if e["event"] == "start"][0]
    assert start["warm"] is True and start["parity_max_abs_diff"] <= second_cfg.parity_tolerance
    # the first run moved the policy well past the probe's tolerance: an engine left with its final
    # weights would have failed the probe
    assert max(abs(a - b) for a, b in zip(ended, base)) > 100 * second_cfg.parity_tolerance
    assert [row["step"] for row in second.history] == list(range(1, STEPS + 1))
    assert [row["learner/version"] for row in second.history] == list(range(1, STEPS + 1))
    assert events(second_cfg)[-1]["status"] == "finished" and events(first_cfg)[-1]["status"] == "finished"


def test_the_second_run_trains_with_its_own_algorithm_and_reports_the_decomposition(runs):
    _, second, _, _, _ = runs
    last = second.history[-1]
    assert "clip/m2po_masked_frac" in last and last["offpolicy/ess"] > 0
    tokens = sum(last[f"offpolicy/stale_{b}/tokens"] for b in ("0", "1", "2", "3-4", "5+"))
    assert tokens == last["learner/loss_tokens"]
    # float32 engine and learner: the fresh tokens' logprobs agree to rounding
    assert all(row.get("offpolicy/mismatch_abs", 0.0) < 1e-4 for row in second.history)


def test_a_take_over_whose_push_does_not_reach_the_engine_is_caught(runs, tmp_path):
    first, second, _, _, _ = runs
    cfg = config(first.cfg.model.path, tmp_path, "sabotaged", "seed=2")
    warm = second.release()
    original = warm.weight_sync.push
    warm.weight_sync.push = lambda version, step=None, on_lost=None: {}  # the push that silently does nothing
    third = Orchestrator(cfg)
    try:
        with pytest.raises(RuntimeError, match="not computing with the pushed weights"):
            third.run(warm)
    finally:
        warm.weight_sync.push = original
        second.learner = second.pool = None  # `third` holds the processes now; the fixture ends them
        third.shutdown()
