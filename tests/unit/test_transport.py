import time
from dataclasses import replace

import msgpack
import pytest

from asyncrl.transport.codec import FrameError, decode_batch, decode_samples, encode_batch, encode_samples
from asyncrl.transport.zmq_stream import FrameReceiver, FrameSender, RecordBatcher
from asyncrl.types import Batch, EpisodeRecord, EpisodeStatus, ResponseSpan, Sample, SequenceChunk, with_lists


def sample(i=0):
    return Sample(prompt_id="p1", group_id="p1", sample_index=i, prompt_ids=[5, 6, 7],
                  response_ids=[8, 9, 2], logprobs=[-0.5, -0.25, -1.0], versions=[3, 3, 4],
                  finish_reason="stop", actor_id=1, metadata={"answer": "12", "data_source": "tiny"},
                  temperature=1.25)


def one(frame):
    """The one sample a frame carries, its token columns as lists."""
    (s,) = decoded(frame)
    return s


def decoded(frame):
    return [with_lists(s) for s in decode_samples(frame)]


def batch_lists(b):
    return replace(b, chunks=[with_lists(c) for c in b.chunks], opened=[with_lists(c) for c in b.opened])


def test_sample_round_trip_is_exact():
    s = sample()
    assert decoded(encode_samples([s])) == [s]


def test_decoded_token_columns_are_packed_arrays_and_re_encode_as_they_came():
    """The driver holds every buffered token as decoded: 4 bytes each in an array (a list of ints
    costs 36), and a decoded record re-encodes (a batch of its chunks) without unpacking."""
    frame = encode_samples([sample(0), sample(1)])
    a, b = decode_samples(frame)
    assert [type(x).__name__ for x in (a.prompt_ids, a.response_ids, a.logprobs, a.versions)] == ["array"] * 4
    assert (a.response_ids.typecode, a.response_ids.itemsize, a.logprobs.typecode) == ("i", 4, "f")
    assert b.response_ids.tolist() == [8, 9, 2] and b.versions.tolist() == [3, 3, 4]
    assert encode_samples([a, b]) == frame
    assert decoded(encode_samples([with_lists(a)])) == [sample(0)]


def test_the_sample_wire_format_is_the_dataclass_fields():
    """Declared once: every field of Sample is a column of the frame, in constructor order, so a
    new field needs no edit in the codec (an annotation it has no column kind for fails at import);
    only the driver's own last fields (the teacher's logprobs) never travel."""
    from dataclasses import fields

    from asyncrl.transport.codec import ACTOR_SCORED, DRIVER_ONLY, EPISODIC, MASKED, ROUTED, SAMPLE_COLUMNS

    assert DRIVER_ONLY == ("teacher_logprobs",)
    assert [name for name, _ in SAMPLE_COLUMNS] == [f.name for f in fields(Sample)][:-1]
    taught = replace(sample(), teacher_logprobs=[-0.1, -0.2, -0.3])  # set on the driver, never sent
    frame = msgpack.unpackb(encode_samples([taught]))
    assert set(frame) == ({"v", "kind", "count", "prompt_lengths", "response_lengths"}
                          | {f.name for f in fields(Sample)} - set(ACTOR_SCORED) - set(MASKED) - set(EPISODIC)
                          - set(ROUTED) - set(DRIVER_ONLY))
    assert one(encode_samples([taught])).teacher_logprobs == []


def episode(status=EpisodeStatus.DONE, **kw):
    return EpisodeRecord("calculator", status, turns=2, tool_calls=1, env_s=0.25, observation_tokens=1, reward=1.0,
                         spans=[[0, 1, "model"], [1, 2, "env"], [2, 3, "model"]], **kw)


