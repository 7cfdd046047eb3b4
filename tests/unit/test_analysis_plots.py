"""Figures and report from hand-written run directories: the pictures hold the arms and the data of
the metrics files (tests/figure_checks.py), the sweep figure its points, the report its numbers."""

import json

import pytest
from figure_checks import check_metric_figure, check_png, has_colour

from asyncrl.lab.analysis.analyse import analyse
from asyncrl.lab.analysis.arms import Arm, arms_from_dirs
from asyncrl.lab.analysis.runs import read_run
from asyncrl.lab.study.config import AnalysisSpec, StudyConfig


def make_run(root, name, entropy, reward, eta, decoupled=False):
    d = root / name
    d.mkdir(parents=True)
    rows = [{"step": i + 1, "time": 0.0, "entropy/learner": e, "reward/mean": r, "clip/high_frac": 0.01 * eta,
             "rollout/samples_total": 64 * (i + 1) + eta}
            for i, (e, r) in enumerate(zip(entropy, reward))]
    rows[1]["reward/mean"] = None  # a step whose reward is missing is left out of the line
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "events.jsonl").write_text(json.dumps({"step": 0, "event": "start"}) + "\n"
                                    + json.dumps({"step": len(rows), "event": "end", "status": "finished"}) + "\n")
    (d / "config.yaml").write_text(f"buffer:\n  max_staleness: {eta}\nalgo:\n  decoupled: {str(decoupled).lower()}\n")
    return d


@pytest.fixture
def runs(tmp_path):
    return {
        "eta0": [make_run(tmp_path, "eta0-s0", [1.0, 0.9, 0.8, 0.7], [0.1, 0.2, 0.3, 0.4], 0),
                 make_run(tmp_path, "eta0-s1", [1.2, 1.1, 1.0, 0.9], [0.3, 0.2, 0.5, 0.6], 0)],
        "eta4": [make_run(tmp_path, "eta4-s0", [1.0, 0.5, 0.3, 0.2], [0.1, 0.1, 0.2, 0.2], 4),
                 make_run(tmp_path, "eta4-s1", [1.0, 0.6, 0.3, 0.1], [0.0, 0.2, 0.2, 0.3], 4)],
    }


def test_metric_figures_hold_every_arm_and_the_seed_means(tmp_path, runs):
    arms = arms_from_dirs([d for ds in runs.values() for d in ds], group_seeds=True)
    assert [a.name for a in arms] == ["eta0", "eta4"]
    out = tmp_path / "out"
    analyse(arms, out, AnalysisSpec(figures=["entropy/learner", "reward/mean", "kl/mean"], window=2), "t")
    for metric in ("entropy/learner", "reward/mean"):
        check_metric_figure(out / "figures", metric, runs)
    sidecar = json.loads((out / "figures" / "reward_mean.json").read_text())
    # by hand: eta0 step 1 = (0.1 + 0.3) / 2, step 2 missing in both seeds
    assert sidecar["panels"][0]["lines"][0]["x"] == [1.0, 3.0, 4.0]
    assert sidecar["panels"][0]["lines"][0]["y"][0] == pytest.approx(0.2, abs=1e-12)
    assert not (out / "figures" / "kl_mean.png").exists()  # no arm logged it: no empty figure


def test_a_figure_missing_an_arm_fails_the_check(tmp_path, runs):
    out = tmp_path / "out"
    analyse([Arm("eta0", [read_run(d) for d in runs["eta0"]])], out, AnalysisSpec(figures=["entropy/learner"]), "t")
    with pytest.raises(AssertionError):
        check_metric_figure(out / "figures", "entropy/learner", runs)


