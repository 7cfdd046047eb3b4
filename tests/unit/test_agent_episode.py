"""Agent episodes (rollout/agent_episode.py) through the real openai client and the actor's
endpoint (rollout/agent_endpoint.py), with a scripted actor and the character tokenizer: the calls
stitched into one sample, token for token, with the engine's logprobs and versions."""

import asyncio
import threading

import openai
import pytest

from asyncrl.reward.episode_reward import env_failure, episode_reward, verifier_metadata
from asyncrl.rollout.actor import RolloutActor
from asyncrl.rollout import agent_episode
from asyncrl.rollout.agent_episode import AgentFailed, AgentRunner, LastCall, Stitched, agent_reward, extend, stitch
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.fake_engine import FakeEngine
from asyncrl.tiny.tokenizer import build_tokenizer
from asyncrl.types import EpisodeStatus, PromptItem

# Role markers and an end-of-turn token with a newline after it, as real templates have (Qwen's
# "<|im_end|>\n"): the newline is template text the model never sampled, so it must be observed.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
EOS = 1  # <|endoftext|>


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer(model_max_length=4096)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def reply(tok, text, versions, eos=True):
    """A scripted completion: the text's ids (+ end of turn) and each token's version."""
    ids = enc(tok, text) + ([EOS] if eos else [])
    return ids, versions if isinstance(versions, list) else [versions] * len(ids)


class ScriptedActor:
    """RolloutActor.complete's contract: the next scripted reply, cut at spec.max_tokens ("length"),
    its k-th token overall given logprob -0.01 * (k + 1)."""

    def __init__(self, replies, delay_s=0.0):
        self.actor_id, self.version = 7, 0
        self.replies, self.delay_s = list(replies), delay_s
        self.requests = []
        self.num_tokens = 0

    async def complete(self, prompt_ids, spec, name, abortable=True):
        self.requests.append((list(prompt_ids), spec, name))
        await asyncio.sleep(self.delay_s)
        ids, versions = self.replies.pop(0)
        cut = len(ids) > spec.max_tokens
        ids, versions = ids[:spec.max_tokens], versions[:spec.max_tokens]
        logprobs = [-0.01 * (self.num_tokens + k + 1) for k in range(len(ids))]
        self.num_tokens += len(ids)
        self.version = versions[-1]
        return ids, logprobs, versions, "length" if cut else "stop"


def run_episodes(runner, actor, prompts, max_tokens=200):
    async def main():
        try:
            spec = SamplingSpec(1.0, 1.0, max_tokens)
            return await asyncio.gather(*[runner.run(actor, p, i, spec, f"{p.prompt_id}-{i}")
                                          for i, p in enumerate(prompts)])
        finally:
            await runner.aclose()
    return asyncio.run(main())


def chat(client, messages, **kwargs):
    r = client.chat.completions.create(model="whatever", messages=messages, **kwargs)
    return r, r.choices[0].message.content


