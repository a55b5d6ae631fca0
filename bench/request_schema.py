"""What validating the OpenAI request schema at the edge costs, per request.

A typical streamed chat body (system + user message of ~2 KB, sampling fields, one text and
one image part) parsed four ways, interleaved in one run (median of rounds, µs per request):
orjson.loads alone (the floor: what the gateway paid before), orjson + the hand-written
checks of the old gateway `_parse`, flexpipe.protocol (orjson + pydantic model_validate), and
pydantic's model_validate_json straight from bytes.

    python -m bench request_schema [--rounds 15] [--n 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from flexpipe.protocol import ChatCompletionRequest, parse_chat_request

BODY = orjson.dumps(
    {
        "model": "llama-2-7b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. " * 10},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Summarise the following text. " + "word " * 350},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                ],
            },
        ],
        "max_tokens": 128,
        "temperature": 0.7,
        "top_p": 0.95,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "tenant-a",
    }
)


def _hand_checks(raw: bytes) -> Any:
    """The old gateway `_parse`'s checks (the baseline the schema replaces)."""
    body = orjson.loads(raw)
    assert isinstance(body, dict)
    model = body.get("model")
    assert isinstance(model, str) and model
    assert isinstance(body.get("stream", False), bool)
    parts = []
    for m in body["messages"]:
        content = m.get("content")
        parts.append(f"<{m.get('role')}>")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
    return "".join(parts).encode()


def _schema(raw: bytes) -> Any:
    return parse_chat_request(raw, "application/json").prompt_bytes


def _from_json(raw: bytes) -> Any:
    return ChatCompletionRequest.model_validate_json(raw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench request_schema")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--n", type=int, default=2000, help="requests per round and way")
    args = p.parse_args(argv or [])
    ways: dict[str, Callable[[bytes], Any]] = {
        "orjson.loads only": orjson.loads,
        "orjson + hand checks (old)": _hand_checks,
        "flexpipe.protocol": _schema,
        "model_validate_json": _from_json,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            for _ in range(args.n):
                fn(BODY)
            times[name].append((time.perf_counter() - t0) / args.n * 1e6)
    print(f"chat body of {len(BODY)} bytes; median of {args.rounds} rounds of {args.n}")
    base = statistics.median(times["orjson.loads only"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:28s} {med:7.1f} µs/request  ({med / base:4.1f}x orjson.loads)")
    return 0
