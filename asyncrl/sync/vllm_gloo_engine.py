"""Receiving end of the gloo weight sync, running inside a vLLM worker process.

`GlooWeightTransferEngine` is a vLLM `WeightTransferEngine` registered with vLLM's
`WeightTransferEngineFactory` as backend "asyncrl_gloo", so the engine's own weight-update
API drives it (`AsyncLLM.init_weight_transfer_engine` / `start_weight_update` /
`update_weights` / `finish_weight_update`), exactly like vLLM's NCCL backend on GPUs.

Registration must happen in the worker process before the model loads. Two routes, both
idempotent: the `vllm.general_plugins` entry point `register`, and `WorkerExtension`
passed as `worker_extension_cls` (vLLM imports it in the worker before building the worker,
which runs this module's `register()`), so an install without the entry point still works.

Loading uses vLLM's in-place layerwise reload (initialize / model.load_weights /
finalize, `vllm.model_executor.model_loader.reload`): weights arrive in checkpoint format and
each layer is re-processed (CPU GEMM prepacking included) once all its tensors are in. Three
CPU-specific gaps are closed in `finish_weight_update`:
- A MoE layer's experts are kept prepacked; the reload copies new weights into that storage
  without packing them (`refresh_cpu_moe`).
- A tied LM head (tie_word_embeddings) shares its weight with embed_tokens; the reload
  updates that weight but never re-processes the LM head, so its oneDNN handle keeps the
  old prepacked copy and logits silently stay stale. `refresh_cpu_gemm` re-runs vLLM's CPU
  GEMM dispatch on every layer that still holds a 2-D weight.
- The prefix cache is reset by the caller (`vllm_receiver.receive_weights`): it lives in
  the scheduler, not in the worker.

Every bucket comes with a checksum (wire.py), checked once the bucket is applied; a failure is
counted (`_take_report`, fetched through the worker extension's `asyncrl_sync_report`), not
raised, so the group stays in step for the whole push that follows. With `transfer: delta` each
worker keeps the bytes of every bucket it last applied (one model copy in the engine's dtype):
deltas are applied there and the whole bucket is then loaded as usual, since a layer reloads only
once all its tensors are in. So a delta saves the wire, not the reload.

A LoRA policy's push (`adapter` in the update info) carries its adapter alone: nothing is loaded
into the model; the engine's first worker writes the tensors as a peft adapter directory
(`adapter_dir`, on the actor's node), which the actor then has vLLM load in place of the adapter
it served (rollout/vllm_engine.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from asyncrl.sync.buckets import unpack_bucket
from asyncrl.sync.delta import (PREFIX_WORDS, WHOLE, ChecksumMismatch, bucket_word, checksum, decode_bucket,
                                payload_nbytes)
from asyncrl.sync.wire import broadcast, check_header, open_gloo_group
from asyncrl.sync.protocol import WeightSyncError

BACKEND = "asyncrl_gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where to join: this worker's rank is rank_offset + its global vLLM worker rank."""

    host: str
    port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0  # each collective's (a push's)
    local_host: str | None = None  # the receiving actor's node address, which its connections bind
    join_timeout_s: float | None = None  # joining's, where it differs (wire.open_gloo_group)


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One push: the bucket plan from `GlooWeightSender.metadata` and its version."""

    buckets: list[dict]
    version: int
    transfer: str = "full"  # "delta": buckets may come as deltas against this worker's copy
    adapter: dict | None = None  # a LoRA adapter's push: its adapter_config.json (learner/lora.py)
    adapter_dir: str | None = None  # where the engine's first worker writes it


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """One receiver rank of the learner's gloo group, loading checkpoint-format weights."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        logging.getLogger(RELOAD_LOGGER).addFilter(BenignReloadWarnings(tied))
        self.group = None
        self.store = None
        self.where = "gloo weight-sync group (not joined)"
        self.shadows: list[torch.Tensor | None] = []  # per bucket, the bytes last applied (delta transfer)
        self.verify_failures = self.received_bytes = 0
        self.reloading = False  # a layerwise reload is open (weights, not an adapter)
        self.loaded: set[str] = set()  # names of the tensors the open reload received

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the learner's group; blocks until the learner and all receivers join."""
        parallel = self.parallel_config  # one rank per worker: TP/DP workers all receive
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        rank = init_info.rank_offset + worker
        self.where = (f"gloo weight-sync group {init_info.host}:{init_info.port} "
                      f"(rank {rank} of {init_info.world_size})")
        self.group, self.store = open_gloo_group(
            init_info.host, init_info.port, rank, init_info.world_size, init_info.timeout_s, init_info.local_host,
            init_info.join_timeout_s)

    def start_weight_update(self) -> None:
        pass  # the reload opens in receive_weights, once the push says it carries weights, not an adapter

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive the header and every bucket; load each bucket while the next arrives.

        On failure the reload is finalized before the error propagates, so the model is
        whole again: if nothing had arrived it keeps its previous weights, otherwise its
        weights are a mix of two versions and it must not serve until a later push.
        """
        if self.group is None:
            raise RuntimeError("GlooWeightTransferEngine: init_transfer_engine() was not called")
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        adapter: dict[str, torch.Tensor] | None = {} if update_info.adapter is not None else None
        if adapter is None:
            initialize_layerwise_reload(self.model)
            self.reloading = True
            self.loaded = set()
        try:
            self._receive(update_info.buckets, update_info.version, update_info.transfer, adapter)
        except BaseException:
            self.finish_weight_update()  # vLLM will not call it after a failed update
            raise
        if adapter is not None and self._first_worker:
            from asyncrl.learner.lora import write_adapter

            write_adapter(update_info.adapter_dir, adapter.items(), update_info.adapter)

    @property
    def _first_worker(self) -> bool:
        return self.parallel_config.data_parallel_index == 0 and self.parallel_config.rank == 0

    def _receive(self, buckets: list[dict], version: int, transfer: str,
                 adapter: dict[str, torch.Tensor] | None = None) -> None:
        """Every bucket into the model, or (`adapter` a dict) into `adapter`, copied out by name."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        header = torch.zeros(4, dtype=torch.int64)
        self._wait(broadcast(self.group, header), version, "header")
        check_header(header, buckets, version, self.where)
        if transfer != "delta":
            self.shadows = []
        elif len(self.shadows) != len(buckets) or any(
                s is not None and s.numel() != b["nbytes"] for s, b in zip(self.shadows, buckets)):
            self.shadows = [None] * len(buckets)  # a new plan: what this worker held no longer lines up
        self._prefix = torch.zeros(PREFIX_WORDS, dtype=torch.int64)
        self._prefix_work = broadcast(self.group, self._prefix)
        pending = self._post(buckets, 0, version)
        with disable_mtp_completeness_check():
            for index, bucket in enumerate(buckets):
                announced, payload, work = pending
                self._wait(work, version, f"bucket {index}/{len(buckets)}")
                if index + 1 < len(buckets):  # the next bucket arrives while this one loads
                    pending = self._post(buckets, index + 1, version)
                tensors = unpack_bucket(bucket, self._apply(index, bucket, announced, payload))
                if adapter is None:
                    self.loaded.update(name for name, _ in tensors)
                    self.model.load_weights(tensors)
                else:  # copies: a kept bucket's bytes change with the next push
                    adapter.update((name, t.clone()) for name, t in tensors)

    def _apply(self, index: int, bucket: dict, announced: list[int], payload: torch.Tensor) -> torch.Tensor:
        """The bucket's bytes after this push, checked against its checksum (a failure is counted,
        not raised: the learner follows with a whole push, see vllm_receiver.receive_weights)."""
        keep = bool(self.shadows)
        if announced[0] == WHOLE:
            target, ok = payload, checksum(payload) == announced[2]
        else:  # a delta needs what this worker held; without it the bucket cannot be right
            target = self.shadows[index] if keep and self.shadows[index] is not None else \
                torch.zeros(bucket["nbytes"], dtype=torch.uint8)
            try:
                decode_bucket(announced, payload, target, bucket_word(bucket))
                ok = True
            except ChecksumMismatch:
                ok = False
        if keep:
            self.shadows[index] = target
        self.verify_failures += not ok
        self.received_bytes += 8 * PREFIX_WORDS + payload.numel()
        return target

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self.reloading:  # an adapter's push: the model's weights were not touched
            return
        self.reloading = False
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_cpu_gemm(self.model)
        refresh_cpu_moe(self.model, self.loaded)

    def shutdown(self) -> None:
        self.group = self.store = None
        self.shadows = []  # the next group's first push is whole

    def _post(self, buckets: list[dict], index: int, version: int):
        """Wait for bucket `index`'s prefix, post its payload's receive, then the next prefix's.
        A whole bucket lands in this worker's copy of it when it keeps one (delta transfer), else
        in a fresh buffer: vLLM's layers repack their weights at load, and layerwise reload keeps
        views of the buffers until a layer is complete."""
        self._wait(self._prefix_work, version, f"bucket {index}/{len(buckets)}'s prefix")
        announced = self._prefix.tolist()
        bucket = buckets[index]
        shadow = self.shadows[index] if self.shadows else None
        if announced[0] == WHOLE and shadow is not None:
            payload = shadow
        else:
            payload = torch.empty(payload_nbytes(announced, bucket["nbytes"], bucket_word(bucket)), dtype=torch.uint8)
        work = broadcast(self.group, payload)
        if index + 1 < len(buckets):
            self._prefix = torch.zeros(PREFIX_WORDS, dtype=torch.int64)
            self._prefix_work = broadcast(self.group, self._prefix)
        return announced, payload, work

    def _take_report(self) -> dict:
        """What the pushes since the last report did on this worker (and start counting anew)."""
        report = {"sync/verify_failures": self.verify_failures, "sync/received_bytes": self.received_bytes}
        self.verify_failures = self.received_bytes = 0
        return report

    def _wait(self, work, version: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo timeout or the learner went away
            raise WeightSyncError(f"weight receive version {version}: {what} from rank 0 of "
                                  f"{self.where} failed: {exc}") from exc


def refresh_cpu_gemm(model: torch.nn.Module) -> int:
    """Re-run vLLM's CPU GEMM dispatch on layers that keep a 2-D weight; returns how many.

    Layers whose weight the dispatch removed (packed linears) were re-packed by the reload;
    the ones that keep it (embeddings and a tied LM head) may hold a stale packed copy.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor)
                and weight.ndim == 2 and weight.numel() > 0 and not weight.is_meta):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
    return count


def refresh_cpu_moe(model: torch.nn.Module, loaded: set[str]) -> int:
    """Re-pack the experts of every CPU MoE layer the reload wrote (`loaded`: the names of the
    tensors it received); returns how many layers.

    vLLM-CPU's experts keep their weights in a prepacked grouped-GEMM layout, made at the first
    load. A reload copies the new weights, in checkpoint layout, into that storage and does not
    pack them again (vLLM 0.32 `_setup_kernel` runs the experts' own post-load step on the first
    load only): the sums of the weights are right and the outputs wrong (measured: |d| 0.11 nats
    after pushing the same weights). Packing the copied weights again restores them; a layer the
    push did not reach (one that failed before its tensors came) is still packed and is left alone.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    count = 0
    for name, module in model.named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        prefix = name.partition(".experts")[0] + ".experts."  # the checkpoint's names of its experts
        if not any(n.startswith(prefix) for n in loaded):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise WeightSyncError(f"{type(model).__name__}: an expert width of {config.intermediate_size_per_partition} "
                                  "is padded by vLLM-CPU, and a padded MoE layer cannot be reloaded in place here")
        experts.process_weights_after_loading(module)
        count += 1
    return count


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class BenignReloadWarnings(logging.Filter):
    """Drops the two "<Layer>: Failed to load weights" warnings every reload prints that are
    expected: a RotaryEmbedding has no checkpoint weights, and a tied LM head's weight arrives
    as embed_tokens (and is re-packed by `refresh_cpu_gemm`). Any other layer that fails to load
    is still reported."""

    def __init__(self, tied_head: bool):
        super().__init__()
        self.expected = {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied_head else set())

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and record.args[0] in self.expected)


