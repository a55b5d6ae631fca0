"""`flexpipe controller`: the process that keeps the plan alive — launches the engines of the
plan, registers them in the gateway, and shifts gears as load and free GPUs change
(flexpipe/control/controller.py). `flexpipe up` runs it next to a gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml
from rich.markup import escape

from flexpipe.cli.common import err_console, load_shift_params, one_line, user_errors
from flexpipe.policies.planner import PlannerConfig

if TYPE_CHECKING:
    from flexpipe.control.watch.ray_watch import RayWatch
    from flexpipe.launch import AdoptingLauncher


SERVING_LINE = "controller: admin API on "  # `up` reads it: the controller served
DEFAULT_GATEWAY = "http://127.0.0.1:8000"


def _secret(value: str | None, path: Path | None, env: str) -> str | None:
    """A token from the flag, else its file, else the environment."""
    if value:
        return value
    if path is not None:
        try:
            return path.read_text().strip() or None
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    return os.environ.get(env) or None


def unix_clock() -> Callable[[], float]:
    """A monotonic clock that reads unix seconds. The controller hands its clock's `now` to the
    shift policy and the planner, which compare it with the cluster file's `free_until_s`
    (unix seconds); `time.monotonic()` counts from boot, so a lease ending in a minute looked
    hours away and no planned reclaim ever fired. Monotonic, so that phase durations and
    cooldowns do not jump with the wall clock."""
    offset_s = time.time() - time.monotonic()
    return lambda: time.monotonic() + offset_s


def replica_urls(values: Sequence[str], path: Path | None) -> list[str]:
    """The gateway replicas: each `--gateway` (a URL or a comma list), then the YAML list in
    `path` (or its `gateways:` list), without repeats; the default gateway when none."""
    urls = [u.strip() for v in values for u in v.split(",") if u.strip()]
    if path is not None:
        try:
            doc = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not YAML: {one_line(exc)}") from None
        if isinstance(doc, dict):
            doc = doc.get("gateways")
        if not isinstance(doc, list) or not all(isinstance(u, str) for u in doc):
            raise ValueError(f"{path}: expected a list of gateway URLs (or `gateways:` with one)")
        urls += [u.strip() for u in doc]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"gateway {url!r}: expected an http:// or https:// URL")
    return list(dict.fromkeys(u.rstrip("/") for u in urls)) or [DEFAULT_GATEWAY]


def register(app: typer.Typer) -> None:
    app.command("controller")(controller)


def controller(
    gateway: Annotated[
        list[str] | None,
        typer.Option(
            help="A gateway's base URL (its admin API); repeat it, or give a comma list, for "
            "several replicas of one gateway service [http://127.0.0.1:8000]."
        ),
    ] = None,
    gateways_file: Annotated[
        Path | None,
        typer.Option(help="YAML list of the gateway replicas' URLs (with or beside --gateway)."),
    ] = None,
    gateway_token_file: Annotated[
        Path | None,
        typer.Option(help="The gateway's admin token (else env FLEXPIPE_GATEWAY_TOKEN)."),
    ] = None,
    cluster: Annotated[Path | None, typer.Option(help="Cluster file (watched).")] = None,
    models: Annotated[Path | None, typer.Option(help="Models file.")] = None,
    store: Annotated[str | None, typer.Option(help="Store URL (gear table, shift log).")] = None,
    host: Annotated[str, typer.Option(help="Admin API address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Admin API port.")] = 8100,
    token_file: Annotated[
        Path | None,
        typer.Option(help="Admin API token file (else env FLEXPIPE_CONTROLLER_TOKEN)."),
    ] = None,
    engine: Annotated[str, typer.Option(help="sim or vllm.")] = "sim",
    time_scale: Annotated[float, typer.Option(help="sim: wall s per modelled s.")] = 1.0,
    sim_load_time_s: Annotated[float | None, typer.Option(help="sim: weight-load time.")] = None,
    ready_timeout_s: Annotated[float, typer.Option(help="Wait for each engine.")] = 900.0,
    vllm_command: Annotated[str, typer.Option(help="What runs for --engine vllm.")] = (
        "vllm serve"
    ),
    tick_s: Annotated[float, typer.Option(help="Seconds between decisions.")] = 10.0,
    drain_deadline_s: Annotated[float, typer.Option(help="Drain before moving.")] = 30.0,
    discover_interval_s: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Ask NVML for the GPUs again this often (0: never; default: every 30 s "
            "when the cluster file was written by `flexpipe discover`).",
        ),
    ] = None,
    share_gpus: Annotated[
        bool,
        typer.Option(
            help="Pack models that need far less than one GPU onto shared GPUs, each engine "
            "with its own --gpu-memory-utilization (docs/gpu-sharing.md).",
        ),
    ] = False,
    scale_to_zero: Annotated[
        bool,
        typer.Option(
            help="An idle model whose min_instances is 0 may drop to no instance; the gateway "
            "holds its next request while one cold-starts (default: at least one each).",
        ),
    ] = False,
    rehearsal_tolerance: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="A new instance's rehearsal probe may take this many times the gear "
            "table's prediction; slower rolls the shift back.",
        ),
    ] = 2.0,
    shift_config: Annotated[
        Path | None,
        typer.Option(
            help="YAML with a `shift:` section (docs/shift-policy.md) [examples/shift/live.yaml: "
            "fast up, slow down]."
        ),
    ] = None,
    engine_token_file: Annotated[
        Path | None,
        typer.Option(help="Admin token of the engines it starts (KV moves; kept over restarts)."),
    ] = None,
    supervisor_pid: Annotated[
        int | None,
        typer.Option(
            help="Engines live as long as this process (flexpipe up) instead of "
            "as long as the controller, which may then crash and be restarted."
        ),
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            help="Ray cluster address (auto, HOST:PORT): nodes and GPUs from Ray, engines in "
            "placement groups; --cluster then only lays links and names over it (docs/ray.md)."
        ),
    ] = None,
    ray_deployment: Annotated[
        str, typer.Option(help="Ray: names this deployment's placement groups.")
    ] = "default",
    engine_host: Annotated[
        str | None, typer.Option(help="Ray: address engines bind [their node's Ray address].")
    ] = None,
    occupy: Annotated[
        list[str] | None,
        typer.Option(
            help="A GPU another tenant holds from the start, until `flexpipe cluster release` "
            "(repeatable)."
        ),
    ] = None,
    occupy_owner: Annotated[str, typer.Option(help="Who holds the --occupy GPUs.")] = (
        "another tenant"
    ),
    deployment_id: Annotated[
        str | None,
        typer.Option(
            help="What owns this controller's instances, shift log and occupations in the "
            "store [the deployment the store recorded one of the gateways under, else the "
            "gateways' URLs sorted and joined by commas (of one gateway: its URL); with --ray, "
            "ray:<--ray-deployment>, whose placement groups it adopts]."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "warning",
) -> None:
    """Launch the plan's engines, register them in the gateway, shift gears while serving."""
    from flexpipe.control.controller import Controller
    from flexpipe.control.controller_config import ControllerConfig
    from flexpipe.control.engines.launching import engine_spec, load_models
    from flexpipe.control.gateway_fleet import GatewayFleet, deployment_of, keep_replicas
    from flexpipe.examples import DEFAULT_CLUSTER, DEFAULT_MODELS, DEFAULT_SHIFT
    from flexpipe.launch import ENGINES, LocalLauncher
    from flexpipe.store import Store

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    with user_errors():
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; use sim or vllm")
        cluster_path = cluster or DEFAULT_CLUSTER
        demands = load_models(models or DEFAULT_MODELS)
        params = load_shift_params(shift_config or DEFAULT_SHIFT)  # live: fast up by default
        if occupy:
            from flexpipe.cluster import load_cluster

            known = {g.id for g in load_cluster(cluster_path).gpus}
            unknown = [g for g in occupy if g not in known]
            if unknown:
                raise ValueError(f"--occupy {unknown[0]}: no such GPU in {cluster_path}")
        gw_token = _secret(None, gateway_token_file, "FLEXPIPE_GATEWAY_TOKEN")
        gateway_urls = replica_urls(gateway or [], gateways_file)
        admin_token = _secret(None, token_file, "FLEXPIPE_CONTROLLER_TOKEN")
        cfg = ControllerConfig(
            cluster_path=cluster_path,
            demands=demands,
            host=host,
            port=port,
            token=admin_token,
            tick_s=tick_s,
            drain_deadline_s=drain_deadline_s,
            discover_interval_s=discover_interval_s,
            min_instances_floor=0 if scale_to_zero else 1,
            planner=PlannerConfig(share_gpus=share_gpus),
            rehearsal_tolerance=rehearsal_tolerance,
            time_scale=time_scale,
            engine_admin_token=_secret(None, engine_token_file, "FLEXPIPE_ENGINE_TOKEN")
            or secrets.token_urlsafe(16),
            engine_kind=engine,
            shift=params,
            occupied=tuple(occupy or ()),
            occupied_owner=occupy_owner,
            # Ray: the store's deployment is the Ray deployment, as its adoption of placement
            # groups removes those of that Ray deployment no record of this one names
            deployment_id=deployment_id or (f"ray:{ray_deployment}" if ray is not None else None),
        )
        st = Store(store)
        # one id whatever replica is listed first, kept when one is added or retired
        cfg.deployment_id = deployment_of(st, cfg.deployment_id, gateway_urls)
    launcher: AdoptingLauncher = LocalLauncher(
        engine,
        time_scale=time_scale,
        sim_load_time_s=sim_load_time_s,
        ready_timeout_s=ready_timeout_s,
        vllm_command=vllm_command.split(),
        supervisor_pid=supervisor_pid,
    )
    watch: RayWatch | None = None
    if ray is not None:
        from flexpipe.control.engines.ray_backend import ray_backend

        with user_errors():
            watch, launcher = ray_backend(
                ray,
                cluster,
                ray_deployment,
                engine,
                time_scale,
                sim_load_time_s,
                ready_timeout_s,
                vllm_command,
                engine_host,
            )

    def say(line: str) -> None:
        typer.echo(line)

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        try:  # it reads the cluster file: a mistake there is one line, exit 2
            ctl = Controller(
                cfg,
                launcher,
                GatewayFleet(gateway_urls, gw_token, say=say),
                lambda p, c: engine_spec(p, c, str(cluster_path), demands, cfg.engine_admin_token),
                store=st,
                clock=unix_clock(),
                say=say,
                watch=watch,
            )
        except (OSError, ValueError) as exc:
            err_console.print(
                f"[bold red]error:[/] {escape(one_line(exc))}", highlight=False, soft_wrap=True
            )
            return 2
        try:
            start = asyncio.ensure_future(ctl.start())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([start, stopped], return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                start.cancel()
                with contextlib.suppress(BaseException):
                    await start
            else:
                stopped.cancel()
                await start  # raises what went wrong
                if ray is None:  # (with --ray the deployment is Ray's, named by its flag)
                    keep_replicas(st, ctl.deployment, gateway_urls)  # the lease is ours now
                say(f"{SERVING_LINE}http://{cfg.host}:{cfg.port}")
                await ctl.run(stop)
        except (OSError, RuntimeError, ValueError) as exc:
            err_console.print(
                f"[bold red]error:[/] {escape(one_line(exc))}", highlight=False, soft_wrap=True
            )
            return 2
        finally:
            num = len(ctl.running)
            say("draining ...")
            await ctl.close()
            say(f"stopped {num} engine(s)")
        return 0

    try:
        rc = asyncio.run(run())
    finally:
        st.close()
    raise typer.Exit(rc)
