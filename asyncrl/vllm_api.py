"""Every name asyncrl takes from vLLM and how it calls each one: what a vLLM upgrade must keep.

asyncrl reaches into parts of vLLM that change between minor versions without a deprecation
period: the weight-transfer engines, layerwise reload, the CPU GEMM dispatch, the engine
arguments. When one of them is renamed, the failure comes late. It shows at the first weight
push, minutes into a run, or, on the NCCL path, only on GPUs, which CI never has. SURFACE
lists the names; `check` compares one of them with the installed vLLM, on CPU, without
starting an engine. tests/unit/test_vllm_api_conformance.py runs it for every entry and scans
asyncrl/ so that no call into vLLM is left out of the table. pyproject.toml pins the `cpu` and
`gpu` extras to the minor version that test passed on.

How arguments are written (`call`, and each method in `methods`): the names vLLM's signature gives
the arguments asyncrl passes. The positional ones come first, in order, then "*", then the
keyword ones, as in a `def`. `check` binds them to the signature, so a renamed, reordered or
removed parameter, or a new required one, is reported with the entry's name.

Importing this module imports nothing from vLLM; `check` imports the entry it checks.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VllmName:
    """One vLLM name asyncrl uses."""

    where: str
    """`module:attribute` (the attribute may be dotted)."""
    used_by: str
    """The asyncrl file(s) that use it, for the failure message."""
    call: tuple[str, ...] | None = None
    """The arguments asyncrl calls it with (None: asyncrl does not call it)."""
    methods: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Methods asyncrl calls, or overrides in a subclass, and their arguments as in `call`."""
    awaited: tuple[str, ...] = ()
    """The methods asyncrl awaits or iterates with `async for`: they must stay async."""
    attrs: tuple[str, ...] = ()
    """Attributes, fields, members or keys asyncrl reads or sets."""

    @property
    def label(self) -> str:
        return self.where.replace(":", ".")


ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
WEIGHT_TRANSFER_ENGINE = "vllm.distributed.weight_transfer.base:WeightTransferEngine"
ENVIRONMENT = "vllm.envs:environment_variables"

