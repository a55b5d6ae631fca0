"""The simulator's event loop and workloads: deterministic order, seeded generators, traces."""

from __future__ import annotations

import itertools
import random
import statistics
from pathlib import Path

import pytest

from flexpipe.engine.block_manager import BlockManager, KVState
from flexpipe.policies.routing import prompt_block_hashes
from flexpipe.sim.loop import ARRIVAL, SCRAPE, STEP_END, EventLoop
from flexpipe.sim.request import PREFIX_BLOCK_TOKENS, SimRequest
from flexpipe.sim.trace import TraceReplay, read_azure, read_mooncake
from flexpipe.sim.workload import Diurnal, LengthDist, SharedPrefix, Synthetic, WorkloadError

DATA = Path(__file__).parents[1] / "data"


def test_loop_orders_by_time_then_priority_then_insertion() -> None:
    loop = EventLoop()
    log: list[str] = []

    def rec(name: str, follow: bool = False) -> object:
        def act(t: float) -> None:
            log.append(f"{name}@{t:g}")
            if follow:  # an action schedules a follow-up at the same time, lower priority
                loop.at(t, SCRAPE, lambda t2: log.append(f"{name}-follow@{t2:g}"))

        return act

    loop.at(2.0, ARRIVAL, rec("a2"))  # type: ignore[arg-type]
    loop.at(1.0, SCRAPE, rec("s1"))  # type: ignore[arg-type]
    loop.at(1.0, ARRIVAL, rec("a1", follow=True))  # type: ignore[arg-type]
    loop.at(1.0, STEP_END, rec("e1"))  # type: ignore[arg-type]
    loop.at(1.0, ARRIVAL, rec("a1b"))  # type: ignore[arg-type]
    loop.run(1.5)
    assert log == ["e1@1", "a1@1", "a1b@1", "s1@1", "a1-follow@1"]
    assert loop.now_s == 1.5 and loop.num_pending == 1
    loop.at(0.0, STEP_END, rec("late"))  # type: ignore[arg-type]  # never before now
    loop.run(10)
    assert log[-2:] == ["late@1.5", "a2@2"]
    assert loop.num_events == 7


def test_two_loops_do_not_share_counters() -> None:
    a, b = EventLoop(), EventLoop()
    out: list[str] = []
    for loop, name in ((a, "a"), (b, "b")):
        loop.at(1.0, ARRIVAL, lambda t, n=name: out.append(n + "1"))
        loop.at(1.0, ARRIVAL, lambda t, n=name: out.append(n + "2"))
    b.run(2)
    a.run(2)
    assert out == ["b1", "b2", "a1", "a2"]


def _gaps(src: Synthetic, seed: int, until: float) -> list[float]:
    times = [a[0] for a in src.arrivals(random.Random(seed), until)]
    return [y - x for x, y in itertools.pairwise(times)]


def test_poisson_and_gamma_rates_and_burstiness() -> None:
    fixed = LengthDist("fixed", 100)
    poisson = Synthetic(10.0, fixed, fixed)
    gamma = Synthetic(10.0, fixed, fixed, arrival="gamma", cv=3.0)
    for src, cv in ((poisson, 1.0), (gamma, 3.0)):
        gaps = _gaps(src, 1, 2000)
        assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.15)
    # same seed, same requests; another seed, others
    assert list(poisson.arrivals(random.Random(5), 50)) == list(
        poisson.arrivals(random.Random(5), 50)
    )
    assert list(poisson.arrivals(random.Random(5), 50)) != list(
        poisson.arrivals(random.Random(6), 50)
    )


def test_diurnal_rate_follows_the_cosine() -> None:
    fixed = LengthDist("fixed", 10)
    src = Synthetic(20.0, fixed, fixed, diurnal=Diurnal(period_s=1000, amplitude=0.8, peak_s=0))
    times = [a[0] for a in src.arrivals(random.Random(2), 1000)]
    near_peak = sum(1 for t in times if t < 100 or t >= 900) / 200
    near_trough = sum(1 for t in times if 400 <= t < 600) / 200
    assert near_peak == pytest.approx(20 * (1 + 0.8 * 0.935), rel=0.15)
    assert near_trough == pytest.approx(20 * (1 - 0.8 * 0.935), rel=0.35)
    assert len(times) / 1000 == pytest.approx(20, rel=0.1)


def test_length_distributions() -> None:
    rng = random.Random(0)
    logn = [LengthDist("lognormal", 1000, cv=0.5, max=10**6).sample(rng) for _ in range(20000)]
    assert statistics.mean(logn) == pytest.approx(1000, rel=0.03)
    assert statistics.stdev(logn) / statistics.mean(logn) == pytest.approx(0.5, rel=0.08)
    uni = [LengthDist("uniform", 5, min=3, max=7).sample(rng) for _ in range(2000)]
    assert set(uni) == {3, 4, 5, 6, 7}
    capped = [LengthDist("exponential", 100, max=150).sample(rng) for _ in range(2000)]
    assert max(capped) == 150 and min(capped) >= 1
    with pytest.raises(WorkloadError, match="unknown length distribution"):
        LengthDist("zipf")


