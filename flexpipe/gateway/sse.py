"""Just enough of OpenAI's server-sent events to count tokens, rebuild the text generated so
far and rewrite a continuation stream; the relay itself forwards bytes untouched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class StreamState:
    """What the events relayed so far say."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    text: str = ""
    num_tokens: int = 0
    finished: bool = False  # a finish_reason or [DONE] was seen
    usage: dict[str, Any] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def events(data: bytes) -> list[bytes]:
    """The `data:` payloads of complete events in `data`."""
    out = []
    for raw in data.split(b"\n\n"):
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
    return out


def summarize(data: bytes, chat: bool) -> StreamState:
    state = StreamState()
    for payload in events(data):
        if payload == b"[DONE]":
            state.finished = True
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        state.id = state.id or obj.get("id")
        state.created = state.created or obj.get("created")
        state.model = state.model or obj.get("model")
        if obj.get("usage"):
            state.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                state.text += piece
                state.num_tokens += 1
            if choice.get("finish_reason"):
                state.finished = True
    return state


def continuation_body(
    original: dict[str, Any], state: StreamState, chat: bool, default_max_tokens: int
) -> dict[str, Any] | None:
    """The request that continues `original` after `state.text`; None when nothing is left."""
    body = dict(original)
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(key) or default_max_tokens
    remaining = int(max_tokens) - state.num_tokens
    if remaining <= 0:
        return None
    body[key] = remaining
    if chat:
        body["messages"] = [*original["messages"], {"role": "assistant", "content": state.text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        prompt = original.get("prompt")
        if not isinstance(prompt, str):
            return None  # token-id or batched prompts: not continued
        body["prompt"] = prompt + state.text
    if "min_tokens" in body:
        body["min_tokens"] = max(0, int(body["min_tokens"]) - state.num_tokens)
    return body


def rewrite_event(payload: bytes, state: StreamState, chat: bool) -> tuple[bytes | None, int]:
    """A continuation's event as the client's stream: same id/created/model, usage summed,
    the repeated assistant-role chunk dropped. Returns (event bytes or None to skip, tokens)."""
    if payload == b"[DONE]":
        return DONE, 0
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None, 0
    if not isinstance(obj, dict):
        return None, 0
    if state.id is not None:
        obj["id"] = state.id
    if state.created is not None:
        obj["created"] = state.created
    if state.model is not None:
        obj["model"] = state.model
    num_tokens = 0
    for choice in obj.get("choices") or ():
        if chat:
            delta = choice.get("delta") or {}
            role_only = delta.pop("role", None) is not None and not delta.get("content")
            if role_only and not choice.get("finish_reason") and not obj.get("usage"):
                return None, 0
            if delta.get("content"):
                num_tokens += 1
        elif choice.get("text"):
            num_tokens += 1
    usage = obj.get("usage")
    if usage and isinstance(usage, dict):
        prev = state.usage or {}
        done = state.num_tokens
        # the continuation's prompt held the text generated before the break
        usage["prompt_tokens"] = prev.get(
            "prompt_tokens", max(0, usage.get("prompt_tokens", 0) - done)
        )
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + done
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return b"data: " + orjson.dumps(obj) + b"\n\n", num_tokens


def error_event(message: str, status: int = 502, type: str = "BadGatewayError") -> bytes:
    err = {"error": {"message": message, "type": type, "param": None, "code": status}}
    return b"data: " + orjson.dumps(err) + b"\n\n"
