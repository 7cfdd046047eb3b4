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

A step's work, from the batch to the gradient, is `PolicyStep`'s (step.py), which also holds the
algorithm's state across steps (entropy schedule, reference policy, pi_prox of the open rollout
batch); the rank is the process around it: the batch socket, the optimizer step and the
version, the weight-sync sender, checkpoints. `save_checkpoint` / `load_checkpoint` write and
read the whole group's state independent of the number of ranks: policy (Hugging Face format),
optimizer state, reference policy, algorithm state (pi_prox included: every rank holds all of
it), version and torch RNG, so a resumed run's next step is bit-identical on CPU and a checkpoint
of N ranks resumes on M. On FSDP2 no rank holds the whole optimizer state or reference at any
point: they are written and read as each rank's shards (torch.distributed.checkpoint), the
policy's files one gathered parameter at a time, and a starting rank reads only its own rows of
the model (sharded_load.py).

Three dtypes, each its own: the parameters (`learner.param_dtype`, float32 masters by default),
the compute dtype of every forward (`dtype`, model.dtype: the backend autocasts to it), and the
engines' weights (`engine_dtype`: rollout.dtype, else model.dtype): pushes cast each parameter to
it on the way out (FSDP2 casts each rank's shard before the gather: a bf16 push gathers half the
bytes), while checkpoints keep the masters.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.algo.kl import should_reset_reference
from asyncrl.compat import check_gpu_visibility, hide_broken_torch_extras
from asyncrl.config import AlgoConfig, LearnerConfig
from asyncrl.learner import make_backend
from asyncrl.learner.backend import MOMENTS, init_process_group
from asyncrl.learner.hf_files import meta_params, save_hf_model
from asyncrl.learner import lora as lora_files
from asyncrl.learner.model_forward import packing_is_exact
from asyncrl.learner.packed_attention import use_packed_attention
from asyncrl.learner.phases import phase
from asyncrl.learner.reference import AdapterReference, ReferencePolicy
from asyncrl.learner.replay import install as install_replay
from asyncrl.learner.replay import replay_of
from asyncrl.learner.routers import use_fp32_routers
from asyncrl.learner.sharded_load import load_own_rows, meta_model, missing_from_files
from asyncrl.learner.step import PolicyStep, moe_shape
from asyncrl.observe.worker_logs import redirect_output
from asyncrl.sync.protocol import WeightSyncError
from asyncrl.sync.wire import free_port, own_address
from asyncrl.transport.codec import decode_batch
from asyncrl.transport.zmq_stream import FrameReceiver
from asyncrl.types import Locate, ReferenceReset, StepResult

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class LearnerRank:
    def __init__(self, model_path: str, learner: LearnerConfig, algo: AlgoConfig, dtype: str = "float32",
                 engine_dtype: str | None = None,
                 seed: int = 0, host: str | None = None, batch_timeout_s: float = 600.0, rank: int = 0,
                 world_size: int = 1, group_address: str | None = None, locate: Locate | None = None,
                 max_response_tokens: int = 0):
        redirect_output()  # to the run's logs/ when the orchestrator asked
        hide_broken_torch_extras()
        check_gpu_visibility("learner rank", "learner.num_gpus", learner.num_gpus)
        if not torch.cuda.is_available():
            torch.set_num_threads(learner.num_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.rank, self.world_size = rank, world_size
        host = host or own_address()  # every bind on this rank's own node (None: found here)
        if distributed(learner, world_size):
            init_process_group(rank, world_size, group_address or f"{host}:{free_port(host)}", batch_timeout_s,
                               local_host=host)
        self.batches = FrameReceiver(lambda frame: [decode_batch(frame)], host=host)
        self.batch_timeout_s = batch_timeout_s
        self.sender = None
        self.reset(model_path, learner, algo, dtype, engine_dtype, seed, locate, max_response_tokens)

    def reset(self, model_path: str, learner: LearnerConfig, algo: AlgoConfig, dtype: str = "float32",
              engine_dtype: str | None = None, seed: int = 0, locate: Locate | None = None,
              max_response_tokens: int = 0, log_file: str | None = None) -> None:
        """A fresh run's learner in this process: the model loaded from `model_path`, a new optimizer,
        reference, entropy schedule and version 0. The process group, the batch socket and the
        weight-sync group stay (a study's runs share them: asyncrl/orchestrator/warm.py); the
        process-shaping fields (backend, ranks, parameter dtype) must be the ones it started with."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if log_file:
            redirect_output(log_file)
        torch.manual_seed(seed)
        if locate is not None:  # the built-in model: this node's own build (types.Locate)
            model_path = locate(model_path)
        self.cfg = learner
        self.lora = learner.lora.enabled
        # an adapter directory (a LoRA run's checkpoint or final policy) loads its base, then the adapter
        adapter_dir = model_path if lora_files.is_adapter_dir(model_path) else None
        if adapter_dir and not self.lora:
            raise ValueError(f"{model_path} holds a LoRA adapter: set learner.lora (its rank and targets) to train it")
        model_path = lora_files.adapter_base(adapter_dir) if adapter_dir else model_path
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.engine_dtype = DTYPES[engine_dtype or dtype]  # the engines' (rollout.dtype, else model.dtype)
        params = param_dtype(learner, dtype)
        # the MoE experts' default kernel (grouped_mm) has no float64
        kernels = {"experts_implementation": "eager"} if params == torch.float64 else {}
        # the frozen base as the engines hold it: no float32 copy (DeepSpeed wants float32 parameters and
        # casts the module to bf16 itself, keeping float32 masters of the trained ones only)
        if self.lora and params != torch.float64 and learner.backend != "deepspeed":
            params = self.engine_dtype
        # several FSDP2 ranks: each builds the model without weights and reads its own shard (sharded_load.py);
        # a LoRA base is loaded whole (peft renames the layers it wraps) in the engines' dtype, then sharded
        model, whole = None, not (learner.backend == "torch" and self.world_size > 1 and not self.lora)
        if not whole:
            model = meta_model(model_path, params, **kernels)
            why = missing_from_files(model, model_path)
            if why:
                log.warning("each learner rank loads the whole model before sharding it: %s", why)
                model, whole = None, True
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=params, **kernels).to(self.device)
        self.load_mode = "whole" if whole else "own rows"
        model.train()
        if learner.pack_sequences:  # packed rows at each sequence's own attention cost (packed_attention.py)
            use_packed_attention(model)
        if learner.head_dtype == "float32":  # MoE routers too (routers.py)
            use_fp32_routers(model)
        if algo.moe_routing == "replay":  # before the reference is copied: it replays too (replay.py)
            install_replay(model)
        if learner.activation_checkpointing:  # before any sharding wraps the layers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.files = PolicyFiles(tokenizer, model.config, generation_config(model_path, model), model_path)
        if self.lora:
            model = lora_files.apply_lora(model, learner.lora, adapter_dir)
        head_fp32 = learner.head_dtype == "float32"
        reference = (ReferencePolicy(model, learner.entropy_chunk_tokens, self.device, head_fp32)
                     if algo.kl.needs_reference and not self.lora else None)  # copied before any sharding
        moe = moe_shape(model)
        # whether packing is exact needs one whole model: checked before sharding, or on the shards together
        packed = learner.pack_sequences and whole and packing_is_exact(model, self.device)
        self.backend = make_backend(learner.backend, model, learner, self.world_size, compute_dtype=DTYPES[dtype])
        if not whole:
            load_own_rows(self.backend.module, model_path, self.device)
            packed = learner.pack_sequences and packing_is_exact(self.backend.module, self.device)
            self.backend.module.reshard()  # the check's forward left the root gathered
        if reference is not None:
            reference.place(self.backend)
        if self.lora and algo.kl.needs_reference:  # the base itself: the policy with its adapter off
            reference = AdapterReference(self.backend, learner.entropy_chunk_tokens, self.device, head_fp32)
        if learner.pack_sequences and not packed:
            log.warning("learner.pack_sequences: %s mixes packed sequences (its attention ignores position ids); "
                        "micro-batches are padded", type(model).__name__)
        self.version = 0
        self.step = PolicyStep(self.backend, learner, algo, self.device, self.world_size,
                               distributed(learner, self.world_size), tokenizer.pad_token_id or 0, reference,
                               moe, max_response_tokens, packed)

    @property
    def model(self) -> torch.nn.Module:
        """The policy as the backend wraps it (FSDP2, a DeepSpeed engine's module)."""
        return self.backend.module

    def batch_endpoint(self) -> str:
        return self.batches.endpoint

    def train_step(self, step: int, reset_reference: bool = False) -> StepResult:
        """Receive this rank's part of the step, do one optimizer step, advance the version; then
        reset the reference if a trigger fires (`reset_reference`: a request from the operator)."""
        t0 = time.monotonic()
        metrics = self._accumulate(step)
        with phase("optimizer"):
            grad_norm = self.backend.step(self.cfg.grad_clip)
        self.version += 1
        metrics.update({
            "learner/grad_norm": grad_norm,
            "learner/optimizer_steps": self.backend.optimizer_steps(),
            "learner/trainable_params": sum(s.numel() for _, s, _ in self.backend.param_specs(trainable_only=True)),
            "timing/learner_compute_s": time.monotonic() - t0 - metrics["timing/learner_wait_batch_s"],
        })
        events: list[ReferenceReset] = []
        reference = self.step.reference
        if reference is not None:
            kl = self.step.algo.kl
            fire, why = should_reset_reference(step, metrics["kl/mean"], kl.reset_every, kl.reset_kl_threshold,
                                               requested=reset_reference)
            if fire:
                self.step.reset_reference()
                events.append(ReferenceReset(why, metrics["kl/mean"]))
            metrics["kl/resets_total"] = reference.num_resets
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
        return {**self.step.run(batch, self.version), "timing/learner_wait_batch_s": t1 - t0}

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta and a fresh optimizer state (ProRL section 3.3.1). Collective."""
        self.step.reset_reference()

    # -- weights (every rank calls these: gathering a sharded parameter is collective) ---------

    def init_weight_sync(self, kind: str, host: str, port: int, world_size: int, timeout_s: float,
                         bucket_bytes: int, transfer: str = "full", full_every: int = 0,
                         join_timeout_s: float | None = None) -> None:
        """Rank 0 joins the weight-sync group (the other ranks only help gather): within
        join_timeout_s (default timeout_s), each push within timeout_s."""
        from asyncrl.sync import make_sender

        if self.rank != 0:
            return
        if kind == "gloo" and self.device.type == "cuda" and not self.lora:  # an adapter is copied to the CPU
            raise ValueError("sync.type=gloo cannot push from a CUDA learner: gloo sends CPU tensors; "
                             "use sync.type=nccl")
        if self.sender is not None:  # a rebuilt group: the old communicator is released, not leaked
            self.sender.close()
            self.sender = None
        self.sender = make_sender(kind, host=host, port=port, world_size=world_size, timeout_s=timeout_s,
                                  bucket_bytes=bucket_bytes, transfer=transfer, full_every=full_every,
                                  join_timeout_s=join_timeout_s)
        self.sender.connect()

    def weight_metadata(self) -> dict[str, Any]:
        """Rank 0 only: planned from names, shapes and the engines' dtype, nothing gathered. A LoRA
        policy's pushes carry its adapter alone, with the adapter's config for the engines."""
        specs = [(self._wire(name), shape, self.engine_dtype)
                 for name, shape, _ in self.backend.param_specs(trainable_only=self.lora)]
        metadata = self.sender.metadata(meta_params(specs))
        if self.lora:
            metadata["update_info"]["adapter"] = lora_files.adapter_config(self.model, self.files.base_path)
        return metadata

    def _wire(self, name: str) -> str:
        return lora_files.wire_name(name) if self.lora else name

    def _pushed(self, dtype: torch.dtype | None = None):
        """What a push sends, gathered one at a time (cast to `dtype` first where the backend can):
        every parameter, or a LoRA policy's adapter."""
        for name, tensor in self.backend.named_full_params(trainable_only=self.lora, dtype=dtype):
            # an adapter goes over gloo from GPU learners too: a few MB, copied to the CPU
            yield (self._wire(name), tensor.cpu()) if self.lora else (name, tensor)

    def push_weights(self, version: int, whole: bool = False) -> dict[str, float]:
        """Broadcast the current weights, `version` (the engines receive concurrently and are told
        the same number; this rank's own must agree); on a sharded learner every rank gathers one
        parameter at a time and rank 0 sends it on."""
        if version != self.version:
            raise WeightSyncError(f"asked to push version {version}, but the learner holds version {self.version}")
        params = self._pushed(self.engine_dtype)
        if self.rank != 0:
            for _ in params:
                pass
            return {}
        try:
            return self.sender.push(params, version, whole=whole)
        finally:  # a push that failed midway: gather on to the end, or the other ranks wait in a gather for ever
            for _ in params:
                pass

    # -- inspection ---------------------------------------------------------------------------

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1 at temperature 1 (the parity probe)."""
        ids = torch.tensor([token_ids], device=self.device)
        replay = replay_of(self.model)
        if replay is not None:  # the probe has no recorded routing: the routers choose (not the last step's rows)
            replay.use(None)
        with self.backend.autocast():
            logits = self.model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        return logp.cpu().tolist()

    @torch.no_grad()
    def param_fingerprint(self) -> float:
        return float(sum(p.double().abs().sum() for _, p in self.backend.named_full_params()))

    def answer_storage_probe(self, probe: str, answer: str, token: str) -> str:
        """If the file `probe` (the driver's) holds `token`, write it to `<answer>.<rank>`; this
        node's address either way (the storage contract, orchestrator/checkpoint.py: every rank
        writes its own shards of a checkpoint)."""
        if Path(probe).is_file() and Path(probe).read_text() == token:
            Path(f"{answer}.{self.rank}").write_text(token)
        return own_address()

    def save(self, path: str, merged: bool = False) -> str:
        """The policy in Hugging Face format: every rank helps gather one parameter at a time,
        rank 0 writes them as they come (hf_files.py). A LoRA policy: its adapter in peft's
        format (a model path all the same, lora.py), and with `merged` also a plain Hugging Face
        model of the base with the adapter merged in, under `path/merged`."""
        params = self._pushed() if self.lora else self.backend.named_full_params()
        out = Path(path)
        if self.rank != 0:
            for _ in params:
                pass
            if self.lora and merged:
                for _ in self.backend.named_full_params():
                    pass
            return str(out)
        out.mkdir(parents=True, exist_ok=True)
        if self.lora:
            lora_files.write_adapter(out, params, lora_files.adapter_config(self.model, self.files.base_path))
            if merged:
                tied, config = lora_files.untied_head(self.model), self.files.config
                if tied is not None:  # an adapter on the tied head or embedding: they differ now
                    config = copy.deepcopy(config)
                    config.tie_word_embeddings = False
                save_hf_model(out / "merged", lora_files.merge_stream(self.backend.named_full_params(), self.cfg.lora,
                                                                      tied), config, self.files.generation_config)
                self.files.tokenizer.save_pretrained(out / "merged")
        else:
            save_hf_model(out, params, self.files.config, self.files.generation_config)
        self.files.tokenizer.save_pretrained(out)
        (out / "algo_state.json").write_text(json.dumps(self.step.state_dict(), indent=2))
        return str(out)

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """The policy in Hugging Face format under `path/policy`; Adam's moments and the reference
        policy under `path/state` as torch.distributed.checkpoint writes them (each rank its own
        shards, nothing gathered, loadable on any number of ranks); the rest in `path/learner.pt`."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        t0 = time.monotonic()
        self.save(str(Path(path) / "policy"))
        optimizer, reference = self.backend.optimizer_state(), self.step.reference
        dcp.save({"optimizer": {key: optimizer[key] for key in MOMENTS},
                  "reference": reference.state_dict() if reference else {}},
                 checkpoint_id=str(Path(path) / "state"), no_dist=not dist.is_initialized())
        if self.rank == 0:
            torch.save({"version": self.version, "optimizer_steps": optimizer["step"],
                        "moments": sorted(optimizer["exp_avg"]), "reference": reference is not None,
                        "algo": self.step.state_dict(), "proximal": self.step.proximal.state_dict(),
                        "torch_rng": torch.get_rng_state(),
                        "ranks": self.world_size}, Path(path) / "learner.pt")
        return {"version": self.version, "save_s": time.monotonic() - t0}

    def load_checkpoint(self, path: str) -> int:
        """Restore what `save_checkpoint` wrote, with any number of ranks; the policy weights come
        from `path/policy`, which the learner must have been built from. Returns the version."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        state = torch.load(Path(path) / "learner.pt", map_location="cpu", weights_only=False)
        reference = self.step.reference
        if reference is not None and not state["reference"]:
            raise ValueError(f"{path} holds no reference policy, but this run's algo.kl needs one")
        if "optimizer" in state:  # written before the sharded state: full tensors in learner.pt
            self.backend.load_optimizer_state(state["optimizer"])
            if reference is not None:
                reference.load_state_dict(state["reference"])
        else:
            sharded = {"optimizer": self.backend.optimizer_template(state["moments"]),
                       "reference": reference.state_dict() if reference else {}}
            # in place, each rank its own rows
            dcp.load(sharded, checkpoint_id=str(Path(path) / "state"), no_dist=not dist.is_initialized())
            self.backend.load_optimizer_state({"step": state["optimizer_steps"], **sharded["optimizer"]})
            if reference is not None:
                reference.load_state_dict(sharded["reference"])
        self.step.load_state_dict(state["algo"])
        self.step.proximal.load_state_dict(state.get("proximal"))  # absent in older checkpoints
        torch.set_rng_state(state["torch_rng"])
        self.version = int(state["version"])
        return self.version

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.batches.close()


@dataclass(frozen=True)
class PolicyFiles:
    """What a saved policy holds besides its weights, as read at start."""

    tokenizer: Any
    config: Any
    """The model's config, saved as is: a wrapped model's class name is not a loadable one."""
    generation_config: Any
    base_path: str
    """The model directory loaded (a LoRA adapter's base): what a saved adapter names as its base."""


def generation_config(model_path: str, model: torch.nn.Module):
    """The generation config saved beside the policy: the directory's, else the one the model
    class derives from its config (a model built from its config alone never reads the file)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return getattr(model, "generation_config", None)


def param_dtype(learner: LearnerConfig, compute: str) -> torch.dtype:
    """The parameters' dtype: learner.param_dtype, or float64 when the compute dtype is float64.
    float64 compute is not a config value (engines have none); it is for checks that must not
    depend on the order in which a processor sums float32 (the learner-rank tests)."""
    return torch.float64 if compute == "float64" else DTYPES[learner.param_dtype]


def distributed(learner: LearnerConfig, world_size: int) -> bool:
    """Whether the ranks form a process group: a single torch rank needs none; DeepSpeed always
    wants one."""
    return world_size > 1 or learner.backend == "deepspeed"
