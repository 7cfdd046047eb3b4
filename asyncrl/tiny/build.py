"""Build (or fetch from cache) the tiny warm-started model the default config trains.

Why a warm start: RL from a random init gets reward 0 on every sample, so no group has a
learning signal. A short supervised run on the tiny task (loss on the response and its eos only)
teaches it part of the task.

Where it stops: every ``check_every`` steps the build samples every train problem
``check_samples_per_problem`` times the way RL rollouts sample (temperature 1 over the whole
vocabulary, ``measure.measure_accuracy``) and stops at the first check whose accuracy reaches
``target_sampled_accuracy`` (default 0.25; measured: the check at step 80 finds 0.30, after
33 s on 2 cores). The result is a partially trained policy: the right answer's probability is
between 0.05 and 0.95 on every train problem and greedy decoding is wrong on 71% of the held-out
ones, so RL has real errors to fix and a real policy whose entropy it moves. The accuracy curve
up to the stop goes into ``warm_start.json``.

Softening (an option, off by default): with ``target_sampled_accuracy=None`` the model trains all
``warm_start_steps`` (greedy accuracy ~1), and ``soften_to_probability`` then divides the final
norm's weight by a temperature tau found by bisection so that the exact probability of sampling the
right answer is that value. With tied embeddings and no LM-head bias that is exactly sampling the
converged model at temperature tau: RL's reward gain from such a model is mostly undoing tau, and
its falling entropy is the same rescaling, which is why it is no longer the default.

The output is a Hugging Face directory (Qwen2, or Qwen3-MoE with `num_experts`, or with
`architecture` llama the Qwen2 build's Llama twin; tied embeddings, float32 safetensors, character
tokenizer) that transformers and vLLM load, cached under ``$ASYNCRL_CACHE`` (default
``~/.cache/asyncrl``) by spec hash: built in a temp dir, renamed into place, under a file lock.
The build is seeded (init, batches, accuracy samples), so a spec always gives the same model on
one machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from asyncrl.compat import hide_broken_torch_extras, usable_cores

hide_broken_torch_extras()  # before transformers caches what is installed: see asyncrl/compat.py

import torch  # noqa: E402

from asyncrl.tiny import task as tiny_task  # noqa: E402
from asyncrl.tiny import tool_measure, tool_task  # noqa: E402
from asyncrl.tiny.measure import answer_probability, encode_examples, evaluate, measure_accuracy, soften  # noqa: E402
from asyncrl.tiny.spec import FORMAT_VERSION, TinyModelSpec  # noqa: E402
from asyncrl.tiny.tokenizer import build_tokenizer, save_tokenizer  # noqa: E402

TOOL_CHECK_LOSS = 0.35
TOOL_CHECK_PROBLEMS = 400
"""Train problems sampled once each at every check of the tool task's warm start."""


def local_model_path(path: str, spec: TinyModelSpec | None) -> str:
    """`path` where it exists in this process's filesystem; else, for the built-in model (`spec`
    given), this node's build of it: deterministic, so the weights the driver's build has. A
    learner rank or engine on another node has its own cache, not the driver's."""
    if spec is None or Path(path).exists():
        return path
    return str(ensure_tiny_model(spec, log=lambda _: None))


def cache_root() -> Path:
    """Where built models live: ``$ASYNCRL_CACHE`` or ``~/.cache/asyncrl``."""
    return Path(os.environ.get("ASYNCRL_CACHE") or Path.home() / ".cache" / "asyncrl")


@contextlib.contextmanager
def torch_threads(num: int | None = None):
    """Use the cores this process may run on (2 here), then restore torch's setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num or usable_cores())
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_prompts(num: int, seed: int, split: tiny_task.Split = "train", spec: TinyModelSpec | None = None) -> list[dict[str, str]]:
    """Task records for the model built from ``spec``: the prompt source's entry point."""
    spec = spec or TinyModelSpec()
    if spec.tool:
        return tool_task.make_problems(num, seed, split)
    return tiny_task.make_problems(num, seed, split, spec.task)


def train_records(spec: TinyModelSpec) -> list[dict[str, str]]:
    """Every distinct train-split problem once: the warm start's data and the softening's yardstick."""
    if spec.tool:
        return [tool_task.make_record(*problem) for problem in tool_task.all_problems("train")]
    return [tiny_task.make_record(*problem) for problem in tiny_task.all_problems(spec.task, "train")]


