"""Just enough of OpenAI's server-sent events to count tokens, rebuild the text generated so
far and rewrite a continuation stream; the relay itself forwards bytes untouched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class StreamState:
    """What the events relayed to the client so far say (kept up to date through every
    continuation, so a stream can be continued more than once)."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    text: str = ""
    num_tokens: int = 0
    finished: bool = False  # a finish_reason or [DONE] was seen
    usage: dict[str, Any] | None = None
    prompt_tokens: int | None = None  # the client's prompt, once an event's usage told it
    num_tokens_at_join: int = 0  # tokens the client had when the current continuation began
    completion_events: bool = False  # the continuation answers in completions' format
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
        if isinstance(obj, dict):
            state.id = state.id or obj.get("id")
            state.created = state.created or obj.get("created")
            state.model = state.model or obj.get("model")
            absorb(state, obj, chat)
    return state


def absorb(state: StreamState, obj: dict[str, Any], chat: bool) -> int:
    """Add one event (as the client got it) to `state`; returns the tokens it carried."""
    usage = obj.get("usage")
    if usage and isinstance(usage, dict):
        state.usage = usage
        if state.prompt_tokens is None and isinstance(usage.get("prompt_tokens"), int):
            state.prompt_tokens = usage["prompt_tokens"]
    num_tokens = 0
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if piece and isinstance(piece, str):
            state.text += piece
            num_tokens += 1
        if choice.get("finish_reason"):
            state.finished = True
    state.num_tokens += num_tokens
    return num_tokens


def continuation_body(
    original: dict[str, Any], state: StreamState, chat: bool, default_max_tokens: int
) -> dict[str, Any] | None:
    """The request that continues `original` after `state.text` (the original itself when
    nothing was generated yet); None when nothing is left or it cannot be continued.

    Chat continues the assistant's message (`continue_final_message`, as vLLM does), so the
    engine detokenizes the next token after the text already sent: no words glued at the join.
    """
    if not state.text:
        return dict(original)
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
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None  # token-id or batched prompts: not continued
        body["prompt"] = prompt + state.text
    if "min_tokens" in body:
        body["min_tokens"] = max(0, int(body["min_tokens"]) - state.num_tokens)
    return body


# The link a KV move's transfer is priced over when the move names none (or 0): ~PCIe 4.0 x16.
DEFAULT_KV_LINK_BYTES_PER_S = 25e9


def kv_link_bytes_per_s(bandwidth_bytes_per_s: float | None) -> float:
    """The bandwidth a KV move's export and import are priced at: the move's link, else
    `DEFAULT_KV_LINK_BYTES_PER_S`."""
    return bandwidth_bytes_per_s or DEFAULT_KV_LINK_BYTES_PER_S


def import_body(
    original: dict[str, Any],
    export: dict[str, Any],
    state: StreamState,
    bandwidth_bytes_per_s: float | None,
    latency_s: float = 0.0,
) -> dict[str, Any] | None:
    """The engine's /admin/import body that resumes a request from its exported KV cache:
    the prompt's token ids and the tokens the client got from this engine (all it got, less
    what the engine's prompt already holds when the stream was continued there), as
    completions (the import hook's format); None when nothing is left to generate."""
    prompt_ids = list(export.get("prompt_token_ids") or [])
    num_here = state.num_tokens - state.num_tokens_at_join
    output_ids = list(export.get("output_token_ids") or [])[:num_here]
    left = export.get("max_tokens_left")
    if not isinstance(left, int):
        return None
    remaining = left + (len(export.get("output_token_ids") or []) - len(output_ids))
    if remaining <= 0:
        return None
    ids = prompt_ids + output_ids
    body: dict[str, Any] = {
        k: v
        for k, v in original.items()
        if k not in ("messages", "prompt", "max_tokens", "max_completion_tokens", "n")
        and k not in ("continue_final_message", "add_generation_prompt", "tools")
    }
    body.update(
        prompt=ids,
        max_tokens=remaining,
        num_kv_tokens=len(ids),
        bandwidth_bytes_per_s=kv_link_bytes_per_s(bandwidth_bytes_per_s),
        latency_s=latency_s,
        stream=True,
    )
    if "min_tokens" in body:
        body["min_tokens"] = max(0, int(body["min_tokens"]) - state.num_tokens)
    return body


def _as_chat_chunk(obj: dict[str, Any]) -> None:
    """A completions stream event as a chat one, in place (a KV-moved chat stream)."""
    obj["object"] = "chat.completion.chunk"
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict) and "text" in choice:
            text = choice.pop("text")
            choice["delta"] = {"content": text} if text else {}
            keep = {k: choice[k] for k in ("index", "delta")}
            keep.update((k, v) for k, v in choice.items() if k not in keep)
            choice.clear()
            choice.update(keep)


def rewrite_event(payload: bytes, state: StreamState, chat: bool) -> tuple[bytes | None, int]:
    """A continuation's event as the client's stream: same id/created/model, usage counted
    from the client's prompt, the repeated assistant-role chunk dropped; `state` absorbs it.
    Returns (event bytes or None to skip, tokens)."""
    if payload == b"[DONE]":
        state.finished = True
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
    if chat and state.completion_events:
        _as_chat_chunk(obj)
    if chat:
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            role_only = delta.pop("role", None) is not None and not delta.get("content")
            if role_only and not choice.get("finish_reason") and not obj.get("usage"):
                return None, 0
    usage = obj.get("usage")
    if usage and isinstance(usage, dict):
        done = state.num_tokens_at_join
        # the continuation's prompt held the text generated before the join
        prompt = state.prompt_tokens
        if prompt is None:
            prompt = max(0, int(usage.get("prompt_tokens", 0)) - done)
        usage["prompt_tokens"] = prompt
        usage["completion_tokens"] = int(usage.get("completion_tokens", 0)) + done
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    num_tokens = absorb(state, obj, chat)
    return b"data: " + orjson.dumps(obj) + b"\n\n", num_tokens


def error_event(message: str, status: int = 502, type: str = "BadGatewayError") -> bytes:
    err = {"error": {"message": message, "type": type, "param": None, "code": status}}
    return b"data: " + orjson.dumps(err) + b"\n\n"
