"""Learner ranks in real torch.distributed groups (gloo, one process each): 2 ranks with FSDP2,
DeepSpeed ZeRO-2 and ZeRO-3 give the single-rank gradient for every aggregation mode, with the
step's responses split across ranks and micro-batches (ranks with fewer micro-batches pad), and
the same parameters after optimizer steps; metrics are global; checkpoints move between rank
counts.

How two sides are compared. Two ranks sum a gradient in another order than one rank, and a
processor's vector width changes the order again (AVX2 and AVX-512 round float32 sums
differently), so a check must hold for any order of summation:

- The torch backend (FSDP2) runs in float64 (`LearnerRank(dtype="float64")`, `F64`). Unit
  roundoff u = 1.1e-16: the gradients differ by 6e-17 and the parameters after 3 steps by 1e-15
  (measured); the checks allow 1e-13 and the bound below (1.8e-7).
- DeepSpeed has no float64 path (measured: in float64 ZeRO-2's gradients came out 2e-2 off and
  ZeRO-3's 2e-9, float32 rounding), so it runs float32 against a float32 single rank (`F32`):
  * gradients within `F32_GRAD_TOL` = 1e-6. Each coordinate is a float32 sum over the step's
    tokens of products over the model's widths (n ~ 10^2 terms of size <= ||g||_inf = 0.031):
    two summation orders differ by ~sqrt(n) u ||g||_inf ~ 2e-8, at worst n u sum|t| ~ 2e-5.
    Measured 4e-8 (AVX-512 and AVX2); a gradient missing a rank's share is off by ~1e-2.
  * parameters after k AdamW steps within `Precision.param_tol(k, lr)` = k lr 3 (2 F32_GRAD_TOL) / eps.
    An update lr m/(sqrt(v) + eps), its gradient off by dg, moves by at most
    lr (|dm| + |m|/sqrt(v) |d sqrt(v)|) / eps; |dm| and |d sqrt(v)| are at most dg (both are
    weighted means over the steps), and |m|/sqrt(v) <= 1.01 for 6 steps of betas (0.9, 0.99)
    (Cauchy-Schwarz), so <= 3 lr dg / eps a step. dg is 2 F32_GRAD_TOL: the clip's scale adds
    |g| times the global norm's relative error (<= 1e-5, checked) ~ 3e-7. With torch's default
    eps = 1e-8 the bound is ~2 lr a step, no check at all (a coordinate whose true gradient is
    ~0 takes the sign of its rounding noise: the 1.2e-6 that failed on AVX-512 against a fixed
    1e-6), so these runs use eps = 1e-3: 1.8e-5 after 3 steps at lr 1e-3 (measured 3.7e-9).
    A clip norm 20% off on two ranks moves parameters by 1.5e-4; a lost moment or a rank's
    gradient missing, by ~lr. (eps far above every |g| would tighten the bound further but
    make Adam an SGD whose second moment no check could see.)
"""

import dataclasses
import multiprocessing as mp
import os
import random
import sys
import traceback
from dataclasses import dataclass

import pytest
import torch

from asyncrl.buffer.packing import rank_batches, split_for_ranks
from asyncrl.learner.micro_batches import micro_batches
from asyncrl.config import AlgoConfig, LearnerConfig
from asyncrl.learner.rank import LearnerRank
from asyncrl.sync.protocol import WeightSyncError
from asyncrl.sync.wire import free_port
from asyncrl.transport.codec import encode_batch
from asyncrl.transport.zmq_stream import FrameSender
from asyncrl.types import Batch, SequenceChunk

VOCAB = 48  # token ids drawn below it
MODES = ["budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
STEPS = 3
BUDGET = 64
LR = 1e-3
# the optimizer steps also run the learner's state: adaptive entropy control fed the measured
# e_k (target above it, so alpha grows from 0) and a KL term whose reference resets at step 2
STEP_ALGO = AlgoConfig(aggregation="token_mean",
                       entropy_control={"enabled": True, "target": 10.0, "delta": 0.05, "coef_max": None},
                       kl={"coef": 0.01, "reset_every": 2})


@dataclass(frozen=True)
class Precision:
    """How one backend's two sides run and how close they must be (module docstring)."""
    dtype: str  # the learner's compute dtype; float64 loads the parameters in float64 too
    eps: float  # AdamW's
    grad_tol: float  # largest gradient difference two summation orders can make
    metric_abs: float = 1e-7  # a step metric's (a sum over its tokens; plus rel 1e-5)

    def param_tol(self, steps: int, lr: float) -> float:
        """Parameters after `steps` AdamW steps: each moves by at most 3 lr dg / eps, with the
        clip's scale doubling dg."""
        return steps * lr * 3 * (2 * self.grad_tol) / self.eps


F32_GRAD_TOL = 1e-6
F64 = Precision("float64", eps=1e-8, grad_tol=1e-13)  # n u sum|t| ~ 1e2 * 1.1e-16 * 0.1; measured 6e-17
# a float32 metric sums n ~ 70 token terms of size <= 1/n: at worst n u sum|t| ~ 4e-6 apart
# (measured: 1.2e-7, loss/total)
F32 = Precision("float32", eps=1e-3, grad_tol=F32_GRAD_TOL, metric_abs=4e-6)
BF16 = Precision("bfloat16", eps=1e-8, grad_tol=0.0)  # its tests compare relative errors


def precision_of(backend):
    return F64 if backend == "torch" else F32


def build_model(path, tie):
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.tiny.tokenizer import save_tokenizer

    vocab = len(save_tokenizer(path))

    # no attention biases: a key bias's true gradient is 0 (softmax ignores a shift), so Adam
    # would turn its rounding noise into full-size updates that differ with summation order
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie))
    model.save_pretrained(path)
    return str(path)


