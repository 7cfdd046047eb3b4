"""The driver's per-sample path (orchestrator/intake.py) without Ray: the batch decoder gives the
tokenizer's own texts, and ingest hands the pool one call per new sample, none for repeats."""

import random

from asyncrl.buffer.group_assembler import GroupAssembler
from asyncrl.buffer.token_buffer import TokenBuffer
from asyncrl.orchestrator.intake import SampleIntake
from asyncrl.reward.decode import batch_decoder
from asyncrl.orchestrator.ledger import GroupLedger, Shaping
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.tiny.tokenizer import build_tokenizer
from asyncrl.types import PromptItem, Sample


def test_batch_decoder_gives_exactly_what_decode_gives_special_tokens_included():
    tok = build_tokenizer()
    rng = random.Random(0)
    batch = [[rng.randrange(0, tok.vocab_size) for _ in range(rng.randrange(0, 30))] for _ in range(50)]
    assert batch_decoder(tok)(batch) == [tok.decode(ids, skip_special_tokens=True) for ids in batch]
    tok.clean_up_tokenization_spaces = True  # the backend alone would not do this: one at a time
    assert batch_decoder(tok)(batch) == [tok.decode(ids, skip_special_tokens=True) for ids in batch]


class Pool:
    def __init__(self):
        self.calls, self.waits = [], []

    def submit_many(self, calls):
        self.calls += calls

    def poll(self, timeout_s=0.0):
        self.waits.append(timeout_s)
        return []


class NoEval:
    def poll(self, *args):
        pass


def test_ingest_submits_each_new_sample_once_with_its_text_and_keeps_the_first_as_probe():
    tok = build_tokenizer()
    ledger = GroupLedger(TokenBuffer(64, 1), GroupAssembler(), Shaping(), 2)
    ledger.admit(PromptItem("g", [5, 6], {"answer": "1"}), 0, SamplingSpec(1.0, 1.0, 8), 2, actor=0, version=0)
    pool = Pool()
    intake = SampleIntake(ledger, pool, tok, route=None, evaluator=None)
    ids = tok.encode("12+3")

    def sample(i):
        return Sample("g", "g", i, [5, 6], ids, [-0.5] * len(ids), [0] * len(ids), "stop", 0, {"answer": "1"})

    intake.ingest([sample(0), sample(0), sample(1)])  # a repeated frame is not scored twice
    intake.ingest([])
    assert [(c[0].sample_index, c[1], c[2]) for c in pool.calls] == [(0, "12+3", {"answer": "1"}),
                                                                     (1, "12+3", {"answer": "1"})]
    assert intake.probe_ids == [5, 6, *ids] and ledger.counts.samples_orphaned == 1


def test_samples_their_actor_scored_skip_the_pool_and_reach_the_router_with_their_rewards():
    ledger = GroupLedger(TokenBuffer(64, 1), GroupAssembler(), Shaping(), 2)
    ledger.admit(PromptItem("g", [5, 6], {}), 0, SamplingSpec(1.0, 1.0, 8), 2, actor=0, version=0)
    pool, routed = Pool(), []
    intake = SampleIntake(ledger, pool, build_tokenizer(), route=lambda rs, step: routed.extend(rs), evaluator=NoEval())

    def scored(i, reward, outcome):
        s = Sample("g", "g", i, [5, 6], [7, 8], [-0.5, -0.5], [0, 0], "stop", 0, {})
        s.reward, s.reward_info, s.reward_latency_s = reward, {"outcome": outcome}, 0.125
        return s

    intake.ingest([scored(0, 1.0, "correct"), scored(1, 0.0, "timeout"), scored(1, 0.0, "timeout")])
    assert pool.calls == [] and routed == []  # routed with the next poll, not by ingest
    intake.poll_rewards(step=3, timeout_s=0.5)
    assert [(r.key.sample_index, r.reward, r.info["outcome"], r.latency_s) for r in routed] == [
        (0, 1.0, "correct", 0.125), (1, 0.0, "timeout", 0.125)]  # the repeated frame is dropped
    assert pool.waits == [0.0]  # with rewards in hand the driver does not wait on its own pool
    assert intake.metrics() == {"reward/actor_scored_total": 2, "reward/actor_pool_timeouts_total": 1,
                                "reward/actor_pool_crashes_total": 0}
    intake.poll_rewards(step=3, timeout_s=0.5)
    assert len(routed) == 2 and pool.waits == [0.0, 0.5]


def test_long_responses_are_detokenized_off_the_driver_thread_and_reach_the_pool_in_arrival_order():
    """A turn of at least OFF_THREAD_TOKENS response tokens is decoded on a helper thread; its
    samples reach the pool once decoded, and a later short turn queues behind it, not ahead."""
    import threading

    from asyncrl.orchestrator.intake import OFF_THREAD_TOKENS

    tok = build_tokenizer()
    ledger = GroupLedger(TokenBuffer(64, 1), GroupAssembler(), Shaping(), 2)
    for g in ("long", "short"):
        ledger.admit(PromptItem(g, [5, 6], {}), 0, SamplingSpec(1.0, 1.0, 10**6), 2, actor=0, version=0)
    pool = Pool()
    intake = SampleIntake(ledger, pool, tok, route=None, evaluator=None)
    release, threads = threading.Event(), []
    decode = intake.decode

    def held(batch):  # the helper thread waits until the test lets it finish
        threads.append(threading.current_thread().name)
        release.wait(5)
        return decode(batch)

    intake.decode = held
    piece = tok.encode("12+3")
    long_ids = piece * (OFF_THREAD_TOKENS // len(piece) + 1)

    def sample(g, i, ids):
        return Sample(g, g, i, [5, 6], ids, [-0.5] * len(ids), [0] * len(ids), "stop", 0, {})

    intake.ingest([sample("long", 0, long_ids), sample("long", 1, piece)])
    intake.ingest([sample("short", 0, piece)])  # short, but behind a decode still running
    assert pool.calls == []
    release.set()
    intake.submit_decoded(wait=True)
    assert [(c[0].group_id, c[0].sample_index) for c in pool.calls] == [("long", 0), ("long", 1), ("short", 0)]
    assert pool.calls[0][1] == "12+3" * (len(long_ids) // len(piece)) and pool.calls[2][1] == "12+3"
    assert threads and all(t.startswith("asyncrl-detokenize") for t in threads)
    intake.ingest([sample("short", 1, piece)])  # nothing queued: a short turn decodes inline
    assert [c[0].sample_index for c in pool.calls[3:]] == [1] and threads[2:] == [threading.main_thread().name]
    intake.close()
