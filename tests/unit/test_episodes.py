"""Multi-turn episodes in a rollout actor (rollout/episode.py), with the fake engine and scripted
environments: per-token versions and logprobs across a weight update, the loss mask, an
environment that hangs or raises costing its own episode only."""

import asyncio
import threading

import pytest

from asyncrl.config import RewardConfig
from asyncrl.config.env_section import EnvConfig
from asyncrl.env.base import Step
from asyncrl.reward.errors import RewardErrorsExceeded, env_error_monitor, format_report
from asyncrl.reward.episode_reward import verifier_metadata
from asyncrl.reward.registry import RewardRouter
from asyncrl.rollout.actor import RolloutActor
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.episode import EpisodeRunner
from asyncrl.rollout.fake_engine import FakeEngine
from asyncrl.types import PromptItem

VOCAB = 16


class LetterTokenizer:
    """Token id i <-> letter chr(97 + i): observation text is spelled in ids below VOCAB."""

    def __len__(self):
        return VOCAB

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 97 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids)


class Echo:
    """Answers every turn with "obs" until `turns` turns; the reward is the number of turns."""

    stop = ("</x>",)

    def __init__(self, metadata, turns=3, gate=None):
        self.turns, self.gate, self.seen = turns, gate, []

    def step(self, turn):
        self.seen.append(turn)
        if self.gate is not None:
            self.gate.wait()
        done = turn.index + 1 >= self.turns
        return Step(observation="" if done else "obs", reward=1.0, done=done, info={"tool_calls": 1})


def make_actor(out, factory, sync_mode="inflight", delay_s=0.002, **env):
    cfg = EnvConfig(type="calculator", **{"max_turn_tokens": 4, "max_turns": 4, **env})
    return RolloutActor(0, lambda: FakeEngine(vocab_size=VOCAB, eos_id=99, delay_s=delay_s),
                        SamplingSpec(1.0, 1.0, 64), group_size=1, emit=out.append, seed=3, sync_mode=sync_mode,
                        episodes=lambda: EpisodeRunner(cfg, factory, LetterTokenizer()))


async def wait_for(out, n, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if len(out) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(out)} samples after {timeout} s, expected {n}")


def test_an_episode_keeps_model_and_observation_tokens_with_a_mask_of_the_model_ones():
    envs = []

    def factory(metadata, **options):
        envs.append(Echo(metadata))
        return envs[-1]

    async def main():
        out = []
        actor = make_actor(out, factory)
        await actor.start()
        await actor.submit([PromptItem("p0", [1, 2], {"answer": "7"})])
        await wait_for(out, 1)
        return out[0]

    s = run(main())
    s.validate()
    obs = LetterTokenizer().encode("obs")
    # three model turns of 4 tokens (max_turn_tokens; the fake engine never stops early here),
    # two observations between them, none after the last turn
    assert len(s.response_ids) == 3 * 4 + 2 * len(obs)
    assert s.loss_mask == [1] * 4 + [0] * 3 + [1] * 4 + [0] * 3 + [1] * 4
    assert s.response_ids[4:7] == obs and s.response_ids[11:14] == obs
    assert [s.logprobs[i] for i in range(len(s.loss_mask)) if not s.loss_mask[i]] == [0.0] * 6
    assert s.num_loss_tokens == 12 and s.finish_reason == "stop"
    ep = s.episode
    assert (ep.turns, ep.tool_calls, ep.reward, ep.observation_tokens) == (3, 3, 3.0, 6)
    assert ep.spans == [[0, 4, "model"], [4, 7, "env"], [7, 11, "model"], [11, 14, "env"], [14, 18, "model"]]
    assert ep.error is None and s.metadata["answer"] == "7"
    # the environment saw each turn's own sampled ids and their text, never a re-tokenization
    turns = envs[0].seen
    assert [t.token_ids for t in turns] == [s.response_ids[0:4], s.response_ids[7:11], s.response_ids[14:18]]
    assert all(t.text == LetterTokenizer().decode(t.token_ids) for t in turns)
    # every turn after the first was prompted with everything before it (checked via the engine's prompt)


def test_an_episode_across_an_inflight_update_carries_both_versions_each_with_its_own_logprobs():
    entered, gate = threading.Event(), threading.Event()

    class Held(Echo):
        def step(self, turn):
            entered.set()  # the first turn is sampled: hold the episode here while the weights change
            return super().step(turn)

    async def main():
        out = []
        actor = make_actor(out, lambda metadata, **o: Held(metadata, turns=2, gate=gate))
        await actor.start()
        await actor.submit([PromptItem("p0", [1, 2], {})])
        while not entered.is_set():
            await asyncio.sleep(0.005)
        await actor.update_weights({}, version=1)
        gate.set()
        await wait_for(out, 1)
        return out[0], actor

    s, actor = run(main())
    engine = actor.engine
    model = [i for i, m in enumerate(s.loss_mask) if m]
    assert sorted(set(s.versions[i] for i in model)) == [0, 1]
    for i in model:  # each model token's behaviour logprob is that of the weights that sampled it
        assert s.logprobs[i] == pytest.approx(engine.logprob_at(s.versions[i]), abs=1e-12)
    assert s.versions == sorted(s.versions)  # never decreasing: the stale check stays a prefix scan
    assert s.versions[4:7] == [0, 0, 0]  # the observation takes its turn's version


