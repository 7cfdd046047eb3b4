"""What is checked before Ray starts: model path, lengths, packages, data."""

import json

import pytest

from asyncrl import preflight
from asyncrl.config import ConfigError, load_config


def _model_dir(tmp_path, **cfg):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_context_is_read_from_the_model_and_fills_max_model_len(tmp_path):
    d = _model_dir(tmp_path, max_position_embeddings=4096)
    cfg = preflight.resolve(load_config(None, [f"model.path={d}"]))
    assert cfg.model.max_model_len == 4096
    (tmp_path / "vl").mkdir()
    nested = _model_dir(tmp_path / "vl", text_config={"max_position_embeddings": 2048})
    assert preflight.model_context(str(nested)) == 2048
    assert preflight.model_context("builtin:tiny") == 64


@pytest.mark.parametrize("make, message", [
    (lambda p: str(p / "missing"), "does not exist"),
    (lambda p: str((p / "f.txt").write_text("x") and p / "f.txt"), "is a file"),
    (lambda p: str((p / "empty").mkdir() or p / "empty"), "without config.json"),
    (lambda p: "someone/unknown-model-xyz", "not .*in the local Hugging Face cache|no model of that name"),
    (lambda p: "builtin:huge", "the only built-in model"),
])
def test_bad_model_paths_are_named(tmp_path, make, message):
    with pytest.raises(ConfigError, match=message):
        preflight.preflight(load_config(None, [f"model.path={make(tmp_path)}"]))


def test_routing_replay_needs_a_mixture_of_experts_model(tmp_path):
    with pytest.raises(ConfigError, match="algo.moe_routing: replay .* is dense"):
        preflight.check_moe_routing(load_config(None, ["algo.moe_routing=replay"]))
    preflight.check_moe_routing(load_config(None, ["algo.moe_routing=replay", "model.tiny.num_experts=8"]))
    dense, moe = _model_dir(tmp_path, vocab_size=10), tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"text_config": {"num_local_experts": 300}}))
    with pytest.raises(ConfigError, match="is dense"):
        preflight.check_moe_routing(load_config(None, ["algo.moe_routing=replay", f"model.path={dense}"]))
    with pytest.raises(ConfigError, match="300 experts is more than 254"):
        preflight.check_moe_routing(load_config(None, ["algo.moe_routing=replay", f"model.path={moe}"]))
    preflight.check_moe_routing(load_config(None, [f"model.path={dense}"]))  # learner routing: any model


def test_lengths(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.max_tokens \(64\) must be below model.max_model_len \(64\)"):
        preflight.preflight(load_config(None, ["rollout.max_tokens=64"]))
    with pytest.raises(ConfigError, match=r"model.max_model_len \(65\) is longer than the model's context \(64\)"):
        preflight.preflight(load_config(None, ["model.max_model_len=65"]))
    with pytest.raises(ConfigError, match=r"stages.1.max_tokens \(70\)"):
        preflight.preflight(load_config(None, ["stages=[{steps: 2}, {max_tokens: 70}]"]))


def test_a_missing_package_names_the_extra(monkeypatch):
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda m: None if m == "wandb" else real(m))
    with pytest.raises(ConfigError, match=r"observe.wandb_project needs the 'wandb' package.*\.\[wandb\]"):
        preflight.preflight(load_config(None, ["observe.wandb_project=p"]))
    preflight.preflight(load_config(None, ["rollout.engine=fake"]))  # nothing needed


def test_deepspeed_backend_without_deepspeed_gives_the_install_hint(monkeypatch):
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda m: None if m == "deepspeed" else real(m))
    with pytest.raises(ConfigError, match=r"learner.backend=deepspeed needs the 'deepspeed' package.*"
                                          r"pip install deepspeed \(in the cpu and gpu extras\)"):
        preflight.preflight(load_config(None, ["learner.backend=deepspeed"]))


def test_more_ranks_than_ray_cpus_is_named(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"learner.num_ranks=4 .* need 5 Ray CPUs, more than ray.num_cpus=4"):
        preflight.preflight(load_config(None, ["learner.num_ranks=4"]))
    preflight.preflight(load_config(None, ["learner.num_ranks=3"]))  # 3 + 1 actor fit 4
    preflight.preflight(load_config(None, ["learner.num_ranks=4", "ray.address=auto"]))  # a cluster places them


def test_zero_stage_must_be_2_or_3():
    with pytest.raises(ConfigError, match=r"learner.deepspeed.stage.*2 or 3"):
        load_config(None, ["learner.deepspeed.stage=1"])


