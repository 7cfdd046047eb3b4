"""What an episode's own record says about its reward (rollout/episode.py writes
`metadata["episode"]`): the `episode` verifier, and the score of an episode whose environment failed."""

from __future__ import annotations

from typing import Any


def episode_reward(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The `episode` verifier: the sum of the rewards the environment's steps gave (0 if none did,
    e.g. an episode cut short by its token limit)."""
    record = metadata.get("episode")
    if not isinstance(record, dict):
        raise ValueError("reward.type episode scores episodes: set env.type (this sample has no episode record)")
    reward = record.get("reward")
    return (0.0, {"outcome": "no_reward"}) if reward is None else (float(reward), {"outcome": "episode"})


def env_failure(metadata: Any) -> dict[str, Any] | None:
    """The info of an episode that ended with an environment error (outcome env_error, scored 0
    whatever the verifier), else None."""
    record = metadata.get("episode") if isinstance(metadata, dict) else None
    if not isinstance(record, dict) or "error" not in record:
        return None
    return {"outcome": "env_error", "error": str(record["error"]), "traceback": record.get("traceback"),
            "verifier": str(record.get("env"))}
