from pathlib import Path

import pytest
import yaml

from asyncrl.config import DEFAULT_CONFIG, ConfigError, load_config, parse_override, write_resolved

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_default_config_loads_and_is_the_tiny_cpu_one():
    cfg = load_config()
    assert DEFAULT_CONFIG.name == "tiny_cpu.yaml"
    assert cfg.model.path == "builtin:tiny" and cfg.rollout.engine == "vllm"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    load_config(path)


def test_off_stays_a_choice_not_a_bool(tmp_path):
    assert load_config(None, ["observe.console=off"]).observe.console == "off"
    f = tmp_path / "c.yaml"
    f.write_text("observe:\n  console: off\n")
    assert load_config(f).observe.console == "off"
    assert parse_override("a.b=1e-3") == ("a.b", 1e-3)
    assert parse_override("a.b=null") == ("a.b", None)
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["buffer.token_budget=1024", "algo.eps_high=0.4", "name=x", "observe.tensorboard=false"])
    assert cfg.buffer.token_budget == 1024 and cfg.algo.eps_high == 0.4
    assert cfg.name == "x" and cfg.observe.tensorboard is False


@pytest.mark.parametrize("override, field", [
    ("buffer.token_budget=-1", "buffer.token_budget"),
    ("sync.type=carrier_pigeon", "sync.type"),
    ("rollout.num_actors=0", "rollout.num_actors"),
    ("algo.eps_low=abc", "algo.eps_low"),
    ("algo.advantage_std=unbiased", "algo.advantage_std"),
    ("model.tiny.target_sampled_accuracy=1.5", "model.tiny.target_sampled_accuracy"),
    ("model.tiny.soften_to_probability=0", "model.tiny.soften_to_probability"),
    ("model.tiny.warm_start_steps=0", "model.tiny.warm_start_steps"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert field in str(e.value)


def test_unknown_field_lists_the_allowed_ones():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["buffer.token_budgett=3"])
    assert "buffer.token_budgett" in str(e.value) and "token_budget" in str(e.value)


def test_allowed_values_are_named_for_a_choice():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sync.type=udp"])
    assert "gloo" in str(e.value) and "nccl" in str(e.value)


def test_jsonl_source_needs_a_path():
    with pytest.raises(ConfigError, match="data.path"):
        load_config(None, ["data.type=jsonl"])


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError):
        parse_override("no_equals_sign")
    with pytest.raises(ConfigError):
        parse_override("bad key=1")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["seed=7"])
    out = write_resolved(cfg, tmp_path)
    again = load_config(out)
    assert again == cfg and yaml.safe_load(out.read_text())["seed"] == 7


def test_every_field_has_a_docstring():
    from pydantic import BaseModel

    from asyncrl.config import Config

    missing = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(prefix + name)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation, f"{prefix}{name}.")

    walk(Config, "")
    assert not missing, missing


def test_override_indexes_a_list_of_sections():
    cfg = load_config(None, ["stages=[{steps: 2}, {max_tokens: 8}]", "stages.0.steps=5", "stages.1.group_size=4"])
    assert cfg.stages[0].steps == 5 and cfg.stages[1].group_size == 4 and cfg.stages[1].max_tokens == 8
    with pytest.raises(ConfigError, match="not an index of a list of 2"):
        load_config(None, ["stages=[{steps: 2}, {}]", "stages.2.steps=1"])