def test_a_figure_against_samples_generated(tmp_path, runs):
    arms = arms_from_dirs(runs["eta4"], group_seeds=True)
    analyse(arms, tmp_path, AnalysisSpec(figures=["entropy/learner"], x_axis="rollout/samples_total"), "t")
    sidecar = json.loads((tmp_path / "figures" / "entropy_learner.json").read_text())
    assert sidecar["x_axis"] == "rollout/samples_total"
    assert sidecar["panels"][0]["lines"][0]["x"] == [68.0, 132.0, 196.0, 260.0]  # 64 (i + 1) + 4
    assert sidecar["panels"][0]["lines"][0]["y"] == pytest.approx([1.0, 0.55, 0.3, 0.15], abs=1e-12)


def test_a_figure_against_seconds_since_each_runs_start(tmp_path):
    """Two runs started a day apart (Unix times) share one elapsed axis: seconds since each start."""
    dirs = []
    for seed, t0 in ((0, 1_700_000_000.0), (1, 1_700_086_400.0)):
        d = make_run(tmp_path, f"a-s{seed}", [1.0, 0.8, 0.6], [0.1, 0.2, 0.3], 0)
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        for i, r in enumerate(rows):
            r["time"] = t0 + 10.0 * (i + 1) + seed  # the first row 10 s (11 s) after the start event
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "events.jsonl").write_text(json.dumps({"step": 0, "time": t0, "event": "start"}) + "\n")
        dirs.append(d)
    assert read_run(dirs[1]).series("elapsed").values == (11.0, 21.0, 31.0)
    arms = arms_from_dirs(dirs, group_seeds=True)
    analyse(arms, tmp_path / "out", AnalysisSpec(figures=["entropy/learner"], x_axis="elapsed"), "t")
    sidecar = json.loads((tmp_path / "out" / "figures" / "entropy_learner.json").read_text())
    xs = sorted({x for line in sidecar["panels"][0]["lines"] for x in line["x"]})
    assert sidecar["x_axis"] == "elapsed" and max(xs) <= 31.0 and min(xs) >= 10.0, xs


def test_sweep_figure_and_report(tmp_path, runs):
    study = StudyConfig.model_validate({
        "name": "s", "total_steps": 4, "grid": {"buffer.max_staleness": [0, 4]}, "grid_names": {"buffer.max_staleness": "eta"},
        "analysis": {"figures": ["entropy/learner"], "window": 2},
        "sweep_plots": [{"name": "vs_eta", "x_field": "buffer.max_staleness", "series_fields": ["algo.decoupled"],
                         "metrics": ["entropy/learner", "clip/high_frac"]}],
        "findings": [{"name": "staleness lowers final entropy", "checks": [
            {"kind": "ordered", "arms": ["eta0", "eta4"], "stat": "final", "direction": "decreasing"}]}]})
    arms = arms_from_dirs([d for ds in runs.values() for d in ds], group_seeds=True)
    out = tmp_path / "out"
    report = analyse(arms, out, study.analysis, "Study s", "what it asks", study.findings, study.sweep_plots,
                     study.grid_names, {"eta0": "buffer.max_staleness=0", "eta4": "buffer.max_staleness=4"})
    sidecar = json.loads((out / "figures" / "vs_eta.json").read_text())
    pixels = check_png(out / "figures" / sidecar["png"], sidecar)
    assert sidecar["legend"] == ["decoupled=0"]
    entropy_panel = sidecar["panels"][0]
    assert entropy_panel["metric"] == "entropy/learner"
    # final = mean of the last 2 steps of the seed mean: eta0 (0.9 + 0.8) / 2, eta4 (0.3 + 0.15) / 2
    assert entropy_panel["lines"][0]["x"] == [0.0, 4.0]
    assert entropy_panel["lines"][0]["y"] == pytest.approx([0.85, 0.225], abs=1e-12)
    assert has_colour(pixels, entropy_panel["lines"][0]["color"])
    text = report.read_text()
    # paired by seed: finals eta4 - eta0 = (0.25 - 0.75, 0.2 - 0.95) = (-0.5, -0.75), mean -0.625, sd
    # 0.17678, 95% interval -0.625 -+ 12.706 * 0.17678 / sqrt(2) = [-2.21, +0.963]: two seeds decide nothing
    assert ("| staleness lowers final entropy | **inconclusive** | final of entropy/learner [eta4] - final of "
            "entropy/learner [eta0] < 0: -0.625 [-2.21, +0.963] (n=2) (undecided) |") in text
    # the arm table: final ± sd over seeds (per-seed finals 0.25 and 0.2) / peak, and the collapse step
    # (eta4's seed mean 1, 0.55, 0.3, 0.15: initial 0.775, smoothed 1, 0.775, 0.425, 0.225 < 0.3875 at step 4)
    assert "| eta4 | buffer.max_staleness=4 | 2/2 finished | 4 | 4 | 0.225 ± 0.0354 / 1 |" in text
    assert "![entropy/learner](figures/entropy_learner.png)" in text and "![vs_eta](figures/vs_eta.png)" in text
    verdicts = json.loads((out / "report.json").read_text())["verdicts"]
    assert [v["outcome"] for v in verdicts] == ["inconclusive"]


