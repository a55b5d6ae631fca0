"""Open-loop Poisson load for bench/shift.py, through the official `openai` client.

Arrivals are a seeded Poisson process (exponential gaps, `random.Random(seed)`): a request
is sent at its arrival time whether or not earlier ones have finished, so a stall of the
service shows up as queueing, not as a slower client. Each request is streamed, half chat and
half completion (seeded), with `ignore_eos` so its length is known in advance; every chunk
that carries text is time-stamped, which is what the pause measure needs. The instance that
served the request's head (`x-flexpipe-instance`) is recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import openai
from openai.types.chat import ChatCompletionStreamOptionsParam, ChatCompletionUserMessageParam

__all__ = ["USUAL_NUM_GAPS", "LoadMix", "PoissonLoad", "RequestRecord", "excess_pause_s"]

# How many of a stream's gaps just before a pause make its usual rhythm (`usual_gap`): a few
# steps of the batch it was in, not the whole stream (its batch changes over its life).
USUAL_NUM_GAPS = 5


def excess_pause_s(gap_s: float, usual_gap_s: float) -> float:
    """The interruption a pause caused beyond the stream's normal rhythm: the gap less the
    stream's usual gap there (what the client would have waited for the next token anyway),
    never below 0."""
    return max(0.0, gap_s - usual_gap_s)


@dataclass(frozen=True)
class LoadMix:
    """What the load sends (wall-clock rate; the caller converts from modelled time)."""

    rate_per_s: float
    min_prompt_tokens: int
    max_prompt_tokens: int
    short_output_tokens: int
    long_output_tokens: int
    long_share: float  # share of requests with long_output_tokens
    seed: int


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are time.monotonic()."""

    index: int
    route: str  # "chat" | "completion"
    max_tokens: int
    sent_s: float
    token_s: list[float] = field(default_factory=list)  # arrival of each chunk with text
    ended_s: float | None = None
    prompt_tokens: int | None = None  # from the usage chunk
    num_completion_tokens: int | None = None  # from the usage chunk
    instance: str | None = None  # x-flexpipe-instance of the head
    stream_id: str | None = None  # the engine's request id in the stream's id (cmpl-<id>)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.num_completion_tokens == self.max_tokens

    @property
    def failure(self) -> str | None:
        if self.error is not None:
            return self.error
        if self.ended_s is None:
            return "not finished"
        if self.num_completion_tokens != self.max_tokens:
            return f"short: {self.num_completion_tokens} of {self.max_tokens} tokens"
        return None

    def max_gap(self) -> tuple[float, int] | None:
        """The largest gap between consecutive text chunks, and how many tokens had arrived
        before it (where in the request it fell); None with fewer than two chunks."""
        if len(self.token_s) < 2:
            return None
        gaps = [(b - a, i + 1) for i, (a, b) in enumerate(itertools.pairwise(self.token_s))]
        return max(gaps)

    def gap_over(self, start_s: float, end_s: float) -> tuple[float, int] | None:
        """The largest gap between consecutive text chunks that overlaps [start_s, end_s] (a
        move carried out in that window), and how many tokens had arrived before it."""
        gaps = [
            (b - a, i + 1)
            for i, (a, b) in enumerate(itertools.pairwise(self.token_s))
            if a <= end_s and b >= start_s
        ]
        return max(gaps) if gaps else None

    def median_gap_before(self, num_tokens: int) -> float | None:
        """The median gap between the first `num_tokens` chunks: the request's own cadence."""
        gaps = [b - a for a, b in itertools.pairwise(self.token_s[:num_tokens])]
        return statistics.median(gaps) if gaps else None

    def usual_gap(self, num_tokens: int, num_gaps: int = USUAL_NUM_GAPS) -> float | None:
        """The stream's usual rhythm at its gap after the first `num_tokens` chunks: the median
        of its last `num_gaps` gaps before it (where it was); for a gap that is its first,
        of its first `num_gaps` after it. None with no other gap."""
        before = [b - a for a, b in itertools.pairwise(self.token_s[:num_tokens])]
        if before:
            return statistics.median(before[-num_gaps:])
        after = [b - a for a, b in itertools.pairwise(self.token_s[num_tokens:])]
        return statistics.median(after[:num_gaps]) if after else None

    def median_gap_after(self, num_tokens: int) -> float | None:
        """The median gap between the chunks that came after the first `num_tokens` (after a
        move that cut in there): the request's cadence where it went."""
        gaps = [b - a for a, b in itertools.pairwise(self.token_s[num_tokens:])]
        return statistics.median(gaps) if gaps else None