def new_model(spec: TinyModelSpec, tokenizer):
    """A freshly initialised (seeded) Qwen2 causal LM sized by the spec, or with `num_experts` a
    Qwen3-MoE one (every layer sparse, top-k probabilities renormalized, as Qwen3-30B-A3B), or
    with `architecture` llama its Llama twin's shape (`llama_twin`)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    common = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=True, dtype="float32",
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    if spec.num_experts:
        config = Qwen3MoeConfig(**common, head_dim=spec.hidden_size // spec.num_heads, num_experts=spec.num_experts,
                                num_experts_per_tok=spec.experts_per_token, decoder_sparse_step=1, mlp_only_layers=[],
                                moe_intermediate_size=spec.intermediate_size // spec.experts_per_token,
                                norm_topk_prob=True)
        return Qwen3MoeForCausalLM(config).float()
    if spec.architecture == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, attention_bias=True)).float()
    return Qwen2ForCausalLM(Qwen2Config(**common)).float()


def llama_twin(source: Path, directory: Path) -> dict:
    """The built Qwen2 model in `source` as a Llama model in `directory`, the same function: Qwen2
    is Llama with biases on the query, key and value projections, which Llama's attention_bias
    gives (with one on the output projection too, set to zero). Its tokenizer and warm-start
    report come along; the report gains the largest logit difference on a few sequences (0 here)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    qwen = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    c = qwen.config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters, hidden_act=c.hidden_act,
        tie_word_embeddings=True, attention_bias=True, dtype="float32",
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)
    llama = LlamaForCausalLM(config).float()
    with torch.no_grad():
        unmatched = llama.load_state_dict(qwen.state_dict(), strict=False)
        if unmatched.unexpected_keys or any(not k.endswith("o_proj.bias") for k in unmatched.missing_keys):
            raise RuntimeError(f"the Llama twin does not take the Qwen2 weights: {unmatched}")
        for name, p in llama.named_parameters():
            if name.endswith("o_proj.bias"):
                p.zero_()
        ids = torch.randint(2, c.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
        diff = (qwen(ids).logits - llama(ids).logits).abs().max().item()
    if diff > 1e-5:  # a transformers whose Llama and Qwen2 no longer compute alike
        raise RuntimeError(f"the Llama twin's logits differ from the Qwen2 model's by {diff:.3g}")
    llama.generation_config = qwen.generation_config
    llama.save_pretrained(str(directory), safe_serialization=True)
    save_tokenizer(directory, model_max_length=c.max_position_embeddings)
    report = json.loads((source / "warm_start.json").read_text())
    return {**report, "twin_of": source.name, "twin_max_logit_diff": diff}


def sampled_accuracy(model, tokenizer, spec: TinyModelSpec) -> float:
    """The stopping rule's measure: every train problem sampled check_samples_per_problem times at
    temperature 1 over the whole vocabulary, as rollouts sample (seeded, so a spec's build repeats)."""
    if spec.tool:  # 6,480 train problems: a fixed draw of them
        records = tool_task.make_problems(TOOL_CHECK_PROBLEMS, spec.seed, "train")
        return tool_measure.success(model, tokenizer, records, seed=spec.seed)["accuracy"]
    records = train_records(spec) * spec.check_samples_per_problem
    return measure_accuracy(model, tokenizer, records, greedy=False, seed=spec.seed)


def warm_start(model, tokenizer, spec: TinyModelSpec, log: Callable[[str], None] = print,
               on_check: Callable[[int, float], None] | None = None,
               measure: Callable[[object], float] | None = None) -> dict:
    """Supervised training on the train split until the sampled accuracy reaches the spec's target
    (or for warm_start_steps); logs a progress line every few seconds and the stop.

    Accuracy is checked every check_every steps when there is a target or an ``on_check(step,
    accuracy)`` (called with the model in eval mode, e.g. to save it); ``measure(model)`` takes
    it (default: `sampled_accuracy`; tests pass a scripted one). No attention mask is needed:
    padding only follows the eos and carries no loss.
    """
    measure = measure or (lambda m: sampled_accuracy(m, tokenizer, spec))
    if spec.tool:
        ids, labels = tool_measure.encode_traces(train_records(spec), tokenizer)
    else:
        pairs = [(r["prompt"], tiny_task.format_response(r["answer"])) for r in train_records(spec)]
        ids, labels = encode_examples(pairs, tokenizer)
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.0)
    total, warmup, target = spec.warm_start_steps, max(1, spec.warm_start_steps // 20), spec.target_sampled_accuracy
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) * max(0.1, 1 - i / total))
    checks = target is not None or on_check is not None
    curve: list[list[float]] = []  # [step, sampled accuracy] of every check
    start = last_log = time.monotonic()
    loss, step = torch.tensor(float("nan")), 0
    while step < total and not (target is not None and curve and curve[-1][1] >= target):
        step += 1
        model.train()
        batch = torch.randint(len(ids), (spec.batch_size,), generator=gen)
        loss = model(input_ids=ids[batch], labels=labels[batch]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        model.eval()
        # the tool task samples no right answer while its trace loss is above ~0.3 (measured:
        # 0.005 at loss 0.22, 0.3 soon after), so its checks, 400 episodes each, start below it
        if checks and step % spec.check_every == 0 and not (spec.tool and loss.item() > TOOL_CHECK_LOSS):
            curve.append([step, measure(model)])
            if on_check is not None:
                on_check(step, curve[-1][1])
        now = time.monotonic()
        if now - last_log >= 5.0 or step == total:
            accuracy = f", sampled accuracy {curve[-1][1]:.3f} at step {curve[-1][0]}" if curve else ""
            goal = f" (stops at {target})" if target is not None else ""
            log(f"tiny warm start: step {step}/{total} loss {loss.item():.4f}{accuracy}{goal}, {now - start:.0f}s")
            last_log = now
    reached = target is not None and bool(curve) and curve[-1][1] >= target
    if reached:
        log(f"tiny warm start: stopped at step {step}: sampled accuracy {curve[-1][1]:.3f} >= {target} "
            f"({TOOL_CHECK_PROBLEMS if spec.tool else len(train_records(spec)) * spec.check_samples_per_problem} "
            f"samples), {time.monotonic() - start:.0f}s")
    elif target is not None:
        log(f"tiny warm start: warning: sampled accuracy never reached {target} in {total} steps "
            f"(last {curve[-1][1] if curve else float('nan'):.3f}); raise warm_start_steps or lr")
    return {"steps": step, "reached_target": reached, "final_loss": loss.item(),
            "train_seconds": time.monotonic() - start, "sampled_accuracy_curve": curve}


def save_model(model, tokenizer, directory: Path) -> None:
    """The model and its tokenizer as a Hugging Face directory (generation stops at eos)."""
    from transformers import GenerationConfig

    save_tokenizer(directory, model_max_length=model.config.max_position_embeddings)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(directory), safe_serialization=True)


