"""What a verifier sees of an episode, and what the episode's record says about its reward.

A sample from a multi-turn episode carries a typed record (`Sample.episode`, types.EpisodeRecord).
Verifiers, the user's included, take `(response, metadata)`: `verifier_metadata` is the one place
that hands them the record, as plain values under `metadata["episode"]` (status, reward, turns,
tool_calls, tool_errors, spans, error). The `episode` verifier and the env_error rule below read it
there, in the reward worker.
"""

from __future__ import annotations

from typing import Any

from asyncrl.types import EpisodeRecord, EpisodeStatus


def verifier_metadata(metadata: dict[str, Any], episode: EpisodeRecord | None) -> dict[str, Any]:
    """The metadata a verifier is called with: the record's own, and the episode's record if any."""
    return metadata if episode is None else {**metadata, "episode": episode.to_dict()}


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
    if not isinstance(record, dict) or record.get("status") != EpisodeStatus.FAILED.value:
        return None
    return {"outcome": "env_error", "error": str(record.get("error")), "traceback": record.get("traceback"),
            "verifier": str(record.get("env"))}
