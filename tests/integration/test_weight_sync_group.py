"""The weight-sync group as WeightSync forms it, on real Ray actors that record what they are
told: every tensor-parallel worker of every engine is a member, and an actor whose NCCL receive
failed is replaced (vLLM leaves its reload unfinished) while a gloo one is pushed to again."""

import pytest
import ray

from asyncrl.config import SyncConfig
from asyncrl.orchestrator.actor_pool import ActorPool
from asyncrl.orchestrator.weight_sync import PushFailed, WeightSync
from asyncrl.sync.protocol import WeightSyncError


@ray.remote
class Member:
    """An engine's side of the group: records its joins; its receive fails when told to."""

    def __init__(self, fail_receive: bool = False):
        self.joins, self.fail_receive = [], fail_receive

    def init_weight_sync(self, host, port, rank, world_size, timeout_s, join_timeout_s=None):
        self.joins.append((rank, world_size, timeout_s, join_timeout_s))

    def update_weights(self, metadata, version, rewind=False):
        if self.fail_receive:
            raise RuntimeError("NCCL error: remote process exited")
        return {"sync/load_s": 0.01}

    def recorded(self):
        return self.joins


class Learner:
    """LearnerGroup's weight-sync calls: rank 0 joins at rank 0 of the world it is given."""

    def __init__(self):
        self.worlds = []

    def weight_sync_address(self):
        return "127.0.0.1", 29999

    def init_weight_sync(self, kind, host, port, world_size, timeout_s, bucket_bytes, transfer, full_every,
                         join_timeout_s=None):
        assert (transfer, full_every) == ("full", 100)  # sync.transfer and sync.full_every reach the sender
        self.worlds.append((world_size, timeout_s, join_timeout_s))
        return ray.put(None)

    def weight_metadata(self):
        return {}  # no plan: the learner sends nothing


class Pool:
    """The pool's membership over recording actors; its weight calls are ActorPool's own."""

    init_weight_sync = ActorPool.init_weight_sync
    update_weights = ActorPool.update_weights

    def __init__(self, actors):
        self.actors, self.removed = dict(enumerate(actors)), []

    @property
    def ids(self):
        return sorted(self.actors)

    def why_gone(self, actor_id):
        return None

    def remove(self, actor_id, kill=False):
        self.actors.pop(actor_id)
        self.removed.append((actor_id, kill))


def test_every_tensor_parallel_worker_of_every_engine_is_a_member(ray_cluster):
    members = [Member.remote() for _ in range(3)]
    learner, pool = Learner(), Pool(members)
    sync = WeightSync(SyncConfig(timeout_s=7.0), learner, pool, tensor_parallel_size=2)
    sync.rebuild_group()
    sync.rebuild_group(join_timeout_s=600.0)  # a run's first group: joining may wait, a push may not
    # 1 learner rank + 3 engines x 2 TP workers; engine r's workers are ranks 1 + 2r and 2 + 2r
    assert learner.worlds == [(7, 7.0, 7.0), (7, 7.0, 600.0)]
    assert [ray.get(m.recorded.remote()) for m in members] == [
        [(rank, 7, 7.0, 7.0), (rank, 7, 7.0, 600.0)] for rank in (1, 3, 5)]


@pytest.mark.parametrize("kind, replaced", [("nccl", True), ("gloo", False)])
def test_an_actor_whose_receive_failed_is_replaced_with_nccl_only(ray_cluster, kind, replaced):
    members = [Member.remote(), Member.remote(fail_receive=True)]
    pool = Pool(members)
    sync = WeightSync(SyncConfig(type=kind), Learner(), pool)
    sync.rebuild_group()
    if replaced:
        with pytest.raises(PushFailed, match="its NCCL receive failed \\(RuntimeError: NCCL error") as e:
            sync.push(3, step=3)
        assert e.value.dead == [1] and pool.removed == [(1, True)] and pool.ids == [0]
    else:  # a survivor's gloo receive broken by a peer: the actor stays; the push fails in one line naming it
        with pytest.raises(PushFailed, match="weight push of version 3 \\(step 3\\) failed on rollout actor 1: ") as e:
            sync.push(3, step=3)
        assert e.value.dead == [] and pool.removed == [] and pool.ids == [0, 1] and sync.members == []


@ray.remote
def _join_that_times_out():
    raise WeightSyncError("could not join gloo weight-sync group 127.0.0.1:29999 (rank 0 of 2) within 0.001s")


class LearnerThatCannotJoin(Learner):
    def init_weight_sync(self, *args, **kwargs):
        super().init_weight_sync(*args, **kwargs)
        return _join_that_times_out.remote()


def test_a_group_that_cannot_form_says_which_timeout_to_raise(ray_cluster):
    """Mid-run (a push's retry after a loss) the field is sync.timeout_s; the run's first group is
    worded by lifecycle.form_weight_sync_group, which names sync.start_timeout_s itself."""
    sync = WeightSync(SyncConfig(timeout_s=0.001), LearnerThatCannotJoin(), Pool([Member.remote()]))
    with pytest.raises(PushFailed, match=r"could not form within sync.timeout_s=0.001s: learner rank 0 said "
                                         r"WeightSyncError: could not join") as e:
        sync.rebuild_group()
    assert e.value.dead == [] and sync.members == []
    with pytest.raises(PushFailed) as e:
        sync.rebuild_group(join_timeout_s=600.0)
    assert "sync.timeout_s" not in str(e.value) and "could not form: learner rank 0 said" in str(e.value)
