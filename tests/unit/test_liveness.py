"""trainer/training/liveness.py over a real c10d TCPStore (two ranks' views of one store): each node's
progress, and which node a stall warning names."""

from datetime import timedelta

import torch.distributed as dist

from trainer.training.distributed import Dist
from trainer.training.liveness import Heartbeats


def two_ranks():
    server = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    client = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=timedelta(seconds=10))
    r0 = Heartbeats(Dist(rank=0, world_size=2), store=server, node=0, host="gpu-a")
    r1 = Heartbeats(Dist(rank=1, world_size=2), store=client, node=1, host="gpu-b")
    return r0, r1


def test_a_rank_that_never_reached_the_collective_is_named_with_its_node():
    r0, r1 = two_ranks()
    assert r0.laggards() == "" and r0.nodes() == []
    r0.beat(4, "step_done", step_s=0.5)
    assert r0.laggards() == "ranks [1] have not reported yet"
    r1.beat(4, "step_done", step_s=0.75)
    assert "every rank is at step 4 step_done" in r0.laggards()
    r0.beat(5, "step_start")
    r0.beat(5, "captured")  # rank 0 waits in step 5's all-reduce; rank 1 never started step 5
    said = r0.laggards()
    assert said.startswith("ranks [1] on node 1 (gpu-b) stopped at step 4 step_done"), said
    r1.beat(5, "step_start")
    assert "ranks [1] on node 1 (gpu-b) stopped at step 5 step_start" in r0.laggards()
    r1.beat(5, "step_done", step_s=0.25)
    r0.beat(5, "step_done", step_s=2.0)
    assert r0.nodes() == [
        {"node": 0, "host": "gpu-a", "ranks": [0], "step": 5, "step_s": 2.0},
        {"node": 1, "host": "gpu-b", "ranks": [1], "step": 5, "step_s": 0.25},
    ]


def test_one_process_keeps_no_heartbeats():
    hb = Heartbeats(Dist())
    hb.beat(1, "step_start")
    assert not hb.enabled and hb.read() == [] and hb.laggards() == "" and hb.nodes() == []
