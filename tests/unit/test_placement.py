"""Where the learner ranks and actors may go: each asks for CPUs, GPUs and custom resources, a
run that no node can place says what is missing at once, and the environment a process on
another node needs travels with it from one list."""

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.orchestrator.components import process_env
from asyncrl.orchestrator.placement import actor_resources, check_placeable, rank_resources

NODES = [
    {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 0.0, "node:10.0.0.2": 1.0}},
    {"Alive": True, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 8.0, "learner_node": 1.0, "memory": 1e9}},
    {"Alive": True, "NodeManagerAddress": "10.0.0.4", "Resources": {"CPU": 4.0, "GPU": 1.0, "rollout_node": 2.0}},
    {"Alive": False, "NodeManagerAddress": "10.0.0.5", "Resources": {"CPU": 64.0, "GPU": 8.0, "learner_node": 1.0}},
]


def test_resources_are_the_config_fields():
    cfg = load_config(None, ["learner.resources={learner_node: 1}", "learner.num_gpus=1", "rollout.resources={rollout_node: 1}",
                             "rollout.num_gpus_per_actor=0.5", "sync.type=nccl"])
    assert rank_resources(cfg.learner) == {"CPU": 1.0, "GPU": 1.0, "learner_node": 1.0}
    assert actor_resources(cfg.rollout) == {"CPU": 1.0, "GPU": 0.5, "rollout_node": 1.0}
    assert rank_resources(load_config(None, []).learner) == {"CPU": 1.0}  # no GPU key when none is asked


def test_a_component_some_live_node_holds_passes():
    check_placeable({"CPU": 1.0, "learner_node": 1.0}, "a learner rank", "learner.resources", NODES)
    check_placeable({"CPU": 1.0, "GPU": 1.0, "rollout_node": 1.0}, "a rollout actor", "rollout.resources", NODES)


@pytest.mark.parametrize("needs, short", [
    ({"CPU": 1.0, "GPU": 1.0, "learner_node": 1.0}, "on one node"),  # each exists, never together (10.0.0.5 is dead)
    ({"CPU": 1.0, "learner_node": 2.0}, "learner_node"),
    ({"CPU": 1.0, "tpu": 1.0}, "tpu"),
])
def test_a_component_no_live_node_holds_is_named_with_what_the_nodes_have(needs, short):
    with pytest.raises(ConfigError) as e:
        check_placeable(needs, "a learner rank", "learner.num_gpus or learner.resources", NODES)
    text = str(e.value)
    assert text.startswith("no Ray node can hold a learner rank (") and f"not enough {short})" in text
    assert ("the nodes have 10.0.0.2: CPU 0; 10.0.0.3: CPU 8, learner_node 1; 10.0.0.4: CPU 4, GPU 1, rollout_node 2; "
            "change learner.num_gpus or learner.resources") in text


def test_a_remote_process_gets_the_forwarded_variables_and_not_the_drivers_devices():
    cfg = load_config(None, [])
    env = process_env(cfg, "learner", {"NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_BLOCKING_WAIT": "1",
                                       "GLOO_SOCKET_IFNAME": "eth0", "HF_HOME": "/data/hf", "HF_HUB_OFFLINE": "1",
                                       "CUDA_VISIBLE_DEVICES": "0,1", "NCCLX": "no", "HOME": "/root"})
    own = ("ASYNCRL_LOG_FILE", "ASYNCRL_HIDE_MODULES", "PYTHONPATH")  # set by asyncrl itself (compat, worker_logs)
    assert {k: v for k, v in env.items() if k not in own} == {
        "NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_BLOCKING_WAIT": "1", "GLOO_SOCKET_IFNAME": "eth0",
        "HF_HOME": "/data/hf", "HF_HUB_OFFLINE": "1"}  # Ray sets each process's own CUDA_VISIBLE_DEVICES


def test_a_component_that_could_not_start_is_told_in_one_line():
    from asyncrl.orchestrator.components import start_failure

    class TaskError(Exception):  # a failed start() call: Ray keeps the exception as `cause`
        cause = RuntimeError("rollout engine asked for no GPU (rollout.num_gpus_per_actor=0) but sees 1 CUDA device(s)")

    assert start_failure(TaskError()) == ("RuntimeError: rollout engine asked for no GPU "
                                          "(rollout.num_gpus_per_actor=0) but sees 1 CUDA device(s)")
    # a constructor's failure comes as the actor's death, its traceback in the message
    died = Exception("The actor died because of an error raised in its creation task\n  File \"rank.py\", "
                     "line 74\nRuntimeError: learner rank asked for no GPU (learner.num_gpus=0)\n")
    assert start_failure(died) == "RuntimeError: learner rank asked for no GPU (learner.num_gpus=0)"