def test_three_chat_turns_are_one_sample_of_the_engines_tokens_logprobs_and_versions(tok):
    r1 = reply(tok, "calc 2+2", 0)
    r2 = reply(tok, "calc 4*3", [0, 0, 0, 1, 1, 1, 1, 1, 1])  # a weight update inside the second call
    r3 = reply(tok, "answer 12", 1)
    actor = ScriptedActor([r1, r2, r3])
    seen, metadata_seen = [], []

    def agent(base_url, metadata):
        metadata_seen.append(metadata)
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": metadata["question"]}]
        for observation in ("4", "12", None):
            r, content = chat(client, messages, max_tokens=50, temperature=0.1)
            seen.append(r)
            if observation is not None:
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": observation}]
        return 1.5, {"tool_calls": 2}

    p = PromptItem("p0", [5, 6], {"question": "2+2, then *3?"})
    [sample] = run_episodes(AgentRunner(agent, tok), actor, [p])

    prompt = enc(tok, "user: 2+2, then *3?<|endoftext|>\nassistant: ")
    obs1 = enc(tok, "\nuser: 4<|endoftext|>\nassistant: ")
    obs2 = enc(tok, "\nuser: 12<|endoftext|>\nassistant: ")
    assert sample.prompt_ids == prompt
    assert sample.response_ids == r1[0] + obs1 + r2[0] + obs2 + r3[0]
    assert sample.loss_mask == ([1] * len(r1[0]) + [0] * len(obs1) + [1] * len(r2[0]) + [0] * len(obs2)
                                + [1] * len(r3[0]))
    assert sample.versions == r1[1] + [0] * len(obs1) + r2[1] + [1] * len(obs2) + r3[1]
    model_lps = [-0.01 * (k + 1) for k in range(len(r1[0]) + len(r2[0]) + len(r3[0]))]
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == model_lps
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    # The engine was given the stitched ids, and the run's sampling settings, not the agent's.
    assert actor.requests[1][0] == prompt + r1[0] + obs1
    assert actor.requests[2][0] == prompt + r1[0] + obs1 + r2[0] + obs2
    assert [spec.temperature for _, spec, _ in actor.requests] == [1.0] * 3
    assert [spec.max_tokens for _, spec, _ in actor.requests] == [50] * 3
    assert len({name for _, _, name in actor.requests}) == 3
    first = seen[0]
    assert first.choices[0].message.content == "calc 2+2" and first.choices[0].finish_reason == "stop"
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(prompt), len(r1[0]))
    assert first.object == "chat.completion" and first.model == "asyncrl-policy"
    record = sample.episode
    assert (record.turns, record.calls, record.unstitched_calls) == (3, 3, 0)
    assert record.observation_tokens == len(obs1) + len(obs2)
    assert (record.reward, record.tool_calls, record.info) == (1.5, 2, {"tool_calls": 2})
    n1, n2 = len(r1[0]), len(r1[0]) + len(obs1)
    assert record.spans[:3] == [[0, n1, "model"], [n1, n2, "env"], [n2, n2 + len(r2[0]), "model"]]
    assert record.error is None and sample.finish_reason == "stop" and sample.actor_id == 7
    assert episode_reward("", verifier_metadata(sample.metadata, sample.episode)) == (1.5, {"outcome": "episode"})
    assert metadata_seen[0]["prompt_ids"] == [5, 6] and metadata_seen[0]["question"] == "2+2, then *3?"
    assert "prompt_ids" not in sample.metadata
    sample.validate()


def test_completion_calls_stitch_an_ids_prompt_and_a_stop_string_the_agent_left_out(tok):
    r1 = reply(tok, "<calc>2+2</calc>", 0, eos=False)
    r2 = reply(tok, "<calc>4*3</calc>", 0, eos=False)
    r3 = reply(tok, "A: 12", 0)
    actor = ScriptedActor([r1, r2, r3])
    texts = []

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        a = client.completions.create(model="m", prompt=metadata["prompt_ids"], stop=["</calc>"])
        text = metadata["prompt_text"] + a.choices[0].text + "</calc>\n= 4\n"  # the stop string put back
        b = client.completions.create(model="m", prompt=text, stop="</calc>")
        text += b.choices[0].text + "\n= 12\n"  # ... and here left out
        c = client.completions.create(model="m", prompt=text)
        texts.extend([a.choices[0].text, b.choices[0].text, c.choices[0].text])
        return 1.0

    p = PromptItem("p0", enc(tok, "Q: 2+2 *3?\n"), {})
    [sample] = run_episodes(AgentRunner(agent, tok), actor, [p])
    assert texts == ["<calc>2+2", "<calc>4*3", "A: 12"]
    obs1, obs2 = enc(tok, "\n= 4\n"), enc(tok, "\n= 12\n")
    assert sample.prompt_ids == p.prompt_ids
    # The second stop string stays in the sample as sampled, though the agent's text dropped it.
    assert sample.response_ids == r1[0] + obs1 + r2[0] + obs2 + r3[0]
    assert actor.requests[2][0] == p.prompt_ids + sample.response_ids[:-len(r3[0])]
    assert actor.requests[0][1].stop == ("</calc>",)
    assert sample.episode.unstitched_calls == 0


