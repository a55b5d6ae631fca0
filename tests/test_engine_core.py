"""The sim engine's pure core, stepped by hand: tokenizer, block manager, scheduler."""

from __future__ import annotations

from flexpipe.engine.block_manager import BlockManager, KVState
from flexpipe.engine.request import EngineRequest, SamplingParams
from flexpipe.engine.scheduler import Scheduler, SchedulerConfig
from flexpipe.engine.tokenizer import BOS_ID, EOS_ID, Tokenizer

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
    assert kv.block_ids == [0, 1, 2]
    bm.cache_full_blocks(kv, 5)
    bm.free(kv)
    assert list(bm.free_queue) == [3, 2, 1, 0]  # freed tail first
    kv2 = KVState()
    bm.update_hashes(kv2, tokens)
    hits = bm.computed_blocks(kv2, 5)
    assert hits == [0, 1]
    assert bm.allocate(kv2, 5, hits)
    assert kv2.block_ids == [0, 1, 3]  # new block: least recently freed (3)
    assert bm.usage == 0.75
    # a different prefix evicts the cached block 2 (the only free one)
    kv3 = KVState()
    bm.update_hashes(kv3, [9, 9])
    assert bm.computed_blocks(kv3, 2) == []
    assert bm.allocate(kv3, 2)
    assert kv3.block_ids == [2]
    assert not bm.allocate(KVState(), 2)


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
