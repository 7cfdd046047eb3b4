"""`asyncrl twin`: a scenario of a GPU cluster (configs/twin/*.yaml) in the digital twin, the real
driver deciding: the synchronous baselines (colocated `sync`, `sync_decoupled` on the split),
drain and in-flight asynchronous modes and `colocate_async`, a table, a utilisation figure and,
last, one line of JSON (asyncrl/twin/).

    asyncrl twin configs/twin/areal_math_1p5b_1node.yaml
    asyncrl twin configs/twin/short_response_1p5b.yaml split.gen_gpus=5 split.train_gpus=3 --modes sync inflight
    asyncrl twin SCENARIO --no-charge         the driver's CPU time not charged: a pure function of the scenario

The JSON holds trained_tokens_per_s, sync_trained_tokens_per_s, async_over_sync (against the
colocated step), async_over_decoupled, ideal_tokens_per_s, fraction_of_ideal, gen_util (busy
time), gen_occupancy (running requests over max_num_seqs), reprefill_frac, train_util,
staleness_mean, staleness_max, length_bias and driver_core_frac (the driver's real CPU seconds
per simulated second).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SUMMARY = "a GPU cluster's synchronous baselines and asynchronous modes in the digital twin (real driver)"


def scenario_parser(prog: str, doc: str | None, example: str) -> argparse.ArgumentParser:
    """A command's parser whose first arguments are a twin scenario and its overrides."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", help="a twin scenario file (configs/twin/*.yaml)")
    p.add_argument("overrides", nargs="*", help=f"section.field=value, e.g. {example}")
    return p


def load_or_say(args: argparse.Namespace) -> Any:
    """The scenario the arguments name, or None after printing what is wrong with it."""
    from asyncrl.config.load import ConfigError
    from asyncrl.twin.scenario import load_scenario

    try:
        return load_scenario(args.scenario, args.overrides)
    except ConfigError as e:
        print(f"error: {e}")
        return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    from asyncrl.twin.cluster import MODES

    p = scenario_parser("asyncrl twin", __doc__, "split.gen_gpus=5 run.max_staleness=2")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--out", default=None, help="directory of the figure and results.json (default: runs/twin/<name>)")
    p.add_argument("--no-charge", action="store_true", help="do not charge the driver's CPU time to the clock")
    return p.parse_intermixed_args(argv)  # overrides may follow the options


def main(argv: list[str]) -> int:
    from asyncrl.twin.bench import figure, run_modes, summary, table

    args = parse_args(argv)
    if (sc := load_or_say(args)) is None:
        return 2
    results = run_modes(sc, args.modes, charge_driver=not args.no_charge)
    out = Path(args.out or Path("runs") / "twin" / sc.name)
    print(table(results))
    png = figure(results, out / "utilisation.png", f"{sc.name}: {sc.split.gen_gpus} generation + "
                 f"{sc.split.train_gpus} training GPUs, eta {sc.run.max_staleness}")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"figure: {png}; every mode's results: {out / 'results.json'}")
    print(json.dumps(summary(sc, results)))
    return 0