def test_an_agent_that_edits_history_is_served_but_only_consistent_calls_are_stitched(tok):
    r1, r2, r3, r4 = (reply(tok, t, 0) for t in ("one", "two", "side", "four"))
    actor = ScriptedActor([r1, r2, r3, r4])

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        m = [{"role": "user", "content": "Q"}]
        m += [{"role": "assistant", "content": chat(client, m)[1]}, {"role": "user", "content": "o1"}]
        m += [{"role": "assistant", "content": chat(client, m)[1]}, {"role": "user", "content": "o2"}]
        edited = [{"role": "user", "content": "Q, shorter"}] + m[1:]
        assert chat(client, edited)[1] == "side"  # served from its own rendering
        assert chat(client, m)[1] == "four"  # extends the stitched calls again
        return 0.0

    [sample] = run_episodes(AgentRunner(agent, tok), actor, [PromptItem("p0", [5], {})])
    prompt = enc(tok, "user: Q<|endoftext|>\nassistant: ")
    obs1, obs2 = enc(tok, "\nuser: o1<|endoftext|>\nassistant: "), enc(tok, "\nuser: o2<|endoftext|>\nassistant: ")
    assert sample.response_ids == r1[0] + obs1 + r2[0] + obs2 + r4[0]
    edited_prompt = enc(tok, "user: Q, shorter<|endoftext|>\nassistant: one<|endoftext|>\nuser: o1<|endoftext|>\n"
                             "assistant: two<|endoftext|>\nuser: o2<|endoftext|>\nassistant: ")
    assert actor.requests[2][0] == edited_prompt
    assert actor.requests[3][0] == prompt + sample.response_ids[:-len(r4[0])]
    # The unstitched call's tokens still count against the budget.
    assert actor.requests[3][1].max_tokens == 200 - len(r1[0] + obs1 + r2[0] + obs2) - len(r3[0])
    record = sample.episode
    assert (record.turns, record.calls, record.unstitched_calls) == (3, 4, 1)
    assert record.reward == 0.0 and record.error is None


def test_a_retried_call_after_an_empty_reply_is_served_from_its_own_prompt_and_what_follows_is_context(tok):
    actor = ScriptedActor([reply(tok, "", 0), reply(tok, "ab", 0, eos=False), reply(tok, "c", 0, eos=False)])

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        assert client.completions.create(model="m", prompt="Q:").choices[0].text == ""
        assert client.completions.create(model="m", prompt="Q:").choices[0].text == "ab"  # the retry
        client.completions.create(model="m", prompt="Q:ab")  # builds on the empty reply's prompt
        return 0.0

    [sample] = run_episodes(AgentRunner(agent, tok), actor, [PromptItem("p0", [5], {})])
    # the retry is served from its own prompt and left out; the call after it extends the
    # episode's first call (what follows an empty reply is the agent's text, as after any
    # reply): its "ab" is context the engine was given after the sampled end of sequence
    assert [prompt for prompt, _, _ in actor.requests] == [enc(tok, "Q:"), enc(tok, "Q:"),
                                                           enc(tok, "Q:") + [EOS] + enc(tok, "ab")]
    assert sample.response_ids == [EOS] + enc(tok, "ab") + enc(tok, "c")
    assert sample.loss_mask == [1, 0, 0, 1] and sample.episode.unstitched_calls == 1


def test_an_agent_that_raises_ends_its_own_episode_and_the_runner_goes_on(tok):
    actor = ScriptedActor([reply(tok, "hi", 0), reply(tok, "ok", 0)])

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        chat(client, [{"role": "user", "content": "Q"}])
        if metadata["fail"]:
            raise ValueError("the tool broke")
        return 1.0

    runner = AgentRunner(agent, tok)
    broken, fine = run_episodes(runner, actor, [PromptItem("p0", [5], {"fail": True}),
                                                PromptItem("p1", [5], {"fail": False})])
    record = broken.episode
    assert record.error == "ValueError: the tool broke"
    assert 'raise ValueError("the tool broke")' in record.traceback
    assert record.reward is None and record.turns == 1
    assert broken.response_ids == reply(tok, "hi", 0)[0] or broken.response_ids == reply(tok, "ok", 0)[0]
    assert env_failure(verifier_metadata(broken.metadata, broken.episode))["outcome"] == "env_error"
    assert fine.episode.error is None and fine.episode.reward == 1.0
    assert env_failure(verifier_metadata(fine.metadata, fine.episode)) is None


