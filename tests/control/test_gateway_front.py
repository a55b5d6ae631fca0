"""The fronts of docs/gateway-front.md, as written there (its HAProxy config, its nginx
upstream and server; only the addresses changed), in front of two `flexpipe gateway` processes
on 127.0.0.1 that the controller's fleet client registered one sim engine in: the `openai`
client's requests are spread over both replicas; a stream comes through token by token
(nothing buffered); when the replica holding an open stream is killed with SIGKILL, that
stream ends with an error, and the client's retry and every request after it are served by
the other replica, with no retry of the client's own (the proxy resends only the connections
it could not make). HAProxy and nginx are Debian's, unpacked by `make test` into .deps/; a
proxy that is neither there nor on the PATH is skipped."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest
from test_gateway_fleet_live import ROOT, TOKEN, _gateway, _processes, _wait

from flexpipe.control.gateway_fleet import GatewayFleet
from flexpipe.engine.testing import free_port, request, scrape, sim_engine

MODEL = "llama-2-7b"
DOC = ROOT / "docs" / "gateway-front.md"


def _binary(name: str) -> tuple[str, dict[str, str]] | None:
    """The proxy's binary and its environment: .deps/NAME's (make test unpacks Debian's
    package there), else the PATH's; None when neither has it."""
    local = ROOT / ".deps" / name
    binary = local / "usr" / "sbin" / name
    if binary.is_file():
        libs = [str(p) for p in sorted((local / "usr" / "lib").glob("*-linux-gnu"))]
        return str(binary), {"LD_LIBRARY_PATH": ":".join(libs)}
    found = shutil.which(name)
    return (found, {}) if found else None


def _doc_block(lang: str) -> str:
    (block,) = re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)
    return str(block)


def _haproxy(port: int, replicas: list[int], tmp: Path) -> list[str]:
    """The doc's HAProxy config on 127.0.0.1:`port` over `replicas`, its checks every 200 ms
    (the doc's 1 s would only make the test slower), at most 1,000 connections (the doc's
    20,000 need twice that many descriptors); the command that runs it."""
    block = _doc_block("haproxy").replace("bind :8000", f"bind 127.0.0.1:{port}")
    block = block.replace("inter 1s", "inter 200ms").replace("maxconn 20000", "maxconn 1000")
    servers = "\n".join(f"    server gw{i + 1} 127.0.0.1:{p} check" for i, p in enumerate(replicas))
    block = re.sub(r"(    server gw\d .*\n)+", servers + "\n", block)
    assert f"127.0.0.1:{replicas[1]} check" in block
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(block)
    return ["-db", "-f", str(cfg)]


def _nginx(port: int, replicas: list[int], tmp: Path) -> list[str]:
    """The doc's nginx `upstream` and `server` on 127.0.0.1:`port` over `replicas`, inside
    the main context nginx needs (its files under `tmp`); the command that runs it."""
    block = _doc_block("nginx").replace("listen 8000;", f"listen 127.0.0.1:{port};")
    servers = "".join(f"    server 127.0.0.1:{p} max_fails=2 fail_timeout=5s;\n" for p in replicas)
    block = re.sub(r"(    server 10\.0\.0\.\d:8000 .*\n)+", servers, block)
    assert f"127.0.0.1:{replicas[1]} max_fails" in block
    temp = (
        " ".join(
            f"{kind}_temp_path {tmp / kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi")
        )
        + f" scgi_temp_path {tmp / 'scgi'};"
    )
    user = "user root;" if os.geteuid() == 0 else ""  # workers that can read `tmp`
    cfg = tmp / "nginx.conf"
    cfg.write_text(
        f"{user} worker_processes 1; error_log {tmp / 'error.log'}; pid {tmp / 'nginx.pid'};\n"
        f"events {{}}\nhttp {{ access_log off; {temp}\n{block}}}\n"
    )
    return ["-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(cfg), "-g", "daemon off;"]


FRONTS = {"haproxy": _haproxy, "nginx": _nginx}


def _in_flight(gateway: str) -> int:
    text = request("GET", gateway + "/metrics", timeout_s=5).text
    return round(scrape(text, "flexpipe_in_flight_requests"))


def _served(gateway: str) -> float:
    text = request("GET", gateway + "/metrics", timeout_s=5).text
    return scrape(text, "flexpipe_requests_total", model=MODEL, status="200")


@pytest.mark.parametrize("proxy", sorted(FRONTS))
def test_the_front_spreads_clients_streams_unbuffered_and_takes_a_killed_replica_out(
    tmp_path: Path, proxy: str
) -> None:
    found = _binary(proxy)
    if found is None:
        pytest.skip(f"no {proxy}: `make test` unpacks Debian's into .deps/{proxy}")
    binary, env = found
    ports = [free_port(), free_port()]
    g1, g2 = (f"http://127.0.0.1:{p}" for p in ports)
    front_port = free_port()
    front = f"http://127.0.0.1:{front_port}"
    argv = [binary, *FRONTS[proxy](front_port, ports, tmp_path)]
    log = tmp_path / "log.txt"
    args = [MODEL, "--load-time-s", "0", "--time-scale", "1"]
    with sim_engine(args) as engine, _processes() as procs:
        procs += [_gateway(p, log) for p in ports]

        async def register() -> None:
            fleet = GatewayFleet([g1, g2], TOKEN)
            try:
                await fleet.add(engine.url, MODEL, 64)
            finally:
                await fleet.close()

        asyncio.run(register())
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        procs.append(proc)
        client = openai.OpenAI(base_url=front + "/v1", api_key="none", timeout=30)
        _wait(
            lambda: request("GET", front + "/v1/models", timeout_s=1).status == 200,
            10,
            lambda: log.read_text()[-2000:],
        )

        # spread: leastconn over idle replicas alternates
        for _ in range(10):
            r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert r.usage is not None and r.usage.completion_tokens == 2
        assert _served(g1) > 0 and _served(g2) > 0
        assert _served(g1) + _served(g2) == 10

        # a stream comes through as the engine makes it: the first token long before the last
        t0 = time.monotonic()
        arrivals = []
        for ch in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=40, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            if ch.choices and ch.choices[0].text:
                arrivals.append(time.monotonic() - t0)
        assert len(arrivals) == 40
        assert arrivals[0] < 0.5 * arrivals[-1], arrivals

        # the replica holding an open stream dies: that stream ends with an error, the
        # client's retry and every request after the kill are served by the other one, with
        # no retry of the client's own (HAProxy resends what it could not connect for)
        once = client.with_options(max_retries=0)
        stream = once.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=400, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        num_tokens = sum(1 for _, _ in zip(range(5), chunks, strict=False))
        in_flight = [_in_flight(g) for g in (g1, g2)]
        assert sorted(in_flight) == [0, 1], in_flight
        dead = in_flight.index(1)
        survivor = (g1, g2)[1 - dead]
        before = _served(survivor)
        procs[dead].send_signal(signal.SIGKILL)
        procs[dead].wait(5)
        with pytest.raises(Exception):  # noqa: B017 (httpx's or openai's, as it breaks)
            for ch in chunks:
                num_tokens += len([c for c in ch.choices if c.text])
        assert num_tokens < 400
        for _ in range(20):
            r = once.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert r.usage is not None and r.usage.completion_tokens == 2
        assert _served(survivor) - before == 20