def test_data_of_the_run_its_stages_and_its_eval_is_checked(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "target": "3"}\n')
    with pytest.raises(ConfigError, match=rf"{bad}:2: no 'answer' field.*did you mean 'target'"):
        preflight.preflight(load_config(None, ["data.type=jsonl", f"data.path={bad}"]))
    with pytest.raises(ConfigError, match=rf"{bad}:2"):
        preflight.preflight(load_config(None, [f"stages=[{{data: [{{type: jsonl, path: '{bad}'}}]}}]"]))
    with pytest.raises(ConfigError, match=rf"{bad}:2"):
        preflight.preflight(load_config(None, ["data.type=jsonl", f"data.path={good}", f"eval.data={bad}"]))
    # a user reward function reads what it likes: no answer needed
    cfg = preflight.preflight(load_config(None, ["data.type=jsonl", f"data.path={bad}",
                                                 "reward.type=import:asyncrl.reward.text_rewards:AnswerTagReward"]))
    assert cfg.data.path == str(bad)


def test_a_component_that_asked_for_no_gpu_but_sees_one_is_stopped(monkeypatch):
    import torch

    from asyncrl.compat import check_gpu_visibility

    check_gpu_visibility("learner rank", "learner.num_gpus", 0)  # no CUDA here: nothing to say
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_gpu_visibility("learner rank", "learner.num_gpus", 1)  # asked for one: fine
    with pytest.raises(RuntimeError) as e:
        check_gpu_visibility("rollout engine", "rollout.num_gpus_per_actor", 0)
    message = str(e.value)
    assert "\n" not in message and "sees 2 CUDA device(s)" in message
    assert "rollout.num_gpus_per_actor" in message and 'CUDA_VISIBLE_DEVICES=""' in message


def test_a_learner_rank_checks_its_gpus_before_loading_anything(monkeypatch):
    import torch

    from asyncrl.config import AlgoConfig, LearnerConfig
    from asyncrl.learner.rank import LearnerRank

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"learner\.num_gpus=0"):
        LearnerRank("/no/such/model", LearnerConfig(), AlgoConfig())


def test_gloo_sync_from_a_cuda_learner_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"sync\.type=gloo .*learner\.num_gpus=1.*sync\.type=nccl"):
        load_config(None, ["learner.num_gpus=1"])
    assert load_config(None, ["learner.num_gpus=1", "sync.type=nccl"]).sync.type == "nccl"


def test_enforce_eager_defaults_to_the_platform(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from asyncrl.rollout.vllm_engine import VLLMEngine

    assert load_config().rollout.enforce_eager is None
    assert VLLMEngine("m").engine_kwargs()["enforce_eager"] is True  # a CPU engine here
    assert VLLMEngine("m", enforce_eager=False).engine_kwargs()["enforce_eager"] is False
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert VLLMEngine("m").engine_kwargs()["enforce_eager"] is False  # CUDA graphs on GPU
    # except where routing is recorded: a graph's replay never calls the routers' capture hook
    assert VLLMEngine("m", record_routing=True).engine_kwargs()["enforce_eager"] is True


USER_REWARDS = '''
def reads_it(response, metadata):
    return float(metadata["answer"] in response)


def reads_it_with_get(response, metadata):
    gold = metadata.get("answer")
    return float(bool(gold) and gold in response)


def ignores_it(response, metadata):
    return float(len(response) % 2)


def refuses_empty(response, metadata):
    if not response:
        raise ValueError("empty")
    return float(metadata["answer"] in response)
'''


@pytest.mark.parametrize("fn, needs", [("reads_it", True), ("reads_it_with_get", True), ("ignores_it", False),
                                       ("refuses_empty", False)])
def test_a_label_a_user_reward_reads_is_checked_like_a_builtin_verifiers(tmp_path, fn, needs):
    """A user function seen reading metadata["answer"] (called once on an empty response) makes
    every record need a label, with the near miss named; one that raises first is not seen."""
    (tmp_path / "probe_rewards.py").write_text(USER_REWARDS)
    data = tmp_path / "d.jsonl"
    # the first record has its label, the second calls it something else: scored 0 forever unchecked
    data.write_text(json.dumps({"q": "1+1=", "target": "2"}) + "\n" + json.dumps({"q": "2+2=", "solution": "4"}) + "\n")
    cfg = load_config(None, ["data.type=jsonl", f"data.path={data}", "data.prompt_field=q", "data.answer_field=target",
                             f"reward.type=import:probe_rewards:{fn}", f"reward.import_path=[{tmp_path}]"])
    if not needs:
        preflight.check_data(cfg)
        return
    with pytest.raises(ConfigError) as e:
        preflight.check_data(cfg)
    assert str(e.value) == (f"{data}:2: no 'target' field, which the reward function probe_rewards:{fn} reads as "
                            "metadata['answer']; did you mean 'solution'? set data.answer_field=solution")
