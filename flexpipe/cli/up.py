"""`flexpipe up`: plan for the free GPUs, launch every instance, serve the OpenAI API.

Static plan (the controller will make it change while serving):

1. load the cluster and the models (default: the seed's fragmented 4-GPU cluster and one 7B
   model, examples/), read the gear table from the store, plan (measured curves where there
   are any, the performance model elsewhere);
2. start the gateway on 127.0.0.1:8000 and print the base URL;
3. launch every instance through the launcher, all at once; each is added to the gateway's
   pool as soon as /health answers 200;
4. serve until SIGINT/SIGTERM; an engine that dies is taken out of the pool (no restart);
5. drain: no new requests, wait for in-flight ones (bounded), then stop the gateway and every
   engine (SIGTERM, then SIGKILL to its process group).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.table import Table

from flexpipe.cli.common import console as make_console
from flexpipe.cli.common import err_console, user_errors
from flexpipe.cluster import Cluster, load_cluster
from flexpipe.launch import ENGINES, EngineHandle, EngineSpec, Launcher, LaunchError, LocalLauncher
from flexpipe.policies.planner import ModelDemand, Plan, PlannedInstance, parse_models, plan
from flexpipe.store import Store

_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CLUSTER = _ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"
DEFAULT_MODELS = _ROOT / "examples" / "models" / "llama-7b.yaml"


class UpError(ValueError):
    """`flexpipe up` cannot go on; one line for the user."""


def load_models(path: Path) -> tuple[ModelDemand, ...]:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UpError(f"{path}: cannot read the file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UpError(f"{path}: YAML syntax error: {exc}") from None
    return parse_models(doc, str(path))


def engine_spec(
    inst: PlannedInstance, cluster: Cluster, cluster_file: str, demands: Sequence[ModelDemand]
) -> EngineSpec:
    """The launcher's view of a planned instance."""
    gpu_ids = tuple(g for stage in inst.stages for g in stage)
    max_len = next((d.max_model_len for d in demands if d.name == inst.model), None)
    env: tuple[tuple[str, str], ...] = ()
    if len(set(inst.layers_per_stage)) > 1:
        # vLLM reads an uneven pipeline split from this variable (the sim splits evenly).
        env = (("VLLM_PP_LAYER_PARTITION", ",".join(map(str, inst.layers_per_stage))),)
    return EngineSpec(
        model=inst.model_id,
        gear=inst.gear,
        name=inst.name,
        gpu_ids=gpu_ids,
        gpu_indices=tuple(cluster.gpu(g).index for g in gpu_ids),
        cluster_file=cluster_file,
        served_model_name=inst.model,
        max_model_len=max_len,
        env=env,
    )


@dataclass
class Running:
    """What `up` started, so that everything is stopped on the way out."""

    handles: dict[str, EngineHandle] = field(default_factory=dict)  # instance name -> engine
    failures: list[str] = field(default_factory=list)
    instance_ids: dict[str, int] = field(default_factory=dict)  # instance name -> store row


