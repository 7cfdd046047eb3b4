"""Build (or fetch from cache) the tiny warm-started model the default config trains.

Why a warm start: RL from a random init gets reward 0 on every sample, so no group has a
learning signal. A short supervised run on the tiny task (loss on the response and its eos only)
teaches the answers; greedy decoding is then nearly always right.

Why it is then softened: a converged model samples the right answer almost always at
temperature 1 too, so RL would have nothing to do; an under-trained one (stopped early) has
errors that are systematic, which RL improves only slowly (measured: about +0.05 in 50 steps). So after
training, the final norm's weight is divided by a temperature tau, which with tied embeddings and
no LM-head bias is exactly the same as sampling the trained model at temperature tau. tau is
found by bisection so that the exact probability of sampling the right answer on train prompts
equals ``target_answer_probability``. The result knows the answer (greedy accuracy about 1) but
samples it only ~30% of the time: the "sharpening" regime where RL gains fast. The catch: RL's
gain from it is largely undoing tau, and its falling entropy largely the same rescaling, so it
shows the loop working, not entropy dynamics of a real policy (the README says so). The measured
accuracies go into ``warm_start.json`` beside the weights.

The output is a Hugging Face directory (Qwen2, tied embeddings, float32 safetensors, character
tokenizer) that transformers and vLLM load, cached under ``$ASYNCRL_CACHE`` (default
``~/.cache/asyncrl``) by spec hash: built in a temp dir, renamed into place, under a file lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from asyncrl.compat import hide_broken_torch_extras

hide_broken_torch_extras()  # before transformers caches what is installed: see asyncrl/compat.py

import torch  # noqa: E402

from asyncrl.tiny import task as tiny_task  # noqa: E402
from asyncrl.tiny.measure import answer_probability, encode_examples, evaluate, soften  # noqa: E402
from asyncrl.tiny.tokenizer import save_tokenizer  # noqa: E402

FORMAT_VERSION = 1
"""Bump when the directory layout, tokenizer or training recipe changes: it is part of the key."""


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the built model; its hash is the cache key."""

    seed: int = 0
    """Seeds the init, the warm-start batches and the accuracy measurement."""
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    """hidden_size / num_heads must be a head size vLLM's CPU attention supports (32, 64, ...)."""
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_positions: int = 64
    """Context length; the tiny task needs under 20 tokens per sample."""
    warm_start_steps: int = 800
    """About 30 s on 2 cores; greedy accuracy reaches ~1.0 on held-out prompts (see report)."""
    batch_size: int = 64
    lr: float = 3e-3
    """AdamW peak learning rate (linear warmup over 5% of the steps, then linear decay to 10%)."""
    target_answer_probability: float | None = 0.3
    """After training, soften the policy until the exact probability of sampling the canonical
    right response at temperature 1, averaged over train prompts, is this (None: no softening).
    Measured sampled accuracy runs a few points higher: a stray character before the right
    ``\\boxed{}`` also counts as correct."""
    task: tiny_task.TinyTaskSpec = dataclasses.field(default_factory=tiny_task.TinyTaskSpec)
    num_eval_prompts: int = 200
    """Held-out prompts for the accuracies recorded in warm_start.json."""

    def key(self) -> str:
        """Stable short hash of the spec and the format version."""
        blob = json.dumps({"format": FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """Where built models live: ``$ASYNCRL_CACHE`` or ``~/.cache/asyncrl``."""
    return Path(os.environ.get("ASYNCRL_CACHE") or Path.home() / ".cache" / "asyncrl")


@contextlib.contextmanager
def torch_threads(num: int | None = None):
    """Use the cores this process may run on (2 here), then restore torch's setting."""
    previous = torch.get_num_threads()
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only; macOS falls back to cpu_count
    torch.set_num_threads(num or (len(affinity(0)) if affinity else os.cpu_count() or 1))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_prompts(num: int, seed: int, split: tiny_task.Split = "train", spec: TinyModelSpec | None = None) -> list[dict[str, str]]:
    """Task records for the model built from ``spec``: the prompt source's entry point."""
    return tiny_task.make_problems(num, seed, split, (spec or TinyModelSpec()).task)


def train_records(spec: TinyModelSpec) -> list[dict[str, str]]:
    """Every distinct train-split problem once: the warm start's data and the softening's yardstick."""
    return [tiny_task.make_record(*problem) for problem in tiny_task.all_problems(spec.task, "train")]


def new_model(spec: TinyModelSpec, tokenizer):
    """A freshly initialised (seeded) Qwen2 causal LM sized by the spec."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=True, dtype="float32",
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(config).float()


def warm_start(model, tokenizer, spec: TinyModelSpec, log: Callable[[str], None] = print) -> dict:
    """Supervised training on the train split; logs a progress line every few seconds.

    No attention mask is needed: padding only follows the eos and carries no loss.
    """
    pairs = [(r["prompt"], tiny_task.format_response(r["answer"])) for r in train_records(spec)]
    ids, labels = encode_examples(pairs, tokenizer)
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.0)
    total, warmup = spec.warm_start_steps, max(1, spec.warm_start_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) * max(0.1, 1 - i / total))
    model.train()
    start = last_log = time.monotonic()
    loss = torch.tensor(float("nan"))
    for step in range(1, spec.warm_start_steps + 1):
        batch = torch.randint(len(ids), (spec.batch_size,), generator=gen)
        loss = model(input_ids=ids[batch], labels=labels[batch]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        now = time.monotonic()
        if now - last_log >= 5.0 or step == spec.warm_start_steps:
            log(f"tiny warm start: step {step}/{spec.warm_start_steps} loss {loss.item():.4f} elapsed {now - start:.1f}s")
            last_log = now
    model.eval()
    return {"steps": spec.warm_start_steps, "final_loss": loss.item(), "train_seconds": time.monotonic() - start}


def build_into(directory: Path, spec: TinyModelSpec, log: Callable[[str], None] = print) -> dict:
    """Train the tiny model and write the full Hugging Face directory; returns the warm-start report."""
    start = time.monotonic()
    tokenizer = save_tokenizer(directory, model_max_length=spec.max_positions)
    with torch_threads():
        model = new_model(spec, tokenizer)
        log(f"tiny model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, building in {directory}")
        report = warm_start(model, tokenizer, spec, log)
        report["trained_answer_probability"] = answer_probability(model, tokenizer, train_records(spec))
        if spec.target_answer_probability is not None:
            report["softening_temperature"] = soften(model, tokenizer, train_records(spec), spec.target_answer_probability)
        report.update(evaluate(model, tokenizer, spec))
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(directory), safe_serialization=True)
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
            report = build_into(staging, spec, log)
            staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(
        f"tiny model ready at {final} (built in {report['build_seconds']:.0f}s; held-out accuracy "
        f"sampled {report['eval_sampled_accuracy']:.2f}, greedy {report['eval_greedy_accuracy']:.2f})"
    )
    return final
