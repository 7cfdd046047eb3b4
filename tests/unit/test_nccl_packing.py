"""The NCCL sender's packed pushes, recorded by a fake group and read back as vLLM's packed consumer
reads them: every parameter arrives bit for bit, for float32 and bf16 weights, tied and untied
heads, on CPU tensors (CI) and CUDA tensors (gpu-marked).

Two readers: vLLM's own `packed_nccl_broadcast_consumer` where vLLM is installed (on CPU its CUDA
streams are stood in for), and `mirror_consume`, the same algorithm written out here, where it is
not (the GPU machine has no vLLM).
"""

import contextlib
import math

import pytest
import torch

from asyncrl.sync.buckets import dtype_from_str
from asyncrl.sync.nccl_packing import chunk_sizes, num_chunks
from asyncrl.sync.nccl_sender import NcclWeightSender
from asyncrl.sync.wire import NUM_BUFFERS

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BUCKET = 3000  # bytes: a push of the tiny model makes many chunks, some holding one large tensor


class RecordingGroup:
    """Stands in for PyNcclCommunicator on the sending side: keeps a copy of every broadcast."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor, src):
        assert src == 0 and tensor.dtype == torch.uint8 and tensor.dim() == 1
        self.sent.append(tensor.cpu().clone())

    def destroy(self):  # the sender's close() leaves the group
        pass


class ReplayGroup:
    """The receiving side: each broadcast fills the receiver's buffer with the next recorded one."""

    def __init__(self, sent):
        self.sent = list(sent)

    def broadcast(self, tensor, src):
        chunk = self.sent.pop(0)
        assert tensor.numel() == chunk.numel(), "receiver and sender cut the chunks differently"
        tensor.copy_(chunk.to(tensor.device))


def params(tie: bool, dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie))
    # named_parameters() yields a tied embedding once, as the learner's backends do
    return [(n, p.detach().to(device=device, dtype=dtype)) for n, p in model.named_parameters()]


def mirror_consume(update_info: dict, group, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """vLLM 0.32's packed consumer, step for step: cut chunks from the metadata (close once past
    bucket_bytes), receive each into an empty uint8 buffer, split by byte sizes, view."""
    metas = [(n, shape, dtype_from_str(d)) for n, d, shape in
             zip(update_info["names"], update_info["dtype_names"], update_info["shapes"], strict=True)]
    out, chunk, size = {}, [], 0

    def receive():
        buffer = torch.empty(size, dtype=torch.uint8)
        group.broadcast(buffer, src=0)
        for (name, shape, dtype), piece in zip(chunk, buffer.split([math.prod(s) * d.itemsize for _, s, d in chunk])):
            out[name] = piece.contiguous().view(dtype).view(shape)

    for meta in metas:
        chunk.append(meta)
        size += math.prod(meta[1]) * meta[2].itemsize
        if size > bucket_bytes:
            receive()
            chunk, size = [], 0
    if chunk:
        receive()
    return out


def vllm_consume(update_info: dict, group, bucket_bytes: int, device: str, monkeypatch) -> dict[str, torch.Tensor]:
    """vLLM's own consumer; on CPU its side streams become no-ops (they only order GPU work)."""
    packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    if device == "cpu":
        class NoStream:
            def synchronize(self):
                pass

        monkeypatch.setattr(packed_tensor, "_get_streams", lambda index, n: tuple(NoStream() for _ in range(n)))
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    out = {}
    metas = iter([(n, (shape, dtype_from_str(d))) for n, d, shape in
                  zip(update_info["names"], update_info["dtype_names"], update_info["shapes"], strict=True)])
    packed_tensor.packed_nccl_broadcast_consumer(
        metas, group, 0, lambda pairs: out.update({n: t.clone() for n, t in pairs}),
        buffer_size_bytes=bucket_bytes, num_buffers=NUM_BUFFERS, device=device)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("reader", ["mirror", "vllm"])
def test_a_push_unpacks_to_the_parameters(device, dtype, tie, reader, monkeypatch):
    named = params(tie, dtype, device)
    sender = NcclWeightSender("127.0.0.1", 0, 2, timeout_s=60, bucket_bytes=BUCKET)
    group = RecordingGroup()
    sender.connect(group=group, device=torch.device(device))
    meta = sender.metadata(named)
    stats = sender.push(iter(named), version=3)
    sender.close()

    sizes = [t.numel() * t.element_size() for _, t in named]
    assert stats["sync/num_bytes"] == meta["num_bytes"] == sum(sizes) == sum(c.numel() for c in group.sent)
    assert stats["sync/num_buckets"] == len(group.sent) == num_chunks(sizes, BUCKET) > 3
    assert max(c.numel() for c in group.sent) > BUCKET  # a chunk closes only once past the bound
    assert ("lm_head.weight" in meta["update_info"]["names"]) != tie

    replay = ReplayGroup(group.sent)
    info = meta["update_info"]
    got = (mirror_consume(info, replay, BUCKET) if reader == "mirror"
           else vllm_consume(info, replay, BUCKET, device, monkeypatch))
    assert not replay.sent  # every broadcast was consumed
    assert list(got) == [n for n, _ in named]
    for name, want in named:
        assert got[name].dtype == dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].cpu(), want.cpu()), name  # bit for bit


