"""The one config system: pydantic models, YAML recipes in configs/, dotted overrides.

Every component receives only its own sub-config. Variants are chosen by a `type` field. A bad
value fails at load with a message naming the field and what is allowed.

    cfg = load_config("configs/tiny_cpu.yaml", ["buffer.token_budget=1024", "name=try2"])
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(_Section):
    path: str = "builtin:tiny"
    """Hugging Face model directory, or `builtin:tiny` for the locally built tiny model."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype in both learner and engines (float32 on CPU)."""
    max_model_len: int = Field(128, gt=0)
    """Longest prompt + response, in tokens."""


class DataConfig(_Section):
    type: Literal["tiny_arith", "jsonl"] = "tiny_arith"
    """Prompt source: the built-in synthetic task, or a jsonl file."""
    path: str | None = None
    """jsonl file (type=jsonl): fields prompt or messages, answer, data_source, metadata."""
    seed: int = 0
    """Seed of the prompt order / synthetic problems."""
    apply_chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template (real chat models)."""

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> "DataConfig":
        if self.type == "jsonl" and not self.path:
            raise ValueError("data.path is required when data.type is 'jsonl'")
        return self


class RolloutConfig(_Section):
    engine: Literal["vllm", "fake"] = "vllm"
    """Inference engine of each actor: vLLM, or a fake one for tests of scheduling logic."""
    num_actors: int = Field(1, ge=1)
    """Rollout actors, each owning one engine; raise it to raise throughput, no learner change."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt (n); advantages are computed within each group."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the learner scales logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; keep 1.0 for unbiased behaviour logprobs."""
    max_tokens: int = Field(16, gt=0)
    """Longest response; longer ones finish with reason `length`."""
    kv_cache_gib: int = Field(1, ge=1)
    """vLLM-CPU KV-cache size per engine (VLLM_CPU_KVCACHE_SPACE); ignored on GPU."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences an engine decodes at once."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of GPU memory an engine may use (GPU only)."""
    num_cpus_per_actor: float = Field(1.0, gt=0)
    """Logical Ray CPUs per actor."""
    num_gpus_per_actor: float = Field(0.0, ge=0)
    """Ray GPUs per actor (0 on CPU)."""
    max_in_flight_prompts: int = Field(64, ge=1)
    """Cap on prompts an actor generates at once, on top of admission control."""


class RewardConfig(_Section):
    type: Literal["math_verify"] = "math_verify"
    """Verifier for all samples (a per-data-source registry comes with the reward system)."""


class AlgoConfig(_Section):
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """grpo: (r - mean) / (std + eps); drgrpo: r - mean; rloo: r - mean of the others."""
    truncation_mask: Literal["none", "before", "after"] = "none"
    """Advantage mask for responses cut at max_tokens (Skywork-OR1 section 3.2.3)."""
    no_eos_penalty: float = Field(0.0, ge=0)
    """Subtracted from the reward of a response that never emits EOS (ProRL runs 4-5)."""
    overlong_buffer: int | None = Field(None, gt=0)
    """DAPO soft overlong punishment: tokens before max_tokens where the penalty ramps (None: off)."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    """Scale of DAPO's overlong penalty (1 in DAPO)."""
    advantage_eps: float = Field(1e-6, gt=0)
    """eps in the GRPO denominator."""
    drop_zero_variance_groups: bool = True
    """Drop groups whose rewards are all equal (no signal), counted in metrics."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip bound: ratio clipped at 1 - eps_low."""
    eps_high: float = Field(0.28, ge=0)
    """Upper clip bound: 1 + eps_high (clip-higher when > eps_low)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual clip: for A < 0 cap the token loss at -c * A (None: off)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Fixed entropy bonus coefficient alpha (loss -= alpha * entropy)."""
    aggregation: Literal["budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "budget"
    """budget: sum / Phi (C3PO); token_mean: / step tokens; seq_mean_*: mean over the step's sequences."""


class BufferConfig(_Section):
    token_budget: int = Field(512, gt=0)
    """Phi: loss tokens per optimizer step, summed over learner ranks (Ring-lite C3PO)."""
    max_staleness: int = Field(1, ge=0)
    """Most versions a trained token may lag the learner; 0 is on-policy (synchronous mode)."""


class LearnerConfig(_Section):
    backend: Literal["torch"] = "torch"
    """Training backend (DeepSpeed comes with multi-rank learners)."""
    num_ranks: int = Field(1, ge=1, le=1)
    """Learner ranks (one for now)."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    micro_batch_tokens: int = Field(4096, gt=0)
    """Tokens (context included) per forward/backward; the step's gradient does not depend on it."""
    entropy_chunk_tokens: int = Field(1024, gt=0)
    """Tokens per chunk when computing logprobs and entropy over the vocabulary."""
    num_threads: int = Field(1, ge=1)
    """torch intra-op threads of a learner rank on CPU."""
    num_cpus: float = Field(1.0, gt=0)
    """Logical Ray CPUs per learner rank."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs per learner rank."""


class SyncConfig(_Section):
    type: Literal["gloo", "nccl"] = "gloo"
    """Weight-transfer backend: gloo on CPU, NCCL (vLLM's engine) on GPUs."""
    every_steps: int = Field(1, ge=1)
    """Push weights to the actors every this many optimizer steps."""
    mode: Literal["drain"] = "drain"
    """drain: finish in-flight requests, then load (in-flight updates come later)."""
    bucket_mb: int = Field(256, gt=0)
    """Largest bucket of parameters broadcast at once."""
    timeout_s: float = Field(120.0, gt=0)
    """A push that takes longer fails loudly with the step and peer."""
    probe_every: int = Field(0, ge=0)
    """Check actor/learner logprob parity every this many pushes (0: never)."""
    probe_tolerance: float = Field(1e-4, gt=0)
    """Parity tolerance in nats; a larger gap raises."""


class ObserveConfig(_Section):
    output_dir: str = "runs"
    """Runs are written to <output_dir>/<name>/."""
    console: Literal["live", "lines", "off"] = "live"
    """live: a refreshing progress display (falls back to lines without a terminal)."""

    @field_validator("console", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as false
    tensorboard: bool = True
    """Write TensorBoard event files beside the JSONL."""
    wandb_project: str | None = None
    """Log to this W&B project too (wandb must be installed)."""


class RayConfig(_Section):
    address: str | None = None
    """Cluster to join; None joins the one `ray job submit` provides or starts a local one."""
    num_cpus: int | None = 4
    """Logical CPUs of a local cluster (may exceed physical cores)."""


class Config(_Section):
    name: str = "tiny-cpu"
    """Run name: the run directory is <observe.output_dir>/<name>."""
    seed: int = 0
    """Seeds torch, sampling and the prompt source."""
    total_steps: int = Field(200, gt=0)
    """Optimizer steps to run."""
    save_final: bool = True
    """Save the final policy (Hugging Face format) into the run directory."""
    model: ModelConfig = ModelConfig()
    """The policy: where it is loaded from, dtype, context length."""
    data: DataConfig = DataConfig()
    """Where prompts come from."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout actors and how they sample."""
    reward: RewardConfig = RewardConfig()
    """How responses are scored."""
    algo: AlgoConfig = AlgoConfig()
    """Advantages, group filtering and the loss."""
    buffer: BufferConfig = BufferConfig()
    """Token budget per step and the staleness bound."""
    learner: LearnerConfig = LearnerConfig()
    """Learner ranks and their optimizer."""
    sync: SyncConfig = SyncConfig()
    """Weight pushes from the learner to the engines."""
    observe: ObserveConfig = ObserveConfig()
    """Where metrics go and how progress is shown."""
    ray: RayConfig = RayConfig()
    """Which Ray cluster to use."""

    @property
    def run_dir(self) -> Path:
        return Path(self.observe.output_dir) / self.name


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def _parse_value(raw: str) -> Any:
    """3 -> int, 1e-3 -> float, true/false -> bool, null -> None, [..]/{..} -> YAML, else str.

    Unlike plain YAML 1.1, `off`, `no` and `on` stay strings (they are valid choices)."""
    raw = raw.strip()
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    if raw[:1] in "[{":
        return yaml.safe_load(raw)
    return raw


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", typed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted field name")
    return key, _parse_value(raw)


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown field (allowed: {', '.join(_allowed_fields(e['loc'][:-1]))})"
        elif "input" in e and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {where}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def _allowed_fields(loc: tuple) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc:
        model = model.model_fields[part].annotation  # type: ignore[assignment]
    return sorted(model.model_fields)


def config_from_dict(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (the tiny CPU default when path is None), apply dotted overrides, validate."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    tree = yaml.safe_load(path.read_text()) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    for text in overrides or []:
        _set_dotted(tree, *parse_override(text))
    return config_from_dict(tree)


def write_resolved(cfg: Config, run_dir: Path) -> Path:
    """Write the fully resolved config (defaults included) into the run directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    out.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    return out
