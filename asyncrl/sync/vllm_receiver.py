"""Rollout-actor side of the weight sync: async helpers around an `AsyncLLM` the actor owns.

Both transports go through vLLM's own weight-update API, so this file is the same for
both; only the engine backend and the init/update payloads differ:
- "gloo": our `GlooWeightTransferEngine` (backend "asyncrl_gloo", `vllm_gloo_engine.py`);
- "nccl": vLLM's `NCCLWeightTransferEngine` (backend "nccl"), fed by `NcclWeightSender`.

Order (the learner's matching calls must run at the same time, see `protocol.py`):
    AsyncEngineArgs(..., **engine_kwargs(kind))
    await init_receiver(llm, host, port, rank, world_size, timeout_s, kind)  # || sender.connect()
    # per push, generation paused or drained by the caller:
    await receive_weights(llm, metadata, version)                           # || sender.push()
"""

from __future__ import annotations

import asyncio
import time

from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from asyncrl.sync.protocol import WeightSyncError

GLOO_ENGINE_MODULE = "asyncrl.sync.vllm_gloo_engine"
WORKER_EXTENSION = f"{GLOO_ENGINE_MODULE}.WorkerExtension"
"""asyncrl's methods in vLLM's workers (`worker_extension_cls`): the gloo receiver's, routing replay's."""


def engine_kwargs(kind: str = "gloo") -> dict:
    """Extra `AsyncEngineArgs` kwargs (plain data) that give the engine a weight receiver.

    The bucket size is not an engine setting: gloo plans travel with each push's metadata,
    and NCCL's packing geometry is set at `init_receiver`.
    """
    if kind == "gloo":
        # worker_extension_cls makes vLLM import our module in the worker, which registers
        # the "asyncrl_gloo" backend even when the plugin entry point is not installed.
        return {"weight_transfer_config": {"backend": "asyncrl_gloo"},
                "worker_extension_cls": WORKER_EXTENSION}
    if kind == "nccl":
        return {"weight_transfer_config": {"backend": "nccl"}}
    raise ValueError(f"sync kind must be 'gloo' or 'nccl', got {kind!r}")


async def init_receiver(llm, host: str, port: int, rank: int, world_size: int,
                        timeout_s: float = 300.0, kind: str = "gloo",
                        bucket_bytes: int = 256 << 20, join_timeout_s: float | None = None) -> None:
    """Join the learner's weight-sync group as rank `rank` (its first worker, with TP > 1).

    Blocks until the learner's `sender.connect()` and every other receiver have joined (gloo:
    within join_timeout_s, default timeout_s; each push's collectives within timeout_s), so
    run it concurrently with them. `bucket_bytes` (NCCL only) must equal the sender's.
    """
    if kind == "gloo":
        from asyncrl.sync.wire import own_address

        # found here, in the actor: the engine's worker process is not a Ray worker
        init_info = {"host": host, "port": port, "rank_offset": rank, "world_size": world_size,
                     "timeout_s": timeout_s, "join_timeout_s": join_timeout_s, "local_host": own_address()}
    elif kind == "nccl":
        from asyncrl.sync.wire import NUM_BUFFERS

        init_info = {"master_address": host, "master_port": port, "rank_offset": rank,
                     "world_size": world_size, "packed": True,
                     "packed_buffer_size_bytes": bucket_bytes, "packed_num_buffers": NUM_BUFFERS}
    else:
        raise ValueError(f"sync kind must be 'gloo' or 'nccl', got {kind!r}")
    await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))


async def receive_weights(llm, metadata: dict, version: int,
                          reset_running_requests: bool = True,
                          timeout_s: float | None = None, reset_prefix_cache: bool = True) -> dict:
    """Receive one push described by `metadata` (from `sender.metadata`) and apply it.

    Runs start / update / finish of vLLM's weight-update API, then resets the prefix cache
    (KV computed with old weights must not be reused by new requests). Generation must be
    paused or drained by the caller. Requests kept across the update (pause mode "keep")
    hold KV blocks, and vLLM can only reset the cache by preempting them: with
    `reset_running_requests` they are recomputed with the new weights on resume; without it
    a reset blocked by running requests raises. `reset_prefix_cache` False skips the reset: the
    kept requests decode on with their KV (sync.keep_kv). Returns `sync/...` stats.

    gloo receivers time out by themselves (the group's timeout_s, per collective); NCCL has
    no timeout, so pass `timeout_s` there: the call then fails with WeightSyncError instead
    of hanging (the engine stays stuck in NCCL and must be replaced). A failed gloo push
    leaves the old weights if no bucket had arrived, else a mix: do not serve until a later
    push succeeds (on a new group: init_receiver again). So does a push whose
    `sync/verify_failures` is not 0 (gloo: buckets that failed their checksum, summed over the
    engine's workers): the learner follows it with a whole push.
    """
    update_info = dict(metadata["update_info"])
    if metadata["kind"] == "gloo":
        update_info["version"] = version
    start = time.perf_counter()
    await llm.start_weight_update()
    request = WeightTransferUpdateRequest(update_info=update_info)
    try:
        await asyncio.wait_for(llm.update_weights(request), timeout_s)
    except asyncio.TimeoutError as exc:
        raise WeightSyncError(f"weight receive version {version} ({metadata['kind']}) did not "
                              f"complete within {timeout_s:.0f}s") from exc
    received = time.perf_counter()
    await llm.finish_weight_update(weight_version=str(version))
    report = {}
    if metadata["kind"] == "gloo":  # every worker's checksum failures and bytes (vllm_gloo_engine.py)
        for worker in await llm.collective_rpc("asyncrl_sync_report"):
            for key, value in worker.items():
                report[key] = report.get(key, 0) + value
    if reset_prefix_cache and not await llm.reset_prefix_cache(reset_running_requests=reset_running_requests):
        raise RuntimeError(f"weights version {version} loaded but the prefix cache could not "
                           "be reset: requests still hold KV blocks")
    end = time.perf_counter()
    return {**report, "sync/version": version, "sync/num_bytes": metadata["num_bytes"],
            "sync/receive_s": received - start, "sync/finish_s": end - received,
            "sync/total_s": end - start,
            "sync/receive_gb_per_s": metadata["num_bytes"] / max(end - start, 1e-9) / 1e9}
