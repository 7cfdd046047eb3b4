"""On-policy distillation (algo.distill) without Ray: the per-token advantage in float64, the
teacher's logprobs from the driver through the buffer, the wire and the learner's collate, the
intake that waits for the teacher, the group assembler that keeps every group, and the checks a
bad teacher meets at start."""

import asyncio
import json
import math
import warnings
from collections import deque
from dataclasses import replace

import pytest
import torch

from asyncrl.algo.distill import distill_advantages
from asyncrl.buffer.base import BufferStats, ResponseCursor, cut_budget
from asyncrl.buffer.group_assembler import GroupAssembler, Kept, Rejected
from asyncrl.buffer.token_buffer import TokenBuffer
from asyncrl.config import ConfigError, load_config
from asyncrl.learner.collate import collate, empty_chunk
from asyncrl.orchestrator.intake import SampleIntake
from asyncrl.orchestrator.ledger import GroupLedger, Shaping
from asyncrl.orchestrator.teacher import InlineTeacher, TeacherTally, attach
from asyncrl.preflight import check_resources, check_teacher
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.teacher import TeacherActor, response_logprobs
from asyncrl.tiny.tokenizer import build_tokenizer
from asyncrl.transport.codec import decode_batch, encode_batch
from asyncrl.types import Batch, PromptItem, Sample, ScoredSample
from test_intake import NoEval, Pool  # the intake tests' stand-ins for the pool and the evaluator

F64 = torch.float64


def test_the_advantage_gains_coef_times_the_teachers_minus_the_behaviour_logprob_in_float64():
    adv = torch.tensor([0.5, 0.5, -1.0], dtype=F64)
    teacher = torch.tensor([-0.1, -2.0, -0.3], dtype=F64)
    behaviour = torch.tensor([-0.4, -0.5, -0.3], dtype=F64)
    # by hand: 0.5 + 0.5 * 0.3 = 0.65; 0.5 + 0.5 * -1.5 = -0.25; -1.0 + 0
    assert distill_advantages(adv, teacher, behaviour, 0.5).tolist() == pytest.approx([0.65, -0.25, -1.0], abs=1e-15)


def taught_sample(index=0, mask=()):
    return Sample("p", "g", index, [5, 6], [1, 2, 3, 4], [-0.5, -0.25, -1.0, -2.0], [0, 0, 1, 1], "stop", 0,
                  loss_mask=list(mask), teacher_logprobs=[-0.25, -0.75, -1.0, -0.5])


def test_the_buffer_cuts_the_teachers_logprobs_with_the_chunk_and_the_wire_carries_them():
    queue, stats = deque([ResponseCursor(taught_sample(), 1.5)]), BufferStats()
    first, second = cut_budget(queue, 3, stats), cut_budget(queue, 1, stats)
    assert [list(c.teacher_logprobs) for c in first + second] == [[-0.25, -0.75, -1.0], [-0.5]]
    batch = Batch(0, 0, first + second, 4, 1, 4)
    decoded = decode_batch(encode_batch(batch))
    assert [list(c.teacher_logprobs) for c in decoded.chunks] == [[-0.25, -0.75, -1.0], [-0.5]]
    plain = replace(first[0], teacher_logprobs=[])  # a run without a teacher: no column, nothing decoded
    assert list(decode_batch(encode_batch(Batch(0, 0, [plain], 3, 1, 3))).chunks[0].teacher_logprobs) == []
    with pytest.raises(ValueError, match="all carry teacher logprobs"):
        encode_batch(Batch(0, 0, [first[0], plain], 6, 2, 6))


def test_collate_adds_the_teachers_term_on_loss_tokens_only_and_none_without_a_coefficient():
    chunk = ResponseCursor(taught_sample(mask=[1, 0, 1, 1]), 1.5).chunk(4)  # position 1: an observation
    plain = collate([chunk])
    assert plain.advantages.tolist() == [1.5, 1.5, 1.5]
    mb = collate([chunk], distill_coef=2.0)
    # loss positions 0, 2, 3: 1.5 + 2 * (t - b) = 1.5 + 2 * 0.25, 1.5 + 0, 1.5 + 2 * 1.5
    assert mb.advantages.tolist() == pytest.approx([2.0, 1.5, 4.5])
    assert mb.old_logprobs.tolist() == [-0.5, -1.0, -2.0]
    pad = collate([empty_chunk()], distill_coef=2.0)  # a rank's zero-loss chunk has no teacher: no term
    assert pad.advantages.tolist() == [0.0]


