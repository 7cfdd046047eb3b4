"""The real inference engine: one vLLM AsyncLLM (continuous batching) per rollout actor.

Only this file (and the weight-sync adapters in asyncrl/sync/) import vllm. It is constructed
inside the actor's process; on CPU the KV cache is sized explicitly (VLLM_CPU_KVCACHE_SPACE)
so several engines and the learner fit on one machine.

Behaviour logprobs are requested in vLLM's `processed_logprobs` mode: the logprob under the
distribution the sampler actually used (after temperature), which is what the learner's ratio
needs; the learner divides its logits by the same temperature.

LoRA (`lora_rank` > 0, learner.lora): the engine serves its base model plus one adapter with vLLM's
LoRA support, never merged weights. Every request names the adapter (`LORA_ID`); a push writes the
new adapter into this engine's own directory and vLLM drops the adapter it held and loads that one
under the same id, so requests kept across the load (`pause`) go on with the new adapter, as they
would with new weights. A model path that is an adapter directory (a LoRA run's checkpoint or final
policy) serves its base with that adapter.

Routing replay (`record_routing`, algo.moe_routing: replay): the engine's workers record which
experts each position was routed to (rollout/routes.py) and each completion carries its rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.compat import hide_broken_torch_extras
from asyncrl.rollout import owner
from asyncrl.rollout.engine import Completion, SamplingSpec
from asyncrl.types import Locate

# Tokens one CPU scheduler step may compute (vLLM's own default for AsyncLLM on CPU).
CPU_STEP_TOKENS = 2048

# On CPU, vLLM's engine process never exits within the 5 s grace its shutdown gives it after
# SIGTERM (its worker alone takes ~4 s to leave), so every shutdown waited 5 s and then killed the
# process tree anyway. Killing after 1 s ends in the same state, 4 s sooner. On GPUs vLLM's own
# grace stays: there a clean exit releases device memory.
CPU_SHUTDOWN_GRACE_S = 1.0

# An eager engine still runs a few small ops of vLLM's through torch.compile (on CPU, the rank of
# each sampled token among the logprobs, at the first request that asks for logprobs): inductor
# traces them and builds C++ in the engine's process, ~2 s of every CPU engine's first step on 2
# cores even when its cache holds the result (the tiny model's first 8 requests with logprobs:
# 1.9 s -> 0.04 s without). Eager, it is a comparison and a sum. Set for the engine's own process only; a value the user
# gave stands.
EAGER_CPU_ENV = {"TORCH_COMPILE_DISABLE": "1"}

LORA_NAME, LORA_ID = "asyncrl-policy", 1  # the one adapter an engine serves; pushes replace it in place
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the `max_lora_rank` values vLLM accepts


log = logging.getLogger(__name__)

RPC_PREFIX = "asyncrl-vllm-rpc-"


def own_rpc_dir() -> str:
    """A directory for this engine's IPC sockets (VLLM_RPC_BASE_PATH), made on the engine's own
    node: vLLM never creates it, and one made by the driver does not exist on other nodes. Named
    with the pid, so the directories of engines killed before their shutdown (whose processes are
    gone) are removed here, by the next engine on the node."""
    for old in Path(tempfile.gettempdir()).glob(f"{RPC_PREFIX}*"):
        pid = old.name.removeprefix(RPC_PREFIX).split("-", 1)[0]
        if pid.isdecimal() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{RPC_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def one_engine_process_on_cpu() -> None:
    """On CPU, run vLLM's model worker inside its engine-core process (the "uni" executor)
    instead of a third process of its own.

    vLLM-CPU otherwise gives the worker its own process: spawned, it imports torch and vLLM once
    more (~10 s of every engine start on 2 cores), and the engine core then spins on a shared-memory
    queue while the worker computes (over half of a core here, taken from the learner). Measured on
    the tiny model, alternating: start 30-32 s -> 18-20 s, tokens/s the same (medians 3,128 and
    3,191 over 15 rounds each; both layouts compute with one torch thread here). vLLM wants its
    own layout on CPU so that it can bind the worker's OpenMP threads to cores in a fresh process:
    an engine given many cores may be faster that way, and setting the variable to 1 brings it
    back. The switch is vLLM's own environment variable; AsyncLLM keeps its engine core in a
    separate process either way."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """`values` in os.environ where not already set, for the duration of the block."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def span_versions(spans, num_tokens: int) -> list[int | None] | None:
    """Each token's weight version from vLLM's spans (`CompletionOutput.weight_versions`, labelled
    by finish_weight_update with the pushed version); None for tokens sampled before any labelled
    load (vLLM's label "default"), and None altogether when vLLM gave no spans."""
    if not spans:
        return None
    out: list[int | None] = [None] * num_tokens
    for span in spans:
        label = int(span.version) if str(span.version).isdecimal() else None
        out[span.start:span.end] = [label] * (span.end - span.start)
    return out


