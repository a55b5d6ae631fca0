"""Sleep mode on a real sim engine process, over HTTP on 127.0.0.1, as vLLM serves it:
POST /sleep?level=&mode=, POST /wake_up[?tags=], GET /is_sleeping (dev mode only).
Durations are the performance model's, read back exactly from /admin/sleep."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import pytest

from flexpipe.engine.args import EngineArgsError, parse_engine_args
from flexpipe.engine.sleep import SleepState
from flexpipe.engine.testing import EngineProc, HttpResult, request, scrape, sim_engine
from flexpipe.perf import perf_model_for
from flexpipe.perf.weights import local_nvme

MODEL = "llama-2-7b"
ADMIN = "admintok"
DEV = {"VLLM_SERVER_DEV_MODE": "1"}
BASE = [MODEL, "--load-time-s", "0", "--max-model-len", "512", "--admin-token", ADMIN]
PM = perf_model_for(MODEL, "tp=1", "A100-80G-SXM", max_model_len=512)


def post(e: EngineProc, path: str) -> HttpResult:
    return request("POST", e.url + path, raw=b"")


def state(e: EngineProc) -> dict[str, Any]:
    r = request("GET", e.url + "/admin/sleep", headers={"x-admin-token": ADMIN})
    assert r.status == 200
    out: dict[str, Any] = r.json()
    return out


def is_sleeping(e: EngineProc) -> bool:
    r = request("GET", e.url + "/is_sleeping")
    assert r.status == 200 and set(r.json()) == {"is_sleeping"}
    return bool(r.json()["is_sleeping"])


def complete(e: EngineProc, max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "sleep well", "max_tokens": max_tokens}
    r = request("POST", e.url + "/v1/completions", body)
    assert r.status == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.fixture(scope="module")
def eng() -> Iterator[EngineProc]:
    # time scale 0: sleeps and wake-ups take no wall time; their modelled time is reported
    args = [*BASE, "--time-scale", "0", "--enable-sleep-mode"]
    with sim_engine(args, env=DEV) as e:
        yield e


@pytest.fixture(autouse=True)
def awake_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "eng" in request.fixturenames:
        e = request.getfixturevalue("eng")
        post(e, "/wake_up")
        assert not is_sleeping(e)


def test_level1_sleep_and_wake_take_the_modelled_host_link_copies(eng: EngineProc) -> None:
    assert not is_sleeping(eng)
    r = post(eng, "/sleep?level=1")
    assert (r.status, r.body) == (200, b"")
    assert is_sleeping(eng)
    st = state(eng)
    weights = PM.memory.per_gpu[0].weights_bytes
    assert st["last"] == {"op": "sleep", "level": 1, "tags": ["weights", "kv_cache"],
                          "modelled_s": weights / (32e9 * 0.8)}  # fmt: skip
    assert st["level"] == 1 and st["sleeping_tags"] == ["kv_cache", "weights"]
    assert st["gpu_memory_bytes"] == PM.memory.per_gpu[0].reserve_bytes
    assert st["host_memory_bytes"] == weights
    text = request("GET", eng.url + "/metrics").text
    assert scrape(text, "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1.0
    assert scrape(text, "vllm:engine_sleep_state", sleep_state="awake") == 0.0
    assert scrape(text, "flexpipe:gpu_memory_bytes") == PM.memory.per_gpu[0].reserve_bytes
    assert scrape(text, "flexpipe:host_memory_bytes") == weights
    r = post(eng, "/wake_up")
    assert (r.status, r.body) == (200, b"")
    assert not is_sleeping(eng)
    st = state(eng)
    assert st["last"]["op"] == "wake_up" and st["last"]["modelled_s"] == PM.wake_s(1)
    assert PM.wake_s(1) == weights / (32e9 * 0.8)
    g = PM.memory.per_gpu[0]
    assert st["gpu_memory_bytes"] == g.reserve_bytes + g.weights_bytes + g.kv_bytes
    assert st["host_memory_bytes"] == 0.0
    assert complete(eng)["usage"]["completion_tokens"] == 8


def test_a_request_sent_while_asleep_waits_for_the_wake_up(eng: EngineProc) -> None:
    assert post(eng, "/sleep?level=1").status == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(complete, eng, 5)
        deadline = time.monotonic() + 5
        while state(eng)["num_held_requests"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state(eng)["num_held_requests"] == 1
        time.sleep(0.1)
        assert not fut.done()  # held, not refused: vLLM queues adds while asleep
        assert post(eng, "/wake_up").status == 200
        out = fut.result(10)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5
    assert state(eng)["num_held_requests"] == 0


def test_sleep_twice_and_wake_twice_are_no_ops(eng: EngineProc) -> None:
    before = state(eng)
    assert post(eng, "/wake_up").status == 200  # awake: nothing to do
    assert post(eng, "/sleep?level=2").status == 200
    assert post(eng, "/sleep?level=1").status == 200  # already asleep: stays at level 2
    st = state(eng)
    assert st["level"] == 2 and st["num_sleeps"] == before["num_sleeps"] + 1
    assert st["host_memory_bytes"] == 0.0  # level 2 keeps no copy
    assert post(eng, "/wake_up").status == 200
    assert post(eng, "/wake_up").status == 200
    st = state(eng)
    assert st["num_wakes"] == before["num_wakes"] + 1
    assert st["last"]["modelled_s"] == PM.wake_s(2) == PM.memory.weights_bytes / 2e9


def test_level2_partial_wake_up_by_tags(eng: EngineProc) -> None:
    assert post(eng, "/sleep?level=2").status == 200
    assert state(eng)["last"]["modelled_s"] == 0.0  # level 2 discards: no copy
    text = request("GET", eng.url + "/metrics").text
    assert scrape(text, "vllm:engine_sleep_state", sleep_state="discard_all") == 1.0
    assert post(eng, "/wake_up?tags=weights").status == 200
    st = state(eng)
    assert st["sleeping_tags"] == ["kv_cache"] and is_sleeping(eng)  # not until every tag
    assert st["last"]["tags"] == ["weights"] and st["last"]["modelled_s"] == PM.wake_s(2)
    g = PM.memory.per_gpu[0]
    assert st["gpu_memory_bytes"] == g.reserve_bytes + g.weights_bytes
    assert post(eng, "/wake_up?tags=bogus").status == 200  # unknown tag: skipped
    assert is_sleeping(eng)
    assert post(eng, "/wake_up?tags=kv_cache").status == 200
    st = state(eng)
    assert not is_sleeping(eng) and st["last"]["modelled_s"] == 0.0  # re-mapped empty
    assert complete(eng)["usage"]["completion_tokens"] == 8


def test_level0_pauses_scheduling_only(eng: EngineProc) -> None:
    assert post(eng, "/sleep?level=0").status == 200
    st = state(eng)
    assert is_sleeping(eng) and st["sleeping_tags"] == [] and st["last"]["modelled_s"] == 0.0
    g = PM.memory.per_gpu[0]
    assert st["gpu_memory_bytes"] == g.reserve_bytes + g.weights_bytes + g.kv_bytes
    assert post(eng, "/wake_up?tags=scheduling").status == 200
    assert not is_sleeping(eng)


@pytest.mark.parametrize(
    ("query", "param"), [("level=3", "level"), ("level=x", "level"), ("mode=drop", "mode")]
)
def test_bad_sleep_parameters_are_400(eng: EngineProc, query: str, param: str) -> None:
    r = post(eng, "/sleep?" + query)
    assert r.status == 400 and r.json()["error"]["param"] == param
    assert not is_sleeping(eng)


def _stream_until_first_token(e: EngineProc, max_tokens: int) -> concurrent.futures.Future[Any]:
    """A completion running in a thread; returns once the engine runs it."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(complete, e, max_tokens)
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        reqs = request("GET", e.url + "/admin/requests", headers={"x-admin-token": ADMIN})
        if any(r["num_output_tokens"] > 0 for r in reqs.json()["requests"]):
            return fut
        time.sleep(0.005)
    raise AssertionError("the request never started")


