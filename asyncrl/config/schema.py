"""The config schema: one pydantic section per component, each field with its docstring, and the
checks across fields (the reward section is in reward_section.py, the algorithm's in
algo_section.py, the model's in model_section.py). Loading (YAML, dotted overrides, error messages) is in config/load.py."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.algo_section import AlgoConfig
from asyncrl.config.env_section import EnvConfig
from asyncrl.config.learner_section import LearnerConfig
from asyncrl.config.model_section import ModelConfig
from asyncrl.config.reward_section import RewardConfig
from asyncrl.config.section import _Section
from asyncrl.config.sync_section import SyncConfig, parity_tolerance


def check_group_size(n: int | None) -> int | None:
    # every estimator (grpo, drgrpo, rloo) compares a response with the rest of its group: alone,
    # its advantage is 0, every group is dropped as signal-free and the run stalls without a step
    if n is not None and n < 2:
        raise ValueError(f"must be at least 2: the advantage estimators (grpo, drgrpo, rloo) compare each "
                         f"response with the others of its group, so a group of {n} has no learning signal "
                         "(8 is usual)")
    return n


class DataConfig(_Section):
    type: Literal["tiny_arith", "tiny_calc", "jsonl"] = "tiny_arith"
    """Prompt source: a built-in synthetic task (tiny_arith: addition; tiny_calc: two-digit
    multiplication with the calculator, model.tiny.task calc_tool), or a jsonl file."""
    path: str | None = None
    """jsonl file (type=jsonl), one record a line: prompt (or messages), answer (or ground_truth),
    optional data_source (or domain), tests, metadata. Every record is checked before Ray starts."""
    prompt_field: str = "prompt"
    """The record field holding the prompt text (`messages`, a chat list, is used when present)."""
    answer_field: str = "answer"
    """The record field holding the reference answer (`ground_truth` is read when it is absent)."""
    seed: int = 0
    """Seed of the prompt order / synthetic problems."""
    apply_chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template (real chat models)."""

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> "DataConfig":
        if self.type == "jsonl" and not self.path:
            raise ValueError("data.path is required when data.type is 'jsonl'")
        return self


class DataMixConfig(DataConfig):
    weight: float = Field(1.0, gt=0)
    """Relative share of prompts drawn from this source within its stage's mixture."""


class StageConfig(_Section):
    """One training stage (Skywork-OR1 section 3.2.2, Ring-lite section 3.4); None inherits the run's value."""

    name: str | None = None
    """Shown in logs and metrics (default: stage<index>)."""
    steps: int | None = Field(None, gt=0)
    """Optimizer steps in this stage; None only for the last stage (runs to total_steps)."""
    until_reward_mean: float | None = None
    """Also end the stage once the mean reward of its last until_window steps reaches this."""
    until_window: int = Field(10, ge=1)
    """Steps averaged for until_reward_mean."""
    data: list[DataMixConfig] | None = None
    """Dataset mixture of the stage (None: the run's data section)."""
    max_tokens: int | None = Field(None, gt=0)
    """Longest response in this stage (rollout.max_tokens when None)."""
    group_size: int | None = Field(None, ge=1)
    """Samples per prompt in this stage, at least 2 (rollout.group_size when None)."""
    temperature: float | None = Field(None, gt=0)
    """Sampling temperature in this stage (rollout.temperature when None)."""
    token_budget: int | None = Field(None, gt=0)
    """Phi in this stage, the batch size in loss tokens (buffer.token_budget when None)."""
    online_filter: bool = False
    """On entering this stage, drop prompts whose pass rate in the previous stage was 1
    (Skywork-OR1 section 3.1); prompts not seen in the previous stage stay."""

    @field_validator("group_size")
    @classmethod
    def _a_group(cls, v: int | None) -> int | None:
        return check_group_size(v)


