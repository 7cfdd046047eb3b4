"""asyncrl across Ray nodes, on a cluster made of this machine (cluster_support.py): the driver on
a head with no CPUs, the learner ranks and the rollout actor each on a node of their own, each node
at its own loopback address.

- Every socket a run's processes listen on (the driver's sample socket, the learner ranks' batch
  sockets and group, the weight-sync rendezvous and gloo connections, vLLM's engine) is bound on
  that process's own node address, never on another node's and never on every address.
- A learner node that does not see the driver's run directory (a private disk) stops the run at
  start with the storage requirement (exit 2), never a silent fresh start later; one that does
  (the same disk) checkpoints at a SIGTERM and resumes from there.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from asyncrl.config import ConfigError, load_config
from asyncrl.orchestrator.orchestrator import Orchestrator
from asyncrl.sync.wire import GLOO_CONNECTIONS, interface_of
from cluster_support import can_hide, descendants, listening, loopback_cluster, private_disk_node

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HEAD, LEARNER_NODE, ROLLOUT_NODE, PRIVATE_NODE = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
WORKER_NODES = {LEARNER_NODE: {"learner_node": 2}, ROLLOUT_NODE: {"rollout_node": 1}}  # room for 2 ranks
WILDCARDS = ("0.0.0.0", "::")


@dataclass
class LoopbackCluster:
    address: str  # the head's, for ray.address
    runs: Path  # where the runs' directories are (the private node sees it empty)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster for the module, the driver connected: a learner node and a rollout node."""
    runs = tmp_path_factory.mktemp("runs")
    with loopback_cluster(HEAD, WORKER_NODES, num_cpus=2) as c:
        ray.init(address=c.address)
        try:
            yield LoopbackCluster(c.address, runs)
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def private_node(cluster, tmp_path_factory):
    """A learner node (resource private_node) that sees an empty directory where the runs are."""
    if not can_hide(tmp_path_factory.mktemp("probe")):
        pytest.skip("making a private disk for a node needs a mount namespace (root or CAP_SYS_ADMIN)")
    with private_disk_node(cluster.address, PRIVATE_NODE, {"private_node": 1}, hidden=cluster.runs, num_cpus=2,
                           log=tmp_path_factory.mktemp("logs") / "private-node.log"):
        yield PRIVATE_NODE


def overrides(runs: Path, name: str, model: str, *extra: str) -> list[str]:
    return [f"model.path={model}", f"name={name}", f"observe.output_dir={runs}",
            "observe.tensorboard=false", "eval.every_steps=0", "save_final=false", "checkpoint.every_steps=0",
            "buffer.token_budget=48", "rollout.max_tokens=8", "rollout.group_size=4",
            "algo.drop_zero_variance_groups=false", *extra]  # every group counts: steps come at once


def run_config(cluster: LoopbackCluster, name: str, model: str, *extra: str):
    return load_config(None, overrides(cluster.runs, name, model, "observe.console=off", *extra))


@dataclass
class Listener:
    role: str  # "driver", "learner rank <r>", "rollout actor", "vllm engine" or "below the actor"
    pid: int
    node: str  # the address of the process's node
    address: str
    port: int


def audit(orch: Orchestrator, driver_before: set[int]) -> list[Listener]:
    """Every socket the run's processes listen on: the driver's (those opened since
    `driver_before`), each learner rank's, the rollout actor's and those of the processes below it
    (vLLM's engine core). Ray's own server in each of its workers, on every address (Ray's choice),
    is left out."""
    procs = [("driver", os.getpid(), HEAD, None)]
    procs += [(f"learner rank {r}", *placed(rank)) for r, rank in enumerate(orch.learner.ranks)]
    actor_pid, node, ray_port = placed(orch.pool.actors[0])
    procs += [("rollout actor", actor_pid, node, ray_port)]
    procs += [("vllm engine" if comm(pid).startswith("VLLM::") else "below the actor", pid, node, None)
              for pid in descendants(actor_pid)]
    return [Listener(role, pid, node, address, port)
            for role, pid, node, ray_port in procs
            for inode, (address, port) in listening(pid).items()
            if port != ray_port and not (role == "driver" and inode in driver_before)]


def placed(handle) -> tuple[int, str, int]:
    """An actor's pid, node address and the port of Ray's own server in it."""
    pid, node = ray.get(handle.__ray_call__.remote(lambda self: (os.getpid(), ray.util.get_node_ip_address())))
    return pid, node, ray._private.state.actors(actor_id=handle._actor_id.hex())["Address"]["Port"]


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def off_node(listeners: list[Listener]) -> list[Listener]:
    """Listeners bound elsewhere than their process's node address, less the loopback ones that
    no other node dials and asyncrl does not place:
    - in vLLM's engine: vLLM's own single-process gloo groups (parallel_state), which torch binds
      where the hostname resolves, else on loopback;
    - in a learner rank, one: its gloo device of the learner group (the default process group)
      when no network interface has the node's address as its own, as here (loopback aliases):
      torch takes that device's address from GLOO_SOCKET_IFNAME, an interface, or the hostname."""
    out, excused = [], set()
    for x in listeners:
        if x.address == x.node or (x.address == "127.0.0.1" and x.role == "vllm engine"):
            continue
        if (x.address == "127.0.0.1" and x.role.startswith("learner rank") and x.role not in excused
                and interface_of(x.node) is None):
            excused.add(x.role)
            continue
        out.append(x)
    return out


