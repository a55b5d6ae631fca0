"""The performance model's error against this machine's measurements (`flexpipe calibrate
--out FILE`), three ways: generic factors, the shipped calibration (what flexpipe uses for this
GPU type today), and the factors fitted here. Same rows as docs/performance-model.md's table.

    python -m bench._gpu_check_compare calibrate.csv        (bench/gpu_check.sh runs it)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from flexpipe.perf.calibration import NO_CALIBRATION, Calibration, builtin_calibration
from flexpipe.perf.efficiency import Efficiency
from flexpipe.perf.fit import ErrorRow, error_rows, fit
from flexpipe.perf.sample import Sample, read_samples_csv


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def compare(samples: Sequence[Sample], shipped: Calibration) -> str:
    """Markdown: per setup, group and size, the error with generic, shipped and fitted-here
    factors, and which setups the shipped calibration has a set for."""
    eff = Efficiency(calibration=NO_CALIBRATION)
    here = fit(samples, "this machine (flexpipe calibrate)")

    def rows(calibration: Calibration) -> dict[tuple[str, str, str], ErrorRow]:
        return {(r.setup, r.group, r.size): r for r in error_rows(samples, eff, calibration)}

    generic, ship, mine = rows(NO_CALIBRATION), rows(shipped), rows(here)
    have = {g.gpu_type for g in shipped.gpus} | {lk.link for lk in shipped.links}
    lines = [
        "| setup | group | size | n | generic median | generic p90 | shipped median "
        "| shipped p90 | fitted here median | fitted here p90 |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, r in sorted(mine.items()):
        g, s = generic[key], ship[key]
        lines.append(
            f"| {r.setup}{'' if r.setup in have else ' (no shipped set)'} | {r.group} | {r.size} "
            f"| {r.num_samples} | {_pct(g.median)} | {_pct(g.p90)} | {_pct(s.median)} "
            f"| {_pct(s.p90)} | {_pct(r.median)} | {_pct(r.p90)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._gpu_check_compare", description=__doc__)
    parser.add_argument("csv", type=Path, help="measurements from `flexpipe calibrate --out`")
    args = parser.parse_args(argv)
    samples = read_samples_csv(args.csv.read_text(encoding="utf-8"), str(args.csv))
    print(compare(samples, builtin_calibration()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
