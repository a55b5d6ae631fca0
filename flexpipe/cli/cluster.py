"""`flexpipe cluster show | validate | generate`: look at, check and make cluster files.
`flexpipe cluster occupy | release`: take GPUs from flexpipe by hand, through the controller."""

from __future__ import annotations

import getpass
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flexpipe.cli.common import console
from flexpipe.cli.durations import DURATION_HELP, parse_until
from flexpipe.cli.run_dir import admin_token, controller_url
from flexpipe.cluster import Cluster, ClusterError, load_cluster
from flexpipe.cluster.generate import generate_cluster
from flexpipe.control.api.client import (
    DEFAULT_CONTROLLER_URL,
    ControllerClient,
    ControllerError,
)
from flexpipe.hardware import DEFAULT_FAST_LINK_BYTES_PER_S, GB, GiB, LinkSpec

cluster_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help=(
        "Cluster files: show a cluster, validate a file, generate a large fragmented one; "
        "occupy and release GPUs through a running controller."
    ),
)


@contextmanager
def _cluster_errors() -> Iterator[None]:
    """A bad cluster file: its error lines, plain, on stderr; exit 2 (no traceback)."""
    try:
        yield
    except ClusterError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.1f}"


def _gbps(spec: LinkSpec) -> str:
    return f"{spec.bandwidth_bytes_per_s / GB:g}"


def _summary(cluster: Cluster) -> str:
    capacity = sum(g.capacity_bytes for g in cluster.gpus)
    return (
        f"{len(cluster.nodes)} nodes, {len(cluster.gpus)} GPUs, "
        f"{_gib(cluster.total_free_bytes)} of {_gib(capacity)} GiB free"
    )


def _report(cluster: Cluster, fast_bytes_per_s: float) -> dict[str, Any]:
    """What `show --json` prints: the document plus derived per-GPU figures."""
    return {
        "name": cluster.name,
        "source": cluster.source,
        "num_nodes": len(cluster.nodes),
        "num_gpus": len(cluster.gpus),
        "total_free_bytes": cluster.total_free_bytes,
        "gpus": [
            {
                "id": g.id,
                "node": g.node,
                "type": g.type,
                "index": g.index,
                "capacity_bytes": g.capacity_bytes,
                "used_bytes": g.used_bytes,
                "free_bytes": g.free_bytes,
                "free_until_s": g.free_until_s,
                "owner": g.owner,
            }
            for g in cluster.gpus
        ],
        "networks": {
            n.name: {
                "link": n.network.link,
                "bandwidth_bytes_per_s": n.network.spec.bandwidth_bytes_per_s,
                "measured": n.network.measured_gb_per_s is not None,
            }
            for n in cluster.nodes
        },
        "fast_link_bytes_per_s": fast_bytes_per_s,
        "fast_domains": [list(d) for d in cluster.fast_domains(fast_bytes_per_s)],
        "document": cluster.to_doc(),
    }


def _print_tables(cluster: Cluster, fast_bytes_per_s: float, console: Console) -> None:
    gpus = Table(title=f"{cluster.name}: GPUs", title_justify="left")
    for column in ("node", "gpu", "idx", "type", "GiB", "used", "free", "free until", "owner"):
        numeric = column in ("idx", "GiB", "used", "free", "free until")
        gpus.add_column(
            column, justify="right" if numeric else "left", no_wrap=column in ("gpu", "type")
        )
    for g in cluster.gpus:
        gpus.add_row(
            escape(g.node),
            escape(g.id),
            str(g.index),
            g.type,
            _gib(g.capacity_bytes),
            _gib(g.used_bytes) if g.used_bytes else "",
            _gib(g.free_bytes),
            "" if g.free_until_s is None else f"{g.free_until_s:g} s",
            escape(g.owner or ""),
        )
    console.print(gpus)

    links = Table(title="links inside nodes", title_justify="left")
    for column in ("node", "gpus", "link", "GB/s", "latency us", ""):
        links.add_column(column, justify="right" if column in ("GB/s", "latency us") else "left")
    for node in cluster.nodes:
        for group in node.links:
            spec = group.spec
            links.add_row(
                escape(node.name),
                escape(", ".join(group.gpus)),
                group.link,
                _gbps(spec),
                f"{spec.latency_s * 1e6:g}",
                "measured" if group.measured_gb_per_s is not None else "",
            )
    console.print(links)
    console.print(
        f"GPUs of one node without a declared link: {cluster.default_intra_node_link}",
        highlight=False,
    )

    networks = Table(title="networks", title_justify="left")
    for column in ("nodes", "link", "GB/s", "latency us", ""):
        networks.add_column(column, justify="right" if column in ("GB/s", "latency us") else "left")
    for node in cluster.nodes:
        spec = node.network.spec
        networks.add_row(
            escape(node.name),
            node.network.link,
            _gbps(spec),
            f"{spec.latency_s * 1e6:g}",
            "measured" if node.network.measured_gb_per_s is not None else "",
        )
    for pair in cluster.node_links:
        spec = pair.spec
        networks.add_row(
            escape(" <-> ".join(pair.nodes)),
            pair.link,
            _gbps(spec),
            f"{spec.latency_s * 1e6:g}",
            "pair, measured" if pair.measured_gb_per_s is not None else "pair",
        )
    console.print(networks)
    console.print("Nodes not paired above talk over the slower of their networks.")

    domains = cluster.fast_domains(fast_bytes_per_s)
    shown = " | ".join("+".join(d) for d in domains[:24])
    more = f" | ... ({len(domains)} in all)" if len(domains) > 24 else ""
    console.print(
        f"fast domains (links >= {fast_bytes_per_s / GB:g} GB/s, where tensor parallelism "
        f"may go): {shown}{more}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    console.print(_summary(cluster), highlight=False, markup=False)


@cluster_app.command("show")
def show(
    file: Annotated[Path, typer.Argument(help="A cluster YAML file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    fast_gb_per_s: Annotated[
        float,
        typer.Option(help="Links at least this fast (GB/s) form a fast domain."),
    ] = DEFAULT_FAST_LINK_BYTES_PER_S / GB,
) -> None:
    """Print a cluster's nodes, GPUs, free memory and links."""
    with _cluster_errors():
        cluster = load_cluster(file)
    if as_json:
        typer.echo(json.dumps(_report(cluster, fast_gb_per_s * GB), indent=2))
        return
    _print_tables(cluster, fast_gb_per_s * GB, console())


@cluster_app.command("validate")
def validate(file: Annotated[Path, typer.Argument(help="A cluster YAML file.")]) -> None:
    """Check a cluster file; print every mistake (one per line) and exit 2 if there are any."""
    with _cluster_errors():
        cluster = load_cluster(file)
    typer.echo(f"{file}: ok: {_summary(cluster)}")


@cluster_app.command("generate")
def generate(
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="Number of nodes.")] = 128,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs in each node.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed: the same seed gives the same cluster.")] = 0,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Cluster name.")] = None,
) -> None:
    """Generate a large fragmented cluster (mixed node kinds, random occupancy) as YAML."""
    with _cluster_errors():
        cluster = generate_cluster(nodes, gpus_per_node, seed, name=name)
    header = (
        f"# generated by `flexpipe cluster generate --nodes {nodes} --gpus-per-node "
        f"{gpus_per_node} --seed {seed}`\n# {_summary(cluster)}\n"
    )
    text = header + cluster.to_yaml()
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        typer.echo(f"{output}: cannot write: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {output}: {_summary(cluster)}")


