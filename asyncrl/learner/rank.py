"""LearnerRank: one rank of the learner group, on the backend `learner.backend` names.

It binds a zmq socket for its batches (the orchestrator streams each rank its part of a step
as msgpack; nothing bulky crosses Ray), trains one step per `train_step` call, and rank 0
pushes the weights to the rollout engines over the weight-sync process group. The
orchestrator runs the ranks as Ray actors (`orchestrator/learner_group.py`); tests can use a
single rank in-process.

Every rank receives its own part of the step (split by tokens in `buffer/packing.py`) rather
than rank 0 receiving the batch and scattering it: no rank handles more bytes than it trains
on, and the step's global counts travel in each part's header, so each rank can normalize its
loss by them without talking to the others. The backend sums the ranks' gradients. Sharded
backends gather parameters inside every forward and reduce gradients inside every backward,
so every rank runs as many micro-batches as the busiest one (padding with zero-loss ones).

The rank owns the algorithm's state: the adaptive entropy controller (fed e_k all-reduced over
ranks), the reference policy and its resets, and decoupled PPO's pi_prox of the open rollout
batch (learner/proximal.py), computed when a step opens a batch (`Batch.role`).
`save_checkpoint` / `load_checkpoint` write and read the whole group's state independent of
the number of ranks: policy (Hugging Face format), full optimizer state, reference policy,
algorithm state (pi_prox included: every rank holds all of it), version and torch RNG, so a
resumed run's next step is bit-identical on CPU and a checkpoint of N ranks resumes on M.

Three dtypes, each its own: the parameters (`learner.param_dtype`, float32 masters by default),
the compute dtype of every forward (`dtype`, model.dtype: the backend autocasts to it), and the
engines' weights (`engine_dtype`: rollout.dtype, else model.dtype): pushes cast each parameter to
it on the way out, while checkpoints keep the masters.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.algo.aggregation import StepCounts
from asyncrl.algo.corrections import m2po_threshold
from asyncrl.algo.kl import should_reset_reference
from asyncrl.learner.micro_batches import micro_batches
from asyncrl.compat import check_gpu_visibility, hide_broken_torch_extras
from asyncrl.config import AlgoConfig, LearnerConfig
from asyncrl.learner import collectives
from asyncrl.learner import make_backend
from asyncrl.learner.backend import init_process_group
from asyncrl.learner.collate import collate, empty_chunk
from asyncrl.learner.entropy_schedule import EntropySchedule, sampled_nll_sum
from asyncrl.learner.hf_files import meta_params, save_hf_model
from asyncrl.learner.model_forward import is_moe, policy_forward
from asyncrl.learner.policy_step import (MoeStep, forward_backward, fractions, m2po_log_ratios, measure_pass, padding_loss,
                                         routed_positions)
from asyncrl.learner.proximal import ProximalLogprobs
from asyncrl.learner.reference import ReferencePolicy
from asyncrl.observe.worker_logs import redirect_output
from asyncrl.sync.protocol import WeightSyncError
from asyncrl.sync.wire import free_port, own_address
from asyncrl.transport.codec import decode_batch
from asyncrl.transport.zmq_stream import FrameReceiver
from asyncrl.types import StepResult

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class LearnerRank:
    def __init__(self, model_path: str, learner: LearnerConfig, algo: AlgoConfig, dtype: str = "float32",
                 engine_dtype: str | None = None,
                 seed: int = 0, host: str | None = None, batch_timeout_s: float = 600.0, rank: int = 0,
                 world_size: int = 1, group_address: str | None = None, tiny: Any = None,
                 max_response_tokens: int = 0):
        redirect_output()  # to the run's logs/ when the orchestrator asked
        hide_broken_torch_extras()
        check_gpu_visibility("learner rank", "learner.num_gpus", learner.num_gpus)
        if not torch.cuda.is_available():
            torch.set_num_threads(learner.num_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.rank, self.world_size = rank, world_size
        # a single torch rank needs no process group; DeepSpeed always wants one
        self.distributed = world_size > 1 or learner.backend == "deepspeed"
        host = host or own_address()  # every bind on this rank's own node (None: found here)
        if self.distributed:
            init_process_group(rank, world_size, group_address or f"{host}:{free_port(host)}", batch_timeout_s,
                               local_host=host)
        self.batches = FrameReceiver(lambda frame: [decode_batch(frame)], host=host)
        self.batch_timeout_s = batch_timeout_s
        self.sender = None
        self.reset(model_path, learner, algo, dtype, engine_dtype, seed, tiny, max_response_tokens)

    def reset(self, model_path: str, learner: LearnerConfig, algo: AlgoConfig, dtype: str = "float32",
              engine_dtype: str | None = None, seed: int = 0, tiny: Any = None, max_response_tokens: int = 0,
              log_file: str | None = None) -> None:
        """A fresh run's learner in this process: the model loaded from `model_path`, a new optimizer,
        reference, entropy schedule and version 0. The process group, the batch socket and the
        weight-sync group stay (a study's runs share them: asyncrl/orchestrator/warm.py); the
        process-shaping fields (backend, ranks, parameter dtype) must be the ones it started with."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if log_file:
            redirect_output(log_file)
        torch.manual_seed(seed)
        if tiny is not None:  # the built-in model: this node's own build (see local_model_path)
            from asyncrl.tiny.build import local_model_path

            model_path = local_model_path(model_path, tiny)
        self.cfg, self.algo, self.model_path = learner, algo, model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.engine_dtype = DTYPES[engine_dtype or dtype]  # the engines' (rollout.dtype, else model.dtype)
        params = param_dtype(learner, dtype)
        # the MoE experts' default kernel (grouped_mm) has no float64
        kernels = {"experts_implementation": "eager"} if params == torch.float64 else {}
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=params, **kernels).to(self.device)
        model.train()
        self.hf_config = model.config  # saved as is: a wrapped model's class name is not a loadable one
        self.generation_config = getattr(model, "generation_config", None)
        self.moe_top_k = int(getattr(model.config, "num_experts_per_tok", 0)) if is_moe(model) else 0
        self.num_experts = int(getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0))
        self.reference = (ReferencePolicy(model, learner.entropy_chunk_tokens, self.device)
                          if algo.kl.needs_reference else None)  # copied before any sharding
        self.backend = make_backend(learner.backend, model, learner, self.world_size, compute_dtype=DTYPES[dtype])
        self.model = self.backend.module
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.version = 0
        self.entropy = EntropySchedule(algo)
        self.entropy_ctl = self.entropy.controller  # None without adaptive control
        self.proximal = ProximalLogprobs()  # decoupled PPO's pi_prox of the open rollout batch
        self.max_response_tokens = max_response_tokens  # the off-policy metrics' length quarters

    def batch_endpoint(self) -> str:
        return self.batches.endpoint

    def _forward(self, mb):
        with self.backend.autocast():
            return policy_forward(self.model, mb, self.cfg.entropy_chunk_tokens, self.device, moe=bool(self.moe_top_k))

    def _reference_logprobs(self, mb):
        with self.backend.autocast():  # the policy's numerics: KL is 0 right after a reset
            return self.reference.logprobs(mb)

    def _micro_batches(self, chunks) -> tuple[list, int]:
        """This rank's micro-batches, and how many zero-loss ones it must add to match the
        busiest rank (sharded backends run collectives in every forward and backward)."""
        mbs = [collate(c, self.pad_id) for c in micro_batches(chunks, self.cfg.micro_batch_tokens)]
        mbs = [mb for mb in mbs if mb.num_loss_tokens]  # the loss step skips those: no forward to match
        pad = collectives.max_over_ranks(len(mbs)) - len(mbs) if self.distributed else 0
        self.backend.expect_backwards(len(mbs) + pad)
        return mbs, pad

    def _padding(self, count: int, grad: bool, moe: MoeStep | None = None) -> None:
        """`count` forwards (and backwards) that change nothing, in step with the other ranks; each
        backward's graph is a real micro-batch's (`padding_loss`; `moe` as forward_backward gets it)."""
        for _ in range(count):
            with torch.set_grad_enabled(grad):
                out = self._forward(collate([empty_chunk(self.pad_id)], self.pad_id))
            if grad:
                self.backend.backward(padding_loss(out, self.algo, moe))

    @torch.no_grad()
    def _open_rollout_batch(self, batch) -> float | None:
        """The step opens a rollout batch: a no-grad pass over this rank's share of its responses
        under the current policy gives pi_prox for the batch's steps (decoupled PPO; the ranks sum
        their parts, each filling its own slots of the batch's layout, so all hold all of it) and
        the batch's mean entropy, over all ranks (exact entropy control's e_k)."""
        mbs = [collate(c, self.pad_id) for c in micro_batches(batch.opened, self.cfg.micro_batch_tokens)]
        pad = collectives.max_over_ranks(len(mbs)) - len(mbs) if self.distributed else 0
        mine, entropy = [], 0.0
        for mb in mbs:
            out = self._forward(mb)
            mine.append(out.logprobs.double().cpu())
            entropy += float(out.entropy.double().sum())
        self._padding(pad, grad=False)
        layout = batch.opened_layout
        num_tokens = sum(s.num_tokens for s in layout)
        if self.distributed:
            entropy = collectives.sum_over_ranks(entropy)
        if self.algo.decoupled:
            values = torch.zeros(num_tokens, dtype=torch.float64)
            start = sum(s.num_tokens for s in layout[:batch.opened_offset])
            if mine:
                values[start:start + sum(t.numel() for t in mine)] = torch.cat(mine)
            if self.distributed:
                values = collectives.sum_tensor_over_ranks(values)
            self.proximal.open(layout, values.float())
        return entropy / num_tokens if num_tokens else None

    def _measure(self, mbs, pad: int, num_tokens: int, exact: bool) -> tuple[float | None, MoeStep | None]:
        """The no-grad pass over the step before its update, when something needs it, over all
        ranks: with `exact`, e_k, the current policy's mean entropy over the step's loss tokens
        (exact entropy control of a step that is its own rollout batch), and the MoE step's
        routed positions and expert fractions f (when the load-balance loss trains). One forward
        serves both."""
        routing = bool(self.moe_top_k) and self.algo.moe_aux_loss_coef > 0
        entropy, counts = None, None
        if exact or routing:
            entropy, counts = measure_pass(self._forward, mbs, self.moe_top_k if routing else 0, self.num_experts)
            self._padding(pad, grad=False)
            if self.distributed:
                entropy = collectives.sum_over_ranks(entropy)
                counts = collectives.sum_tensor_over_ranks(counts) if counts is not None else None
        moe = None
        if self.moe_top_k:
            positions = routed_positions(mbs)
            positions = int(collectives.sum_over_ranks(positions)) if self.distributed else positions
            moe = MoeStep(self.moe_top_k, self.num_experts, positions, None if counts is None else fractions(counts))
        return (entropy / max(num_tokens, 1) if exact else None), moe

    def train_step(self, step: int, reset_reference: bool = False) -> StepResult:
        """Receive this rank's part of the step, do one optimizer step, advance the version; then
        reset the reference if a trigger fires (`reset_reference`: a request from the operator)."""
        t0 = time.monotonic()
        metrics = self._accumulate(step)
        grad_norm = self.backend.step(self.cfg.grad_clip)
        self.version += 1
        metrics.update({
            "learner/grad_norm": grad_norm,
            "learner/optimizer_steps": self.backend.optimizer_steps(),
            "timing/learner_compute_s": time.monotonic() - t0 - metrics["timing/learner_wait_batch_s"],
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

    def gradients(self, step: int) -> dict[str, torch.Tensor]:
        """Receive the step's part and return the full gradient it gives (summed over ranks),
        without an optimizer step: for inspecting gradients, and for the tests that check that
        every backend and split gives the single-rank gradient. Collective."""
        self._accumulate(step)
        grads = {name: g.cpu() for name, g in self.backend.full_grads().items()}
        self.backend.zero_grad()
        return grads

    def _accumulate(self, step: int) -> dict[str, float]:
        """Receive the part, run its micro-batches (and padding) forward and backward."""
        t0 = time.monotonic()
        batch = self.batches.recv(self.batch_timeout_s)
        if batch is None:
            raise TimeoutError(f"learner rank {self.rank}: no batch for step {step} within {self.batch_timeout_s}s")
        if batch.step != step:
            raise RuntimeError(f"learner rank {self.rank}: expected the batch of step {step}, got step {batch.step}")
        t1 = time.monotonic()
        measured = None
        if batch.role == "open" and batch.opened_layout:
            measured = self._open_rollout_batch(batch)
        mbs, pad = self._micro_batches(batch.chunks)
        counts = StepCounts(batch.num_loss_tokens_global, batch.num_sequences_global, batch.token_budget)
        step_measured, moe = self._measure(mbs, pad, counts.num_tokens, self.entropy.exact and batch.role == "own")
        if self.entropy.sampled and self.entropy.needs_measure(batch.role):
            measured = step_measured = self._sampled_nll(batch, counts.num_tokens)
        alpha, ctl_metrics = self.entropy.coef(batch.role, measured if batch.role == "open" else step_measured)
        # the padding first: forward_backward ends in an all-reduce of the step's metrics, which a
        # rank with fewer micro-batches would otherwise enter while the others still run forwards
        # and backwards, whose collectives (FSDP2, ZeRO-3 gathers) it would never join: a hang
        proximal = self.proximal.lookup if batch.role != "own" else None
        cut = math.inf
        if self.algo.policy_loss == "m2po":
            log_ratio = m2po_log_ratios(self._forward, mbs, self.algo, proximal)
            self._padding(pad, grad=False)  # before the gather: the others may still run forwards
            cut = m2po_threshold(collectives.cat_over_ranks(log_ratio) if self.distributed else log_ratio,
                                 self.algo.m2po_tau)
        self._padding(pad, grad=True, moe=moe)
        metrics = forward_backward(self._forward, mbs, self.algo, counts, entropy_coef=alpha,
                                   ref_logprobs=self._reference_logprobs if self.reference else None,
                                   proximal=proximal, moe=moe, backward=self.backend.backward,
                                   reduce=collectives.all_reduce_tally if self.distributed else None, m2po_cut=cut,
                                   version=self.version if self.cfg.offpolicy_metrics else None,
                                   max_response_tokens=self.max_response_tokens)
        self.entropy.observe(metrics["entropy/learner"], metrics["learner/loss_tokens"])
        return {**metrics, **ctl_metrics, **self._rank_metrics(batch.chunks),
                "entropy/coef": alpha, "learner/opens_rollout_batch": float(batch.role != "continue"),
                "timing/learner_wait_batch_s": t1 - t0}

    def _sampled_nll(self, batch, step_tokens: int) -> float | None:
        """sampled_nll's e_k: over the rollout batch the step opens, or the step's own tokens."""
        opens = batch.role == "open"
        chunks = batch.opened if opens else batch.chunks
        num_tokens = sum(s.num_tokens for s in batch.opened_layout) if opens else step_tokens
        total = sampled_nll_sum(chunks)
        if self.distributed:
            total = collectives.sum_over_ranks(total)
        return total / num_tokens if num_tokens else None

    def _rank_metrics(self, chunks) -> dict[str, float]:
        """How the step was split: loss tokens and forward tokens (context included) per rank."""
        mine = [sum(c.num_loss_tokens for c in chunks), sum(c.num_tokens for c in chunks)]
        per_rank = collectives.gather_over_ranks(mine) if self.distributed else [mine]
        out: dict[str, float] = {"learner/ranks": self.world_size}
        for r, (loss_tokens, tokens) in enumerate(per_rank):
            out[f"learner/loss_tokens_rank{r}"] = loss_tokens
            out[f"learner/tokens_rank{r}"] = tokens
        return out

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta and a fresh optimizer state (ProRL section 3.3.1). Collective."""
        if self.reference is None:
            raise ValueError("no reference policy to reset: set algo.kl.coef > 0 or algo.kl.track=true")
        self.reference.reset_from(self.backend.named_full_params())
        self.backend.reset_optimizer()

    def algo_state(self) -> dict[str, Any]:
        """The algorithm's state for a checkpoint (the reference weights travel separately)."""
        return {**self.entropy.state_dict(), "num_reference_resets": self.reference.num_resets if self.reference else 0}

    def load_algo_state(self, state: dict[str, Any]) -> None:
        self.entropy.load_state_dict(state)
        if self.reference is not None:
            self.reference.num_resets = int(state.get("num_reference_resets", 0))

    # -- weights (every rank calls these: gathering a sharded parameter is collective) ---------

    def init_weight_sync(self, kind: str, host: str, port: int, world_size: int, timeout_s: float,
                         bucket_bytes: int) -> None:
        """Rank 0 joins the weight-sync group (the other ranks only help gather)."""
        from asyncrl.sync import make_sender

        if self.rank != 0:
            return
        if kind == "gloo" and self.device.type == "cuda":
            raise ValueError("sync.type=gloo cannot push from a CUDA learner: gloo sends CPU tensors; "
                             "use sync.type=nccl")
        if self.sender is not None:  # a rebuilt group: the old communicator is released, not leaked
            self.sender.close()
            self.sender = None
        self.sender = make_sender(kind, host=host, port=port, world_size=world_size,
                                  timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self.sender.connect()

    def weight_metadata(self) -> dict[str, Any]:
        """Rank 0 only: planned from names, shapes and the engines' dtype, nothing gathered."""
        specs = [(name, shape, self.engine_dtype) for name, shape, _ in self.backend.param_specs()]
        return self.sender.metadata(meta_params(specs))

    def push_weights(self, version: int) -> dict[str, float]:
        """Broadcast the current weights, `version` (the engines receive concurrently and are told
        the same number; this rank's own must agree); on a sharded learner every rank gathers one
        parameter at a time and rank 0 sends it on."""
        if version != self.version:
            raise WeightSyncError(f"asked to push version {version}, but the learner holds version {self.version}")
        params = self.backend.named_full_params()
        if self.rank != 0:
            for _ in params:
                pass
            return {}
        return self.sender.push(engine_weights(params, self.engine_dtype), version)

    # -- inspection ---------------------------------------------------------------------------

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1 at temperature 1 (the parity probe)."""
        ids = torch.tensor([token_ids], device=self.device)
        with self.backend.autocast():
            logits = self.model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        return logp.cpu().tolist()

    @torch.no_grad()
    def param_fingerprint(self) -> float:
        return float(sum(p.double().abs().sum() for _, p in self.backend.named_full_params()))

    def answer_storage_probe(self, probe: str, answer: str, token: str) -> str:
        """Rank 0: if the file `probe` (the driver's) holds `token`, write it to `answer`; this
        node's address either way (the storage contract, orchestrator/checkpoint.py)."""
        if self.rank == 0 and Path(probe).is_file() and Path(probe).read_text() == token:
            Path(answer).write_text(token)
        return own_address()

    def save(self, path: str) -> str:
        """The policy in Hugging Face format (rank 0 writes; every rank helps gather)."""
        state = {name: t.cpu().contiguous() for name, t in self.backend.named_full_params()}
        out = Path(path)
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            save_hf_model(out, state, self.hf_config, self.generation_config)
            self.tokenizer.save_pretrained(out)
            (out / "algo_state.json").write_text(json.dumps(self.algo_state(), indent=2))
        return str(out)

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """The policy in HF format under `path/policy`, everything else in `path/learner.pt`."""
        t0 = time.monotonic()
        self.save(str(Path(path) / "policy"))
        optimizer = self.backend.optimizer_state()
        if self.rank == 0:
            torch.save({"version": self.version, "optimizer": optimizer,
                        "reference": self.reference.model.state_dict() if self.reference else None,
                        "algo": self.algo_state(), "proximal": self.proximal.state_dict(),
                        "torch_rng": torch.get_rng_state(),
                        "ranks": self.world_size}, Path(path) / "learner.pt")
        return {"version": self.version, "save_s": time.monotonic() - t0}

    def load_checkpoint(self, path: str) -> int:
        """Restore what `save_checkpoint` wrote, with any number of ranks; the policy weights come
        from `path/policy`, which the learner must have been built from. Returns the version."""
        state = torch.load(Path(path) / "learner.pt", map_location="cpu", weights_only=False)
        self.backend.load_optimizer_state(state["optimizer"])
        if self.reference is not None:
            if state["reference"] is None:
                raise ValueError(f"{path} holds no reference policy, but this run's algo.kl needs one")
            self.reference.model.load_state_dict(state["reference"])
        self.load_algo_state(state["algo"])
        self.proximal.load_state_dict(state.get("proximal"))  # absent in older checkpoints
        torch.set_rng_state(state["torch_rng"])
        self.version = int(state["version"])
        return self.version

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.batches.close()


def engine_weights(named_params, dtype: torch.dtype):
    """The parameters as the engines hold them: cast to their dtype one at a time, as they are sent."""
    for name, tensor in named_params:
        yield name, tensor.to(dtype)


def param_dtype(learner: LearnerConfig, compute: str) -> torch.dtype:
    """The parameters' dtype: learner.param_dtype, or float64 when the compute dtype is float64.
    float64 compute is not a config value (engines have none); it is for checks that must not
    depend on the order in which a processor sums float32 (the learner-rank tests)."""
    return torch.float64 if compute == "float64" else DTYPES[learner.param_dtype]