def test_pushes_pack_into_the_same_buffers_in_turn():
    """Chunk i of every push is packed into the front of buffer i % NUM_BUFFERS, allocated once
    (as large as the largest chunk), and a second push of other values arrives as the first did."""
    named = params(True, torch.float32, "cpu")
    sizes = [t.numel() * t.element_size() for _, t in named]

    class PointerGroup(RecordingGroup):
        def broadcast(self, tensor, src):
            super().broadcast(tensor, src)
            self.pointers = getattr(self, "pointers", []) + [tensor.data_ptr()]

    sender = NcclWeightSender("127.0.0.1", 0, 2, timeout_s=60, bucket_bytes=BUCKET)
    sender.connect(group=(group := PointerGroup()), device=torch.device("cpu"))
    sender.metadata(named)
    sender.push(iter(named), version=1)
    buffers = sender._buffers
    assert len(buffers) == NUM_BUFFERS and buffers[0].numel() == max(chunk_sizes(sizes, BUCKET)) > BUCKET
    starts = [b.data_ptr() for b in buffers]
    assert group.pointers == [starts[i % NUM_BUFFERS] for i in range(len(group.sent))]
    first = list(group.sent)
    again = [(n, t * 2) for n, t in named]
    group.sent, group.pointers = [], []
    sender.push(iter(again), version=2)
    assert sender._buffers is buffers and group.pointers == [starts[i % NUM_BUFFERS] for i in range(len(first))]
    got = mirror_consume(sender.metadata(again)["update_info"], ReplayGroup(group.sent), BUCKET)
    assert all(torch.equal(got[n], t) for n, t in again)
    assert [c.numel() for c in group.sent] == [c.numel() for c in first] == chunk_sizes(sizes, BUCKET)
    sender.close()


def test_chunk_rule_closes_once_past_the_bound():
    # 1000 + 1500 = 2500 <= 3000: open; + 800 = 3300 > 3000: closes; then 4000 alone; then 10
    assert num_chunks([1000, 1500, 800, 4000, 10], 3000) == 3
    assert chunk_sizes([1000, 1500, 800, 4000, 10], 3000) == [3300, 4000, 10]
    assert num_chunks([3000], 3000) == 1 and num_chunks([3000, 1], 3000) == 1 and num_chunks([], 10) == 0


def test_a_push_checks_the_parameters_against_the_metadata():
    named = params(True, torch.float32, "cpu")
    sender = NcclWeightSender("127.0.0.1", 0, 2, bucket_bytes=BUCKET)
    sender.connect(group=RecordingGroup(), device=torch.device("cpu"))
    sender.metadata(named)
    with pytest.raises(ValueError, match="differs from the last metadata"):
        sender.push([(n, t.to(torch.bfloat16)) for n, t in named], version=1)
    sender.close()


class StalledGroup(RecordingGroup):
    """A group with a member that stopped mid-push: broadcasts block until the communicator is
    aborted, then fail, as an NCCL call does after ncclCommAbort."""

    def __init__(self):
        super().__init__()
        import threading

        self.aborted, self.returned = threading.Event(), threading.Event()

    def broadcast(self, tensor, src):
        self.aborted.wait()
        self.returned.set()
        raise RuntimeError("NCCL error: communicator aborted")

    def destroy(self):
        self.aborted.set()


def test_a_push_that_stalls_is_aborted_and_the_sender_can_join_a_new_group():
    """No learner thread is left inside NCCL: the stuck call returns once the communicator is aborted,
    and the next group (the orchestrator's rebuild around the survivors) takes a push."""
    from asyncrl.sync.protocol import WeightSyncError

    named = params(True, torch.float32, "cpu")
    sender = NcclWeightSender("127.0.0.1", 0, 2, timeout_s=0.3, bucket_bytes=BUCKET)
    stalled = StalledGroup()
    sender.connect(group=stalled, device=torch.device("cpu"))
    sender.metadata(named)
    with pytest.raises(WeightSyncError, match="did not complete within"):
        sender.push(named, version=1)
    assert stalled.aborted.is_set() and stalled.returned.wait(5)  # the helper thread got out
    with pytest.raises(RuntimeError, match="before connect"):
        sender.push(named, version=1)
    fresh = RecordingGroup()
    sender.connect(group=fresh, device=torch.device("cpu"))
    sender.metadata(named)
    assert sender.push(named, version=1)["sync/num_buckets"] == len(fresh.sent) > 0
    sender.close()
