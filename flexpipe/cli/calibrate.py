"""`flexpipe calibrate --model M [--store URL] [--out CSV] [--from-csv CSV]`: measure this
machine's GPUs (PyTorch micro-benchmarks, flexpipe/perf/microbench.py), fit the performance model's
factors for its GPU type and link (flexpipe/perf/fit.py, the code that fitted the built-in
ones), and store them next to the gear table so `plan`, `up`, `sim` and `estimate --store` use
them. `--from-csv` fits measurements recorded earlier (no PyTorch, no GPU needed).
"""

from __future__ import annotations

import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flexpipe.cli.common import console, user_errors
from flexpipe.hardware import gpu_spec
from flexpipe.model_spec import ModelSpec, load_model_spec
from flexpipe.perf.calibration import NO_CALIBRATION, Calibration
from flexpipe.perf.efficiency import Efficiency
from flexpipe.perf.fit import error_rows, fit, predict_layer_s
from flexpipe.perf.sample import LAYER_OPS, Sample, read_samples_csv, write_samples_csv
from flexpipe.store import Store


def _measure(
    model: ModelSpec, gpu_type: str | None, link: str | None, quick: bool
) -> tuple[list[Sample], str]:
    from flexpipe.cluster.nvml import catalog_type
    from flexpipe.perf import microbench

    if not microbench.torch_available():
        raise ValueError(microbench.INSTALL_HINT)
    try:
        name, memory_bytes, count = microbench.visible_gpu()
    except Exception as exc:  # no CUDA build, no driver, no device
        raise ValueError(f"flexpipe calibrate needs a CUDA GPU: {exc}") from None
    gpu = gpu_spec(gpu_type).name if gpu_type else catalog_type(name, memory_bytes)
    if link is None and count > 1:
        link = gpu_spec(gpu).nvlink_generation or "pcie4"
    config = microbench.BenchConfig.quick() if quick else microbench.BenchConfig()
    try:
        samples = microbench.run_benchmarks(model, gpu, link if count > 1 else None, config)
    except microbench.CalibrateError as exc:
        raise ValueError(str(exc)) from None
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    return samples, f"flexpipe calibrate, {count}x {name} on {platform.node()}, {stamp}"


def _print_summary(
    samples: list[Sample], calibration: Calibration, model: ModelSpec, store_url: str
) -> None:
    out = console()
    names = [g.gpu_type for g in calibration.gpus] + [lk.link for lk in calibration.links]
    out.print(f"stored factors for {', '.join(names) or 'nothing'} in {store_url}", highlight=False)
    generic = Efficiency(calibration=NO_CALIBRATION)
    before = {(r.setup, r.group, r.size): r for r in error_rows(samples, generic, NO_CALIBRATION)}
    table = Table(title="Model error against these measurements (median / p90)")
    for col in ("setup", "group", "size", "n", "generic", "calibrated"):
        table.add_column(col, justify="left" if col in ("setup", "group", "size") else "right")
    for r in error_rows(samples, generic, calibration):
        b = before[(r.setup, r.group, r.size)]
        table.add_row(
            r.setup,
            r.group,
            r.size,
            str(r.num_samples),
            f"{b.median:.0%} / {b.p90:.0%}",
            f"{r.median:.0%} / {r.p90:.0%}",
        )
    out.print(table)
    layers = [s for s in samples if s.op in LAYER_OPS]
    if not layers:
        return
    calibrated = Efficiency(calibration=calibration)
    check = Table(title=f"One {model.name} layer: model against measured")
    for col in ("op", "batch", "tokens", "context", "measured ms", "generic ms", "calibrated ms"):
        check.add_column(col, justify="right")
    for s in layers:
        check.add_row(
            s.op,
            str(s.num_seqs),
            str(s.num_tokens),
            str(s.context_len),
            f"{s.time_s * 1e3:.3f}",
            f"{predict_layer_s(s, model, generic) * 1e3:.3f}",
            f"{predict_layer_s(s, model, calibrated) * 1e3:.3f}",
        )
    out.print(check)


def register(app: typer.Typer) -> None:
    @app.command()
    def calibrate(
        model: Annotated[str, typer.Option(help="Model whose shapes to benchmark (id or path).")],
        store: Annotated[
            str | None,
            typer.Option(help="Store URL (default: $FLEXPIPE_STORE or ~/.flexpipe)."),
        ] = None,
        out: Annotated[
            Path | None, typer.Option(help="Write the measurements to this CSV.")
        ] = None,
        from_csv: Annotated[
            Path | None,
            typer.Option("--from-csv", help="Fit recorded measurements instead of measuring."),
        ] = None,
        gpu_type: Annotated[
            str | None, typer.Option(help="Catalog GPU type (default: detected).")
        ] = None,
        link: Annotated[
            str | None, typer.Option(help="Link class joining the GPUs (default: detected).")
        ] = None,
        quick: Annotated[bool, typer.Option(help="Fewer sizes and repeats (~1 minute).")] = False,
    ) -> None:
        """Measure this machine's GPUs, fit the performance model's factors, store them."""
        with user_errors():
            spec = load_model_spec(model)
            if from_csv is not None:
                samples = read_samples_csv(from_csv.read_text(), str(from_csv))
                source = f"recorded measurements {from_csv.name}"
            else:
                samples, source = _measure(spec, gpu_type, link, quick)
            if out is not None:
                out.write_text(write_samples_csv(samples))
            calibration = fit(samples, source, {"source": source})
            with Store(store) as st:
                st.put_calibration(calibration)
                url = st.display_url
        _print_summary(samples, calibration, spec, url)
