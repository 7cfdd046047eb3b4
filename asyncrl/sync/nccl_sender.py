"""Learner side of the GPU weight sync, through vLLM's native NCCL weight-transfer backend.

The receivers are vLLM's own `NCCLWeightTransferEngine` (backend "nccl"), so the learner
speaks its wire protocol: vLLM's `nccl_common.trainer_init` (StatelessProcessGroup rendezvous +
PyNcclCommunicator, rank 0), and the packed chunks of vLLM's producer, cut by our own
`nccl_packing.broadcast_packed` (tensors packed into chunks of `bucket_bytes`, double-buffered
on side streams) so that packing needs no vLLM and is tested without it. We do not use
`NCCLTrainerWeightTransferEngine` itself: it drives the actors through a client RPC, while
here the orchestrator calls the actors (`vllm_receiver.receive_weights`) and the learner.

NCCL has no timeouts of its own, so rendezvous and broadcast run on a helper thread and the
caller gets a `WeightSyncError` after `timeout_s`. A member that died or stalls mid-push would
otherwise leave the broadcast's kernel queued for ever on the packing's side streams and the helper
thread inside NCCL: on a timeout the communicator is aborted (PyNccl's `destroy`, ncclCommAbort,
which makes the stuck call return with an error), the side streams are dropped and a fresh helper
thread is made, so the learner can join the group the orchestrator rebuilds around the survivors. vllm is imported lazily (rendezvous only): this module imports,
and a push to an already-joined group runs, without it.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from asyncrl.sync.buckets import dtype_from_str, dtype_to_str
from asyncrl.sync.nccl_packing import Broadcaster, broadcast_packed, chunk_sizes, num_chunks, reset_streams
from asyncrl.sync.protocol import NamedTensors, WeightSyncError
from asyncrl.sync.wire import NUM_BUFFERS

ABORT_WAIT_S = 10.0  # how long an aborted call may take to return before the thread is abandoned


class NcclWeightSender:
    """Rank 0 of vLLM's NCCL weight-transfer group; receivers use `engine_kwargs("nccl")`."""

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float = 300.0,
                 bucket_bytes: int = 256 << 20, join_timeout_s: float | None = None):
        self.host, self.port, self.world_size = host, port, world_size
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.join_timeout_s = join_timeout_s or timeout_s  # connect()'s; a push's is timeout_s
        self._comm: Broadcaster | None = None
        self._device: torch.device | None = None
        self._specs: list[tuple[str, list[int], str]] | None = None
        self._buffers: list[torch.Tensor] | None = None  # packing buffers, kept across pushes
        # One worker thread: NCCL calls of one communicator must stay in order.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nccl-weight-sync")

    def connect(self, group: Broadcaster | None = None, device: torch.device | None = None) -> None:
        """Rendezvous as rank 0 on the current CUDA device (receivers join concurrently). Given a
        `group` (anything with PyNccl's `broadcast(tensor, src)`, e.g. a recording fake in tests),
        push to it instead, from `device`."""
        if device is None or (device.type == "cuda" and device.index is None):
            device = torch.device("cuda", torch.accelerator.current_device_index())  # set_device needs an index
        self._device = device
        self._comm = group or self._run(self._join, "join", None, self.join_timeout_s)

    def metadata(self, named_params: NamedTensors) -> dict:
        """vLLM's NCCL update info (names, dtype_names, shapes) for these parameters."""
        self._specs = [(n, list(t.shape), dtype_to_str(t.dtype)) for n, t in named_params]
        num_bytes = sum(_numel(shape) * dtype_from_str(dtype).itemsize
                        for _, shape, dtype in self._specs)
        return {
            "kind": "nccl",
            "update_info": {"names": [s[0] for s in self._specs],
                            "dtype_names": [s[2] for s in self._specs],
                            "shapes": [s[1] for s in self._specs]},
            "num_tensors": len(self._specs),
            "num_bytes": num_bytes,
        }

    def push(self, named_params: NamedTensors, version: int, whole: bool = True) -> dict:
        """Packed broadcast of the parameters (CUDA tensors); returns `sync/...` stats. Always
        whole: vLLM's NCCL receiver takes whole tensors."""
        if self._comm is None:
            raise RuntimeError("NcclWeightSender.push before connect() (or after a failure)")
        if self._specs is None:
            raise RuntimeError("NcclWeightSender.push before metadata(): receivers need the names and shapes")
        sizes = [_numel(shape) * dtype_from_str(dtype).itemsize for _, shape, dtype in self._specs]
        num_bytes = sum(sizes)
        if self._device.type == "cuda":
            # The producer reads parameters on its own streams: finish pending optimizer writes.
            torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        buffers = self._packing_buffers(sizes)
        self._run(lambda: self._broadcast(_checked(named_params, self._specs), buffers), "push", version)
        seconds = time.perf_counter() - start
        return {"sync/version": version, "sync/num_bytes": num_bytes,
                "sync/num_buckets": num_chunks(sizes, self.bucket_bytes),
                "sync/push_s": seconds, "sync/push_gb_per_s": num_bytes / seconds / 1e9}

    def _packing_buffers(self, sizes: list[int]) -> list[torch.Tensor]:
        """One buffer per side stream, as large as the push's largest chunk, allocated at the first
        push (again only if a larger chunk comes) rather than every chunk anew."""
        largest = max(chunk_sizes(sizes, self.bucket_bytes), default=0)
        if self._buffers is None or self._buffers[0].numel() < largest:
            self._buffers = None  # the old ones freed first
            self._buffers = [torch.empty(largest, dtype=torch.uint8, device=self._device) for _ in range(NUM_BUFFERS)]
        return self._buffers

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
        self._comm = None
        self._pool.shutdown(wait=False)

    def _abort(self, stalled) -> None:
        """After a stalled call: abort the communicator (the stuck NCCL call then returns with an
        error), wait for that call to leave (it may hold the push's parameter generator, which the
        learner drains next), forget the side streams that held its kernels, start a new helper
        thread."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()  # ncclCommAbort; vLLM's returns within 5 s even if the abort itself hangs
        with contextlib.suppress(Exception):
            stalled.exception(timeout=ABORT_WAIT_S)
        reset_streams()
        self._buffers = None  # an aborted broadcast's kernel may have held one
        self._pool.shutdown(wait=False)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nccl-weight-sync")

    def _join(self):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        torch.cuda.set_device(self._device)  # helper thread: same GPU as the caller
        return trainer_init({"master_address": self.host, "master_port": self.port,
                             "world_size": self.world_size})

    def _broadcast(self, named_params: NamedTensors, buffers: list[torch.Tensor]) -> int:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # helper thread: streams on the learner's GPU
        return broadcast_packed(self._comm, named_params, self.bucket_bytes, self._device, NUM_BUFFERS,
                                buffers=buffers)

    def _run(self, fn, what: str, version: int | None, timeout_s: float | None = None):
        timeout_s = timeout_s or self.timeout_s
        future = self._pool.submit(fn)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout as exc:
            self._abort(future)
            step = "" if version is None else f" version {version}"
            raise WeightSyncError(
                f"weight {what}{step}: NCCL group {self.host}:{self.port} (world size "
                f"{self.world_size}) did not complete within {timeout_s:.0f}s"
            ) from exc


def _checked(named_params: NamedTensors, specs: list) -> NamedTensors:
    """The parameters, read lazily (a sharded learner gathers each as it is needed), each checked
    against the metadata the receivers were given."""
    for (name, tensor), spec in zip(named_params, specs, strict=True):
        if (name, list(tensor.shape), dtype_to_str(tensor.dtype)) != tuple(spec):
            raise ValueError(f"push() parameter {name} differs from the last metadata()'s {spec}; call "
                             "metadata() again and send it to the receivers first")
        yield name, tensor


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
