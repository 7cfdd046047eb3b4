"""Everything about a run that can be checked before Ray starts, in about a second: a mistake
found here costs the user one line (exit 2), not 20 s of start-up and a traceback.

- model: `model.path` is `builtin:tiny`, a model directory (config.json inside) or a model in
  the local Hugging Face cache; its context length fills `model.max_model_len` when that is unset.
- lengths: every stage's `max_tokens` < `max_model_len` <= the model's context.
- packages: what the config switches on is installed (vLLM for the vllm engine, wandb for
  `observe.wandb_project`, DeepSpeed for its backend), naming the extra that installs it.
- resources: the learner ranks and rollout actors fit a local Ray's `ray.num_cpus`.
- data: every jsonl record the run and its evaluation will read has the fields its verifier
  needs (data/records.py), and user reward functions import (reward/registry.py); a user function
  seen reading metadata["answer"] makes the answer field required like a built-in verifier's.
- teacher: algo.distill.teacher is a model here with the student's vocabulary.
- GPUs (config load, schema.py): a CUDA learner (learner.num_gpus > 0) pushes over NCCL, not gloo.

`compat.check_gpu_visibility` runs where a component starts (learner rank, vLLM engine), not
here: what a process sees depends on the node and the Ray bundle it lands on, not on the driver.

`resolve` is the part a run cannot do without (the context length); the orchestrator calls it
too, so a config built in code needs no preflight.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from asyncrl.config import Config, ConfigError
from asyncrl.data.records import NEEDS_ANSWER, RecordError, check_file, read_records
from asyncrl.data.stages import resolve_stages, stage_mixture

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _config_json(path: str) -> Path:
    """The model's config.json: in the directory, or in the local Hugging Face cache for a hub id."""
    directory = Path(path).expanduser()
    adapter = directory / "adapter_config.json"
    if directory.is_dir() and not (directory / "config.json").is_file() and adapter.is_file():
        # a LoRA adapter (a LoRA run's final/ or checkpoint policy): its base is the model
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"model.path {path!r}: its adapter_config.json names no base_model_name_or_path")
        return _config_json(base)
    if directory.is_dir():
        if not (directory / "config.json").is_file():
            raise ConfigError(f"model.path {path!r} is a directory without config.json, not a "
                              "Hugging Face model (save one with save_pretrained)")
        return directory / "config.json"
    if directory.exists():
        raise ConfigError(f"model.path {path!r} is a file; give the model's directory")
    if path.count("/") == 1 and not path.startswith((".", "/", "~")):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
        if isinstance(cached, str):
            return Path(cached)
    raise ConfigError(f"model.path {path!r} does not exist (no such directory, and no model of that "
                      "name in the local Hugging Face cache; nothing is downloaded at run time)")


def model_directory(path: str) -> Path:
    """The model's directory: `path` itself, or a hub id's snapshot in the local Hugging Face cache
    (ConfigError when neither is here)."""
    return _config_json(path).parent


def model_context(path: str) -> int | None:
    """The model's context length in tokens (None when its config does not say)."""
    if path.startswith("builtin:"):
        if path != "builtin:tiny":
            raise ConfigError(f"model.path {path!r}: the only built-in model is 'builtin:tiny'")
        from asyncrl.tiny.build import TinyModelSpec

        return TinyModelSpec().max_positions
    cfg = json.loads(_config_json(path).read_text())
    for section in (cfg, cfg.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            if isinstance(section.get(key), int):
                return section[key]
    return None


def resolve(cfg: Config) -> Config:
    """`model.max_model_len` filled from the model when unset (a copy; idempotent)."""
    if cfg.model.max_model_len is not None:
        return cfg
    context = model_context(cfg.model.path)
    if context is None:
        raise ConfigError(f"model.max_model_len: the config of {cfg.model.path!r} states no context "
                          "length; set model.max_model_len")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"max_model_len": context})})


