"""TorchLearner: one learner rank with a plain torch model and AdamW.

It binds a zmq socket for its batches (the orchestrator streams each step's chunks there as
msgpack; nothing bulky crosses Ray), trains one step per `train_step` call, and pushes its
weights to the rollout engines over the weight-sync process group. The orchestrator runs it as
a Ray actor; tests can use it in-process.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.algo.aggregation import StepCounts
from asyncrl.buffer.packing import micro_batches
from asyncrl.compat import hide_broken_torch_extras
from asyncrl.config import AlgoConfig, LearnerConfig
from asyncrl.learner.collate import collate
from asyncrl.learner.policy_step import forward_backward
from asyncrl.transport.codec import decode_batch
from asyncrl.transport.zmq_stream import FrameReceiver

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchLearner:
    def __init__(self, model_path: str, learner: LearnerConfig, algo: AlgoConfig, token_budget: int,
                 temperature: float, dtype: str = "float32", seed: int = 0, host: str = "127.0.0.1",
                 batch_timeout_s: float = 600.0):
        hide_broken_torch_extras()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        if not torch.cuda.is_available():
            torch.set_num_threads(learner.num_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cfg = learner
        self.algo = algo
        self.token_budget = token_budget
        self.temperature = temperature
        self.model_path = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learner.lr, betas=learner.betas,
                                           weight_decay=learner.weight_decay)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.version = 0
        self.batches = FrameReceiver(decode_batch, host=host)
        self.batch_timeout_s = batch_timeout_s
        self.sender = None

    def batch_endpoint(self) -> str:
        return self.batches.endpoint

    def _logits(self, mb) -> torch.Tensor:
        return self.model(input_ids=mb.input_ids.to(self.device),
                          attention_mask=mb.attention_mask.to(self.device)).logits

    def train_step(self, step: int) -> dict[str, float]:
        """Receive this step's batch, do one optimizer step, advance the version."""
        t0 = time.monotonic()
        batch = self.batches.recv(self.batch_timeout_s)
        if batch is None:
            raise TimeoutError(f"learner: no batch for step {step} within {self.batch_timeout_s}s")
        if batch.step != step:
            raise RuntimeError(f"learner: expected the batch of step {step}, got step {batch.step}")
        t1 = time.monotonic()
        self.optimizer.zero_grad(set_to_none=True)
        mbs = [collate(c, self.pad_id) for c in micro_batches(batch.chunks, self.cfg.micro_batch_tokens)]
        counts = StepCounts(batch.num_loss_tokens_global, batch.num_sequences_global, self.token_budget)
        metrics = forward_backward(self._logits, mbs, self.algo, counts, self.temperature,
                                   self.cfg.entropy_chunk_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.version += 1
        metrics.update({
            "learner/grad_norm": float(grad_norm),
            "learner/version": self.version,
            "timing/learner_wait_batch_s": t1 - t0,
            "timing/learner_compute_s": time.monotonic() - t1,
        })
        return metrics

    # -- weights ------------------------------------------------------------------------------

    def init_weight_sync(self, kind: str, host: str, port: int, world_size: int, timeout_s: float,
                         bucket_bytes: int) -> None:
        from asyncrl.sync.protocol import make_sender

        self.sender = make_sender(kind, host=host, port=port, world_size=world_size,
                                  timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self.sender.connect()

    def _named_params(self):
        # named_parameters() yields a tied embedding once, under its input-embedding name
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def weight_metadata(self) -> dict[str, Any]:
        return self.sender.metadata(self._named_params())

    def push_weights(self) -> dict[str, float]:
        """Broadcast the current weights (the engines receive concurrently)."""
        return self.sender.push(self._named_params(), self.version)

    # -- inspection ---------------------------------------------------------------------------

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1 at temperature 1 (the parity probe)."""
        ids = torch.tensor([token_ids], device=self.device)
        logits = self.model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        return logp.cpu().tolist()

    @torch.no_grad()
    def param_fingerprint(self) -> float:
        return float(sum(p.double().abs().sum() for p in self.model.parameters()))

    def save(self, path: str) -> str:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        self.tokenizer.save_pretrained(out)
        return str(out)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.batches.close()