def build_moe_model(path, tie=True):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from asyncrl.tiny.tokenizer import save_tokenizer

    vocab = len(save_tokenizer(path))
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie)).save_pretrained(path)
    return str(path)


def step_chunks(step):
    """Responses of different lengths; some start mid-response (the rest of a split response)."""
    rng = random.Random(step)
    out = []
    for i in range(7):
        prompt = [rng.randrange(4, VOCAB) for _ in range(3 + i % 3)]
        resp = [rng.randrange(4, VOCAB) for _ in range(2 + (5 * i) % 9)]
        start = i % 2
        n = len(resp) - start
        out.append(SequenceChunk(f"g{i}", i % 2, prompt, resp, start, [rng.uniform(-4, -1) for _ in range(n)],
                                 [step - 1] * n, advantage=rng.uniform(-1, 1)))
    return out


def with_routing(chunks, step, layers=2, experts=4, k=2):
    """The chunks with a recorded routing (distinct random experts per position and layer, seeded),
    the last position of each unrecorded, as an engine returns it."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for c in chunks:
        rows = torch.stack([torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(layers)])
                            for _ in range(c.num_tokens)]).to(torch.uint8)
        rows[-1] = 255
        out.append(dataclasses.replace(c, routed_experts=rows.numpy().tobytes()))
    return out


def feed(learner, sender, step, rank, world, routed=False):
    chunks = with_routing(step_chunks(step), step) if routed else step_chunks(step)
    part = split_for_ranks(chunks, world)[rank]
    sender.send(encode_batch(Batch(step=step, rank=rank, chunks=part,
                                   num_loss_tokens_global=sum(c.num_loss_tokens for c in chunks),
                                   num_sequences_global=len(chunks), token_budget=BUDGET)))


def group_address(port):
    """The learner group's rendezvous; a one-rank run passes port None and gets a free port (a
    one-rank DeepSpeed learner still joins a process group)."""
    return f"127.0.0.1:{port if port is not None else free_port()}"


def learner_cfg(backend, stage, world, precision=None, **kw):
    # a rank that sees CUDA must have asked for a GPU (compat.check_gpu_visibility)
    return LearnerConfig(backend=backend, num_ranks=world, deepspeed={"stage": stage}, lr=kw.pop("lr", LR),
                         micro_batch_tokens=kw.pop("micro_batch_tokens", 24),
                         eps=precision.eps if precision else LearnerConfig().eps,
                         num_gpus=1 if torch.cuda.is_available() else 0, **kw)


def mode_gradients(learner, sender, rank, world):
    """Step 1's gradient under each aggregation mode (no optimizer step)."""
    grads = {}
    for mode in MODES:
        learner.step.algo = AlgoConfig(aggregation=mode)
        feed(learner, sender, 1, rank, world)
        grads[mode] = learner.gradients(1)
    return grads


def run_rank(rank, world, port, model, backend, stage, micro_batch_tokens=24, ckpt_in=None, ckpt_out=None,
             steps=STEPS, precision=None):
    """What one rank does; returns rank 0's results: the gradient of step 1 per aggregation mode,
    then STEPS optimizer steps' metrics and the parameters after them. `precision`: the compute
    dtype and AdamW's eps (None: the backend's, `precision_of`)."""
    precision = precision or precision_of(backend)
    # clipped at 0.1: the steps' norms are above it, so the global norm must be right
    cfg = learner_cfg(backend, stage, world, precision, grad_clip=0.1, micro_batch_tokens=micro_batch_tokens)
    learner = LearnerRank(model, cfg, STEP_ALGO, dtype=precision.dtype, rank=rank, world_size=world,
                          group_address=group_address(port))
    sender = FrameSender(learner.batch_endpoint())
    grads = mode_gradients(learner, sender, rank, world)
    learner.step.algo = STEP_ALGO
    if ckpt_in:
        learner.load_checkpoint(ckpt_in)
    start = {n: t.cpu().clone() for n, t in learner.backend.named_full_params()}
    metrics = []
    for step in range(learner.version + 1, learner.version + 1 + steps):
        feed(learner, sender, step, rank, world)
        metrics.append(learner.train_step(step).metrics)
    if ckpt_out:
        learner.save_checkpoint(ckpt_out)
    params = {n: t.cpu().clone() for n, t in learner.backend.named_full_params()}
    sender.close()
    learner.shutdown()
    return {"grads": grads, "metrics": metrics, "params": params, "start": start}


MOE_ALGO = AlgoConfig(aggregation="token_mean", moe_aux_loss_coef=0.5, moe_z_loss_coef=0.05)