@pytest.mark.parametrize("overrides, field", [
    (["algo.is_weight_cap=3"], "algo.decoupled"),
    (["algo.entropy_control.enabled=true", "algo.entropy_coef=0.01"], "algo.entropy_coef"),
    (["algo.kl.reset_every=10"], "algo.kl.coef"),
    (["buffer.minibatch_prompts=4"], "buffer.rollout_batch_prompts"),
    (["buffer.rollout_batch_prompts=6", "buffer.minibatch_prompts=4"], "multiple"),
    (["buffer.num_reuse=2"], "buffer.rollout_batch_prompts"),
    (["buffer.rollout_batch_prompts=4", "buffer.stale_policy=wait"], "buffer.stale_policy wait applies to the"),
    (["buffer.rollout_batch_prompts=4", "buffer.stale_policy=ess"], "buffer.stale_policy ess applies to the"),
    (["buffer.max_staleness=2", "buffer.ess_max_lag=1"], "buffer.ess_max_lag"),
    (["buffer.stale_policy=ess", "learner.offpolicy_metrics=false"], "learner.offpolicy_metrics"),
    (["stages=[{max_tokens: 4}, {steps: 3}]"], "stages.0.steps"),
    (["model.max_model_len=64", "stages=[{max_tokens: 500}]"], "stages.0.max_tokens"),
    (["algo.entropy_control.measure=sometimes"], "algo.entropy_control.measure"),
    (["algo.kl.estimator=k4"], "algo.kl.estimator"),
    (["reward.type=code", "reward.timeout_s=20"], "reward.code.sandbox.compile_time_s"),
    (["reward.by_source={cc: code}", "reward.code.sandbox.wall_time_s=29"], "reward.timeout_s"),
    (["reward.type=grader"], "reward.type"),
    (["reward.by_source={gpqa: mcq}"], "gpqa"),
    (["rollout.group_size=1"], "rollout.group_size: must be at least 2"),
    (["stages=[{group_size: 1}]"], "stages.0.group_size: must be at least 2"),
])
def test_inconsistent_algorithm_switches_fail_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_stale_policies_stream_and_ess_lag_may_equal_the_bound():
    assert load_config().buffer.stale_policy == "discard"
    cfg = load_config(None, ["buffer.stale_policy=ess", "buffer.max_staleness=2", "buffer.ess_max_lag=2"])
    assert (cfg.buffer.stale_policy, cfg.buffer.ess_min, cfg.buffer.ess_max_lag) == ("ess", 0.9, 2)
    load_config(None, ["buffer.rollout_batch_prompts=4", "buffer.stale_policy=discard"])  # a rollout batch discards


def test_a_code_run_that_fits_the_reward_timeout_is_accepted():
    cfg = load_config(None, ["reward.type=code", "reward.timeout_s=26"])  # 15 + 10 < 26
    assert cfg.reward.code.sandbox.compile_time_s + cfg.reward.code.sandbox.wall_time_s < cfg.reward.timeout_s


def test_decoupled_ppo_caps_its_importance_weight_by_default_and_warns_without_a_cap():
    """A streaming step's ratio to pi_prox is exactly 1: the cap is its only trust region."""
    assert load_config(None, ["algo.decoupled=true"]).algo.is_weight_cap == 2.0
    with pytest.warns(UserWarning, match="nothing bounds its update"):
        assert load_config(None, ["algo.decoupled=true", "algo.is_weight_cap=null"]).algo.is_weight_cap is None
    assert load_config(None, []).algo.decoupled is False  # the default: no decoupled weight, no error


def test_the_parity_tolerance_adds_each_side_s_rounding_floor_unless_set():
    from asyncrl.config.sync_section import ROUNDING_FLOOR_NATS

    assert load_config(DEFAULT_CONFIG).parity_tolerance == pytest.approx(1e-4)  # float32 learner and engines
    bf16 = ROUNDING_FLOOR_NATS["bfloat16"]
    both = load_config(DEFAULT_CONFIG, ["model.dtype=bfloat16"])
    assert both.engine_dtype == "bfloat16" and both.parity_tolerance == pytest.approx(2 * bf16)
    mixed = load_config(DEFAULT_CONFIG, ["rollout.dtype=bfloat16"])
    assert mixed.parity_tolerance == pytest.approx(bf16 + 5e-5)
    assert load_config(DEFAULT_CONFIG, ["model.dtype=bfloat16", "sync.probe_tolerance=0.01"]).parity_tolerance == 0.01


def test_delta_pushes_are_refused_on_nccl_and_default_to_whole_pushes():
    cfg = load_config(None, [])
    assert cfg.sync.transfer == "full" and cfg.sync.full_every == 100
    assert load_config(None, ["sync.transfer=delta", "sync.full_every=0"]).sync.transfer == "delta"
    with pytest.raises(ConfigError, match="sync.transfer=delta is implemented for sync.type=gloo only"):
        load_config(None, ["sync.transfer=delta", "sync.type=nccl"])
    with pytest.raises(ConfigError, match="transfer"):
        load_config(None, ["sync.transfer=sparse"])