def test_azure_trace_rows_are_relative_seconds() -> None:
    rows = read_azure(DATA / "azure_conv_head.csv")
    assert len(rows) == 40
    assert rows[0] == (0.0, 374, 44, ())
    assert rows[1][0] == pytest.approx(50.995169 - 46.68059)
    assert rows[-1][1:3] == (28, 175)
    replay = TraceReplay("azure", DATA / "azure_conv_head.csv", speedup=2.0, offset_s=1.0)
    got = list(replay.arrivals(until_s=10.0))
    assert got[1][0] == pytest.approx(1.0 + rows[1][0] / 2)
    assert all(a[0] <= 10.0 for a in got) and len(got) < 40


def test_mooncake_trace_and_shared_prefixes() -> None:
    rows = read_mooncake(DATA / "mooncake_head.jsonl")
    assert len(rows) == 30
    t, prompt, output, ids = rows[0]
    assert (t, prompt, output) == (0.0, 6758, 500) and ids[:3] == (0, 1, 2)
    a = SimRequest(0, 0.0, "m", rows[0][1], rows[0][2], rows[0][3])
    b = SimRequest(1, 0.0, "m", rows[1][1], rows[1][2], rows[1][3])
    assert rows[1][3][0] == 0 and rows[1][3][1] != rows[0][3][1]  # one shared block
    ta, tb = a.prompt_token_ids(), b.prompt_token_ids()
    assert len(ta) == 6758 and len(tb) == rows[1][1]
    assert ta[:PREFIX_BLOCK_TOKENS] == tb[:PREFIX_BLOCK_TOKENS]
    assert ta[PREFIX_BLOCK_TOKENS] != tb[PREFIX_BLOCK_TOKENS]
    # the gateway's prefix hashes see the same one shared block (512 tokens = 32 x 64 bytes)
    ha, hb = prompt_block_hashes(a.prompt_bytes()), prompt_block_hashes(b.prompt_bytes())
    shared = next(i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y)
    assert shared == PREFIX_BLOCK_TOKENS * 4 // 64
    assert len(a.prompt_bytes()) == 4 * 6758


def test_unique_prompts_share_nothing() -> None:
    src = Synthetic(5.0, LengthDist("fixed", 700), LengthDist("fixed", 10),
                    shared_prefix=SharedPrefix(num_groups=1, num_tokens=512))  # fmt: skip
    arr = list(src.arrivals(random.Random(0), 2))
    reqs = [SimRequest(i, a[0], "m", a[1], a[2], a[3]) for i, a in enumerate(arr)]
    assert len(reqs) >= 2
    x, y = reqs[0].prompt_token_ids(), reqs[1].prompt_token_ids()
    assert x[:512] == y[:512] and x[512] != y[512]
    # what the engine's prefix cache sees: 16-token blocks, hashed in a chain
    hx, hy = _engine_block_hashes(x), _engine_block_hashes(y)
    assert len(hx) == 700 // 16 and hx[:32] == hy[:32] and not set(hx[32:]) & set(hy[32:])
    solo = [_engine_block_hashes(SimRequest(i, 0, "m", 100, 1).prompt_token_ids()) for i in (0, 1)]
    assert len(solo[0]) == 6 and not set(solo[0]) & set(solo[1])


def test_prompt_token_ids_exact() -> None:
    """The unique part: the request's own first id, then 1, 2, 3, ...; a fresh list each time
    (the engine owns it)."""
    from flexpipe.sim.request import _UNIQUE_BASE

    first = SimRequest(7, 0.0, "m", 5, 1).prompt_token_ids()
    assert first == [_UNIQUE_BASE + 7, 1, 2, 3, 4]
    first[1] = -1
    assert SimRequest(8, 0.0, "m", 3, 1).prompt_token_ids() == [_UNIQUE_BASE + 8, 1, 2]
    assert SimRequest(9, 0.0, "m", 1, 1).prompt_token_ids() == [_UNIQUE_BASE + 9]
    shared = SimRequest(3, 0.0, "m", PREFIX_BLOCK_TOKENS + 3, 1, (2,)).prompt_token_ids()
    start = 2 * PREFIX_BLOCK_TOKENS
    assert shared == [*range(start, start + PREFIX_BLOCK_TOKENS), _UNIQUE_BASE + 3, 1, 2]


def _engine_block_hashes(token_ids: list[int]) -> list[int]:
    kv, bm = KVState(), BlockManager(1, 16)
    bm.update_hashes(kv, token_ids)
    return bm.block_hashes(kv)


def test_prompt_block_hashes_without_the_bytes() -> None:
    """The gateway's prefix hashes of a simulated prompt, from its runs of equal blocks, are
    those of its bytes: shared blocks, a prompt ending inside one, the unique part, and
    block sizes the runs do not fit (from the bytes then)."""
    rng = random.Random(3)
    reqs = [SimRequest(0, 0.0, "m", 1, 1), SimRequest(1, 0.0, "m", 17, 1, (5,)),
            SimRequest(2, 0.0, "m", PREFIX_BLOCK_TOKENS, 1, (5, 6)),
            SimRequest(3, 0.0, "m", PREFIX_BLOCK_TOKENS * 2 + 3, 1, (5, 6))]  # fmt: skip
    for i in range(4, 200):
        prefix = tuple(rng.randrange(1 << 20) for _ in range(rng.randrange(4)))
        reqs.append(SimRequest(i, 0.0, "m", rng.randrange(1, 3000), 1, prefix))
    for req in reqs:
        assert req.num_prompt_bytes == len(req.prompt_bytes())
        for block_chars in (8, 16, 64, 128, 2048, 4096, 48, 100):
            expected = prompt_block_hashes(req.prompt_bytes(), block_chars)
            assert req.prompt_block_hashes(block_chars) == expected, (req, block_chars)
