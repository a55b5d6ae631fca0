"""The sim engine as a real process, driven with the official `openai` client."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import openai
import pytest

from flexpipe.engine.testing import EngineProc, http_stream, request, scrape, sim_engine
from flexpipe.perf import perf_model_for

MODEL = "llama-2-7b"
ADMIN = "admintok"
BASE = [MODEL, "--load-time-s", "0", "--max-model-len", "512", "--admin-token", ADMIN]


@pytest.fixture(scope="module")
def eng() -> Iterator[EngineProc]:
    # real time: llama-2-7b decode steps of ~10 ms on one A100
    args = [*BASE, "--max-num-seqs", "4", "--time-scale", "1", "--max-request-body-bytes", "65536"]
    with sim_engine(args) as e:
        yield e


def client(e: EngineProc, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=e.url + "/v1", api_key=api_key, max_retries=0)


def metrics(e: EngineProc) -> str:
    return request("GET", e.url + "/metrics").text


def good_request_works(e: EngineProc) -> None:
    r = client(e).completions.create(model=MODEL, prompt="still serving?", max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_completions_and_chat_with_exact_usage(eng: EngineProc) -> None:
    c = client(eng)
    r = c.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=7)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 7)  # BOS + 4
    assert r.usage.total_tokens == 12
    assert len(r.choices[0].text.split()) >= 4  # readable-ish words
    again = c.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=7)
    assert again.choices[0].text == r.choices[0].text  # deterministic
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=5
    )
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (1 + 7 + 5, 5)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content


def test_streaming_chat_and_completions(eng: EngineProc) -> None:
    c = client(eng)
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Stream please"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) == 6
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model=MODEL, prompt="one two", max_tokens=4, stream=True)
    )
    whole = c.completions.create(model=MODEL, prompt="one two", max_tokens=4)
    assert text == whole.choices[0].text


def test_stop_strings_and_natural_stop(eng: EngineProc) -> None:
    c = client(eng)
    r = c.completions.create(model=MODEL, prompt="count", max_tokens=40)
    words = r.choices[0].text.split()
    stop = words[3]
    cut = c.completions.create(model=MODEL, prompt="count", max_tokens=40, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text.split()
    free = c.completions.create(model=MODEL, prompt="no limit given", extra_body={})
    assert free.choices[0].finish_reason == "stop"
    assert free.usage is not None and 8 <= free.usage.completion_tokens <= 256


def test_models_version_tokenize_detokenize(eng: EngineProc) -> None:
    models = client(eng).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert request("GET", eng.url + "/version").json()["version"]
    assert request("GET", eng.url + "/health").status == 200
    tok = request("POST", eng.url + "/tokenize", {"model": MODEL, "prompt": "Hello, world!"}).json()
    assert tok["count"] == 5 and tok["max_model_len"] == 512 and len(tok["tokens"]) == 5
    detok = request("POST", eng.url + "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
    assert detok.json() == {"prompt": "Hello, world!"}
    chat_tok = request(
        "POST", eng.url + "/tokenize", {"messages": [{"role": "user", "content": "Hi there"}]}
    ).json()
    assert chat_tok["count"] == 13


def test_metrics_have_vllm_names_and_labels(eng: EngineProc) -> None:
    good_request_works(eng)
    text = metrics(eng)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "flexpipe:num_tokens_queued_running",
    ):
        assert scrape(text, name, model_name=MODEL) >= 0, name
    assert scrape(text, "vllm:request_success_total", finished_reason="length") >= 1
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert "# TYPE vllm:prompt_tokens_total counter" in text
    pm = perf_model_for(MODEL, "tp=1,max_num_seqs=4", max_model_len=512)
    num_blocks = pm.memory.num_kv_blocks
    assert scrape(text, "flexpipe:num_kv_blocks_free") == num_blocks  # idle
    assert scrape(text, "vllm:cache_config_info", num_gpu_blocks=str(num_blocks), block_size="16")


def test_continuous_batching_throughput_and_queueing(eng: EngineProc) -> None:
    """Modelled throughput (tokens per modelled busy second: immune to CPU contention) rises
    with concurrency up to max-num-seqs=4, then stays; the excess waits (TTFT, waiting)."""

    async def burst(n: int, max_tokens: int) -> tuple[float, list[float], float, float]:
        before = metrics(eng)
        c = openai.AsyncOpenAI(base_url=eng.url + "/v1", api_key="x", max_retries=0)
        ttfts: list[float] = []
        max_waiting = 0.0

        async def one(i: int) -> None:
            t0 = time.monotonic()
            stream = await c.completions.create(
                model=MODEL, prompt=f"request {i}", max_tokens=max_tokens, stream=True
            )
            async for ch in stream:
                if ch.choices and ch.choices[0].text and len(ttfts) < 100:
                    ttfts.append(time.monotonic() - t0)
                    break
            async for _ in stream:
                pass

        async def watch() -> None:
            nonlocal max_waiting
            for _ in range(20):
                text = await asyncio.to_thread(metrics, eng)
                max_waiting = max(max_waiting, scrape(text, "vllm:num_requests_waiting"))
                await asyncio.sleep(0.05)

        await asyncio.gather(watch(), *(one(i) for i in range(n)))
        after = metrics(eng)
        await c.close()
        tokens = scrape(after, "vllm:generation_tokens_total") - scrape(
            before, "vllm:generation_tokens_total"
        )
        busy = scrape(after, "flexpipe:modelled_busy_seconds_total") - scrape(
            before, "flexpipe:modelled_busy_seconds_total"
        )
        return tokens / busy, sorted(ttfts), max_waiting, busy

    one_tput, _, _, _ = asyncio.run(burst(1, 40))
    four_tput, _, _, four_busy_s = asyncio.run(burst(4, 40))
    eight_tput, ttfts, max_waiting, _ = asyncio.run(burst(8, 40))
    assert four_tput > 3.0 * one_tput
    assert eight_tput < 1.3 * four_tput  # capped at max-num-seqs
    assert max_waiting >= 1
    # The last four waited for a seat: a whole 40-token run of the first four. Wall time is
    # never shorter than modelled time (time scale 1), so this holds under any CPU load.
    assert min(ttfts[4:]) > 0.8 * four_busy_s


def test_prefix_cache_hits_on_shared_prefix(eng: EngineProc) -> None:
    c = client(eng)
    shared = " ".join(f"word{i}" for i in range(80))
    before = scrape(metrics(eng), "vllm:prefix_cache_hits_total")
    c.completions.create(model=MODEL, prompt=shared + " first question", max_tokens=1)
    r = c.completions.create(model=MODEL, prompt=shared + " second one", max_tokens=1)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 80  # 5 full blocks of 16
    assert scrape(metrics(eng), "vllm:prefix_cache_hits_total") - before == 80


def test_client_disconnect_frees_blocks(eng: EngineProc) -> None:
    total = scrape(metrics(eng), "flexpipe:num_kv_blocks_free")
    assert scrape(metrics(eng), "vllm:num_requests_running") == 0
    with http_stream(
        eng.url + "/v1/completions",
        {"model": MODEL, "prompt": "x " * 100, "max_tokens": 400, "stream": True},
    ) as lines:
        for _ in range(3):
            next(lines)
        text = metrics(eng)
        assert scrape(text, "vllm:num_requests_running") == 1
        assert scrape(text, "flexpipe:num_kv_blocks_free") < total
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        text = metrics(eng)
        if scrape(text, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.02)
    assert scrape(text, "vllm:num_requests_running") == 0
    assert scrape(text, "vllm:kv_cache_usage_perc") == 0.0
    assert scrape(text, "vllm:request_success_total", finished_reason="abort") >= 1
    good_request_works(eng)


def test_bad_inputs_get_vllm_errors_and_server_keeps_serving(eng: EngineProc) -> None:
    c = client(eng)

    def expect(status: int, exc: type[openai.APIStatusError], **kw: object) -> None:
        with pytest.raises(exc) as info:
            kw.setdefault("model", MODEL)
            if "messages" in kw:
                c.chat.completions.create(**kw)  # type: ignore[call-overload]
            else:
                c.completions.create(**kw)  # type: ignore[call-overload]
        assert info.value.status_code == status
        body = info.value.response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == status and body["error"]["message"]
        good_request_works(eng)

    expect(400, openai.BadRequestError, messages=[], max_tokens=3)
    expect(400, openai.BadRequestError, prompt="hi", max_tokens=0)
    expect(400, openai.BadRequestError, prompt="word " * 500, max_tokens=100)
    expect(400, openai.BadRequestError, prompt="hi", max_tokens=3, n=2)
    expect(404, openai.NotFoundError, model="no-such-model", prompt="hi", max_tokens=3)
    expect(413, openai.APIStatusError, prompt="x" * 70000, max_tokens=3)
    bad = request("POST", eng.url + "/v1/completions", raw=b"{not json")
    assert bad.status == 400 and bad.json()["error"]["type"] == "BadRequestError"
    good_request_works(eng)


def test_wrong_api_key_and_health_while_loading() -> None:
    args = [MODEL, "--max-model-len", "512", "--api-key", "sekrit", "--load-time-s", "1.5"]
    with sim_engine([*args, "--time-scale", "1"]) as e:
        assert request("GET", e.url + "/health").status == 503
        ok = client(e, api_key="sekrit")
        with pytest.raises(openai.APIStatusError) as info:
            ok.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        deadline = time.monotonic() + 10
        while request("GET", e.url + "/health").status != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert request("GET", e.url + "/health").status == 200
        with pytest.raises(openai.AuthenticationError) as auth:
            client(e).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert auth.value.status_code == 401
        assert auth.value.response.json()["error"]["code"] == 401
        r = ok.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens == 2


def test_preemption_under_kv_pressure_loses_no_request() -> None:
    # 12 blocks of 16 tokens; six requests of ~60 tokens need 24 blocks at once
    args = [MODEL, "--load-time-s", "0", "--time-scale", "0.5", "--max-model-len", "128"]
    with sim_engine([*args, "--num-gpu-blocks-override", "12", "--max-num-seqs", "8"]) as e:

        async def run() -> list[openai.types.Completion]:
            c = openai.AsyncOpenAI(base_url=e.url + "/v1", api_key="x", max_retries=0)
            try:
                return await asyncio.gather(
                    *(
                        c.completions.create(
                            model=MODEL,
                            prompt=" ".join(f"p{i}w{j}" for j in range(19)),
                            max_tokens=40,
                        )
                        for i in range(6)
                    )
                )
            finally:
                await c.close()

        results = asyncio.run(run())
        assert all(r.usage is not None and r.usage.completion_tokens == 40 for r in results)
        assert all(r.choices[0].finish_reason == "length" for r in results)
        text = metrics(e)
        assert scrape(text, "vllm:num_preemptions_total") > 0
        assert scrape(text, "vllm:kv_cache_usage_perc") == 0.0


def test_migration_export_and_import(eng: EngineProc) -> None:
    admin = {"x-admin-token": ADMIN}
    assert request("POST", eng.url + "/admin/export", {"request_id": "x"}).status == 401
    pm = perf_model_for(MODEL, "tp=1,max_num_seqs=4", max_model_len=512)
    with http_stream(
        eng.url + "/v1/completions",
        {"model": MODEL, "prompt": "migrate me " * 10, "max_tokens": 300, "stream": True},
        headers={"x-request-id": "mig-1"},
    ) as lines:
        for _ in range(5):
            next(lines)
        listed = request("GET", eng.url + "/admin/requests", headers=admin).json()["requests"]
        assert "mig-1" in [r["request_id"] for r in listed]
        state = request(
            "POST",
            eng.url + "/admin/export",
            {"request_id": "cmpl-mig-1", "abort": True, "bandwidth_bytes_per_s": 25e9},
            headers=admin,
        ).json()
        rest = list(lines)
    assert len(state["prompt_token_ids"]) == 21  # BOS + 20 words
    assert len(state["output_token_ids"]) >= 2
    assert state["kv_bytes"] == state["num_kv_tokens"] * pm.memory.kv_bytes_per_token
    assert state["transfer_s"] == pytest.approx(pm.kv_transfer_s(state["num_kv_tokens"], 25e9))
    assert state["recompute_s"] > 0 and state["aborted"] is True
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"abort"' in rest[-2]
    # continue it elsewhere (here: the same engine) from the transferred KV
    tokens = state["prompt_token_ids"] + state["output_token_ids"]
    time.sleep(0.2)  # let the step that was running at the abort end
    before = scrape(metrics(eng), "vllm:iteration_tokens_total_sum")
    r = request(
        "POST",
        eng.url + "/admin/import",
        headers=admin,
        body={
            "model": MODEL,
            "prompt": tokens,
            "max_tokens": 5,
            "num_kv_tokens": len(tokens),
            "bandwidth_bytes_per_s": 25e9,
        },
    )
    assert r.status == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert float(r.headers["x-flexpipe-kv-transfer-s"]) > 0
    computed = scrape(metrics(eng), "vllm:iteration_tokens_total_sum") - before
    assert computed == 1 + 4  # only the last prompt token is computed, then 4 decodes


@pytest.fixture(scope="module")
def eng0() -> Iterator[EngineProc]:
    """Time scale 0: several steps per event-loop pass, one write per stream per pass."""
    with sim_engine(
        [MODEL, "--load-time-s", "0", "--max-model-len", "4096", "--time-scale", "0"]
    ) as e:
        yield e


def test_time_scale_zero_streams_one_event_per_token(eng0: EngineProc) -> None:
    c = client(eng0)
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "count to forty"}],
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [
        ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content
    ]
    assert len(content) == 40 and not content[0].startswith(" ")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
    whole = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count to forty"}], max_tokens=40
    )
    assert "".join(content) == whole.choices[0].message.content
    # a stop string ends the stream where the text says, as without streaming
    text = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=MODEL, prompt="stop soon", max_tokens=200, stop=[" the"], stream=True
        )
    )
    whole_c = c.completions.create(model=MODEL, prompt="stop soon", max_tokens=200, stop=[" the"])
    assert text == whole_c.choices[0].text


def test_slow_reader_gets_every_token_and_blocks_no_one() -> None:
    """A client that does not read: its tokens wait (the socket buffers fill: a 2,000-character
    served model name makes every event ~2 KB), other requests are served meanwhile, and when
    it reads it gets every token, one event each."""
    name = "m" * 2000
    args = [MODEL, "--load-time-s", "0", "--max-model-len", "4096", "--time-scale", "0"]

    async def run(eng0: EngineProc) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few events
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", eng0.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            body = (
                b'{"model":"%s","prompt":"slow reader","max_tokens":3000,"stream":true}'
                % name.encode()
            )
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await asyncio.sleep(0.3)  # the engine ran far ahead of this reader
            # meanwhile the engine serves others
            other = await asyncio.to_thread(
                lambda: client(eng0).completions.create(model=name, prompt="hi", max_tokens=3)
            )
            assert other.usage is not None and other.usage.completion_tokens == 3
            data = b""
            while not data.endswith(b"\r\n0\r\n\r\n"):
                more = await asyncio.wait_for(reader.read(1 << 20), 10)
                assert more, "connection closed early"
                data += more
            assert data.count(b'"text":') == 3000
            assert b'"finish_reason":"length"' in data and b"data: [DONE]" in data
        finally:
            writer.close()

    with sim_engine([*args, "--served-model-name", name]) as e:
        asyncio.run(run(e))


def test_a_continued_assistant_message_joins_with_a_space(eng: EngineProc) -> None:
    """continue_final_message (the gateway's stream continuation): the first new token
    follows the text already there, so "light" + "most" is "light most", never "lightmost";
    a fresh reply starts without a space."""
    c = client(eng)
    msgs: list[dict[str, str]] = [{"role": "user", "content": "tell me a story"}]
    fresh = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)  # type: ignore[arg-type]
    assert fresh.choices[0].message.content and not fresh.choices[0].message.content[0].isspace()
    partial = [*msgs, {"role": "assistant", "content": "Once upon a time the light"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    cont = c.chat.completions.create(
        model=MODEL,
        messages=partial,
        max_tokens=3,
        extra_body=extra,  # type: ignore[arg-type]
    )
    text = cont.choices[0].message.content or ""
    assert text.startswith(" ") or text[:1] in ",.;:"
    stream = c.chat.completions.create(
        model=MODEL,
        messages=partial,
        max_tokens=3,
        stream=True,
        extra_body=extra,  # type: ignore[arg-type]
    )
    pieces = [ch.choices[0].delta.content for ch in stream if ch.choices]
    first = next(p for p in pieces if p)
    assert first.startswith(" ") or first[:1] in ",.;:"
    assert "".join(p or "" for p in pieces) == text  # same tokens, same join
