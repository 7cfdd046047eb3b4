"""Delta pushes over a real gloo group (sender and in-place receiver as two threads of this
process): 50 pushes of random updates arrive bit-exact, the bytes shrink with the update, and a
bit flipped on the way is caught by the checksum and healed by a whole push."""

import threading

import torch

from asyncrl.sync.buckets import DIRECT_BYTES
from asyncrl.sync.gloo_receiver import GlooWeightReceiver
from asyncrl.sync.gloo_sender import GlooWeightSender
from asyncrl.sync.wire import free_port

HOST = "127.0.0.1"
ENGINE_DTYPES = {"embed": torch.bfloat16, "a.bias": torch.float16, "a.weight": torch.bfloat16,
                 "b.weight": torch.float16, "norm": torch.bfloat16, "b.bias": torch.float32}


def master(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights over a range of magnitudes; two large enough to travel as their own bucket."""
    g = torch.Generator().manual_seed(seed)
    big = DIRECT_BYTES // 2 + 5  # 2-byte elements: just past the direct threshold
    shapes = {"embed": (big,), "a.bias": (7,), "a.weight": (40, 9), "b.weight": (2, big // 2 + 1),
              "norm": (11,), "b.bias": (5,)}
    return {name: torch.randn(shape, generator=g) * 10.0 ** torch.randint(-4, 3, shape, generator=g)
            for name, shape in shapes.items()}


def engine_view(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.to(ENGINE_DTYPES[name])) for name, t in weights.items()]


def pair(transfer: str, full_every: int = 0):
    port = free_port()
    sender = GlooWeightSender(HOST, port, 2, timeout_s=30, bucket_bytes=256, transfer=transfer, full_every=full_every)
    receiver = GlooWeightReceiver(HOST, port, 1, 2, timeout_s=30)
    joining = threading.Thread(target=receiver.connect)
    joining.start()
    sender.connect()
    joining.join()
    return sender, receiver


def push(sender, receiver, weights, version, held, whole=False):
    """One push: the sender on a thread, the receiver here, into `held`; returns both stats."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(sent=sender.push(engine_view(weights), version, whole)))
    thread.start()
    got = receiver.receive(sender._plan, version, held)
    thread.join(60)
    return out["sent"], got


def update(weights: dict[str, torch.Tensor], step: int, g: torch.Generator) -> None:
    """Every tenth step changes nothing, every tenth from the fifth everything; the others a random
    fraction of elements by a relative step between 1e-6 (an RL learning rate, mostly rounded away
    in 16 bits) and 1e-1."""
    if step % 10 == 0:
        return
    for t in weights.values():
        if step % 10 == 5:
            t.mul_(-1.5).add_(1e-3)
            continue
        mask = torch.rand(t.shape, generator=g) < float(torch.rand(1, generator=g))
        scale = 10.0 ** float(torch.empty(1).uniform_(-6, -1, generator=g))
        t.add_(mask * torch.randn(t.shape, generator=g) * scale * t.abs())


def bits_equal(held: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(held[n].view(torch.uint8), t.view(torch.uint8)) for n, t in engine_view(weights))


def test_fifty_delta_pushes_of_random_updates_equal_full_pushes_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    weights = master()
    sender, receiver = pair("delta", full_every=20)
    sender.metadata(engine_view(weights))
    held = {n: torch.zeros_like(t) for n, t in engine_view(weights)}
    rows = []
    for version in range(50):
        update(weights, version, g)
        sent, got = push(sender, receiver, weights, version, held)
        assert bits_equal(held, weights), f"push {version} differs from a full push"
        assert got["sync/verify_failures"] == 0 and got["sync/push_bytes"] == sent["sync/push_bytes"]
        rows.append(sent)
    assert [r["sync/whole"] for r in rows].count(1.0) == 3  # the first, then one in 20
    assert rows[0]["sync/whole"] == rows[20]["sync/whole"] == rows[40]["sync/whole"] == 1.0
    nothing = rows[10]  # nothing changed: prefixes only
    assert nothing["sync/changed_frac"] == 0 and nothing["sync/push_bytes"] == 24 * nothing["sync/num_buckets"]
    everything = rows[15]  # (nearly) everything changed: (nearly) every bucket whole, never more
    assert everything["sync/changed_frac"] > 0.99
    assert 0.99 * everything["sync/num_bytes"] < everything["sync/push_bytes"] <= \
        everything["sync/num_bytes"] + 24 * everything["sync/num_buckets"]
    small = [r for i, r in enumerate(rows) if i % 10 not in (0, 5) and i % 20 and r["sync/changed_frac"] < 0.05]
    assert small and all(r["sync/push_bytes"] < 0.2 * r["sync/num_bytes"] for r in small)


def test_a_flipped_bit_is_counted_at_the_receiver_and_a_whole_push_heals_it():
    g = torch.Generator().manual_seed(2)
    weights = master(3)
    sender, receiver = pair("delta")
    sender.metadata(engine_view(weights))
    held = {n: torch.zeros_like(t) for n, t in engine_view(weights)}
    push(sender, receiver, weights, 0, held)
    update(weights, 1, g)
    sender.corrupt_next = True
    sent, got = push(sender, receiver, weights, 1, held)
    assert got["sync/verify_failures"] == 1 and not bits_equal(held, weights)
    sent, got = push(sender, receiver, weights, 1, held, whole=True)
    assert sent["sync/whole"] == 1.0 and got["sync/verify_failures"] == 0 and bits_equal(held, weights)


def test_full_transfer_carries_checksums_too():
    weights = master(4)
    sender, receiver = pair("full")
    sender.metadata(engine_view(weights))
    held = {n: torch.zeros_like(t) for n, t in engine_view(weights)}
    sender.corrupt_next = True
    _, got = push(sender, receiver, weights, 0, held)
    assert got["sync/verify_failures"] == 1
    sent, got = push(sender, receiver, weights, 1, held)
    assert got["sync/verify_failures"] == 0 and bits_equal(held, weights) and "sync/changed_frac" not in sent