def run_moe_rank(rank, world, port, model, backend, stage, micro_batch_tokens=24, precision=None):
    """A MoE model's gradient of step 1 (load-balance and z-losses large enough to show), and
    one optimizer step's metrics."""
    precision = precision or precision_of(backend)
    cfg = learner_cfg(backend, stage, world, precision, micro_batch_tokens=micro_batch_tokens)
    learner = LearnerRank(model, cfg, MOE_ALGO, dtype=precision.dtype, rank=rank, world_size=world,
                          group_address=group_address(port))
    sender = FrameSender(learner.batch_endpoint())
    feed(learner, sender, 1, rank, world)
    grads = learner.gradients(1)
    feed(learner, sender, 1, rank, world)
    metrics = learner.train_step(1).metrics
    sender.close()
    learner.shutdown()
    return {"grads": grads, "metrics": metrics, "load_mode": learner.load_mode}


def run_replay_rank(rank, world, port, model, backend, stage, micro_batch_tokens=24, precision=None, replay=True):
    """Step 1's gradient with routing replay (every chunk carries a recorded routing), and one
    optimizer step's metrics; `replay` False: the learner's own routing, for contrast."""
    precision = precision or precision_of(backend)
    cfg = learner_cfg(backend, stage, world, precision, micro_batch_tokens=micro_batch_tokens)
    algo = AlgoConfig(aggregation="token_mean", moe_routing="replay" if replay else "learner")
    learner = LearnerRank(model, cfg, algo, dtype=precision.dtype, rank=rank, world_size=world,
                          group_address=group_address(port))
    sender = FrameSender(learner.batch_endpoint())
    feed(learner, sender, 1, rank, world, routed=True)
    grads = learner.gradients(1)
    feed(learner, sender, 1, rank, world, routed=True)
    metrics = learner.train_step(1).metrics
    sender.close()
    learner.shutdown()
    return {"grads": grads, "metrics": metrics}


ENTROPY_ALGO = AlgoConfig(aggregation="token_mean", entropy_control={"enabled": True, "target": 10.0, "delta": 0.05,
                                                                          "coef_max": None})


def run_entropy_rank(rank, world, port, model, backend, stage):
    """Rank 0 gets one short response, rank 1 the other six: very unequal token counts. Two
    optimizer steps of adaptive entropy control (exact e_k)."""
    cfg = learner_cfg(backend, stage, world, F64, micro_batch_tokens=4096)
    learner = LearnerRank(model, cfg, ENTROPY_ALGO, dtype=F64.dtype, rank=rank, world_size=world,
                          group_address=group_address(port))
    sender = FrameSender(learner.batch_endpoint())
    rows = []
    for step in (1, 2):
        chunks = step_chunks(step)
        parts = [chunks[:1], chunks[1:]] if world == 2 else [chunks]
        sender.send(encode_batch(Batch(step=step, rank=rank, chunks=parts[rank],
                                       num_loss_tokens_global=sum(c.num_loss_tokens for c in chunks),
                                       num_sequences_global=len(chunks), token_budget=BUDGET)))
        rows.append(learner.train_step(step).metrics)
    sender.close()
    learner.shutdown()
    return {"metrics": rows}


DECOUPLED_ALGO = AlgoConfig(decoupled=True, is_weight_cap=3.0, aggregation="token_mean")
DECOUPLED_LR = 2e-2  # ratios that reach the clip
# M2PO's cut over both ranks' tokens: q = pi_theta / pi_b, candidates where PPO's clip would act
M2PO_ALGO = AlgoConfig(decoupled=True, is_weight_cap=3.0, aggregation="token_mean", policy_loss="m2po",
                       m2po_tau=0.01, m2po_candidates="clip", eps_low=0.05, eps_high=0.05)


def run_decoupled_rank(rank, world, port, model, backend, stage, micro_batch_tokens=24, precision=None,
                       algo=DECOUPLED_ALGO):
    """Decoupled PPO over one rollout batch of 3 steps (N_SGD = 3, data reused): the whole batch,
    then its responses again in two halves; pi_prox is the batch's start policy throughout."""
    precision = precision or precision_of(backend)
    cfg = learner_cfg(backend, stage, world, precision, lr=DECOUPLED_LR, micro_batch_tokens=micro_batch_tokens)
    learner = LearnerRank(model, cfg, algo, dtype=precision.dtype, rank=rank, world_size=world,
                          group_address=group_address(port))
    sender = FrameSender(learner.batch_endpoint())
    batch = step_chunks(1)
    rows = []
    for step, (role, chunks) in enumerate([("open", batch), ("continue", batch[:4]), ("continue", batch[4:])], 1):
        sender.send(encode_batch(rank_batches(step, chunks, world, BUDGET, role, batch)[rank]))
        rows.append(learner.train_step(step).metrics)
    params = {n: t.clone() for n, t in learner.backend.named_full_params()}
    sender.close()
    learner.shutdown()
    return {"metrics": rows, "params": params}


