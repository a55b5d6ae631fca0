"""A light load generator for streaming completions: raw asyncio sockets, keep-alive, no HTTP
library, so it does not become the bottleneck it measures.

Each client holds one connection and sends requests back to back. For every response it
records when the request was sent, when each read brought token events (`"text":` count) and
when the terminal chunk arrived.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class StreamRecord:
    sent_s: float
    token_times_s: list[float] = field(default_factory=list)  # one entry per token event
    done_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else float("nan")


def completion_request(
    host: str, port: int, model: str, prompt: str, max_tokens: int, path: str = "/v1/completions"
) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


_END = b"\r\n0\r\n\r\n"
_EVENT = b'"text":'


async def client_loop(
    host: str,
    port: int,
    requests: list[bytes],
    records: list[StreamRecord],
    stop_at_s: float,
    timestamps: bool,
) -> None:
    """Send `requests` (cycled) one after the other on one connection until `stop_at_s`."""
    reader, writer = await asyncio.open_connection(host, port)
    clock = time.monotonic
    i = 0
    try:
        while clock() < stop_at_s:
            rec = StreamRecord(clock())
            writer.write(requests[i % len(requests)])
            i += 1
            tail = b""
            times = rec.token_times_s
            while True:
                data = await reader.read(262144)
                if not data:
                    raise ConnectionError("server closed the connection")
                if timestamps:
                    n = data.count(_EVENT)
                    if n:
                        now = clock()
                        times.extend([now] * n)
                else:
                    times.extend([0.0] * data.count(_EVENT))
                tail = (tail + data)[-16:]
                if tail.endswith(_END):
                    break
            rec.done_s = clock()
            records.append(rec)
    finally:
        writer.close()


async def run_load(
    host: str,
    port: int,
    num_clients: int,
    duration_s: float,
    model: str,
    max_tokens: int,
    prompt_words: int = 8,
    timestamps: bool = True,
) -> tuple[list[StreamRecord], float]:
    """Run `num_clients` closed-loop streaming clients for `duration_s`; returns the records
    of the responses that completed and the elapsed time."""
    reqs = [
        completion_request(
            host, port, model, " ".join(f"c{c}w{w}" for w in range(prompt_words)), max_tokens
        )
        for c in range(num_clients)
    ]
    records: list[StreamRecord] = []
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    await asyncio.gather(
        *(
            client_loop(host, port, [reqs[c]], records, stop_at, timestamps)
            for c in range(num_clients)
        )
    )
    return records, time.monotonic() - t0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def cpu_load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"
