"""A recompute move cuts over right after its source's next token (flexpipe.gateway.core.cut_over):
asked in the middle of a source step, it waits for that step's token, relays it, and sends the
continuation with it; cut at once (`max_token_wait_s` 0, as before), it throws the step in
progress away and the client's gap starts at the token before. Side by side, real sim
engines (a slow source: long steps make the half step visible), real HTTP, the official
client. Which tokens came from the source is read from the destination's prompt, not guessed
from timing."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
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
from test_warm_moves import engine_metric

from flexpipe.engine.testing import EngineProc, sim_engine
from flexpipe.gateway.core.cut_over import MAX_TOKEN_WAIT_S

NUM_PROMPT_WORDS = 40
NUM_BEFORE = 3  # tokens streamed from the source before the move is asked
MAX_TOKENS = 8
SOURCE_TIME_SCALE = 20  # wall seconds per modelled second on the source: steps of ~0.2 s


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineProc]]:
    slow = list(BASE)
    slow[slow.index("--time-scale") + 1] = str(SOURCE_TIME_SCALE)
    with ExitStack() as stack:
        yield [stack.enter_context(sim_engine(slow)), stack.enter_context(sim_engine(BASE))]


def prompt_tokens(url: str) -> float:
    return engine_metric(url, "vllm:prompt_tokens_total")


def test_a_recompute_move_cuts_over_right_after_a_source_token(
    lt: LoopThread, engines: list[EngineProc]
) -> None:
    source, target = engines[0].url, engines[1].url
    seen: dict[bool, tuple[float, float, int]] = {}
    for aligned in (True, False):
        r = make_gateway(lt, [engines[0]])  # the target joins once the stream runs on `source`
        try:
            before = prompt_tokens(target)
            times, moved_at, result = stream_and_move(r, source, target, aligned)
            assert result["outcome"] == "recompute" and len(times) == MAX_TOKENS
            # the continuation's prompt: the client's prompt (+ BOS) and what the source gave
            num_from_source = round(prompt_tokens(target) - before) - (NUM_PROMPT_WORDS + 1)
            assert NUM_BEFORE <= num_from_source < MAX_TOKENS
            last_source_s = times[num_from_source - 1]  # its last token on the source
            gap_s = times[num_from_source] - last_source_s  # the cut-over, as the client saw it
            seen[aligned] = (gap_s, last_source_s - moved_at, num_from_source)
            assert r.gw.num_active_calls == 0
        finally:
            r.close()
    # aligned: the source's step in progress was not thrown away: its token came after the
    # move was asked (relayed, and in the continuation), then the cut-over
    assert seen[True][1] > 0, seen
    # cut at once: the client's gap began at the token before the move was asked
    assert seen[False][1] < 0, seen
    # and so the aligned cut-over's gap is shorter, by about the half step it waited for
    assert seen[True][0] < seen[False][0], seen


def stream_and_move(
    r: Any, source: str, target: str, aligned: bool
) -> tuple[list[float], float, dict[str, Any]]:
    """Stream a completion; after NUM_BEFORE tokens from `source`, ask (in a thread) for a
    recompute move to `target` half a source step after the last token (no warm-up: the
    cut-over's timing alone). Returns when each token came, when the move was asked, and the
    move's result."""
    times: list[float] = []
    moved_at: list[float] = []
    results: list[dict[str, Any]] = []

    def do_move(last_s: float, step_s: float) -> None:
        time.sleep(max(0.0, last_s + 0.5 * step_s - time.monotonic()))
        (req,) = requests_on(r, source)
        m: dict[str, Any] = {"id": req["id"], "method": "recompute", "target": target,
                             "warm_timeout_s": 0}  # fmt: skip
        if not aligned:
            m["max_token_wait_s"] = 0
        moved_at.append(time.monotonic())
        body = orjson.dumps({"moves": [m]})
        status, _, raw = r.http("POST", "/admin/requests/move", body, AUTH)
        assert status == 200
        results.append(orjson.loads(raw)["results"][0])

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        prompt = " ".join(f"a{int(aligned)}w{i}" for i in range(NUM_PROMPT_WORDS))
        mover: threading.Thread | None = None
        s = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for ch in s:
            if ch.choices and ch.choices[0].text:
                times.append(time.monotonic())
                if len(times) == 1:
                    register(r, target)
                if len(times) == NUM_BEFORE:
                    step_s = statistics.median(b - a for a, b in itertools.pairwise(times))
                    # asked half a step in, the next token comes well within the wait's cap
                    assert 0.5 * step_s < 0.6 * MAX_TOKEN_WAIT_S, step_s
                    mover = threading.Thread(target=do_move, args=(times[-1], step_s))
                    mover.start()
        await client.close()
        if mover is not None:
            await asyncio.to_thread(mover.join)

    asyncio.run(run())
    return times, moved_at[0], results[0]
