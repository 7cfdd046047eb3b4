"""What each process finds on its own node rather than taking from the driver: the address it
binds (gloo's connections included), vLLM's IPC directory, the built-in model."""

import os
import socket
import subprocess
import sys
import threading

from asyncrl.sync.wire import GLOO_CONNECTIONS, interface_of, open_gloo_group, own_address


def listening(address: str) -> list[int]:
    """Ports this machine listens on at `address` (/proc/net/tcp, state 0A)."""
    want = socket.inet_aton(address)[::-1].hex().upper()  # little-endian hex, as the kernel writes it
    ports = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host, port = local.split(":")
        if state == "0A" and host == want:
            ports.append(int(port, 16))
    return ports


def test_gloo_connections_bind_the_members_own_address():
    """Two members on one machine, each told its own loopback address (as two nodes would be):
    each one's gloo connections listen there, not on what the hostname resolves to."""
    hosts = {0: "127.0.0.31", 1: "127.0.0.32"}
    assert listening(hosts[0]) == listening(hosts[1]) == []
    port = 29731
    groups, seen = {}, {}

    def join(rank):
        groups[rank] = open_gloo_group(hosts[0], port, rank, 2, timeout_s=60, local_host=None if rank == 0 else hosts[1])
        seen[rank] = listening(hosts[rank])

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(groups) == {0, 1}
    # rank 0's store and gloo devices on the rendezvous host (its own address), rank 1's devices on
    # the address it was given: one listening socket per connection, and the store's port
    assert port in seen[0] and len(seen[0]) == GLOO_CONNECTIONS + 1
    assert len(seen[1]) == GLOO_CONNECTIONS


def test_own_address_outside_ray_is_loopback_and_interfaces_are_found_by_address():
    assert own_address() == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # nobody's address


def test_each_engine_makes_its_own_rpc_directory_and_clears_those_of_dead_engines(tmp_path, monkeypatch):
    from asyncrl.rollout.vllm_engine import RPC_PREFIX, own_rpc_dir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"{RPC_PREFIX}{dead.stdout.strip()}-abc"
    alive = tmp_path / f"{RPC_PREFIX}{os.getppid()}-def"
    other = tmp_path / "someone-else"
    for d in (gone, alive, other):
        d.mkdir()
    made = own_rpc_dir()
    assert made.startswith(str(tmp_path / f"{RPC_PREFIX}{os.getpid()}-"))
    assert not gone.exists() and alive.exists() and other.exists()


def test_a_node_without_the_drivers_cache_builds_the_same_built_in_model(tiny_model_path):
    from asyncrl.tiny.build import TinyModelSpec, local_model_path

    assert local_model_path(tiny_model_path, TinyModelSpec()) == tiny_model_path  # here: as given
    assert local_model_path("/driver/only/cache/tiny-x", TinyModelSpec()) == tiny_model_path  # this node's build
    assert local_model_path("/no/such/model", None) == "/no/such/model"  # not built-in: loading will say so