@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_an_episode_record_travels_typed_beside_its_sample_in_every_kind_of_frame(scored, masked):
    """A frame with an episode carries its records; one of single-turn samples has no such column."""
    s = replace(sample(), episode=episode(info={"k": [1, "a"]}), loss_mask=[1, 0, 1] if masked else [],
                **({"reward": 1.0, "reward_info": {"outcome": "episode"}} if scored else {}))
    failed = replace(sample(1), episode=EpisodeRecord("calculator"), loss_mask=s.loss_mask, reward=s.reward,
                     reward_info=s.reward_info)
    failed.episode.fail(ZeroDivisionError("division by zero"))
    plain = replace(sample(2), loss_mask=s.loss_mask, reward=s.reward, reward_info=s.reward_info)
    got = decoded(encode_samples([s, failed, plain]))
    assert got == [s, failed, plain]
    assert got[0].episode.status is EpisodeStatus.DONE and got[1].episode.status is EpisodeStatus.FAILED
    assert got[1].episode.error == "ZeroDivisionError: division by zero" and got[2].episode is None
    assert "episode" not in msgpack.unpackb(encode_samples([plain]))


@pytest.mark.parametrize("value, match", [
    (["nope"], "not an episode record"), ([{"env": "x", "what": 1}], "not an episode record"),
    ([{"env": "x", "status": "lost"}], "'lost' is not a valid EpisodeStatus"), ([None, None], "list of 1")])
def test_a_frame_with_a_bad_episode_record_is_rejected(value, match):
    frame = msgpack.unpackb(encode_samples([replace(sample(), episode=episode())]))
    frame["episode"] = value
    with pytest.raises(FrameError, match=match):
        decode_samples(msgpack.packb(frame, use_bin_type=True))


def test_a_frame_of_several_samples_round_trips_in_order_with_their_own_lengths():
    a, b, c = sample(0), sample(1), sample(2)
    b.prompt_ids, b.response_ids, b.logprobs, b.versions = [4], [], [], []  # nothing generated: length 0
    c.response_ids, c.logprobs, c.versions = [8, 9, 10, 11, 2], [-0.125, -2.0, -0.5, -0.75, -1.5], [4, 4, 5, 5, 6]
    c.metadata, c.finish_reason, c.actor_id, c.temperature = {"answer": "7"}, "length", 3, 0.5
    assert decoded(encode_samples([a, b, c])) == [a, b, c]
    assert decode_samples(encode_samples([])) == []


def test_a_sample_scored_by_its_actor_round_trips_with_its_reward_and_an_unscored_frame_has_none():
    s = sample()
    s.reward, s.reward_info, s.reward_latency_s = 0.5, {"outcome": "correct", "verifier": "math_verify"}, 0.25
    assert one(encode_samples([s])) == s
    plain = msgpack.unpackb(encode_samples([sample()]), raw=False)
    assert "reward" not in plain and one(encode_samples([sample()])).reward is None
    with pytest.raises(ValueError, match="all scored"):
        encode_samples([s, sample(1)])


def test_a_sample_whose_fields_disagree_is_refused_by_its_sender():
    s = sample()
    s.logprobs = s.logprobs[:2]
    with pytest.raises(ValueError, match="logprobs"):
        encode_samples([s])


@pytest.mark.parametrize("field,value,match", [
    ("reward", ["1"], "reward"), ("reward", [float("nan")], "not finite"), ("reward", [], "reward"),
    ("reward_info", [[1]], "reward_info"), ("reward_latency_s", None, "reward_latency_s")])
def test_a_scored_frame_with_a_bad_reward_field_is_rejected(field, value, match):
    s = sample()
    s.reward = 1.0
    obj = msgpack.unpackb(encode_samples([s]), raw=False)
    obj[field] = value
    with pytest.raises(FrameError, match=match):
        decode_samples(msgpack.packb(obj, use_bin_type=True))


def test_batch_round_trip_is_exact():
    c = SequenceChunk("g", 0, [1, 2], [3, 4, 5], loss_start=1, old_logprobs=[-0.5, -0.75],
                      versions=[0, 1], advantage=-1.25, temperature=0.75)
    b = Batch(step=4, rank=0, chunks=[c], num_loss_tokens_global=2, num_sequences_global=1, token_budget=2)
    assert batch_lists(decode_batch(encode_batch(b))) == b
    # the first step of a rollout batch carries this rank's share of it and the whole layout
    other = SequenceChunk("h", 1, [1], [6, 7], loss_start=0, old_logprobs=[-0.5, -0.5], versions=[1, 1], advantage=0.5)
    opening = Batch(step=5, rank=1, chunks=[c], num_loss_tokens_global=2, num_sequences_global=1, token_budget=2,
                    role="open", opened=[other], opened_layout=[ResponseSpan("g", 0, 1, 2), ResponseSpan.of(other)],
                    opened_offset=1)
    assert batch_lists(decode_batch(encode_batch(opening))) == opening
    with pytest.raises(FrameError, match="role"):
        decode_batch(encode_batch(Batch(4, 0, [c], 2, 1, 2, role="first")))


