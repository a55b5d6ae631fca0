"""`flexpipe up`: a gateway and a controller, supervised; the plan lives.

1. load the cluster and the models (default: the seed's fragmented 4-GPU cluster and one 7B
   model, shipped in the package: flexpipe/examples.py) and the shift config, plan once to
   show the plan and to stop early on what cannot work, before anything starts;
2. start `flexpipe gateway` (the OpenAI API on 127.0.0.1:8000) and `flexpipe controller`
   (launches the plan's engines, registers each in the gateway once healthy, shifts gears as
   load and free GPUs change; its admin API on the gateway's port + 100 for `flexpipe cluster
   occupy|release`), both behind one admin token in a private directory (cli/run_dir.py),
   relaying both logs, each started again when it dies, within its own budget
   (cli/restart_budget.py);
3. serve until SIGINT/SIGTERM, then stop the controller first (it drains and stops its
   engines) and the gateway last (it drains what is still in flight). The children get
   SIGTERM if `up` dies (PR_SET_PDEATHSIG), and the engines if the controller dies, so even
   `kill -9` of `up` leaves no process behind (and the next `up` removes its directory).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flexpipe.cli.common import console as make_console
from flexpipe.cli.common import err_console, load_shift_params, user_errors
from flexpipe.cli.run_dir import run_dir
from flexpipe.cli.supervise import UpError, supervise
from flexpipe.cluster import Cluster, load_cluster
from flexpipe.control.api.client import TOKEN_ENV, resolve_token
from flexpipe.control.engines.launching import engine_spec, load_models
from flexpipe.demo import DemoRun, controller_args, demo_cluster, demo_shift_config
from flexpipe.examples import DEFAULT_CLUSTER, DEFAULT_MODELS, DEFAULT_SHIFT
from flexpipe.launch import ENGINES
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import Plan, PlannerConfig, plan
from flexpipe.store import Store


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
        engine: Annotated[str, typer.Option(help="sim, vllm or sglang.")] = "sim",
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
            typer.Option(
                help="YAML with a `shift:` section (docs/shift-policy.md) [examples/shift/"
                "live.yaml: fast up, slow down; --demo: examples/demo/shift.yaml]."
            ),
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
        dcgm: Annotated[
            list[str] | None,
            typer.Option(
                help="A DCGM exporter (http://HOST:9400; repeat for each GPU node): GPU "
                "utilisation measured on the GPUs, on the dashboard and in `flexpipe status`."
            ),
        ] = None,
        dcgm_hostname: Annotated[
            list[str] | None,
            typer.Option(help="NODE=HOSTNAME where a node's exporter reports another name."),
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
                raise UpError(f"unknown engine {engine!r}; use {', '.join(ENGINES)}")
            if demo and cluster is not None:
                raise UpError("--demo runs the built-in example cluster; leave out --cluster")
            cluster_path = cluster or DEFAULT_CLUSTER
            models_path = models or DEFAULT_MODELS
            the_cluster = load_cluster(cluster_path) if ray is None else _ray_cluster(ray, cluster)
            if demo:  # the plan the controller will start with: gpu1 held by the tenant
                the_cluster = demo_cluster(the_cluster, time.time())
            demands = load_models(models_path)
            if shift_config is None:  # the live profile (the controller's default) or the demo's
                shift_config = demo_shift_config() if demo else DEFAULT_SHIFT
            load_shift_params(shift_config)  # checked before anything starts
            admin_token = None
            if admin_token_file is not None:
                admin_token = resolve_token(None, admin_token_file)
            with Store(store) as st:
                efficiency = st.efficiency()
                lookup = GearLookup(st.points(), efficiency)
                config = PlannerConfig(share_gpus=share_gpus)
                the_plan = plan(the_cluster, demands, lookup, config=config, efficiency=efficiency)
            if not the_plan.instances:
                raise UpError(
                    "the planner found nothing to run on the free GPUs: "
                    + "; ".join(f"{u.gpu_id}: {u.reason}" for u in the_plan.unused)
                )
            if engine != "sim":
                nodes = {
                    the_cluster.gpu(g).node
                    for i in the_plan.instances
                    for g in engine_spec(i, the_cluster, str(cluster_path), demands).gpu_ids
                }
                if len(nodes) > 1:
                    raise UpError(
                        f"the plan uses GPUs of nodes {', '.join(sorted(nodes))}; the local "
                        f"launcher starts {engine} on this machine only (multi-node needs the Ray "
                        "launcher); use --engine sim or a single-node cluster file"
                    )
        console.print(f"cluster {the_cluster.name} ({cluster_path}); models from {models_path}")
        console.print(plan_table(the_plan))
        if dry_run:
            return

        def say(line: str) -> None:
            if line.startswith("error:"):
                err_console.print(
                    f"[bold red]error:[/]{escape(line[6:])}", highlight=False, soft_wrap=True
                )  # one line, as the child wrote it
            else:
                console.print(line, highlight=False, soft_wrap=True)

        controller_url = f"http://{host}:{controller_port or port + 100}"
        with run_dir(port, f"http://{host}:{port}", controller_url, admin_token) as rd:
            token_file = str(rd.admin_token_file)
            # one admin token: the gateway's, the controller's (`flexpipe cluster occupy`),
            # and the dashboard's reads of the controller
            say(f"admin token in {token_file} (`flexpipe cluster` and `flexpipe status` find it)")
            me = [sys.executable, "-m", "flexpipe"]
            gateway_argv = [
                *me,
                "gateway",
                "--host",
                host,
                "--port",
                str(port),
                "--admin-token-file",
                token_file,
                "--shutdown-grace-s",
                str(drain_timeout_s),
                "--controller-url",
                controller_url,  # the dashboard's GPU map
                "--controller-token-file",
                token_file,
                *[a for url in dcgm or [] for a in ("--dcgm", url)],
                *[a for pair in dcgm_hostname or [] for a in ("--dcgm-hostname", pair)],
            ]
            controller_argv = [
                *me,
                "controller",
                "--gateway",
                f"http://{host}:{port}",
                "--gateway-token-file",
                token_file,
                "--token-file",
                token_file,
                "--cluster",
                str(cluster_path),
                "--models",
                str(models_path),
                "--port",
                str(controller_port or port + 100),
                "--engine",
                engine,
                "--time-scale",
                str(time_scale),
                "--ready-timeout-s",
                str(ready_timeout_s),
                "--tick-s",
                str(tick_s),
                "--drain-deadline-s",
                str(drain_timeout_s),
                "--vllm-command",
                vllm_command,
                "--engine-token-file",
                str(rd.engine_token_file),
                "--supervisor-pid",
                str(os.getpid()),
                "--rehearsal-tolerance",
                str(rehearsal_tolerance),
            ]
            if scale_to_zero:
                controller_argv.append("--scale-to-zero")
            if share_gpus:
                controller_argv.append("--share-gpus")
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
                        supervise(
                            gateway_argv,
                            controller_argv,
                            host,
                            port,
                            say,
                            drain_timeout_s,
                            on_stop=demo_run.halt if demo_run else None,
                        )
                    )
            finally:
                if demo_run is not None:
                    demo_run.stop()
                    os.environ.pop(TOKEN_ENV, None)
                    if before is not None:
                        os.environ[TOKEN_ENV] = before
        console.print("stopped the controller and the gateway")
        if rc != 0:
            raise typer.Exit(rc)
