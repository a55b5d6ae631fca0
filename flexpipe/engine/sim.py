"""`python -m flexpipe.engine.sim [vllm serve flags]`: run one sim engine until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Sequence

import prometheus_client

from flexpipe.engine.args import EngineArgsError, EngineConfig, parse_engine_args, warn_ignored
from flexpipe.http.server import install_uvloop, serve


async def serve_engine(cfg: EngineConfig) -> None:
    from flexpipe.engine.api import SimServer

    server = SimServer(cfg)
    http = await serve(server.app, cfg.host, cfg.port)
    server.start()
    print(
        f"flexpipe sim engine: {cfg.served_model_name} on http://{cfg.host}:{http.port} "
        f"({cfg.hardware}; tp={cfg.gear.tp} pp={cfg.gear.pp} {cfg.gear.dtype}; "
        f"{cfg.num_kv_blocks} KV blocks of {cfg.gear.block_size}; max_model_len "
        f"{cfg.max_model_len}; cold start {cfg.load_time_s:.1f} s x time scale {cfg.time_scale:g})",
        file=sys.stderr,
        flush=True,
    )
    # start-up objects live forever: keep them out of every later collection (as vLLM does)
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await http.close()
        await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_engine_args(sys.argv[1:] if argv is None else argv)
    except EngineArgsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    warn_ignored(cfg)
    install_uvloop()
    # as vLLM does: no *_created series
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        asyncio.run(serve_engine(cfg))
    except OSError as exc:
        print(
            f"error: cannot serve on {cfg.host}:{cfg.port}: {exc.strerror or exc}", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
