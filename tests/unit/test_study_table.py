"""The studies guide's table of presets says how many runs each `--quick` study makes: the count
is checked against the study's own plan, so the page stays true when a preset changes (it said 3
runs where --plan listed 4 once every preset gained an A/A arm)."""

import re
from pathlib import Path

import pytest

from asyncrl.lab.study.config import load_study
from asyncrl.lab.study.plan import plan_study

ROOT = Path(__file__).resolve().parents[2]
ROWS = re.findall(r"^\| `(\w+)\.yaml` \|.*\| (\d+) runs of [^|]*\|$",
                  (ROOT / "docs/guides/studies.md").read_text(), flags=re.M)


def test_the_table_lists_every_shipped_preset():
    assert sorted(name for name, _ in ROWS) == sorted(p.stem for p in (ROOT / "configs/studies").glob("*.yaml"))


@pytest.mark.parametrize("name,runs", ROWS, ids=[name for name, _ in ROWS])
def test_a_presets_quick_run_count_is_its_plans(name, runs):
    path = ROOT / "configs/studies" / f"{name}.yaml"
    assert len(plan_study(load_study(path), path, quick=True, cli_overrides=[]).runs) == int(runs)
