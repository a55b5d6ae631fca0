"""The performance model's error against measured operator profiles, before and after
calibration, and the refit of the built-in factors.

    python -m bench perf_model_error                 # report from the shipped samples
    python -m bench perf_model_error -- --profiles ../shared/data/vidur-profiling --write
        # convert Vidur's profiles to flexpipe/perf/data/vidur_samples.csv, refit
        # flexpipe/perf/data/calibration.json, then report

The report (markdown) is what docs/performance-model.md quotes.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

from flexpipe.perf.calibration import BUILTIN_CALIBRATION_FILE, NO_CALIBRATION, Calibration
from flexpipe.perf.efficiency import Efficiency
from flexpipe.perf.fit import ErrorRow, error_rows, fit, leave_one_gpu_out
from flexpipe.perf.operator import GEMM_OPS, MEMORY_OPS
from flexpipe.perf.sample import Sample, read_samples_csv, write_samples_csv

DATA = Path(__file__).resolve().parent.parent / "flexpipe" / "perf" / "data"
SAMPLES_FILE = "vidur_samples.csv.gz"
SOURCE = "vidur-profiling (microsoft/vidur@7d47513 data/profiling, MIT)"
PROVENANCE = {
    "source": "microsoft/vidur, data/profiling/ (compute/*/mlp.csv, network/*/*.csv)",
    "commit": "7d47513",
    "licence": "MIT (Copyright (c) Microsoft Corporation)",
    "samples": f"flexpipe/perf/data/{SAMPLES_FILE} (a subsample: medians, log-spaced sizes)",
    "fitted_by": "bench/perf_model_error.py --write (flexpipe/perf/fit.py)",
}
GPU_OF = {"a100": "A100-80G-SXM", "h100": "H100-80G-SXM", "a40": "A40"}
# Token counts kept from the profiles: powers of two and 3 x powers of two.
KEEP_TOKENS = {2**k for k in range(15)} | {3 * 2**k for k in range(3, 13)}


def _vidur_compute(root: Path) -> Iterator[Sample]:
    for path in sorted(root.glob("compute/*/*/*/mlp.csv")):
        gpu = GPU_OF[path.parts[-4]]
        model = path.parts[-2]
        with path.open() as f:
            for row in csv.DictReader(f):
                tokens = int(row["num_tokens"])
                if tokens not in KEEP_TOKENS:
                    continue
                hidden, heads = int(row["n_embd"]), int(row["n_head"])
                for op in (*GEMM_OPS, *MEMORY_OPS):
                    yield Sample(
                        gpu_type=gpu,
                        op=op,
                        time_s=float(row[f"time_stats.{op}.median"]) * 1e-3,
                        num_tokens=tokens,
                        tp=int(row["num_tensor_parallel_workers"]),
                        hidden_size=hidden,
                        intermediate_size=int(row["n_expanded_embd"]),
                        num_heads=heads,
                        num_kv_heads=int(row["n_kv_head"]),
                        head_dim=hidden // heads,
                        source=f"vidur {path.parts[-4]} {model}",
                    )


def _link_of(setup: str, num_workers: int, devices_per_node: int) -> str | None:
    """The catalog link class of a Vidur network setup (None: not one class, skipped)."""
    if num_workers > devices_per_node:
        return None  # spans nodes over an unnamed network
    if setup.endswith("_dgx"):
        return "nvswitch-a100" if setup.startswith("a100") else "nvswitch-h100"
    if setup.endswith("_pairwise_nvlink") and num_workers == 2:
        return "nvlink3" if setup.startswith("a100") else "nvlink4"
    return None  # 4 GPUs joined in NVLink pairs: the ring crosses PCIe


def _vidur_network(root: Path) -> Iterator[Sample]:
    targets = [2**k for k in range(11, 27)]  # 2 KiB .. 64 MiB
    for path in sorted(root.glob("network/*/*.csv")):
        setup, op = path.parts[-2], path.stem
        groups: dict[tuple[str, int], dict[int, float]] = {}
        with path.open() as f:
            for row in csv.DictReader(f):
                link = _link_of(setup, int(row["num_workers"]), int(row["devices_per_node"]))
                if link is None:
                    continue
                groups.setdefault((link, int(row["num_workers"])), {})[int(row["size"])] = (
                    float(row[f"time_stats.{op}.median"]) * 1e-3
                )
        for (link, ranks), by_size in sorted(groups.items()):
            sizes = sorted(by_size)
            kept = {min(sizes, key=lambda s: abs(math.log2(s / t))) for t in targets}
            for size in sorted(kept):
                yield Sample(
                    gpu_type="",
                    op=op,
                    time_s=by_size[size],
                    link=link,
                    num_ranks=ranks,
                    message_bytes=size,
                    source=f"vidur {setup}",
                )


def convert(root: Path) -> list[Sample]:
    return [*_vidur_compute(root), *_vidur_network(root)]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def report(samples: Sequence[Sample], calibration: Calibration) -> str:
    """Markdown: per setup, group and size: generic, calibrated, leave-one-GPU-out."""
    eff = Efficiency(calibration=NO_CALIBRATION)
    before = {(r.setup, r.group, r.size): r for r in error_rows(samples, eff, NO_CALIBRATION)}
    after = error_rows(samples, eff, calibration)
    logo: dict[tuple[str, str, str], ErrorRow] = {}
    for gpu in sorted({s.gpu_type for s in samples if s.gpu_type}):
        held_out = leave_one_gpu_out(samples, gpu, SOURCE)
        mine = [s for s in samples if s.gpu_type == gpu]
        logo.update({(r.setup, r.group, r.size): r for r in error_rows(mine, eff, held_out)})
    lines = [
        "| setup | group | size | n | generic median | generic p90 | calibrated median "
        "| calibrated p90 | leave-one-GPU-out median | leave-one-GPU-out p90 |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in after:
        key = (r.setup, r.group, r.size)
        b, o = before[key], logo.get(key)
        lines.append(
            f"| {r.setup} | {r.group} | {r.size} | {r.num_samples} | {_pct(b.median)} "
            f"| {_pct(b.p90)} | {_pct(r.median)} | {_pct(r.p90)} "
            f"| {_pct(o.median) if o else '-'} | {_pct(o.p90) if o else '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench perf_model_error", description=__doc__)
    parser.add_argument("--profiles", type=Path, help="Vidur profiling folder to convert")
    parser.add_argument("--write", action="store_true", help="rewrite the shipped data files")
    args = parser.parse_args(argv)
    if args.profiles is not None:
        # Through the CSV, so the shipped factors are exactly the fit of the shipped samples.
        samples = read_samples_csv(write_samples_csv(convert(args.profiles)))
    else:
        samples = read_samples_csv(gzip.decompress((DATA / SAMPLES_FILE).read_bytes()).decode())
    calibration = fit(samples, SOURCE, PROVENANCE)
    if args.write:
        text = write_samples_csv(samples).encode()
        (DATA / SAMPLES_FILE).write_bytes(gzip.compress(text, mtime=0))
        (DATA / BUILTIN_CALIBRATION_FILE).write_text(calibration.to_json())
        print(f"wrote {len(samples)} samples and {BUILTIN_CALIBRATION_FILE} to {DATA}")
    print(report(samples, calibration))