def test_a_batch_of_chunks_of_different_lengths_round_trips_and_a_loss_range_outside_its_response_is_rejected():
    chunks = [SequenceChunk("g", 0, [1, 2], [3, 4, 5], 1, [-0.5, -0.75], [0, 1], -1.25, 0.75),
              SequenceChunk("g", 1, [1, 2], [6], 0, [-2.0], [1], 0.5),
              SequenceChunk("h", 0, [9], [7, 8, 2, 2], 4, [], [], 0.0)]  # its loss tokens in an earlier batch
    b = Batch(step=1, rank=0, chunks=chunks, num_loss_tokens_global=3, num_sequences_global=3, token_budget=3)
    assert batch_lists(decode_batch(encode_batch(b))) == b
    obj = msgpack.unpackb(encode_batch(b), raw=False)
    obj["chunks"]["loss_start"] = [1, 0, 5]  # 5 > 4 response tokens
    with pytest.raises(FrameError, match="outside"):
        decode_batch(msgpack.packb(obj, use_bin_type=True))


def test_routing_travels_only_in_frames_that_record_it_and_is_cut_with_its_chunk():
    """A MoE engine's routing (one uint8 row of layers x top-k per position fed) rides in its
    sample's frame and, cut to the positions a chunk feeds, in the learner's batch; a frame without
    any has no such column. A routing that is not a whole row per position is refused."""
    from asyncrl.buffer.base import ResponseCursor

    routes = bytes(range(6 * 4))  # 3 prompt + 3 response positions, 2 layers x top-2
    routed = replace(sample(), routed_experts=routes)
    frame = encode_samples([sample(1), routed])
    assert [s.routed_experts for s in decoded(frame)] == [b"", routes]
    assert "routed_experts" not in msgpack.unpackb(encode_samples([sample()]))
    chunk = ResponseCursor(routed, advantage=1.0, offset=1).chunk(2)  # feeds prompt + response[:2]
    assert chunk.routed_experts == routes[:5 * 4]
    plain = SequenceChunk("h", 0, [1], [2], 0, [-1.0], [0], 0.5)
    b = Batch(step=1, rank=0, chunks=[chunk, plain], num_loss_tokens_global=2, num_sequences_global=2, token_budget=2)
    assert [c.routed_experts for c in decode_batch(encode_batch(b)).chunks] == [routes[:20], b""]
    with pytest.raises(ValueError, match="whole row"):
        encode_samples([replace(sample(), routed_experts=routes[:-1])])
    obj = msgpack.unpackb(frame, raw=False)
    obj["routed_experts"][1] = routes[:-2]
    with pytest.raises(FrameError, match="whole row"):
        decode_samples(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize("frame", [
    b"",
    b"\xff\xfe garbage",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"v": 4, "kind": "batch"}),
    msgpack.packb({"v": 99, "kind": "samples"}),
    msgpack.packb({"v": 2, "kind": "samples", "count": 0}),  # the format before packed token columns
    msgpack.packb({"v": 4, "kind": "samples", "count": 1}),
    msgpack.packb({"v": 4, "kind": "samples", "count": -1}),
])
def test_malformed_frames_raise_frame_error(frame):
    with pytest.raises(FrameError):
        decode_samples(frame)