def test_add_drops_equal_reward_groups_as_configured_and_replace_keeps_every_group_with_no_reward_signal():
    group = [ScoredSample(taught_sample(i), 1.0) for i in range(2)]
    assert isinstance(GroupAssembler().assemble("g", group), Rejected)
    assert isinstance(GroupAssembler(distill="add").assemble("g", group), Rejected)
    kept = GroupAssembler(distill="add", drop_zero_variance=False).assemble("g", group)
    assert isinstance(kept, Kept) and kept.group.advantages == [0.0, 0.0]
    kept = GroupAssembler(distill="replace").assemble("g", group)
    assert isinstance(kept, Kept) and kept.group.advantages == [0.0, 0.0]
    differ = [ScoredSample(taught_sample(0), 1.0), ScoredSample(taught_sample(1), 0.0)]
    unit = 0.5 / (0.5 + 1e-6)  # (r - mean) / (population std + eps): +-0.5 / (0.5 + 1e-6)
    assert GroupAssembler(distill="add").assemble("g", differ).group.advantages == pytest.approx([unit, -unit],
                                                                                                abs=1e-12)
    assert GroupAssembler(distill="replace").assemble("g", differ).group.advantages == [0.0, 0.0]
    with pytest.raises(ValueError, match="distill"):
        GroupAssembler(distill="forward_kl")


def test_the_tally_measures_the_reverse_kl_over_the_students_tokens_only():
    tally = TeacherTally()
    tally.add(taught_sample(mask=[1, 0, 1, 1]), 0.5)  # (-0.5+0.25) + (-1+1) + (-2+0.5) over 3 tokens
    tally.add(taught_sample(), 1.5)                   # ... plus (-0.25+0.75) over 4
    row = tally.take(pending=3)
    assert row == {"distill/reverse_kl": pytest.approx((-0.25 + 0 - 1.5 - 0.25 + 0.5 + 0 - 1.5) / 7),
                   "distill/teacher_latency_s": 1.0, "distill/scored_total": 2.0, "distill/pending": 3.0}
    later = tally.take(pending=0)
    assert math.isnan(later["distill/reverse_kl"]) and later["distill/scored_total"] == 2.0


def test_a_teacher_answer_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="returned 3 logprobs .* of 4 response tokens"):
        attach(taught_sample(), [-1.0] * 3)
    with pytest.raises(ValueError, match="4 response tokens but 3 teacher logprobs"):
        replace(taught_sample(), teacher_logprobs=[-1.0] * 3).validate()


def test_the_intake_sends_each_sample_to_the_teacher_first_and_to_its_reward_after():
    tok = build_tokenizer()
    ledger = GroupLedger(TokenBuffer(64, 1), GroupAssembler(distill="add"), Shaping(), 2)
    ledger.admit(PromptItem("g", [5, 6], {"answer": "1"}), 0, SamplingSpec(1.0, 1.0, 8), 2, actor=0, version=0)
    pool, seen = Pool(), []

    def teacher(prompt, response):
        seen.append((prompt, response))
        return [-0.125 * (j + 1) for j in range(len(response))]

    intake = SampleIntake(ledger, pool, tok, route=lambda rs, step: None, evaluator=NoEval(),
                          teacher=InlineTeacher(teacher))
    ids = tok.encode("12")
    intake.ingest([Sample("g", "g", i, [5, 6], ids, [-0.5] * 2, [0] * 2, "stop", 0, {"answer": "1"}) for i in (0, 0, 1)])
    assert seen == [([5, 6], ids), ([5, 6], ids)] and pool.calls == []  # the repeat is dropped; no reward yet
    intake.poll_rewards(step=1)
    assert [(c[0].sample_index, list(c[0].teacher_logprobs), c[1]) for c in pool.calls] == [
        (0, [-0.125, -0.25], "12"), (1, [-0.125, -0.25], "12")]
    metrics = intake.metrics()
    assert metrics["distill/reverse_kl"] == pytest.approx(-0.5 + 0.1875) and metrics["distill/scored_total"] == 2


