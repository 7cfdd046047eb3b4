"""Sparse weight deltas and push checksums (asyncrl/sync/delta.py): bit-exact after many pushes,
whole buckets when a delta would not be smaller, and every single flipped bit detected."""

import struct

import pytest
import torch

from asyncrl.sync import delta
from asyncrl.sync.delta import (GAPS, INDICES, WHOLE, ChecksumMismatch, bits, checksum, decode_bucket,
                                encode_bucket, payload_nbytes, weighted_sum)


def rl_step(master: torch.Tensor, gen: torch.Generator, kind: str) -> None:
    """An update of the fp32 master weights: none, tiny (an lr-1e-6 step: most elements round away
    in 16 bits), medium (a few in ten change) or large (every element changes), relative to each
    element's magnitude (1e-6 to 1e3)."""
    if kind == "none":
        return
    scale = {"tiny": 1e-6, "medium": 3e-4, "large": 1.0}[kind]
    master += torch.randn(master.shape, generator=gen, dtype=torch.float64).to(torch.float32) * scale * master.abs()


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fifty_deltas_leave_the_engine_equal_to_a_full_push_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** torch.randint(-6, 4, (5000,), generator=gen).to(torch.float32)
    master = torch.randn(5000, generator=gen) * magnitudes
    master[:3] = torch.tensor([0.0, -0.0, 1e-8])  # signed zeros and a value below fp16's smallest normal
    shadow = master.to(dtype)  # what the learner knows the engines hold
    engine = shadow.clone()
    kinds = ["none", "tiny", "large"] + ["tiny", "tiny", "medium"] * 15 + ["tiny", "none"]
    wholes, changed = 0, 0
    for step, kind in enumerate(kinds):
        rl_step(master, gen, kind)
        new = master.to(dtype)
        want = int((bits(shadow) != bits(new)).sum())
        prefix, payload, count = encode_bucket(raw(shadow), raw(new), 2, advance=True)
        assert count == want
        assert torch.equal(bits(shadow), bits(new))  # the learner's shadow advanced in place, whole or delta
        if prefix[0] == WHOLE:  # a delta would be no smaller
            wholes += 1
        else:
            assert payload.numel() < new.numel() * 2
            changed += count
        decode_bucket(prefix, payload.clone(), raw(engine), 2)
        assert torch.equal(bits(engine), bits(new)), step
    assert wholes == 1  # the step that changed everything went whole; "none" was an empty delta
    assert changed > 2000  # the deltas carried thousands of elements over the run, not a handful


