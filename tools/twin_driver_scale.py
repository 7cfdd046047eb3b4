"""How large a cluster one driver serves: the AReaL-like scenario at growing GPU counts in the
twin, the real driver's CPU time charged, and where that time goes.

    python tools/twin_driver_scale.py [--gpus 64 256] [--placement actor] [--eta 4] [--steps 6] [--profile]

Each size splits its GPUs 3:1 between generation and training (the planner's ratio for this
workload) and grows Phi with it, 0.5M loss tokens a step a GPU as in the one-node scenario: with
Phi fixed, the staleness
bound caps the requests in flight at (eta + 1) steps' worth and added engines would run nearly
empty. Samples are scored by the driver's pool of 8 workers or by the actors (--placement).
The driver holds every finished, untrained token as decoded from its frame (12 bytes a token:
id, version, logprob), so a cluster's Phi must fit this machine's memory a few times over.
`driver_core_frac` is the driver's real CPU seconds per simulated second: past 1 the driver
cannot keep up and the cluster waits for it (fraction_of_ideal falls). --profile prints the
costliest functions at each size (cProfile, their own time; the twin's own work included).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "twin" / "areal_math_1p5b_1node.yaml"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--placement", choices=["driver", "actor"], default="driver", help="reward.placement")
    p.add_argument("--eta", type=int, default=4, help="buffer.max_staleness")
    p.add_argument("--phi-per-gpu", type=int, default=500_000, help="Phi = this x the GPUs (the 1-node scenario's)")
    args = p.parse_args()
    from asyncrl.twin.cluster import Twin
    from asyncrl.twin.scenario import load_scenario

    rows = []
    for gpus in args.gpus:
        gen = gpus * 3 // 4
        phi = args.phi_per_gpu * gpus
        sc = load_scenario(SCENARIO, [f"split.gen_gpus={gen}", f"split.train_gpus={gpus - gen}",
                                      f"run.token_budget={phi}", f"run.steps={args.steps}",
                                      f"run.warmup_steps={args.warmup}", "run.reward_workers=8",
                                      f"run.reward_placement={args.placement}", f"run.max_staleness={args.eta}",
                                      f"name=areal_1p5b_{gpus}gpu"])
        t0 = time.monotonic()
        twin = Twin(sc, "inflight")
        prof = cProfile.Profile() if args.profile else None
        if prof:
            prof.enable()
        r = twin.run()
        if prof:
            prof.disable()
        wall = time.monotonic() - t0
        row = {"gpus": gpus, "gen_gpus": gen, "token_budget": phi, "placement": args.placement, "eta": args.eta,
               "driver_core_frac": r["driver_core_frac"],
               "trained_tokens_per_s": r["trained_tokens_per_s"], "fraction_of_ideal": r["fraction_of_ideal"],
               "samples_per_sim_s": r["samples"] / r["sim_s"], "gen_util": r["gen_util"], "train_util": r["train_util"],
               "wall_s": wall}
        rows.append(row)
        print(f"{gpus:5d} GPUs ({gen} gen): driver {r['driver_core_frac']:.2f} cores, {r['trained_tokens_per_s']:,.0f} "
              f"trained tokens/s ({r['fraction_of_ideal']:.2f} of ideal), {row['samples_per_sim_s']:,.0f} samples/s, "
              f"gen util {r['gen_util']:.2f}, train util {r['train_util']:.2f}  [{wall:.0f} s]", flush=True)
        if prof:
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(12)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
