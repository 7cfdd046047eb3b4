"""msgpack encoding of the records that cross process boundaries on the hot path.

No pickle: a frame is a msgpack map of a few scalars and columns. A frame carries a list of
records (the samples an actor finished at once, or a learner rank's chunks of one step) column by
column: each scalar field of the records is one entry, a msgpack list with a value per record;
each token column (ids and versions as int32, logprobs as float32, as the engine computes them)
is one byte string, the records' values packed little-endian and concatenated, cut by the
records' lengths (a `*_lengths` column). Decoding a frame costs a few calls per column and a
slice per record, never a Python object per token: the records come out holding `array`s
(types.IntSeq), so the driver's one thread, which decodes every sample of every actor
(tools/bench_orchestrator.py, tools/twin_driver_scale.py measure it), and its buffer, which holds
every untrained token, pay bytes for tokens, not objects.

Decoding validates the whole frame and raises `FrameError` for anything that is not a well-formed
list of records, so a receiver can drop and count it instead of crashing the run.
"""

from __future__ import annotations

import math
import sys
from array import array
from dataclasses import fields
from itertools import accumulate
from operator import attrgetter
from typing import Any

import msgpack

from asyncrl.types import BATCH_ROLES, FINISH_REASONS, Batch, EpisodeRecord, ResponseSpan, Sample, SequenceChunk

FORMAT_VERSION = 6  # 4: loss masks (multi-turn episodes); 5: episode records; 6: routed experts
_SWAP = sys.byteorder != "little"
INT, FLOAT = "i", "f"  # int32 and float32
assert array(INT).itemsize == 4 and array(FLOAT).itemsize == 4, "this platform's C int or float is not 32 bits"


class FrameError(ValueError):
    """A frame that does not decode to a valid list of records."""


# -- columns -----------------------------------------------------------------------------------

def _pack(seqs: list, typecode: str) -> bytes:
    """Sequences of int32 or float32 values, concatenated (their lengths travel in another column).
    An array of the right type is copied as it is, so re-encoding decoded records is a copy."""
    packed = array(typecode)
    for seq in seqs:
        packed += seq if isinstance(seq, array) and seq.typecode == typecode else array(typecode, seq)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _unpack(obj: dict, name: str, typecode: str, lengths: list[int]) -> list[array]:
    raw = obj.get(name)
    if not isinstance(raw, bytes) or len(raw) != 4 * sum(lengths):
        raise FrameError(f"field {name!r} must be {sum(lengths)} packed 32-bit values")
    values = array(typecode)
    values.frombytes(raw)
    if _SWAP:
        values.byteswap()
    ends = list(accumulate(lengths))
    return [values[a:b] for a, b in zip([0, *ends], ends)]


def _column(obj: dict, name: str, typ: type, count: int | None) -> list:
    """A msgpack list of `count` values (None: any number) of type `typ` (exactly: no bools as ints)."""
    values = obj.get(name)
    if not isinstance(values, list) or count is not None and len(values) != count:
        raise FrameError(f"field {name!r} must be a list of {'' if count is None else count} values")
    if not set(map(type, values)) <= {typ}:
        raise FrameError(f"field {name!r}: every value must be {typ.__name__}")
    return values


def _lengths(obj: dict, name: str, count: int) -> list[int]:
    values = _column(obj, name, int, count)
    if values and min(values) < 0:
        raise FrameError(f"field {name!r}: a negative length")
    return values


def _int_seqs(obj: dict, name: str, count: int) -> list[list[int]]:
    """A list of `count` msgpack lists of ints (a batch's layout spans)."""
    seqs = _column(obj, name, list, count)
    if not all(set(map(type, seq)) <= {int} for seq in seqs):
        raise FrameError(f"field {name!r}: every value must be an int")
    return seqs


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


def _count(obj: dict) -> int:
    count = _typed(obj, "count", int)
    if count < 0:
        raise FrameError(f"negative record count {count}")
    return count


# -- samples: rollout actor -> orchestrator ----------------------------------------------------