def run_layout_rank(rank, world, port, model, ckpt):
    """What a 2-rank FSDP2 learner holds (its own rows of each parameter, the reference sharded
    too) and writes (a checkpoint after one step); rank 0's view of it."""
    from torch.distributed.tensor import DTensor

    from asyncrl.learner.sharded_load import shard_rows

    learner = LearnerRank(model, learner_cfg("torch", 2, world, F64), STEP_ALGO, dtype="float64", rank=rank,
                          world_size=world, group_address=group_address(port))
    assert learner.load_mode == "own rows"
    policy = dict(learner.model.named_parameters())
    reference = dict(learner.step.reference.model.named_parameters())
    layout = {name: (isinstance(p, DTensor), shard_rows(p), tuple(p.to_local().shape),
                     isinstance(reference[name], DTensor), torch.equal(p.to_local(), reference[name].to_local()))
              for name, p in policy.items()}
    start = {n: t.cpu().clone() for n, t in learner.backend.named_full_params()}
    buffers = {n: b.cpu().clone() for n, b in learner.model.named_buffers()}
    sender = FrameSender(learner.batch_endpoint())
    feed(learner, sender, 1, rank, world)
    learner.train_step(1)
    learner.save_checkpoint(ckpt)
    # a weight push that breaks on rank 0 after its third parameter (an engine died mid-push): rank 1
    # must not be left in a gather; the full-parameter read after it is collective and would hang
    learner.sender = BreakingSender() if rank == 0 else None
    try:
        learner.push_weights(learner.version)
        push_failed = False
    except WeightSyncError:
        push_failed = True
    after = {n: t.cpu().clone() for n, t in learner.backend.named_full_params()}
    # a push to float16 engines: each rank casts its shard, then the ranks gather (half the bytes)
    learner.engine_dtype = torch.float16
    learner.sender = RecordingSender() if rank == 0 else None
    gathered, full_tensor = [], DTensor.full_tensor
    DTensor.full_tensor = lambda self, **kw: (gathered.append(self.dtype), full_tensor(self, **kw))[1]
    try:
        learner.push_weights(learner.version)
    finally:
        DTensor.full_tensor = full_tensor
    pushed = learner.sender.pushed if rank == 0 else {}
    sender.close()
    learner.shutdown()
    return {"layout": layout, "start": start, "buffers": buffers, "push_failed": push_failed, "after_push": after,
            "pushed": pushed, "gathered_dtypes": set(gathered)}


class RecordingSender:
    """Rank 0's weight sender that keeps what it was given."""

    def __init__(self):
        self.pushed = {}

    def push(self, named, version, whole=False):
        self.pushed = {name: tensor.cpu().clone() for name, tensor in named}
        return {}

    def close(self):
        pass


class BreakingSender:
    """Rank 0's weight sender whose push fails once it has read three parameters."""

    def push(self, named, version, whole=False):
        for count, _ in enumerate(named):
            if count == 2:
                raise WeightSyncError(f"push of version {version}: an engine died mid-push (injected)")

    def close(self):
        pass


def _child(rank, world, port, args, out):
    os.environ["DS_ACCELERATOR"] = "cpu"
    targets = {"moe": run_moe_rank, "entropy": run_entropy_rank, "decoupled": run_decoupled_rank,
               "layout": run_layout_rank, "replay": run_replay_rank}
    if callable(args[0]):  # another module's rank function (test_lora_learner.py)
        target, args = args[0], args[1:]
    else:
        target, args = (targets[args[0]], args[1:]) if args[0] in targets else (run_rank, args)
    try:
        result = target(rank, world, port, *args)
        if rank == 0:  # a file, not the queue: a queued tensor's shared memory dies with its process
            torch.save(result, out)
    except BaseException:
        (out.parent / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    # Done, and what the test reads is saved and closed: exit without the interpreter's last garbage
    # collection of torch, transformers and DeepSpeed (1.2-1.7 s a rank here), a heap the OS frees anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(tmp_path, world, *args):
    """`run_rank` on `world` processes in one gloo group; rank 0's results."""
    ctx = mp.get_context("spawn")
    out, port = tmp_path / "rank0.pt", free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:  # a rank that fails leaves the others waiting in a collective: stop them
        # RANK_TIMEOUT_S: shorter, to see a hang sooner when debugging one
        p.join(timeout=int(os.environ.get("RANK_TIMEOUT_S", 600)) if p is procs[0] else 30)
        if any(f for f in tmp_path.glob("error-*.txt")):
            break
    for p in procs:
        p.join(timeout=5)
        if p.exitcode is None:
            p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(tmp_path.glob("error-*.txt"))]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * world, "a rank died without a Python error"
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tied"), tie=True)


@pytest.fixture(scope="module")
def single(tied_model):
    """The reference of a backend: one plain torch rank in its precision, in-process, one
    micro-batch for the whole step."""
    runs = {}

    def reference(backend):
        precision = precision_of(backend)
        if precision not in runs:
            runs[precision] = run_rank(0, 1, None, tied_model, "torch", 2, 4096, precision=precision)
        return runs[precision]
    return reference


def assert_close(got, want, what, tol):
    assert set(got) == set(want), what
    for name in want:
        diff = float((got[name].detach().double() - want[name].double()).abs().max())
        assert diff <= tol, f"{what}: {name} differs by {diff:.3g}"