def write_eval(run_dir, final_avg, step=4):
    from asyncrl.lab.offline.run_policies import SavedPolicy, eval_document, eval_entry

    entries = [eval_entry(SavedPolicy("checkpoints/step_2", 2, run_dir), {"avg@8": 0.0, "pass@8": 0.0}),
               eval_entry(SavedPolicy("final", step, run_dir), {"avg@8": final_avg, "pass@8": 1.0})]
    (run_dir / "eval.json").write_text(json.dumps(eval_document(run_dir, {"n": 8}, entries)))


def test_report_gives_each_arm_its_final_policys_avg_from_eval_json(tmp_path, runs):
    write_eval(runs["eta0"][0], 0.5)
    write_eval(runs["eta0"][1], 0.25)
    write_eval(runs["eta4"][0], 0.75)  # eta4-s1 was not evaluated
    arms = arms_from_dirs([d for ds in runs.values() for d in ds], group_seeds=True)
    analyse(arms, tmp_path / "out", AnalysisSpec(figures=["entropy/learner"], window=2), "t")
    text = (tmp_path / "out" / "report.md").read_text()
    header = "final policy avg@8 (eval.json)"
    assert f"| entropy/learner | {header} |" in text
    # eta0: mean of 0.5 and 0.25, sample sd sqrt(2 * 0.125^2) = 0.1768
    assert "| 0.375 ± 0.177 |" in text
    assert "| 0.75 (1/2 runs) |" in text
    cells = {a["arm"]: a["cells"][header] for a in json.loads((tmp_path / "out" / "report.json").read_text())["arms"]}
    assert cells == {"eta0": "0.375 ± 0.177", "eta4": "0.75 (1/2 runs)"}


def test_report_has_no_eval_column_without_eval_json(tmp_path, runs):
    arms = arms_from_dirs(runs["eta0"], group_seeds=True)
    analyse(arms, tmp_path / "out", AnalysisSpec(figures=["entropy/learner"], window=2), "t")
    assert "eval.json" not in (tmp_path / "out" / "report.md").read_text()


