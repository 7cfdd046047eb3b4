"""msgpack encoding of the records that cross process boundaries on the hot path.

No pickle: a frame is a msgpack map of scalars, strings and packed little-endian arrays
(token ids as int32, logprobs as float32, versions as int32). Decoding validates the frame and
raises `FrameError` for anything that is not a well-formed record, so a receiver can drop and
count it instead of crashing the run.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import msgpack

from asyncrl.types import BATCH_ROLES, Batch, ResponseSpan, Sample, SequenceChunk

FORMAT_VERSION = 1
# Packed arrays go through the stdlib's `array` (a C loop, a quarter to half of numpy's
# per-call cost on arrays this short), as little-endian 4-byte values.
_TYPECODES = {"<i4": "i", "<f4": "f"}
assert all(array(code).itemsize == 4 for code in _TYPECODES.values())
_SWAP = sys.byteorder != "little"


class FrameError(ValueError):
    """A frame that does not decode to a valid record."""


def _pack(values: list, dtype: str) -> bytes:
    packed = array(_TYPECODES[dtype], values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _unpack(raw: Any, dtype: str, field: str) -> list:
    if not isinstance(raw, bytes):
        raise FrameError(f"field {field!r} must be packed bytes, got {type(raw).__name__}")
    if len(raw) % 4:
        raise FrameError(f"field {field!r}: {len(raw)} bytes is not a whole number of {dtype}")
    values = array(_TYPECODES[dtype])
    values.frombytes(raw)
    if _SWAP:
        values.byteswap()
    return values.tolist()


def encode_sample(s: Sample) -> bytes:
    scored = {} if s.reward is None else {  # only an actor that scores its own samples sends these
        "reward": float(s.reward), "reward_info": s.reward_info, "reward_latency_s": float(s.reward_latency_s)}
    return msgpack.packb(
        {
            **scored,
            "v": FORMAT_VERSION,
            "kind": "sample",
            "prompt_id": s.prompt_id,
            "group_id": s.group_id,
            "sample_index": s.sample_index,
            "prompt_ids": _pack(s.prompt_ids, "<i4"),
            "response_ids": _pack(s.response_ids, "<i4"),
            "logprobs": _pack(s.logprobs, "<f4"),
            "versions": _pack(s.versions, "<i4"),
            "finish_reason": s.finish_reason,
            "actor_id": s.actor_id,
            "metadata": s.metadata,
            "temperature": float(s.temperature),
        },
        use_bin_type=True,
    )


def _load_map(frame: bytes, kind: str) -> dict:
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise FrameError(f"not a msgpack frame: {e}") from e
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        raise FrameError(f"expected a {kind!r} map")
    if obj.get("v") != FORMAT_VERSION:
        raise FrameError(f"format version {obj.get('v')!r}, expected {FORMAT_VERSION}")
    return obj


def _typed(obj: dict, name: str, typ: type | tuple[type, ...]) -> Any:
    value = obj.get(name)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise FrameError(f"field {name!r} missing or not {typ}")
    return value


def decode_sample(frame: bytes) -> Sample:
    obj = _load_map(frame, "sample")
    try:
        sample = Sample(
            prompt_id=_typed(obj, "prompt_id", str),
            group_id=_typed(obj, "group_id", str),
            sample_index=_typed(obj, "sample_index", int),
            prompt_ids=_unpack(obj.get("prompt_ids"), "<i4", "prompt_ids"),
            response_ids=_unpack(obj.get("response_ids"), "<i4", "response_ids"),
            logprobs=_unpack(obj.get("logprobs"), "<f4", "logprobs"),
            versions=_unpack(obj.get("versions"), "<i4", "versions"),
            finish_reason=_typed(obj, "finish_reason", str),
            actor_id=_typed(obj, "actor_id", int),
            metadata=_typed(obj, "metadata", dict),
            temperature=_typed(obj, "temperature", float),
        )
        if "reward" in obj:
            sample.reward = _typed(obj, "reward", float)
            sample.reward_info = _typed(obj, "reward_info", dict)
            sample.reward_latency_s = _typed(obj, "reward_latency_s", float)
        if not sample.temperature > 0:
            raise ValueError(f"temperature {sample.temperature} is not positive")
        sample.validate()
    except ValueError as e:
        raise FrameError(str(e)) from e
    return sample


def encode_batch(b: Batch) -> bytes:
    layout = b.opened_layout
    return msgpack.packb(
        {
            "v": FORMAT_VERSION,
            "kind": "batch",
            "step": b.step,
            "rank": b.rank,
            "num_loss_tokens_global": b.num_loss_tokens_global,
            "num_sequences_global": b.num_sequences_global,
            "token_budget": b.token_budget,
            "chunks": [_encode_chunk(c) for c in b.chunks],
            "role": b.role,
            "opened": [_encode_chunk(c) for c in b.opened],
            "layout_groups": [s.group_id for s in layout],
            "layout_spans": _pack([v for s in layout for v in (s.sample_index, s.loss_start, s.num_tokens)], "<i4"),
            "opened_offset": b.opened_offset,
        },
        use_bin_type=True,
    )


def _encode_chunk(c: SequenceChunk) -> dict:
    return {
        "group_id": c.group_id,
        "sample_index": c.sample_index,
        "prompt_ids": _pack(c.prompt_ids, "<i4"),
        "response_ids": _pack(c.response_ids, "<i4"),
        "loss_start": c.loss_start,
        "old_logprobs": _pack(c.old_logprobs, "<f4"),
        "versions": _pack(c.versions, "<i4"),
        "advantage": float(c.advantage),
        "temperature": float(c.temperature),
    }


def _decode_chunks(obj: dict, name: str) -> list[SequenceChunk]:
    chunks = []
    for i, c in enumerate(_typed(obj, name, list)):
        if not isinstance(c, dict):
            raise FrameError(f"{name} {i} is not a map")
        chunk = SequenceChunk(
            group_id=_typed(c, "group_id", str),
            sample_index=_typed(c, "sample_index", int),
            prompt_ids=_unpack(c.get("prompt_ids"), "<i4", "prompt_ids"),
            response_ids=_unpack(c.get("response_ids"), "<i4", "response_ids"),
            loss_start=_typed(c, "loss_start", int),
            old_logprobs=_unpack(c.get("old_logprobs"), "<f4", "old_logprobs"),
            versions=_unpack(c.get("versions"), "<i4", "versions"),
            advantage=_typed(c, "advantage", float),
            temperature=_typed(c, "temperature", float),
        )
        if len(chunk.old_logprobs) != chunk.num_loss_tokens or len(chunk.versions) != chunk.num_loss_tokens:
            raise FrameError(f"{name} {i}: loss token fields disagree in length")
        chunks.append(chunk)
    return chunks


def decode_batch(frame: bytes) -> Batch:
    obj = _load_map(frame, "batch")
    role = _typed(obj, "role", str)
    if role not in BATCH_ROLES:
        raise FrameError(f"role {role!r} not in {BATCH_ROLES}")
    groups = _typed(obj, "layout_groups", list)
    spans = _unpack(obj.get("layout_spans"), "<i4", "layout_spans")
    if len(spans) != 3 * len(groups) or not all(isinstance(g, str) for g in groups):
        raise FrameError("layout_groups and layout_spans disagree")
    return Batch(
        step=_typed(obj, "step", int),
        rank=_typed(obj, "rank", int),
        chunks=_decode_chunks(obj, "chunks"),
        num_loss_tokens_global=_typed(obj, "num_loss_tokens_global", int),
        num_sequences_global=_typed(obj, "num_sequences_global", int),
        token_budget=_typed(obj, "token_budget", int),
        role=role,
        opened=_decode_chunks(obj, "opened"),
        opened_layout=[ResponseSpan(g, *spans[3 * i:3 * i + 3]) for i, g in enumerate(groups)],
        opened_offset=_typed(obj, "opened_offset", int),
    )