# How each field of `Sample` travels, by its annotation: the columns are derived from
# `dataclasses.fields(Sample)`, so a new field is one edit (in types.py); an annotation without a
# column kind here fails at import. A token column ("IntSeq", "FloatSeq") is packed, cut by the
# prompt's lengths (prompt_ids) or the response's (the rest).
EPISODE = "episode"  # a list of maps (EpisodeRecord.to_dict), nil for a sample that is no episode
_KINDS = {"str": str, "int": int, "float": float, "float | None": float, "dict[str, Any]": dict, "bytes": bytes,
          "IntSeq": INT, "FloatSeq": FLOAT, "EpisodeRecord | None": EPISODE}
DRIVER_ONLY = ("teacher_logprobs",)
"""Sample fields the driver sets after a sample arrived (on-policy distillation's teacher
logprobs): never in an actor's frame, so they are Sample's last fields and decode as defaults."""
SAMPLE_COLUMNS: list[tuple[str, Any]] = [(f.name, _KINDS[f.type]) for f in fields(Sample) if f.name not in DRIVER_ONLY]
assert [f.name for f in fields(Sample)][-len(DRIVER_ONLY):] == list(DRIVER_ONLY), "driver-only fields come last"
ACTOR_SCORED = ("reward", "reward_info", "reward_latency_s")
"""Columns only a frame of samples scored by their actor carries (reward.placement: actor)."""
MASKED = ("loss_mask",)
"""Columns only a frame holding an episode with observation tokens carries (with `mask_lengths`):
a single-turn frame decodes exactly as before masks existed, at the same cost."""
EPISODIC = ("episode",)
"""Columns only a frame holding an episode carries."""
ROUTED = ("routed_experts",)
"""Columns only a frame of a MoE engine recording its routing carries (algo.moe.routing: replay)."""
_FRAME_COLUMNS = {(scored, masked, episodic, routed): [
    (n, k) for n, k in SAMPLE_COLUMNS
    if (scored or n not in ACTOR_SCORED) and (masked or n not in MASKED) and (episodic or n not in EPISODIC)
    and (routed or n not in ROUTED)]
    for scored in (False, True) for masked in (False, True) for episodic in (False, True) for routed in (False, True)}
# a frame whose columns are not the first of Sample's fills the ones it left out with their defaults
_FILLS = {key: [n for n, _ in cols] != [n for n, _ in SAMPLE_COLUMNS[:len(cols)]]
          for key, cols in _FRAME_COLUMNS.items()}
_TOKEN_KINDS = (INT, FLOAT)


_LENGTHS = {"prompt_ids": "prompt_lengths", "loss_mask": "mask_lengths"}  # the rest: response_lengths


def _check_masks(masks: list[array], response_lengths: list[int], what: str) -> None:
    """A loss mask is empty (every token is the model's) or one 0/1 per response token."""
    for mask, n in zip(masks, response_lengths):
        if mask and (len(mask) != n or not set(mask) <= {0, 1}):
            raise FrameError(f"{what}: a loss_mask is not {n} zeros and ones")


def encode_samples(samples: list[Sample]) -> bytes:
    """One frame of samples (an actor sends what finished together). Samples scored by their
    actor (reward.placement: actor) carry their reward; a frame's samples are all scored or none."""
    for s in samples:  # a bad record is the sender's bug: it raises there, not at the driver
        s.validate()
    scored = {s.reward is not None for s in samples}
    if len(scored) > 1:
        raise ValueError("a frame's samples must be all scored by their actor or none")
    masked, episodic = any(s.loss_mask for s in samples), any(s.episode is not None for s in samples)
    routed = any(s.routed_experts for s in samples)
    frame: dict[str, Any] = {"v": FORMAT_VERSION, "kind": "samples", "count": len(samples),
                             "prompt_lengths": [len(s.prompt_ids) for s in samples],
                             "response_lengths": [len(s.response_ids) for s in samples]}
    if masked:
        frame["mask_lengths"] = [len(s.loss_mask) for s in samples]
    for name, kind in _FRAME_COLUMNS[scored == {True}, masked, episodic, routed]:
        values = list(map(attrgetter(name), samples))
        frame[name] = (_pack(values, kind) if kind in _TOKEN_KINDS else [float(v) for v in values] if kind is float
                       else [None if e is None else e.to_dict() for e in values] if kind is EPISODE else values)
    return msgpack.packb(frame, use_bin_type=True)