def test_a_hanging_environment_times_out_alone_and_the_actor_keeps_generating():
    release = threading.Event()

    class Hang(Echo):
        def step(self, turn):
            if self.turns == 99:
                release.wait(30)
            return super().step(turn)

    def factory(metadata, **options):
        return Hang(metadata, turns=99 if metadata.get("hang") else 2)

    async def main():
        out = []
        actor = make_actor(out, factory, step_timeout_s=0.3)
        await actor.start()
        await actor.submit([PromptItem("hang", [1], {"hang": True})] + [PromptItem(f"ok{i}", [1], {}) for i in range(4)])
        await wait_for(out, 5)
        stuck.append(actor.get_stats()["episodes_stuck"])
        release.set()
        await actor.submit([PromptItem("after", [1], {})])  # the actor still works
        await wait_for(out, 6)
        return {s.group_id: s for s in out}

    stuck = []
    samples = run(main())
    assert stuck == ["1 environment step(s) still running past env.step_timeout_s=0.3s (their episodes ended "
                     "as env errors; the steps hang)"]
    hung = samples["hang"].episode
    assert hung.error == "TimeoutError: env.step took longer than env.step_timeout_s=0.3"
    assert 0.3 <= hung.env_s < 2 and hung.turns == 1
    assert samples["hang"].loss_mask == [] and len(samples["hang"].response_ids) == 4
    for name in ("ok0", "ok1", "ok2", "ok3", "after"):
        assert samples[name].episode.error is None
        assert samples[name].episode.turns == 2


def test_more_steps_hanging_for_good_than_the_actor_has_threads_cost_only_their_episodes():
    """80 episodes whose step never returns (more than the 64 threads a fixed pool had) and 10 that
    work: the 10 finish normally, the 80 end as env errors, and the actor says what is stuck."""
    release = threading.Event()

    class Hang(Echo):
        def step(self, turn):
            if self.turns == 99:
                release.wait()
            return super().step(turn)

    def factory(metadata, **options):
        return Hang(metadata, turns=99 if metadata.get("hang") else 2)

    async def main():
        out = []
        actor = make_actor(out, factory, step_timeout_s=0.2, delay_s=0.0)
        await actor.start()
        await actor.submit([PromptItem(f"hang{i}", [1], {"hang": True}) for i in range(80)])
        await actor.submit([PromptItem(f"ok{i}", [1], {}) for i in range(10)])
        await wait_for(out, 90, timeout=30)
        return {s.group_id: s for s in out}, actor.get_stats()["episodes_stuck"]

    try:
        samples, stuck = run(main())
    finally:
        release.set()
    assert all(samples[f"ok{i}"].episode.error is None and samples[f"ok{i}"].episode.turns == 2 for i in range(10))
    assert all(samples[f"hang{i}"].episode.error.startswith("TimeoutError") for i in range(80))
    assert stuck.startswith("80 environment step(s) still running")


def test_a_raising_environment_costs_its_episode_reported_with_its_last_traceback_line():
    class Broken(Echo):
        def step(self, turn):
            return {"zero": 1 / 0}[turn.text]

    async def main():
        out = []
        actor = make_actor(out, lambda metadata, **o: Broken(metadata) if metadata["broken"] else Echo(metadata))
        await actor.start()
        await actor.submit([PromptItem(f"p{i}", [1], {"broken": i == 0, "answer": "1"}) for i in range(3)])
        await wait_for(out, 3)
        return {s.group_id: s for s in out}

    samples = run(main())
    ep = samples["p0"].episode
    assert ep.error == "ZeroDivisionError: division by zero"
    assert "1 / 0" in ep.traceback and ep.turns == 1
    # the router scores it 0 as an environment error, whatever the verifier would say
    router = RewardRouter(RewardConfig(type="episode"))
    view = {k: verifier_metadata(s.metadata, s.episode) for k, s in samples.items()}  # what a verifier is given
    reward, info = router("text", view["p0"])
    assert (reward, info["outcome"], info["error"], info["verifier"]) == (
        0.0, "env_error", "ZeroDivisionError: division by zero", "calculator")
    assert router("text", view["p1"])[0] == 3.0  # the episode verifier: the steps' rewards
    monitor = env_error_monitor(0.05)
    report = monitor.observe(info, "text", view["p0"])
    assert format_report(report).startswith("environment error in calculator")
    assert "ZeroDivisionError: division by zero" in format_report(report)