SURFACE: list[VllmName] = [
    # --- the rollout engine (rollout/vllm_engine.py)
    VllmName("vllm:AsyncEngineArgs", "rollout/vllm_engine.py, sync/vllm_receiver.py (engine_kwargs)",
             call=("*", "model", "dtype", "max_model_len", "max_num_seqs", "enforce_eager", "seed",
                   "tensor_parallel_size", "gpu_memory_utilization", "logprobs_mode", "disable_log_stats", "enable_chunked_prefill",
                   "max_num_batched_tokens", "weight_transfer_config", "worker_extension_cls", "enable_lora",
                   "max_loras", "max_lora_rank")),
    VllmName(ASYNC_LLM, "rollout/vllm_engine.py, sync/vllm_receiver.py (the engine an actor holds, `llm`)",
             methods={"from_engine_args": ("engine_args", "*", "stat_loggers"),
                      "generate": ("prompt", "sampling_params", "request_id", "*", "lora_request"),
                      "add_lora": ("lora_request",),
                      "remove_lora": ("lora_id",),
                      "abort": ("request_id",),
                      "shutdown": ("*", "timeout"),
                      "init_weight_transfer_engine": ("request",),
                      "shutdown_weight_transfer_engine": (),
                      "start_weight_update": (),
                      "update_weights": ("request",),
                      "finish_weight_update": ("*", "weight_version"),
                      "reset_prefix_cache": ("*", "reset_running_requests"),
                      "pause_generation": ("*", "mode", "clear_cache"),
                      "resume_generation": (),
                      "collective_rpc": ("method", "*", "args")},
             awaited=("generate", "abort", "init_weight_transfer_engine", "shutdown_weight_transfer_engine",
                      "start_weight_update",
                      "update_weights", "finish_weight_update", "reset_prefix_cache", "pause_generation",
                      "resume_generation", "collective_rpc", "add_lora", "remove_lora")),
    VllmName("vllm.lora.request:LoRARequest", "rollout/vllm_engine.py (the adapter of a LoRA policy)",
             call=("lora_name", "lora_int_id", "lora_path")),
    # which embedding layers a model's class serves adapters on (served_embedding_adapters)
    VllmName("vllm.model_executor.models:ModelRegistry", "rollout/vllm_engine.py (served_embedding_adapters)",
             attrs=("models",)),
    VllmName("vllm.model_executor.models.registry:_LazyRegisteredModel",
             "rollout/vllm_engine.py (a ModelRegistry.models entry)", methods={"load_model_cls": ()}),
    VllmName("vllm.model_executor.models.llama:LlamaForCausalLM",
             "rollout/vllm_engine.py (served_embedding_adapters: a model class)", attrs=("embedding_modules",)),
    VllmName("vllm:SamplingParams", "rollout/vllm_engine.py",
             call=("*", "n", "temperature", "top_p", "max_tokens", "logprobs", "output_kind", "skip_clone",
                   "detokenize", "prompt_logprobs", "stop", "include_stop_str_in_output",
                   "logprob_token_ids"),  # the last token's logprob of a sequence that fills the context
             attrs=("seed",)),
    VllmName("vllm.sampling_params:RequestOutputKind", "rollout/vllm_engine.py", attrs=("FINAL_ONLY",)),
    # the prompt dicts generate() is given, and what it yields
    VllmName("vllm.inputs.engine:TokensInput", "rollout/vllm_engine.py (generate)", attrs=("type", "prompt_token_ids")),
    VllmName("vllm.inputs:TokensPrompt", "rollout/vllm_engine.py (prompt_logprobs)", attrs=("prompt_token_ids",)),
    VllmName("vllm.outputs:RequestOutput", "rollout/vllm_engine.py", attrs=("outputs", "prompt_logprobs")),
    VllmName("vllm.outputs:CompletionOutput", "rollout/vllm_engine.py",
             attrs=("token_ids", "logprobs", "finish_reason", "weight_versions")),
    VllmName("vllm.v1.metrics.loggers:StatLoggerBase", "tests/integration/test_inflight_update_vllm.py (a stat logger)",
             methods={"record": ("scheduler_stats", "iteration_stats")}),
    VllmName("vllm.outputs:WeightVersionSpan", "rollout/vllm_engine.py (token versions of a kept request)",
             attrs=("version", "start", "end")),
    VllmName("vllm.logprobs:Logprob", "rollout/vllm_engine.py", attrs=("logprob",)),
    VllmName("vllm.platforms:current_platform", "rollout/vllm_engine.py, sync/vllm_gloo_engine.py",
             methods={"is_cpu": ()}),
    VllmName(ENVIRONMENT, "rollout/vllm_engine.py, orchestrator/components.py (variables set for the engines)",
             attrs=("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL",
                    "VLLM_RPC_BASE_PATH")),
    # --- the weight-update API, both transports (sync/vllm_receiver.py)
    VllmName("vllm.distributed.weight_transfer.base:WeightTransferInitRequest", "sync/vllm_receiver.py",
             call=("*", "init_info")),
    VllmName("vllm.distributed.weight_transfer.base:WeightTransferUpdateRequest", "sync/vllm_receiver.py",
             call=("*", "update_info")),
    VllmName("vllm.config.weight_transfer:WeightTransferConfig", "sync/vllm_receiver.py (weight_transfer_config)",
             call=("*", "backend")),
    # --- NCCL: vLLM's own engine receives, asyncrl's sender speaks its protocol (sync/nccl_sender.py).
    # vLLM builds these two from the dicts asyncrl sends (init_receiver, NcclWeightSender.metadata).
    VllmName("vllm.distributed.weight_transfer.nccl_common:NCCLWeightTransferInitInfo", "sync/vllm_receiver.py",
             call=("*", "master_address", "master_port", "rank_offset", "world_size", "packed",
                   "packed_buffer_size_bytes", "packed_num_buffers")),
    VllmName("vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferUpdateInfo", "sync/nccl_sender.py",
             call=("*", "names", "dtype_names", "shapes")),
    VllmName("vllm.distributed.weight_transfer.nccl_common:trainer_init", "sync/nccl_sender.py",
             call=("init_info",)),
    VllmName("vllm.distributed.weight_transfer.nccl_common:NCCLRendezvous", "sync/nccl_sender.py (trainer_init's dict)",
             attrs=("master_address", "master_port", "world_size")),
    VllmName("vllm.distributed.device_communicators.pynccl:PyNcclCommunicator",
             "sync/nccl_sender.py, sync/nccl_packing.py (what trainer_init returns)",
             methods={"broadcast": ("tensor", "*", "src"), "destroy": ()}),
    # --- gloo: asyncrl's own engine inside vLLM's workers (sync/vllm_gloo_engine.py). vLLM calls
    # the methods below on it, and it reads the attributes the base class sets.
    VllmName(WEIGHT_TRANSFER_ENGINE, "sync/vllm_gloo_engine.py (subclassed)",
             methods={"__init__": ("config", "vllm_config", "device", "model"),
                      "init_transfer_engine": ("init_info",), "start_weight_update": (),
                      "receive_weights": ("update_info",), "finish_weight_update": (), "shutdown": ()},
             attrs=("init_info_cls", "update_info_cls", "supports_draft_weight_update", "model", "model_config",
                    "parallel_config")),
    VllmName("vllm.v1.worker.gpu_worker:Worker", "sync/vllm_gloo_engine.py (WorkerExtension, mixed into "
             "the worker, reads its engine)", attrs=("weight_transfer_engine",)),
    VllmName("vllm.distributed.weight_transfer.base:WeightTransferInitInfo", "sync/vllm_gloo_engine.py (subclassed)"),
    VllmName("vllm.distributed.weight_transfer.base:WeightTransferUpdateInfo", "sync/vllm_gloo_engine.py (subclassed)"),
    VllmName("vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory", "sync/vllm_gloo_engine.py",
             methods={"register_engine": ("name", "module_path_or_cls")}, attrs=("_registry",)),
    VllmName("vllm.config:ParallelConfig", "sync/vllm_gloo_engine.py (self.parallel_config)",
             attrs=("data_parallel_index", "world_size", "rank")),
    VllmName("vllm.config:ModelConfig", "sync/vllm_gloo_engine.py (self.model_config)", attrs=("hf_config",)),
    VllmName("vllm.model_executor.model_loader.reload:initialize_layerwise_reload", "sync/vllm_gloo_engine.py",
             call=("model",)),
    VllmName("vllm.model_executor.model_loader.reload:finalize_layerwise_reload", "sync/vllm_gloo_engine.py",
             call=("model", "model_config")),
    # finalize_layerwise_reload(*args, **kwargs) forwards to this one, whose names are the real check;
    # its module is also the logger whose warnings vllm_gloo_engine.RELOAD_LOGGER filters
    VllmName("vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_processing",
             "sync/vllm_gloo_engine.py", call=("model", "model_config")),
    VllmName("vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check",
             "sync/vllm_gloo_engine.py", call=()),
    VllmName("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "sync/vllm_gloo_engine.py",
             call=("layer", "*", "remove_weight")),
    # the experts of a CPU MoE layer, packed again after a reload (refresh_cpu_moe)
    VllmName("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts", "sync/vllm_gloo_engine.py",
             methods={"process_weights_after_loading": ("layer",), "_padded_intermediate_size": ("moe_config",)},
             attrs=("_use_zentorch", "moe_config")),
    VllmName("vllm.model_executor.layers.fused_moe.config:FusedMoEConfig", "sync/vllm_gloo_engine.py",
             attrs=("intermediate_size_per_partition",)),
    # --- routing replay: the capture hook on every MoE router, in the worker (sync/vllm_gloo_engine.py)
    VllmName("vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter", "sync/vllm_gloo_engine.py",
             methods={"set_capture_fn": ("capture_fn",)}),
    VllmName("vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner", "sync/vllm_gloo_engine.py",
             attrs=("router", "layer_id")),
    VllmName("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "sync/vllm_gloo_engine.py (the worker's model_runner)",
             methods={"_prepare_inputs": ("scheduler_output", "num_scheduled_tokens"), "get_model": ()},
             attrs=("input_batch", "vllm_config")),
    VllmName("vllm.v1.worker.gpu_input_batch:InputBatch", "sync/vllm_gloo_engine.py",
             attrs=("req_ids", "num_reqs", "num_computed_tokens_cpu")),
    VllmName("vllm.v1.core.sched.output:SchedulerOutput", "sync/vllm_gloo_engine.py",
             attrs=("scheduled_new_reqs", "finished_req_ids")),
    VllmName("vllm.v1.core.sched.output:NewRequestData", "sync/vllm_gloo_engine.py",
             attrs=("req_id", "prompt_token_ids", "num_computed_tokens")),
    VllmName("vllm.config:ModelConfig", "sync/vllm_gloo_engine.py",
             methods={"get_total_num_hidden_layers": (), "get_num_experts_per_tok": (), "get_num_experts": ()}),
    VllmName("vllm.config:VllmConfig", "sync/vllm_gloo_engine.py", attrs=("model_config", "cache_config")),
    VllmName("vllm.config:CacheConfig", "sync/vllm_gloo_engine.py (the prefix cache's block size)", attrs=("block_size",)),
]


def check(name: VllmName) -> list[str]:
    """What of `name` no longer matches the installed vLLM, one line each (empty: all of it does)."""
    module, _, attr = name.where.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        return [f"{name.label}: module {module} no longer imports ({e}); used by asyncrl/{name.used_by}"]
    for part in attr.split("."):
        if not hasattr(obj, part):
            return [f"{name.label}: {module} has no {attr} any more (moved or renamed); "
                    f"used by asyncrl/{name.used_by}"]
        obj = getattr(obj, part)
    problems = []
    if name.call is not None:
        problems += _binds(name.label, obj, name.call)
    for method, args in name.methods.items():
        problems += _method(name.label, obj, method, args, method in name.awaited)
    problems += [f"{name.label}: has no attribute, field or key {a!r} any more" for a in name.attrs if not _has(obj, a)]
    return [f"{p}; used by asyncrl/{name.used_by}" for p in problems]


def _binds(label: str, fn, args: tuple[str, ...], unbound: bool = False) -> list[str]:
    if not callable(fn):
        return [f"{label}: is not callable any more"]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: that it is callable is all we learn
        return []
    params = list(sig.parameters.values())[1 if unbound else 0:]
    sig = sig.replace(parameters=params)
    star = args.index("*") if "*" in args else len(args)
    positional, keywords = args[:star], args[star + 1:]
    P = inspect.Parameter
    slots = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    takes_any = any(p.kind == P.VAR_POSITIONAL for p in params)
    named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    problems = []
    for i, want in enumerate(positional):
        if i < len(slots) and slots[i] != want:
            problems.append(f"{label}: positional argument {i + 1} is now {slots[i]!r}, asyncrl passes {want!r} there")
        elif i >= len(slots) and not takes_any:
            problems.append(f"{label}: takes no positional argument {i + 1} ({want!r}) any more")
    problems += [f"{label}: has no parameter {k!r} any more (asyncrl passes it by keyword)"
                 for k in keywords if k not in named]
    if not problems:
        try:
            sig.bind(*positional, **dict.fromkeys(keywords))
        except TypeError as e:
            problems.append(f"{label}: the arguments asyncrl passes no longer bind: {e}")
    return [f"{p} (signature now {textwrap.shorten(str(sig), 300)})" for p in problems]


def _method(label: str, obj, method: str, args: tuple[str, ...], awaited: bool) -> list[str]:
    where = f"{label}.{method}"
    if not hasattr(obj, method):
        return [f"{where}: no such method any more"]
    owner = obj if inspect.isclass(obj) else type(obj)
    raw = inspect.getattr_static(owner, method, None)
    wrapped = isinstance(raw, (classmethod, staticmethod))
    # looked up on a class, a plain method's first parameter is self, which asyncrl never passes
    problems = _binds(where, getattr(obj, method), args, unbound=inspect.isclass(obj) and not wrapped)
    fn = inspect.unwrap(raw.__func__ if wrapped else raw or getattr(obj, method))
    if awaited and not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
        problems.append(f"{where}: is not async any more (asyncrl awaits it)")
    return problems


def _has(obj, attr: str) -> bool:
    """An attribute, a dataclass or msgspec field, an annotated key (TypedDict, Protocol), an
    attribute a method sets on self, or a key of a mapping."""
    if isinstance(obj, Mapping):
        return attr in obj
    if hasattr(obj, attr):
        return True
    return inspect.isclass(obj) and any(
        attr in getattr(k, "__dataclass_fields__", {}) or attr in getattr(k, "__struct_fields__", ())
        or attr in getattr(k, "__annotations__", {}) or attr in _set_on_self(k) for k in obj.__mro__)


@functools.cache
def _set_on_self(cls: type) -> frozenset[str]:
    """Names a class's own methods assign as `self.<name>` (instance attributes set in __init__)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # builtins, classes made at run time
        return frozenset()
    return frozenset(n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                     and isinstance(n.value, ast.Name) and n.value.id == "self")
