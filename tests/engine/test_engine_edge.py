"""The sim engine under hostile input and impatient clients (real processes, real sockets).

- every schema violation is a 400 in OpenAI's shape with the offending param, never a 500;
- secrets come from a file or the environment (not the command line) and are checked;
- stream_options.continuous_usage_stats puts the usage on every chunk, as vLLM does;
- a client that leaves (before the response head, while queued, mid-stream) leaves nothing
  behind: running/waiting counts and free KV blocks return to their idle values.
"""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from flexpipe.engine.api import SimServer
from flexpipe.engine.args import parse_engine_args
from flexpipe.engine.testing import EngineProc, request, scrape, sim_engine
from flexpipe.http.server import HttpError, Request

MODEL = "llama-2-7b"
FAST = [MODEL, "--load-time-s", "0", "--max-model-len", "512", "--time-scale", "0"]


@pytest.fixture(scope="module")
def eng0() -> Iterator[EngineProc]:
    with sim_engine(FAST) as e:
        yield e


def post(
    e: EngineProc, path: str, body: Any, content_type: str = "application/json"
) -> tuple[int, dict[str, Any]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = request("POST", e.url + path, raw=raw, headers={"content-type": content_type})
    return r.status, r.json()


def idle_state(e: EngineProc) -> tuple[float, float, float]:
    text = request("GET", e.url + "/metrics").text
    return (
        scrape(text, "vllm:num_requests_running"),
        scrape(text, "vllm:num_requests_waiting"),
        scrape(text, "flexpipe:num_kv_blocks_free"),
    )


def wait_idle(e: EngineProc, free_blocks: float, timeout_s: float = 5.0) -> tuple[float, ...]:
    deadline = time.monotonic() + timeout_s
    state = idle_state(e)
    while state != (0, 0, free_blocks) and time.monotonic() < deadline:
        time.sleep(0.02)
        state = idle_state(e)
    return state


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            CHAT,
            chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            "messages.0.content.0.text",
        ),
        (
            CHAT,
            chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]),
            "messages.0.content.0.text",
        ),
        (CHAT, chat_body(max_tokens=True), "max_tokens"),
        (CHAT, chat_body(stream="yes"), "stream"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 2}, "model"),
        (COMPLETIONS, {"model": MODEL, "prompt": [1, True]}, "prompt.1"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "n": 3}, "n"),
        (COMPLETIONS, {"model": MODEL, "prompt": [70000]}, "prompt"),  # beyond the vocabulary
        (COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),  # batches: not here
        (CHAT, chat_body(max_tokens=600), "max_tokens"),  # beyond max_model_len
    ],
)
def test_violations_are_400_with_their_param(
    eng0: EngineProc, path: str, body: dict[str, Any], param: str
) -> None:
    status, err = post(eng0, path, body)
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert (err["error"]["param"], err["error"]["code"]) == (param, 400)
    assert err["error"]["type"] == "BadRequestError" and err["error"]["message"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_json_under_another_content_type_is_400(eng0: EngineProc, content_type: str) -> None:
    for path, body in (
        (CHAT, chat_body(max_tokens=2)),
        (COMPLETIONS, {"model": MODEL, "prompt": "x"}),
    ):
        status, err = post(eng0, path, body, content_type)
        assert status == 400 and "application/json" in err["error"]["message"]
    status, _ = post(eng0, CHAT, chat_body(max_tokens=2), "application/json; charset=utf-8")
    assert status == 200


def test_missing_content_type_is_400_as_in_vllm(eng0: EngineProc) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", eng0.port, timeout=10)
    try:
        body = json.dumps(chat_body(max_tokens=2)).encode()
        conn.putrequest("POST", CHAT, skip_accept_encoding=True)
        conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        assert resp.status == 400 and b"application/json" in resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (["x"], "messages.0"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content.0.text"),
    ],
)
def test_tokenize_validates_messages(eng0: EngineProc, messages: Any, param: str) -> None:
    status, err = post(eng0, "/tokenize", {"model": MODEL, "messages": messages})
    assert (status, err["error"]["param"]) == (400, param)


HOSTILE: list[Any] = [
    None, True, False, 0, -1, 1.5, 10**12, "yes", "", [], {}, [5], [None],
    {"type": "text", "text": 5}, [{"type": "text", "text": None}], "x" * 40,
]  # fmt: skip
PATHS = [
    "model", "messages", "messages.0", "messages.0.role", "messages.0.content",
    "messages.0.content.0", "messages.0.content.0.text", "prompt", "prompt.0", "max_tokens",
    "max_completion_tokens", "stream", "stream_options", "stream_options.include_usage",
    "stream_options.continuous_usage_stats", "stop", "n", "temperature", "top_p", "seed",
    "stop_token_ids", "min_tokens", "ignore_eos", "logprobs", "user",
]  # fmt: skip