@pytest.fixture(scope="module")
def slow() -> Iterator[EngineProc]:
    # real time: 7B decode steps of ~10 ms, so a 300-token request runs ~3 s
    args = [*BASE, "--time-scale", "1", "--enable-sleep-mode"]
    with sim_engine(args, env=DEV) as e:
        yield e


def test_sleep_aborts_running_requests_by_default(slow: EngineProc) -> None:
    fut = _stream_until_first_token(slow, 300)
    assert post(slow, "/sleep?level=1").status == 200
    out = fut.result(10)
    assert out["choices"][0]["finish_reason"] == "abort"  # vLLM's mode=abort
    assert 0 < out["usage"]["completion_tokens"] < 300
    assert post(slow, "/wake_up").status == 200


def test_sleep_mode_wait_finishes_running_requests_first(slow: EngineProc) -> None:
    fut = _stream_until_first_token(slow, 30)
    assert post(slow, "/sleep?level=1&mode=wait").status == 200
    assert fut.done()  # the sleep answered after the request drained
    out = fut.result(0)
    assert (out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]) == (
        "length",
        30,
    )
    assert post(slow, "/wake_up").status == 200


def test_sleep_mode_keep_resumes_running_requests_after_the_wake_up(slow: EngineProc) -> None:
    fut = _stream_until_first_token(slow, 100)
    assert post(slow, "/sleep?level=1&mode=keep").status == 200
    time.sleep(0.1)
    assert not fut.done()  # frozen, its KV dropped
    assert post(slow, "/wake_up").status == 200
    out = fut.result(10)  # recomputed after the wake-up, every token delivered
    assert (out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]) == (
        "length",
        100,
    )


