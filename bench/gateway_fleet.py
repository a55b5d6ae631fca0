"""The controller's gateway fleet (flexpipe/control/gateway_fleet.py), measured against real
in-process gateways on 127.0.0.1 (one event loop with the fleet):

- an admin command's latency through the fleet with 1, 2 and 4 replicas (the fan-out's cost);
- the catch-up of a replica that comes back empty: the wall time from the read that finds it
  to its pool and holds restored, for a pool of `--num-instances` and `--num-holds` holds;
- a stream's tokens direct from a gateway and through HAProxy with docs/gateway-front.md's
  config, with and without `option http-no-delay` (HAProxy from .deps/haproxy or the PATH;
  a sim engine at time scale 1).

python -m bench gateway_fleet
python -m bench gateway_fleet -- --num-instances 200 --num-holds 20
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

from flexpipe.control.gateway_fleet import GatewayFleet
from flexpipe.gateway.app import Gateway
from flexpipe.gateway.config import config_from_dict

TOKEN = "bench"


async def _gateway(port: int = 0) -> tuple[Gateway, str]:
    gw = Gateway(config_from_dict({"backends": [], "admin_token": TOKEN}))
    server = await gw.start("127.0.0.1", port)
    return gw, f"http://127.0.0.1:{server.port}"


async def _command_latency(num_commands: int) -> None:
    gateways = [await _gateway() for _ in range(4)]
    engine = "http://127.0.0.1:9"  # never probed within the run
    try:
        for n in (1, 2, 4):
            fleet = GatewayFleet([u for _, u in gateways[:n]], TOKEN)
            await fleet.add(engine, "m", 8)
            took = []
            for i in range(num_commands):
                t0 = time.perf_counter()
                await fleet.set_weight(engine, 1.0 + i % 2)
                took.append(time.perf_counter() - t0)
            took.sort()
            print(
                f"{n} replica(s): set_weight median {statistics.median(took) * 1e3:.2f} ms, "
                f"p99 {took[int(0.99 * len(took))] * 1e3:.2f} ms over {num_commands}"
            )
            await fleet.remove(engine)
            await fleet.close()
    finally:
        for gw, _ in gateways:
            await gw.close()


async def _catch_up(num_instances: int, num_holds: int) -> None:
    gw1, url1 = await _gateway()
    gw2, url2 = await _gateway()
    fleet = GatewayFleet([url1, url2], TOKEN, say=lambda line: None)
    try:
        for i in range(num_instances):
            await fleet.add(f"http://127.0.0.1:{10000 + i}", f"m{i % 8}", 8)
        for i in range(num_holds):
            await fleet.hold(f"held-{i}", 600.0)
        port2 = int(url2.rsplit(":", 1)[1])
        await gw2.close()
        gw2, _ = await _gateway(port2)  # back, empty
        t0 = time.perf_counter()
        await fleet.instances()  # finds it (it answers again) and starts the catch-up
        await fleet.settle()
        took_s = time.perf_counter() - t0
        assert len(gw2.pool.instances) == num_instances
        print(
            f"catch-up of an empty replica: {num_instances} instance(s) and {num_holds} "
            f"hold(s) in {took_s * 1e3:.0f} ms (pool {[v['pool'] for v in fleet.view()]})"
        )
    finally:
        await fleet.close()
        await gw1.close()
        await gw2.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gateway_fleet")
    parser.add_argument("--num-commands", type=int, default=300)
    parser.add_argument("--num-instances", type=int, default=50)
    parser.add_argument("--num-holds", type=int, default=10)
    parser.add_argument("--num-tokens", type=int, default=40, help="the front's stream")
    parser.add_argument("--no-front", action="store_true", help="skip HAProxy's stream")
    args = parser.parse_args(argv)
    asyncio.run(_command_latency(args.num_commands))
    asyncio.run(_catch_up(args.num_instances, args.num_holds))
    if not args.no_front:
        _front(args.num_tokens)
    return 0


# ------------------------------------------------------------------ the front (HAProxy)
def _front(num_tokens: int) -> None:
    """A stream's token arrival times direct from a gateway and through HAProxy with
    docs/gateway-front.md's config, with and without its `option http-no-delay`."""
    import os
    import re
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import openai

    from flexpipe.engine.testing import ROOT, free_port, request, sim_engine

    local = ROOT / ".deps" / "haproxy"
    binary = local / "usr" / "sbin" / "haproxy"
    env = dict(os.environ)
    if binary.is_file():
        libs = sorted((local / "usr" / "lib").glob("*-linux-gnu"))
        env["LD_LIBRARY_PATH"] = ":".join(str(p) for p in libs)
        haproxy = str(binary)
    elif found := shutil.which("haproxy"):
        haproxy = found
    else:
        print("front: no haproxy (make test unpacks Debian's into .deps/haproxy)")
        return
    (block,) = re.findall(
        r"```haproxy\n(.*?)```", (ROOT / "docs/gateway-front.md").read_text(), re.S
    )
    model = "llama-2-7b"

    def arrivals(url: str) -> list[float]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        t0 = time.perf_counter()
        out = []
        for ch in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=num_tokens, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            if ch.choices and ch.choices[0].text:
                out.append(time.perf_counter() - t0)
        return out

    def wait_ok(url: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if request("GET", url + "/v1/models", timeout_s=1).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{url} did not come up")

    def said(name: str, times: list[float]) -> None:
        gaps = [b - a for a, b in itertools.pairwise(times)]
        print(
            f"front: {name:<28} first token {times[0] * 1e3:6.0f} ms, last {times[-1] * 1e3:6.0f}"
            f" ms, largest gap {max(gaps) * 1e3:5.0f} ms ({len(times)} tokens)"
        )

    args = [model, "--load-time-s", "0", "--time-scale", "1"]
    with sim_engine(args) as engine, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        gw = subprocess.Popen(
            [sys.executable, "-m", "flexpipe", "gateway", "--port", str(port), "--backend",
             engine.url, "--model", model],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            direct = f"http://127.0.0.1:{port}"
            wait_ok(direct)
            arrivals(direct)  # warm
            said("direct to the gateway", arrivals(direct))
            for name, delay in (
                ("HAProxy, doc's config", True),
                ("HAProxy, no http-no-delay", False),
            ):
                front_port = free_port()
                cfg = block.replace("bind :8000", f"bind 127.0.0.1:{front_port}")
                cfg = cfg.replace("maxconn 20000", "maxconn 1000")
                cfg = re.sub(
                    r"(    server gw\d .*\n)+", f"    server gw1 127.0.0.1:{port} check\n", cfg
                )
                if not delay:
                    cfg = "\n".join(x for x in cfg.splitlines() if "http-no-delay" not in x) + "\n"
                path = Path(tmp) / "haproxy.cfg"
                path.write_text(cfg)
                proxy = subprocess.Popen(
                    [haproxy, "-db", "-f", str(path)], env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                try:
                    front = f"http://127.0.0.1:{front_port}"
                    wait_ok(front)
                    arrivals(front)
                    said(name, arrivals(front))
                finally:
                    proxy.terminate()
                    proxy.wait(10)
        finally:
            gw.terminate()
            gw.wait(10)