class VLLMEngine:
    def __init__(self, model_path: str, dtype: str = "float32", max_model_len: int = 128,
                 max_num_seqs: int = 256, kv_cache_gib: int = 1, gpu_memory_utilization: float = 0.5,
                 sync_type: str = "gloo", bucket_bytes: int = 256 << 20, seed: int = 0,
                 enforce_eager: bool | None = None, num_gpus: float | None = None, locate: Locate | None = None,
                 tensor_parallel_size: int = 1, stat_loggers: list | None = None, lora_rank: int = 0,
                 record_routing: bool = False):
        # enforce_eager None: on for CPU engines, off on GPU (rollout.enforce_eager); num_gpus: what
        # the actor asked Ray for, checked against what it sees at start (None: not checked)
        self.model_path, self.locate = model_path, locate  # resolved at start, on the engine's node
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache_gib = kv_cache_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.sync_type = sync_type
        self.bucket_bytes = bucket_bytes
        self.seed = seed
        self.enforce_eager, self.num_gpus = enforce_eager, num_gpus
        self.tensor_parallel_size = tensor_parallel_size
        self.stat_loggers = stat_loggers  # vLLM stat-logger factories (its statistics are off without one)
        self.lora_rank = lora_rank  # learner.lora.rank: 0 serves the model's own weights
        self._lora = None  # the LoRARequest every request names, once there is an adapter
        self._head_adapter = False  # whether it adapts the LM head (prompt_logprobs then scores by sampling)
        self._adapter_dir: str | None = None  # where pushes write this engine's adapter
        self.llm = None
        self._templates: dict[tuple, Any] = {}
        self._rpc_dir: str | None = None
        self._rpc_env_before: str | None = None
        self._joined = False  # in a weight-sync group
        self._paused = False  # requests kept in place for a load (pause)
        self.record_routing = record_routing  # algo.moe_routing: replay (rollout/routes.py)
        self.routing_shape: tuple[int, int] | None = None  # (MoE layers, top-k) once recording
        self._route_waiters: dict[str, asyncio.Future] = {}
        self._route_fetch: asyncio.Task | None = None

    async def start(self) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        given = os.environ.get("VLLM_RPC_BASE_PATH")
        if not given or Path(given).name.startswith(RPC_PREFIX):  # a user's own choice stands; not
            # another engine's directory, inherited from a process that ran one (Ray workers get
            # the environment of the driver that started the cluster)
            self._rpc_dir, self._rpc_env_before = own_rpc_dir(), given
            os.environ["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        hide_broken_torch_extras()
        if self.num_gpus is not None:
            from asyncrl.compat import check_gpu_visibility

            check_gpu_visibility("rollout engine", "rollout.num_gpus_per_actor", self.num_gpus)
        one_engine_process_on_cpu()
        if self.locate is not None:  # on this node: the driver's cache path may not exist here
            self.model_path = self.locate(self.model_path)
        if (Path(self.model_path) / "adapter_config.json").is_file():  # serve its base with it
            self._serve_adapter(self.model_path)
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        from asyncrl.sync import vllm_receiver

        kwargs = {**self.engine_kwargs(), **vllm_receiver.engine_kwargs(self.sync_type)}
        if self.record_routing:  # the capture's methods are the worker extension's (gloo sets it too)
            kwargs["worker_extension_cls"] = vllm_receiver.WORKER_EXTENSION
        os.environ[owner.ENV] = owner.owner_token()  # the engine's processes end with this one (owner.py)
        with _environ(EAGER_CPU_ENV if kwargs["enforce_eager"] and current_platform.is_cpu() else {}):
            # the engine core's process is started in here, with this environment
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=self.stat_loggers)
        if self.record_routing:
            self.routing_shape = tuple((await self.llm.collective_rpc("asyncrl_routing_start"))[0])

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM engine arguments without the weight receiver: what a bare `vllm.LLM` of the same
        engine takes (tools/bench_actor.py measures the actor against one)."""
        from vllm.platforms import current_platform

        eager = current_platform.is_cpu() if self.enforce_eager is None else self.enforce_eager
        if self.record_routing and not eager:
            # the capture is a Python hook in each router (rollout/routes.py): a CUDA graph replays the
            # kernels it recorded and never calls it, so every decode step would go unrecorded
            log.warning("algo.moe_routing: replay records routing in eager mode: CUDA graphs are off for this engine")
            eager = True
        kwargs = dict(model=self.model_path, dtype=self.dtype, max_model_len=self.max_model_len,
                      max_num_seqs=self.max_num_seqs, enforce_eager=eager, seed=self.seed,
                      tensor_parallel_size=self.tensor_parallel_size,
                      gpu_memory_utilization=self.gpu_memory_utilization,
                      logprobs_mode="processed_logprobs", disable_log_stats=not self.stat_loggers)
        if self.lora_rank:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(self.lora_rank))
        if current_platform.is_cpu():
            # Every request carries a seed. When chunked prefill splits a prompt across scheduler
            # steps, vLLM rewinds that request's generator with set_offset, which CPU generators
            # do not have: the engine dies ("CPU Generator does not use offset"). It happens when
            # an in-flight update resumes hundreds of requests at once, each re-prefilling its
            # prefix (more prompt tokens than one step's budget). Whole-prompt prefills avoid it.
            kwargs.update(enable_chunked_prefill=False,
                          max_num_batched_tokens=max(self.max_model_len, CPU_STEP_TOKENS))
        return kwargs

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec, request_id: str) -> Completion:
        params = copy.copy(self._params(spec.temperature, spec.top_p, spec.max_tokens, spec.stop))
        params.seed = spec.seed
        # A rendered token input ("type": "token") is processed inline; a raw prompt goes through
        # vLLM's renderer on its thread pool first, a thread hop per request for nothing to render.
        prompt = {"type": "token", "prompt_token_ids": prompt_ids}
        final = None
        async for out in self.llm.generate(prompt, params, request_id, lora_request=self._lora):
            final = out
        seq = final.outputs[0]
        token_ids = list(seq.token_ids)
        logprobs = [pos[tok].logprob for tok, pos in zip(token_ids, seq.logprobs)]
        reason = seq.finish_reason if seq.finish_reason in ("stop", "length") else "abort"
        routes = await self._routes_of(request_id) if self.record_routing else None
        return Completion(token_ids, logprobs, reason, span_versions(seq.weight_versions, len(token_ids)), routes)

    async def _routes_of(self, request_id: str):
        """A finished request's routing, [positions, layers, k] uint8. The requests that finish in one
        event-loop turn are asked for in one call to the engine's workers (a call per request
        would wait behind a scheduler step each)."""
        import numpy as np

        future = asyncio.get_running_loop().create_future()
        self._route_waiters[request_id] = future
        if self._route_fetch is None or self._route_fetch.done():
            self._route_fetch = asyncio.create_task(self._fetch_routes())
        raw = await future
        return np.frombuffer(raw, dtype=np.uint8).reshape(-1, *self.routing_shape)

    async def _fetch_routes(self) -> None:
        await asyncio.sleep(0)  # let the other requests finishing now join this call
        while self._route_waiters:
            waiters, self._route_waiters = self._route_waiters, {}
            try:
                got = (await self.llm.collective_rpc("asyncrl_routing_take", args=(list(waiters),)))[0]
            except Exception as e:
                for future in waiters.values():
                    future.set_exception(e)
                continue
            for rid, future in waiters.items():
                future.set_result(got.get(rid, b""))

    async def pause(self) -> None:
        # "keep": running requests stay scheduled with their KV blocks; clear_cache False, or vLLM
        # would free them (and the prefix cache is not reset after the load either: see load_weights)
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self._paused = False

    async def abort(self, request_ids: list[str]) -> None:
        await self.llm.abort(request_ids)  # each generate() gets a final output, reason "abort"

    def _params(self, temperature: float, top_p: float, max_tokens: int, stop: tuple[str, ...] = ()):
        """One validated SamplingParams per setting; each request takes a copy with its seed
        (building and validating one per request cost ~10% of the actor's process time). The
        template itself never reaches vLLM, so no cached property (sampling_type) is set on it.
        Resumed requests ask for fewer tokens: at most max_tokens templates per setting."""
        key = (temperature, top_p, max_tokens, stop)
        if key not in self._templates:
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind

            # skip_clone: vLLM copies the params of every request it takes; a deep copy cost a tenth
            # of the actor's process. A shallow one is enough: each request already has its own
            # copy (above), and the only state copies share is the stop-token set, to which vLLM
            # adds the same end-of-sequence id every time.
            self._templates[key] = SamplingParams(
                n=1, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                output_kind=RequestOutputKind.FINAL_ONLY, skip_clone=True,
                # rewards decode on their own workers; text here cost ~20% of tokens/s. Stop strings
                # (an environment's turns) need it; the turn keeps the string, and its token ids
                # are what was sampled (vLLM cuts the text at the string, never the ids).
                stop=list(stop) or None, include_stop_str_in_output=bool(stop), detokenize=bool(stop))
        return self._templates[key]

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams

        if self._head_adapter:
            return await self._sampled_logprobs(token_ids)
        # vLLM refuses a prompt that leaves no room for the one token every request generates: a
        # sequence that fills the context (a response cut at max_model_len) is scored as its prefix,
        # whose one generated position gives the last token's logprob (logprob_token_ids)
        full = len(token_ids) >= self.max_model_len
        prompt = token_ids[:-1] if full else token_ids
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0,
                                logprob_token_ids=[token_ids[-1]] if full else None)
        final = None
        async for out in self.llm.generate({"prompt_token_ids": prompt}, params,
                                           f"probe-{os.urandom(4).hex()}", lora_request=self._lora):
            final = out
        # position 0 has no logprob; each later position holds at least the actual token
        logprobs = [pos[tok].logprob for tok, pos in zip(prompt[1:], final.prompt_logprobs[1:])]
        if full:
            logprobs.append(final.outputs[0].logprobs[0][token_ids[-1]].logprob)
        return logprobs

    async def _sampled_logprobs(self, token_ids: list[int]) -> list[float]:
        """`prompt_logprobs` as each prefix's one sampled position (logprob_token_ids), all at once
        (the prefix cache shares their prefill). Under an LM-head adapter vLLM 0.32 computes a
        prompt's logprobs with the head adapter's mapping of the batch's sampled positions, one per
        request, which fails (einsum shapes) whenever other requests share the batch."""
        from vllm import SamplingParams

        async def one(t: int) -> float:
            params = SamplingParams(max_tokens=1, temperature=1.0, logprob_token_ids=[token_ids[t]])
            final = None
            async for out in self.llm.generate({"prompt_token_ids": token_ids[:t]}, params,
                                               f"probe-{os.urandom(4).hex()}", lora_request=self._lora):
                final = out
            return final.outputs[0].logprobs[0][token_ids[t]].logprob

        return list(await asyncio.gather(*(one(t) for t in range(1, len(token_ids)))))

    async def init_weight_sync(self, host: str, port: int, rank: int, world_size: int,
                               timeout_s: float, join_timeout_s: float | None = None) -> None:
        from asyncrl.sync import vllm_receiver

        if self._joined:  # a rebuilt group: release the old communicator first (else it leaks)
            await self.llm.shutdown_weight_transfer_engine()
        await vllm_receiver.init_receiver(self.llm, host, port, rank, world_size, timeout_s,
                                          kind=self.sync_type, bucket_bytes=self.bucket_bytes,
                                          join_timeout_s=join_timeout_s)
        self._joined = True

    async def load_weights(self, metadata: dict[str, Any], version: int) -> dict[str, float]:
        from asyncrl.sync import vllm_receiver

        adapter = "adapter" in metadata["update_info"]
        if adapter:  # written by the engine's first worker, on this node
            if self._adapter_dir is None:
                self._adapter_dir = tempfile.mkdtemp(prefix="asyncrl-lora-", dir=_fast_tmp())
            metadata = {**metadata, "update_info": {**metadata["update_info"], "adapter_dir": self._adapter_dir}}
        # kept requests hold their KV blocks, and vLLM resets the prefix cache only by preempting
        # them (a prefill again, what keeping them avoids): with requests paused it stays, and new
        # requests may reuse prefix blocks the old weights wrote, the mismatch keep_kv accepts
        stats = await vllm_receiver.receive_weights(self.llm, metadata, version, reset_prefix_cache=not self._paused)
        if self.record_routing:  # prompt prefills of the old weights: no longer what a cache hit reuses
            await self.llm.collective_rpc("asyncrl_routing_forget_prefixes")
        if adapter:
            await self._serve_adapter_now(self._adapter_dir)
        else:  # whole weights (another saved policy, `asyncrl evaluate`): served as they are
            self._lora, self._head_adapter = None, False
        return stats

    def _serve_adapter(self, path: str) -> None:
        """Before start: an adapter directory as the model path, i.e. its base plus it."""
        import json

        config = json.loads((Path(path) / "adapter_config.json").read_text())
        from vllm.lora.request import LoRARequest

        self.model_path = config["base_model_name_or_path"]
        self.lora_rank = max(self.lora_rank, int(config["r"]))
        self._lora = LoRARequest(LORA_NAME, LORA_ID, path)
        self._head_adapter = adapts_head(path)

    async def _serve_adapter_now(self, path: str) -> None:
        """Replace the adapter vLLM holds under LORA_ID by the one in `path` (requests naming the
        id, running or kept, use it from their next token on)."""
        from vllm.lora.request import LoRARequest

        if self._lora is not None:
            await self.llm.remove_lora(LORA_ID)
        self._lora = LoRARequest(LORA_NAME, LORA_ID, path)
        self._head_adapter = adapts_head(path)
        if not await self.llm.add_lora(self._lora):
            raise RuntimeError(f"vLLM did not load the pushed LoRA adapter from {path}")

    async def shutdown(self) -> None:
        if self.llm is not None:
            from vllm.platforms import current_platform

            self.llm.shutdown(timeout=CPU_SHUTDOWN_GRACE_S if current_platform.is_cpu() else None)
            self.llm = None
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            if self._rpc_env_before is None:  # what the process had before this engine
                os.environ.pop("VLLM_RPC_BASE_PATH", None)
            else:
                os.environ["VLLM_RPC_BASE_PATH"] = self._rpc_env_before
            self._rpc_dir = None


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above the largest vLLM serves ({VLLM_LORA_RANKS[-1]})")


def adapts_head(adapter_dir: str) -> bool:
    """Whether the peft adapter in `adapter_dir` has a layer on the LM head (lm_head)."""
    import json

    targets = json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("target_modules") or []
    return not isinstance(targets, str) and any(t == "lm_head" or t.endswith(".lm_head") for t in targets)


def served_embedding_adapters(architecture: str) -> set[str]:
    """The embedding layers (module-name suffixes, e.g. embed_tokens and lm_head) on which vLLM
    serves LoRA adapters for a model of this Hugging Face architecture: its model class's
    `embedding_modules` (Llama's names both; vLLM 0.32's Qwen2 names none). Empty for an
    architecture vLLM has no class of its own for."""
    hide_broken_torch_extras()
    from vllm.model_executor.models import ModelRegistry

    entry = ModelRegistry.models.get(architecture)
    return set(getattr(entry.load_model_cls(), "embedding_modules", None) or ()) if entry is not None else set()


def _fast_tmp() -> str | None:
    """/dev/shm where there is one (an adapter is written and read once per push), else the default."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
