"""Checkpoint directories: written atomically, found again, checked against the config.

    runs/<name>/checkpoints/step_<N>/
        run_state.msgpack   the orchestrator's state: step, version, ledger (buffer contents with
                            split responses, groups to regenerate, counts), data cursor and RNG,
                            stage tracker, pass rates, online-filter exclusions, metrics history
        config.yaml         the resolved config the run had
        learner/policy/     the policy in Hugging Face format (loads in transformers and vLLM)
        learner/state/      Adam's moments and the reference policy, each learner rank's shards
        learner/learner.pt  optimizer step count, algorithm state, version, torch RNG
        COMPLETE            written last, with the step: a directory without it is not a checkpoint

A checkpoint is assembled in `.tmp_step_<N>/` and renamed into place once complete, so a crash
while writing leaves a temporary directory (removed by the next writer), never a half checkpoint
under a real name. Only the newest `keep` are kept. Nothing here knows Ray: the orchestrator has
the learner write its part into `learner/` of the temporary directory, then calls `commit`.

The storage contract: the run directory is one directory that the driver and every learner rank
see (the same machine, or storage every node mounts at the same path). The learner writes
its checkpoint part, `final/` and its logs there and the driver renames, prunes and resumes from
it, so a run checks at start that every rank reads a probe the driver wrote (`check_shared`, exit 2
with the requirement otherwise); `commit` refuses a checkpoint whose learner part is not there,
and `resume=auto` over checkpoints none of which is whole is an error, never a fresh start.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import yaml

from asyncrl.config import Config, ConfigError
from asyncrl.types import RunFailed

log = logging.getLogger(__name__)

STATE_FILE = "run_state.msgpack"
LEARNER_DIR = "learner"
PROBE_FILE, PROBE_ANSWER = ".storage-probe", ".storage-probe-answer"  # check_shared
# the learner's part of a checkpoint, written on the learner's node: the policy is a Hugging Face
# model (config.json) or a LoRA run's adapter (adapter_config.json)
LEARNER_FILES = (f"{LEARNER_DIR}/learner.pt", f"{LEARNER_DIR}/policy/config.json|adapter_config.json")


def _missing(root: Path, needs) -> list[str]:
    """The files of `needs` that `root` lacks; `dir/a|b` is there when either is."""
    missing = []
    for need in needs:
        folder, _, names = need.rpartition("/")
        if not any((root / folder / name).is_file() for name in names.split("|")):
            missing.append(need)
    return missing

# Fields a resumed run must share with the checkpoint: the weights, the buffer's layout and the
# data cursor would otherwise mean something else. Everything else (lr, total_steps, actors,
# logging...) may change on resume.
MUST_MATCH = ("model.path", "model.dtype", "data.type", "data.path", "buffer.rollout_batch_prompts",
              "buffer.minibatch_prompts", "buffer.num_reuse", "algo.kl.needs_reference", "stages.length")


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def begin(run_dir: Path, step: int, state: dict[str, Any], cfg: Config) -> Path:
    """A fresh temporary directory for step `step`'s checkpoint, with the orchestrator's state and
    config written; the learner writes into `<returned>/learner` next."""
    tmp = checkpoints_dir(run_dir) / f".tmp_step_{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / STATE_FILE).write_bytes(msgpack.packb(state, use_bin_type=True))
    (tmp / "config.yaml").write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    return tmp


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """`state` as a checkpoint would hold it, detached from the live objects it was read from."""
    return msgpack.unpackb(msgpack.packb(state, use_bin_type=True), raw=False, strict_map_key=False)


def check_shared(run_dir: Path, answer: Callable[[str, str, str], list[str]]) -> None:
    """ConfigError unless every learner rank sees this run directory: the driver writes a probe,
    and `answer(probe, answer_prefix, token)` (every rank's, returning their node addresses in rank
    order) must read it and write the token to `<answer_prefix>.<rank>`, which the driver must then
    read. Rank 0 writes the policy files and `learner.pt`; every rank writes its shards of the
    optimizer state and the reference (`learner/state/`)."""
    token = os.urandom(8).hex()
    probe, reply = run_dir / PROBE_FILE, run_dir / PROBE_ANSWER
    run_dir.mkdir(parents=True, exist_ok=True)
    probe.write_text(token)
    try:
        nodes = answer(str(probe), str(reply), token)
        seen = [Path(f"{reply}.{rank}") for rank in range(len(nodes))]
        blind = [(rank, node) for rank, (node, path) in enumerate(zip(nodes, seen))
                 if not (path.is_file() and path.read_text() == token)]
    finally:
        probe.unlink(missing_ok=True)
        for path in run_dir.glob(f"{PROBE_ANSWER}.*"):
            path.unlink(missing_ok=True)
    if blind:
        who = ", ".join(f"rank {rank} ({node})" for rank, node in blind)
        raise ConfigError(f"the run directory {run_dir} is not shared with the node of learner {who}: the "
                          "learner ranks write checkpoints, final/ and logs there and the driver must see them, or "
                          "resume would silently lose the run. Put observe.output_dir on storage every node mounts "
                          "at the same path (NFS, a shared volume), or run the learner on the driver's node "
                          "(learner.resources)")


def commit(tmp: Path, step: int, keep: int) -> Path:
    """Mark the checkpoint complete, move it into place, delete all but the newest `keep`.
    A learner part the driver cannot see (another node's disk) is an error, not a COMPLETE mark."""
    missing = _missing(tmp, LEARNER_FILES)
    if missing:
        raise RunFailed(f"checkpoint of step {step}: the learner reported its part written but {tmp} has no "
                           f"{', '.join(missing)}: the run directory is not shared with the learner's node")
    (tmp / "COMPLETE").write_text(json.dumps({"step": step}))
    final = tmp.parent / f"step_{step}"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_complete(tmp.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in tmp.parent.glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_complete(ckpt_dir: Path) -> list[Path]:
    """Checkpoint directories that carry a COMPLETE marker, oldest first."""
    found = []
    for d in ckpt_dir.glob("step_*") if ckpt_dir.is_dir() else []:
        if d.name[5:].isdecimal() and (d / "COMPLETE").is_file():
            found.append(d)
    return sorted(found, key=lambda d: int(d.name[5:]))


def validate(path: Path) -> dict[str, Any]:
    """The checkpoint's run state; raises ValueError saying what is missing or unreadable."""
    if not (path / "COMPLETE").is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    for need in _missing(path, (STATE_FILE, "config.yaml", *LEARNER_FILES)):
        raise ValueError(f"{path} is missing {need}")
    try:
        state = msgpack.unpackb((path / STATE_FILE).read_bytes(), raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for corrupt data
        raise ValueError(f"{path}/{STATE_FILE} is corrupt: {e}") from e
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path}/{STATE_FILE} holds no run state")
    return state


def find_resumable(run_dir: Path, warn: Callable[[str], None] = log.warning) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of the run that validates, skipping (with a warning) any that does not."""
    for path in reversed(list_complete(checkpoints_dir(run_dir))):
        try:
            return path, validate(path)
        except ValueError as e:
            warn(f"skipping checkpoint: {e}")
    return None


def _field(cfg: dict[str, Any], dotted: str) -> Any:
    if dotted == "algo.kl.needs_reference":
        kl = cfg["algo"]["kl"]
        return kl["coef"] > 0 or kl["track"]
    if dotted == "stages.length":
        return len(cfg.get("stages") or [])
    value: Any = cfg
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def check_compatible(path: Path, cfg: Config) -> None:
    """ConfigError naming the first field that differs where a resumed run cannot allow it."""
    saved = yaml.safe_load((path / "config.yaml").read_text())
    now = json.loads(cfg.model_dump_json())
    for name in MUST_MATCH:
        if _field(saved, name) != _field(now, name):
            raise ConfigError(f"resume from {path}: {name} was {_field(saved, name)!r} in the checkpoint and is "
                              f"{_field(now, name)!r} now; a resumed run cannot change it (start a new run name)")
