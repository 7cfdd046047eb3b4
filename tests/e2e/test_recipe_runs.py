"""Every method recipe in configs/ runs a few steps end to end, as a user starts it:
`python launch/run.py --config configs/<recipe>.yaml`, on the tiny model with a real vLLM-CPU actor.

Overrides only shorten the run (steps, stage lengths, rollout-batch size) so each recipe crosses
its interesting boundaries (stages, online filtering, reference resets, rollout batches) in three
steps; the algorithm settings are the recipe's own. Two recipes run on two learner ranks, as a
user who outgrew one process would run them: C3PO's exact Φ on DeepSpeed ZeRO-2, ProRL's
reference resets on FSDP2. GRPO's actor scores its own samples (reward.placement: actor)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

SHORTEN = {
    "grpo": [],
    "dapo": ["buffer.rollout_batch_prompts=16"],  # N_SGD 2: step 3 opens a second rollout batch
    "ring_lite_c3po": [],
    "skywork_or1_magic": ["stages.0.steps=1", "stages.1.steps=1"],
    "prorl": ["stages.0.steps=1", "stages.1.steps=1", "algo.kl.reset_every=2", "buffer.rollout_batch_prompts=8"],
    "tiny_tool": [],  # episodes with the calculator, on its own warm start (built on first use)
    "tiny_lora": ["algo.kl.coef=0.001"],  # the KL reference is the base, the adapter switched off
    # its teacher is the demo's final/, which a fresh clone has not made: the warm start itself, in
    # its own vLLM engine, so the first step's reverse KL is the two engines' numerical gap
    "tiny_distill": ["algo.distill.teacher=builtin:tiny"],
    "tiny_moe": [],  # the tiny model as a Qwen3-MoE (built on first use), routing replayed
}
RANKS = {"ring_lite_c3po": ["learner.num_ranks=2", "learner.backend=deepspeed"],
         # FSDP2 pushes of the tied tiny model as deltas (rank 0 keeps the engines' copy), probed
         "prorl": ["learner.num_ranks=2", "sync.probe_every=1", "sync.transfer=delta"],
         # LoRA on FSDP2: each push is rank 0's adapter, served by vLLM's LoRA support, probed
         "tiny_lora": ["learner.num_ranks=2", "sync.probe_every=1"],
         # routing replay on FSDP2: each rank replays its own chunks' routing; pushes probed (CPU experts repacked)
         "tiny_moe": ["learner.num_ranks=2", "sync.probe_every=1"]}
# as a user with slow verifiers or many actors runs it: each vLLM actor scores its own samples
PLACEMENT = {"grpo": ["reward.placement=actor"]}


# Not run here: they ask Ray for GPUs (a CPU cluster never places them) and load a real model from the
# Hugging Face cache. tests/unit/test_recipes.py checks what they ask for.
GPU_ONLY = {"gpu_single_node", "gpu_multi_node", "gpu_single_node_lora", "gpu_multi_node_lora", "gsm8k_qwen_2x8"}


def test_every_recipe_is_covered():
    shipped = {p.stem for p in (ROOT / "configs").glob("*.yaml")} - {"tiny_cpu"}
    assert GPU_ONLY <= shipped and sorted(shipped - GPU_ONLY) == sorted(SHORTEN)


def run_recipe(name, tmp_path):
    cmd = [sys.executable, "launch/run.py", "--config", f"configs/{name}.yaml", f"total_steps={STEPS}",
           f"observe.output_dir={tmp_path}", "observe.console=lines", "observe.tensorboard=false",
           "save_final=false", "eval.every_steps=0", *SHORTEN[name], *RANKS.get(name, []), *PLACEMENT.get(name, [])]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows, events


@pytest.mark.parametrize("name", sorted(SHORTEN))
def test_recipe_runs(name, tmp_path, tiny_model_path):
    rows, events = run_recipe(name, tmp_path)
    tokens = [r["learner/loss_tokens"] for r in rows]
    assert all(t > 0 for t in tokens)
    assert [r["learner/ranks"] for r in rows] == [2 if name in RANKS else 1] * STEPS
    # the tiny model keeps packed sequences apart (checked at start): no forward computes padding
    assert all(r["learner/packed"] == 1.0 and r["learner/padding_frac"] == 0.0 for r in rows)
    if name in RANKS:  # the ranks' parts add up to the step
        assert all(r["learner/loss_tokens_rank0"] + r["learner/loss_tokens_rank1"] == r["learner/loss_tokens"]
                   for r in rows)
    scored_by_actors = rows[-1]["reward/actor_scored_total"]
    if name in PLACEMENT:  # every sample of the steps came scored from the actor
        assert scored_by_actors >= sum(r["reward/num_samples"] for r in rows) > 0
    else:
        assert scored_by_actors == 0
    if name == "ring_lite_c3po":
        assert tokens == [512] * STEPS  # C3PO: exactly Phi loss tokens every step
    if name in ("grpo", "ring_lite_c3po", "prorl"):
        assert all("kl/mean" in r for r in rows) and rows[0]["kl/mean"] == 0.0
    if name == "skywork_or1_magic":
        stages = [e for e in events if e["event"] == "stage"]
        assert [e["name"] for e in stages] == ["stage2", "stage3"]
        assert [r["stage/index"] for r in rows] == [0, 1, 2]
        assert [r["entropy/coef"] for r in rows][0] == 0.0 and all("entropy_control/c" in r for r in rows)
    if name == "prorl":
        assert [e["reason"] for e in events if e["event"] == "reference_reset"] == ["every_k"]
        assert rows[2]["kl/mean"] == 0.0 and rows[2]["learner/optimizer_steps"] == 1
        assert all(r["sync/probe_max_abs_diff"] <= 1e-4 and r["sync/verify_failures"] == 0 for r in rows)
        # a push with nothing to compare with (the group's first) goes whole; every later one is
        # compared bit by bit with what the engines hold, and is never larger than a whole push
        compared = [r for r in rows if "sync/changed_frac" in r]
        assert len(compared) >= STEPS - 1 and all(0 <= r["sync/changed_frac"] <= 1 for r in compared)
        assert all(r["sync/whole"] == 1.0 for r in rows if "sync/changed_frac" not in r)
        assert all(r["sync/push_bytes"] <= r["sync/num_bytes"] + 24 * r["sync/num_buckets"] for r in rows)
        assert [r["stage/index"] for r in rows] == [0, 1, 2]
    if name == "tiny_tool":  # the episodes called the calculator, whose answers are in, masked
        episodes = [r for r in rows if r.get("episode/tool_calls_mean") is not None]
        assert episodes and all(r["episode/error_frac"] == 0 for r in episodes)
        # Over the run's ~200 episodes, not step by step: the warm start calls in ~96% of them, and a
        # late step of 25 episodes falls under 0.9 one time in eight by chance (binomial) - CI saw it;
        # a step can hold a single episode, with no call and so nothing masked.
        def total(key):
            return sum(r[key] * r["reward/num_samples"] for r in episodes)

        assert total("episode/tool_calls_mean") / sum(r["reward/num_samples"] for r in episodes) >= 0.9
        observed = total("episode/observation_tokens_mean")
        assert observed / (observed + total("episode/model_tokens_mean")) > 0.3  # ~0.41
    if name == "tiny_lora":  # the engine serves the pushed adapter: its logprobs are the learner's
        assert all(r["sync/probe_max_abs_diff"] <= 1e-4 and r["sync/verify_failures"] == 0 for r in rows)
        model_bytes = sum(p.stat().st_size for p in Path(tiny_model_path).glob("*.safetensors"))
        assert all(0 < r["sync/push_bytes"] <= 0.1 * model_bytes for r in rows)
        assert all(r["kl/mean"] >= 0 for r in rows) and rows[-1]["learner/trainable_params"] > 0
    if name == "tiny_distill":  # every trained sample went through the teacher's engine first
        assert rows[-1]["distill/scored_total"] >= sum(r["reward/num_samples"] for r in rows) > 0
        # teacher and student are one model at version 0: an off-by-one in the teacher's positions
        # or another model would give a gap of nats (the student's own entropy is ~0.17 a token)
        assert abs(rows[0]["distill/reverse_kl"]) < 1e-3
        # a row in which the teacher scored nothing (its samples came back in an earlier row) has
        # neither figure: NaN, written as null
        scored = [r for r in rows if r["distill/reverse_kl"] is not None]
        assert scored[0] is rows[0] and all(r["distill/teacher_latency_s"] > 0 for r in scored)
        assert all(r["distill/teacher_latency_s"] is None for r in rows if r["distill/reverse_kl"] is None)
    if name == "tiny_moe":  # every recorded position is routed as the engine routed it, on both ranks
        assert all(r["moe/route_agreement"] == 1.0 and r["moe/route_coverage"] > 0.85 for r in rows)
        assert all(r["moe/own_route_agreement"] > 0.9 for r in rows)  # float32 both sides: ties are rare
        assert all(r["sync/probe_max_abs_diff"] <= 1e-4 for r in rows)
        fresh = [r["offpolicy/mismatch_abs"] for r in rows if r.get("offpolicy/mismatch_abs") is not None]
        assert fresh and max(fresh) <= 1e-4
    if name == "dapo":
        sealed = [r["buffer/rollout_batches_sealed_total"] for r in rows]
        assert sealed[0] == 1 and sealed[2] == 2
