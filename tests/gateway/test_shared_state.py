"""The pure parts of what gateway workers and replicas share: the control log's compaction,
the split of an instance's slots between workers, the merge of their metrics."""

from __future__ import annotations

from flexpipe.gateway.core.pool import Pool, share_slots
from flexpipe.gateway.peers import merge_expositions
from flexpipe.gateway.shared_state import compact, seconds_left


def _log(*ops: dict[str, object]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for op in ops:
        out = compact(out, op)
    return out


def test_compact_keeps_what_replays_to_the_same_state() -> None:
    add_a = {"op": "add", "url": "a", "model": "m"}
    add_b = {"op": "add", "url": "b", "model": "m"}
    rehearse = {"op": "state", "url": "a", "state": "rehearsing"}
    active = {"op": "state", "url": "a", "state": "active"}
    w1, w2 = {"op": "weight", "url": "a", "weight": 1.0}, {"op": "weight", "url": "a", "weight": 2}
    h1 = {"op": "hold", "model": "m", "seconds": 60, "at_wall_s": 0}
    h2 = {"op": "hold", "model": "m", "seconds": 30, "at_wall_s": 5}
    r1 = {"op": "refuse", "model": "m", "reason": "x", "seconds": 60, "at_wall_s": 6}
    log = _log(add_a, h1, add_b, rehearse, w1, active, h2, w2, r1)
    assert log == [add_a, add_b, rehearse, active, h2, w2, r1]
    # removing an instance drops its history (and a new add drops the removal)
    remove_a = {"op": "remove", "url": "a"}
    assert _log(*log, remove_a) == [add_b, h2, r1, remove_a]
    assert _log(*log, remove_a, add_a) == [add_b, h2, r1, add_a]


def test_seconds_left_counts_from_when_the_op_was_issued() -> None:
    op = {"op": "hold", "model": "m", "seconds": 60.0, "at_wall_s": 1000.0}
    assert seconds_left(op, 1000.0) == 60.0
    assert seconds_left(op, 1045.5) == 14.5
    assert seconds_left(op, 2000.0) == 0.0


def test_share_slots_splits_each_cap_between_workers() -> None:
    assert [share_slots(10, i, 1) for i in range(1)] == [10]
    assert [share_slots(10, i, 3) for i in range(3)] == [4, 3, 3]
    assert [share_slots(2, i, 4) for i in range(4)] == [1, 1, 1, 1]  # at least one each
    pool = Pool(256, (1, 2))
    inst = pool.add("http://e", "m", max_num_seqs=16)  # 16 + 16 // 8 = 18: 9 each
    assert inst.max_concurrency == 9
    assert Pool(256).add("http://e", "m", max_num_seqs=16).max_concurrency == 18


def test_merge_expositions_sums_samples_and_takes_max_of_instance_up() -> None:
    one = (
        "# HELP flexpipe_queued_requests q\n# TYPE flexpipe_queued_requests gauge\n"
        "flexpipe_queued_requests 2.0\n"
        'flexpipe_instance_up{instance="a",state="active"} 1.0\n'
        'flexpipe_requests_total{status="200"} 3.0\n'
    )
    two = (
        "# HELP flexpipe_queued_requests q\n# TYPE flexpipe_queued_requests gauge\n"
        "flexpipe_queued_requests 5.0\n"
        'flexpipe_instance_up{instance="a",state="active"} 1.0\n'
        'flexpipe_requests_total{status="200"} 4.5\n'
        'flexpipe_requests_total{status="503"} 1.0\n'
    )
    assert merge_expositions([one, two]).decode() == (
        "# HELP flexpipe_queued_requests q\n# TYPE flexpipe_queued_requests gauge\n"
        "flexpipe_queued_requests 7.0\n"
        'flexpipe_instance_up{instance="a",state="active"} 1.0\n'
        'flexpipe_requests_total{status="200"} 7.5\n'
        'flexpipe_requests_total{status="503"} 1.0\n'
    )


def test_only_policies_that_read_the_prefix_index_publish_prefixes() -> None:
    from flexpipe.gateway.shared_state import reads_prefixes
    from flexpipe.policies.routing import create_policy

    assert reads_prefixes(create_policy("prefix_affinity"))
    assert not reads_prefixes(create_policy("round_robin"))
    assert not reads_prefixes(create_policy("least_load"))
    assert reads_prefixes(create_policy("composite", weights={"prefix": 1.0, "load": 1.0}))
    assert not reads_prefixes(create_policy("composite", weights={"load": 1.0}))


def test_merge_expositions_keeps_each_family_together() -> None:
    one = '# TYPE a gauge\na{m="0"} 1.0\n# TYPE b gauge\nb 2.0\n'
    two = '# TYPE a gauge\na{m="1"} 1.0\n# TYPE b gauge\nb 3.0\n'
    assert merge_expositions([one, two]).decode() == (
        '# TYPE a gauge\na{m="0"} 1.0\na{m="1"} 1.0\n# TYPE b gauge\nb 5.0\n'
    )


def test_request_ids_never_collide_between_workers_or_replicas() -> None:
    import itertools

    from flexpipe.gateway.shared_state import CALL_ID_SALT_BITS, call_ids

    def first(ids: object, n: int = 3) -> list[int]:
        return list(itertools.islice(ids, n))  # type: ignore[call-overload]

    assert first(call_ids(None, (0, 1))) == [1, 2, 3]
    assert first(call_ids(None, (0, 2))) == [1, 3, 5]
    assert first(call_ids(None, (1, 2))) == [2, 4, 6]

    class Replica:
        member_salted = True

    ids = first(call_ids(Replica(), (0, 1)))  # type: ignore[arg-type]
    step = 1 << CALL_ID_SALT_BITS
    assert ids[1] - ids[0] == step and ids[2] - ids[1] == step
    assert ids[0] >= step and len({i % step for i in ids}) == 1


def test_a_slot_admitted_for_a_client_that_left_goes_back() -> None:
    import asyncio

    from flexpipe.gateway.shared_state import admit_shared

    class Shared:
        def __init__(self) -> None:
            self.answer: asyncio.Future[tuple[bool, float, str]] | None = None
            self.ended: list[tuple[str, float, float]] = []

        async def tenant_admit(self, name: str, num_tokens: float) -> tuple[bool, float, str]:
            self.answer = asyncio.get_running_loop().create_future()
            return await self.answer

        def tenant_end(self, name: str, charged: float, used: float) -> None:
            self.ended.append((name, charged, used))

    async def run(verdict: tuple[bool, float, str]) -> list[tuple[str, float, float]]:
        shared = Shared()
        task = asyncio.ensure_future(admit_shared(shared, "0:a", 300.0))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        task.cancel()  # the client left while the answer was on its way
        await asyncio.sleep(0)
        assert shared.answer is not None
        shared.answer.set_result(verdict)
        for _ in range(3):
            await asyncio.sleep(0)
        assert task.cancelled()
        return shared.ended

    assert asyncio.run(run((True, 0.0, ""))) == [("0:a", 300.0, 0)]
    assert asyncio.run(run((False, 1.0, "concurrency limit reached"))) == []
