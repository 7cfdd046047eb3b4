"""`asyncrl plan-cluster`: the split of a GPU count between generation and training, and the
staleness bound, that trains the most tokens a second for a scenario's model and workload, found
in the digital twin (asyncrl/twin/plan.py).

    asyncrl plan-cluster configs/twin/areal_math_1p5b_1node.yaml
    asyncrl plan-cluster configs/twin/math_7b_4node.yaml --gpus 64 --etas 2 4 8
    asyncrl plan-cluster SCENARIO model.params=3e9 workload.lengths.mean=9000 --max-staleness-mean 2

Prints every (split, eta) tried, the best with its expected throughput and staleness, the
scenario overrides and the asyncrl run overrides that run it, and a last line of JSON.
"""

from __future__ import annotations

import argparse
import json

SUMMARY = "the best generation/training split and eta for a GPU count, from the digital twin"


def parse_args(argv: list[str]) -> argparse.Namespace:
    from asyncrl.cli.twin import scenario_parser

    p = scenario_parser("asyncrl plan-cluster", __doc__, "model.params=7e9 workload.lengths.mean=4000")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to split (default: the scenario's)")
    p.add_argument("--etas", type=int, nargs="+", default=[1, 2, 4, 8], help="staleness bounds to try")
    p.add_argument("--splits", type=int, default=3, help="splits run in the twin (the best by closed form)")
    p.add_argument("--max-staleness-mean", type=float, default=None, help="only plans whose mean staleness is within this")
    return p.parse_intermixed_args(argv)  # overrides may follow the options


def main(argv: list[str]) -> int:
    from asyncrl.cli.twin import load_or_say
    from asyncrl.twin.plan import plan, run_overrides

    args = parse_args(argv)
    if (sc := load_or_say(args)) is None:
        return 2
    gpus = args.gpus or sc.split.gen_gpus + sc.split.train_gpus
    if gpus < sc.split.tp + 1:
        print(f"error: --gpus {gpus} leaves no GPU to train on beside one engine of tp {sc.split.tp}")
        return 2
    print(f"{sc.name}: splitting {gpus} GPUs, eta in {args.etas}")
    best, trials = plan(sc, gpus, args.etas, args.splits, args.max_staleness_mean)
    if best is None:
        print(f"no plan has a mean staleness within {args.max_staleness_mean}")
        return 1
    r = best.result
    print(f"best: {best.gen_gpus} generation + {best.train_gpus} training GPUs, eta {best.eta}: "
          f"{best.rate:,.0f} trained tokens/s ({r['fraction_of_ideal']:.2f} of ideal {r['ideal_tokens_per_s']:,.0f}), "
          f"mean staleness {r['staleness_mean']:.2f} (max {r['staleness_max']:.0f})")
    print(f"scenario: split.gen_gpus={best.gen_gpus} split.train_gpus={best.train_gpus} run.max_staleness={best.eta}")
    print(f"asyncrl run: {' '.join(run_overrides(sc, best))}")
    print(json.dumps({"scenario": sc.name, "gpus": gpus, "gen_gpus": best.gen_gpus, "train_gpus": best.train_gpus,
                      "max_staleness": best.eta, "trained_tokens_per_s": best.rate,
                      "fraction_of_ideal": r["fraction_of_ideal"], "staleness_mean": r["staleness_mean"],
                      "tried": [{"gen_gpus": t.gen_gpus, "train_gpus": t.train_gpus, "eta": t.eta,
                                 "trained_tokens_per_s": t.rate, "staleness_mean": t.result["staleness_mean"]}
                                for t in trials]}))
    return 0