def decode_samples(frame: bytes) -> list[Sample]:
    """The samples of one frame, validated as a whole: any bad record rejects the frame."""
    obj = _load_map(frame, "samples")
    k = _count(obj)
    scored, masked, episodic, routed = "reward" in obj, "loss_mask" in obj, "episode" in obj, "routed_experts" in obj
    lengths = {"prompt_lengths": _lengths(obj, "prompt_lengths", k), "response_lengths": _lengths(obj, "response_lengths", k)}
    if masked:
        lengths["mask_lengths"] = _lengths(obj, "mask_lengths", k)
    col = {name: _unpack(obj, name, kind, lengths[_LENGTHS.get(name, "response_lengths")]) if kind in _TOKEN_KINDS
           else _episodes(obj, k) if kind is EPISODE else _column(obj, name, kind, k)
           for name, kind in _FRAME_COLUMNS[scored, masked, episodic, routed]}
    if not all(lengths["prompt_lengths"]):
        raise FrameError("a sample has an empty prompt")
    if k and min(col["sample_index"]) < 0:
        raise FrameError("a sample has a negative sample_index")
    if masked:
        _check_masks(col["loss_mask"], lengths["response_lengths"], "a sample")
    if not set(col["finish_reason"]) <= set(FINISH_REASONS):
        bad = sorted(set(col["finish_reason"]) - set(FINISH_REASONS))
        raise FrameError(f"finish_reason {bad} not in {FINISH_REASONS}")
    if not all(t > 0 for t in col["temperature"]):
        raise FrameError("a sample's temperature is not positive")
    if "reward" in col and not all(map(math.isfinite, col["reward"])):
        raise FrameError("a sample's reward is not finite")
    if routed:
        _check_routes(col["routed_experts"], lengths["prompt_lengths"], lengths["response_lengths"], "a sample")
    if _FILLS[scored, masked, episodic, routed]:  # a column left out sits before one carried: their defaults
        col = {name: col[name] if name in col else _default(name, k) for name, _ in SAMPLE_COLUMNS}
    return [Sample(*values) for values in zip(*col.values())]


def _default(name: str, k: int) -> list:
    """A column a frame left out (not scored by the actor, no mask, no episode), as Sample's defaults."""
    if name in ("reward_info", "loss_mask"):
        return [{} if name == "reward_info" else [] for _ in range(k)]
    if name == "routed_experts":
        return [b""] * k
    return [0.0 if name == "reward_latency_s" else None] * k


def _check_routes(routes: list[bytes], prompt_lengths: list[int], lengths: list[int], what: str) -> None:
    """Routing is empty or a whole row (layers x top-k bytes) for each position fed."""
    for r, p, n in zip(routes, prompt_lengths, lengths):
        if len(r) % (p + n):
            raise FrameError(f"{what}: its routing is not a whole row for each of its {p + n} positions")


def _episodes(obj: dict, k: int) -> list[EpisodeRecord | None]:
    values = obj.get("episode")
    if not isinstance(values, list) or len(values) != k:
        raise FrameError(f"field 'episode' must be a list of {k} values")
    try:
        return [None if v is None else EpisodeRecord.from_dict(v) for v in values]
    except (TypeError, ValueError) as e:
        raise FrameError(f"field 'episode': {e}") from None


# -- batches: orchestrator -> learner rank -----------------------------------------------------

def _chunk_columns(chunks: list[SequenceChunk]) -> dict[str, Any]:
    taught = any(c.teacher_logprobs for c in chunks)
    if taught and any(len(c.teacher_logprobs) != len(c.old_logprobs) for c in chunks):
        raise ValueError("a batch's chunks must all carry teacher logprobs over their loss range, or none")
    return {
        "count": len(chunks),
        "group_id": [c.group_id for c in chunks],
        "sample_index": [c.sample_index for c in chunks],
        "prompt_lengths": [len(c.prompt_ids) for c in chunks],
        "response_lengths": [len(c.response_ids) for c in chunks],
        "prompt_ids": _pack([c.prompt_ids for c in chunks], INT),
        "response_ids": _pack([c.response_ids for c in chunks], INT),
        "loss_start": [c.loss_start for c in chunks],
        "old_logprobs": _pack([c.old_logprobs for c in chunks], FLOAT),
        "versions": _pack([c.versions for c in chunks], INT),
        "advantage": [float(c.advantage) for c in chunks],
        "temperature": [float(c.temperature) for c in chunks],
        "response_length": [c.response_length for c in chunks],
        # an episode's chunks only (see MASKED)
        **({"mask_lengths": [len(c.loss_mask) for c in chunks], "loss_mask": _pack([c.loss_mask for c in chunks], INT)}
           if any(c.loss_mask for c in chunks) else {}),
        # a distillation run's only: the teacher's logprobs over each chunk's loss range
        **({"teacher_logprobs": _pack([c.teacher_logprobs for c in chunks], FLOAT)}
           if taught else {}),
        # a routing-replay run's only: what the engine routed each position fed to
        **({"routed_experts": [c.routed_experts for c in chunks]} if any(c.routed_experts for c in chunks) else {}),
    }