def register() -> None:
    """Register backend "asyncrl_gloo" with vLLM's factory (idempotent; plugin entry point)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)


class WorkerExtension:
    """vLLM `worker_extension_cls`: importing it registers the engine in the worker, and its
    methods join the worker's, for `collective_rpc`: the gloo receiver's report, and routing
    replay's capture (rollout/routes.py), bound only when an engine asks for it."""

    def asyncrl_sync_report(self) -> dict:
        """This worker's `GlooWeightTransferEngine._take_report()` ({} before it has one)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return engine._take_report() if isinstance(engine, GlooWeightTransferEngine) else {}

    def asyncrl_routing_start(self) -> tuple[int, int]:
        """Bind the capture to every MoE router of this worker's model; returns (layers, k)."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        from asyncrl.rollout.routes import NONE, RoutingCapture

        runner = self.model_runner
        config = runner.vllm_config.model_config
        num_layers, top_k = config.get_total_num_hidden_layers(), config.get_num_experts_per_tok()
        if config.get_num_experts() > NONE:
            raise ValueError(f"routing replay records expert ids as uint8: {config.get_num_experts()} experts "
                             f"is more than {NONE}")
        capture = RoutingCapture(num_layers, top_k, runner.vllm_config.cache_config.block_size)
        bound = 0
        for module in runner.get_model().modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                module.router.set_capture_fn(functools.partial(capture.capture, module.layer_id))
                bound += 1
        if not bound:
            raise ValueError("routing replay: the engine's model has no MoE router it can record")
        prepare = runner._prepare_inputs

        def prepare_and_record(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            batch = runner.input_batch
            n = batch.num_reqs
            capture.start_step(scheduler_output, list(batch.req_ids[:n]),
                               batch.num_computed_tokens_cpu[:n].copy(), num_scheduled_tokens[:n].copy())
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        runner._prepare_inputs = prepare_and_record
        self._asyncrl_routing = capture
        return num_layers, top_k

    def asyncrl_routing_take(self, request_ids: list[str]) -> dict[str, bytes]:
        return self._asyncrl_routing.take(request_ids)

    def asyncrl_routing_forget_prefixes(self) -> None:
        """After a weight load: prompt prefills of the old weights are no longer what the cache holds."""
        self._asyncrl_routing.forget_prefixes()


register()