def test_an_agent_that_hangs_times_out_and_its_late_calls_get_404(tok):
    actor = ScriptedActor([reply(tok, "hi", 0)])
    release, late = threading.Event(), []

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        chat(client, [{"role": "user", "content": "Q"}])
        release.wait(10)
        try:
            chat(client, [{"role": "user", "content": "Q"}])
        except openai.NotFoundError as e:
            late.append(e)

    async def hangs(base_url, metadata):
        await asyncio.sleep(30)

    async def main():
        runner, coroutine_runner = AgentRunner(agent, tok, episode_timeout_s=0.3), AgentRunner(hangs, tok, 0.2)
        spec = SamplingSpec(1.0, 1.0, 100)
        sample = await runner.run(actor, PromptItem("p0", [5], {}), 0, spec, "p0-0")
        coroutine_sample = await asyncio.wait_for(coroutine_runner.run(actor, PromptItem("p1", [5], {}), 0, spec,
                                                                       "p1-0"), 2)
        release.set()
        for _ in range(200):
            if late:
                break
            await asyncio.sleep(0.01)
        await runner.aclose()
        await coroutine_runner.aclose()
        return sample, coroutine_sample

    sample, coroutine_sample = asyncio.run(main())
    assert sample.episode.error == ("TimeoutError: the agent ran past env.episode_timeout_s=0.3s of its own time (its "
                                    "calls' time in the engine not counted)")
    assert sample.response_ids == reply(tok, "hi", 0)[0]
    assert coroutine_sample.episode.error.startswith("TimeoutError")
    assert len(late) == 1 and "no running episode" in late[0].message


def test_the_agent_timeout_counts_its_own_time_not_its_calls_in_a_busy_engine(tok):
    async def agent(base_url, metadata):  # 0.2 s of its own, 2 x 0.4 s in the engine
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)

        def ask(text):
            return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])

        await asyncio.sleep(0.1)
        await ask("Q")
        await ask("R")
        await asyncio.sleep(0.1)
        return 1.0

    actor = ScriptedActor([reply(tok, "hi", 0)] * 3, delay_s=0.4)
    [sample] = run_episodes(AgentRunner(agent, tok, episode_timeout_s=0.35), actor, [PromptItem("p0", [5], {})])
    assert sample.episode.error is None and sample.episode.reward == 1.0  # 1 s of wall time, 0.2 s its own
    assert 0.2 <= sample.episode.env_s < 0.35
    slow = ScriptedActor([reply(tok, "hi", 0)] * 3, delay_s=0.4)
    [late] = run_episodes(AgentRunner(agent, tok, episode_timeout_s=0.15), slow, [PromptItem("p0", [5], {})])
    assert late.episode.error.startswith("TimeoutError: the agent ran past env.episode_timeout_s=0.15s")


def test_agent_time_is_wall_time_less_its_calls_time_in_the_engine():
    log = agent_episode.CallLog()
    log.call_started(1.0)
    assert log.agent_s(0.0, 2.5) == 1.0  # the open call's 1.5 s not counted
    log.call_ended(4.0)
    log.call_started(6.0)
    assert log.agent_s(0.0, 7.0) == 3.0  # 7 - 3 - 1 (the open call)
    log.call_ended(8.0)
    assert (log.agent_s(0.0, 10.0), log.engine_s) == (5.0, 5.0)