def _set(body: Any, path: str, value: Any) -> bool:
    *parents, last = path.split(".")
    node = body
    for key in parents:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return False
    if isinstance(node, dict):
        node[last] = value
        return True
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
        return True
    return False


def test_random_hostile_bodies_never_500_and_leave_the_engine_idle(eng0: EngineProc) -> None:
    """300 bodies with one or two fields set to hostile values: each answer is a 200, a 400
    naming a param (or the body) or a 404 for an unknown model; never a 500."""
    rng = random.Random(8)
    bases = {
        CHAT: chat_body(
            messages=[{"role": "user", "content": [{"type": "text", "text": "hey"}]}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        ),
        COMPLETIONS: {"model": MODEL, "prompt": ["tell"], "max_tokens": 3},
    }
    free = idle_state(eng0)[2]
    conn = http.client.HTTPConnection("127.0.0.1", eng0.port, timeout=10)
    seen: dict[int, int] = {}
    try:
        for _ in range(300):
            path = rng.choice([CHAT, COMPLETIONS])
            body = copy.deepcopy(bases[path])
            for field in rng.sample(PATHS, rng.choice([1, 2])):
                _set(body, field, copy.deepcopy(rng.choice(HOSTILE)))
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            seen[resp.status] = seen.get(resp.status, 0) + 1
            assert resp.status in (200, 400, 404), (body, data)
            if resp.status != 200:
                err = json.loads(data)["error"]
                assert err["code"] == resp.status and err["message"], body
    finally:
        conn.close()
    assert seen.get(200, 0) > 20 and seen.get(400, 0) > 100  # both kinds were exercised
    assert wait_idle(eng0, free) == (0, 0, free)


def test_continuous_usage_stats_on_every_chunk(eng0: EngineProc) -> None:
    c = openai.OpenAI(base_url=eng0.url + "/v1", api_key="x", max_retries=0)
    # (a vLLM extension of stream_options: not in the client's types)
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    only_continuous: Any = {"continuous_usage_stats": True}
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "count"}],
            max_tokens=12,
            stream=True,
            stream_options=options,
        )
    )
    assert all(ch.usage is not None for ch in chunks)
    prompt = chunks[0].usage.prompt_tokens if chunks[0].usage else -1
    counts = [ch.usage.completion_tokens for ch in chunks if ch.usage]
    assert counts == [0, *range(1, 13), 12]  # role chunk, one per token, the usage chunk
    totals = [ch.usage.total_tokens for ch in chunks if ch.usage]
    assert totals == [prompt + n for n in counts]
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length"
    # completions, and a stop string (one event of new text per step)
    comp = list(
        c.completions.create(
            model=MODEL,
            prompt="go",
            max_tokens=8,
            stream=True,
            stream_options=options,
        )
    )
    assert [ch.usage.completion_tokens for ch in comp if ch.usage] == [*range(1, 9), 8]
    cut = list(
        c.completions.create(
            model=MODEL,
            prompt="stop soon",
            max_tokens=200,
            stop=[" the"],
            stream=True,
            stream_options=options,
        )
    )
    counts = [ch.usage.completion_tokens for ch in cut if ch.usage]
    assert counts == sorted(counts) and counts[-1] == counts[-2] > 0  # the last: the total
    # include_usage false: continuous usage is off too (vLLM's rule)
    plain = list(
        c.completions.create(
            model=MODEL,
            prompt="go",
            max_tokens=4,
            stream=True,
            stream_options=only_continuous,
        )
    )
    assert all(ch.usage is None for ch in plain) and len(plain) == 4


