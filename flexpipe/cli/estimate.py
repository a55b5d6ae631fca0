"""`flexpipe estimate`: the performance model's memory plan, step times and the TTFT, TPOT and
tokens/s of one gear at the batch sizes and request lengths asked, with the factor set used."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from flexpipe.cli.common import console, parse_overrides, user_errors
from flexpipe.gears.gear import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GearError,
    GpuSlot,
    Placement,
    parse_gear,
    uniform_placement,
)
from flexpipe.hardware import link_spec
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import Efficiency, PerfModel
from flexpipe.perf.actuation import node_sources, peer_link_for, source_rows
from flexpipe.perf.calibration import NO_CALIBRATION
from flexpipe.perf.steady_state import Workload, steady_state
from flexpipe.perf.weights import HOST_RAM, PAGE_CACHE, WeightSource

if TYPE_CHECKING:
    from flexpipe.cluster import Cluster

GiB = float(2**30)


def parse_gpu_list(text: str) -> list[str]:
    """`A100-80G-SXM:2` or `A100-80G-SXM:1,V100-32G:1` -> one GPU type per GPU."""
    out: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, count = part.partition(":")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise GearError(f"bad --gpus item {part!r}: expected TYPE[:COUNT]") from None
        if n < 1:
            raise GearError(f"bad --gpus item {part!r}: COUNT must be >= 1")
        out.extend([name.strip()] * n)
    return out


def parse_batches(text: str | None) -> list[int] | None:
    """`1,8,32` -> [1, 8, 32]; None -> None (the defaults: 1, 8, 32 and the largest that fits)."""
    if text is None:
        return None
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            b = int(part)
        except ValueError:
            raise ValueError(f"bad --batch item {part!r}: expected a positive integer") from None
        if b < 1:
            raise ValueError(f"bad --batch item {part!r}: expected a positive integer")
        out.append(b)
    if not out:
        raise ValueError("--batch is empty")
    return sorted(set(out))


def load_efficiency(
    path: Path | None,
    overrides: list[str],
    store_url: str | None = None,
    generic: bool = False,
) -> Efficiency:
    """Generic factors with the built-in calibration, then the store's (`--store`), then the
    YAML file and `--set` overrides; `generic` drops every calibration."""
    eff = Efficiency(calibration=NO_CALIBRATION) if generic else Efficiency()
    if store_url is not None and not generic:
        from flexpipe.store import Store

        with Store(store_url) as st:
            eff = st.efficiency(eff)
    if path is not None:
        doc = yaml.safe_load(path.read_text()) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: expected a mapping of efficiency factors")
        eff = Efficiency.from_mapping(doc.get("efficiency", doc), eff)
    if overrides:
        eff = Efficiency.from_mapping(parse_overrides(overrides), eff)
    return eff


def estimate_report(
    pm: PerfModel,
    prompt_len: int,
    output_len: int = 256,
    batches: list[int] | None = None,
    sources: Sequence[WeightSource] | None = None,
    node_of: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """The numbers `estimate` prints, as plain data (also its --json output).

    At each batch size: the steady state the planner prices (the same `steady_state`): TTFT,
    TPOT with chunked prefills of new requests interleaved, output tokens/s; and the bare
    decode step at the mean context (prompt + half the output)."""
    mem = pm.memory
    workload = Workload(prompt_len, output_len)
    context_len = workload.mean_context_tokens
    report: dict[str, Any] = {
        "model": pm.model.name,
        "gear": str(pm.gear),
        "gpus": [
            {"name": g.name, "type": g.spec.name, "free_gib": round(g.free_bytes / GiB, 2)}
            for g in pm.placement.gpus
        ],
        "layers_per_stage": [s.num_layers for s in pm.placement.stages],
        "feasible": pm.feasible,
        "reason": pm.reason,
        "factors": pm.factor_sets() if pm.feasible else {},
        "memory": {
            "per_gpu": [
                {
                    "name": g.name,
                    "budget_gib": round(g.budget_bytes / GiB, 2),
                    "weights_gib": round(g.weights_bytes / GiB, 2),
                    "reserve_gib": round(g.reserve_bytes / GiB, 2),
                    "kv_gib": round(max(g.kv_bytes, 0.0) / GiB, 2),
                    "kv_bytes_per_token": g.kv_bytes_per_token,
                }
                for g in mem.per_gpu
            ],
            "kv_bytes_per_token": mem.kv_bytes_per_token,
            "kv_capacity_tokens": mem.kv_capacity_tokens,
            "num_kv_blocks": mem.num_kv_blocks,
            "block_size": mem.block_size,
            "max_model_len": mem.max_model_len,
        },
        "prompt_len": prompt_len,
        "output_len": output_len,
        "context_len": context_len,
        "steps": [],
    }
    if not pm.feasible:
        return report
    max_batch = min(mem.max_batch(prompt_len + output_len), pm.gear.max_num_seqs)
    report["memory"]["max_batch"] = max_batch
    if batches is None:
        batches = sorted({b for b in (1, 8, 32, max_batch) if 1 <= b <= max_batch})
    for b in batches:
        est = steady_state(pm, b, workload)
        report["steps"].append(
            {
                "batch": b,
                "fits": b <= max_batch,
                "ttft_ms": round(est.ttft_s * 1e3, 3),
                "tpot_ms": round(est.tpot_s * 1e3, 3),
                "output_tokens_per_s": round(est.output_tokens_per_s, 1),
                "requests_per_s": round(est.requests_per_s, 3),
                "decode_step_ms": round(pm.decode_step_s(b, context_len) * 1e3, 3),
                "decode_tokens_per_s": round(pm.decode_tokens_per_s(b, context_len), 1),
            }
        )
    report["prefill_ms"] = round(pm.prefill_s(prompt_len) * 1e3, 3)
    report["cold_start_s"] = round(pm.cold_start_s(), 2)
    srcs = node_sources(pm) if sources is None else sources
    report["weight_sources"] = [
        {
            "source": r.source,
            "detail": r.detail,
            "gb_per_s": round(r.bandwidth_bytes_per_s / 1e9, 3),
            "load_s": round(r.load_s, 3),
            "cold_start_s": round(r.cold_start_s, 3),
            "wake_s": round(r.wake_s, 3),
        }
        for r in source_rows(pm, srcs, node_of)
    ]
    return report


def _print_report(report: dict[str, Any], console: Console) -> None:
    status = "[green]fits[/]" if report["feasible"] else f"[red]does not fit[/]: {report['reason']}"
    console.print(f"[bold]{report['model']}[/] · {report['gear']} · {status}")
    mem = Table(title="Memory plan (per GPU)")
    for col in ("GPU", "budget GiB", "weights GiB", "reserve GiB", "KV GiB", "KV B/token"):
        mem.add_column(col, justify="right" if col != "GPU" else "left")
    for g in report["memory"]["per_gpu"]:
        mem.add_row(
            g["name"],
            f"{g['budget_gib']:.1f}",
            f"{g['weights_gib']:.1f}",
            f"{g['reserve_gib']:.1f}",
            f"{g['kv_gib']:.1f}",
            f"{g['kv_bytes_per_token']:,.0f}",
        )
    console.print(mem)
    m = report["memory"]
    whole = report["prompt_len"] + report["output_len"]
    console.print(
        f"KV capacity: {m['kv_capacity_tokens']:,} tokens = {m['num_kv_blocks']:,} blocks of "
        f"{m['block_size']} · max batch at {whole} tokens per sequence: "
        f"{m.get('max_batch', 0)} · layers per stage: {report['layers_per_stage']}"
    )
    if not report["feasible"]:
        return
    steps = Table(
        title=f"Steady state: {report['prompt_len']}-token prompts, "
        f"{report['output_len']}-token outputs (decode context {report['context_len']})"
    )
    for col in (
        "batch",
        "TTFT ms",
        "TPOT ms",
        "output tokens/s",
        "requests/s",
        "decode step ms",
        "decode tokens/s",
    ):
        steps.add_column(col, justify="right")
    for s in report["steps"]:
        note = "" if s["fits"] else " (over max batch)"
        steps.add_row(
            f"{s['batch']}{note}",
            f"{s['ttft_ms']:.1f}",
            f"{s['tpot_ms']:.2f}",
            f"{s['output_tokens_per_s']:,.0f}",
            f"{s['requests_per_s']:.2f}",
            f"{s['decode_step_ms']:.2f}",
            f"{s['decode_tokens_per_s']:,.0f}",
        )
    console.print(steps)
    console.print(
        f"prefill of {report['prompt_len']} tokens alone: {report['prefill_ms']:.1f} ms · "
        f"cold start: {report['cold_start_s']:.1f} s"
    )
    src = Table(title="Cold start and wake-up by weight source (fastest first)")
    for col in ("source", "GB/s", "load s", "cold start s", "wake s"):
        src.add_column(col, justify="left" if col == "source" else "right")
    for r in report["weight_sources"]:
        src.add_row(
            r["source"],
            f"{r['gb_per_s']:.1f}",
            f"{r['load_s']:.2f}",
            f"{r['cold_start_s']:.1f}",
            f"{r['wake_s']:.2f}",
        )
    console.print(src)
    console.print(
        "wake: host_ram is a level-1 wake (the sleeping copy), the others a level-2 wake "
        "loading from that source; cold start adds the engine's fixed start-up",
        highlight=False,
    )
    for what, factors in report["factors"].items():
        console.print(f"factors for {what}: {factors}", highlight=False)


def _cluster_placement(
    cluster_file: Path, on: str, tp: int, pp: int, num_layers: int
) -> tuple[Placement, Cluster]:
    from flexpipe.cluster import load_cluster, placement_on

    ids = [p.strip() for p in on.split(",") if p.strip()]
    if len(ids) != tp * pp:
        raise GearError(f"--on names {len(ids)} GPUs; the gear needs tp x pp = {tp * pp}")
    cluster = load_cluster(cluster_file)
    stages = [ids[i * tp : (i + 1) * tp] for i in range(pp)]
    return placement_on(cluster, stages, num_layers), cluster


def cluster_sources(pm: PerfModel, cluster: Cluster) -> tuple[WeightSource, ...]:
    """The sources of the nodes the placement spans, at the slowest node's figures (the peer:
    a GPU beside the first, over its NVLink or PCIe, or the network when it has no neighbour
    in its node). Neither a sleeping copy nor the page cache where a node's host RAM cannot
    hold its GPUs' weights."""
    nodes = [cluster.node(cluster.gpu(g.name).node) for g in pm.placement.gpus]
    first = nodes[0]
    peer = peer_link_for(pm.placement.gpus[0].spec) if len(first.gpus) > 1 else None
    sources = node_sources(
        pm,
        min(n.local_nvme_bytes_per_s for n in nodes),
        min(n.network_storage_bytes_per_s for n in nodes),
        peer or first.network.spec,
    )
    weights_per_node: dict[str, float] = {}
    for g in pm.memory.per_gpu:
        node = cluster.gpu(g.name).node
        weights_per_node[node] = weights_per_node.get(node, 0.0) + g.weights_bytes
    fits = all(b <= cluster.node(n).host_ram_capacity_bytes for n, b in weights_per_node.items())
    in_ram = (HOST_RAM, PAGE_CACHE)
    return sources if fits else tuple(s for s in sources if s.kind not in in_ram)