def test_the_agent_timeout_default_is_an_environment_episode_s_time():
    from asyncrl.config.env_section import EnvConfig

    assert EnvConfig(type="agent", agent="m:f").agent_timeout_s == 4 * 30.0
    assert EnvConfig(type="agent", agent="m:f", max_turns=2, step_timeout_s=5).agent_timeout_s == 10.0
    assert EnvConfig(type="agent", agent="m:f", episode_timeout_s=7).agent_timeout_s == 7.0


def test_a_long_running_agent_episode_is_named_as_such_for_a_stalled_run(tok, monkeypatch):
    monkeypatch.setattr(agent_episode, "LONG_EPISODE_S", 0.1)
    seen = []

    async def slow(base_url, metadata):
        await asyncio.sleep(0.3)
        return 1.0

    async def main():
        runner = AgentRunner(slow, tok, episode_timeout_s=5)
        episode = asyncio.ensure_future(runner.run(ScriptedActor([]), PromptItem("p0", [5], {}), 0,
                                                   SamplingSpec(1.0, 1.0, 100), "p0-0"))
        seen.append(runner.stuck())  # just started
        await asyncio.sleep(0.2)
        seen.append(runner.stuck())  # past LONG_EPISODE_S
        await episode
        seen.append(runner.stuck())  # ended
        await runner.aclose()

    asyncio.run(main())
    assert seen == [None, "1 agent episode(s) running for over 0.1s (env.episode_timeout_s=5s): the agent "
                          "may hang or wait on something", None]


def test_a_used_up_token_budget_cuts_then_refuses_calls(tok):
    actor = ScriptedActor([reply(tok, "abcde", 0, eos=False), reply(tok, "123456", 0, eos=False)])
    seen = []

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        text = "Q:"
        a = client.completions.create(model="m", prompt=text, max_tokens=100)
        text += a.choices[0].text + "xyz"
        b = client.completions.create(model="m", prompt=text)
        seen.append(b.choices[0].finish_reason)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="m", prompt=text + b.choices[0].text + ".")
        seen.append(refused.value.message)
        return 1.0

    [sample] = run_episodes(AgentRunner(agent, tok), actor, [PromptItem("p0", [5], {})], max_tokens=12)
    assert actor.requests[0][1].max_tokens == 12  # the agent's 100, capped by the budget
    assert actor.requests[1][1].max_tokens == 12 - 5 - 3
    assert len(actor.requests) == 2
    assert seen[0] == "length" and "token budget (rollout.max_tokens=12" in seen[1]
    assert sample.response_ids == enc(tok, "abcdexyz1234")
    assert sample.finish_reason == "length" and sample.episode.reward == 1.0


def test_an_agent_that_raises_on_its_used_up_budget_is_truncated_not_an_error(tok):
    actor = ScriptedActor([reply(tok, "abcdefgh", 0, eos=False)])

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        a = client.completions.create(model="m", prompt="Q:")
        client.completions.create(model="m", prompt="Q:" + a.choices[0].text + "?")  # 400: raises
        return 1.0

    [sample] = run_episodes(AgentRunner(agent, tok), actor, [PromptItem("p0", [5], {})], max_tokens=8)
    assert sample.episode.status == EpisodeStatus.TRUNCATED and sample.episode.error is None
    assert sample.finish_reason == "length" and sample.episode.reward is None
    assert sample.response_ids == enc(tok, "abcdefgh")
    assert episode_reward("", verifier_metadata(sample.metadata, sample.episode))[1]["outcome"] != "env_error"


