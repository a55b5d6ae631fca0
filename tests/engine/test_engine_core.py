"""The sim engine's pure core, stepped by hand: tokenizer, block manager, scheduler, and the
engine core on a virtual clock (exact timestamps: sums of the performance model's durations)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from flexpipe.engine.block_manager import BlockManager, KVState
from flexpipe.engine.core import EngineCore, StepEvents
from flexpipe.engine.metrics import EngineMetrics
from flexpipe.engine.request import EngineRequest, SamplingParams
from flexpipe.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from flexpipe.engine.tokenizer import BOS_ID, EOS_ID, Tokenizer
from flexpipe.perf import BatchShape, Efficiency, perf_model_for
from flexpipe.perf.calibration import NO_CALIBRATION

GEN = (100, 101, 102)


def make_req(rid: str, prompt: list[int], max_tokens: int = 4, **params: object) -> EngineRequest:
    return EngineRequest(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **params),
        max_tokens,
        GEN,  # type: ignore[arg-type]
    )


def make_sched(
    num_blocks: int = 64, block_size: int = 4, **cfg: object
) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**cfg), bm), bm  # type: ignore[arg-type]


def run_to_end(s: Scheduler, max_steps: int = 1000) -> int:
    steps = 0
    while s.has_work and steps < max_steps:
        s.finish_step(s.schedule())
        steps += 1
    return steps


def test_tokenizer_counts_words_and_punctuation() -> None:
    tok = Tokenizer(32000)
    ids = tok.encode("Hello, world!")
    assert ids[0] == BOS_ID and len(ids) == 5
    assert tok.encode("Hello, world!", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "Hello, world!"
    assert all(3 <= i < 32000 for i in ids[1:])
    # stable across instances (a hash, not a learned vocabulary)
    assert Tokenizer(32000).encode("Hello, world!") == ids
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert len(tok.encode(chat)) == 1 + (5 + 2) + 5


def test_generation_is_deterministic_and_stops_at_max_tokens() -> None:
    a = make_req("a", [5, 6, 7], max_tokens=6)
    b = make_req("b", [5, 6, 7], max_tokens=6)
    for r in (a, b):
        while r.finish_reason is None:
            r.sample()
    assert a.output_token_ids == b.output_token_ids
    assert a.num_output_tokens == 6 and a.finish_reason == "length"
    c = make_req("c", [5, 6, 8], max_tokens=6, seed=3)
    while c.finish_reason is None:
        c.sample()
    assert c.output_token_ids != a.output_token_ids


def test_natural_stop_without_max_tokens_ends_in_eos() -> None:
    r = EngineRequest("n", [9, 9], SamplingParams(max_tokens=None), 10_000, GEN)
    while r.finish_reason is None:
        r.sample()
    assert r.finish_reason == "stop" and r.token_ids[-1] == EOS_ID
    assert 8 <= r.num_output_tokens <= 256


def test_block_manager_prefix_hit_and_lru_eviction() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    kv = KVState()
    bm.update_hashes(kv, tokens)
    assert bm.allocate(kv, 5)
    assert kv.num_blocks == 3
    bm.cache_full_blocks(kv, 5)
    h0, h1 = bm.block_hashes(kv)
    assert bm.cached == {h0: 1, h1: 1}
    bm.free(kv)
    # freed tail first, after the never-used block: [3, 2, 1, 0] by block id
    assert bm.free_entries() == [None, None, h1, h0]
    kv2 = KVState()
    bm.update_hashes(kv2, tokens)
    hits = bm.computed_blocks(kv2, 5)
    assert len(hits) == 2
    assert bm.allocate(kv2, 5, hits)
    # its new block is the least recently freed (the never-used one), so the partial block
    # freed by `kv` is next in line
    assert bm.free_entries() == [None] and bm.cached == {h0: 1, h1: 1}
    assert bm.usage == 0.75
    # a different prefix takes the only free block
    kv3 = KVState()
    bm.update_hashes(kv3, [9, 9])
    assert bm.computed_blocks(kv3, 2) == []
    assert bm.allocate(kv3, 2)
    assert not bm.allocate(KVState(), 2)
    # freeing kv2 queues its blocks tail first; a new allocation evicts its tail's entry first
    bm.free(kv2)
    assert bm.free_entries() == [None, h1, h0]
    kv4 = KVState()
    assert bm.allocate(kv4, 4)  # two blocks: the anonymous one, then h1's
    assert bm.cached == {h0: 0}


def test_continuous_batching_and_chunked_prefill() -> None:
    s, _ = make_sched(max_num_batched_tokens=8, max_num_seqs=2)
    a = make_req("a", list(range(10, 22)), max_tokens=2)  # 12 prompt tokens
    b = make_req("b", [1, 2, 3], max_tokens=2)
    c = make_req("c", [4, 5], max_tokens=1)
    for r in (a, b, c):
        s.add(r)
    p = s.schedule()
    assert [(r.request_id, n, before) for r, n, before in p.scheduled] == [("a", 8, 0)]
    assert p.batch.num_prefill_tokens == 8 and p.batch.num_decode_seqs == 0
    assert s.finish_step(p) == []  # a chunk: nothing sampled
    p = s.schedule()
    assert [(r.request_id, n) for r, n, _ in p.scheduled] == [("a", 4), ("b", 3)]
    assert [r.request_id for r in s.finish_step(p)] == ["a", "b"]
    p = s.schedule()  # both decode; c waits for a seat (max_num_seqs=2)
    assert p.batch.num_decode_seqs == 2 and p.batch.decode_context_tokens == 13 + 4
    assert s.num_waiting == 1
    done = s.finish_step(p)
    assert all(r.finish_reason == "length" for r in done)
    p = s.schedule()
    assert [r.request_id for r, _, _ in p.scheduled] == ["c"]
    run_to_end(s)
    assert c.num_output_tokens == 1 and s.bm.num_free_blocks == s.bm.num_blocks


def test_prefix_cache_hit_on_shared_prefix() -> None:
    s, bm = make_sched(block_size=4)
    shared = list(range(50, 62))  # 3 full blocks
    a = make_req("a", [*shared, 1, 2], max_tokens=1)
    s.add(a)
    run_to_end(s)
    b = make_req("b", [*shared, 3], max_tokens=1)
    s.add(b)
    p = s.schedule()
    assert p.scheduled == [(b, 1, 12)]
    assert b.num_cached_tokens == 12
    assert bm.stats.num_hit_tokens == 12
    assert bm.stats.num_queries_tokens == 14 + 13


def test_preemption_by_recompute_loses_nothing() -> None:
    s, bm = make_sched(num_blocks=6, block_size=4, max_num_seqs=8, watermark=0.0)
    reqs = [make_req(f"r{i}", [i + 10] * 6, max_tokens=10) for i in range(3)]
    for r in reqs:
        s.add(r)
    run_to_end(s)
    assert s.num_preemptions > 0
    assert all(r.finish_reason == "length" and r.num_output_tokens == 10 for r in reqs)
    assert bm.num_free_blocks == 6
    # recomputed outputs are the same tokens a lone run would give
    lone = make_req("r0", [10] * 6, max_tokens=10)
    s.add(lone)
    run_to_end(s)
    assert lone.output_token_ids == reqs[0].output_token_ids


def test_abort_frees_blocks_at_once() -> None:
    s, bm = make_sched()
    r = make_req("a", list(range(20)), max_tokens=100)
    s.add(r)
    s.finish_step(s.schedule())
    assert bm.num_free_blocks < bm.num_blocks
    plan = s.schedule()
    s.abort(r)
    assert bm.num_free_blocks == bm.num_blocks and r.finish_reason == "abort"
    assert s.finish_step(plan) == [] and not s.has_work


def test_preloaded_kv_is_not_recomputed() -> None:
    s, _ = make_sched(block_size=4)
    r = make_req("m", list(range(30, 50)), max_tokens=2)
    r.num_preloaded_tokens = 16
    s.add(r)
    p = s.schedule()
    assert p.scheduled == [(r, 4, 16)]
    assert p.batch.num_prefill_tokens == 4


def test_prompt_larger_than_the_cache_is_rejected() -> None:
    s, _ = make_sched(num_blocks=2, block_size=4)
    r = make_req("big", list(range(20)), max_tokens=1)
    s.add(r)
    p = s.schedule()
    assert p.rejected == [r] and r.finish_reason == "error" and not s.has_work


# --- the engine core on a virtual clock --------------------------------------------------
# Generic factors: the exact step sequence below (b joins at step 6) is timed on them.
PM = perf_model_for(
    "llama-2-7b",
    "tp=1",
    max_model_len=4096,
    efficiency=Efficiency(calibration=NO_CALIBRATION),
)


def make_core(num_blocks: int = 64, block_size: int = 4, **cfg: object) -> EngineCore:
    s, _ = make_sched(num_blocks, block_size, **cfg)
    return EngineCore(s, PM.step_time_s)


@dataclass
class Trace:
    """What a hand-driven virtual clock saw: each step's start, plan and events."""

    starts_s: list[float] = field(default_factory=list)
    plans: list[StepPlan] = field(default_factory=list)
    events: list[StepEvents] = field(default_factory=list)