async def serve_plan(
    the_plan: Plan,
    specs: dict[str, EngineSpec],
    launcher: Launcher,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    stop: asyncio.Event | None = None,
    drain_timeout_s: float = 30.0,
    store: Store | None = None,
    engine: str = "sim",
    say: Any = print,
) -> Running:
    """Run the plan behind a gateway until `stop` is set (or SIGINT/SIGTERM), then drain and
    stop everything. Returns what ran (handles are stopped by then)."""
    from flexpipe.gateway import Gateway, GatewayConfig

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    gw = Gateway(GatewayConfig(host=host, port=port))
    running = Running()
    try:
        try:
            server = await gw.start()
        except OSError as exc:
            raise UpError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        say(f"flexpipe up: OpenAI API at http://{server.host}:{server.port}/v1 (starting engines)")

        async def launch(inst: PlannedInstance) -> None:
            spec = specs[inst.name]
            try:
                handle = await launcher.start(spec)
            except LaunchError as exc:
                running.failures.append(f"{inst.name}: {exc}")
                say(f"error: instance {inst.name} did not start: {exc}")
                return
            running.handles[inst.name] = handle
            gw.pool.add(handle.endpoint, model=inst.model)
            if store is not None:
                running.instance_ids[inst.name] = store.add_instance(
                    inst.name,
                    inst.model_id,
                    str(inst.gear),
                    spec.gpu_ids,
                    handle.endpoint,
                    engine,
                    "active",
                    handle.cold_start_s,
                )
            say(
                f"  {inst.name} ready at {handle.endpoint} on {'+'.join(spec.gpu_ids)} "
                f"({inst.gear.key()}, {handle.cold_start_s:.1f} s)"
            )

        launches = [asyncio.create_task(launch(i)) for i in the_plan.instances]
        stop_wait: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        all_launched: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*launches))
        await asyncio.wait([stop_wait, all_launched], return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            if not running.handles:
                raise UpError("no instance started; see the errors above")
            say(
                f"serving {len(running.handles)} instance(s) at "
                f"http://{server.host}:{server.port}/v1 — Ctrl-C to stop"
            )
            watch = asyncio.create_task(_watch_engines(running, gw, stop, say))
            await stop.wait()
            watch.cancel()
        else:
            for t in launches:
                t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await all_launched
        stop_wait.cancel()
        say("draining ...")
        await _drain(gw, drain_timeout_s)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
        await asyncio.shield(_stop_all(gw, running, store))
    return running


async def _watch_engines(running: Running, gw: Any, stop: asyncio.Event, say: Any) -> None:
    """Take a dead engine out of the pool (the static plan does not restart it)."""
    while not stop.is_set():
        for name, handle in list(running.handles.items()):
            if handle.returncode is not None and handle.endpoint in gw.pool.instances:
                gw.pool.remove(handle.endpoint)
                say(f"error: instance {name} exited ({handle.returncode}); removed from the pool")
        await asyncio.sleep(0.5)


async def _drain(gw: Any, timeout_s: float) -> None:
    for url in list(gw.pool.instances):
        gw.pool.drain(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(i.num_in_flight == 0 for i in gw.pool.instances.values()):
            return
        await asyncio.sleep(0.05)


async def _stop_all(gw: Any, running: Running, store: Store | None) -> None:
    await gw.close()
    await asyncio.gather(*(h.stop() for h in running.handles.values()), return_exceptions=True)
    if store is not None:
        for iid in running.instance_ids.values():
            store.set_instance_state(iid, "gone")


def plan_table(the_plan: Plan) -> Table:
    table = Table(title="plan", title_justify="left")
    for col in ("instance", "model", "gear", "GPUs", "tok/s", "TTFT ms", "TPOT ms", "basis"):
        table.add_column(col, justify="right" if col in ("tok/s", "TTFT ms", "TPOT ms") else "left")
    for i in the_plan.instances:
        table.add_row(
            i.name,
            i.model,
            i.gear.key(),
            " | ".join("+".join(s) for s in i.stages),
            f"{i.capacity_tokens_per_s:,.0f}",
            f"{i.estimate.ttft_s * 1e3:.0f}",
            f"{i.estimate.tpot_s * 1e3:.1f}",
            i.estimate.source,
        )
    return table


def register(app: typer.Typer) -> None:
    """Add `flexpipe up` to the app."""

    @app.command("up")
    def up(
        cluster: Annotated[
            Path | None, typer.Option(help="Cluster file (default: the fragmented 4-GPU example).")
        ] = None,
        models: Annotated[
            Path | None, typer.Option(help="Models file (default: one 7B model, examples/).")
        ] = None,
        engine: Annotated[str, typer.Option(help="sim or vllm.")] = "sim",
        host: Annotated[str, typer.Option(help="Gateway address.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Gateway port.")] = 8000,
        time_scale: Annotated[
            float, typer.Option(help="sim: wall seconds per modelled second.")
        ] = 1.0,
        sim_load_time_s: Annotated[
            float | None,
            typer.Option(help="sim: weight-load time (default: the performance model's)."),
        ] = None,
        ready_timeout_s: Annotated[float, typer.Option(help="Wait for each engine.")] = 900.0,
        drain_timeout_s: Annotated[float, typer.Option(help="Wait for in-flight requests.")] = 30,
        vllm_command: Annotated[str, typer.Option(help="What runs for --engine vllm.")] = (
            "vllm serve"
        ),
        store: Annotated[str | None, typer.Option(help="Store URL (gear table).")] = None,
        dry_run: Annotated[bool, typer.Option(help="Print the plan and exit.")] = False,
    ) -> None:
        """Plan for the free GPUs, launch the instances, serve the OpenAI API until Ctrl-C."""
        console = make_console()
        with user_errors():
            if engine not in ENGINES:
                raise UpError(f"unknown engine {engine!r}; use sim or vllm")
            cluster_path = cluster or DEFAULT_CLUSTER
            models_path = models or DEFAULT_MODELS
            the_cluster = load_cluster(cluster_path)
            demands = load_models(models_path)
            st = Store(store)
            from flexpipe.gears.performance import TablePerformance

            performance = TablePerformance(st.points())
            the_plan = plan(the_cluster, demands, performance)
            if not the_plan.instances:
                raise UpError(
                    "the planner found nothing to run on the free GPUs: "
                    + "; ".join(f"{u.gpu_id}: {u.reason}" for u in the_plan.unused)
                )
            specs = {
                i.name: engine_spec(i, the_cluster, str(cluster_path), demands)
                for i in the_plan.instances
            }
            if engine == "vllm":
                nodes = {
                    the_cluster.gpu(g).node
                    for i in the_plan.instances
                    for g in specs[i.name].gpu_ids
                }
                if len(nodes) > 1:
                    raise UpError(
                        f"the plan uses GPUs of nodes {', '.join(sorted(nodes))}; the local "
                        "launcher starts vLLM on this machine only (multi-node needs the Ray "
                        "launcher); use --engine sim or a single-node cluster file"
                    )
        console.print(f"cluster {the_cluster.name} ({cluster_path}); models from {models_path}")
        console.print(plan_table(the_plan))
        if dry_run:
            st.close()
            return
        launcher = LocalLauncher(
            engine,
            time_scale=time_scale,
            sim_load_time_s=sim_load_time_s,
            ready_timeout_s=ready_timeout_s,
            vllm_command=vllm_command.split(),
        )

        def say(line: str) -> None:
            if line.startswith("error:"):
                err_console.print(f"[bold red]error:[/]{line[6:]}", highlight=False)
            else:
                console.print(line, highlight=False)

        async def main() -> Running:
            return await serve_plan(
                the_plan,
                specs,
                launcher,
                host=host,
                port=port,
                drain_timeout_s=drain_timeout_s,
                store=st,
                engine=engine,
                say=say,
            )

        try:
            with user_errors():
                running = asyncio.run(main())
        finally:
            st.close()
        console.print(f"stopped {len(running.handles)} engine(s) and the gateway")
        if running.failures and not running.handles:
            raise typer.Exit(1)