def assert_matches_single(two, single, precision, what):
    for mode in MODES:
        assert_close(two["grads"][mode], single["grads"][mode], f"{what} gradient, {mode}", precision.grad_tol)
    assert_close(two["params"], single["params"], f"{what} parameters after {STEPS} steps",
                 precision.param_tol(STEPS, LR))


def assert_moved(run, tol):
    """The updates compared are real: most coordinates moved past the tolerance (float32's
    median 3.8 times it, float64's 5e3), so a wrong update to any of them shows."""
    moved = torch.cat([(run["params"][n] - run["start"][n]).abs().flatten().double() for n in run["start"]])
    assert float(moved.median()) > tol, (float(moved.median()), tol)


@pytest.mark.parametrize("backend,stage", [("torch", 2), ("deepspeed", 2), ("deepspeed", 3)],
                         ids=["fsdp2", "zero2", "zero3"])
def test_two_ranks_give_the_single_rank_gradient_and_update(tmp_path, tied_model, single, backend, stage):
    two, single, precision = run_ranks(tmp_path, 2, tied_model, backend, stage), single(backend), precision_of(backend)
    assert_matches_single(two, single, precision, f"{backend}-{stage}")
    assert_moved(single, precision.param_tol(STEPS, LR))
    assert max(m["learner/grad_norm"] for m in single["metrics"]) > 0.1  # clipping was active
    assert single["metrics"][-1]["entropy/coef"] > 0 and single["metrics"][-1]["kl/resets_total"] >= 1
    for m2, m1 in zip(two["metrics"], single["metrics"], strict=True):
        # global, not rank-local: the same numbers as one rank that saw everything
        for key in ("learner/loss_tokens", "entropy/learner", "ratio/max", "clip/high_frac", "loss/total",
                    "entropy_control/measured", "entropy/coef", "kl/mean", "kl/resets_total"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=precision.metric_abs), key
        assert m2["learner/grad_norm"] == pytest.approx(m1["learner/grad_norm"], rel=1e-5)
        # the off-policy decomposition over every token of the step: the ranks' tables gathered as tensors
        offpolicy = sorted(k for k in m1 if k.startswith("offpolicy/"))
        assert offpolicy and offpolicy == sorted(k for k in m2 if k.startswith("offpolicy/"))
        for key in offpolicy:
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=precision.metric_abs), key
        assert m2["learner/ranks"] == 2 and m1["learner/ranks"] == 1
        assert m2["learner/loss_tokens_rank0"] + m2["learner/loss_tokens_rank1"] == m1["learner/loss_tokens"]
        assert abs(m2["learner/tokens_rank0"] - m2["learner/tokens_rank1"]) <= 14  # balanced by tokens