ControllerUrl = Annotated[
    str | None,
    typer.Option(
        "--controller",
        envvar="FLEXPIPE_CONTROLLER",
        help="The controller's admin API URL (default: your running `flexpipe up`'s, whatever "
        f"its ports, else {DEFAULT_CONTROLLER_URL}).",
        show_default=False,
    ),
]
Token = Annotated[
    str | None,
    typer.Option(
        help="Admin token (default: --token-file, else $FLEXPIPE_CONTROLLER_TOKEN, else the "
        "token of your `flexpipe up` whose controller this is)."
    ),
]
TokenFile = Annotated[
    Path | None, typer.Option(help="A file holding the admin token.", show_default=False)
]
TimeoutS = Annotated[float, typer.Option("--timeout-s", min=0.1, help="Seconds to wait.")]


def connect(
    controller: str | None, token: str | None, token_file: Path | None, timeout_s: float
) -> ControllerClient:
    """The client of the controller a command means (`run_dir.controller_url`), with its
    token; a bad URL or token file, or several running `up`s: ValueError."""
    url = controller_url(controller)
    return ControllerClient(url, admin_token(url, token, token_file), timeout_s)


def _client(
    controller: str | None, token: str | None, token_file: Path | None, timeout_s: float
) -> ControllerClient:
    """Bad local input (URL, token file): one `error:` line, exit 2."""
    try:
        return connect(controller, token, token_file, timeout_s)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _default_owner() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "admin"


@cluster_app.command("occupy")
def occupy(
    gpus: Annotated[
        list[str], typer.Argument(metavar="GPU", help="GPU ids, as in the cluster file.")
    ],
    until: Annotated[
        str | None,
        typer.Option(help=f"Until when: {DURATION_HELP} or an ISO time. Default: until released."),
    ] = None,
    owner: Annotated[
        str | None, typer.Option(help="Who takes them (default: your user name).")
    ] = None,
    controller: ControllerUrl = None,
    token: Token = None,
    token_file: TokenFile = None,
    timeout_s: TimeoutS = 10.0,
) -> None:
    """Take GPUs from flexpipe (another job needs them): the controller moves its work off them
    and plans without them until --until or `flexpipe cluster release`."""
    until_s = None
    if until is not None:
        try:
            until_s = parse_until(until, time.time())
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    client = _client(controller, token, token_file, timeout_s)
    who = owner or _default_owner()
    try:
        result = client.occupy(gpus, until_s, who)
    except ControllerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    when = "until released" if until_s is None else f"until {_local_time(until_s)}"
    typer.echo(f"occupied {', '.join(result.gpus)} for {who} {when}: {result.summary()}")


@cluster_app.command("release")
def release(
    gpus: Annotated[
        list[str], typer.Argument(metavar="GPU", help="GPU ids occupied with `occupy`.")
    ],
    controller: ControllerUrl = None,
    token: Token = None,
    token_file: TokenFile = None,
    timeout_s: TimeoutS = 10.0,
) -> None:
    """Give GPUs taken with `flexpipe cluster occupy` back to flexpipe."""
    client = _client(controller, token, token_file, timeout_s)
    try:
        result = client.release(gpus)
    except ControllerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"released {', '.join(result.gpus)}: {result.summary()}")


def _local_time(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s).astimezone().isoformat(timespec="seconds")


def register(app: typer.Typer) -> None:
    """Add `flexpipe cluster ...` to the `flexpipe` app."""
    app.add_typer(cluster_app, name="cluster")
