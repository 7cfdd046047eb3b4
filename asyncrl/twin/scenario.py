"""A twin scenario (configs/twin/*.yaml): the hardware, the model, how its GPUs are split between
generation and training, the engines' and the learner's costs, the workload and the run's
asyncrl settings. Unknown keys are errors, as in a run config; `key=value` overrides as on
`asyncrl run`. Every figure in a shipped scenario names its source in a comment."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from asyncrl.config.load import ConfigError, _set_dotted, explain, parse_override, read_recipe
from asyncrl.config.section import _Section
from asyncrl.twin.costs import EngineCost, LearnerCost, PushCost, engine_cost_from_hardware, kv_capacity_tokens
from asyncrl.twin.workload import Lengths, PassRates, lengths_of_run


class Link(_Section):
    alpha_s: float = Field(gt=0)
    """Latency of one message (one bucket of a broadcast)."""
    beta_bytes_per_s: float = Field(gt=0)
    """Bandwidth a broadcast gets from it."""


class Hardware(_Section):
    gpu: str = "H100-SXM"
    peak_flops: float = Field(989e12, gt=0)
    """Dense BF16 FLOP/s of one GPU."""
    hbm_bytes_per_s: float = Field(3.35e12, gt=0)
    gpu_memory_gib: float = Field(80, gt=0)
    gpus_per_node: int = Field(8, ge=1)
    intra_node: Link = Link(alpha_s=10e-6, beta_bytes_per_s=150e9)
    inter_node: Link = Link(alpha_s=20e-6, beta_bytes_per_s=40e9)


class Model(_Section):
    params: float = Field(gt=0)
    bytes_per_param: float = Field(2, gt=0)
    """Of the weights the engines hold and the push carries (2: bf16)."""
    kv_bytes_per_token: float = Field(gt=0)
    """2 (K and V) x layers x KV heads x head dim x bytes."""

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


class Split(_Section):
    gen_gpus: int = Field(ge=1)
    train_gpus: int = Field(ge=1)
    tp: int = Field(1, ge=1)
    """GPUs per engine (tensor parallel)."""
    colocated: bool = False
    """The same GPUs generate and train, in turns (the synchronous baseline's placement)."""

    @model_validator(mode="after")
    def _whole_engines(self) -> "Split":
        if self.gen_gpus % self.tp:
            raise ValueError(f"gen_gpus ({self.gen_gpus}) must be a multiple of tp ({self.tp})")
        return self

    @property
    def engines(self) -> int:
        return self.gen_gpus // self.tp


class Engine(_Section):
    max_num_seqs: int = Field(256, ge=1)
    memory_utilization: float = Field(0.9, gt=0, le=1)
    bandwidth_efficiency: float = Field(0.6, gt=0, le=1)
    """Share of HBM bandwidth a decode step gets (weights and KV reads)."""
    prefill_mfu: float = Field(0.5, gt=0, le=1)
    step_overhead_s: float = Field(0.0, ge=0)
    """Per step beyond the memory model: scheduling, sampling, kernel launches."""
    c0_s: float | None = Field(None, ge=0)
    """Explicit costs (a calibrated machine) replace the ones derived from the hardware."""
    c_seq_s: float | None = Field(None, ge=0)
    c_ctx_s: float | None = Field(None, ge=0)
    c_prefill_s: float | None = Field(None, ge=0)
    c_request_s: float = Field(0.0, ge=0)
    """Per request started (EngineCost.c_request_s); 0 next to a GPU's steps."""
    kv_tokens: int | None = Field(None, ge=1)
    slowdown_while_training: float = Field(1.0, ge=1)
    """Steps take this many times their cost while the learner trains: 1 where generation and
    training have hardware of their own; above 1 on a machine where they share cores (the CPU demo)."""


class Learner(_Section):
    mfu: float = Field(0.4, gt=0, le=1)
    flops_per_param_token: float = Field(6.0, gt=0)
    fixed_s: float = Field(0.0, ge=0)
    per_token_s: float = Field(0.0, ge=0)
    loop_overhead_s: float = Field(0.0, ge=0)
    """Per step, the orchestrator's own work around it, the driver's thread blocked: the Ray
    calls that start the step and collect its result, the row and samples it writes (tens of ms;
    calibrated machines measure it, GPU scenarios can leave it at 0 next to steps of seconds)."""
    slowdown_while_generating: float = Field(1.0, ge=1)
    """A step's work goes this many times slower while any engine generates: 1 where they have
    hardware of their own; above 1 where they share cores (the CPU demo: two cores for the
    learner, the engine and the processes around them). The engine's side of it is
    engine.slowdown_while_training."""
    ranks: int | None = Field(None, ge=1)
    """Learner processes the batch is split over (default: one per training GPU)."""


class Push(_Section):
    bucket_mb: int = Field(256, gt=0)
    load_bytes_per_s: float = Field(100e9, gt=0)
    fixed_s: float = Field(0.0, ge=0)
    switch_s: float = Field(0.0, ge=0)
    """Colocated layouts only (`sync`, `colocate_async`), per push: the GPUs' switch between training
    and generation beyond the weights' transfer (verl's: the trainer offloads, vLLM wakes and
    reallocates its KV cache, the weights are resharded, and back)."""
    link: Literal["auto", "intra_node", "inter_node"] = "auto"
    """auto: inter_node when generation and training span more than one node."""
    transfer: Literal["full", "delta"] = "full"
    """sync.transfer: every push whole, or the elements that changed in the engine's dtype."""
    changed_frac: float = Field(0.02, gt=0, le=1)
    """`delta`: the share of elements one step changes in the engine's dtype (about 1% measured on
    an 8B model in bf16 at RL learning rates, less on large MoE models; assumed)."""
    full_every: int | None = Field(None, ge=1)
    """`delta`: a whole push every this many versions (sync.full_every); None: never."""
    encode_bytes_per_s: float = Field(2e9, gt=0)
    """`delta`: weight bytes per second the learner compares with its copy of the engines' weights
    to find the changed elements, before every delta's broadcast. 2e9: the gloo sender on 2 CPU cores,
    Qwen2.5-0.5B's 988 MB of bf16 weights with 2-4% changed in about 0.5 s of a 0.75-0.85 s delta
    push (checksums included; timed around the sender's calls in tools/bench_weight_sync.py --transfer
    delta, docs/benchmarks.md). A large tensor is searched in one slice per core, so a host with more
    cores is faster."""


class LengthSpec(_Section):
    kind: Literal["fixed", "lognormal", "empirical"] = "lognormal"
    mean: float = Field(0.0, ge=0)
    sigma: float = Field(0.0, ge=0)
    samples: str | None = None
    """kind empirical: a real run's samples.jsonl (its completions' response_tokens)."""
    values: list[int] = []
    """kind empirical: the lengths themselves (tools/validate_twin.py writes those it measured)."""
    group_share: float = Field(0.0, ge=0, le=1)
    """Share of the variance of log length that a prompt's samples have in common (the intraclass
    correlation of log lengths: a hard prompt makes every answer long). 0: independent draws."""


class PassRateSpec(_Section):
    alpha: float = Field(1.0, gt=0)
    beta: float = Field(1.0, gt=0)
    drift_per_version: float = 0.0


class Workload(_Section):
    prompt_tokens: int = Field(gt=0)
    max_tokens: int = Field(gt=0)
    group_size: int = Field(ge=1)
    lengths: LengthSpec
    pass_rate: PassRateSpec = PassRateSpec()
    verify_s: float = Field(0.0026, ge=0)
    """A verifier call's time a sample (default: the math verifier's 2.6 ms on this project's CPU,
    tools/bench_rewards.py)."""


class Run(_Section):
    token_budget: int = Field(gt=0)
    """Phi: loss tokens per optimizer step."""
    max_staleness: int = Field(1, ge=0)
    sync_mode: Literal["inflight", "drain"] = "inflight"
    max_in_flight_prompts: int | None = Field(None, ge=1)
    """Per actor; default: enough to keep its engine's max_num_seqs busy twice over."""
    max_in_flight_requests: int | None = Field(None, ge=1)
    """Per actor, samples still generating (rollout.max_in_flight_requests): admission by requests,
    which replaces the cap on prompts. None: by prompts."""
    keep_kv: bool = False
    """sync.keep_kv: in-flight updates pause requests with their KV cache instead of aborting and
    re-prefilling them."""
    stale_policy: Literal["discard", "wait", "pace", "ess", "train"] = "discard"
    """buffer.stale_policy of the asynchronous modes (the synchronous ones have nothing stale)."""
    colocate_slowdown: float = Field(2.0, ge=1)
    """colocate_async: each side's work takes this many times longer while the other computes on
    the same GPUs (2: an even time share; assumed)."""
    sync_prompts: int | None = Field(None, ge=1)
    """Prompts per synchronous step (the baseline); default: Phi's worth at the mean length."""
    steps: int = Field(12, ge=1)
    warmup_steps: int = Field(2, ge=0)
    reward_placement: Literal["driver", "actor"] = "driver"
    """Where samples are scored (reward.placement): the driver's pool of reward_workers, or each actor."""
    reward_workers: int = Field(2, ge=1)
    """reward.num_workers: the driver's verifier processes (asyncrl's default is 2)."""
    overrides: list[str] = []
    """Further asyncrl config overrides (section.field=value) for the real driver."""
    timeline_bin_s: float | None = Field(None, gt=0)


class Anchor(_Section):
    """A published speedup the scenario reproduces (configs/twin/published/, twin/published.py)."""

    anchor: str
    """What was published and where: paper, table or figure, row."""
    published: float = Field(gt=0)
    """The published ratio (hours, step time or throughput, as the source gives it)."""
    baseline: Literal["sync", "sync_decoupled"]
    """The twin's mode matching the source's baseline: colocated (verl, TRL, NeMo-RL's
    synchronous GRPO) or on the asynchronous split (AReaL's synchronous variant, its eta 0)."""
    mode: Literal["drain", "inflight", "colocate_async"] | None = None
    """The asynchronous mode measured; None: the scenario's run.sync_mode."""
    overrides: list[str] = []
    """This row's changes to the scenario (a GPU count, eta), section.field=value."""
    reason: str | None = None
    """Why the twin is not expected to reproduce it (the row stays in the table, counted apart)."""
    published_tokens_per_s: tuple[float, float] | None = None
    """The source's own throughputs (asynchronous, baseline), where it prints them: set beside the
    twin's, they show which side a miss is on."""


class Scenario(_Section):
    name: str
    seed: int = 0
    published: list[Anchor] = []
    """Published results this scenario stands for (configs/twin/published/)."""
    assumed: dict[str, tuple[float, float]] = {}
    """The values no source fixes, `section.field` -> the low and high end of what is plausible:
    `tools/twin_published.py --sensitivity` reruns each published row at both ends."""
    hardware: Hardware = Hardware()
    model: Model
    split: Split
    engine: Engine = Engine()
    learner: Learner = Learner()
    push: Push = Push()
    workload: Workload
    run: Run

    def for_mode(self, mode: str) -> "Scenario":
        """The scenario a mode runs (cluster.MODES): the colocated ones have every GPU on both
        sides; colocate_async slows each side while the other computes, at a staleness of 1."""
        if mode not in ("sync", "colocate_async"):
            return self
        total = self.split.gen_gpus + self.split.train_gpus
        split = Split(gen_gpus=total - total % self.split.tp, train_gpus=total, tp=self.split.tp, colocated=True)
        update: dict[str, Any] = {"split": split}
        if mode == "colocate_async":
            f = self.run.colocate_slowdown
            update.update(engine=self.engine.model_copy(update={"slowdown_while_training": f}),
                          learner=self.learner.model_copy(update={"slowdown_while_generating": f}),
                          run=self.run.model_copy(update={"max_staleness": 1}))
        return self.model_copy(update=update)

    @property
    def nodes(self) -> int:
        s = self.split
        return -(-(s.gen_gpus if s.colocated else s.gen_gpus + s.train_gpus) // self.hardware.gpus_per_node)

    def engine_cost(self) -> EngineCost:
        e, m, h = self.engine, self.model, self.hardware
        derived = engine_cost_from_hardware(m.params, m.weight_bytes, m.kv_bytes_per_token, self.split.tp,
                                            h.peak_flops, h.hbm_bytes_per_s, e.bandwidth_efficiency,
                                            e.prefill_mfu, e.step_overhead_s)
        return EngineCost(*(given if given is not None else default for given, default in
                            zip((e.c0_s, e.c_seq_s, e.c_ctx_s, e.c_prefill_s),
                                (derived.c0_s, derived.c_seq_s, derived.c_ctx_s, derived.c_prefill_s))),
                          c_request_s=e.c_request_s)

    def kv_tokens(self) -> int:
        if self.engine.kv_tokens is not None:
            return self.engine.kv_tokens
        return kv_capacity_tokens(self.split.tp, self.hardware.gpu_memory_gib * 2**30, self.engine.memory_utilization,
                                  self.model.weight_bytes, self.model.kv_bytes_per_token)

    def learner_cost(self) -> LearnerCost:
        lc = self.learner
        return LearnerCost(self.model.params, self.split.train_gpus, self.hardware.peak_flops, lc.mfu,
                           lc.flops_per_param_token, lc.fixed_s, lc.per_token_s)

    def push_cost(self) -> PushCost:
        link = self.push.link
        if link == "auto":
            link = "inter_node" if self.nodes > 1 else "intra_node"
        ln: Link = getattr(self.hardware, link)
        return PushCost(self.model.weight_bytes, self.push.bucket_mb * 2**20, ln.alpha_s, ln.beta_bytes_per_s,
                        self.push.load_bytes_per_s,
                        self.push.fixed_s + (self.push.switch_s if self.split.colocated else 0.0),
                        changed_frac=self.push.changed_frac if self.push.transfer == "delta" else 1.0,
                        bytes_per_param=self.model.bytes_per_param, encode_bytes_per_s=self.push.encode_bytes_per_s)

    def full_push(self, version: int) -> bool:
        """Whether the push of `version` goes whole under `push.transfer` and `push.full_every`."""
        p = self.push
        return p.transfer == "full" or (p.full_every is not None and version % p.full_every == 0)

    def lengths(self) -> Lengths:
        ls, w = self.workload.lengths, self.workload
        hist = lengths_of_run(ls.samples) if ls.kind == "empirical" and ls.samples else ls.values
        return Lengths(ls.kind, w.max_tokens, self.seed, ls.mean, ls.sigma, hist, ls.group_share)

    def pass_rates(self) -> PassRates:
        p = self.workload.pass_rate
        return PassRates(p.alpha, p.beta, p.drift_per_version, self.seed)


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """A scenario file (with `base:` scenarios under it, as recipes have) and `section.field=value`
    overrides; ConfigError names what is wrong."""
    path = Path(path)
    tree: dict[str, Any] = read_recipe(path)
    for text in overrides or []:
        _set_dotted(tree, *parse_override(text))
    samples = tree.get("workload", {}).get("lengths", {}).get("samples")
    if samples and not Path(samples).is_absolute() and (path.parent / samples).exists():
        tree["workload"]["lengths"]["samples"] = str((path.parent / samples).resolve())
    try:
        return Scenario.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(explain(e, Scenario, f"invalid twin scenario {path}")) from None
