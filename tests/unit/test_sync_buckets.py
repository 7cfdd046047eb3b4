"""Bucket plans and pack/unpack: bounded, ordered, exact."""

import msgpack
import pytest
import torch

from asyncrl.sync.buckets import ALIGN_BYTES, is_direct, pack_bucket, plan_buckets, specs_of, unpack_bucket


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


def round_trip(named: list[tuple[str, torch.Tensor]], bucket_bytes: int, direct_bytes: int = 1 << 20) -> dict:
    plan = plan_buckets(specs_of(named), bucket_bytes, direct_bytes)
    tensors, out = dict(named), {}
    for bucket in plan:
        buffer = pack_bucket(bucket, [tensors[e["name"]] for e in bucket["tensors"]]).clone()
        out.update(unpack_bucket(bucket, buffer))
    return out


def names(plan: list[dict]) -> list[list[str]]:
    return [[e["name"] for e in b["tensors"]] for b in plan]


def test_bucket_bytes_bounded_every_tensor_once_and_packed_order_kept():
    named = mixed_tensors()
    plan = plan_buckets(specs_of(named), bucket_bytes=256)
    assert sorted(n for b in names(plan) for n in b) == sorted(n for n, _ in named)
    order = [n for n, _ in named]
    for bucket in plan:
        assert bucket["nbytes"] <= 256 or len(bucket["tensors"]) == 1
        got = [e["name"] for e in bucket["tensors"]]
        assert got == sorted(got, key=order.index)
        for entry in bucket["tensors"]:
            assert entry["offset"] % ALIGN_BYTES == 0
            assert entry["offset"] + entry["nbytes"] <= bucket["nbytes"]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 256, 1 << 20])
@pytest.mark.parametrize("direct_bytes", [8, 100, 1 << 20])
def test_pack_unpack_round_trip_exact(bucket_bytes, direct_bytes):
    named = mixed_tensors()
    got = round_trip(named, bucket_bytes, direct_bytes)
    assert sorted(got) == sorted(n for n, _ in named)
    for name, want in named:
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert torch.equal(got[name], want)


def test_oversized_tensor_gets_its_own_bucket_and_small_ones_wait_behind_it():
    named = [("small", torch.zeros(4)), ("big", torch.zeros(100)), ("tail", torch.zeros(2))]
    plan = plan_buckets(specs_of(named), bucket_bytes=64)
    # 400 bytes of large tensors passed "small": its bucket closes before "tail" joins it
    assert names(plan) == [["big"], ["small"], ["tail"]]
    assert plan[0]["nbytes"] == 400 and is_direct(plan[0]) and is_direct(plan[1])


def test_large_tensors_travel_alone_and_small_ones_share_a_bucket_past_them():
    shapes = [("s1", [3]), ("L1", [40]), ("s2", [5]), ("L2", [40]), ("s3", [2])]  # float32
    named = [(n, torch.zeros(s)) for n, s in shapes]
    plan = plan_buckets(specs_of(named), bucket_bytes=1000, direct_bytes=100)
    assert names(plan) == [["L1"], ["L2"], ["s1", "s2", "s3"]]
    assert [is_direct(b) for b in plan] == [True, True, False]
    assert [e["offset"] for e in plan[2]["tensors"]] == [0, 16, 48]
    # past bucket_bytes of large tensors the small ones leave without waiting for more
    plan = plan_buckets(specs_of(named), bucket_bytes=300, direct_bytes=100)
    assert names(plan) == [["L1"], ["L2"], ["s1", "s2"], ["s3"]]


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
    assert torch.equal(round_trip(named, bucket_bytes=1 << 10)["t"], base.t())


def test_zero_padding_clears_exactly_the_gaps_between_tensors():
    from asyncrl.sync.buckets import zero_padding

    plan = plan_buckets([("a", [3], "float16"), ("b", [5], "float32"), ("c", [1], "int8")], bucket_bytes=1024)
    (bucket,) = plan
    assert [e["offset"] for e in bucket["tensors"]] == [0, 16, 48] and bucket["nbytes"] == 49
    buffer = torch.full((64,), 7, dtype=torch.uint8)
    zero_padding(bucket, buffer)
    occupied = set(range(0, 6)) | set(range(16, 36)) | {48}  # 3 x 2, 5 x 4 and 1 x 1 bytes
    assert [int(b) for b in buffer[:49]] == [7 if i in occupied else 0 for i in range(49)]
    assert buffer[49:].eq(7).all()  # past the bucket: not its bytes
