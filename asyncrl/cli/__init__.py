"""The `asyncrl` command (pyproject's [project.scripts]; `python -m asyncrl` is the same): one
subcommand per tool, each a module here that parses its arguments and calls one package function.

    asyncrl run [--config RECIPE] [section.field=value ...]    train one run (asyncrl/launch.py)
    asyncrl scale RUN_DIR --actors N                          resize a running run's actor pool
    asyncrl evaluate RUN_DIR ... | --model POLICY              avg@n, pass@k (asyncrl/lab/offline/)
    asyncrl sample --model POLICY                              a policy's samples and accuracy
    asyncrl filter-difficulty --out KEPT.jsonl                 drop the always / never solved prompts
    asyncrl choose-checkpoint CKPT ... --band LOW HIGH         the SFT checkpoint by its entropy
    asyncrl study STUDY [--quick] [--plan] [overrides ...]     a grid of runs and its report (asyncrl/lab/study/)
    asyncrl plot RUN_DIR ... --out DIR                         figures and a report of any runs
    asyncrl twin SCENARIO [overrides ...]                      a GPU cluster in the digital twin (asyncrl/twin/)
    asyncrl plan-cluster SCENARIO [--gpus N]                   its best generation/training split and eta

RECIPE and STUDY are a path or the name of a shipped one (`grpo`, `staleness`). `asyncrl <command>
--help` lists a command's options. The scripts in launch/ and tools/ call the same functions.
"""

from __future__ import annotations

import sys

from asyncrl.cli import (choose_checkpoint, evaluate, filter_difficulty, plan_cluster, plot, run, sample, scale,
                         study, twin)

COMMANDS = {"run": run, "scale": scale, "evaluate": evaluate, "sample": sample,
            "filter-difficulty": filter_difficulty, "choose-checkpoint": choose_checkpoint,
            "study": study, "plot": plot, "twin": twin, "plan-cluster": plan_cluster}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {module.SUMMARY}" for name, module in COMMANDS.items()]
    return "usage: asyncrl <command> [options]\n\ncommands:\n" + "\n".join(lines) + \
        "\n\n`asyncrl <command> --help` lists a command's options."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"error: no command {argv[0]!r}\n{usage()}", file=sys.stderr)
        return 2
    return command.main(argv[1:])
