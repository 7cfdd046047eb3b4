"""Checkpoint directories: atomic commit, keep-newest-N, corrupt ones skipped, and the config
fields a resume may not change."""

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.orchestrator import checkpoint


def write(run_dir, step, cfg, keep=2):
    tmp = checkpoint.begin(run_dir, step, {"step": step, "version": step}, cfg)
    (tmp / "learner" / "policy").mkdir(parents=True)
    (tmp / "learner" / "policy" / "config.json").write_text("{}")
    (tmp / "learner" / "learner.pt").write_bytes(b"x")
    return checkpoint.commit(tmp, step, keep)


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path):
    cfg = load_config(None, [])
    for step in (10, 20, 30):
        write(tmp_path, step, cfg)
    found = checkpoint.list_complete(checkpoint.checkpoints_dir(tmp_path))
    assert [p.name for p in found] == ["step_20", "step_30"]
    assert not list(checkpoint.checkpoints_dir(tmp_path).glob(".tmp_*"))


def test_a_partial_or_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path):
    cfg = load_config(None, [])
    write(tmp_path, 10, cfg, keep=5)
    newest = write(tmp_path, 20, cfg, keep=5)
    (newest / checkpoint.STATE_FILE).write_bytes(b"\xc1 not msgpack")
    # a crash while writing step 30: only its temporary directory exists
    checkpoint.begin(tmp_path, 30, {"step": 30}, cfg)
    warnings = []
    path, state = checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert path.name == "step_10" and state["step"] == 10
    assert len(warnings) == 1 and "corrupt" in warnings[0]


def test_missing_learner_files_make_a_checkpoint_invalid(tmp_path):
    path = write(tmp_path, 5, load_config(None, []))
    (path / "learner" / "learner.pt").unlink()
    with pytest.raises(ValueError, match="learner.pt"):
        checkpoint.validate(path)
    assert checkpoint.find_resumable(tmp_path, warn=lambda m: None) is None


def test_resume_refuses_a_different_model_but_allows_a_longer_run(tmp_path):
    path = write(tmp_path, 5, load_config(None, []))
    checkpoint.check_compatible(path, load_config(None, ["total_steps=900", "learner.lr=1e-4"]))
    with pytest.raises(ConfigError, match="model.path"):
        checkpoint.check_compatible(path, load_config(None, ["model.path=/elsewhere/model"]))
    with pytest.raises(ConfigError, match="algo.kl.needs_reference"):
        checkpoint.check_compatible(path, load_config(None, ["algo.kl.coef=0.001"]))


def test_a_checkpoint_whose_learner_part_the_driver_cannot_see_is_never_complete(tmp_path):
    """The learner said it wrote its part, but it went to its own node's disk: no COMPLETE mark."""
    cfg = load_config(None, [])
    tmp = checkpoint.begin(tmp_path, 7, {"step": 7, "version": 7}, cfg)
    from asyncrl.types import RunFailed

    with pytest.raises(RunFailed, match="has no learner/learner.pt, learner/policy/config.json|adapter_config.json: the run directory "
                                           "is not shared with the learner's node"):
        checkpoint.commit(tmp, 7, keep=2)
    assert checkpoint.list_complete(checkpoint.checkpoints_dir(tmp_path)) == []


def test_resume_auto_over_only_broken_checkpoints_is_an_error_not_a_fresh_start(tmp_path):
    from asyncrl.orchestrator.checkpointer import Checkpointer

    cfg = load_config(None, ["resume=auto"])
    path = write(tmp_path, 5, cfg)
    (path / "learner" / "learner.pt").unlink()  # what a learner on a private disk leaves
    said = []
    with pytest.raises(ConfigError, match="resume=auto: none of the 1 checkpoint\\(s\\) in .* can be resumed "
                                          "\\(newest: .*learner.pt"):
        Checkpointer(cfg, tmp_path, say=said.append).find_resume()
    # with no checkpoint at all, resume=auto starts fresh (and says so)
    assert Checkpointer(cfg, tmp_path / "empty", say=said.append).find_resume() is None
    assert said[-1].startswith("resume=auto: no checkpoint in")


def test_the_storage_probe_passes_when_every_rank_sees_the_run_directory_and_names_those_that_do_not(tmp_path):
    from pathlib import Path

    def ranks(sees):  # learner ranks on the driver's filesystem (True) or a node with its own disk
        def answer(probe, prefix, token):
            for rank, shared in enumerate(sees):
                if shared and Path(probe).read_text() == token:
                    Path(f"{prefix}.{rank}").write_text(token)
            return [f"10.0.0.{7 + rank}" for rank in range(len(sees))]
        return answer

    checkpoint.check_shared(tmp_path / "run", ranks([True, True]))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # the probe files are gone
    with pytest.raises(ConfigError, match=f"the run directory {tmp_path / 'run'} is not shared with the node of "
                                          "learner rank 0 \\(10.0.0.7\\): .* Put observe.output_dir on storage"):
        checkpoint.check_shared(tmp_path / "run", ranks([False]))
    # rank 1 alone on another node: rank 0 writes the policy, but rank 1's optimizer shards would be lost
    with pytest.raises(ConfigError, match="learner rank 1 \\(10.0.0.8\\):"):
        checkpoint.check_shared(tmp_path / "run", ranks([True, False]))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []