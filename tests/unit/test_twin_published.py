"""The published-results table (asyncrl/twin/published.py): each row's ratio, the baselines shared
between rows, the rows not expected to match, and the scenario files behind it."""

from pathlib import Path

import pytest
import yaml

from asyncrl.config.load import ConfigError
from asyncrl.twin.published import TOLERANCE, Row, anchors, predict, sensitivity, summary, table
from asyncrl.twin.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "configs" / "twin" / "published"


def scenario_file(tmp_path, published) -> Path:
    base = ROOT / "configs" / "twin" / "areal_math_1p5b_1node.yaml"
    path = tmp_path / "row.yaml"
    path.write_text(yaml.safe_dump({"base": str(base), "name": "row", "published": published}))
    return path


def test_a_row_is_the_async_rate_over_its_baseline_and_baselines_are_run_once(tmp_path):
    path = scenario_file(tmp_path, [
        {"anchor": "eta 2", "published": 2.0, "baseline": "sync_decoupled", "overrides": ["run.max_staleness=2"],
         "published_tokens_per_s": [1000, 500]},
        {"anchor": "eta 8", "published": 3.0, "baseline": "sync_decoupled", "overrides": ["run.max_staleness=8"]},
        {"anchor": "other split", "published": 1.0, "baseline": "sync", "reason": "not modelled",
         "overrides": ["split.gen_gpus=4", "split.train_gpus=4"]}])
    runs = []

    def fake(sc, mode):  # a rate from the settings each run sees: eta for async, the split for all
        runs.append((mode, sc.run.max_staleness, sc.split.gen_gpus))
        useful = (100.0 * sc.split.gen_gpus if mode.startswith("sync")
                  else 100.0 * sc.split.gen_gpus * (1 + sc.run.max_staleness / 4))
        return {"trained_tokens_per_s": useful, "all_trained_tokens_per_s": 1.25 * useful}

    cache: dict = {}
    rows = [predict(p, a, run=fake, cache=cache) for p, a in anchors([path])]
    assert [r.predicted for r in rows] == [pytest.approx(1.5), pytest.approx(3.0), pytest.approx(2.0)]
    # one decoupled baseline for both etas (its schedule has no staleness), one for the other split
    assert sorted(runs) == sorted([("inflight", 2, 6), ("sync_decoupled", 2, 6), ("inflight", 8, 6),
                                   ("inflight", 4, 4), ("sync", 4, 4)])
    out = summary(rows)
    assert (out["total"], out["expected"], out["within_15pct"]) == (3, 2, 1)  # 1.5 vs 2.0 is -25%
    assert [r["within_15pct"] for r in out["rows"]] == [False, True, False]
    assert out["rows"][2]["reason"] == "not modelled"
    # each side's own rate, all loss tokens, beside the source's where it prints them
    assert out["rows"][0]["tokens_per_s"] == [1125, 750] and out["rows"][0]["published_tokens_per_s"] == [1000, 500]
    lines = table(rows).splitlines()
    assert lines[2].split() == ["tokens/s,", "twin", "(published):", "asynchronous", "1,125", "(1,000),",
                                "sync_decoupled", "750", "(500)"]
    assert len(lines) == 5  # the header, three rows, one line of rates


def test_within_is_the_tolerance_either_side():
    def row(predicted):
        return Row("a", "s", "sync", 2.0, predicted, None)

    assert row(2.0 * (1 + TOLERANCE) - 1e-9).within and row(2.0 * (1 - TOLERANCE) + 1e-9).within
    assert not row(2.0 * (1 + TOLERANCE) + 1e-6).within and not row(1.6).within


def test_the_published_scenarios_load_and_name_their_rows():
    rows = anchors(sorted(PUBLISHED.glob("*.yaml")))
    assert len(rows) >= 6
    for path, a in rows:
        sc = load_scenario(path, a.overrides)  # every row's overrides are valid
        assert a.published > 0 and sc.published
    # a baseline the twin has no mode for: one line naming the field
    with pytest.raises(ConfigError, match="baseline"):
        load_scenario(ROOT / "configs" / "twin" / "areal_math_1p5b_1node.yaml",
                      ["published=[{anchor: x, published: 2, baseline: colocated}]"])


def test_sensitivity_reruns_the_row_at_both_ends_of_each_assumed_value(tmp_path):
    base = ROOT / "configs" / "twin" / "areal_math_1p5b_1node.yaml"
    path = tmp_path / "row.yaml"
    path.write_text(yaml.safe_dump({
        "base": str(base), "name": "row",
        "assumed": {"workload.lengths.mean": [2000, 8000], "engine.bandwidth_efficiency": [0.3, 0.9]},
        "published": [{"anchor": "eta 4", "published": 2.0, "baseline": "sync", "overrides": ["run.max_staleness=4"]}]}))

    def fake(sc, mode):  # async gains with the mean length; the baseline with the bandwidth
        rate = (sc.workload.lengths.mean / 1000 if mode == "inflight" else 2 * sc.engine.bandwidth_efficiency)
        return {"trained_tokens_per_s": rate, "all_trained_tokens_per_s": rate}

    [(p, a)] = anchors([path])
    row = predict(p, a, run=fake)
    mean, bw = load_scenario(path).workload.lengths.mean, load_scenario(path).engine.bandwidth_efficiency
    assert row.predicted == pytest.approx(mean / 1000 / (2 * bw))
    row.sensitivity = sensitivity(p, a, run=fake)
    assert row.sensitivity == {
        "workload.lengths.mean": [(2000, pytest.approx(2 / (2 * bw))), (8000, pytest.approx(8 / (2 * bw)))],
        "engine.bandwidth_efficiency": [(0.3, pytest.approx(mean / 1000 / 0.6)), (0.9, pytest.approx(mean / 1000 / 1.8))]}
    assert f"workload.lengths.mean 2000: {2 / (2 * bw):.2f}x, 8000: {8 / (2 * bw):.2f}x" in table([row])
    assert summary([row])["rows"][0]["sensitivity"]["engine.bandwidth_efficiency"][0] == [0.3, round(mean / 600, 3)]
