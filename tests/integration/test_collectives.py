"""learner/collectives.py over a real gloo group of two processes: tensors of different lengths,
one rank with nothing, gathered in rank order as one padded tensor (no pickled objects)."""

import multiprocessing as mp
import traceback

import torch

from asyncrl.sync.wire import free_port


def _rank(rank, port, out):
    import torch.distributed as dist

    from asyncrl.algo.token_decomposition import TokenTable
    from asyncrl.learner.collectives import cat_over_ranks

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        vector = torch.arange(3.0) + 10 * rank if rank == 0 else torch.arange(5.0) + 10 * rank
        matrix = torch.arange(20.0).reshape(10, 2) if rank == 0 else None  # rank 1: no tokens this step
        results = {"vector": cat_over_ranks(vector), "matrix": cat_over_ranks(matrix)}
        table = TokenTable.from_matrix(results["matrix"])
        results["staleness"] = table.staleness
        if rank == 0:
            torch.save(results, out)
        dist.destroy_process_group()
    except BaseException:
        (out.parent / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def test_cat_over_ranks_gathers_uneven_and_empty_parts_in_rank_order(tmp_path):
    ctx, port, out = mp.get_context("spawn"), free_port(), tmp_path / "out.pt"
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    errors = [f.read_text() for f in tmp_path.glob("error-*.txt")]
    assert not errors and [p.exitcode for p in procs] == [0, 0], errors
    got = torch.load(out)
    assert got["vector"].tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 13.0, 14.0]
    assert got["matrix"].dtype == torch.float64
    assert torch.equal(got["matrix"], torch.arange(20.0).reshape(10, 2).double())
    assert got["staleness"].dtype == torch.int64 and got["staleness"].tolist() == [0, 1]