def check_lengths(cfg: Config, context: int | None) -> None:
    limit = cfg.model.max_model_len
    if context is not None and limit > context:
        raise ConfigError(f"model.max_model_len ({limit}) is longer than the model's context ({context})")
    for st in resolve_stages(cfg):
        where = f"stages.{st.index}.max_tokens" if cfg.stages else "rollout.max_tokens"
        if st.max_tokens >= limit:
            raise ConfigError(f"{where} ({st.max_tokens}) must be below model.max_model_len ({limit}), "
                              "which holds prompt and response")


PACKAGES = {"vllm": 'pip install -e ".[cpu]" (or ".[gpu]")', "wandb": 'pip install -e ".[wandb]"',
            "deepspeed": "pip install deepspeed (in the cpu and gpu extras)"}


def check_packages(cfg: Config) -> None:
    needed = []
    if cfg.rollout.engine == "vllm":
        needed.append(("vllm", "rollout.engine=vllm"))
    if cfg.observe.wandb_project:
        needed.append(("wandb", "observe.wandb_project"))
    if cfg.learner.backend == "deepspeed":
        needed.append(("deepspeed", "learner.backend=deepspeed"))
    for module, why in needed:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{why} needs the {module!r} package, which is not installed: {PACKAGES[module]}")


def check_resources(cfg: Config) -> None:
    """The learner ranks and the rollout actors fit the Ray CPUs this run starts (a local Ray with
    `ray.num_cpus`); on a cluster Ray places them, and says so if it cannot."""
    if cfg.ray.address or os.environ.get("RAY_ADDRESS") or cfg.ray.num_cpus is None:
        return
    learner = cfg.learner.num_ranks * cfg.learner.num_cpus
    actors = cfg.rollout.num_actors * cfg.rollout.num_cpus_per_actor
    d = cfg.algo.distill
    teachers = d.num_engines * d.num_cpus_per_engine if d.enabled else 0
    if learner + actors + teachers > cfg.ray.num_cpus:
        raise ConfigError(
            f"learner.num_ranks={cfg.learner.num_ranks} ranks of learner.num_cpus={cfg.learner.num_cpus:g} and "
            f"{cfg.rollout.num_actors} rollout actor(s) of {cfg.rollout.num_cpus_per_actor:g} "
            + (f"and {d.num_engines} teacher engine(s) of {d.num_cpus_per_engine:g} " if teachers else "")
            + f"need {learner + actors + teachers:g} Ray CPUs, more than ray.num_cpus={cfg.ray.num_cpus}; raise "
            "ray.num_cpus (logical CPUs: it may exceed the cores) or lower learner.num_ranks")


def check_data(cfg: Config) -> None:
    from functools import partial

    from asyncrl.reward.registry import check_functions, reads_answer, route

    check_functions(cfg.reward)
    verifier_of = partial(route, cfg.reward)
    needs = {*NEEDS_ANSWER, *reads_answer(cfg.reward)}
    for st in resolve_stages(cfg):
        for data in stage_mixture(st, cfg.data):
            if data.type == "jsonl":
                _check(data.path, data.prompt_field, data.answer_field, verifier_of, needs)
    if cfg.eval.data and cfg.eval.every_steps:
        _check(cfg.eval.data, cfg.data.prompt_field, cfg.data.answer_field, verifier_of, needs)
    if cfg.env.type:
        check_env_on_data(cfg)


def check_env_on_data(cfg: Config) -> None:
    """The environment loads and builds for the first record of the first jsonl data (a
    generated task's first record is not known before its source starts: the factory only loads)."""
    from asyncrl.data.prompt_source import record_metadata
    from asyncrl.env.registry import check_agent, check_env, env_factory

    if cfg.env.type == "agent":
        check_agent(cfg.env)
        return

    first = next((d for st in resolve_stages(cfg) for d in stage_mixture(st, cfg.data) if d.type == "jsonl"), None)
    if first is None:
        try:
            env_factory(cfg.env)
        except Exception as e:
            raise ConfigError(f"env.type={cfg.env.type!r}: {e}") from e
        return
    rec = read_records(first.path, first.prompt_field, first.answer_field, limit=1, needs_answer=())[0]
    check_env(cfg.env, record_metadata(rec, f"{first.path}#0"))


