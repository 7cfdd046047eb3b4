"""A Ray cluster of several nodes on this one machine, and what its processes listen on.

Each node gets its own loopback address (all of 127.0.0.0/8 is local on Linux), so a socket bound
on the wrong node's address, or on every address, shows up as it would across machines; the head
is never 127.0.0.1, which Ray rewrites to the machine's own address. A node whose raylet runs in a
mount namespace of its own, with a tmpfs over a directory, has a private disk there: every process
Ray starts on it sees an empty directory where the driver sees the run.

Sockets are read from /proc rather than hooked in Python: gloo, torch's TCPStore and zmq bind in
C++, where no Python hook sees them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

RAY = str(Path(sys.executable).parent / "ray")
CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")  # Ray's "the cluster on this machine" file
TCP_LISTEN = "0A"  # the socket state column of /proc/net/tcp


@contextmanager
def loopback_cluster(head_ip: str, nodes: dict[str, dict[str, float]], num_cpus: int) -> Iterator[Cluster]:
    """A head at `head_ip` with no CPUs (only a driver lands there) and a worker node per
    `nodes` entry (address -> custom resources), `num_cpus` each; shut down on exit."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": head_ip, "num_cpus": 0, "include_dashboard": False})
    try:
        for ip, resources in nodes.items():
            cluster.add_node(node_ip_address=ip, num_cpus=num_cpus, resources=resources)
        yield cluster
    finally:
        cluster.shutdown()
        forget_cluster(cluster.address)


def forget_cluster(address: str | None) -> None:
    """Remove Ray's current-cluster file if it names `address`: a later plain ray.init() in the
    suite would otherwise try to join this dead cluster."""
    if address and CURRENT_CLUSTER.is_file() and CURRENT_CLUSTER.read_text().strip() == address:
        CURRENT_CLUSTER.unlink()


def hide_command(hidden: Path) -> list[str]:
    """The command prefix of a process (and all it starts) that sees an empty tmpfs at `hidden`:
    a private mount namespace, so nothing outside it sees the mount."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f"mount -t tmpfs tmpfs {hidden} && exec \"$@\"",
            "hide"]


def can_hide(directory: Path) -> bool:
    """Whether this machine lets us make a private mount namespace (root, or CAP_SYS_ADMIN)."""
    return subprocess.run([*hide_command(directory), "true"], capture_output=True).returncode == 0


@contextmanager
def private_disk_node(address: str, ip: str, resources: dict[str, float], hidden: Path,
                      num_cpus: int, log: Path, start_timeout_s: float = 60.0) -> Iterator[None]:
    """A worker node at `ip` joined to the cluster at `address` whose every process sees an empty
    tmpfs at `hidden`: `ray start --block` in a private mount namespace. The driver must be
    connected (it waits for the node in ray.nodes()). On exit the node's processes, and only
    those (its session), are stopped: `ray stop` would stop every Ray on the machine."""
    # the agent's port a free one: another Ray on this machine may hold the default
    start = [RAY, "start", f"--address={address}", f"--node-ip-address={ip}", f"--num-cpus={num_cpus}",
             f"--resources={json.dumps(resources)}", "--dashboard-agent-listen-port=0", "--block"]
    with log.open("w") as out:
        node = subprocess.Popen([*hide_command(hidden), *start], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for_node(ip, node, log, start_timeout_s)
        yield
    finally:
        node.terminate()  # ray start drains the node and stops the processes it started
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()
        kill_session(node.pid)


def wait_for_node(ip: str, node: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(n["Alive"] and n["NodeManagerAddress"] == ip for n in ray.nodes()):
        if node.poll() is not None or time.monotonic() > deadline:
            node.kill()
            raise RuntimeError(f"the node at {ip} did not join (exit {node.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def kill_session(sid: int) -> None:
    """SIGKILL whatever is left of the session `sid` (a node's workers outlive a killed raylet)."""
    for pid in all_pids():
        try:
            if os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdecimal()]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (vLLM's engine core below a rollout actor, say)."""
    children: dict[int, list[int]] = {}
    for p in all_pids():
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:  # exited meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"; comm may hold spaces
        children.setdefault(ppid, []).append(p)
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def listening(pid: int) -> dict[int, tuple[str, int]]:
    """The TCP sockets `pid` listens on: socket inode -> (bound address, port); the address is
    "0.0.0.0" or "::" for a socket bound on every address."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    found = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == TCP_LISTEN and inode in inodes:
                found[inode] = decode_address(local)
    return found


def decode_address(local: str) -> tuple[str, int]:
    """A /proc/net/tcp{,6} "local_address" (hex, each 32-bit word in host byte order) as
    (address, port); an IPv4-mapped IPv6 address as its IPv4 form."""
    host, port = local.split(":")
    words = [bytes.fromhex(host[i:i + 8]) for i in range(0, len(host), 8)]
    raw = b"".join(w if sys.byteorder == "big" else w[::-1] for w in words)
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return str(addr), int(port, 16)
