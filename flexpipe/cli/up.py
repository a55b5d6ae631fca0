"""`flexpipe up`: a gateway and a controller, supervised; the plan lives.

1. load the cluster and the models (default: the seed's fragmented 4-GPU cluster and one 7B
   model, shipped in the package: flexpipe/examples.py), plan once to show the plan and to
   stop early on what cannot work;
2. start `flexpipe gateway` (the OpenAI API on 127.0.0.1:8000; its admin token in a private
   file) and `flexpipe controller` (launches the plan's engines, registers each in the
   gateway once healthy, shifts gears as load and free GPUs change; its admin API on the
   gateway's port + 100 for `flexpipe cluster occupy|release`), relaying both logs;
3. serve until SIGINT/SIGTERM, then stop the controller first (it drains and stops its
   engines) and the gateway last (it drains what is still in flight). The children get
   SIGTERM if `up` dies (PR_SET_PDEATHSIG), and the engines if the controller dies, so even
   `kill -9` of `up` leaves no process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flexpipe.cli.common import console as make_console
from flexpipe.cli.common import err_console, load_shift_params, user_errors
from flexpipe.cli.controller import SERVING_LINE
from flexpipe.cli.restart_budget import RestartBudget, RestartDecision, decide_restart
from flexpipe.cli.run_dir import run_dir
from flexpipe.cluster import Cluster, load_cluster
from flexpipe.control.client import TOKEN_ENV, resolve_token
from flexpipe.control.launching import engine_spec, load_models
from flexpipe.demo import DemoRun, controller_args, demo_cluster, demo_shift_config
from flexpipe.examples import DEFAULT_CLUSTER, DEFAULT_MODELS
from flexpipe.gears.lookup import GearLookup
from flexpipe.launch import ENGINES
from flexpipe.launch.process import die_with_parent
from flexpipe.policies.planner import Plan, plan
from flexpipe.store import Store


class UpError(ValueError):
    """`flexpipe up` cannot go on; one line for the user."""


async def _relay_lines(stream: asyncio.StreamReader, say: Callable[[str], None]) -> None:
    while line := await stream.readline():
        say(line.decode("utf-8", "replace").rstrip("\n"))


async def _start(argv: list[str], say: Callable[[str], None]) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        preexec_fn=die_with_parent,
        start_new_session=True,  # Ctrl-C reaches `up` alone: it stops them in order
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    asyncio.get_running_loop().create_task(_relay_lines(proc.stdout, say))
    return proc


async def _stop(proc: asyncio.subprocess.Process, timeout_s: float) -> int:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode if proc.returncode is not None else -1


async def _wait_listening(host: str, port: int, proc: asyncio.subprocess.Process) -> None:
    """Until the gateway accepts connections (it is not /health-y before an engine is)."""
    while proc.returncode is None:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise UpError(f"the gateway exited ({proc.returncode}); see its error above")


DEFAULT_BUDGET = RestartBudget()


@dataclass
class _Child:
    """One supervised process: its argv, the running process, when it was restarted."""

    name: str
    argv: list[str]
    say: Callable[[str], None]
    proc: asyncio.subprocess.Process | None = None
    restarts_s: list[float] = field(default_factory=list)
    restart_at_s: float | None = None  # a restart is due then
    exhausted: bool = False  # said so already

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, now_s: float | None = None) -> None:
        if now_s is not None:
            self.restarts_s.append(now_s)
        self.restart_at_s = None
        self.proc = await _start(self.argv, self.say)


def _gave_up(child: _Child, rc: int, decision: RestartDecision, budget: RestartBudget) -> str:
    return (
        f"error: the {child.name} exited ({rc}) {decision.num_recent + 1} times within "
        f"{budget.window_s:g} s; stopping"
    )


async def supervise(
    gateway_argv: list[str],
    controller_argv: list[str],
    host: str,
    port: int,
    say: Callable[[str], None],
    drain_timeout_s: float,
    budget: RestartBudget = DEFAULT_BUDGET,
    on_stop: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run the gateway, then the controller, until SIGINT/SIGTERM (or `stop`). A child that
    dies is started again (a controller adopts the engines its predecessor left, and gives a new
    gateway its pool back) within its own budget, with backoff (restart_budget.py). A
    controller that served and spent its budget is retried slowly while the gateway and the
    engines serve on; a gateway that spent its budget, or a controller that never served
    (exit status 2: it said why; or its budget spent) stops everything. Returns the
    controller's exit status."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    served = False

    def controller_says(line: str) -> None:
        nonlocal served
        served = served or line.startswith(SERVING_LINE)
        say(line)

    gateway = _Child("gateway", gateway_argv, say)
    controller = _Child("controller", controller_argv, controller_says)
    await gateway.start()
    try:
        assert gateway.proc is not None
        await _wait_listening(host, port, gateway.proc)
        say(
            f"flexpipe up: OpenAI API at http://{host}:{port}/v1, dashboard at "
            f"http://{host}:{port}/ui (starting engines)"
        )
        await controller.start()
        while True:
            waits: list[asyncio.Future[object]] = [asyncio.ensure_future(stop.wait())]
            waits += [asyncio.ensure_future(c.proc.wait())
                      for c in (gateway, controller) if c.running and c.proc]  # fmt: skip
            due = [c.restart_at_s for c in (gateway, controller) if c.restart_at_s is not None]
            timeout_s = max(0.0, min(due) - clock()) if due else None
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if stop.is_set():
                if on_stop is not None:
                    on_stop()  # e.g. the demo's load: no new requests while draining
                assert controller.proc is not None
                return await _stop(controller.proc, drain_timeout_s + 30)
            now_s = clock()
            for child in (gateway, controller):
                proc = child.proc
                if proc is None or proc.returncode is None or child.restart_at_s is not None:
                    continue
                rc = proc.returncode
                if child is controller and rc == 2 and not served:
                    return 2  # it could not start the plan, and said why
                keep_trying = child is controller and served
                decision = decide_restart(child.restarts_s, now_s, budget, keep_trying=keep_trying)
                if not decision.restart:
                    say(_gave_up(child, rc, decision, budget))
                    return rc if child is controller else 1
                if decision.exhausted and not child.exhausted:
                    say(
                        f"error: the controller exited {decision.num_recent + 1} times within "
                        f"{budget.window_s:g} s; the gateway and the engines keep serving, but "
                        f"nothing shifts gears until it is back (retrying every "
                        f"{decision.delay_s:g} s)"
                    )
                elif not decision.exhausted:
                    when = f" in {decision.delay_s:g} s" if decision.delay_s else ""
                    say(f"error: the {child.name} exited ({rc}); restarting it{when}")
                child.exhausted = decision.exhausted
                child.restart_at_s = now_s + decision.delay_s
            for child in (gateway, controller):
                if child.restart_at_s is not None and child.restart_at_s <= clock():
                    await child.start(clock())
                    if child is gateway:
                        assert gateway.proc is not None
                        await _wait_listening(host, port, gateway.proc)
    finally:
        if controller.proc is not None:
            await _stop(controller.proc, drain_timeout_s + 30)
        if gateway.proc is not None:
            await _stop(gateway.proc, drain_timeout_s + 5)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)


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
            i.estimate.basis,
        )
    return table


def _ray_cluster(address: str, overlay: Path | None) -> Cluster:
    """`--ray`: the cluster as the Ray cluster has it, with the cluster file's links."""
    from flexpipe.cluster.ray_inventory import read_ray_cluster

    return read_ray_cluster(address, load_cluster(overlay) if overlay is not None else None)


