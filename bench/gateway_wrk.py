"""A first look with wrk, beside gateway_bench: requests/s and latency through each gateway
against the same fast engines, measured by a load generator that is not ours.

    python bench/gateway_wrk.py            # or: python -m bench gateway_wrk
    python bench/gateway_wrk.py --duration-s 10 --rounds 2

Three sim engines at time scale 0 (16-token responses, streamed), then for each target —
direct to one engine, flexpipe, and the Rust peers where their virtual environments exist
(bench/.venv-sglang, bench/.venv-vllm-router; see bench/gateway_peers.py) — `wrk -c 64` and
`wrk -c 1` for `--duration-s`, interleaved round by round; medians. Needs `wrk` on PATH
(Debian: `apt-get install wrk`); without it the benchmark says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gateway_bench as gb
import gateway_peers as peers

BODY = {"model": gb.MODEL, "prompt": gb.SHORT_PROMPT, "max_tokens": 16, "stream": True}
LUA = f"""wrk.method = "POST"
wrk.body = '{json.dumps(BODY)}'
wrk.headers["Content-Type"] = "application/json"
"""

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not m:
        raise ValueError(f"unparsed wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_wrk(url: str, conns: int, duration_s: int, script: Path) -> dict[str, float]:
    out = subprocess.run(
        [
            "wrk",
            "-t",
            "1",
            "-c",
            str(conns),
            "-d",
            f"{duration_s}s",
            "--latency",
            "-s",
            str(script),
            url + "/v1/completions",
        ],
        capture_output=True,
        text=True,
        timeout=duration_s + 30,
        check=True,
    ).stdout
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if rps is None or "50" not in pct:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    return {
        "req_per_s": float(rps.group(1)),
        "p50_ms": _ms(pct["50"]),
        "p99_ms": _ms(pct["99"]),
        "non_2xx": float(errors.group(1)) if errors else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("gateway_wrk: wrk is not installed (apt-get install wrk); skipped")
        return 0
    script = Path(tempfile.mkdtemp()) / "completion.lua"
    script.write_text(LUA)
    procs = gb.Procs()
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    load_before = gb.load_1m()
    try:
        engines = procs.engines(3, 0.0)
        targets = {"direct (one engine)": engines[0]}
        targets["flexpipe"] = procs.gateway("flexpipe", engines, "round_robin")
        for kind, ok in peers.available().items():
            if ok:
                targets[kind] = procs.gateway(kind, engines, "round_robin")
        for r in range(args.rounds):
            names = gb.rotated(list(targets), r)
            for conns in (1, 64):
                for name in names:
                    url = targets[name] if name != "direct (one engine)" else engines[0]
                    rows.setdefault((name, conns), []).append(
                        run_wrk(url, conns, args.duration_s, script)
                    )
    finally:
        procs.stop()
    print(
        "\n### wrk, streamed 16-token completions, round_robin over 3 engines at time scale 0 "
        f"(medians of {args.rounds}; load before {load_before}, after {gb.load_1m()})"
    )
    print("| connections | target | req/s | p50 ms | p99 ms | non-2xx | flexpipe ÷ target |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for conns in (1, 64):
        base = statistics.median(r["req_per_s"] for r in rows[("flexpipe", conns)])
        for name in targets:
            runs = rows[(name, conns)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            ratio = base / med["req_per_s"] if med["req_per_s"] else float("nan")
            print(f"| {conns} | {name} | {med['req_per_s']:,.0f} | {med['p50_ms']:.2f} | "
                  f"{med['p99_ms']:.2f} | {med['non_2xx']:.0f} | {ratio:.2f}× |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
