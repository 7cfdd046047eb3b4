"""What misbehaving verifiers cost the training loop: the same real run (Ray, vLLM-CPU actor,
learner) scored by the plain math verifier (the baseline) and by the math verifier with one
sample in 32 hanging (or crashing), in one invocation. Prints steps/s of each and the ratio.

    python tools/bench_reward_faults.py [--steps 60] [--rounds 3] [--timeout 0.5] [--workers 8]
        [--fault hang|crash] [section.field=value ...]

Runs alternate (plain, fault, plain, fault, ...) and the ratio is of the summed rates, because on
2 shared cores one run's step rate varies by +-15% for reasons of its own (response lengths
drift as the policy learns). A hang costs its sample (reward 0 after reward.timeout_s) and a
replacement worker; the run should keep its step rate when the pool has more workers than hangs
in flight.
"""

from __future__ import annotations

import argparse
import json
import time

from loop_bench import run_loop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=0.5, help="reward.timeout_s")
    p.add_argument("--workers", type=int, default=8, help="reward.num_workers")
    p.add_argument("--fault", choices=("hang", "crash"), default="hang")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    common = [f"reward.timeout_s={args.timeout}", f"reward.num_workers={args.workers}", *args.overrides]
    fault_fn = f"import:asyncrl.reward.fault_injection:{args.fault}_on_some"
    t0 = time.monotonic()
    print(f"{'round':<7}{'verifier':<10}{'steps/s':>9}{'median step s':>15}{'wait/step s':>13}{'timeouts':>10}"
          f"{'crashes':>9}{'stale dropped':>15}{'reward(last10)':>16}", flush=True)
    results: dict[str, list[dict]] = {"plain": [], args.fault: []}
    for i in range(args.rounds):
        for name, reward_type in (("plain", "math_verify"), (args.fault, fault_fn)):
            r = run_loop(name, args.steps, args.warmup, [*common, f"reward.type={reward_type}"])
            st = r.pop("orchestrator").rewards.stats
            r.update(timeouts=st.timeouts, crashes=st.crashes)
            results[name].append(r)
            print(f"{i + 1:<7}{name:<10}{r['steps_per_s']:>9.2f}{r['median_step_s']:>15.3f}"
                  f"{r['wait_for_data_s_per_step']:>13.3f}{st.timeouts:>10}{st.crashes:>9}"
                  f"{r['stale_dropped_frac']:>15.1%}{r['reward_last_10']:>16.3f}", flush=True)
    rate = {name: sum(r["steps_per_s"] for r in rs) / len(rs) for name, rs in results.items()}
    per_round = [f["steps_per_s"] / p["steps_per_s"] for p, f in zip(results["plain"], results[args.fault])]
    ratio = rate[args.fault] / rate["plain"]
    print(f"{args.fault} / plain steps per second: {ratio:.2f} (rounds: {', '.join(f'{x:.2f}' for x in per_round)})"
          f"   (bench took {time.monotonic() - t0:.0f}s)")
    print(json.dumps({"ratio": ratio, "per_round": per_round, **results}))


if __name__ == "__main__":
    main()