def _node_of(cluster: Cluster) -> Callable[[str], str]:
    return lambda gpu_id: cluster.gpu(gpu_id).node


def register(app: typer.Typer) -> None:
    @app.command()
    def estimate(
        model: Annotated[str, typer.Option(help="Short id, HF repo id or config.json path.")],
        gear: Annotated[str, typer.Option(help="e.g. tp=2,pp=1,dtype=bf16")] = "tp=1",
        gpus: Annotated[
            str | None, typer.Option(help="GPU types per rank: A100-80G-SXM:2 or A:1,B:1")
        ] = None,
        link: Annotated[str, typer.Option(help="Link inside a stage (TP).")] = "nvlink3",
        pp_link: Annotated[
            str | None, typer.Option(help="Link between pipeline stages (default: --link).")
        ] = None,
        cluster: Annotated[Path | None, typer.Option(help="Cluster file (with --on).")] = None,
        on: Annotated[
            str | None, typer.Option(help="GPU ids in the cluster, stage by stage.")
        ] = None,
        batch: Annotated[
            str | None,
            typer.Option(help="Batch sizes (concurrent sequences), e.g. 1,8,32 [1,8,32,max]."),
        ] = None,
        prompt_len: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 1024,
        output_len: Annotated[int, typer.Option(help="Output tokens per request.")] = 256,
        gpu_memory_utilization: Annotated[float, typer.Option()] = DEFAULT_GPU_MEMORY_UTILIZATION,
        max_model_len: Annotated[int | None, typer.Option()] = None,
        efficiency: Annotated[
            Path | None, typer.Option(help="YAML with efficiency factor overrides.")
        ] = None,
        set_: Annotated[
            list[str] | None, typer.Option("--set", help="Override one factor: KEY=VALUE.")
        ] = None,
        store: Annotated[
            str | None,
            typer.Option(help="Store URL: use the factor sets `flexpipe calibrate` stored there."),
        ] = None,
        generic: Annotated[
            bool, typer.Option("--generic", help="Ignore every calibration: generic factors.")
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """Memory plan, TTFT, TPOT and tokens/s of one gear on concrete GPUs, and which factors
        (generic or calibrated, from where) priced each GPU type and link."""
        with user_errors():
            spec = load_model_spec(model)
            g = parse_gear(gear)
            batches = parse_batches(batch)
            eff = load_efficiency(efficiency, set_ or [], store, generic)
            the_cluster: Cluster | None = None
            if cluster is not None or on is not None:
                if cluster is None or on is None:
                    raise GearError("--cluster and --on go together")
                placement, the_cluster = _cluster_placement(
                    cluster, on, g.tp, g.pp, spec.num_layers
                )
            else:
                types = parse_gpu_list(gpus or f"A100-80G-SXM:{g.num_gpus}")
                if len(types) != g.num_gpus:
                    raise GearError(
                        f"--gpus gives {len(types)} GPUs; the gear needs tp x pp = {g.num_gpus}"
                    )
                slots = [GpuSlot.whole(t, f"gpu{i}") for i, t in enumerate(types)]
                placement = uniform_placement(
                    slots,
                    g.tp,
                    g.pp,
                    spec.num_layers,
                    link_spec(link),
                    link_spec(pp_link or link),
                )
            if prompt_len < 1 or output_len < 1:
                raise ValueError("--prompt-len and --output-len must be >= 1")
            pm = PerfModel(spec, g, placement, eff, gpu_memory_utilization, max_model_len)
            sources, node_of = None, None
            if the_cluster is not None and pm.feasible:
                sources = cluster_sources(pm, the_cluster)
                node_of = _node_of(the_cluster)
            report = estimate_report(pm, prompt_len, output_len, batches, sources, node_of)
        if as_json:
            typer.echo(json.dumps(report, indent=2))
        else:
            _print_report(report, console())