class RolloutConfig(_Section):
    engine: Literal["vllm", "fake"] = "vllm"
    """Inference engine of each actor: vLLM, or a fake one for tests of scheduling logic."""
    num_actors: int = Field(1, ge=1)
    """Rollout actors, each owning one engine; raise it to raise throughput, no learner change."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The engines' weight and compute dtype (None: model.dtype). The mismatch knob: half-precision
    engines under a float32 learner sample from a policy that differs from the one trained by
    rounding alone (trainer/engine mismatch, `offpolicy/mismatch_*`), with no staleness. On CPUs
    whose vLLM bfloat16 kernels fault (SIGILL, an engine that dies at its first step), use float16."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt (n), at least 2; advantages are computed within each group."""
    sampling_seed_offset: int = 0
    """Added to `seed` for the rollouts' sampling only (the prompt order and the learner keep
    `seed`): a run that differs from another by this alone differs by what a rerun varies. A
    study's A/A copy sets it, since runs of one seed are otherwise identical."""
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
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs each actor's vLLM engine spans (tensor parallel); with more than 1, set
    rollout.num_gpus_per_actor to the same number. Every TP worker joins the weight-sync group."""
    resources: dict[str, float] = {}
    """Custom Ray resources each actor asks for, e.g. {rollout_node: 1} to keep actors on the nodes
    started with `ray start --resources '{"rollout_node": 8}'`; a run no node can place fails at start."""
    spread: bool = False
    """Place actors on different nodes where possible (Ray's SPREAD strategy) rather than packed."""
    enforce_eager: bool | None = None
    """vLLM's enforce_eager (no CUDA graphs); None: on for CPU engines, off on GPU (graphs decode faster)."""
    max_in_flight_prompts: int = Field(64, ge=1)
    """Cap on prompts an actor generates at once, on top of admission control (unless
    max_in_flight_requests is set)."""
    max_in_flight_requests: int | None = Field(None, ge=1)
    """Cap on requests (samples still generating) per actor instead: a group's finished samples free
    their slots for new prompts while its longest one runs; a prompt is handed to an actor below the
    cap. Set it to what the engine runs at once (rollout.max_num_seqs) to keep the engine full."""

    @field_validator("group_size")
    @classmethod
    def _a_group(cls, v: int) -> int:
        return check_group_size(v)

    @model_validator(mode="after")
    def _tp_has_its_gpus(self) -> "RolloutConfig":
        if self.tensor_parallel_size > 1 and self.num_gpus_per_actor != self.tensor_parallel_size:
            raise ValueError(f"rollout.tensor_parallel_size={self.tensor_parallel_size} needs that many GPUs per "
                             "actor: "
                             f"set rollout.num_gpus_per_actor={self.tensor_parallel_size} "
                             f"(it is {self.num_gpus_per_actor:g})")
        return self


class BufferConfig(_Section):
    token_budget: int = Field(512, gt=0)
    """Phi: loss tokens per optimizer step, summed over learner ranks (Ring-lite C3PO)."""
    max_staleness: int = Field(1, ge=0)
    """Most versions a token may lag the learner when its response enters training (a streaming
    step first takes it, or its rollout batch is sealed); 0 is on-policy (synchronous mode). Its
    total lag adds the steps since then: up to N_SGD - 1 in a rollout batch, and the step(s) the
    rest of a response split at the Phi boundary follows its prefix by (`staleness/async_max` is
    bounded by this, `staleness/max` is the total). `stale_policy: ess` relaxes the bound by design,
    up to `ess_max_lag` (then `staleness/async_max` may exceed it)."""
    cut: Literal["split", "whole"] = "split"
    """Streaming: `split` takes exactly Phi tokens a step, splitting the response at the boundary
    (its rest opens the next step); `whole` takes whole responses until the step holds at least
    Phi (Ring-lite's greedy selection; the loss still divides by Phi in budget mode)."""
    rollout_batch_prompts: int | None = Field(None, gt=0)
    """D_R (Skywork-OR1 section 4): collect this many kept groups, then train on them for N_SGD
    steps. None streams: each step takes the next Phi tokens as they arrive."""
    minibatch_prompts: int | None = Field(None, gt=0)
    """D_T: groups per optimizer step, so N_SGD = D_R / D_T * num_reuse (the loss still divides by
    Phi in budget mode). None: each step takes exactly Phi loss tokens of the rollout batch."""
    num_reuse: int = Field(1, ge=1)
    """N_reuse: passes over each rollout batch (each pass shuffled); 1 uses every token once."""
    stale_policy: Literal["discard", "wait", "pace", "ess", "train"] = "discard"
    """Streaming only: what to do about work that would be more than max_staleness behind when it
    enters training. Discarding it biases the batch towards short answers (long responses go stale
    first; `buffer/length_bias` < 0); each alternative pays for that elsewhere
    (docs/design/versions.md):
    `discard` drops the stale tokens (free; the bias stays);
    `wait` holds the learner's next step while a group admitted at learner version a with
    a + max_staleness < version + 1 is still generating or scoring, so no group goes stale while
    it is out (tokens that landed beyond the next Phi still can; costs learner idle time;
    max_staleness 0 is the synchronous schedule);
    `pace` hands out no new prompt while a group admitted at a <= version - max_staleness is still
    generating, so the engines finish old work first (costs rollout throughput; what still goes
    stale is dropped);
    `ess` trains a stale response anyway while the batch's effective sample size, estimated from
    the learner's ratio moments per staleness bucket, stays >= `ess_min`, and never beyond
    `ess_max_lag` (costs gradient variance; relaxes the bound by design);
    `train` drops nothing: max_staleness bounds admission only (AReaL's rule) and what arrives later
    than that is trained under the run's off-policy correction (algo.decoupled, a TIS or IcePop
    weight), `staleness/*` and the offpolicy/ ESS reporting what it costs (relaxes the bound by design)."""
    ess_min: float = Field(0.9, gt=0, le=1)
    """`stale_policy: ess`: the least estimated normalized ESS of a batch that a stale response may
    join."""
    ess_max_lag: int | None = Field(None, ge=0)
    """`stale_policy: ess`: the most versions behind a token may be when its response enters
    training; None is max_staleness + 4."""

    @model_validator(mode="after")
    def _schedule(self) -> "BufferConfig":
        if self.minibatch_prompts is not None:
            if self.rollout_batch_prompts is None:
                raise ValueError("buffer.minibatch_prompts needs buffer.rollout_batch_prompts")
            if self.rollout_batch_prompts % self.minibatch_prompts:
                raise ValueError(f"buffer.rollout_batch_prompts ({self.rollout_batch_prompts}) must be a "
                                 f"multiple of buffer.minibatch_prompts ({self.minibatch_prompts})")
        if self.cut != "split" and self.rollout_batch_prompts is not None:
            raise ValueError("buffer.cut applies to the streaming buffer (no buffer.rollout_batch_prompts)")
        if self.num_reuse > 1 and self.rollout_batch_prompts is None:
            raise ValueError("buffer.num_reuse > 1 needs buffer.rollout_batch_prompts (the batch reused)")
        if self.stale_policy != "discard" and self.rollout_batch_prompts is not None:
            raise ValueError(f"buffer.stale_policy {self.stale_policy} applies to the streaming buffer "
                             "(no buffer.rollout_batch_prompts); a rollout batch always discards")
        if self.ess_max_lag is not None and self.ess_max_lag < self.max_staleness:
            raise ValueError(f"buffer.ess_max_lag ({self.ess_max_lag}) must be >= buffer.max_staleness "
                             f"({self.max_staleness})")
        return self


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
    """Log to this W&B project too (needs wandb: `pip install -e ".[wandb]"`)."""
    engine_log_level: Literal["debug", "info", "warning", "error"] = "warning"
    """vLLM's log level in the rollout actors (VLLM_LOGGING_LEVEL): "info" brings back its
    start-up and per-push lines (prefix-cache resets); they go where worker_logs says."""
    worker_logs: Literal["file", "console"] = "file"
    """file: what Ray, the learner and the vLLM engines print goes to <run dir>/logs/ and the
    console shows asyncrl's own lines; console: it is also forwarded to the console."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """A run that makes no optimizer step for this long stops with exit 1 and says what was
    dropped and why (a warning comes every minute before that). Raise it for very long responses."""
    samples_per_step: int = Field(4, ge=0)
    """Completions (with rewards) written to samples.jsonl and TensorBoard each step."""


class EvalConfig(_Section):
    every_steps: int = Field(50, ge=0)
    """Evaluate the policy on held-out prompts at step 0, every this many steps and at the end
    (0: never). It runs on a rollout actor beside generation; the results land in the step row
    where they complete, as eval/avg@<n> and eval/pass@<k>, with eval/step saying which policy."""
    data: str | None = None
    """jsonl of held-out prompts (same fields as data.path). None: the built-in task's held-out
    split when data.type is tiny_arith or tiny_calc; with jsonl data and no eval.data there is no evaluation."""
    n: int = Field(8, ge=1)
    """Samples per prompt: avg@n is their mean reward, pass@k the unbiased estimate from them."""
    pass_k: list[int] | None = None
    """k values for pass@k, each at most n (None: [n]). A sample passes when its reward is >= 1."""
    max_prompts: int | None = Field(None, gt=0)
    """Evaluate on the first this many records of the eval data (None: all)."""
    temperature: float | None = Field(None, gt=0)
    """Sampling temperature (None: the current stage's)."""

    @model_validator(mode="after")
    def _k_within_n(self) -> "EvalConfig":
        for k in self.pass_k or []:
            if not 1 <= k <= self.n:
                raise ValueError(f"eval.pass_k: {k} is not between 1 and eval.n ({self.n})")
        return self


class CheckpointConfig(_Section):
    every_steps: int = Field(50, ge=0)
    """Write a checkpoint every this many optimizer steps (0: only when the run is stopped by a signal)."""
    keep: int = Field(2, ge=1)
    """Newest checkpoints kept under runs/<name>/checkpoints/; older ones are deleted."""


class FaultConfig(_Section):
    max_restarts: int = Field(2, ge=0)
    """Times a run restarts its learner ranks in place when one dies: from the newest checkpoint
    (the base model before the first), the rollout actors and reward workers kept, the steps after
    the checkpoint trained again. Past the last restart the run stops and says how to resume."""
    actor_timeout_s: float | None = Field(300.0, gt=0)
    """A rollout actor that does not answer a ping for this long (a frozen process, a blocked
    event loop) is lost: killed, its groups requeued, a fresh actor started. Without this its
    groups would count as generating until the run stalls (observe.stall_timeout_s). Keep it
    above anything that may block an actor's event loop; None: never."""


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
    total_steps: int = Field(300, gt=0)
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
    env: EnvConfig = EnvConfig()
    """Multi-turn episodes against an environment (a tool, a feedback task); off by default."""
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
    checkpoint: CheckpointConfig = CheckpointConfig()
    """When the run saves what it needs to resume."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation during training."""
    fault: FaultConfig = FaultConfig()
    """How the run heals itself."""
    resume: str | None = None
    """`auto`: continue from the newest complete checkpoint of this run's directory (start fresh if
    there is none); a path: from that checkpoint directory; None: start fresh."""
    stages: list[StageConfig] = []
    """Training stages in order (empty: one stage with the sections above)."""

    @property
    def engine_dtype(self) -> str:
        return self.rollout.dtype or self.model.dtype

    @property
    def parity_tolerance(self) -> float:
        """sync.probe_tolerance, else the one the learner's and the engines' dtypes give."""
        return self.sync.probe_tolerance or parity_tolerance(self.model.dtype, self.engine_dtype)

    @property
    def longest_response(self) -> int:
        """max_tokens of the stage that allows the longest responses."""
        return max([st.max_tokens or self.rollout.max_tokens for st in self.stages] or [self.rollout.max_tokens])

    @model_validator(mode="after")
    def _dtypes(self) -> "Config":
        compute, params = self.model.dtype, self.learner.param_dtype
        if compute == "float16":
            raise ValueError("model.dtype=float16: the learner would compute in float16 without loss scaling, "
                             "which it does not do; use bfloat16 (or float32)")
        if compute == "float32" and params != "float32":
            raise ValueError(f"learner.param_dtype={params} is narrower than the compute dtype model.dtype=float32; "
                             "use learner.param_dtype=float32")
        if self.sync.type == "gloo" and self.learner.num_gpus > 0 and not self.learner.lora.enabled:
            raise ValueError(f"sync.type=gloo cannot push from a CUDA learner (learner.num_gpus="
                             f"{self.learner.num_gpus:g}): gloo sends CPU tensors; use sync.type=nccl "
                             "(a LoRA adapter, learner.lora, is small enough to copy to the CPU and goes over gloo)")
        if self.learner.backend == "deepspeed" and params != "float32":
            raise ValueError("learner.param_dtype must be float32 with learner.backend=deepspeed (its bf16 mode "
                             "always keeps float32 master weights)")
        return self

    @model_validator(mode="after")
    def _lora_fits(self) -> "Config":
        if not self.learner.lora.enabled:
            return self
        resets = self.algo.kl.needs_reference and (self.algo.kl.reset_every or self.algo.kl.reset_kl_threshold)
        if self.learner.backend == "deepspeed" and self.learner.deepspeed.stage == 3 and resets:
            raise ValueError("learner.lora with ZeRO-3 (learner.deepspeed.stage=3) cannot reset the KL reference "
                             "(algo.kl.reset_every, reset_kl_threshold): the reset's adapter copy needs whole "
                             "parameters; use stage 2 or learner.backend=torch")
        if self.sync.type != "gloo":
            raise ValueError("learner.lora pushes its adapter over sync.type=gloo (from GPU learners too: it is "
                             "copied to the CPU); vLLM's NCCL receiver loads weights into the model, not adapters")
        return self

    @model_validator(mode="after")
    def _keep_kv_is_inflight(self) -> "Config":
        if self.sync.transfer == "delta" and self.sync.type != "gloo":
            raise ValueError("sync.transfer=delta is implemented for sync.type=gloo only (NCCL pushes are whole); "
                             "set sync.transfer=full")
        if self.sync.keep_kv and self.sync.mode != "inflight":
            raise ValueError("sync.keep_kv keeps running requests across an in-flight update: set sync.mode=inflight "
                             "(drain lets them finish first)")
        return self

    @model_validator(mode="after")
    def _tiny_task_matches(self) -> "Config":
        calc_data, calc_model = self.data.type == "tiny_calc", self.model.tiny.task == "calc_tool"
        if self.model.path == "builtin:tiny" and calc_data != calc_model:
            raise ValueError("data.type tiny_calc and model.tiny.task calc_tool go together: the built-in model "
                             "is warm-started on the built-in task it will be trained on. To train the "
                             "calculator-trained tiny model on data of your own, give its directory as model.path: "
                             "`python tools/build_tiny_model.py --config tiny_tool` builds it (or finds it "
                             "cached) and prints the path")
        if calc_data and self.env.type is None:
            raise ValueError("data.type tiny_calc is solved with the calculator: set env.type calculator")
        return self

    @model_validator(mode="after")
    def _distill_fits(self) -> "Config":
        d = self.algo.distill
        if d.enabled and self.rollout.temperature != 1.0:
            warnings.warn(f"algo.distill with rollout.temperature={self.rollout.temperature:g}: the teacher scores "
                          "at temperature 1 and the behaviour logprobs are the tempered ones, so the per-token "
                          "term also rewards the temperature's own shift; sample at 1.0 to distil the teacher "
                          "itself", stacklevel=2)
        return self

    @model_validator(mode="after")
    def _env_fits(self) -> "Config":
        if self.env.type is not None and self.algo.decoupled:
            raise ValueError("env.type with decoupled PPO (algo.decoupled) is not supported yet: its proximal "
                             "logprobs are kept per response position, and an episode's observation tokens "
                             "have none; use the behaviour policy as the anchor")
        return self

    @model_validator(mode="after")
    def _ess_has_its_moments(self) -> "Config":
        if self.buffer.stale_policy == "ess" and not self.learner.offpolicy_metrics:
            raise ValueError("buffer.stale_policy=ess estimates ESS from the learner's offpolicy/ ratio moments: "
                             "set learner.offpolicy_metrics=true")
        return self

    @model_validator(mode="after")
    def _stages(self) -> "Config":
        for i, st in enumerate(self.stages):
            last = i == len(self.stages) - 1
            if st.steps is None and not last:
                raise ValueError(f"stages.{i}.steps is required (only the last stage may run to total_steps)")
            max_tokens = st.max_tokens or self.rollout.max_tokens
            if self.model.max_model_len is not None and max_tokens >= self.model.max_model_len:
                raise ValueError(f"stages.{i}.max_tokens ({max_tokens}) leaves no room for the prompt "
                                 f"within model.max_model_len ({self.model.max_model_len})")
        return self

    @property
    def sampling_seed(self) -> int:
        """The seed of the rollouts' sampling (each actor adds its id, each request hashes it)."""
        return self.seed + self.rollout.sampling_seed_offset

    @property
    def run_dir(self) -> Path:
        return Path(self.observe.output_dir) / self.name
