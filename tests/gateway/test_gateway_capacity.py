"""Capacity at the gateway: each instance's cap from what it was launched with or reports,
requests shared in proportion to capacity over a pool of unequal REAL sim engines, and a
backend behind an API key discovered with that key."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import openai
from test_gateway_api import Running
from test_gateway_fakes import LoopThread

from flexpipe.engine.testing import request, scrape, sim_engine
from flexpipe.gateway.core.pool import Pool, derive_max_concurrency
from flexpipe.gateway.prober import parse_engine_metrics

MODEL = "llama-2-7b"
ADMIN = "s3cret"


def test_cap_is_configured_else_slots_plus_a_small_queue_else_the_default() -> None:
    assert derive_max_concurrency(5, 48, 100, 256) == (5, "configured")  # explicit wins
    assert derive_max_concurrency(0, 48, 100, 256) == (54, "max_num_seqs")  # 48 + 48 // 8
    assert derive_max_concurrency(0, 16, 0, 256) == (18, "max_num_seqs")
    assert derive_max_concurrency(0, 2, 0, 256) == (2, "max_num_seqs")  # no queue below 8
    assert derive_max_concurrency(0, 0, 100, 256) == (112, "kv_cache")
    assert derive_max_concurrency(0, 1024, 0, 256) == (256, "max_num_seqs")  # the ceiling
    assert derive_max_concurrency(0, 0, 0, 256) == (256, "default")


def test_pool_takes_registered_then_reported_capacity() -> None:
    pool = Pool(default_max_concurrency=256)
    woken: list[int] = []
    pool.on_change(lambda: woken.append(1))
    a = pool.add("http://a", "m", max_num_seqs=16)
    b = pool.add("http://b", "m")
    c = pool.add("http://c", "m", max_concurrency=4, max_num_seqs=16)
    assert [(i.max_concurrency, i.num_slots) for i in (a, b, c)] == [(18, 16), (256, 0), (4, 16)]
    assert c.view().num_slots == 16 and c.view().max_concurrency == 4
    num_woken = len(woken)
    pool.report_capacity(b, 0, 4096 * 16, 512.0)  # vLLM: only its KV cache, 128 mean requests
    assert (b.max_concurrency, b.max_concurrency_source, b.num_slots) == (144, "kv_cache", 128)
    assert len(woken) == num_woken  # the cap shrank: nobody to wake
    pool.report_capacity(a, 48, 0, 512.0)  # the engine's own max_num_seqs wins
    assert (a.max_concurrency, a.as_dict()["max_num_seqs"]) == (54, 48)
    assert len(woken) == num_woken + 1
    pool.report_capacity(c, 48, 0, 512.0)
    assert c.max_concurrency == 4  # configured stays


def test_parse_engine_metrics_reads_vllm_cache_config_and_sim_max_num_seqs() -> None:
    text = (
        b"# HELP vllm:cache_config_info Information of the LLMEngine for cache_config\n"
        b'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
        b'num_gpu_blocks="2048",sliding_window="None"} 1.0\n'
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'flexpipe:max_num_seqs{engine="0",model_name="m"} 48.0\n'
    )
    assert parse_engine_metrics(text) == {
        "num_kv_tokens": 32768.0,
        "num_running": 3.0,
        "max_num_seqs": 48.0,
    }


def _sample_in_flight(r: Running, peak: dict[str, int], stop: threading.Event) -> None:
    while not stop.is_set():
        for url in peak:
            peak[url] = max(peak[url], r.gw.pool.get(url).num_in_flight)
        time.sleep(0.002)


def _stream_chats(url: str, num_requests: int, num_clients: int) -> list[str]:
    """`num_clients` closed loops of streamed chats (16 tokens); the finish reasons."""

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        queue = list(range(num_requests))
        finishes: list[str] = []

        async def worker() -> None:
            while queue:
                i = queue.pop()
                kw: dict[str, Any] = {"extra_body": {"ignore_eos": True}}
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"request {i}: a story"}],
                    max_tokens=16,
                    stream=True,
                    **kw,
                )
                async for ch in stream:
                    if ch.choices and ch.choices[0].finish_reason:
                        finishes.append(ch.choices[0].finish_reason)

        try:
            await asyncio.gather(*(worker() for _ in range(num_clients)))
        finally:
            await client.close()
        return finishes

    return asyncio.run(main())


def _served(urls: list[str]) -> list[float]:
    return [scrape(request("GET", u + "/metrics").text, "vllm:request_success_total") for u in urls]


def test_unequal_sim_engines_share_requests_by_capacity(lt: LoopThread) -> None:
    """Engines of 12, 6 and 2 slots (max_num_seqs, reported over /metrics), a gateway with
    nothing configured but their URLs, 16 streams at a time (80 % of the 20 slots). With
    least_request each engine's share of requests follows its slots; with the default
    prefix_affinity (new prefixes: its capacity-weighted hash ring) the small one gets no
    more than its share (a 2-slot home is often busy and its keys spill on: less, which
    its TTFT does not mind). Under both, none is sent more than its slots and the small one
    never makes a request wait."""
    slots = (12, 6, 2)
    fair = [s / sum(slots) for s in slots]  # 0.6, 0.3, 0.1
    base = [MODEL, "--load-time-s", "0", "--time-scale", "1"]
    with (
        sim_engine([*base, "--max-num-seqs", str(slots[0])]) as big,
        sim_engine([*base, "--max-num-seqs", str(slots[1])]) as mid,
        sim_engine([*base, "--max-num-seqs", str(slots[2])]) as small,
    ):
        urls = [e.url for e in (big, mid, small)]
        for policy in ("least_request", "prefix_affinity"):
            backends = [{"url": u} for u in urls]
            r = Running(lt, [], backends=backends, admin_token=ADMIN, routing={"policy": policy})
            try:
                status, _, body = r.http(
                    "GET", "/admin/instances", headers={"authorization": f"Bearer {ADMIN}"}
                )
                listed = {i["url"]: i for i in json.loads(body)["instances"]}
                assert status == 200
                assert [listed[u]["max_concurrency"] for u in urls] == [13, 6, 2]
                assert {listed[u]["max_concurrency_source"] for u in urls} == {"max_num_seqs"}

                stop = threading.Event()
                peak = dict.fromkeys(urls, 0)  # gateway in flight, sampled
                sampler = threading.Thread(target=_sample_in_flight, args=(r, peak, stop))
                sampler.start()
                num_requests = 160
                before = _served(urls)
                try:
                    finishes = _stream_chats(r.url, num_requests, 16)
                finally:
                    stop.set()
                    sampler.join(5)
                assert finishes == ["length"] * num_requests
                served = [b - a for a, b in zip(before, _served(urls), strict=True)]
                assert sum(served) == num_requests
                shares = [n / num_requests for n in served]
                if policy == "least_request":
                    for share, want in zip(shares, fair, strict=True):
                        assert abs(share - want) <= 0.04 + 0.25 * want, (policy, shares)
                else:
                    assert shares[2] <= 1.25 * fair[2] + 0.04, (policy, shares)
                    assert shares[0] >= 0.75 * fair[0], (policy, shares)
                # no instance is sent more than its slots while the pool has room ...
                peaks = [peak[u] for u in urls]
                assert all(p <= n for p, n in zip(peaks, slots, strict=True)), (policy, peaks)
            finally:
                r.close()
        # ... and the small engine never made a request wait (its own queue-time histogram)
        text = request("GET", small.url + "/metrics").text
        num_quick = scrape(text, "vllm:request_queue_time_seconds_bucket", le="0.5")
        assert num_quick == scrape(text, "vllm:request_queue_time_seconds_count") > 0


def test_backend_with_api_key_and_no_model_is_discovered_and_used(lt: LoopThread) -> None:
    key = "sk-engine-123"
    with sim_engine([MODEL, "--load-time-s", "0", "--time-scale", "0", "--api-key", key]) as eng:
        assert request("GET", eng.url + "/v1/models").status == 401  # the engine wants it
        without = Running(lt, [], backends=[{"url": eng.url}])
        try:  # the negative control: discovery without the key leaves it ejected
            inst = without.gw.pool.get(eng.url)
            assert (inst.model, inst.healthy) == (None, False)
        finally:
            without.close()
        r = Running(lt, [], backends=[{"url": eng.url, "api_key": key}])
        try:
            inst = r.gw.pool.get(eng.url)
            assert (inst.model, inst.healthy) == (MODEL, True)
            assert inst.scraped_at_s is not None and inst.max_num_seqs == 256  # scraped too
            out = r.client().completions.create(model=MODEL, prompt="hello", max_tokens=4)
            assert out.usage is not None and out.usage.completion_tokens == 4
        finally:
            r.close()