def test_wake_up_during_a_sleep_waits_for_it_and_sleep_takes_its_scaled_time(
    slow: EngineProc,
) -> None:
    before = state(slow)

    def timed(path: str) -> tuple[int, float]:
        r = post(slow, path)
        return r.status, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        t0 = time.monotonic()
        sleeping = pool.submit(timed, "/sleep?level=1")
        while not is_sleeping(slow):  # the sleep has begun: it copies for ~0.53 s
            assert time.monotonic() - t0 < 5
            time.sleep(0.005)
        waking = pool.submit(timed, "/wake_up")
        slept = sleeping.result(10)
        woke = waking.result(10)
    assert slept[0] == woke[0] == 200
    assert slept[1] - t0 >= PM.sleep_s(1)  # time scale 1
    assert woke[1] - t0 >= PM.sleep_s(1) + PM.wake_s(1)  # after the sleep, not beside it
    st = state(slow)
    assert not st["is_sleeping"]
    assert (st["num_sleeps"], st["num_wakes"]) == (before["num_sleeps"] + 1,
                                                   before["num_wakes"] + 1)  # fmt: skip
    assert st["last"]["op"] == "wake_up" and st["last"]["modelled_s"] == PM.wake_s(1)


def test_without_dev_mode_the_endpoints_are_not_mounted() -> None:
    with sim_engine([*BASE, "--time-scale", "0", "--enable-sleep-mode"], env={}) as e:
        assert post(e, "/sleep").status == 404
        assert request("GET", e.url + "/is_sleeping").status == 404


def test_without_enable_sleep_mode_sleep_is_refused() -> None:
    with sim_engine([*BASE, "--time-scale", "0"], env=DEV) as e:
        r = post(e, "/sleep?level=1")
        assert r.status == 400 and "--enable-sleep-mode" in r.json()["error"]["message"]
        assert not is_sleeping(e)
        with pytest.raises(KeyError):
            scrape(request("GET", e.url + "/metrics").text, "vllm:engine_sleep_state")


def test_level2_wake_loads_from_the_weight_source() -> None:
    args = [*BASE, "--time-scale", "0", "--enable-sleep-mode", "--weight-source", "local_nvme"]
    with sim_engine(args, env=DEV) as e:
        assert post(e, "/sleep?level=2").status == 200
        assert post(e, "/wake_up").status == 200
        expected = PM.wake_s(2, local_nvme())
        assert state(e)["last"]["modelled_s"] == expected
        # one GPU: the disk (7 GB/s) is slower than the host link (25.6 GB/s)
        assert expected == PM.memory.per_gpu[0].weights_bytes / 7e9


def test_engine_flags_for_sleep_mode_and_the_weight_source(monkeypatch: pytest.MonkeyPatch) -> None:
    base = [MODEL, "--max-model-len", "512"]
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    cfg = parse_engine_args(base)
    assert (cfg.enable_sleep_mode, cfg.server_dev_mode, cfg.weight_source) == (False, False, None)
    assert cfg.load_time_s == PM.cold_start_s() == PM.memory.weights_bytes / 2e9 + 20.0
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    cfg = parse_engine_args([*base, "--enable-sleep-mode", "--weight-source", "local_nvme"])
    assert (cfg.enable_sleep_mode, cfg.server_dev_mode) == (True, True)
    assert cfg.weight_source == local_nvme()
    assert cfg.load_time_s == PM.memory.per_gpu[0].weights_bytes / 7e9 + 20.0
    cfg = parse_engine_args(
        [*base, "--weight-source", "network_storage", "--weight-source-gb-per-s", "12.5"]
    )
    assert cfg.load_time_s == PM.memory.per_gpu[0].weights_bytes / 12.5e9 + 20.0
    peer = parse_engine_args([*base, "--weight-source", "peer_gpu", "--link", "nvlink4"])
    assert peer.load_time_s == PM.memory.per_gpu[0].weights_bytes / (450e9 * 0.8) + 20.0
    with pytest.raises(EngineArgsError, match="needs --weight-source"):
        parse_engine_args([*base, "--weight-source-gb-per-s", "3"])
    with pytest.raises(EngineArgsError, match="> 0"):
        parse_engine_args([*base, "--weight-source", "local_nvme", "--weight-source-gb-per-s", "0"])


def test_memory_held_asleep_is_every_gpus_reserve() -> None:
    pm = perf_model_for(MODEL, "pp=2", "A100-80G-SXM", max_model_len=512)
    st = SleepState(pm)
    awake = st.gpu_memory_bytes
    per_gpu = pm.memory.per_gpu
    assert awake == sum(g.reserve_bytes + g.weights_bytes + g.kv_bytes for g in per_gpu)
    tags, duration_s = st.sleep_plan(1)
    assert (tags, duration_s) == (("weights", "kv_cache"), pm.sleep_s(1))
    st.apply_sleep(1, tags, duration_s)
    assert st.gpu_memory_bytes == sum(g.reserve_bytes for g in per_gpu)
    assert st.host_memory_bytes == sum(g.weights_bytes for g in per_gpu)
    assert st.sleep_plan(2) == ((), 0.0)  # asleep already: nothing to do
    assert st.wake_plan(("kv_cache",)) == (("kv_cache",), 0.0)
    assert st.wake_plan(None) == (("weights", "kv_cache"), pm.wake_s(1))