def _check(path, prompt_field, answer_field, verifier_of, needs) -> None:
    try:
        check_file(path, prompt_field, answer_field, verifier_of, needs)
    except RecordError as e:
        raise ConfigError(str(e)) from None


def check_lora(cfg: Config) -> None:
    """learner.lora's targets and rank against the model's linear and embedding layers, on the
    model built on the meta device (no weights read), so a wrong name is one line here, not a
    learner that fails to start; an adapter on the embedding or the LM head only where vLLM's
    class for the model serves one there."""
    if not cfg.learner.lora.enabled:
        return
    import torch

    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.learner.lora import check_targets

    hide_broken_torch_extras()
    with torch.device("meta"):
        if cfg.model.path.startswith("builtin:"):
            from asyncrl.tiny.build import new_model
            from asyncrl.tiny.spec import spec_for
            from asyncrl.tiny.tokenizer import build_tokenizer

            model = new_model(spec_for(cfg.model.tiny), build_tokenizer())
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(_config_json(cfg.model.path).parent))

    def served():  # imports vLLM (seconds): asked only when an embedding layer is targeted
        from asyncrl.rollout.vllm_engine import served_embedding_adapters

        return served_embedding_adapters(type(model).__name__)
    check_targets(model, cfg.learner.lora, served if cfg.rollout.engine == "vllm" else None)


def model_vocab(path: str) -> int | None:
    """The vocabulary size the model's config states (the built-in model's: its tokenizer's)."""
    if path.startswith("builtin:"):
        from asyncrl.tiny.tokenizer import build_tokenizer

        return len(build_tokenizer())
    cfg = json.loads(_config_json(path).read_text())
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def check_teacher(cfg: Config) -> None:
    """algo.distill.teacher is a model here, with the student's vocabulary (the teacher scores the
    student's token ids: another tokenizer's ids would be other tokens)."""
    d = cfg.algo.distill
    if not d.enabled:
        return
    try:
        teacher_vocab = model_vocab(d.teacher)
    except ConfigError as e:
        raise ConfigError(f"algo.distill.teacher: {str(e).replace('model.path ', '')}") from None
    student_vocab = model_vocab(cfg.model.path)
    if teacher_vocab and student_vocab and teacher_vocab != student_vocab:
        raise ConfigError(f"algo.distill.teacher {d.teacher!r} has a vocabulary of {teacher_vocab} tokens and the "
                          f"student {cfg.model.path!r} one of {student_vocab}: the teacher must share the student's "
                          "tokenizer (it scores the student's token ids)")


def check_moe_routing(cfg: Config) -> None:
    """algo.moe_routing: replay needs a mixture-of-experts model whose expert ids fit a byte."""
    if cfg.algo.moe_routing != "replay":
        return
    if cfg.model.path.startswith("builtin:"):
        experts = cfg.model.tiny.num_experts
    else:
        config = json.loads(_config_json(cfg.model.path).read_text())
        config = {**config, **(config.get("text_config") or {})}
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if not experts:
        raise ConfigError(f"algo.moe_routing: replay replays the experts a mixture-of-experts model routed to, and "
                          f"{cfg.model.path!r} is dense (no num_experts in its config; the tiny model: "
                          "model.tiny.num_experts)")
    if experts > 254:
        raise ConfigError(f"algo.moe_routing: replay records expert ids in a byte: {experts} experts is more than 254")


def preflight(cfg: Config) -> Config:
    """Every check above; returns the resolved config. Raises ConfigError with one line."""
    context = model_context(cfg.model.path)
    cfg = resolve(cfg)
    check_lengths(cfg, context)
    check_lora(cfg)
    check_teacher(cfg)
    check_moe_routing(cfg)
    check_packages(cfg)
    check_resources(cfg)
    check_data(cfg)
    return cfg