def test_fsdp2_ranks_read_their_own_rows_shard_the_reference_and_checkpoint_shards(tmp_path, tied_model):
    """Two FSDP2 ranks build the model on the meta device and each reads its own rows from the
    files: the whole model they hold is the one from_pretrained loads (buffers included); the
    reference is sharded the same way; a checkpoint writes each rank's shards of the moments and
    the reference (torch.distributed.checkpoint), and learner.pt holds no tensor of either."""
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ckpt"
    got = run_ranks(tmp_path, 2, "layout", tied_model, str(ckpt))
    whole = AutoModelForCausalLM.from_pretrained(tied_model, dtype=torch.float64)
    assert_close(got["start"], dict(whole.named_parameters()), "loaded by rows", 0.0)
    assert_close(got["buffers"], dict(whole.named_buffers()), "buffers", 0.0)
    assert whole.config.vocab_size % 2 == 1  # the embedding splits unevenly: 50 rows and 49
    for name, (sharded, (first, rows), local_shape, ref_sharded, ref_equal) in got["layout"].items():
        assert sharded and ref_sharded and ref_equal, name
        full = whole.get_parameter(name).shape[0]
        assert (first, rows) == (0, -(-full // 2)) and local_shape[0] == rows, name  # rank 0: the first half
    shards = sorted(f.name for f in (ckpt / "state").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
    meta = torch.load(ckpt / "learner.pt", weights_only=False)
    assert "optimizer" not in meta and meta["optimizer_steps"] == 1 and meta["reference"] is True
    assert meta["moments"] == sorted(got["start"])
    moment_bytes = 2 * 8 * sum(t.numel() for t in got["start"].values())
    assert (ckpt / "learner.pt").stat().st_size < moment_bytes / 10  # the RNG state and counters only
    assert (ckpt / "policy" / "model.safetensors").is_file()
    assert got["push_failed"] and sorted(got["after_push"]) == sorted(got["start"])  # both ranks gathered on
    # the shards cast before the gather give the bits of the whole parameter cast after it
    assert sorted(got["pushed"]) == sorted(got["after_push"]) and got["gathered_dtypes"] == {torch.float16}
    for name, tensor in got["pushed"].items():
        assert tensor.dtype == torch.float16 and torch.equal(tensor, got["after_push"][name].to(torch.float16)), name


@pytest.mark.parametrize("backend,stage", [("torch", 2), ("deepspeed", 2), ("deepspeed", 3)],
                         ids=["fsdp2", "zero2", "zero3"])
def test_a_checkpoint_of_two_ranks_resumes_on_one(tmp_path, tied_model, backend, stage):
    """3 steps on 2 sharded ranks, a checkpoint, 3 more on one plain rank == 6 steps on one rank:
    the checkpoint holds the whole optimizer state (moments and step count), written as each
    rank's rows of every moment (FSDP2 and ZeRO alike: no rank holds the whole state) and read
    back whole by the one rank."""
    ckpt = tmp_path / "ckpt"
    run_ranks(tmp_path, 2, tied_model, backend, stage, 24, None, str(ckpt))
    assert (ckpt / "policy" / "model.safetensors").is_file()
    # every moment of every parameter is in the files as two row blocks, each rank's file one
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt / "state")).read_metadata()
    moments = {k: v for k, v in meta.state_dict_metadata.items() if k.startswith("optimizer.")}
    assert len(moments) == 2 * len(torch.load(ckpt / "learner.pt", weights_only=False)["moments"])
    for key, tensor in moments.items():
        rows = sorted((c.offsets[0], c.sizes[0]) for c in tensor.chunks)
        assert rows == [(0, -(-tensor.size[0] // 2)), (-(-tensor.size[0] // 2), tensor.size[0] // 2)], (key, rows)
        files = {info.relative_path for index, info in meta.storage_data.items() if index.fqn == key}
        assert files == {"__0_0.distcp", "__1_0.distcp"}, (key, files)
    precision = precision_of(backend)
    resumed = run_rank(0, 1, None, str(ckpt / "policy"), "torch", 2, 4096, ckpt_in=str(ckpt), precision=precision)
    whole = run_rank(0, 1, None, tied_model, "torch", 2, 4096, steps=2 * STEPS, precision=precision)
    # step 4's update uses the restored moments (its reference reset comes after the update)
    assert [m["learner/optimizer_steps"] for m in resumed["metrics"]] == [
        m["learner/optimizer_steps"] for m in whole["metrics"][STEPS:]]
    # a lost moment or step count changes whole updates (of order lr = 1e-3)
    assert_close(resumed["params"], whole["params"], f"{backend} checkpoint resumed on 1 rank",
                 precision.param_tol(2 * STEPS, LR))
    if backend == "deepspeed":  # and read back by 2 ZeRO ranks, before their first step (ZeRO-2 has no moments then)
        (tmp_path / "again").mkdir()
        again = run_ranks(tmp_path / "again", 2, str(ckpt / "policy"), backend, stage, 24, str(ckpt))
        assert_close(again["params"], whole["params"], f"{backend}-{stage} checkpoint resumed on 2 ranks",
                     precision.param_tol(2 * STEPS, LR))


@pytest.mark.parametrize("backend,stage", [("torch", 2), ("deepspeed", 3)], ids=["fsdp2", "zero3"])
def test_moe_aux_losses_on_two_ranks_equal_the_single_rank_ones(tmp_path_factory, tmp_path, backend, stage):
    """The load-balance loss uses the step's expert fractions f over both ranks, and both MoE
    losses divide by the step's routed tokens, so 2 ranks with micro-batches give the single
    rank's gradient and loss values (per-micro-batch losses do not: e.g. 1.108 vs 1.059)."""
    model = build_moe_model(tmp_path_factory.mktemp("moe"))
    precision = precision_of(backend)
    one = run_moe_rank(0, 1, None, model, "torch", 2, 4096, precision)
    two = run_ranks(tmp_path, 2, "moe", model, backend, stage)
    assert_close(two["grads"], one["grads"], f"MoE {backend}-{stage} gradient", precision.grad_tol)
    for key in ("loss/moe_load_balance", "loss/moe_z", "loss/total"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-6), key
    assert one["metrics"]["loss/moe_load_balance"] > 1.0  # k = 2 is perfect balance; a real value
    # FSDP2 ranks read their own experts' files into the experts' fused tensors (sharded_load.py),
    # whose rows hold each expert's projections as from_pretrained stacks them: a wrong layout
    # would change the gradient; ZeRO-3 ranks load the whole model
    assert two["load_mode"] == ("own rows" if backend == "torch" else "whole")


def test_fused_experts_are_read_from_each_experts_files_as_from_pretrained_fuses_them(tmp_path):
    """A MoE checkpoint holds one tensor per expert and projection; transformers 5 fuses them per
    layer on load (gate_up_proj [E, 2I, H], down_proj [E, H, I]). The meta model filled from the
    files row by row equals from_pretrained's exactly (here 2I == H: a transposed layout would fit
    the shapes and fail the values), and a checkpoint missing one expert's file is refused."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.sharded_load import expert_pieces, file_shapes, load_own_rows, meta_model, missing_from_files

    path = build_moe_model(tmp_path / "moe", tie=False)  # one plain module: to_empty unties (FSDP2 keeps ties)
    whole = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).named_parameters())
    model = meta_model(path, torch.float64)
    assert missing_from_files(model, path) is None
    fused = sorted(n for n, _ in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    assert len(fused) == 4 and whole[fused[1]].shape == (4, 32, 32)  # 2 layers; 2I == H
    load_own_rows(model, path, torch.device("cpu"))
    assert_close(dict(model.named_parameters()), whole, "experts read by rows", 0.0)
    files = file_shapes(path)
    assert expert_pieces(fused[1], (4, 32, 32), files)[3] == tuple(
        f"model.layers.0.mlp.experts.3.{p}.weight" for p in ("gate_proj", "up_proj"))
    assert expert_pieces(fused[1], (5, 32, 32), files) is None  # an expert the files lack
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    assert "model.layers.1.mlp.experts.gate_up_proj" in missing_from_files(meta_model(path, torch.float64), path)


@pytest.mark.parametrize("backend,stage", [("torch", 2), ("deepspeed", 3)], ids=["fsdp2", "zero3"])
def test_routing_replay_on_two_ranks_gives_the_single_rank_gradient(tmp_path_factory, tmp_path, backend, stage):
    """With routing replay each position is routed to its recorded experts whatever rank and
    micro-batch it lands in: 2 ranks with micro-batches give one rank's gradient (float64 on
    FSDP2), every recorded pair is routed as recorded, and the gradient is not the one of the
    learner's own routing (the recorded experts are random, not the model's choice)."""
    model = build_moe_model(tmp_path_factory.mktemp("moe"))
    precision = precision_of(backend)
    one = run_replay_rank(0, 1, None, model, "torch", 2, 4096, precision)
    own = run_replay_rank(0, 1, None, model, "torch", 2, 4096, precision, replay=False)
    two = run_ranks(tmp_path, 2, "replay", model, backend, stage)
    assert_close(two["grads"], one["grads"], f"replayed MoE {backend}-{stage} gradient", precision.grad_tol)
    for run in (one, two):
        m = run["metrics"]
        assert m["moe/route_agreement"] == 1.0 and 0.8 < m["moe/route_coverage"] < 1.0
        assert m["moe/own_route_agreement"] < 0.5  # random experts: the routers' own choice rarely is one
    moved = max(float((own["grads"][n] - one["grads"][n]).abs().max()) for n in one["grads"])
    assert moved > 100 * precision.grad_tol
    assert "moe/route_agreement" not in own["metrics"]


def test_entropy_control_uses_the_global_entropy_of_unequal_ranks(tmp_path, tied_model):
    """e_k is the step's entropy summed over both ranks / all its loss tokens, not a mean of the
    ranks' means: with 1 response on rank 0 and 6 on rank 1 the two differ, and e_k (and alpha,
    the coefficient it drives) equal one rank that saw everything."""
    one = run_entropy_rank(0, 1, None, tied_model, "torch", 2)
    two = run_ranks(tmp_path, 2, "entropy", tied_model, "torch", 2)
    for m2, m1 in zip(two["metrics"], one["metrics"], strict=True):
        assert m2["learner/loss_tokens_rank0"] < m2["learner/loss_tokens_rank1"] / 5
        assert m2["entropy_control/measured"] == pytest.approx(m1["entropy_control/measured"], rel=1e-6, abs=0)
        assert m2["entropy/learner"] == pytest.approx(m1["entropy/learner"], rel=1e-6, abs=0)
        assert m2["entropy/coef"] == m1["entropy/coef"] and m2["entropy_control/c"] == m1["entropy_control/c"]
    # the test can tell: at step 1 (the initial policy) the ranks' own mean entropies, averaged,
    # are not the global mean that both runs measured
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.collate import collate
    from asyncrl.learner.model_forward import policy_forward

    model = AutoModelForCausalLM.from_pretrained(tied_model)
    chunks = step_chunks(1)
    with torch.no_grad():
        parts = [policy_forward(model, collate(p), 1024, torch.device("cpu")).entropy.double()
                 for p in (chunks[:1], chunks[1:])]
    global_mean = float(torch.cat(parts).mean())
    assert one["metrics"][0]["entropy_control/measured"] == pytest.approx(global_mean, rel=1e-6)
    # (a near-uniform random policy: 3.5e-4 apart, 70 times the 1e-6 relative tolerance above)
    assert abs(sum(float(p.mean()) for p in parts) / 2 - global_mean) > 1e-4


@pytest.fixture(scope="module")
def decoupled_single(tied_model):
    runs = {}

    def reference(backend):
        precision = precision_of(backend)
        if precision not in runs:
            runs[precision] = run_decoupled_rank(0, 1, None, tied_model, "torch", 2, 4096, precision)
        return runs[precision]
    return reference


@pytest.mark.parametrize("backend,stage", [("torch", 2), ("deepspeed", 2), ("deepspeed", 3)],
                         ids=["fsdp2", "zero2", "zero3"])
def test_decoupled_reuse_on_two_ranks_equals_one_rank(tmp_path, tied_model, decoupled_single, backend, stage):
    """Each rank computes pi_prox for its share of the opened batch and the ranks sum them, so a
    token trained on either rank in any later step of the batch has the single rank's pi_prox:
    the same ratios, clip fractions and parameters."""
    one, precision = decoupled_single(backend), precision_of(backend)
    two = run_ranks(tmp_path, 2, "decoupled", tied_model, backend, stage)
    # a wrong pi_prox changes the ratios by tenths and the updates by ~lr
    assert_close(two["params"], one["params"], f"decoupled {backend}-{stage} parameters after 3 steps",
                 precision.param_tol(3, DECOUPLED_LR))
    assert one["metrics"][0]["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert one["metrics"][2]["clip/high_frac"] + one["metrics"][2]["clip/low_frac"] > 0  # the clip engaged
    for m2, m1 in zip(two["metrics"], one["metrics"], strict=True):
        for key in ("ratio/mean", "ratio/max", "ratio/min", "clip/high_frac", "clip/low_frac", "is_weight/mean",
                    "is_weight/capped_frac", "loss/total"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=precision.metric_abs), key



def test_m2po_cuts_over_both_ranks_tokens_as_one_rank_does(tmp_path, tied_model):
    """M2PO's threshold is one over the step: each rank's log q_t and candidates gathered (one
    matrix), so two FSDP2 ranks mask the single rank's tokens and reach its parameters."""
    precision = precision_of("torch")
    one = run_decoupled_rank(0, 1, None, tied_model, "torch", 2, 4096, precision, M2PO_ALGO)
    two = run_ranks(tmp_path, 2, "decoupled", tied_model, "torch", 2, 24, precision, M2PO_ALGO)
    assert any(m["clip/m2po_masked_frac"] > 0 for m in one["metrics"])  # the cut acted
    for m2, m1 in zip(two["metrics"], one["metrics"], strict=True):
        assert m2["clip/m2po_masked_frac"] == pytest.approx(m1["clip/m2po_masked_frac"], abs=1e-12)
    assert_close(two["params"], one["params"], "decoupled M2PO parameters after 3 steps",
                 precision.param_tol(3, DECOUPLED_LR))


def relative_error(got, want):
    """||got - want|| / ||want|| over all tensors of two name -> tensor dicts."""
    num = sum(float((got[n].detach().double() - want[n].detach().double()).norm()) ** 2 for n in want)
    return (num / sum(float(want[n].detach().double().norm()) ** 2 for n in want)) ** 0.5


def test_fsdp2_bf16_compute_over_fp32_masters_matches_one_rank(tmp_path, tied_model):
    """FSDP2 with MixedPrecisionPolicy (bf16 gathers, fp32 gradient reduction) against one rank
    under bf16 autocast: the same bf16 compute, so nearly the same gradient; masters stay fp32."""
    one = run_rank(0, 1, None, tied_model, "torch", 2, 4096, precision=BF16)
    two = run_ranks(tmp_path, 2, tied_model, "torch", 2, 24, None, None, STEPS, BF16)
    errors = {mode: relative_error(two["grads"][mode], one["grads"][mode]) for mode in MODES}
    assert all(e < 2e-2 for e in errors.values()), errors  # measured 5e-3
    assert {t.dtype for t in two["params"].values()} == {torch.float32}
    # Adam scales every coordinate to ~lr, so bf16 noise on near-zero gradients flips whole
    # updates: the 3 steps' updates agree to ~7% (measured), a wrong reduction would not
    moved = {n: two["params"][n] - two["start"][n] for n in two["start"]}
    moved_one = {n: one["params"][n] - one["start"][n] for n in one["start"]}
    assert relative_error(moved, moved_one) < 0.15


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_bf16_masters_are_the_loaded_float32_weights(tied_model, stage):
    """DeepSpeed builds its fp32 masters from the module's bf16 copy; the backend writes the loaded
    float32 weights back, so a resumed run continues from its exact masters (without: 2.4e-4 off)."""
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    want = dict(AutoModelForCausalLM.from_pretrained(tied_model).named_parameters())
    learner = LearnerRank(tied_model, learner_cfg("deepspeed", stage, 1), STEP_ALGO, dtype="bfloat16",
                          group_address=group_address(None))
    got = {n: t.cpu() for n, t in learner.backend.named_full_params()}
    learner.shutdown()
    assert set(got) == set(want)
    for name, weight in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], weight.detach()), name


@pytest.mark.parametrize("backend,stage", [("torch", 2), ("deepspeed", 2), ("deepspeed", 3)],
                         ids=["fsdp2", "zero2", "zero3"])
def test_ranks_with_unequal_micro_batch_counts_neither_hang_nor_change_the_gradient(tmp_path, tied_model, single,
                                                                                   backend, stage):
    """Ranks balance tokens, not micro-batches: with 32 tokens a micro-batch rank 0 runs 2 and rank
    1 runs 1 (and pads). The padding must run before the step's metrics are all-reduced, or rank 1
    waits there while rank 0's forwards wait for it (a hang until the batch timeout: both cases
    hung with the padding after the all-reduce). ZeRO-3 also hung while a padding loss reached
    only the logprobs (see `padding_loss`)."""
    counts = [[len([m for m in micro_batches(p, 32) if sum(c.num_loss_tokens for c in m)])
               for p in split_for_ranks(step_chunks(step), 2)] for step in range(1, STEPS + 2)]
    assert all(a != b for a, b in counts), counts
    two = run_ranks(tmp_path, 2, tied_model, backend, stage, 32)
    assert_matches_single(two, single(backend), precision_of(backend), f"{backend}-{stage}")
