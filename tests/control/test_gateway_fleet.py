"""The controller's gateway fleet (control/gateway_fleet.py) against two real gateways on
127.0.0.1 (in-process, their own servers) and real sim engine processes: every command
reaches both replicas; a replica that goes away is skipped without holding the others up and,
back with an empty memory on the same port, is caught up (pool, lifecycle states, holds,
refusals); a move goes to the replica that holds the stream, so streams on one engine from
both replicas move and reach their clients whole; the demand trigger answers as soon as one
replica has a request waiting."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
from test_gateway_fakes import LoopThread

from flexpipe.control.core.gateway_sync import local_request_id
from flexpipe.control.gateway_fleet import GatewayFleet, deployment_of, keep_replicas
from flexpipe.engine.testing import EngineProc, sim_engine
from flexpipe.gateway.app import Gateway
from flexpipe.gateway.config import config_from_dict
from flexpipe.store import Store
from flexpipe.store.controller_lease import ControllerLeases

MODEL = "llama-2-7b"
ENGINE_ADMIN = "engine-admin"
TOKEN = "gw-admin"


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineProc]]:
    args = [MODEL, "--load-time-s", "0", "--time-scale", "1", "--admin-token", ENGINE_ADMIN]
    with ExitStack() as stack:
        yield [stack.enter_context(sim_engine(args)) for _ in range(2)]


def _gateway(lt: LoopThread, port: int = 0) -> tuple[Gateway, str]:
    gw = Gateway(config_from_dict({"backends": [], "admin_token": TOKEN}))
    server = lt.run(gw.start("127.0.0.1", port))
    return gw, f"http://127.0.0.1:{server.port}"


def _pool(gw: Gateway) -> dict[str, str]:
    return {url: i.state.value for url, i in gw.pool.instances.items()}


def _models(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    return sorted(m.id for m in client.models.list().data)


def test_commands_reach_every_replica_and_one_back_from_a_restart_is_caught_up(
    lt: LoopThread, engines: list[EngineProc]
) -> None:
    e1, e2 = (e.url for e in engines)
    gw1, url1 = _gateway(lt)
    gw2, url2 = _gateway(lt)
    said: list[str] = []
    fleet = GatewayFleet([url1, url2], TOKEN, connect_s=1.0, say=said.append)
    try:
        lt.run(fleet.add(e1, MODEL, 8, admin_token=ENGINE_ADMIN, state="starting"))
        assert _pool(gw1) == _pool(gw2) == {e1: "starting"}
        lt.run(fleet.set_state(e1, "active"))
        lt.run(fleet.hold("later", 60.0))
        assert _pool(gw1) == _pool(gw2) == {e1: "active"}
        assert _models(url1) == _models(url2) == ["later", MODEL]

        port2 = int(url2.rsplit(":", 1)[1])
        lt.run(gw2.close())  # replica 2 goes away: what it held is lost with it
        t0 = time.monotonic()
        lt.run(fleet.add(e2, MODEL, 8, admin_token=ENGINE_ADMIN))  # replica 1 takes it
        lt.run(fleet.refuse("never", "no GPU free to us can place it", 60.0))
        lt.run(fleet.set_state(e1, "draining"))
        assert time.monotonic() - t0 < 1.0  # not held up by the replica that is gone
        assert _pool(gw1) == {e1: "draining", e2: "active"}
        up = {v["url"]: v["up"] for v in fleet.view()}
        assert up == {url1: True, url2: False}
        assert said == [f"controller: gateway {url2} does not answer: " + fleet.replicas[1].error]

        gw2, _ = _gateway(lt, port2)  # back, empty, on the same port
        pool = lt.run(fleet.instances())  # the tick's read finds it and starts its catch-up
        assert [(i["url"], i["state"]) for i in pool] == [(e1, "draining"), (e2, "active")]
        lt.run(fleet.settle())
        assert _pool(gw2) == {e1: "draining", e2: "active"}
        assert _models(url2) == ["later", MODEL, "never"]
        assert said[1:] == [
            f"controller: gateway {url2} answers again",
            # e1 joins as active and drains, e2 joins, the hold, the refusal
            f"controller: gateway {url2} caught up (5 command(s))",
        ]
        lt.run(fleet.instances())
        lt.run(fleet.settle())
        assert [(v["url"], v["up"], v["pool"], v["num_catch_ups"]) for v in fleet.view()] == [
            (url1, True, "in sync", 0),
            (url2, True, "in sync", 1),
        ]
    finally:
        lt.run(fleet.close())
        lt.run(gw1.close())
        lt.run(gw2.close())


def test_streams_from_both_replicas_on_one_engine_move_each_through_its_own_replica(
    lt: LoopThread, engines: list[EngineProc]
) -> None:
    source, target = (e.url for e in engines)
    gw1, url1 = _gateway(lt)
    gw2, url2 = _gateway(lt)
    fleet = GatewayFleet([url1, url2], TOKEN)
    texts: dict[str, str] = {}

    def stream(url: str) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        pieces = []
        ids = set()
        for ch in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=120, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            ids.add(ch.id)
            pieces += [c.text for c in ch.choices if c.text]
        texts[url] = f"{len(ids)} id(s), {len(pieces)} token(s)"

    try:
        lt.run(fleet.add(source, MODEL, 8, admin_token=ENGINE_ADMIN))
        clients = [threading.Thread(target=stream, args=(u,)) for u in (url1, url2)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 10
        while True:
            reqs = lt.run(fleet.requests_on(source))
            if len(reqs) == 2 and all(r["num_output_tokens"] >= 5 for r in reqs):
                break
            assert time.monotonic() < deadline, reqs
            time.sleep(0.02)
        assert sorted(local_request_id(r["id"])[1] for r in reqs) == [0, 1]  # one per replica
        lt.run(fleet.add(target, MODEL, 8, admin_token=ENGINE_ADMIN))
        lt.run(fleet.drain(source))
        moves = [{"id": r["id"], "method": "recompute", "target": target} for r in reqs]
        results = lt.run(fleet.move(moves))
        assert sorted((r["id"], r["outcome"]) for r in results) == sorted(
            (r["id"], "recompute") for r in reqs
        )
        for c in clients:
            c.join(30)
        assert texts == {url1: "1 id(s), 120 token(s)", url2: "1 id(s), 120 token(s)"}
        assert lt.run(fleet.requests_on(source)) == []
        assert lt.run(fleet.drain(source, 1.0)) is True
    finally:
        lt.run(fleet.close())
        lt.run(gw1.close())
        lt.run(gw2.close())


def test_demand_answers_as_soon_as_one_replica_has_a_request_waiting(
    lt: LoopThread,
) -> None:
    gw1, url1 = _gateway(lt)
    gw2, url2 = _gateway(lt)
    fleet = GatewayFleet([url1, url2], TOKEN)
    asked: Any = None
    answers: list[int] = []

    def ask() -> None:
        client = openai.OpenAI(base_url=url2 + "/v1", api_key="none", max_retries=0, timeout=3)
        try:
            client.completions.create(model="cold", prompt="hi", max_tokens=1)
        except openai.APIStatusError as exc:  # released with no instance: a 503
            answers.append(exc.status_code)

    try:
        lt.run(fleet.hold("cold", 30.0))
        t0 = time.monotonic()
        asked = threading.Thread(target=ask)
        asked.start()
        queued = lt.run(fleet.demand(["cold"], 10.0))
        assert queued == {"cold": 1}
        assert time.monotonic() - t0 < 2.0  # not the 10 s of the replica with none waiting
    finally:
        lt.run(fleet.hold("cold", 0.0))
        if asked is not None:
            asked.join(5)
        lt.run(fleet.close())
        lt.run(gw1.close())
        lt.run(gw2.close())
    assert answers == [503]


def test_a_replica_that_hangs_holds_neither_commands_nor_reads_for_long(lt: LoopThread) -> None:
    """A replica that accepts connections and never answers (a stopped process; the kernel
    still accepts): cut off `straggler_s` after the other replica answered and counted down;
    the next commands skip it, the tick's reads ask it again with the same bound."""

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up

    async def serve() -> asyncio.Server:
        return await asyncio.start_server(hang, "127.0.0.1", 0)

    server = lt.run(serve())
    hung = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    gw1, url1 = _gateway(lt)
    said: list[str] = []
    fleet = GatewayFleet([url1, hung], TOKEN, straggler_s=0.3, say=said.append)
    try:
        t0 = time.monotonic()
        lt.run(fleet.hold("m", 30.0))
        took_s = time.monotonic() - t0
        assert 0.3 <= took_s < 1.0, took_s
        assert [(v["url"], v["up"]) for v in fleet.view()] == [(url1, True), (hung, False)]
        assert said == [
            f"controller: gateway {hung} does not answer: gateway {hung}: no answer 0.3 s "
            "after another replica's"
        ]
        t0 = time.monotonic()
        lt.run(fleet.hold("m", 30.0))  # skipped: it is down
        assert time.monotonic() - t0 < 0.2
        t0 = time.monotonic()
        assert lt.run(fleet.instances()) == []  # asked again, cut off again
        assert 0.3 <= time.monotonic() - t0 < 1.0
    finally:
        lt.run(fleet.close())
        lt.run(gw1.close())

        async def close() -> None:
            server.close()

        lt.run(close())


def test_the_store_keeps_a_fleets_deployment_through_a_replica_added_or_retired(
    tmp_path: Path,
) -> None:
    """`deployment_of` / `keep_replicas` on a real SQLite store: the replicas recorded under
    the deployment once its controller holds the lease find it again with one more or fewer;
    a single gateway's deployment from before (a lease under its URL) is found by its URL."""
    a, b, c = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
    with Store(f"sqlite:///{tmp_path / 'fleet.db'}") as store:
        first = deployment_of(store, None, [b, a])
        assert first == f"{a},{b}"
        keep_replicas(store, first, [b, a])
        assert deployment_of(store, None, [a, b, c]) == first  # one added
        keep_replicas(store, first, [a, b, c])
        assert deployment_of(store, None, [c]) == first  # two retired
        assert deployment_of(store, "prod", [a]) == "prod"
        ControllerLeases(store).acquire("http://10.0.0.9:8000", 4242, "host", 1.0, bool)
        assert deployment_of(store, None, ["http://10.0.0.9:8000", "http://10.0.0.8:8000"]) == (
            "http://10.0.0.9:8000"
        )
        with pytest.raises(ValueError, match="belong to 2 deployments"):
            deployment_of(store, None, [a, "http://10.0.0.9:8000"])