class ScriptedEngine:
    """prompt_logprobs as an engine gives them: one per token after the first, -position/10."""

    def __init__(self):
        self.started = False

    async def start(self):
        await asyncio.sleep(0.01)
        self.started = True

    async def prompt_logprobs(self, token_ids):
        assert self.started, "scored before the engine started"
        return [-p / 10 for p in range(1, len(token_ids))]

    async def shutdown(self):
        pass


def test_the_teacher_actor_waits_for_its_engine_and_returns_the_response_tokens_logprobs():
    assert response_logprobs([-0.1, -0.2, -0.3, -0.4], 2) == [-0.2, -0.3, -0.4]  # tokens 2, 3, 4 of 5

    async def scenario():
        actor = TeacherActor(ScriptedEngine)
        # a call that comes before the engine is up waits for it
        scored, _ = await asyncio.gather(actor.score([([1, 2, 3], [4, 5]), ([1], [2])]), actor.start())
        return scored

    # response token j of a prompt of P tokens is sequence position P + j: its logprob -(P + j)/10
    assert asyncio.run(scenario()) == [[-0.3, -0.4], [-0.1]]


def test_a_teacher_that_failed_to_start_fails_its_calls_with_the_reason():
    class Broken(ScriptedEngine):
        async def start(self):
            raise OSError("no such model")

    async def scenario():
        actor = TeacherActor(Broken)
        with pytest.raises(OSError):
            await actor.start()
        await actor.score([([1], [2])])

    with pytest.raises(RuntimeError, match="failed to start: OSError\\('no such model'\\)"):
        asyncio.run(scenario())


def distill_config(**distill):
    cfg = load_config("configs/tiny_cpu.yaml")
    return cfg.model_copy(update={"algo": cfg.algo.model_copy(update={"distill": cfg.algo.distill.model_copy(
        update=distill)})})


def test_a_missing_teacher_or_one_with_another_vocabulary_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^algo.distill.teacher: '.*nowhere' does not exist"):
        check_teacher(distill_config(teacher=str(tmp_path / "nowhere")))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    with pytest.raises(ConfigError, match="vocabulary of 151936 tokens and the student 'builtin:tiny' one of "
                                          f"{len(build_tokenizer())}"):
        check_teacher(distill_config(teacher=str(other)))
    same = tmp_path / "same"
    same.mkdir()
    (same / "config.json").write_text(json.dumps({"vocab_size": len(build_tokenizer())}))
    check_teacher(distill_config(teacher=str(same)))  # passes
    check_teacher(distill_config())  # no teacher: nothing to check


def test_the_teachers_engines_count_toward_the_ray_cpus():
    cfg = distill_config(teacher="runs/x/final", num_engines=2)
    cfg = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"num_cpus": 3})})
    with pytest.raises(ConfigError, match="and 2 teacher engine\\(s\\) of 1 need 4 Ray CPUs, more than ray.num_cpus=3"):
        check_resources(cfg)


def test_the_recipe_distils_the_demos_policy_and_a_tempered_student_is_warned():
    cfg = load_config("configs/tiny_distill.yaml")
    assert (cfg.algo.distill.teacher, cfg.algo.distill.reward, cfg.model.path) == (
        "runs/tiny-cpu/final", "add", "builtin:tiny")
    assert cfg.algo.distill.enabled and not load_config("configs/tiny_cpu.yaml").algo.distill.enabled
    with pytest.warns(UserWarning, match="rollout.temperature=0.7: the teacher scores at temperature 1"):
        load_config("configs/tiny_distill.yaml", overrides=["rollout.temperature=0.7"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("configs/tiny_distill.yaml")
    with pytest.raises(Exception, match="reverse_kl"):
        load_config("configs/tiny_distill.yaml", overrides=["algo.distill.mode=forward_kl"])


def test_a_tensor_parallel_teacher_must_ask_for_its_gpus():
    with pytest.raises(Exception, match="algo.distill.tensor_parallel_size=2 needs that many GPUs per engine: set "
                                        "algo.distill.num_gpus_per_engine=2 \\(it is 0\\)"):
        load_config("configs/tiny_distill.yaml", overrides=["algo.distill.tensor_parallel_size=2"])
    cfg = load_config("configs/tiny_distill.yaml", overrides=["algo.distill.tensor_parallel_size=2",
                                                               "algo.distill.num_gpus_per_engine=2"])
    assert cfg.algo.distill.tensor_parallel_size == 2