def _decode_chunks(obj: Any, name: str) -> list[SequenceChunk]:
    if not isinstance(obj, dict):
        raise FrameError(f"{name} must be a map of columns")
    k = _count(obj)
    prompt_lengths, response_lengths = _lengths(obj, "prompt_lengths", k), _lengths(obj, "response_lengths", k)
    loss_start = _column(obj, "loss_start", int, k)
    loss_lens = [n - s for n, s in zip(response_lengths, loss_start)]
    if k and (min(loss_start) < 0 or min(loss_lens) < 0):
        raise FrameError(f"{name}: a chunk's loss_start lies outside its response")
    columns = [
        _column(obj, "group_id", str, k),
        _column(obj, "sample_index", int, k),
        _unpack(obj, "prompt_ids", INT, prompt_lengths),
        _unpack(obj, "response_ids", INT, response_lengths),
        loss_start,
        _unpack(obj, "old_logprobs", FLOAT, loss_lens),
        _unpack(obj, "versions", INT, loss_lens),
        _column(obj, "advantage", float, k),
        _column(obj, "temperature", float, k),
        _column(obj, "response_length", int, k),
    ]
    if "loss_mask" in obj:
        columns.append(_unpack(obj, "loss_mask", INT, _lengths(obj, "mask_lengths", k)))
        _check_masks(columns[-1], loss_lens, name)
    chunks = [SequenceChunk(*fields) for fields in zip(*columns)]
    if "teacher_logprobs" in obj:  # every chunk has them: a distillation run's teacher scored every sample
        for c, teacher in zip(chunks, _unpack(obj, "teacher_logprobs", FLOAT, loss_lens)):
            c.teacher_logprobs = teacher
    if "routed_experts" in obj:
        routes = _column(obj, "routed_experts", bytes, k)
        _check_routes(routes, prompt_lengths, response_lengths, name)
        for c, r in zip(chunks, routes):
            c.routed_experts = r
    return chunks


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
            "chunks": _chunk_columns(b.chunks),
            "role": b.role,
            "opened": _chunk_columns(b.opened),
            "layout_groups": [s.group_id for s in layout],
            "layout_spans": [[s.sample_index, s.loss_start, s.num_tokens] for s in layout],
            "opened_offset": b.opened_offset,
        },
        use_bin_type=True,
    )


def decode_batch(frame: bytes) -> Batch:
    obj = _load_map(frame, "batch")
    role = _typed(obj, "role", str)
    if role not in BATCH_ROLES:
        raise FrameError(f"role {role!r} not in {BATCH_ROLES}")
    groups = _column(obj, "layout_groups", str, None)
    spans = _int_seqs(obj, "layout_spans", len(groups))
    if any(len(span) != 3 for span in spans):
        raise FrameError("a layout span is not (sample_index, loss_start, num_tokens)")
    return Batch(
        step=_typed(obj, "step", int),
        rank=_typed(obj, "rank", int),
        chunks=_decode_chunks(obj.get("chunks"), "chunks"),
        num_loss_tokens_global=_typed(obj, "num_loss_tokens_global", int),
        num_sequences_global=_typed(obj, "num_sequences_global", int),
        token_budget=_typed(obj, "token_budget", int),
        role=role,
        opened=_decode_chunks(obj.get("opened"), "opened"),
        opened_layout=[ResponseSpan(g, *span) for g, span in zip(groups, spans)],
        opened_offset=_typed(obj, "opened_offset", int),
    )