def test_a_smoothed_line_is_drawn_over_the_faint_seed_means(tmp_path, runs):
    arms = arms_from_dirs(runs["eta0"], group_seeds=True)
    analyse(arms, tmp_path, AnalysisSpec(figures=["reward/mean"], window=2), "t", smooth=1)
    sidecar = json.loads((tmp_path / "figures" / "reward_mean.json").read_text())
    assert sidecar["smoothing"] == {"kind": "centred mean", "half_width": 1}
    line = sidecar["panels"][0]["lines"][0]
    # seed means at steps 1, 3, 4: 0.2, 0.4, 0.5; centred over 1 point either side:
    # (0.2 + 0.4) / 2, (0.2 + 0.4 + 0.5) / 3, (0.4 + 0.5) / 2
    assert line["x"] == [1.0, 3.0, 4.0]
    assert line["y"] == pytest.approx([0.2, 0.4, 0.5], abs=1e-12)
    assert line["smoothed"] == pytest.approx([0.3, 1.1 / 3, 0.45], abs=1e-12)
    assert "centred mean over 3 points" in (tmp_path / "report.md").read_text()
    analyse(arms, tmp_path / "raw", AnalysisSpec(figures=["reward/mean"], window=2), "t", smooth=0)
    raw = json.loads((tmp_path / "raw" / "figures" / "reward_mean.json").read_text())
    assert raw["smoothing"] is None and "smoothed" not in raw["panels"][0]["lines"][0]