def test_every_process_listens_on_its_own_node_address(cluster, tiny_model_path):
    cfg = run_config(cluster, "binds", tiny_model_path, "total_steps=100", "rollout.engine=vllm",
                     "rollout.kv_cache_gib=1", "sync.type=gloo", "learner.num_ranks=2",
                     "learner.resources={learner_node: 1}", "rollout.resources={rollout_node: 1}")
    driver_before = set(listening(os.getpid()))
    seen: dict = {}

    def operator(orch):
        while len(orch.history) < 2:  # weights have been pushed across the nodes
            time.sleep(0.05)
        seen["listeners"] = audit(orch, driver_before)
        seen["actor"] = ray.get(orch.pool.actors[0].get_stats.remote())
        orch.request_stop("audit taken", drain_s=0)

    orch = Orchestrator(cfg)
    thread = threading.Thread(target=operator, args=(orch,), daemon=True)
    thread.start()
    try:
        orch.run()
    finally:
        orch.shutdown()
        thread.join(timeout=5)
    listeners = seen["listeners"]
    nodes = {x.role: x.node for x in listeners}
    assert nodes["driver"] == HEAD and nodes["learner rank 0"] == nodes["learner rank 1"] == LEARNER_NODE
    assert nodes["vllm engine"] == ROLLOUT_NODE and seen["actor"]["version"] >= 1  # a push crossed
    assert [x for x in listeners if x.address in WILDCARDS] == []
    assert off_node(listeners) == []
    # and what must be there is, on its node: the driver's sample socket; each rank's batch
    # socket; rank 0's two rendezvous stores and weight-sync connections; the engine's connections
    on_node = {role: sum(x.role == role and x.address == x.node for x in listeners) for role in nodes}
    assert on_node["driver"] >= 1 and on_node["learner rank 1"] >= 1
    assert on_node["learner rank 0"] >= 3 + GLOO_CONNECTIONS and on_node["vllm engine"] >= GLOO_CONNECTIONS


def test_a_learner_node_without_the_run_directory_stops_the_run_at_start(cluster, private_node, small_model):
    cfg = run_config(cluster, "private", small_model, "total_steps=4", "rollout.engine=fake",
                     "learner.resources={private_node: 1}", "rollout.resources={rollout_node: 1}")
    orch = Orchestrator(cfg)
    try:
        with pytest.raises(ConfigError, match="is not shared with the node of learner rank 0"):
            orch.run()
    finally:
        orch.shutdown()
    ended = events(cfg.run_dir)
    assert [e["event"] for e in ended] == ["end"] and private_node in ended[-1]["reason"]
    assert not (cfg.run_dir / "checkpoints").exists()


def test_a_run_directory_every_node_sees_resumes_after_sigterm(cluster, small_model):
    # launch/run.py as a user runs it on a cluster: the driver on the head, the learner and the
    # actor on their nodes; the checkpoint written at the signal is the learner node's part too
    run_dir = cluster.runs / "resumed"
    cut = launch(cluster, small_model, "total_steps=500")
    deadline = time.monotonic() + 180
    while len(rows(run_dir)) < 3 and cut.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    cut.send_signal(signal.SIGTERM)
    out, _ = cut.communicate(timeout=120)
    assert cut.returncode == 128 + signal.SIGTERM, out[-3000:]
    stopped_at = len(rows(run_dir))
    assert 3 <= stopped_at < 500 and (run_dir / "checkpoints" / f"step_{stopped_at}" / "COMPLETE").is_file()

    again = launch(cluster, small_model, f"total_steps={stopped_at + 2}", "resume=auto")
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-3000:]
    assert f"at step {stopped_at}" in out
    assert [r["step"] for r in rows(run_dir)] == list(range(1, stopped_at + 3))
    resumed = [e for e in events(run_dir) if e["event"] == "resume"]
    assert [e["step"] for e in resumed] == [stopped_at]


def launch(cluster: LoopbackCluster, model: str, *extra: str) -> subprocess.Popen:
    """launch/run.py joining the cluster (ray.address), the learner and the actor placed on their
    nodes; its output comes from `communicate()`."""
    args = overrides(cluster.runs, "resumed", model, "rollout.engine=fake", f"ray.address={cluster.address}",
                     "learner.resources={learner_node: 1}", "rollout.resources={rollout_node: 1}",
                     "observe.console=lines", *extra)
    return subprocess.Popen([sys.executable, "launch/run.py", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def rows(run_dir: Path) -> list[dict]:
    """The metric rows written so far (a row being written is left out)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().split("\n")[:-1]] if path.is_file() else []


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