@pytest.mark.parametrize("size, changes", [
    (5000, [0, 1665, 1666, 1667, 3332, 3333, 4999]),  # on and beside the three slices' edges: gaps
    (200_000, [5, 66_666, 133_333, 199_999]),  # gaps past 65,535: int32 indices
    (5000, []),  # nothing changed: an empty delta
])
def test_a_bucket_searched_in_slices_on_threads_encodes_as_in_one(monkeypatch, size, changes):
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(size, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new[changes] = -new[changes]
    one_shadow, one = old.clone(), encode_bucket(raw(old.clone()), raw(new), 2)
    encode_bucket(raw(one_shadow), raw(new), 2, advance=True)
    monkeypatch.setattr(delta, "MIN_SLICE", 7)
    monkeypatch.setattr(delta, "_cores", lambda: 3)
    assert [(s.start, s.stop) for s in delta._slices(size)] == [(0, size // 3), (size // 3, 2 * size // 3),
                                                                (2 * size // 3, size)]
    shadow = old.clone()
    prefix, payload, count = encode_bucket(raw(shadow), raw(new), 2, advance=True)
    assert prefix == one[0] and torch.equal(payload, one[1]) and count == one[2] == len(changes)
    assert prefix[0] == (INDICES if size == 200_000 else GAPS)  # an empty delta travels as no gaps
    assert torch.equal(bits(shadow), bits(new)) and torch.equal(bits(one_shadow), bits(new))
    engine = old.clone()
    decode_bucket(prefix, payload.clone(), raw(engine), 2)
    assert torch.equal(bits(engine), bits(new))


def test_a_delta_holds_exactly_the_changed_bits_and_goes_whole_when_not_smaller():
    old = torch.tensor([1.0, 2.0, 0.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], dtype=torch.float16)
    new = old.clone()
    new[3], new[2] = 4.5, -0.0  # -0.0 equals 0.0 as a value but not as bits
    prefix, payload, count = encode_bucket(raw(old), raw(new), 2)
    assert prefix == [GAPS, 2, checksum(new)] and count == 2
    # positions 2 and 3: gaps 3 (from -1) and 1 as uint16, padded to 8 bytes; then the two new bit patterns
    assert payload[:8].view(torch.uint16).tolist() == [3, 1, 0, 0]
    assert payload[8:].view(torch.int16).tolist() == [struct.unpack("<h", struct.pack("<e", v))[0] for v in (-0.0, 4.5)]
    assert payload.numel() == payload_nbytes(prefix, 20, 2) == 12  # < 20 bytes whole
    prefix, payload, count = encode_bucket(raw(old), raw(old), 2)
    assert prefix == [GAPS, 0, checksum(old)] and payload.numel() == 0 and count == 0
    four, five = old.clone(), old.clone()
    four[:4] += 1
    five[:5] += 1
    assert encode_bucket(raw(old), raw(four), 2)[0][0] == GAPS  # 8 bytes of gaps + 8 of values < 20
    assert encode_bucket(raw(old), raw(five), 2)[0][0] == WHOLE  # 16 + 10 >= 20
    # a gap past 65,535: int32 indices (4 + 2 bytes an element)
    wide = torch.zeros(70_000, dtype=torch.float16)
    changed = wide.clone()
    changed[0], changed[69_999] = 1.0, 2.0
    shadow = wide.clone()
    prefix, payload, _ = encode_bucket(raw(shadow), raw(changed), 2, advance=True)
    assert prefix[:2] == [INDICES, 2] and payload[:8].view(torch.int32).tolist() == [0, 69_999]
    assert torch.equal(shadow, changed)
    decode_bucket(prefix, payload, raw(wide), 2)
    assert torch.equal(wide, changed)
    with pytest.raises(ValueError, match="a delta between"):
        encode_bucket(raw(old), raw(old)[:-2], 2)


def test_a_delta_that_addresses_past_its_bucket_is_refused_not_written():
    old = torch.zeros(100, dtype=torch.float16)
    new = old.clone()
    new[[5, 99]] = 1.0
    prefix, payload, _ = encode_bucket(raw(old), raw(new), 2)
    bad = payload.clone()
    bad[2] = 200  # the second gap now reaches element 5 + 200
    target = old.clone()
    with pytest.raises(ChecksumMismatch, match="addresses elements"):
        decode_bucket(prefix, bad, raw(target), 2)
    assert not target.any()


def test_the_host_checksum_is_xxh3_as_signed_int64_and_the_gpu_one_the_position_weighted_sum_of_32_bit_words():
    import xxhash

    unsigned = xxhash.xxh3_64_intdigest(bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]))
    assert checksum(torch.tensor([1, 2, 3], dtype=torch.int32)) == (unsigned + 2**63) % 2**64 - 2**63
    empty = xxhash.xxh3_64_intdigest(b"")  # 0x2D06800538D394C2: fits int64 as it is
    assert checksum(torch.tensor([7], dtype=torch.uint8)[:0]) == empty == 0x2D06800538D394C2
    high = next(torch.tensor([i], dtype=torch.int64) for i in range(100)
                if xxhash.xxh3_64_intdigest(torch.tensor([i]).numpy().tobytes()) >= 2**63)
    assert -(2**63) <= checksum(high) < 0  # a digest past 2^63 travels as a negative int64
    t = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert weighted_sum(t) == 1 * 1 + 2 * 3 + 3 * 5
    # 6 bytes: padded to two words; the second word is bytes 4, 5 and two zero bytes
    b = torch.tensor([1, 0, 0, 0, 7, 1], dtype=torch.uint8)
    assert weighted_sum(b) == 1 * 1 + (7 + 256) * 3
    # negative words count as their signed value (wrapping int64, as a GPU sums them)
    assert weighted_sum(torch.tensor([-1], dtype=torch.int32)) == -1
    # summed in chunks it is the same number, wrapping included: 2**20 words of 2**31 - 1 sum to
    # (2**31 - 1) x (the first 2**20 odd numbers: 2**40), about 2**71, past int64
    n = 1 << 20
    big = torch.full((n,), 2**31 - 1, dtype=torch.int32)
    want = ((2**31 - 1) * n * n + 2**63) % 2**64 - 2**63
    assert weighted_sum(big) == weighted_sum(big, chunk_words=1000) == weighted_sum(big, chunk_words=7) == want
    mixed = torch.randint(-2**31, 2**31, (5000,), generator=torch.Generator().manual_seed(3)).to(torch.int32)
    exact = sum(int(w) * (2 * i + 1) for i, w in enumerate(mixed.tolist()))
    assert weighted_sum(mixed, chunk_words=64) == weighted_sum(mixed) == (exact + 2**63) % 2**64 - 2**63
    # moving words changes both
    for f in (checksum, weighted_sum):
        assert f(torch.tensor([2, 1], dtype=torch.int32)) != f(torch.tensor([1, 2], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_single_flipped_bit_changes_either_checksum(dtype):
    t = torch.randn(37, generator=torch.Generator().manual_seed(2)).to(dtype)
    raw = t.view(torch.uint8)
    for f in (checksum, weighted_sum):
        want = f(t)
        for byte in range(raw.numel()):
            for bit in range(8):
                flipped = raw.clone()
                flipped[byte] ^= 1 << bit
                assert f(flipped.view(dtype)) != want, (f.__name__, byte, bit)


def test_buckets_pushed_as_deltas_arrive_bit_exact_and_a_flipped_bit_is_caught_and_healed_by_a_whole_push():
    from asyncrl.sync.buckets import pack_bucket, plan_buckets, specs_of
    from asyncrl.sync.delta import ChecksumMismatch, WHOLE, bucket_word, decode_bucket, encode_bucket, payload_nbytes

    gen = torch.Generator().manual_seed(4)
    master = {"a": torch.randn(300, 7, generator=gen), "b": torch.randn(5, generator=gen),
              "c": torch.randn(64, generator=gen), "d": torch.randn(2000, generator=gen)}
    dtypes = {"a": torch.bfloat16, "b": torch.float32, "c": torch.float16, "d": torch.bfloat16}

    def engine_dtype():
        return [(k, v.to(dtypes[k])) for k, v in master.items()]

    plan = plan_buckets(specs_of(engine_dtype()), bucket_bytes=4096, direct_bytes=2048)
    assert sorted(bucket_word(b) for b in plan) == [1, 2, 2]  # the bucket mixing fp32 and fp16 goes bytewise
    packed = lambda: [pack_bucket(b, [dict(engine_dtype())[e["name"]] for e in b["tensors"]],  # noqa: E731
                                  out=torch.zeros(b["nbytes"], dtype=torch.uint8)).clone() for b in plan]
    shadows = [None] * len(plan)  # the learner's: unknown at first, so the first push is whole
    engine = [torch.zeros(b["nbytes"], dtype=torch.uint8) for b in plan]
    kinds = []
    for step in range(12):
        for v in master.values():
            v += torch.randn(v.shape, generator=gen) * (1e-2 if step % 4 == 3 else 1e-5) * v.abs()
        new = packed()
        for i, b in enumerate(plan):
            prefix, payload, changed = encode_bucket(shadows[i], new[i], bucket_word(b))
            as_words = {1: torch.uint8, 2: torch.int16}[bucket_word(b)]
            want = None if shadows[i] is None else int((shadows[i].view(as_words) != new[i].view(as_words)).sum())
            assert changed == want
            if shadows[i] is not None:  # a forced whole push still counts what changed
                assert encode_bucket(shadows[i], new[i], bucket_word(b), whole=True)[0][0] == WHOLE
                assert encode_bucket(shadows[i], new[i], bucket_word(b), whole=True)[2] == want
            assert payload.numel() == payload_nbytes(prefix, b["nbytes"], bucket_word(b))
            kinds.append(prefix[0] == WHOLE)
            decode_bucket(prefix, payload.clone(), engine[i], bucket_word(b))
            assert torch.equal(engine[i], new[i])
            shadows[i] = new[i]
    assert kinds[:len(plan)] == [True] * len(plan) and not all(kinds[len(plan):])  # deltas after the first
    # one flipped bit in a delta on the way: the engine's checksum catches it
    for v in master.values():
        v += torch.randn(v.shape, generator=gen) * 1e-5 * v.abs()
    new = packed()
    prefix, payload, _ = encode_bucket(shadows[0], new[0], bucket_word(plan[0]))
    assert prefix[0] > 0
    corrupted = payload.clone()
    corrupted[-1] ^= 4
    with pytest.raises(ChecksumMismatch, match="learner sent"):
        decode_bucket(prefix, corrupted, engine[0], bucket_word(plan[0]))
    # and a whole push (the learner's shadow forgotten for that engine) heals it
    prefix, payload, _ = encode_bucket(None, new[0], bucket_word(plan[0]))
    decode_bucket(prefix, payload, engine[0], bucket_word(plan[0]))
    assert torch.equal(engine[0], new[0])


@pytest.mark.parametrize(("changed", "how", "nbytes"), [
    (0, "GAPS", 0),              # nothing changed: the prefix alone
    (10, "GAPS", 24 + 10 * 2),   # 20 bytes of uint16 gaps padded to 24, then 2-byte values
    (500, "GAPS", 1000 + 1000),  # 2000 < 2048
    (512, "WHOLE", 2048),        # 1024 + 1024 = 2048: a tie goes whole
])
def test_a_bucket_travels_the_smallest_way_and_arrives_bit_exact(changed, how, nbytes):
    import numpy as np

    from asyncrl.sync import delta

    old = torch.arange(1024, dtype=torch.int16).view(torch.float16)
    new = old.clone()
    picks = torch.from_numpy(np.random.default_rng(changed).permutation(1024)[:changed])
    new.view(torch.int16)[picks] ^= 1  # flip the lowest bit of `changed` elements
    prefix, payload, counted = delta.encode_bucket(raw(old), raw(new), 2)
    assert counted == changed and prefix[:2] == [getattr(delta, how), changed] and payload.numel() == nbytes
    assert payload.numel() == delta.payload_nbytes(prefix, 2048, 2)
    target = old.clone()
    delta.decode_bucket(prefix, payload, raw(target), 2)
    assert torch.equal(raw(target), raw(new))
