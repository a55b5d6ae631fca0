"""The controller's gateway fleet (flexpipe/control/gateway_fleet.py), measured against real
in-process gateways on 127.0.0.1 (one event loop with the fleet):

- an admin command's latency through the fleet with 1, 2 and 4 replicas (the fan-out's cost);
- the catch-up of a replica that comes back empty: the wall time from the read that finds it
  to its pool and holds restored, for a pool of `--num-instances` and `--num-holds` holds.

python -m bench gateway_fleet
python -m bench gateway_fleet -- --num-instances 200 --num-holds 20
"""

from __future__ import annotations

import argparse
import asyncio
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
    args = parser.parse_args(argv)
    asyncio.run(_command_latency(args.num_commands))
    asyncio.run(_catch_up(args.num_instances, args.num_holds))
    return 0
