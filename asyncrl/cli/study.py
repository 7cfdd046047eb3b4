"""`asyncrl study`: a grid of arms x seeds on a base recipe, then its figures, report and verdicts
(asyncrl/lab/study/conduct.py says what each invocation does).

    asyncrl study configs/studies/skywork_sec4.yaml --quick
    asyncrl study staleness observe.output_dir=/tmp/studies        # a shipped study by its name
    asyncrl study prorl_resets --parallel 2     # 2 runs at once, one Ray cluster
    asyncrl study skywork_sec4 --quick --plan   # the runs and their commands
    asyncrl study skywork_sec4 --quick --report # figures and report only
    asyncrl study skywork_sec4 --quick --arms nsgd1,nsgd4   # some arms only
    asyncrl study skywork_sec4 --quick --evaluate  # + each arm's final avg@n

Exit codes: 0 every run finished (and evaluated), 1 a run did not (or the evaluation failed), 2 a
bad study file or override, 128 + signal when stopped.
"""

from __future__ import annotations

import argparse
import sys

SUMMARY = "a grid of runs (arms x seeds), resumable, then figures, a report and verdicts"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", help="study YAML (configs/studies/*.yaml), or a shipped study's name")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every arm, e.g. observe.output_dir=/tmp/s")
    p.add_argument("--quick", action="store_true", help="the study's quick variant (fewer steps and seeds)")
    p.add_argument("--parallel", type=int, default=1,
                   help="runs at once on one Ray cluster, each in its own process (default 1)")
    p.add_argument("--cold", action="store_true",
                   help="each run in a process of its own, as `asyncrl run` (default: one after another in this "
                        "process, sharing the Ray cluster, the engines and the learner)")
    p.add_argument("--arms", default=None, help="only these arms, comma-separated (default: all)")
    p.add_argument("--plan", action="store_true", help="print the runs, what each needs and its command; run nothing")
    p.add_argument("--report", action="store_true", help="only write figures and the report from the runs there")
    p.add_argument("--evaluate", action="store_true",
                   help="evaluate each finished run's final/ on held-out data (asyncrl evaluate) for the report")
    return p.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from asyncrl.config import ConfigError
    from asyncrl.lab.study.conduct import StudyRequest, conduct

    req = StudyRequest(args.study, args.overrides, args.quick, args.parallel,
                       args.arms.split(",") if args.arms else None, args.plan, args.report, args.evaluate,
                       args.cold)
    try:
        return conduct(req, log=lambda s: print(s, flush=True))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