def add_evals(run_dir, evals):
    """Eval rows as a run writes them: in the row of the step where the evaluation completed, with
    eval/step the policy evaluated. evals: (row step, policy step, avg@4)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row_step, policy, avg in evals:
        rows[row_step - 1].update({"eval/step": policy, "eval/avg@4": avg, "eval/pass@4": min(1.0, 2 * avg),
                                   "eval/time_s": 3.0, "eval/num_prompts": 8})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_draws_an_environment_runs_tool_metrics_by_default(tmp_path, runs):
    from asyncrl.lab.analysis.analyse import plot_runs

    for d in runs["eta0"]:
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        for i, r in enumerate(rows):
            r.update({"episode/tool_calls_mean": 1.0 + 0.1 * i, "episode/turns_mean": 2.0})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_runs(runs["eta0"], tmp_path / "env", AnalysisSpec(window=2), group_seeds=True)
    sidecar = json.loads((tmp_path / "env" / "figures" / "episode_tool_calls_mean.json").read_text())
    assert sidecar["panels"][0]["lines"][0]["y"] == pytest.approx([1.0, 1.1, 1.2, 1.3], abs=1e-12)
    assert (tmp_path / "env" / "figures" / "episode_turns_mean.png").exists()
    plot_runs(runs["eta4"], tmp_path / "single", AnalysisSpec(window=2), group_seeds=True)
    assert not list((tmp_path / "single" / "figures").glob("episode_*"))  # single-turn runs: none


def test_plot_draws_the_held_out_eval_curves_by_default_at_the_policys_step(tmp_path, runs):
    from asyncrl.lab.analysis.analyse import plot_runs
    from asyncrl.lab.analysis.runs import series_of

    # seed 0's evaluation of the step-2 policy finished at step 3, seed 1's at step 4
    add_evals(runs["eta0"][0], [(1, 0, 0.25), (3, 2, 0.5)])
    add_evals(runs["eta0"][1], [(1, 0, 0.125), (4, 2, 0.75)])
    rows = [json.loads(x) for x in (runs["eta0"][0] / "metrics.jsonl").read_text().splitlines()]
    assert series_of(rows, "eval/avg@4").steps == (0.0, 2.0)
    report = plot_runs(runs["eta0"], tmp_path / "out", AnalysisSpec(window=2), group_seeds=True)
    figures = tmp_path / "out" / "figures"
    sidecar = json.loads((figures / "eval_avgat4.json").read_text())
    line = sidecar["panels"][0]["lines"][0]
    assert line["x"] == [0.0, 2.0]                                   # the policies' steps, seeds lined up
    assert line["y"] == pytest.approx([0.1875, 0.625], abs=1e-12)    # (0.25 + 0.125) / 2, (0.5 + 0.75) / 2
    assert sidecar["smoothing"] is None and "smoothed" not in line
    assert (figures / "eval_passat4.png").exists()
    assert not (figures / "eval_time_s.png").exists() and not (figures / "eval_step.png").exists()
    text = report.read_text()
    assert "| eval/avg@4 | eval/pass@4 |" in text
    # final of an eval curve is the last evaluation (0.625, per seed 0.5 and 0.75: sd 0.177), peak the best
    assert "| 0.625 ± 0.177 / 0.625 |" in text
    # --metrics given: only those
    plot_runs(runs["eta0"], tmp_path / "chosen", AnalysisSpec(figures=["reward/mean"]), True, with_eval=False)
    assert [p.name for p in (tmp_path / "chosen" / "figures").glob("*.png")] == ["reward_mean.png"]


def test_events_are_marked_where_the_run_logged_them(tmp_path, runs):
    run = runs["eta4"][0]
    events = [{"step": 0, "event": "start"}, {"step": 2, "event": "checkpoint"},
              {"step": 2, "event": "resume", "model": "x"}, {"step": 3, "event": "reference_reset", "kl": 0.2},
              {"step": 3, "event": "scale", "actors": 3}, {"step": 4, "event": "end", "status": "finished"}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (runs["eta4"][1] / "events.jsonl").write_text(
        json.dumps({"step": 3, "event": "reference_reset"}) + "\n" + json.dumps({"step": 4, "event": "end"}) + "\n")
    arms = arms_from_dirs([*runs["eta0"], *runs["eta4"]], group_seeds=True)
    analyse(arms, tmp_path / "out", AnalysisSpec(figures=["entropy/learner"]), "t")
    sidecar = json.loads((tmp_path / "out" / "figures" / "entropy_learner.json").read_text())
    colour = {line["label"]: line["color"] for line in sidecar["panels"][0]["lines"]}
    marks = [(m["arm"], m["event"], m["x"], m["runs"], m["color"]) for m in sidecar["panels"][0]["marks"]]
    # start, checkpoint and end are not marked; the reset both seeds logged at step 3 is one mark
    assert marks == [("eta4", "resume", 2.0, ["eta4-s0"], colour["eta4"]),
                     ("eta4", "reference_reset", 3.0, ["eta4-s0", "eta4-s1"], colour["eta4"]),
                     ("eta4", "scale", 3.0, ["eta4-s0"], colour["eta4"])]
    # against samples generated: at eta4-s0's rollout/samples_total of that step, 64 x step + 4
    analyse(arms, tmp_path / "x", AnalysisSpec(figures=["entropy/learner"], x_axis="rollout/samples_total"), "t")
    sidecar = json.loads((tmp_path / "x" / "figures" / "entropy_learner.json").read_text())
    assert [(m["event"], m["x"]) for m in sidecar["panels"][0]["marks"]] == [
        ("resume", 132.0), ("reference_reset", 196.0), ("scale", 196.0)]


def test_an_exploding_arm_gets_its_own_panel(tmp_path, runs):
    boom = make_run(tmp_path, "boom-s0", [1.0, 2.0, 3.0, 3.5], [0.1, 0.2, 0.3, 0.4], 8)
    arms = arms_from_dirs([*runs["eta0"], *runs["eta4"], boom], group_seeds=True)
    out = tmp_path / "out"
    analyse(arms, out, AnalysisSpec(figures=["entropy/learner", "reward/mean"]), "t", smooth=0)
    # entropy seed means: eta0 1.1 .. 0.8 (height 0.3), eta4 1 .. 0.15 (0.85), boom 1 .. 3.5 (2.5):
    # the reference is eta4, band [0.15, 1]; boom's 3.5 is 2.5 above it, not more than 3 x 0.85 = 2.55
    sidecar = check_metric_figure(out / "figures", "entropy/learner",
                                  {"eta0": runs["eta0"], "eta4": runs["eta4"], "boom": [boom]})
    assert sidecar["outliers"] == [] and len(sidecar["panels"]) == 1
    boom2 = make_run(tmp_path, "boom2-s0", [1.0, 4.0, 6.0, 9.0], [0.1, 0.2, 0.3, 0.4], 8)
    arms = arms_from_dirs([*runs["eta0"], *runs["eta4"], boom2], group_seeds=True)
    analyse(arms, out, AnalysisSpec(figures=["entropy/learner"]), "t", smooth=0)
    # boom2 reaches 9: 8 above eta4's band, more than 2.55
    sidecar = check_metric_figure(out / "figures", "entropy/learner",
                                  {"eta0": runs["eta0"], "eta4": runs["eta4"], "boom2": [boom2]})
    assert sidecar["outliers"] == ["boom2"]
    assert [(p["arms"], p["outliers"]) for p in sidecar["panels"]] == [(["eta0", "eta4"], False), (["boom2"], True)]
    assert sidecar["legend"] == ["eta0", "eta4", "boom2"]
    assert "second panel with its own y axis" in (out / "report.md").read_text()


def test_plot_runs_settings_are_what_differs_between_the_configs(tmp_path, runs):
    from asyncrl.lab.analysis.analyse import plot_runs

    report = plot_runs([d for ds in runs.values() for d in ds], tmp_path / "out",
                       AnalysisSpec(figures=["entropy/learner"], window=2), group_seeds=True)
    text = report.read_text()
    assert "| eta0 | buffer.max_staleness=0 | 2/2 finished |" in text
    assert "| eta4 | buffer.max_staleness=4 | 2/2 finished |" in text
    settings = {a["arm"]: a["settings"] for a in json.loads((tmp_path / "out" / "report.json").read_text())["arms"]}
    assert settings == {"eta0": "buffer.max_staleness=0", "eta4": "buffer.max_staleness=4"}


def test_report_gives_each_arms_share_of_steps_at_the_entropy_cap(tmp_path, runs):
    """entropy_control/saturated (1 while c sits at c_max): a run's mean, then mean ± sd over seeds;
    an arm without the controller gets no share."""
    for d, flags in zip(runs["eta0"], ([1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])):
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        for row, flag in zip(rows, flags):
            row["entropy_control/saturated"] = flag
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    arms = arms_from_dirs(runs["eta0"] + runs["eta4"], group_seeds=True)
    analyse(arms, tmp_path / "out", AnalysisSpec(figures=["entropy/learner"], window=2), "t")
    cells = {a["arm"]: a["cells"]["steps at the entropy cap"]
             for a in json.loads((tmp_path / "out" / "report.json").read_text())["arms"]}
    assert cells == {"eta0": "0.75 ± 0.354", "eta4": "–"}  # (0.5 + 1) / 2; sd sqrt(0.125)
    assert "fixed coefficient, not the controller" in (tmp_path / "out" / "report.md").read_text()


def test_a_one_seed_study_says_its_verdicts_cannot_be_decided(tmp_path, runs):
    study = StudyConfig.model_validate({
        "name": "s", "total_steps": 4, "arms": [{"name": "eta0"}, {"name": "eta4"}],
        "findings": [{"name": "staleness lowers entropy", "checks": [
            {"kind": "compare", "left": {"arm": "eta4", "stat": "final"}, "op": "lt",
             "right": {"arm": "eta0", "stat": "final"}}]}]})
    one_seed = arms_from_dirs([runs["eta0"][0], runs["eta4"][0]], group_seeds=True)
    analyse(one_seed, tmp_path / "one", AnalysisSpec(figures=["entropy/learner"], window=2), "t",
            findings=study.findings)
    text = (tmp_path / "one" / "report.md").read_text()
    assert "One seed an arm" in text and "**inconclusive**" in text
    two_seeds = arms_from_dirs(runs["eta0"] + runs["eta4"], group_seeds=True)
    analyse(two_seeds, tmp_path / "two", AnalysisSpec(figures=["entropy/learner"], window=2), "t",
            findings=study.findings)
    text = (tmp_path / "two" / "report.md").read_text()
    assert "One seed an arm" not in text and "Two seeds an arm: each 95% interval" in text
