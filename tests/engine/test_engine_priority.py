"""vLLM's `--scheduling-policy priority` in the sim engine: a request moved off a drained
instance (sent with a negative priority by the gateway) takes the next free slot ahead of the
requests already waiting, and is the last to be preempted. Stepped by hand; and over HTTP, a
priority is refused by an engine that schedules FCFS, with vLLM's words."""

from __future__ import annotations

import orjson
from test_engine_core import make_req, make_sched

from flexpipe.engine.request import EngineRequest, Status
from flexpipe.engine.scheduler import Scheduler
from flexpipe.engine.testing import sim_engine


def add(
    s: Scheduler, rid: str, at_s: float, priority: int = 0, max_tokens: int = 2
) -> EngineRequest:
    req = make_req(rid, [1, 2, 3, 4], max_tokens=max_tokens)
    req.arrival_s = at_s
    req.priority = priority
    s.add(req)
    return req


def test_a_moved_request_is_admitted_before_the_queue() -> None:
    for policy, first in (("priority", "moved"), ("fcfs", "queued1")):
        s, _ = make_sched(max_num_seqs=1, policy=policy)
        running = add(s, "running", 0.0)
        s.finish_step(s.schedule())  # `running` holds the only slot
        add(s, "queued1", 1.0)
        add(s, "queued2", 2.0)
        add(s, "moved", 3.0, priority=-1)
        assert [r.request_id for r in s.waiting] == (
            ["moved", "queued1", "queued2"] if policy == "priority" else
            ["queued1", "queued2", "moved"]
        )  # fmt: skip
        while running.status is not Status.FINISHED:
            s.finish_step(s.schedule())
        plan = s.schedule()  # the slot is free
        assert [r.request_id for r in plan.admitted] == [first]


def test_priority_preempts_the_latest_lowest_priority_request_not_the_moved_one() -> None:
    # 6 blocks of 4 tokens: three requests of 4 prompt tokens + growth cannot all keep going
    s, _ = make_sched(num_blocks=6, block_size=4, max_num_seqs=3, policy="priority")
    moved = add(s, "moved", 3.0, priority=-1, max_tokens=50)
    add(s, "a", 1.0, max_tokens=50)
    add(s, "b", 2.0, max_tokens=50)
    preempted: list[str] = []
    for _ in range(20):
        plan = s.schedule()
        preempted += [r.request_id for r in plan.preempted]
        s.finish_step(plan)
    assert preempted and "moved" not in preempted
    assert preempted[0] == "b"  # the latest arrival of the lowest priority
    assert moved.status is Status.RUNNING and moved.num_preemptions == 0


def test_the_engine_refuses_a_priority_it_does_not_schedule_by() -> None:
    import http.client

    def post(url: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", orjson.dumps(body),
                     {"content-type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        out = resp.status, orjson.loads(resp.read())
        conn.close()
        return out

    body = {"model": "llama-2-7b", "prompt": "hi", "max_tokens": 2, "priority": -1}
    args = ["llama-2-7b", "--load-time-s", "0", "--time-scale", "0"]
    with sim_engine(args) as fcfs, sim_engine([*args, "--scheduling-policy", "priority"]) as prio:
        status, err = post(fcfs.url, body)
        assert status == 400
        assert "Got priority -1 but Priority scheduling is not enabled." in str(err)
        assert post(fcfs.url, {**body, "priority": 0})[0] == 200
        status, out = post(prio.url, body)
        assert status == 200 and out["usage"]["completion_tokens"] == 2  # type: ignore[index]
        assert post(prio.url, {**body, "priority": "high"})[0] == 400
