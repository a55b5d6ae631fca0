"""A stream moved by recompute pauses for about one engine step, not one prefill: before the
cut-over the gateway warms the destination's prefix cache with the continuation it will send
(`relay.warm_up`), so the continuation prefills only the tokens generated meanwhile. Side by
side with the same move unwarmed (warm_timeout_s 0), which pauses for the whole prefill. Real
sim engines, real HTTP, the official client; the bound is the performance model's prefill."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import openai
import orjson
import pytest
from test_gateway_fakes import LoopThread
from test_gateway_moves import AUTH, MODEL, requests_on
from test_gateway_moves import gateway as make_gateway
from test_move_priority import BASE, register

from flexpipe.engine.args import parse_engine_args
from flexpipe.engine.testing import EngineProc, sim_engine

NUM_PROMPT_WORDS = 2000  # + BOS: a ~2k-token context
NUM_BEFORE = 10  # tokens streamed from the source before the move
MAX_TOKENS = 40
PM = parse_engine_args(BASE).pm  # what the sim engines (same arguments) time prefills with


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineProc]]:
    with ExitStack() as stack:
        yield [stack.enter_context(sim_engine(BASE)) for _ in range(2)]


def engine_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def move(r: Any, call_id: int, target: str, warm_timeout_s: float | None) -> dict[str, Any]:
    m: dict[str, Any] = {"id": call_id, "method": "recompute", "target": target}
    if warm_timeout_s is not None:
        m["warm_timeout_s"] = warm_timeout_s
    status, _, raw = r.http("POST", "/admin/requests/move", orjson.dumps({"moves": [m]}), AUTH)
    assert status == 200
    return dict(orjson.loads(raw)["results"][0])


async def stream(
    r: Any, prompt: str, on_first: Any = None, on_token: Any = None
) -> tuple[list[str], list[float]]:
    """The pieces of a streamed completion through the gateway, each with when it came;
    `on_first` runs at the first token, `on_token` (in a thread) at the NUM_BEFORE-th."""
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    pieces: list[str] = []
    times: list[float] = []
    task: asyncio.Task[Any] | None = None
    s = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for ch in s:
        if ch.choices and ch.choices[0].text:
            pieces.append(ch.choices[0].text)
            times.append(time.monotonic())
            if on_first is not None and len(pieces) == 1:
                on_first()
            if on_token is not None and len(pieces) == NUM_BEFORE:
                task = asyncio.create_task(asyncio.to_thread(on_token))
    await client.close()
    if task is not None:
        await task
    return pieces, times


@pytest.mark.parametrize("warm", [True, False])
def test_a_warmed_recompute_move_pauses_for_a_step_not_a_prefill(
    lt: LoopThread, engines: list[EngineProc], warm: bool
) -> None:
    source, target = engines[0].url, engines[1].url
    # a prompt neither engine has seen (module-scoped engines keep their caches)
    prompt = " ".join(f"w{warm:d}x{i}" for i in range(NUM_PROMPT_WORDS))
    r = make_gateway(lt, [engines[0]])
    try:
        reference, _ = asyncio.run(stream(r, prompt))  # unmoved, on `source`
        hits0 = engine_metric(target, "vllm:prefix_cache_hits_total")
        results: list[dict[str, Any]] = []
        moved_at: list[float] = []

        def do_move() -> None:
            (req,) = requests_on(r, source)
            moved_at.append(time.monotonic())
            results.append(move(r, req["id"], target, None if warm else 0.0))

        # the target joins once the stream runs on `source`
        pieces, times = asyncio.run(stream(r, prompt, lambda: register(r, target), do_move))
        hits_tokens = engine_metric(target, "vllm:prefix_cache_hits_total") - hits0
        assert [x["outcome"] for x in results] == ["recompute"]
        assert results[0]["warmed"] is warm
        # the outcome in the answer and counted in the gateway's /metrics (bound 0: skipped)
        outcome = "warmed" if warm else "skipped"
        assert results[0]["warm"] == outcome
        status, _, raw = r.http("GET", "/metrics")
        counted = re.findall(r'^flexpipe_move_warm_ups_total\{outcome="(\w+)"\} (\S+)$',
                             raw.decode(), re.M)  # fmt: skip
        assert status == 200 and [(o, float(n)) for o, n in counted] == [(outcome, 1.0)]
        # seamless: every token once, the same text as unmoved up to the move
        assert len(pieces) == MAX_TOKENS == len(reference)
        assert pieces[:NUM_BEFORE] == reference[:NUM_BEFORE]
        gaps = [b - a for a, b in itertools.pairwise(times) if b > moved_at[0]]
        pause_s = max(gaps)
        context = NUM_PROMPT_WORDS + 1 + NUM_BEFORE
        prefill_s = PM.prefill_s(context)
        if warm:
            # about one engine step (the tail prefill) plus a new HTTP request: well under
            # the context's prefill on the destination; its cache held the context
            assert pause_s < 0.5 * prefill_s, (pause_s, prefill_s)
            assert hits_tokens >= NUM_PROMPT_WORDS - 2 * 16
        else:
            assert pause_s >= 0.9 * prefill_s, (pause_s, prefill_s)
            assert hits_tokens < 16
        # the warm-up finished and freed its slot: nothing left on the destination
        deadline = time.monotonic() + 5
        while engine_metric(target, "vllm:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine_metric(target, "vllm:num_requests_running") == 0
        assert engine_metric(target, "vllm:num_requests_waiting") == 0
        assert r.gw.num_active_calls == 0
    finally:
        r.close()
