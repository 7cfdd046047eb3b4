"""The loop's scheduling under Ray with fake engines (fast): synchronous mode (max_staleness 0)
trains only on tokens of the current version, and every batch still holds exactly Phi."""

import pytest
import ray

from asyncrl.config import load_config
from asyncrl.orchestrator.orchestrator import Orchestrator
from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    spec = TinyModelSpec(warm_start_steps=10, num_eval_prompts=8)
    return str(ensure_tiny_model(spec, cache_dir=tmp_path_factory.mktemp("cache"), log=lambda _: None))


@pytest.mark.parametrize("staleness", [0, 2])
def test_loop_respects_the_staleness_bound_with_exact_budget(tmp_path, small_model, staleness):
    cfg = load_config(None, [
        f"model.path={small_model}", "rollout.engine=fake", "rollout.num_actors=2", "total_steps=8",
        "buffer.token_budget=48", f"buffer.max_staleness={staleness}", "algo.drop_zero_variance_groups=false",
        "observe.console=off", "observe.tensorboard=false", f"observe.output_dir={tmp_path}", "save_final=false",
        # shaping on: fake responses often run to max_tokens without EOS
        "algo.no_eos_penalty=0.5", "algo.overlong_buffer=4", "algo.truncation_mask=after",
    ])
    ray.init(num_cpus=4, include_dashboard=False)
    orch = Orchestrator(cfg)
    try:
        orch.run()
        actor_versions = [s["version"] for s in ray.get([a.get_stats.remote() for a in orch.actors])]
    finally:
        orch.shutdown()
        ray.shutdown()
    assert [h["learner/loss_tokens"] for h in orch.history] == [48] * 8
    assert [h["learner/version"] for h in orch.history] == list(range(1, 9))
    assert max(h["staleness/max"] for h in orch.history) <= staleness
    assert actor_versions == [8, 8]
    # mean penalty per step: in [-0.5, 0], and below 0 whenever a response ran out of tokens
    assert all(-0.5 <= h["reward/no_eos_penalty"] <= 0 for h in orch.history)
    assert any(h["reward/no_eos_penalty"] < 0 for h in orch.history)
    assert any(h["reward/overlong_penalty"] < 0 for h in orch.history)
    st = orch.buffer.stats
    assert st.tokens_in == st.tokens_out + st.tokens_dropped_stale + orch.buffer.num_loss_tokens
