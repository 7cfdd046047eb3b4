"""Which policies a run directory holds and eval.json's assembly (asyncrl/lab/offline/run_policies.py)."""

import json

from pathlib import Path

from asyncrl.lab.offline.run_policies import (
    SavedPolicy, eval_document, eval_entry, figures_table, final_figure, final_step, reusable, run_policies)


def make_run(tmp_path, steps=(50, 100, 120), complete=(50, 100, 120), final=True, end_step=120):
    run = tmp_path / "run"
    for s in steps:
        policy = run / "checkpoints" / f"step_{s}" / "learner" / "policy"
        policy.mkdir(parents=True)
        (policy / "config.json").write_text("{}")
        if s in complete:
            (run / "checkpoints" / f"step_{s}" / "COMPLETE").write_text(json.dumps({"step": s}))
    (run / "checkpoints" / ".tmp_step_130").mkdir()
    if final:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    if end_step is not None:
        (run / "events.jsonl").write_text(
            json.dumps({"step": 0, "event": "start"}) + "\n"
            + json.dumps({"step": end_step, "event": "end", "status": "finished"}) + "\n{\"half")
    return run


def test_checkpoints_oldest_first_final_last_and_the_last_checkpoint_not_twice(tmp_path):
    run = make_run(tmp_path, complete=(50, 120))     # step_100 was being written: not a checkpoint
    got = [(p.name, p.step) for p in run_policies(run)]
    assert got == [("checkpoints/step_50", 50), ("final", 120)]  # step_120 holds final/'s weights
    assert run_policies(run)[0].path == run / "checkpoints" / "step_50" / "learner" / "policy"
    assert [(p.name, p.step) for p in run_policies(run, final_only=True)] == [("final", 120)]


def test_a_run_without_final_gives_its_checkpoints_and_final_step_falls_back_to_the_summary(tmp_path):
    run = make_run(tmp_path, final=False, end_step=None)
    assert [p.step for p in run_policies(run)] == [50, 100, 120]
    assert run_policies(run, final_only=True) == []
    assert final_step(run) is None
    (run / "summary.json").write_text(json.dumps({"steps": 120}))
    assert final_step(run) == 120


def figures(avg):
    return {"avg@4": avg, "pass@1": avg, "pass@4": min(1.0, 2 * avg), "num_prompts": 3, "num_incomplete": 0,
            "mean_response_tokens": 5.0, "by_source": {"x": {"avg@4": avg}}, "outcomes": {"correct": 1}}


def test_eval_document_orders_entries_keeps_old_ones_and_only_the_newest_final(tmp_path):
    settings = {"n": 4, "ks": [1, 4]}
    old = eval_document("r", settings, [eval_entry(SavedPolicy("final", 100, tmp_path), figures(0.5)),
                                        eval_entry(SavedPolicy("checkpoints/step_50", 50, tmp_path), figures(0.25))])
    assert old["policies"][0] == {"policy": "checkpoints/step_50", "step": 50, "avg@4": 0.25, "pass@1": 0.25,
                                  "pass@4": 0.5, "num_prompts": 3, "mean_response_tokens": 5.0,
                                  "by_source": {"x": {"avg@4": 0.25}}}
    kept = reusable(old, settings)
    assert set(kept) == {("final", 100), ("checkpoints/step_50", 50)}
    assert reusable(old, {"n": 8, "ks": [1, 8]}) == {}        # other settings: nothing is comparable
    new = [eval_entry(SavedPolicy("checkpoints/step_100", 100, tmp_path), figures(0.5)),
           eval_entry(SavedPolicy("final", 150, tmp_path), figures(0.75))]
    doc = eval_document("r", settings, new, kept)
    assert [(e["policy"], e["step"]) for e in doc["policies"]] == [
        ("checkpoints/step_50", 50), ("checkpoints/step_100", 100), ("final", 150)]
    assert final_figure(doc) == ("avg@4", 0.75)
    assert final_figure(doc, "pass@4") == ("pass@4", 1.0)
    assert final_figure(None) is None
    table = figures_table(doc["policies"]).splitlines()
    assert table[0].split() == ["policy", "step", "avg@4", "pass@1", "pass@4"]
    assert table[3].split() == ["final", "150", "0.750", "0.750", "1.000"]


def test_the_policy_the_run_started_from_comes_first_as_step_0(tmp_path):
    run = make_run(tmp_path, complete=(50, 120))
    (run / "config.yaml").write_text("name: r\nmodel:\n  path: builtin:tiny\n  max_model_len: 256\n")
    got = [(p.name, p.step, p.path) for p in run_policies(run)]
    assert got == [("start", 0, Path("builtin:tiny")),
                   ("checkpoints/step_50", 50, run / "checkpoints" / "step_50" / "learner" / "policy"),
                   ("final", 120, run / "final")]
    assert [p.name for p in run_policies(run, final_only=True)] == ["final"]  # the final policy alone
    # a run that saved nothing has nothing to compare its start with
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text("model:\n  path: Qwen/Qwen2.5-0.5B\n")
    assert run_policies(empty) == []
    # eval.json: the start's entry first
    doc = eval_document(run, {}, [eval_entry(p, figures(0.5)) for p in reversed(run_policies(run))])
    assert [(e["policy"], e["step"]) for e in doc["policies"]] == [
        ("start", 0), ("checkpoints/step_50", 50), ("final", 120)]


def test_the_start_is_evaluated_from_its_models_directory_or_left_out_when_it_is_not_here(tmp_path, capsys):
    from asyncrl.config import load_config
    from asyncrl.lab.offline.evaluate import locate_start

    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_config(None)
    final = SavedPolicy("final", 2, tmp_path / "final")
    assert locate_start(cfg, [SavedPolicy("start", 0, model), final]) == [SavedPolicy("start", 0, model), final]
    # a hub id that is not in the local cache: the others are still evaluated, and the reason said
    assert locate_start(cfg, [SavedPolicy("start", 0, Path("no-such-org/no-such-model")), final]) == [final]
    assert "the run's start is not evaluated" in capsys.readouterr().err
