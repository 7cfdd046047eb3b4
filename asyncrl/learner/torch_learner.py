"""TorchLearner: one learner rank with a plain torch model and AdamW.

It binds a zmq socket for its batches (the orchestrator streams each step's chunks there as
msgpack; nothing bulky crosses Ray), trains one step per `train_step` call, and pushes its
weights to the rollout engines over the weight-sync process group. The orchestrator runs it as
a Ray actor; tests can use it in-process.

The learner owns the algorithm's state: the adaptive entropy controller (its e_k is this rank's
entropy of the current policy over the step's loss tokens; with several ranks it must be
all-reduced first), the reference policy and its resets. `save_checkpoint` / `load_checkpoint`
write and read the whole rank: policy (Hugging Face format), optimizer, reference policy,
algorithm state, version and torch RNG, so a resumed run's next step is bit-identical on CPU.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.algo.aggregation import StepCounts
from asyncrl.algo.entropy_control import AdaptiveEntropyController
from asyncrl.algo.kl import should_reset_reference
from asyncrl.buffer.packing import micro_batches
from asyncrl.compat import hide_broken_torch_extras
from asyncrl.config import AlgoConfig, LearnerConfig
from asyncrl.learner.collate import collate
from asyncrl.learner.model_forward import is_moe, policy_forward
from asyncrl.learner.policy_step import forward_backward
from asyncrl.learner.reference import ReferencePolicy
from asyncrl.observe.worker_logs import redirect_output
from asyncrl.transport.codec import decode_batch
from asyncrl.transport.zmq_stream import FrameReceiver
from asyncrl.types import StepResult

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchLearner:
    def __init__(self, model_path: str, learner: LearnerConfig, algo: AlgoConfig, dtype: str = "float32", seed: int = 0, host: str = "127.0.0.1",
                 batch_timeout_s: float = 600.0):
        redirect_output()  # to the run's logs/ when the orchestrator asked
        hide_broken_torch_extras()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        if not torch.cuda.is_available():
            torch.set_num_threads(learner.num_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cfg = learner
        self.algo = algo
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
        self.reference = (ReferencePolicy(self.model, learner.entropy_chunk_tokens, self.device)
                          if algo.kl.needs_reference else None)
        ec = algo.entropy_control
        self.entropy_ctl = (AdaptiveEntropyController(ec.target, ec.delta, ec.coef_max if ec.coef_max is not None
                                                      else float("inf")) if ec.enabled else None)
        self._last_entropy: float | None = None
        self.moe_top_k = int(getattr(self.model.config, "num_experts_per_tok", 0)) if is_moe(self.model) else 0

    def batch_endpoint(self) -> str:
        return self.batches.endpoint

    def _forward(self, mb):
        return policy_forward(self.model, mb, self.cfg.entropy_chunk_tokens, self.device)

    @torch.no_grad()
    def _measure_entropy(self, mbs, num_tokens: int) -> float:
        """e_k: mean entropy of the current policy over the step's loss tokens (before the update)."""
        return sum(float(self._forward(mb).entropy.double().sum()) for mb in mbs) / max(num_tokens, 1)

    def _entropy_coef(self, mbs, num_tokens: int) -> tuple[float, dict[str, float]]:
        """alpha_k: fixed, or from the controller fed e_k (exact) or e_{k-1} (lagged)."""
        ctl = self.entropy_ctl
        if ctl is None:
            return self.algo.entropy_coef, {}
        if self.algo.entropy_control.measure == "exact":
            measured = self._measure_entropy(mbs, num_tokens)
        else:
            measured = self._last_entropy
        if measured is None:  # lagged mode's first step: no e_0 yet, and c_0 = 0 anyway
            return 0.0, {**ctl.metrics(), "entropy_control/target": ctl.target}
        alpha = ctl.update(measured)
        return alpha, {**ctl.metrics(), "entropy_control/measured": measured, "entropy_control/target": ctl.target}

    def train_step(self, step: int, reset_reference: bool = False) -> StepResult:
        """Receive this step's batch, do one optimizer step, advance the version; then reset the
        reference if a trigger fires (`reset_reference` is a request from the run's operator)."""
        t0 = time.monotonic()
        batch = self.batches.recv(self.batch_timeout_s)
        if batch is None:
            raise TimeoutError(f"learner: no batch for step {step} within {self.batch_timeout_s}s")
        if batch.step != step:
            raise RuntimeError(f"learner: expected the batch of step {step}, got step {batch.step}")
        t1 = time.monotonic()
        self.optimizer.zero_grad(set_to_none=True)
        mbs = [collate(c, self.pad_id) for c in micro_batches(batch.chunks, self.cfg.micro_batch_tokens)]
        counts = StepCounts(batch.num_loss_tokens_global, batch.num_sequences_global, batch.token_budget)
        alpha, ctl_metrics = self._entropy_coef(mbs, counts.num_tokens)
        metrics = forward_backward(self._forward, mbs, self.algo, counts, entropy_coef=alpha,
                                   ref_logprobs=self.reference.logprobs if self.reference else None,
                                   moe_top_k=self.moe_top_k)
        self._last_entropy = metrics["entropy/learner"]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.version += 1
        metrics.update(ctl_metrics)
        metrics.update({
            "entropy/coef": alpha,
            "learner/grad_norm": float(grad_norm),
            "learner/optimizer_steps": self._optimizer_steps(),
            "timing/learner_wait_batch_s": t1 - t0,
            "timing/learner_compute_s": time.monotonic() - t1,
        })
        events = []
        if self.reference is not None:
            kl = self.algo.kl
            fire, why = should_reset_reference(step, metrics["kl/mean"], kl.reset_every, kl.reset_kl_threshold,
                                               requested=reset_reference)
            if fire:
                self.reset_reference()
                events.append({"event": "reference_reset", "reason": why, "kl": metrics["kl/mean"]})
            metrics["kl/resets_total"] = self.reference.num_resets
        return StepResult(self.version, metrics, events)

    def _optimizer_steps(self) -> int:
        """Adam's step count (it restarts at 0 when the optimizer state is reset)."""
        state = next(iter(self.optimizer.state.values()), {})
        return int(state.get("step", 0))

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta and a fresh optimizer state (ProRL section 3.3.1)."""
        if self.reference is None:
            raise ValueError("no reference policy to reset: set algo.kl.coef > 0 or algo.kl.track=true")
        self.reference.reset_from(self.model)
        self.optimizer.state.clear()

    def algo_state(self) -> dict[str, Any]:
        """The algorithm's state for a checkpoint (the reference weights travel separately)."""
        return {"entropy_control": self.entropy_ctl.state_dict() if self.entropy_ctl else None,
                "last_entropy": self._last_entropy,
                "num_reference_resets": self.reference.num_resets if self.reference else 0}

    def load_algo_state(self, state: dict[str, Any]) -> None:
        if self.entropy_ctl is not None and state.get("entropy_control"):
            self.entropy_ctl.load_state_dict(state["entropy_control"])
        self._last_entropy = state.get("last_entropy")
        if self.reference is not None:
            self.reference.num_resets = int(state.get("num_reference_resets", 0))

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
        (out / "algo_state.json").write_text(json.dumps(self.algo_state(), indent=2))
        return str(out)

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """The policy in HF format under `path/policy`, everything else in `path/learner.pt`."""
        t0 = time.monotonic()
        self.save(str(Path(path) / "policy"))
        torch.save({"version": self.version, "optimizer": self.optimizer.state_dict(),
                    "reference": self.reference.model.state_dict() if self.reference else None,
                    "algo": self.algo_state(), "torch_rng": torch.get_rng_state()},
                   Path(path) / "learner.pt")
        return {"version": self.version, "save_s": time.monotonic() - t0}

    def load_checkpoint(self, path: str) -> int:
        """Restore what `save_checkpoint` wrote; the policy weights come from `path/policy`,
        which the learner must have been built from. Returns the restored version."""
        state = torch.load(Path(path) / "learner.pt", map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.reference is not None:
            if state["reference"] is None:
                raise ValueError(f"{path} holds no reference policy, but this run's algo.kl needs one")
            self.reference.model.load_state_dict(state["reference"])
        self.load_algo_state(state["algo"])
        torch.set_rng_state(state["torch_rng"])
        self.version = int(state["version"])
        return self.version

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.batches.close()