def build_into(directory: Path, spec: TinyModelSpec, log: Callable[[str], None] = print,
               checkpoints_dir: Path | None = None) -> dict:
    """Train the tiny model and write the full Hugging Face directory; returns the warm-start report.

    ``checkpoints_dir``: also save the model at every accuracy check as ``step_<N>/`` there (with
    ``check.json``: step, sampled accuracy), e.g. to pick a start by its accuracy or entropy.
    """
    start = time.monotonic()
    tokenizer = build_tokenizer(model_max_length=spec.max_positions)

    def keep(step: int, accuracy: float) -> None:
        out = Path(checkpoints_dir) / f"step_{step}"
        out.mkdir(parents=True, exist_ok=True)
        save_model(model, tokenizer, out)
        (out / "check.json").write_text(json.dumps({"step": step, "sampled_accuracy": accuracy}) + "\n")

    with torch_threads():
        model = new_model(spec, tokenizer)
        log(f"tiny model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, building in {directory}")
        report = warm_start(model, tokenizer, spec, log, keep if checkpoints_dir is not None else None)
        if spec.tool:  # softening and the exact answer probability are the arithmetic task's
            report.update(tool_measure.evaluate(model, tokenizer, spec.num_eval_prompts, spec.seed))
        else:
            report["trained_answer_probability"] = answer_probability(model, tokenizer, train_records(spec))
            if spec.soften_to_probability is not None:
                report["softening_temperature"] = soften(model, tokenizer, train_records(spec),
                                                         spec.soften_to_probability)
            report.update(evaluate(model, tokenizer, spec))
    save_model(model, tokenizer, directory)
    report["build_seconds"] = time.monotonic() - start
    report = {"format_version": FORMAT_VERSION, "key": spec.key(), "spec": dataclasses.asdict(spec), **report}
    (directory / "warm_start.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_tiny_model(spec: TinyModelSpec | None = None, cache_dir: str | Path | None = None, log: Callable[[str], None] = print) -> Path:
    """The path of the built model for ``spec``, building it first if it is not cached.

    Safe under concurrency: builders of the same spec serialise on a lock file; the loser of
    the race finds the finished directory and returns it without training.
    """
    spec = spec or TinyModelSpec()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    models_dir = root / "tiny_models"
    models_dir.mkdir(parents=True, exist_ok=True)
    final = models_dir / f"tiny-{spec.key()}"
    if (final / "warm_start.json").exists():
        return final
    with open(models_dir / f"tiny-{spec.key()}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"tiny model {spec.key()} is being built by another process; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "warm_start.json").exists():
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".tiny-{spec.key()}-", dir=models_dir))
        try:
            if spec.architecture == "llama":  # a relabelling of the Qwen2 build, not a second warm start
                qwen = ensure_tiny_model(dataclasses.replace(spec, architecture="qwen2"), root, log)
                t0 = time.monotonic()
                report = llama_twin(qwen, staging)
                report.update(key=spec.key(), spec=dataclasses.asdict(spec), build_seconds=time.monotonic() - t0)
                (staging / "warm_start.json").write_text(json.dumps(report, indent=2) + "\n")
            else:
                report = build_into(staging, spec, log)
            staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(
        f"tiny model ready at {final} (built in {report['build_seconds']:.0f}s, {report['steps']} supervised "
        f"steps; held-out accuracy sampled {report['eval_sampled_accuracy']:.2f}, greedy {report['eval_greedy_accuracy']:.2f})"
    )
    return final