def two_samples_with(field, value):
    """A frame of two valid samples whose column `field` is replaced by `value`."""
    obj = msgpack.unpackb(encode_samples([sample(0), sample(1)]), raw=False)
    obj[field] = value(obj[field]) if callable(value) else value
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("field,value,match", [
    ("logprobs", lambda raw: raw[:-4], "logprobs"),  # five float32 for six tokens
    ("versions", lambda raw: raw[:-4], "versions"),  # five versions for six tokens
    ("response_ids", lambda raw: raw + b"\0\0\0\0", "response_ids"),  # seven ids for six tokens
    ("response_ids", [8, 9, 2, 8, 9, 2], "response_ids"),  # a list, not packed int32
    ("response_lengths", lambda n: [n[0], n[1] + 1], "response_ids"),  # a token with no id, logprob, version
    ("response_lengths", lambda n: [n[0], -1], "negative"),
    ("response_lengths", [3], "response_lengths"),  # one length for two samples
    ("prompt_lengths", lambda n: [n[0], "3"], "prompt_lengths"),
    ("prompt_ids", lambda raw: raw[:12], "prompt_ids"),  # one prompt for two samples
    ("prompt_lengths", lambda n: [n[0] + n[1], 0], "empty prompt"),
    ("finish_reason", ["stop", "exploded"], "exploded"),
    ("group_id", ["p1", 7], "group_id"),
    ("metadata", [{}], "metadata"),
    ("sample_index", [0, -1], "negative"),
    ("sample_index", [0, True], "sample_index"),
    ("temperature", [1.25, 0.0], "temperature"),
])
def test_a_frame_with_one_bad_record_is_rejected_whole(field, value, match):
    with pytest.raises(FrameError, match=match):
        decode_samples(two_samples_with(field, value))


def test_zmq_stream_delivers_valid_frames_and_counts_malformed_ones():
    rx = FrameReceiver(decode_samples)
    tx = FrameSender(rx.endpoint)
    try:
        tx.send(encode_samples([sample(0)]))
        tx.send(b"not msgpack at all")
        tx.send(encode_samples([sample(1), sample(2)]))
        tx.send(encode_samples([sample(3)]))
        got = []
        while len(got) < 2:
            item = rx.recv(timeout_s=5)
            assert item is not None, "stream stalled"
            got.append(item)
        deadline = time.monotonic() + 5
        while len(got) < 4 and time.monotonic() < deadline:
            got += rx.drain()  # what recv decoded and did not hand out yet comes first
        assert [s.sample_index for s in got] == [0, 1, 2, 3]
        assert rx.num_dropped == 1 and rx.num_frames == 4 and rx.num_received == 4
        assert rx.recv(timeout_s=0.05) is None and rx.drain() == []
    finally:
        tx.close()
        rx.close()


def test_take_hands_out_what_waits_and_with_nothing_waits_for_the_first_record():
    rx = FrameReceiver(decode_samples)
    tx = FrameSender(rx.endpoint)
    try:
        t0 = time.monotonic()
        assert rx.take(wait_s=0.2) == [] and time.monotonic() - t0 >= 0.19  # it waited, then nothing
        tx.send(encode_samples([sample(0), sample(1)]))
        first = rx.take(wait_s=5)  # nothing was decoded yet: the first record of the frame that came
        assert [s.sample_index for s in first] == [0]
        tx.send(encode_samples([sample(2)]))
        deadline, got = time.monotonic() + 5, []
        while len(got) < 2 and time.monotonic() < deadline:
            got += rx.take(wait_s=0.05)  # the rest of the first frame, then the second
        assert [s.sample_index for s in got] == [1, 2]
    finally:
        tx.close()
        rx.close()


def test_records_emitted_in_one_event_loop_turn_leave_in_one_frame_and_later_ones_in_their_own():
    import asyncio

    rx = FrameReceiver(decode_samples)
    tx = FrameSender(rx.endpoint)

    async def emit_in_turns():
        batcher = RecordBatcher(tx, encode_samples)
        for i in range(3):  # one turn: three samples finish together
            batcher(sample(i))
        await asyncio.sleep(0)  # the turn ends: the frame leaves
        batcher(sample(3))
        await asyncio.sleep(0)
        batcher.MAX_RECORDS = 2  # a burst larger than a frame's bound leaves in several frames
        for i in range(4, 9):
            batcher(sample(i))
        await asyncio.sleep(0)

    try:
        asyncio.run(emit_in_turns())
        got, deadline = [], time.monotonic() + 5
        while len(got) < 9 and time.monotonic() < deadline:
            got += rx.drain()
        assert [s.sample_index for s in got] == list(range(9))
        assert rx.num_frames == 1 + 1 + 3  # [0 1 2] [3] [4 5] [6 7] [8]
    finally:
        tx.close()
        rx.close()