def _engine_id(stream_id: str) -> str:
    """The engine's request id in an OpenAI stream id (what the controller's move lines name)."""
    for prefix in ("chatcmpl-", "cmpl-"):
        if stream_id.startswith(prefix):
            return stream_id[len(prefix) :]
    return stream_id


def _prompt(rng: random.Random, num_words: int, index: int) -> str:
    # The sim engine's tokenizer counts one token per word (flexpipe/engine/tokenizer.py);
    # distinct words per request keep prefix caching from shortening the prefill.
    words = ("river", "stone", "light", "garden", "window", "quiet", "bright", "open")
    return f"request {index} asks " + " ".join(rng.choice(words) for _ in range(num_words))


class PoissonLoad:
    """Runs in its own thread and event loop; `stop()` ends arrivals, `join()` waits for the
    requests in flight (bounded)."""

    def __init__(self, base_url: str, model: str, mix: LoadMix, timeout_s: float) -> None:
        self.base_url = base_url
        self.model = model
        self.mix = mix
        self.timeout_s = timeout_s
        self.records: list[RequestRecord] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    async def _run(self) -> None:
        rng = random.Random(self.mix.seed)
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key="bench", max_retries=0, timeout=self.timeout_s
        )
        tasks: set[asyncio.Task[None]] = set()
        try:
            next_s = time.monotonic()
            index = 0
            while not self._stop.is_set():
                next_s += rng.expovariate(self.mix.rate_per_s)
                delay_s = next_s - time.monotonic()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                if self._stop.is_set():
                    break
                long = rng.random() < self.mix.long_share
                max_tokens = self.mix.long_output_tokens if long else self.mix.short_output_tokens
                route = "chat" if rng.random() < 0.5 else "completion"
                words = rng.randint(self.mix.min_prompt_tokens, self.mix.max_prompt_tokens)
                rec = RequestRecord(index, route, max_tokens, time.monotonic())
                self.records.append(rec)
                task = asyncio.create_task(self._one(client, rec, _prompt(rng, words, index)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                index += 1
            if tasks:
                await asyncio.wait(set(tasks), timeout=self.timeout_s)
        finally:
            for task in tasks:
                task.cancel()
            await client.close()

    async def _one(self, client: openai.AsyncOpenAI, rec: RequestRecord, prompt: str) -> None:
        extra = {"ignore_eos": True}
        usage: ChatCompletionStreamOptionsParam = {"include_usage": True}
        message: ChatCompletionUserMessageParam = {"role": "user", "content": prompt}
        try:
            if rec.route == "chat":
                raw = await client.chat.completions.with_raw_response.create(
                    model=self.model,
                    messages=[message],
                    max_tokens=rec.max_tokens,
                    stream=True,
                    stream_options=usage,
                    extra_body=extra,
                )
                rec.instance = raw.headers.get("x-flexpipe-instance")
                async for chunk in raw.parse():
                    rec.stream_id = rec.stream_id or _engine_id(chunk.id)
                    if chunk.choices and chunk.choices[0].delta.content:
                        rec.token_s.append(time.monotonic())
                    if chunk.usage is not None:
                        rec.prompt_tokens = chunk.usage.prompt_tokens
                        rec.num_completion_tokens = chunk.usage.completion_tokens
            else:
                raw_c = await client.completions.with_raw_response.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=rec.max_tokens,
                    stream=True,
                    stream_options=usage,
                    extra_body=extra,
                )
                rec.instance = raw_c.headers.get("x-flexpipe-instance")
                async for c in raw_c.parse():
                    rec.stream_id = rec.stream_id or _engine_id(c.id)
                    if c.choices and c.choices[0].text:
                        rec.token_s.append(time.monotonic())
                    if c.usage is not None:
                        rec.prompt_tokens = c.usage.prompt_tokens
                        rec.num_completion_tokens = c.usage.completion_tokens
        except openai.APIError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        except Exception as exc:  # the bench reports whatever broke
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            rec.ended_s = time.monotonic()