def test_the_endpoint_refuses_what_it_does_not_serve_and_unknown_or_busy_episodes(tok):
    # the second call must come while the first is in the engine: 0.05 s was shorter than a full
    # garbage collection after this module's other tests, which once let the first call end first
    actor = ScriptedActor([reply(tok, "hi", 0), reply(tok, "again", 0)], delay_s=0.5)
    outcomes = {}

    async def agent(base_url, metadata):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        outcomes["models"] = [m.id for m in (await client.models.list()).data]
        m = [{"role": "user", "content": "Q"}]
        for key, kwargs in {"n": {"n": 2}, "stream": {"stream": True}, "tools": {"tools": [
                {"type": "function", "function": {"name": "f", "parameters": {}}}]}}.items():
            try:
                await client.chat.completions.create(model="m", messages=m, **kwargs)
            except openai.BadRequestError as e:
                outcomes[key] = e.message
        both = await asyncio.gather(*[client.chat.completions.create(model="m", messages=m) for _ in range(2)],
                                    return_exceptions=True)
        outcomes["both"] = sorted(type(r).__name__ for r in both)
        return 1.0

    async def main():
        runner = AgentRunner(agent, tok)
        await runner.start()
        bogus = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{runner.endpoint.port}/episodes/nope/v1",
                                   api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no running episode 'nope'"):
            await bogus.completions.create(model="m", prompt="Q")
        sample = await runner.run(actor, PromptItem("p0", [5], {}), 0, SamplingSpec(1.0, 1.0, 100), "p0-0")
        await runner.aclose()
        return sample

    sample = asyncio.run(main())
    assert outcomes["models"] == ["asyncrl-policy"]
    assert "n=2" in outcomes["n"] and "streaming" in outcomes["stream"] and "tools" in outcomes["tools"]
    assert outcomes["both"] == ["ChatCompletion", "ConflictError"]
    assert len(actor.requests) == 1 and sample.episode.calls == 1


def test_an_engine_failure_is_raised_from_the_episode_at_once(tok):
    class Broken(ScriptedActor):
        async def complete(self, prompt_ids, spec, name, abortable=True):
            raise RuntimeError("engine died")

    release, seen = threading.Event(), []

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        try:
            chat(client, [{"role": "user", "content": "Q"}])
        except openai.InternalServerError as e:
            seen.append(e.message)
        release.wait(10)  # an agent that goes on does not hold the failure back

    async def main():
        runner = AgentRunner(agent, tok, episode_timeout_s=5)
        try:
            with pytest.raises(RuntimeError, match="engine died"):
                await runner.run(Broken([]), PromptItem("p0", [5], {}), 0, SamplingSpec(1.0, 1.0, 100), "p0-0")
            for _ in range(200):  # the agent, still held, has its answer
                if seen:
                    break
                await asyncio.sleep(0.01)
        finally:
            release.set()
            await runner.aclose()

    asyncio.run(main())
    assert "the engine failed: RuntimeError('engine died')" in seen[0]


def test_concurrent_episodes_on_one_endpoint_each_get_their_own_calls(tok):
    class Echo(ScriptedActor):
        """Answers each prompt with its question's last letter, as many times as turns so far."""

        async def complete(self, prompt_ids, spec, name, abortable=True):
            await asyncio.sleep(0.01)
            text = tok.decode(prompt_ids, skip_special_tokens=True)
            ids = enc(tok, text.split(": ")[1][0] * text.count("assistant: ")) + [EOS]
            return ids, [0.0] * len(ids), [0] * len(ids), "stop"

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        m = [{"role": "user", "content": metadata["q"]}]
        m += [{"role": "assistant", "content": chat(client, m)[1]}, {"role": "user", "content": "."}]
        return float(chat(client, m)[1] == metadata["q"] * 2)

    prompts = [PromptItem(f"p{q}", [5], {"q": q}) for q in "wxyz"]
    samples = run_episodes(AgentRunner(agent, tok), Echo([]), prompts)
    for q, s in zip("wxyz", samples):
        assert s.episode.reward == 1.0
        obs = enc(tok, "\nuser: .<|endoftext|>\nassistant: ")
        assert s.response_ids == enc(tok, q) + [EOS] + obs + enc(tok, q * 2) + [EOS]


