"""With fast up, a reclaim moves nothing that runs: the lost instances are dropped, or
replaced on free GPUs (policy.py, check 2); without it, the planner's re-plan competes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_shift_policy import CLUSTER, decide, demand, policy, running_for, snap, steady

from flexpipe.policies.shift import TriggerParams


def test_a_reclaim_under_fast_up_replaces_the_lost_instance_on_a_free_gpu() -> None:
    running = running_for(CLUSTER, demand(3.0))  # gpu2 and gpu1; gpu3 and gpu0 free
    assert [i.gpu_ids for i in running] == [("gpu2",), ("gpu1",)]
    leaving = CLUSTER.with_gpu("gpu1", free_until_s=150.0)  # 90 s of notice at now = 60
    s = snap(running, [steady(55)], cluster=leaving, rate=3.0)
    fast = decide(policy(triggers=TriggerParams(fast_up_samples=1)), s, 60)
    assert fast.action == "shift" and fast.trigger == "reclaim"
    assert fast.reason == (
        "llama-7b-1: gpu1 is reclaimed in 90 s; add llama-7b: score 1637.8 = gain 1724.0 - "
        "gap 0.0 - migration 0.0 - risk 86.2 (the running plan kept, llama-7b on gpu3 added on "
        "GPUs free now)"
    )
    assert fast.target is not None
    assert [i.gpu_ids for i in fast.target] == [("gpu2",), ("gpu3",)]
    assert fast.target[0] is running[0]  # kept as it runs
    # no re-plan was offered: only the lost instance dropped, and the running plan kept
    assert [a.name for a in fast.alternatives] == ["drop lost", "keep"]
    # without fast up the planner's re-plan is among the candidates (here it wins)
    slow = decide(policy(), s, 60)
    assert slow.reason.startswith("llama-7b-1: gpu1 is reclaimed in 90 s; replan: ")
