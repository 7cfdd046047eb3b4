"""Which runs may share processes (asyncrl/orchestrator/warm.py): the process-shaping fields."""

from asyncrl.config import load_config
from asyncrl.orchestrator.warm import Warm, differences, process_key


def fits(a, b):
    return Warm(process_key(load_config(None, a)), None, None, None).fits(load_config(None, b))


def test_runs_that_differ_in_algorithm_data_or_seed_share_processes():
    assert fits([], ["seed=3", "rollout.sampling_seed_offset=5", "algo.policy_loss=cispo", "buffer.max_staleness=4",
                     "learner.lr=1e-3", "total_steps=7", "name=other", "rollout.temperature=1.2", "algo.kl.coef=0.01"]) == []


def test_a_process_shaping_field_is_named():
    assert fits([], ["rollout.dtype=float16"]) == ["rollout.dtype"]
    assert fits([], ["learner.num_ranks=2", "sync.mode=drain"]) == ["learner.num_ranks", "sync.mode"]
    assert fits([], ["model.dtype=bfloat16"]) == ["model.dtype"]
    # scoring on the actors puts the reward functions in their processes
    assert fits(["reward.placement=actor"], ["reward.placement=actor", "reward.timeout_s=3"]) == ["reward.timeout_s"]
    assert fits([], ["reward.timeout_s=3"]) == []
    # the actors hold the episode runner: an environment's setting starts new ones
    assert fits(["env.type=calculator"], ["env.type=calculator", "env.max_turns=2"]) == ["env.max_turns"]
    # routing replay: the engines record routing and the learner's routers replay it
    assert fits(["model.tiny.num_experts=8"], ["model.tiny.num_experts=8", "algo.moe_routing=replay"]) \
        == ["algo.moe_routing"]


def test_differences_walks_nested_keys():
    assert differences({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 1, "c": 5}, "d": 3, "e": 0}) == ["a.c", "e"]


def test_the_sampling_seed_moves_the_engines_and_requests_but_not_the_prompts():
    """An A/A copy differs from its source by its sampling alone: the engine's seed and every
    request's (the actor hashes its seed with the request id) take seed + the offset; the
    prompt source and the learner keep `seed`."""
    from asyncrl.rollout import engine_factory

    cfg = load_config(None, ["seed=3", "rollout.sampling_seed_offset=1000003"])
    assert cfg.sampling_seed == 1000006 and cfg.seed == 3
    assert engine_factory(cfg, "model", actor_id=2).keywords["seed"] == 1000008
    assert load_config(None, ["seed=3"]).sampling_seed == 3
