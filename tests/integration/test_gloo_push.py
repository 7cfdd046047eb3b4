"""The gloo push against the in-place receiver (no vLLM): large tensors travel without a copy on
either side, small ones through reused buffers, every byte arrives, and a push whose header does
not match the receiver's metadata is refused before any weight changes. Sender and receiver are
two threads of this process, each a rank of a real gloo group over loopback."""

import threading
import time

import pytest
import torch

from asyncrl.sync.buckets import DIRECT_BYTES, is_direct
from asyncrl.sync.gloo_receiver import GlooWeightReceiver
from asyncrl.sync.gloo_sender import GlooWeightSender
from asyncrl.sync.wire import free_port
from asyncrl.sync.protocol import WeightSyncError

HOST = "127.0.0.1"


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    big = DIRECT_BYTES // 4 + 3  # float32 elements: just past the direct threshold
    return [("embed", torch.randn(big, generator=g)),
            ("a.bias", torch.randn(7, generator=g)),
            ("a.half", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
            ("b.weight", torch.randn(3, big, generator=g)),
            ("b.steps", torch.randint(-5, 5, (4,), generator=g, dtype=torch.int64)),
            ("norm", torch.randn(11, generator=g))]


def connected(timeout_s: float = 30.0):
    port = free_port()
    sender = GlooWeightSender(HOST, port, 2, timeout_s=timeout_s, bucket_bytes=128)
    receiver = GlooWeightReceiver(HOST, port, 1, 2, timeout_s=timeout_s)
    joining = threading.Thread(target=receiver.connect)
    joining.start()
    sender.connect()
    joining.join()
    return sender, receiver


def run_pair(sender, push_args, receive):
    """The push on a thread, the receive here; returns (push result or error, receive result or error)."""
    out = {}

    def push():
        try:
            out["push"] = sender.push(*push_args)
        except Exception as e:  # noqa: BLE001 - compared by the test
            out["push"] = e

    thread = threading.Thread(target=push)
    thread.start()
    try:
        got = receive()
    except Exception as e:  # noqa: BLE001
        got = e
    thread.join(60)
    return out["push"], got


def test_pushes_arrive_exactly_in_place_and_buffers_are_reused():
    sender, receiver = connected()
    named = weights(0)
    plan = sender.metadata(named)["update_info"]["buckets"]
    # small ones packed together, behind the large ones that passed them
    assert [[e["name"] for e in b["tensors"]] for b in plan] == [
        ["embed"], ["b.weight"], ["a.bias", "a.half"], ["b.steps", "norm"]]
    assert [is_direct(b) for b in plan] == [True, True, False, False]
    params = {n: torch.zeros_like(t) for n, t in named}
    # a strided destination for a direct bucket is filled through a copy
    params["b.weight"] = torch.zeros(named[3][1].shape[1], 3).t()
    embed_memory = params["embed"].data_ptr()
    for version, seed in ((1, 0), (2, 1)):
        named = weights(seed)
        pushed, received = run_pair(sender, (named, version), lambda: receiver.receive(plan, version, params))
        assert pushed["sync/num_bytes"] == received["sync/num_bytes"] == sum(b["nbytes"] for b in plan)
        for name, tensor in named:
            assert torch.equal(params[name], tensor), name
    assert params["embed"].data_ptr() == embed_memory  # received in place, no new tensor
    sender.close()
    receiver.close()


def test_a_mismatched_header_is_refused_before_any_weight_changes():
    sender, receiver = connected(timeout_s=3.0)
    named = weights(0)
    plan = sender.metadata(named)["update_info"]["buckets"]
    params = {n: torch.zeros_like(t) for n, t in named}
    pushed, received = run_pair(sender, (named, 4), lambda: receiver.receive(plan, 5, params))
    assert isinstance(received, WeightSyncError) and "does not match" in str(received)
    assert isinstance(pushed, WeightSyncError)  # the receiver left: the sender times out, loudly
    assert all(not t.any() for t in params.values())


def test_a_member_that_hangs_is_told_from_the_one_waiting_for_it_whatever_the_join_timeout():
    """A group joined with a long timeout (a run's first, while members may still be building):
    its pushes still time out after timeout_s. Before, the join's timeout held for every
    collective, so when one of two receivers hung, the sender and the healthy receiver waited
    past the push's deadline as well, and the run replaced both engines."""
    port = free_port()
    sender = GlooWeightSender(HOST, port, 3, timeout_s=2.0, bucket_bytes=128, join_timeout_s=120.0)
    receivers = [GlooWeightReceiver(HOST, port, rank, 3, timeout_s=2.0, join_timeout_s=120.0) for rank in (1, 2)]
    joining = [threading.Thread(target=r.connect) for r in receivers]
    for thread in joining:
        thread.start()
    sender.connect()
    for thread in joining:
        thread.join()
    named = weights(0)
    plan = sender.metadata(named)["update_info"]["buckets"]
    params = {n: torch.zeros_like(t) for n, t in named}
    start = time.monotonic()  # receiver 2 never receives: it hangs
    pushed, received = run_pair(sender, (named, 1), lambda: receivers[0].receive(plan, 1, params))
    assert isinstance(pushed, WeightSyncError) and isinstance(received, WeightSyncError), (pushed, received)
    assert time.monotonic() - start < 10.0  # the push's 2 s (and the next wait's), not the join's 120 s


def test_a_receiver_without_a_planned_tensor_fails_before_joining_the_push():
    port = free_port()
    receiver = GlooWeightReceiver(HOST, port, 1, 2, timeout_s=1.0)
    receiver._group = object()  # connected as far as receive() can tell; nothing is received
    named = weights(0)
    sender = GlooWeightSender(HOST, port, 2, bucket_bytes=128)
    plan = sender.metadata(named)["update_info"]["buckets"]
    with pytest.raises(ValueError, match="does not hold"):
        receiver.receive(plan, 1, {n: torch.zeros_like(t) for n, t in named[1:]})


def test_random_mixes_of_large_and_small_tensors_arrive_exactly():
    """Small tensors wait in packed buckets while large ones pass (buckets leave out of the
    tensors' order); the sender must still stage, reuse its two pack buffers and send in plan order."""
    g = torch.Generator().manual_seed(3)
    sizes = [int(torch.randint(1, 400, (1,), generator=g)) * (300 if torch.rand(1, generator=g) < 0.4 else 1)
             for _ in range(60)]
    named = [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate(sizes)]
    port = free_port()
    sender = GlooWeightSender(HOST, port, 2, timeout_s=30, bucket_bytes=4096)
    receiver = GlooWeightReceiver(HOST, port, 1, 2, timeout_s=30)
    joining = threading.Thread(target=receiver.connect)
    joining.start()
    sender.connect()
    joining.join()
    import asyncrl.sync.buckets as buckets

    plan = buckets.plan_buckets(buckets.specs_of(named), 4096, direct_bytes=4000)
    sender.metadata(named)
    sender._plan = plan  # a smaller direct threshold than the default, so both kinds occur
    sender._place = {e["name"]: (i, e) for i, b in enumerate(plan) for e in b["tensors"]}
    assert sum(is_direct(b) for b in plan) > 5 and sum(not is_direct(b) for b in plan) > 3
    params = {n: torch.zeros_like(t) for n, t in named}
    for version in (1, 2):
        named = [(n, t + version) for n, t in named]
        pushed, received = run_pair(sender, (named, version), lambda: receiver.receive(plan, version, params))
        assert not isinstance(pushed, Exception) and not isinstance(received, Exception), (pushed, received)
        assert all(torch.equal(params[n], t) for n, t in named)