def test_a_rollout_actor_runs_agent_episodes_across_a_weight_update_and_stops_its_endpoint(tok):
    entered, gate = threading.Event(), threading.Event()

    def agent(base_url, metadata):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        m = [{"role": "user", "content": "Q"}]
        m += [{"role": "assistant", "content": chat(client, m, max_tokens=4)[1]}, {"role": "user", "content": "o"}]
        entered.set()  # the first call is sampled: hold the episode while the weights change
        gate.wait(10)
        chat(client, m, max_tokens=4)
        return 1.0

    async def main():
        out = []
        actor = RolloutActor(0, lambda: FakeEngine(vocab_size=16, eos_id=EOS, delay_s=0.002),
                             SamplingSpec(1.0, 1.0, 64), group_size=1, emit=out.append, seed=3,
                             episodes=lambda: AgentRunner(agent, tok))
        await actor.start()
        await actor.submit([PromptItem("p0", [5], {})])
        while not entered.is_set():
            await asyncio.sleep(0.005)
        await actor.update_weights({}, version=1)
        gate.set()
        while not out:
            await asyncio.sleep(0.005)
        port = actor.episodes.endpoint.port
        await actor.shutdown()
        await asyncio.sleep(0.05)  # the endpoint stops in a task of the loop
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        return out[0], actor.engine

    try:
        s, engine = asyncio.run(main())
    finally:
        gate.set()
    s.validate()
    record = s.episode
    assert record.turns == 2 and record.reward == 1.0 and record.error is None
    model = [i for i, m in enumerate(s.loss_mask) if m]
    assert 0 in s.loss_mask and sorted(set(s.versions[i] for i in model)) == [0, 1]
    for i in model:  # each model token's behaviour logprob is that of the weights that sampled it
        assert s.logprobs[i] == pytest.approx(engine.logprob_at(s.versions[i]), abs=1e-12)
    assert s.versions == sorted(s.versions)


def test_an_agents_return_value_is_read_as_a_reward():
    assert agent_reward(None) == (None, {})
    assert agent_reward(2) == (2.0, {})
    assert agent_reward((0.5, {"path": object, "n": 1})) == (0.5, {"path": str(object), "n": 1})
    for bad in ("1.0", float("nan"), (1.0, "info"), [1.0]):
        with pytest.raises(AgentFailed):
            agent_reward(bad)


def test_extend_and_stitch_are_pure_and_build_the_columns_by_hand():
    """Two calls stitched by hand, without a server or an actor: the second call's prompt text is the
    first's + its reply + the end-of-turn tail + observation text; the observation is masked, at the
    version of the model token before it; the record it was stitched into is unchanged."""
    encode = lambda text: [ord(c) for c in text]  # noqa: E731  (one id a character)
    empty = Stitched()
    ids, obs = extend(empty, "Q:", None, encode)
    assert ids == [81, 58] and obs == []
    one = stitch(empty, ids, obs, [65, 1], [-0.5, -0.25], [3, 3], LastCall("Q:", "A", "<eos>"), "stop", version=9)
    assert empty == Stitched()  # pure: the record it was given is as it was
    assert (one.prompt_ids, one.tokens, one.mask, one.spans) == ([81, 58], [65, 1], [1, 1], [[0, 2, "model"]])
    ids, obs = extend(one, "Q:A<eos>ok", None, encode)  # the tail is already in the sample
    assert obs == [111, 107] and ids == [81, 58, 65, 1, 111, 107]
    two = stitch(one, ids, obs, [66], [-0.125], [4], LastCall("Q:A<eos>ok", "B", None), "length", version=9)
    assert two.tokens == [65, 1, 111, 107, 66] and two.mask == [1, 1, 0, 0, 1]
    assert two.logprobs == [-0.5, -0.25, 0.0, 0.0, -0.125] and two.versions == [3, 3, 3, 3, 4]
    assert two.spans == [[0, 2, "model"], [2, 4, "env"], [4, 5, "model"]]
    assert (two.turns, two.observation_tokens, two.finish_reason) == (2, 2, "length")
    assert one.tokens == [65, 1] and one.spans == [[0, 2, "model"]]
    # a call that rewrote the history does not extend the episode; one given ids that continue it does
    assert extend(two, "Q:X", None, encode)[1] is None
    assert extend(two, None, [81, 58, 65, 1, 111, 107, 66, 5], encode) == ([81, 58, 65, 1, 111, 107, 66, 5], [5])
