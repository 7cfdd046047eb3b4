"""The one config system: pydantic models (schema.py), YAML recipes in configs/, dotted overrides
(load.py).

Every component receives only its own sub-config. Variants are chosen by a `type` field. A bad
value fails at load with a message naming the field and what is allowed.

    cfg = load_config("configs/tiny_cpu.yaml", ["buffer.token_budget=1024", "name=try2"])
"""

from asyncrl.config.load import (DEFAULT_CONFIG, ConfigError, config_from_dict, dump_config, load_config,
                                 parse_override, write_resolved)
from asyncrl.config.algo_section import AlgoConfig, DistillConfig, EntropyControlConfig, KLConfig
from asyncrl.config.reward_section import BUILTIN_VERIFIERS, CodeRewardConfig, RewardConfig, SandboxConfig
from asyncrl.config.model_section import ModelConfig, TinyModelConfig
from asyncrl.config.schema import (BufferConfig, Config, DataConfig, DataMixConfig, EvalConfig, LearnerConfig,
                                   ObserveConfig, RayConfig, RolloutConfig, StageConfig)
from asyncrl.config.learner_section import LoraConfig
from asyncrl.config.sync_section import SyncConfig

__all__ = [
    "DEFAULT_CONFIG", "ConfigError", "config_from_dict", "dump_config", "load_config", "parse_override",
    "write_resolved",
    "BUILTIN_VERIFIERS", "AlgoConfig", "BufferConfig", "CodeRewardConfig", "Config", "DataConfig",
    "DataMixConfig", "DistillConfig", "EntropyControlConfig", "EvalConfig", "KLConfig", "LearnerConfig", "LoraConfig",
    "ModelConfig", "ObserveConfig",
    "RayConfig", "RewardConfig", "RolloutConfig", "SandboxConfig", "StageConfig", "SyncConfig",
    "TinyModelConfig",
]
