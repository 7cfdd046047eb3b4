import json
from collections import Counter

import pytest

from asyncrl.config import DataConfig, DataMixConfig
from asyncrl.data.build import build_prompt_source, build_stage_source
from asyncrl.data.prompt_source import MixturePromptSource, PromptSource


class CharTokenizer:
    """One token per character: no downloads, and prompt length is the string length."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def records(n, long_every=0):
    return [{"prompt": ("x" * 50 if long_every and i % long_every == 0 else f"q{i}"), "answer": str(i)}
            for i in range(n)]


def keys(items):
    return [p.metadata["record_key"] for p in items]


def test_metadata_carries_answer_source_tests_and_record_key():
    recs = [{"prompt": "hi", "ground_truth": "4", "domain": "code", "tests": ["t"], "metadata": {"k": 1}}]
    item = PromptSource(recs, CharTokenizer(), source_name="set").next()
    assert item.prompt_id == "p1"
    assert item.prompt_ids == [ord("h"), ord("i")]
    assert item.metadata == {"k": 1, "answer": "4", "data_source": "code", "tests": ["t"], "record_key": "set/0"}


def test_record_keys_are_stable_across_epochs():
    src = PromptSource(records(5), CharTokenizer(), seed=3)
    items = src.take(15)
    for p in items:
        assert p.metadata["record_key"] == f"data/{p.metadata['answer']}"
    epochs = [keys(items[i:i + 5]) for i in (0, 5, 10)]
    assert all(sorted(e) == [f"data/{i}" for i in range(5)] for e in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # reshuffled each epoch
    assert [p.prompt_id for p in items] == [f"p{i}" for i in range(1, 16)]
    assert keys(PromptSource(records(5), CharTokenizer(), seed=3).take(15)) == keys(items)


def test_exclude_applies_to_the_current_and_later_epochs_and_keeps_the_others_order():
    reference = keys(PromptSource(records(5), CharTokenizer(), seed=3).take(15))
    src = PromptSource(records(5), CharTokenizer(), seed=3)
    first_two = keys(src.take(2))
    a, c = reference[0], reference[2]  # one already handed out this epoch, one still to come
    assert src.exclude({a, c, "data/99", "other/1", "data/x"}) == 2
    assert src.exclude({a}) == 0
    assert src.num_excluded == 2
    assert src.num_available == 3
    rest = keys(src.take(8))
    expected = [k for k in reference[2:] if k not in (a, c)][:8]
    assert first_two == reference[:2]
    assert rest == expected
    assert src.position == 10  # excluded records are not drawn, so not counted


def test_excluding_every_record_is_a_clear_error():
    src = PromptSource(records(3), CharTokenizer(), source_name="math")
    src.next()
    assert src.exclude({"math/0", "math/1", "math/2"}) == 3
    with pytest.raises(ValueError, match="online filtering removed every prompt of source 'math'"):
        src.next()


def test_too_long_prompts_are_skipped_and_counted_in_position():
    src = PromptSource(records(4, long_every=2), CharTokenizer(), max_prompt_tokens=10)
    items = src.take(4)
    assert sorted(p.metadata["answer"] for p in items) == ["1", "1", "3", "3"]
    assert src.num_skipped_too_long == 4
    assert src.position == 8


def test_only_too_long_prompts_left_is_an_error_not_a_hang():
    src = PromptSource(records(4, long_every=2), CharTokenizer(), max_prompt_tokens=10)
    src.exclude({"data/1", "data/3"})
    with pytest.raises(ValueError, match="longer than max_prompt_tokens=10"):
        src.next()


def two_sources(seed=0, long_every=0):
    return [PromptSource(records(100, long_every), CharTokenizer(), seed=1, source_name="a",
                         max_prompt_tokens=10),
            PromptSource(records(50, long_every), CharTokenizer(), seed=2, source_name="b",
                         max_prompt_tokens=10)]


def test_mixture_follows_the_weights():
    mix = MixturePromptSource(two_sources(), [3.0, 1.0], seed=7)
    items = mix.take(4000)
    share_a = sum(k.startswith("a/") for k in keys(items)) / len(items)
    assert abs(share_a - 0.75) < 0.03
    assert len({p.prompt_id for p in items}) == 4000
    assert mix.position == 4000
    assert [p.prompt_id for p in items[:3]] == ["p1", "p2", "p3"]


def test_mixture_is_reproducible_for_a_seed():
    def draw(seed):
        return keys(MixturePromptSource(two_sources(), [1.0, 1.0], seed=seed).take(200))

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_mixture_sums_skips_and_keeps_ids_unique():
    mix = MixturePromptSource(two_sources(long_every=2), [1.0, 1.0], seed=0, id_prefix="s1-")
    items = mix.take(300)
    assert mix.num_skipped_too_long == sum(s.num_skipped_too_long for s in mix.sources) > 0
    assert mix.position == 300 + mix.num_skipped_too_long
    assert len({p.prompt_id for p in items}) == 300
    assert all(p.prompt_id.startswith("s1-p") for p in items)


def test_mixture_exclude_routes_keys_and_drops_an_emptied_source():
    mix = MixturePromptSource(two_sources(), [10.0, 1.0], seed=0)
    assert mix.exclude({f"a/{i}" for i in range(100)} | {"b/0"}) == 101
    assert mix.num_excluded == 101
    assert all(k.startswith("b/") and k != "b/0" for k in keys(mix.take(100)))
    mix.exclude({f"b/{i}" for i in range(50)})
    with pytest.raises(ValueError, match="online filtering removed every prompt of every source"):
        mix.next()


def test_mixture_rejects_equal_source_names_and_bad_weights():
    same = [PromptSource(records(2), CharTokenizer()), PromptSource(records(2), CharTokenizer())]
    with pytest.raises(ValueError, match="distinct source names"):
        MixturePromptSource(same, [1.0, 1.0], seed=0)
    with pytest.raises(ValueError, match="one weight per source"):
        MixturePromptSource(two_sources(), [1.0], seed=0)


def write_jsonl(path, n):
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return str(path)


def test_build_prompt_source_names_records_by_dataset(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", 3)
    src = build_prompt_source(DataConfig(type="jsonl", path=path), CharTokenizer(), 64)
    assert sorted(keys(src.take(3))) == [f"jsonl:{path}/{i}" for i in range(3)]
    tiny = build_prompt_source(DataConfig(), CharTokenizer(), 64)
    assert tiny.next().metadata["record_key"].startswith("tiny_arith/")


def test_build_stage_source_mixes_datasets(tmp_path):
    mixture = [DataMixConfig(type="jsonl", path=write_jsonl(tmp_path / "a.jsonl", 4), weight=1.0),
               DataMixConfig(type="jsonl", path=write_jsonl(tmp_path / "b.jsonl", 4), weight=3.0)]
    mix = build_stage_source(mixture, CharTokenizer(), 64, seed=0)
    counts = Counter(k.rsplit("/", 1)[0] for k in keys(mix.take(400)))
    assert set(counts) == {f"jsonl:{tmp_path}/a.jsonl", f"jsonl:{tmp_path}/b.jsonl"}
    assert 0.2 < counts[f"jsonl:{tmp_path}/a.jsonl"] / 400 < 0.3
    one = build_stage_source([DataMixConfig()], CharTokenizer(), 64, seed=0)
    assert one.next().metadata["record_key"].startswith("tiny_arith/")
    with pytest.raises(ValueError, match="same dataset twice"):
        build_stage_source([DataMixConfig(), DataMixConfig(seed=1)], CharTokenizer(), 64, seed=0)


def test_a_restored_source_and_mixture_continue_the_same_prompt_stream():
    import msgpack

    from asyncrl.data.prompt_source import MixturePromptSource, PromptSource
    from asyncrl.data.stages import StageTracker

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 97 for c in text]

    def build():
        a = PromptSource([{"prompt": f"a{i}", "answer": "1"} for i in range(7)], Tok(), seed=1, source_name="a")
        b = PromptSource([{"prompt": f"b{i}", "answer": "2"} for i in range(5)], Tok(), seed=2, source_name="b")
        return MixturePromptSource([a, b], [2.0, 1.0], seed=3)

    mix = build()
    mix.take(11)  # more than one epoch of b
    mix.exclude({"a/3", "b/1"})
    state = msgpack.unpackb(msgpack.packb(mix.state_dict(), use_bin_type=True), raw=False, strict_map_key=False)
    fresh = build()
    fresh.load_state_dict(state)
    want = [(p.prompt_id, p.metadata["record_key"]) for p in mix.take(20)]
    assert [(p.prompt_id, p.metadata["record_key"]) for p in fresh.take(20)] == want
    assert not {"a/3", "b/1"} & {k for _, k in want}

    tracker = StageTracker([_stage(0, 3), _stage(1, None)])
    tracker.on_step(1, 0.5)
    again = StageTracker([_stage(0, 3), _stage(1, None)])
    again.load_state_dict(tracker.state_dict())
    assert [again.on_step(s, 0.5) is not None for s in (2, 3)] == [tracker.on_step(s, 0.5) is not None for s in (2, 3)]


def _stage(index, steps):
    from asyncrl.data.stages import ResolvedStage

    return ResolvedStage(index, f"s{index}", steps, None, 10, None, 8, 4, 1.0, 64, False)
