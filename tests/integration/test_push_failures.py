"""A push whose receive fails inside a live rollout actor (its gloo receive timed out while the
learner's send went through) ends as PushFailed, one line naming the actor, not as the actor's
traceback through the driver (CI saw it with sync.timeout_s=0.01: the group formed, the receive did
not). Real Ray tasks stand in for the actors' calls."""

import pytest
import ray

from asyncrl.config.sync_section import SyncConfig
from asyncrl.orchestrator.weight_sync import PushFailed, WeightSync


@ray.remote
def receive(ok: bool):
    if not ok:
        raise RuntimeError("weight receive version 3: bucket 0/1 failed: Timed out waiting 10ms for recv")
    return {"sync/load_s": 0.5}


class Pool:
    """ActorPool's part a push uses: actor 7 receives, actor 9's receive raises."""

    ids = [7, 9]

    def update_weights(self, ids, meta, version, rewind):
        return [receive.remote(a == 7) for a in ids]

    def why_gone(self, actor):
        return None


def test_a_receive_that_raises_in_a_live_actor_is_a_push_failure_naming_it(ray_cluster):
    sync = WeightSync(SyncConfig(timeout_s=5), learner=None, pool=Pool(), fake_engines=True)
    sync.rebuild_group()
    with pytest.raises(PushFailed, match=r"weight push of version 3 \(step 3\) failed on rollout actor 9: "
                                         r"RuntimeError: weight receive version 3.*\(sync.timeout_s=5\)") as e:
        sync.push(3, 3)
    assert e.value.dead == [] and sync.members == []  # the next push forms a new group
