import msgpack
import pytest

from asyncrl.transport.codec import FrameError, decode_batch, decode_sample, encode_batch, encode_sample
from asyncrl.transport.zmq_stream import FrameReceiver, FrameSender
from asyncrl.types import Batch, ResponseSpan, Sample, SequenceChunk


def sample(i=0):
    return Sample(prompt_id="p1", group_id="p1", sample_index=i, prompt_ids=[5, 6, 7],
                  response_ids=[8, 9, 2], logprobs=[-0.5, -0.25, -1.0], versions=[3, 3, 4],
                  finish_reason="stop", actor_id=1, metadata={"answer": "12", "data_source": "tiny"},
                  temperature=1.25)


def test_sample_round_trip_is_exact():
    s = sample()
    assert decode_sample(encode_sample(s)) == s


def test_a_sample_scored_by_its_actor_round_trips_with_its_reward_and_an_unscored_frame_has_none():
    s = sample()
    s.reward, s.reward_info, s.reward_latency_s = 0.5, {"outcome": "correct", "verifier": "math_verify"}, 0.25
    assert decode_sample(encode_sample(s)) == s
    plain = msgpack.unpackb(encode_sample(sample()), raw=False)
    assert "reward" not in plain and decode_sample(encode_sample(sample())).reward is None


@pytest.mark.parametrize("field,value,match", [
    ("reward", "1", "reward"), ("reward", float("nan"), "not finite"), ("reward_info", [1], "reward_info"),
    ("reward_latency_s", None, "reward_latency_s")])
def test_a_scored_frame_with_a_bad_reward_field_is_rejected(field, value, match):
    s = sample()
    s.reward = 1.0
    obj = msgpack.unpackb(encode_sample(s), raw=False)
    obj[field] = value
    with pytest.raises(FrameError, match=match):
        decode_sample(msgpack.packb(obj, use_bin_type=True))


def test_batch_round_trip_is_exact():
    c = SequenceChunk("g", 0, [1, 2], [3, 4, 5], loss_start=1, old_logprobs=[-0.5, -0.75],
                      versions=[0, 1], advantage=-1.25, temperature=0.75)
    b = Batch(step=4, rank=0, chunks=[c], num_loss_tokens_global=2, num_sequences_global=1, token_budget=2)
    assert decode_batch(encode_batch(b)) == b
    # the first step of a rollout batch carries this rank's share of it and the whole layout
    other = SequenceChunk("h", 1, [1], [6, 7], loss_start=0, old_logprobs=[-0.5, -0.5], versions=[1, 1], advantage=0.5)
    opening = Batch(step=5, rank=1, chunks=[c], num_loss_tokens_global=2, num_sequences_global=1, token_budget=2,
                    role="open", opened=[other], opened_layout=[ResponseSpan("g", 0, 1, 2), ResponseSpan.of(other)],
                    opened_offset=1)
    assert decode_batch(encode_batch(opening)) == opening
    with pytest.raises(FrameError, match="role"):
        decode_batch(encode_batch(Batch(4, 0, [c], 2, 1, 2, role="first")))


@pytest.mark.parametrize("frame", [
    b"",
    b"\xff\xfe garbage",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"v": 1, "kind": "batch"}),
    msgpack.packb({"v": 99, "kind": "sample"}),
])
def test_malformed_frames_raise_frame_error(frame):
    with pytest.raises(FrameError):
        decode_sample(frame)


def test_inconsistent_sample_is_rejected():
    obj = msgpack.unpackb(encode_sample(sample()), raw=False)
    obj["logprobs"] = obj["logprobs"][:4]  # one float32 for three tokens
    with pytest.raises(FrameError, match="logprobs"):
        decode_sample(msgpack.packb(obj, use_bin_type=True))
    obj = msgpack.unpackb(encode_sample(sample()), raw=False)
    obj["finish_reason"] = "exploded"
    with pytest.raises(FrameError):
        decode_sample(msgpack.packb(obj, use_bin_type=True))
    obj = msgpack.unpackb(encode_sample(sample()), raw=False)
    obj["response_ids"] = obj["response_ids"][:-1]  # not a whole number of int32
    with pytest.raises(FrameError):
        decode_sample(msgpack.packb(obj, use_bin_type=True))


def test_zmq_stream_delivers_valid_frames_and_counts_malformed_ones():
    rx = FrameReceiver(decode_sample)
    tx = FrameSender(rx.endpoint)
    try:
        tx.send(encode_sample(sample(0)))
        tx.send(b"not msgpack at all")
        tx.send(encode_sample(sample(1)))
        got = []
        while len(got) < 2:
            item = rx.recv(timeout_s=5)
            assert item is not None, "stream stalled"
            got.append(item)
        assert [s.sample_index for s in got] == [0, 1]
        assert rx.num_dropped == 1 and rx.num_received == 3
        assert rx.recv(timeout_s=0.05) is None
    finally:
        tx.close()
        rx.close()