# --- secrets ---------------------------------------------------------------------------------
def test_secrets_from_file_and_environment_stay_out_of_ps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, token = "k-" + "7" * 30, "admin-" + "3" * 30
    token_file = tmp_path / "admin-token"
    token_file.write_text(token + "\n")
    monkeypatch.setenv("VLLM_API_KEY", key)
    with sim_engine([*FAST, "--admin-token-file", str(token_file)]) as e:
        cmdline = Path(f"/proc/{e.proc.pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline and token.encode() not in cmdline
        ok = openai.OpenAI(base_url=e.url + "/v1", api_key=key, max_retries=0)
        r = ok.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens == 2
        for wrong in (key[:-1], key + "7", "", "k-" + "8" * 30):
            bad = openai.OpenAI(base_url=e.url + "/v1", api_key=wrong or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        admin = e.url + "/admin/requests"
        assert request("GET", admin, headers={"x-admin-token": token}).status == 200
        assert request("GET", admin, headers={"authorization": f"Bearer {token}"}).status == 200
        for wrong in (token[:-1], token + "x", "", "é" + token):
            assert request("GET", admin, headers={"x-admin-token": wrong}).status == 401
        assert request("GET", admin).status == 401


# --- disconnects -----------------------------------------------------------------------------
def _send(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    raw = json.dumps(body).encode()
    sock.sendall(
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (path.encode(), len(raw), raw)
    )
    return sock


def test_clients_leaving_at_every_phase_leave_nothing_behind() -> None:
    """Two slots: two streams run, a stream and a non-streaming request wait. The waiting ones
    leave before any response head, a running non-streaming one leaves before its head, then
    the streams leave mid-stream: every request is aborted and every KV block is free."""
    args = [*FAST[:-2], "--time-scale", "1", "--max-num-seqs", "2"]
    with sim_engine(args) as e:
        free = idle_state(e)[2]
        text = request("GET", e.url + "/metrics").text
        aborts0 = scrape(text, "vllm:request_success_total", finished_reason="abort")
        long = {"model": MODEL, "prompt": "a long one", "max_tokens": 400}
        streams = [_send(e.port, COMPLETIONS, {**long, "stream": True}) for _ in range(2)]
        for s in streams:
            assert s.recv(4096).startswith(b"HTTP/1.1 200")  # running: the head went out
        queued = [
            _send(e.port, COMPLETIONS, {**long, "stream": True}),
            _send(e.port, CHAT, chat_body(max_tokens=400)),
        ]
        deadline = time.monotonic() + 5
        while idle_state(e)[1] != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert idle_state(e)[:2] == (2, 2)
        for s in queued:
            s.close()  # before any response head
        deadline = time.monotonic() + 5
        while idle_state(e)[1] != 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert idle_state(e)[:2] == (2, 0)
        for s in streams:
            s.close()  # mid-stream
        assert wait_idle(e, free) == (0, 0, free)
        # a non-streaming request that runs, left before its response head
        s = _send(e.port, COMPLETIONS, long)
        deadline = time.monotonic() + 5
        while idle_state(e)[0] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert idle_state(e)[0] == 1
        s.close()
        assert wait_idle(e, free) == (0, 0, free)
        text = request("GET", e.url + "/metrics").text
        assert scrape(text, "vllm:request_success_total", finished_reason="abort") - aborts0 == 5
        assert scrape(text, "vllm:kv_cache_usage_perc") == 0.0


def test_cancelled_handler_aborts_its_request() -> None:
    """The handler itself cancelled (what the HTTP server does when the client leaves before
    the response head), queued or running: its request leaves the scheduler, blocks freed."""
    cfg = parse_engine_args([*FAST[:-2], "--time-scale", "1", "--max-num-seqs", "1"])

    async def run() -> None:
        server = SimServer(cfg)
        server.start()
        bm, sched = server.block_manager, server.scheduler
        free = bm.num_free_blocks
        try:

            def call(body: dict[str, Any]) -> asyncio.Task[Any]:
                req = Request(
                    "POST",
                    COMPLETIONS,
                    "",
                    {"content-type": "application/json"},
                    json.dumps(body).encode(),
                )
                return asyncio.ensure_future(server.completions(req))

            body = {"model": MODEL, "prompt": "x " * 100, "max_tokens": 300}
            running, queued = call(body), call(body)
            for _ in range(200):
                await asyncio.sleep(0.01)
                if sched.num_running == 1 and sched.num_waiting == 1:
                    break
            assert (sched.num_running, sched.num_waiting) == (1, 1)
            assert bm.num_free_blocks < free
            queued.cancel()
            running.cancel()
            for task in (queued, running):
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert (sched.num_running, sched.num_waiting) == (0, 0)
            assert server.engine.requests == {} and bm.num_free_blocks == free
            # a bad body raised in the handler is an HttpError (a 400), nothing was added
            with pytest.raises(HttpError) as info:
                await call({"model": MODEL, "prompt": "x", "max_tokens": True})
            assert info.value.status == 400 and info.value.param == "max_tokens"
            assert server.engine.requests == {}
            # the engine still serves
            resp = await call({"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert json.loads(resp.body)["usage"]["completion_tokens"] == 2
        finally:
            await server.stop()

    asyncio.run(run())
