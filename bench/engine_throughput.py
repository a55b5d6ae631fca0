"""Sim engine throughput at time scale 0: short streamed responses per second.

One engine process (one core), 64 concurrent keep-alive clients, 16-token streamed
completions. Target: >= 2,500 responses/s, so the engine is never the bottleneck of a gateway
benchmark.

    python -m bench engine_throughput [--clients 64] [--tokens 16] [--duration 10]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.engine_loadgen import cpu_load, run_load
from flexpipe.engine.testing import sim_engine

MODEL = "llama-2-7b"
TARGET_RESPONSES_PER_S = 2500.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench engine_throughput")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=1.0)
    args = p.parse_args(argv or [])
    engine_args = [MODEL, "--time-scale", "0", "--load-time-s", "0", "--max-model-len", "1024"]
    load_before = cpu_load()
    with sim_engine(engine_args) as eng:
        asyncio.run(run_load("127.0.0.1", eng.port, args.clients, args.warmup, MODEL, args.tokens))
        records, elapsed = asyncio.run(
            run_load(
                "127.0.0.1",
                eng.port,
                args.clients,
                args.duration,
                MODEL,
                args.tokens,
                timestamps=False,
            )
        )
    ok = [r for r in records if len(r.token_times_s) == args.tokens]
    rate = len(ok) / elapsed
    print(
        f"engine_throughput: {len(ok)} responses of {args.tokens} tokens in {elapsed:.1f} s "
        f"with {args.clients} clients = {rate:,.0f} responses/s, "
        f"{rate * args.tokens:,.0f} tokens/s (target >= {TARGET_RESPONSES_PER_S:,.0f}); "
        f"incomplete: {len(records) - len(ok)}; load average before: {load_before}"
    )
    return 0 if rate >= TARGET_RESPONSES_PER_S else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
