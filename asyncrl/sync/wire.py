"""What both ends of a weight push share: the rendezvous port and store, the push header, the
gloo group and its settings, and the NCCL packed-buffer count. The senders (learner side) and the
receivers (engine side) import these from here, never from each other.

Gloo push wire format: a 4 x int64 header [magic, version, num_buckets, num_bytes]
(`push_header`), then per bucket of the plan from `buckets.plan_buckets` two broadcasts: a
3 x int64 prefix [how, changed elements, checksum] and the uint8 payload it announces (the
bucket's bytes, or a delta's positions and values: `delta.encode_bucket`). A receiver posts a
payload once its prefix has told it the size.
The header lets a receiver refuse a push whose shape differs from the metadata it was given,
instead of loading garbage (`check_header`). All ranks open the group with `open_gloo_group`
(same connections).
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from asyncrl.sync.protocol import WeightSyncError

NUM_BUFFERS = 2  # vLLM's packed NCCL transfer: packed_num_buffers, the same on the sender and receivers
HEADER_MAGIC = 0x5753594E43  # "WSYNC": guards against a receiver joining the wrong stream
# Each broadcast has a fixed cost (about 0.1-0.5 ms here, most of it waiting on the other side),
# so many are kept queued, and the group has two TCP connections (gloo "devices"): consecutive
# broadcasts alternate between them, so one bucket's fixed cost overlaps the other's transfer.
MAX_IN_FLIGHT = 8  # broadcasts queued in gloo at once
GLOO_CONNECTIONS = 2
GLOO_THREADS = 8  # gloo's worker threads: every queued broadcast can run


def push_header(plan: list[dict], version: int) -> list[int]:
    """The 4 int64 a push starts with: [magic, version, num_buckets, num_bytes]."""
    return [HEADER_MAGIC, version, len(plan), sum(b["nbytes"] for b in plan)]


def check_header(received: torch.Tensor, plan: list[dict], version: int, where: str) -> None:
    """Refuse a push whose header differs from what the receiver's metadata says (a wrong
    stream, a wrong version, another plan): WeightSyncError before any weight is loaded."""
    expected = push_header(plan, version)
    if received.tolist() != expected:
        raise WeightSyncError(f"{where}: push header {received.tolist()} does not match the "
                              f"metadata for version {version} ({expected})")


def open_gloo_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, local_host: str | None = None,
    join_timeout_s: float | None = None,
) -> tuple[ProcessGroupGloo, TCPStore]:
    """Join the weight-sync group; rank 0 hosts the TCPStore. Blocks until all ranks join, for up
    to `join_timeout_s` (default timeout_s); each collective after that fails past `timeout_s`.
    The two differ at a run's start, where members may still be building: the join may wait for
    them, but a push must not wait as long for a member that hangs (its peers would wait with it,
    and be taken for hung too).
    `local_host`: this member's own node address, which its gloo connections bind and advertise
    (default: rank 0's is the rendezvous host; the others' what the hostname resolves to, which is
    127.0.0.1 on many machines and would send peers on other nodes to themselves).

    Returns the gloo backend (ranks are group ranks) and the store, which must outlive it.
    """
    timeout = timedelta(seconds=join_timeout_s or timeout_s)
    where = f"gloo weight-sync group {host}:{port} (rank {rank} of {world_size})"
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._threads = GLOO_THREADS
    local_host = local_host or (host if rank == 0 else None)
    options._devices = [ProcessGroupGloo.create_device(hostname=local_host) if local_host
                        else ProcessGroupGloo.create_default_device() for _ in range(GLOO_CONNECTIONS)]
    try:
        store = store_at(host, port, world_size, rank == 0, timeout)
        group = ProcessGroupGloo(PrefixStore("asyncrl/weights", store), rank, world_size, options)
    except (RuntimeError, OSError) as exc:  # torch: DistStoreError (a RuntimeError) on timeout; the port taken
        raise WeightSyncError(f"could not join {where} within {timeout.total_seconds():.0f}s: {exc}") from exc
    group.set_timeout(timedelta(seconds=timeout_s))
    return group, store


def store_at(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> TCPStore:
    """The TCPStore of a group that meets at host:port; the master's server listens on `host`
    alone. torch's own server listens on every address of the machine, so a node with several
    networks would take the rendezvous on all of them."""
    if not is_master:
        return TCPStore(host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        store = TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now
    return store


def broadcast(group: ProcessGroupGloo, tensor: torch.Tensor):
    """Start a broadcast from rank 0 of `tensor` (in place on receivers); returns the Work."""
    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def own_address() -> str:
    """The address this process binds and is reached at: its Ray node's IP inside a Ray worker
    (the one other nodes reach it by), 127.0.0.1 in a process outside Ray (tests, tools)."""
    import ray  # lazily: the engines' receivers import this module without needing Ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def interface_of(address: str) -> str | None:
    """The network interface whose (primary) IPv4 address is `address`, None if none is: for
    GLOO_SOCKET_IFNAME, the only way to put a torch.distributed gloo group on a chosen address."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's address, bytes 20-24 of the ifreq it returns
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(packed) == address:
            return name
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on `host` (the weight-sync rendezvous; tests), drawn below the
    kernel's ephemeral range: a port the kernel hands out for bind(0) is also the kind it hands to
    the next outgoing connection (a gloo pair, a Ray worker's), which took one between this probe
    and the group's bind in CI. Outside that range only another explicit bind can take it."""
    low = ephemeral_low()
    rng = random.Random()  # not the global generator: runs seed it, and concurrent runs would draw alike
    for _ in range(64):
        port = rng.randrange(PORT_FLOOR, low) if low > PORT_FLOOR + 1024 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host} in [{PORT_FLOOR}, {low}) after 64 tries")


PORT_FLOOR = 20000  # above the registered services most machines run


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), 32768 where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
