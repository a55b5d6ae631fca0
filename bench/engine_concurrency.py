"""Throughput and TTFT against concurrency, for two gears: continuous batching's shape.

Closed-loop streaming clients (128-word prompts, 128 output tokens) at concurrency 1 to 256
against one sim engine per gear. Times run at `--time-scale` and are reported in modelled
seconds (wall / scale): throughput rises with concurrency until the batch is memory- or
compute-bound or max-num-seqs caps it; past max-num-seqs, requests queue and TTFT grows.

    python -m bench engine_concurrency [--duration 3] [--time-scale 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.engine_loadgen import cpu_load, percentile, run_load
from flexpipe.engine.testing import sim_engine

MODEL = "llama-3.1-8b"
GEARS = {
    # name: extra engine flags
    "tp=1, max_num_seqs=64, A100": ["--tensor-parallel-size", "1", "--max-num-seqs", "64"],
    "tp=2, max_num_seqs=256, A100 NVLink": ["--tensor-parallel-size", "2", "--max-num-seqs", "256"],
}
LEVELS = (1, 4, 16, 64, 128, 256)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench engine_concurrency")
    p.add_argument("--duration", type=float, default=3.0, help="wall seconds per level")
    p.add_argument("--time-scale", type=float, default=0.5)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv or [])
    scale = args.time_scale
    print(f"engine_concurrency: {MODEL}, {args.tokens}-token streams, time scale {scale:g}, "
          f"load average before: {cpu_load()}")  # fmt: skip
    print("| gear | concurrency | output tokens/s | requests/s | TTFT p50 (s) | TTFT p99 (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for gear, flags in GEARS.items():
        engine_args = [
            MODEL, *flags, "--max-model-len", "2048", "--time-scale", str(scale),
            "--load-time-s", "0",
        ]  # fmt: skip
        with sim_engine(engine_args) as eng:
            for level in LEVELS:
                records, elapsed = asyncio.run(
                    run_load(
                        "127.0.0.1", eng.port, level, args.duration, MODEL, args.tokens,
                        prompt_words=128,
                    )
                )  # fmt: skip
                modelled_s = elapsed / scale if scale > 0 else elapsed
                done = [r for r in records if len(r.token_times_s) == args.tokens]
                ttfts = [r.ttft_s / scale for r in done]
                tokens = sum(len(r.token_times_s) for r in records)
                print(
                    f"| {gear} | {level} | {tokens / modelled_s:,.0f} | "
                    f"{len(done) / modelled_s:,.1f} | {percentile(ttfts, 50):.3f} | "
                    f"{percentile(ttfts, 99):.3f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