def _ray_argv(address: str, overlay: Path | None, argv: list[str]) -> list[str]:
    """The controller's `--ray` flags; without a cluster file of the user's, no overlay (the
    default example's `--cluster` is dropped from `argv`)."""
    if overlay is None:
        i = argv.index("--cluster")
        del argv[i : i + 2]
    return ["--ray", address]


def register(app: typer.Typer) -> None:
    """Add `flexpipe up` to the app."""

    @app.command("up")
    def up(
        cluster: Annotated[
            Path | None, typer.Option(help="Cluster file (default: the fragmented 4-GPU example).")
        ] = None,
        models: Annotated[
            Path | None, typer.Option(help="Models file (default: the built-in one 7B model).")
        ] = None,
        engine: Annotated[str, typer.Option(help="sim or vllm.")] = "sim",
        host: Annotated[str, typer.Option(help="Gateway address.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Gateway port.")] = 8000,
        controller_port: Annotated[
            int | None, typer.Option(help="Controller admin API port [gateway port + 100].")
        ] = None,
        time_scale: Annotated[
            float, typer.Option(help="sim: wall seconds per modelled second.")
        ] = 1.0,
        sim_load_time_s: Annotated[
            float | None,
            typer.Option(help="sim: weight-load time (default: the performance model's)."),
        ] = None,
        ready_timeout_s: Annotated[float, typer.Option(help="Wait for each engine.")] = 900.0,
        drain_timeout_s: Annotated[float, typer.Option(help="Wait for in-flight requests.")] = 30,
        tick_s: Annotated[float, typer.Option(help="Seconds between shift decisions.")] = 10.0,
        rehearsal_tolerance: Annotated[
            float,
            typer.Option(
                min=0.0,
                help="A new instance's rehearsal probe may take this many times the "
                "prediction; slower rolls the shift back.",
            ),
        ] = 2.0,
        scale_to_zero: Annotated[
            bool,
            typer.Option(
                help="An idle model whose min_instances is 0 may drop to no instance; its next "
                "request waits in the gateway while one cold-starts.",
            ),
        ] = False,
        vllm_command: Annotated[str, typer.Option(help="What runs for --engine vllm.")] = (
            "vllm serve"
        ),
        store: Annotated[str | None, typer.Option(help="Store URL (gear table).")] = None,
        shift_config: Annotated[
            Path | None,
            typer.Option(help="YAML with a `shift:` section (docs/shift-policy.md)."),
        ] = None,
        admin_token_file: Annotated[
            Path | None,
            typer.Option(
                help="The admin token of the gateway and the controller (default: a new one, "
                "in a private file `up` names when it starts)."
            ),
        ] = None,
        dry_run: Annotated[
            bool, typer.Option(help="Check the files, print the plan and exit.")
        ] = False,
        ray: Annotated[
            str | None,
            typer.Option(
                help="Ray cluster address (auto, HOST:PORT): nodes and GPUs from Ray, engines "
                "in placement groups; --cluster then only adds links and names (docs/ray.md)."
            ),
        ] = None,
        demo: Annotated[
            bool,
            typer.Option(
                help="Drive a built-in load and the seed's timeline: another tenant holds gpu1, "
                "then leaves it after a minute; watch flexpipe shift up (flexpipe/demo.py)."
            ),
        ] = False,
    ) -> None:
        """Plan for the free GPUs, launch the instances, serve the OpenAI API until Ctrl-C,
        shifting gears as load and free GPUs change."""
        console = make_console()
        with user_errors():
            if engine not in ENGINES:
                raise UpError(f"unknown engine {engine!r}; use sim or vllm")
            if demo and cluster is not None:
                raise UpError("--demo runs the built-in example cluster; leave out --cluster")
            cluster_path = cluster or DEFAULT_CLUSTER
            models_path = models or DEFAULT_MODELS
            the_cluster = load_cluster(cluster_path) if ray is None else _ray_cluster(ray, cluster)
            if demo:  # the plan the controller will start with: gpu1 held by the tenant
                the_cluster = demo_cluster(the_cluster, time.time())
            demands = load_models(models_path)
            if demo:
                shift_config = shift_config or demo_shift_config()
            if shift_config is not None:  # checked before anything starts
                load_shift_params(shift_config)
            admin_token = None
            if admin_token_file is not None:
                admin_token = resolve_token(None, admin_token_file)
            with Store(store) as st:
                efficiency = st.efficiency()
                lookup = GearLookup(st.points(), efficiency)
                the_plan = plan(the_cluster, demands, lookup, efficiency=efficiency)
            if not the_plan.instances:
                raise UpError(
                    "the planner found nothing to run on the free GPUs: "
                    + "; ".join(f"{u.gpu_id}: {u.reason}" for u in the_plan.unused)
                )
            if engine == "vllm":
                nodes = {
                    the_cluster.gpu(g).node
                    for i in the_plan.instances
                    for g in engine_spec(i, the_cluster, str(cluster_path), demands).gpu_ids
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
            return

        def say(line: str) -> None:
            if line.startswith("error:"):
                err_console.print(f"[bold red]error:[/]{escape(line[6:])}", highlight=False)
            else:
                console.print(line, highlight=False, soft_wrap=True)

        controller_url = f"http://{host}:{controller_port or port + 100}"
        with run_dir(port, f"http://{host}:{port}", controller_url, admin_token) as rd:
            token_file = str(rd.admin_token_file)
            # one admin token: the gateway's, the controller's (`flexpipe cluster occupy`),
            # and the dashboard's reads of the controller
            say(f"admin token in {token_file} (`flexpipe cluster` and `flexpipe status` "
                "find it)")  # fmt: skip
            me = [sys.executable, "-m", "flexpipe"]
            gateway_argv = [*me, "gateway", "--host", host, "--port", str(port),
                            "--admin-token-file", token_file,
                            "--shutdown-grace-s", str(drain_timeout_s),
                            "--controller-url", controller_url,  # the dashboard's GPU map
                            "--controller-token-file", token_file]  # fmt: skip
            controller_argv = [
                *me, "controller", "--gateway", f"http://{host}:{port}",
                "--gateway-token-file", token_file, "--token-file", token_file,
                "--cluster", str(cluster_path), "--models", str(models_path),
                "--port", str(controller_port or port + 100),
                "--engine", engine, "--time-scale", str(time_scale),
                "--ready-timeout-s", str(ready_timeout_s), "--tick-s", str(tick_s),
                "--drain-deadline-s", str(drain_timeout_s), "--vllm-command", vllm_command,
                "--engine-token-file", str(rd.engine_token_file),
                "--supervisor-pid", str(os.getpid()),
                "--rehearsal-tolerance", str(rehearsal_tolerance),
            ]  # fmt: skip
            if scale_to_zero:
                controller_argv.append("--scale-to-zero")
            if sim_load_time_s is not None:
                controller_argv += ["--sim-load-time-s", str(sim_load_time_s)]
            if store is not None:
                controller_argv += ["--store", store]
            demo_run = None
            if demo:
                controller_argv += controller_args()
                demo_run = DemoRun(
                    f"http://{host}:{port}", controller_url, demands[0].name, say, time_scale
                )
            if shift_config is not None:
                controller_argv += ["--shift-config", str(shift_config)]
            if ray is not None:
                controller_argv += _ray_argv(ray, cluster, controller_argv)
            before = os.environ.get(TOKEN_ENV)
            try:
                if demo_run is not None:  # its client reads the token from the environment
                    os.environ[TOKEN_ENV] = rd.admin_token_file.read_text()
                    demo_run.start()
                with user_errors():
                    rc = asyncio.run(
                        supervise(gateway_argv, controller_argv, host, port, say,
                                  drain_timeout_s, on_stop=demo_run.halt if demo_run else None)
                    )  # fmt: skip
            finally:
                if demo_run is not None:
                    demo_run.stop()
                    os.environ.pop(TOKEN_ENV, None)
                    if before is not None:
                        os.environ[TOKEN_ENV] = before
        console.print("stopped the controller and the gateway")
        if rc != 0:
            raise typer.Exit(rc)
