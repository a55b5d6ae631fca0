"""`flexpipe gateway`: the OpenAI-compatible gateway in front of any OpenAI-compatible engines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `flexpipe` app."""
    app.command("gateway")(gateway)


def gateway(
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", "-b", help="Engine base URL (repeat for more)."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="gateway.yaml (docs/gateway.md).")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Bind address [127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="Port [8000].")] = None,
    policy: Annotated[
        str | None, typer.Option(help="Routing policy by name (docs/routing.md) [prefix_affinity].")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model served by the --backend URLs (else discovered).")
    ] = None,
    admin_token: Annotated[
        str | None,
        typer.Option(envvar="FLEXPIPE_ADMIN_TOKEN", help="Bearer token for the admin API."),
    ] = None,
    admin_token_file: Annotated[
        Path | None,
        typer.Option(help="Read the admin token from this file (keeps it out of `ps`)."),
    ] = None,
    shutdown_grace_s: Annotated[
        float | None,
        typer.Option(help="On SIGTERM/SIGINT, seconds in-flight requests get to finish [30]."),
    ] = None,
    max_concurrency: Annotated[
        int | None,
        typer.Option(
            help="A ceiling on requests in flight per instance; each one's cap follows its "
            "max_num_seqs [256]."
        ),
    ] = None,
    controller_url: Annotated[
        str | None,
        typer.Option(
            envvar="FLEXPIPE_CONTROLLER_URL",
            help="The controller's admin API, for the dashboard's GPU map and shift log.",
        ),
    ] = None,
    controller_token_file: Annotated[
        Path | None,
        typer.Option(help="The controller's admin token (else $FLEXPIPE_CONTROLLER_TOKEN)."),
    ] = None,
    dcgm: Annotated[
        list[str] | None,
        typer.Option(
            help="A DCGM exporter (http://HOST:9400; repeat for each GPU node): the dashboard's "
            "GPU utilisation measured on the GPUs (needs --controller-url)."
        ),
    ] = None,
    dcgm_hostname: Annotated[
        list[str] | None,
        typer.Option(
            help="NODE=HOSTNAME: the Hostname a node's DCGM exporter reports, where it is not "
            "the cluster's node name (repeat)."
        ),
    ] = None,
    redis: Annotated[
        str | None,
        typer.Option(
            help="redis://HOST:PORT/DB: replicas on several hosts share budgets, prefix "
            'affinity and the control log there (docs/gateway.md, "Workers and replicas").',
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Worker processes on the one port (SO_REUSEPORT), sharing the pool, holds, "
            'budgets and prefix affinity (docs/gateway.md, "Workers and replicas") '
            "[the host's cores].",
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "warning",
) -> None:
    """Serve the OpenAI API on HOST:PORT and route to the backends."""
    from flexpipe.gateway.app import Gateway
    from flexpipe.gateway.config import (
        BackendConfig,
        ConfigError,
        GatewayConfig,
        config_from_dict,
        load_config,
        validate,
    )

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(config) if config else config_from_dict({})
        for url in backend or []:
            cfg.backends.append(BackendConfig(url=url.rstrip("/"), model=model))
        if host is not None:
            cfg.host = host
        if port is not None:
            cfg.port = port
        if policy is not None:
            cfg.policy, cfg.policy_params = policy, {}
        if admin_token is not None:
            cfg.admin_token = admin_token
        if admin_token_file is not None:
            try:
                cfg.admin_token = admin_token_file.read_text().strip() or None
            except OSError as exc:
                raise ConfigError(f"cannot read {admin_token_file}: {exc.strerror}") from None
        if shutdown_grace_s is not None:
            cfg.shutdown_grace_s = shutdown_grace_s
        if controller_url is not None:
            cfg.controller_url = controller_url.rstrip("/")
        if controller_token_file is not None:
            try:
                cfg.controller_token = controller_token_file.read_text().strip() or None
            except OSError as exc:
                raise ConfigError(f"cannot read {controller_token_file}: {exc.strerror}") from None
        if max_concurrency is not None:
            cfg.max_concurrency_per_instance = max_concurrency
        if redis is not None:
            cfg.shared_state.url = redis
        cfg.dcgm_urls += [u.rstrip("/") for u in dcgm or []]
        for pair in dcgm_hostname or []:
            node, sep, hostname = pair.partition("=")
            if not sep or not node or not hostname:
                raise ConfigError(f"--dcgm-hostname {pair!r}: expected NODE=HOSTNAME")
            cfg.dcgm_hostnames[node] = hostname
        validate(cfg)
        if not cfg.backends and not cfg.admin_token:
            raise ConfigError(
                "no backends: pass --backend URL, list them in --config, or give an admin "
                "token so that a controller can add them"
            )
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    assert isinstance(cfg, GatewayConfig)
    from flexpipe.gateway.workers import Supervisor, default_num_workers, stop_on_signals

    num_workers = workers if workers is not None else default_num_workers()

    async def run_workers() -> None:
        stop = stop_on_signals()
        sup = Supervisor(cfg, num_workers)
        try:
            await sup.start()
        except OSError as exc:
            typer.echo(f"error: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}", err=True)
            await sup.stop()
            raise typer.Exit(2) from None
        typer.echo(
            f"flexpipe gateway on http://{cfg.host}:{sup.port}/v1 "
            f"({len(cfg.backends)} backend(s), policy {cfg.policy}, {num_workers} workers)",
            err=True,
        )
        await stop.wait()
        typer.echo(f"draining {num_workers} workers, up to {cfg.shutdown_grace_s:g} s", err=True)
        await sup.stop()

    async def run() -> None:
        from flexpipe.gateway.workers import make_shared

        stop = asyncio.Event()
        gw = Gateway(cfg, shared=make_shared(cfg, None, 0, stop.set))
        try:
            server = await gw.start()
        except OSError as exc:
            typer.echo(f"error: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}", err=True)
            await gw.close()
            raise typer.Exit(2) from None
        typer.echo(
            f"flexpipe gateway on http://{server.host}:{server.port}/v1 "
            f"({len(cfg.backends)} backend(s), policy {cfg.policy})",
            err=True,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        typer.echo(
            f"draining: {gw.num_active_calls} request(s) in flight, "
            f"up to {cfg.shutdown_grace_s:g} s",
            err=True,
        )
        await gw.shutdown(cfg.shutdown_grace_s)

    from flexpipe.http.server import install_uvloop

    install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run() if num_workers == 1 else run_workers())