def test_environment_errors_stop_the_run_only_past_their_fraction():
    monitor = env_error_monitor(0.05)
    error = {"outcome": "env_error", "error": "ZeroDivisionError: division by zero", "verifier": "calculator"}
    for i in range(1000):
        monitor.observe(error if i % 50 == 49 else {"outcome": "episode"}, "", {})
    assert monitor.num_errors == 20  # a tool failing 2% of the time: the run goes on
    broken = env_error_monitor(0.05)
    for _ in range(9):
        broken.observe(error, "", {})
    with pytest.raises(RewardErrorsExceeded, match=r"env.max_error_frac=0.05.*ZeroDivisionError"):
        broken.observe(error, "", {})  # an environment that always fails stops at its 10th episode


def test_a_factory_that_fails_and_a_step_that_answers_garbage_are_episode_errors():
    class Garbage(Echo):
        def step(self, turn):
            return Step(observation=[3, 999])  # 999 is past the vocabulary: the engine would fail

    class NaNReward(Echo):
        def step(self, turn):
            return Step(reward=float("nan"), done=True)

    def factory(metadata, **options):
        if metadata["kind"] == "factory":
            raise KeyError("secret")
        kinds = {"garbage": Garbage, "nan": NaNReward}
        return kinds[metadata["kind"]](metadata) if metadata["kind"] in kinds else "not an environment"

    async def main():
        out = []
        actor = make_actor(out, factory)
        await actor.start()
        await actor.submit([PromptItem(k, [1], {"kind": k}) for k in ("factory", "garbage", "str", "nan")])
        await wait_for(out, 4)
        return {s.group_id: s for s in out}

    samples = run(main())
    # a NaN step reward is the environment's error, scored as such, not the verifier's
    assert samples["nan"].episode.error == "ValueError: env.step returned a reward of nan, not a finite number"
    view = verifier_metadata(samples["nan"].metadata, samples["nan"].episode)
    assert RewardRouter(RewardConfig(type="episode"))("", view)[1]["outcome"] == "env_error"
    assert samples["factory"].episode.error == "KeyError: 'secret'"
    assert samples["factory"].response_ids == []
    assert samples["garbage"].episode.error.startswith("TypeError: an observation must be")
    assert samples["str"].episode.error.startswith("AttributeError")


def run(coro):
    return asyncio.run(coro)


def test_a_broken_environment_is_a_config_error_at_start_naming_env_type(tmp_path, monkeypatch):
    from asyncrl.config import ConfigError
    from asyncrl.env.registry import check_agent, check_env

    (tmp_path / "myenvs.py").write_text(
        "class NoStep:\n    def __init__(self, metadata): pass\n"
        "def needs_secret(metadata, secret): return None\n"
        "def agent(base_url): return 1.0\n")
    cases = [("import:nowhere:Env", {}, "cannot import module 'nowhere'"),
             ("import:myenvs:NoStep", {}, "no step\\(turn\\) method"),
             ("import:myenvs:needs_secret", {}, "missing 1 required positional argument: 'secret'"),
             ("calculator", {"max_calls": 0}, "max_calls must be at least 1")]
    for env_type, options, message in cases:
        cfg = EnvConfig(type=env_type, options=options, import_path=[str(tmp_path)])
        with pytest.raises(ConfigError, match=f"env.type={env_type!r}.*{message}"):
            check_env(cfg, {"answer": "1"})
    check_env(EnvConfig(type="calculator"), {"answer": "1"})  # a good one passes
    with pytest.raises(ConfigError, match="must take \\(base_url, metadata\\)"):
        check_agent(EnvConfig(type="agent", agent="myenvs:agent", import_path=[str(tmp_path)]))


def test_a_turn_that_ran_past_its_stop_string_ends_at_it():
    """An in-flight update that aborts a turn inside a stop string lets the resumed request run
    past it (the engine matches stop strings in a request's own output): the turn is cut after
    the token that completes the first one, and the rest never reaches the sample."""
    tok = LetterTokenizer()
    runner = EpisodeRunner(EnvConfig(type="calculator"), Echo, tok)
    ids = tok.encode("abxycdxy")
    assert runner._turn_text(ids, ("xy",)) == ("abxy", 4)
    assert runner._turn_text(ids[:4], ("xy",)) == ("abxy", 4)  # ends at its stop string: kept whole
    assert runner._turn_text(ids, ()) == ("abxycdxy", 8)
    assert runner._turn_text(tok.encode("abcd"), ("xy",)) == ("abcd", 4)
    runner.close()