def drive(
    core: EngineCore,
    arrivals: list[tuple[float, EngineRequest]],
    metrics: EngineMetrics | None = None,
    max_steps: int = 10_000,
) -> Trace:
    """A ten-line simulator: add what has arrived by `now`, step, advance the clock by the
    plan's duration, complete; jump to the next arrival when idle."""
    trace = Trace()
    pending = sorted(arrivals, key=lambda a: a[0])
    now = 0.0
    while (pending or core.has_work) and len(trace.plans) < max_steps:
        while pending and pending[0][0] <= now:
            arrival_s, req = pending.pop(0)
            core.add(req, arrival_s)  # it arrived during the last step: waits for the next
        if not core.has_work:
            now = pending[0][0]
            continue
        plan = core.step(now)
        if metrics is not None:
            metrics.observe_plan(plan)
        trace.starts_s.append(now)
        trace.plans.append(plan)
        now += plan.duration_s
        events = core.complete(plan, now)
        if metrics is not None:
            metrics.observe_step(events)
        trace.events.append(events)
    return trace


def ends_of(trace: Trace) -> list[float]:
    """Each step's end on the virtual clock: the plan durations summed, in order."""
    return list(accumulate(p.duration_s for p in trace.plans))


def sample(metrics: EngineMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def make_metrics(core: EngineCore) -> EngineMetrics:
    return EngineMetrics("m", core.scheduler, 4096, {"block_size": 4})


def two_requests() -> tuple[EngineCore, EngineRequest, EngineRequest, Trace, EngineMetrics]:
    core = make_core()
    metrics = make_metrics(core)
    a = make_req("a", list(range(10, 18)), max_tokens=20)
    b = make_req("b", list(range(30, 35)), max_tokens=4)
    return core, a, b, drive(core, [(0.0, a), (0.05, b)], metrics), metrics


def test_core_times_two_requests_by_the_plan_durations() -> None:
    core, a, b, trace, metrics = two_requests()
    plans, ends = trace.plans, ends_of(trace)
    assert len(plans) == 20 and not core.has_work
    # every duration is the performance model's price of the planned batch
    assert plans[0].batch == BatchShape.of(prefills=[(8, 0)])
    assert plans[1].batch == BatchShape.of(decode_contexts=[9])
    assert plans[6].batch == BatchShape.of(prefills=[(5, 0)], decode_contexts=[14])
    assert [p.duration_s for p in plans] == [PM.step_time_s(p.batch) for p in plans]
    # a: first token at the end of its prefill step, then one token per step
    assert a.arrival_s == 0.0 and a.scheduled_s == 0.0 and a.first_token_s == ends[0]
    assert a.num_output_tokens == 20 and a.finish_reason == "length"
    assert a.finished_s == ends[19] and a.tpot_s == (ends[19] - ends[0]) / 19
    # b arrived at 0.05, during step 5: it waits for step 6 to start
    assert trace.starts_s[5] < 0.05 < trace.starts_s[6] == ends[5]
    assert b.arrival_s == 0.05 and b.scheduled_s == ends[5] and b.queue_s == ends[5] - 0.05
    assert b.first_token_s == ends[6] and b.ttft_s == ends[6] - 0.05
    assert b.num_output_tokens == 4 and b.finished_s == ends[9]
    # events: who got a token at each step, exactly
    ev = trace.events
    assert [[r.request_id for r in e.progressed] for e in ev[5:11]] == [
        ["a"],
        ["a", "b"],
        ["a", "b"],
        ["a", "b"],
        ["a", "b"],
        ["a"],
    ]
    assert [e.now_s for e in ev] == ends
    assert [r.request_id for e in ev for r in e.first_token] == ["a", "b"]
    assert [(r.request_id, e.now_s) for e in ev for r in e.finished] == [
        ("b", ends[9]),
        ("a", ends[19]),
    ]
    assert ev[7].itl_s == [ends[7] - ends[6], ends[7] - ends[6]]
    assert sum(len(e.progressed) for e in ev) == 24
    # the metrics are fed from the same plans and events: the virtual clock's values
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 2
    assert sample(metrics, "vllm:time_to_first_token_seconds_sum") == a.ttft_s + b.ttft_s
    assert sample(metrics, "vllm:request_queue_time_seconds_sum") == b.queue_s
    assert sample(metrics, "vllm:e2e_request_latency_seconds_sum") == a.e2e_s + b.e2e_s
    assert sample(metrics, "vllm:inter_token_latency_seconds_count") == 19 + 3
    assert sample(metrics, "vllm:generation_tokens_total") == 24
    assert sample(metrics, "vllm:prompt_tokens_total") == 8 + 5
    assert sample(metrics, "vllm:request_success_total", finished_reason="length") == 2
    assert metrics.num_steps == 20 and metrics.busy_s == ends[-1]


def test_core_is_deterministic() -> None:
    def run() -> list[tuple[str, float, float, float, list[int]]]:
        _, a, b, _, _ = two_requests()
        return [
            (r.request_id, r.scheduled_s, r.first_token_s, r.finished_s, r.token_ids)
            for r in (a, b)
        ]

    assert run() == run()


def test_core_chunked_prefill_first_token_after_the_last_chunk() -> None:
    core = make_core(max_num_batched_tokens=8)
    r = make_req("long", list(range(100, 120)), max_tokens=2)  # 20 prompt tokens
    trace = drive(core, [(0.0, r)])
    ends = ends_of(trace)
    assert [p.batch for p in trace.plans] == [
        BatchShape.of(prefills=[(8, 0)]),
        BatchShape.of(prefills=[(8, 8)]),
        BatchShape.of(prefills=[(4, 16)]),
        BatchShape.of(decode_contexts=[21]),
    ]
    assert [len(e.progressed) for e in trace.events] == [0, 0, 1, 1]
    assert r.scheduled_s == 0.0 and r.first_token_s == ends[2] and r.finished_s == ends[3]


def test_core_preempts_under_a_tiny_kv_budget_and_recomputes() -> None:
    # 6 blocks of 4 tokens: three 6-token prompts fill them; at 9 tokens each needs a 3rd block
    core = make_core(num_blocks=6, block_size=4, max_num_seqs=8, watermark=0.0)
    metrics = make_metrics(core)
    reqs = [make_req(f"r{i}", [i + 10] * 6, max_tokens=10) for i in range(3)]
    trace = drive(core, [(0.0, r) for r in reqs], metrics)
    ends = ends_of(trace)
    first = next(i for i, p in enumerate(trace.plans) if p.preempted)
    assert first == 3 and trace.plans[3].preempted == [reqs[2]]
    assert [r.request_id for r, _, _ in trace.plans[3].scheduled] == ["r0", "r1"]
    assert all(r.finish_reason == "length" and r.num_output_tokens == 10 for r in reqs)
    assert sum(len(e.progressed) for e in trace.events) == 30
    assert core.scheduler.bm.num_free_blocks == 6
    # the first token keeps its time; the recompute shows in the next gap
    r2 = reqs[2]
    assert r2.first_token_s == ends[0] and r2.num_preemptions >= 1
    gaps = [g for e in trace.events for g in e.itl_s]
    assert max(gaps) > 2 * max(p.duration_s for p in trace.plans)
    assert sample(metrics, "vllm:num_preemptions_total") == core.scheduler.num_preemptions


def test_core_abort_mid_step_frees_blocks_and_drops_its_token() -> None:
    core = make_core()
    metrics = make_metrics(core)
    bm = core.scheduler.bm
    a = make_req("a", list(range(20)), max_tokens=100)
    b = make_req("b", list(range(40, 44)), max_tokens=100)
    core.add(a, 0.0)
    core.add(b, 0.0)
    plan = core.step(0.0)
    ev = core.complete(plan, plan.duration_s)
    assert ev.progressed == [a, b]
    now = plan.duration_s
    plan = core.step(now)
    assert core.abort(a, now + 0.001) and not core.abort(a, now + 0.002)
    metrics.observe_abort(a)
    assert a.finish_reason == "abort" and a.finished_s == now + 0.001
    assert bm.num_free_blocks == bm.num_blocks - b.kv.num_blocks
    ev = core.complete(plan, now + plan.duration_s)
    assert ev.progressed == [b] and a.num_output_tokens == 1
    assert sample(metrics, "vllm:request_success_total", finished_reason="abort") == 1


def test_core_prefix_cache_hit_shortens_the_first_token() -> None:
    core = make_core(block_size=4)
    shared = list(range(50, 62))  # 3 full blocks
    a = make_req("a", [*shared, 1, 2], max_tokens=1)
    b = make_req("b", [*shared, 3], max_tokens=1)
    trace = drive(core, [(0.0, a), (1.0, b)])
    assert [p.batch for p in trace.plans] == [
        BatchShape.of(prefills=[(14, 0)]),
        BatchShape.of(prefills=[(1, 12)]),  # 12 tokens hit the cache
    ]
    assert b.num_cached_tokens == 12 and core.scheduler.bm.stats.num_hit_tokens == 12
    assert b.scheduled_s == 1.0 and b.first_token_s == 1.0 + PM.step_time_s(trace.plans[1].batch)
    assert b.ttft_s < a.ttft_s


def test_core_rejects_what_never_fits_at_now() -> None:
    core = make_core(num_blocks=2, block_size=4)
    metrics = make_metrics(core)
    r = make_req("big", list(range(20)), max_tokens=1)
    core.add(r, 3.0)
    plan = core.step(3.5)
    metrics.observe_plan(plan)
    assert plan.rejected == [r] and plan.is_empty and plan.duration_s == 0.0
    assert r.finish_reason == "error" and r.finished_s == 3.5 and not core.has_work
    assert metrics.num_steps == 0
    assert sample(metrics, "vllm:e2e_request_latency_seconds_count") == 0
