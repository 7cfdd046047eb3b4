"""Bucket plans and pack/unpack: bounded, ordered, exact."""

import msgpack
import pytest
import torch

from asyncrl.sync.buckets import ALIGN_BYTES, pack_bucket, plan_buckets, specs_of, unpack_bucket


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.randint(-9, 9, (2, 3, 4), generator=g, dtype=torch.int64)),
        ("d", torch.randn(1, generator=g).to(torch.float16)),
        ("e", torch.tensor(2.5, dtype=torch.float64)),  # 0-d
        ("f", torch.randn(11, 13, generator=g)),
        ("g", torch.tensor([True, False, True])),
    ]


def round_trip(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list:
    plan = plan_buckets(specs_of(named), bucket_bytes)
    out, first = [], 0
    for bucket in plan:
        count = len(bucket["tensors"])
        buffer = pack_bucket(bucket, [t for _, t in named[first : first + count]]).clone()
        out += unpack_bucket(bucket, buffer)
        first += count
    return out


def test_bucket_bytes_bounded_and_order_kept():
    named = mixed_tensors()
    plan = plan_buckets(specs_of(named), bucket_bytes=256)
    assert [e["name"] for b in plan for e in b["tensors"]] == [n for n, _ in named]
    for bucket in plan:
        assert bucket["nbytes"] <= 256 or len(bucket["tensors"]) == 1
        for entry in bucket["tensors"]:
            assert entry["offset"] % ALIGN_BYTES == 0
            assert entry["offset"] + entry["nbytes"] <= bucket["nbytes"]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 256, 1 << 20])
def test_pack_unpack_round_trip_exact(bucket_bytes):
    named = mixed_tensors()
    got = round_trip(named, bucket_bytes)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, have) in zip(named, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have, want)


def test_oversized_tensor_gets_its_own_bucket():
    named = [("small", torch.zeros(4)), ("big", torch.zeros(100)), ("tail", torch.zeros(2))]
    plan = plan_buckets(specs_of(named), bucket_bytes=64)
    assert [[e["name"] for e in b["tensors"]] for b in plan] == [["small"], ["big"], ["tail"]]
    assert plan[1]["nbytes"] == 400


def test_small_tensors_share_buckets():
    named = [(f"t{i}", torch.zeros(4)) for i in range(8)]  # 16 bytes each, 16-aligned
    plan = plan_buckets(specs_of(named), bucket_bytes=64)
    assert [len(b["tensors"]) for b in plan] == [4, 4]


def test_plan_is_plain_data():
    plan = plan_buckets(specs_of(mixed_tensors()), bucket_bytes=128)
    assert msgpack.unpackb(msgpack.packb(plan)) == plan


def test_pack_reuses_out_buffer_and_checks_shapes():
    named = [("x", torch.arange(6.0).view(2, 3)), ("y", torch.arange(3.0))]
    bucket = plan_buckets(specs_of(named), bucket_bytes=1 << 10)[0]
    out = torch.empty(1 << 10, dtype=torch.uint8)
    buffer = pack_bucket(bucket, [t for _, t in named], out=out)
    assert buffer.data_ptr() == out.data_ptr()
    assert torch.equal(unpack_bucket(bucket, buffer)[1][1], named[1][1])
    with pytest.raises(ValueError, match="planned"):
        pack_bucket(bucket, [torch.zeros(3, 2), torch.zeros(3)])


def test_non_contiguous_tensor_packs_by_value():
    base = torch.arange(12.0).view(3, 4)
    named = [("t", base.t())]
    (_, got), = round_trip(named, bucket_bytes=1 << 10)
    assert torch.equal(got, base.t())
