"""Two models live, one of them bursty, driven by `flexpipe replay` (docs/simulator.md, "The same
traffic live"): is the bursty model's TTFT p99 within its SLO from its second burst on?

    python -m bench live_bursty                         # ~2 minutes at the default time scale
    python -m bench live_bursty -- --time-scale 0.5     # slower, less sensitive to the machine

`flexpipe up` (gateway, controller, sim engines: real processes on 127.0.0.1) serves the seed's
fragmented 4-GPU cluster (examples/clusters/fragmented-4gpu.yaml) with two 7B models: `steady`
(at least one instance, a request a second throughout) and `bursty` (minimum 0: idle, it is
put to sleep, vLLM's sleep mode, and woken when a burst queues at the gateway). Two
`flexpipe replay` processes send their traces (Mooncake JSONL written here: the steady model's
even stream; the bursty model's `--num-bursts` bursts of `--burst-s` at `--burst-rate-per-s`,
`--gap-s` apart) compressed by 1 / time scale, so that the sim engines' modelled time and the
traces' time agree. The controller runs the bursty-serverless scenario's triggers: an
up-shift on the first urgent sample, no cooldown blocking it, a down-shift that sleeps.

Every duration below is in MODELLED seconds; TTFTs are the replay's wall times divided by the
time scale (the HTTP hops and the controller's reaction are wall time: on a loaded machine
they count against the model, never for it). Reported per burst of the bursty model: its
requests, failures, TTFT p50/p99 and SLO attainment; for the steady model the same over the
run. Verdict "ok" (exit 0) when no request failed and every burst from the second on has
TTFT p99 within the SLO. JSON goes to bench/results/live_bursty-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.shift import Output, kill_leftovers, stop_up
from flexpipe.cli.run_dir import find_admin_token
from flexpipe.control.api.client import ControllerClient, ControllerError
from flexpipe.launch import free_port
from flexpipe.store import Store
from flexpipe.store.shift_log import ShiftLog

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"

MODELS = """\
models:
  - name: steady
    model: llama-2-7b
    demand: {{request_rate_per_s: 1, input_tokens: {prompt}, output_tokens: {output}}}
    slo: {{ttft_p99_ms: {ttft_ms:g}, tpot_p99_ms: {tpot_ms:g}}}
    dtypes: [bf16]
    min_instances: 1
  - name: bursty
    model: llama-2-7b
    demand: {{request_rate_per_s: 1, input_tokens: {prompt}, output_tokens: {output}}}
    slo: {{ttft_p99_ms: {ttft_ms:g}, tpot_p99_ms: {tpot_ms:g}}}
    dtypes: [bf16]
    min_instances: 0
"""

# bursty-serverless's triggers (flexpipe/sim/scenarios/bursty-serverless.yaml), the durations
# in wall seconds (the live controller's clock): filled in by `shift_yaml`
SHIFT = """\
shift:
  sleep_mode: auto
  triggers:
    fast_up_samples: 1
    cooldown_blocks_up: false
    protect_priority: true
    window_s: {window_s:.3f}
    num_samples: 3
    cooldown_s: {cooldown_s:.3f}
  pricing: {{up_step: 1.0}}
"""


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def write_traces(tmp: Path, a: argparse.Namespace) -> tuple[Path, Path, list[tuple[float, float]]]:
    """The two Mooncake traces (timestamps in ms of modelled time) and the bursts' windows."""
    duration_s = a.lead_s + a.num_bursts * a.burst_s + (a.num_bursts - 1) * a.gap_s + a.tail_s
    steady = [
        {"timestamp": round(t * 1000), "input_length": a.prompt_tokens,
         "output_length": a.output_tokens}
        for t in range(int(duration_s))
    ]  # fmt: skip
    bursts: list[tuple[float, float]] = []
    bursty: list[dict[str, int]] = []
    for b in range(a.num_bursts):
        start_s = a.lead_s + b * (a.burst_s + a.gap_s)
        bursts.append((start_s, start_s + a.burst_s))
        n = round(a.burst_s * a.burst_rate_per_s)
        bursty += [
            {"timestamp": round((start_s + i / a.burst_rate_per_s) * 1000),
             "input_length": a.prompt_tokens, "output_length": a.output_tokens}
            for i in range(n)
        ]  # fmt: skip
    paths = (tmp / "steady.jsonl", tmp / "bursty.jsonl")
    for path, rows in zip(paths, (steady, bursty), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths[0], paths[1], bursts


def replay_argv(trace: Path, model: str, port: int, a: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "flexpipe", "replay", str(trace), "--kind", "mooncake",
        "--url", f"http://127.0.0.1:{port}/v1", "--model", model,
        "--speed-up", f"{1 / a.time_scale:g}", "--json", "--quiet",
        "--slo-ttft-ms", f"{a.ttft_slo_ms * a.time_scale:g}",
        "--slo-tpot-ms", f"{a.tpot_slo_ms * a.time_scale:g}",
        "--timeout-s", "120",
    ]  # fmt: skip


def summarise(records: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    """Requests, failures, modelled TTFT p50/p99 and attainment of some replay records."""
    ttfts = [r["ttft_s"] / a.time_scale for r in records if r["ttft_s"] is not None]
    p99 = _pct(ttfts, 0.99)
    return {
        "num_requests": len(records),
        "num_failed": sum(1 for r in records if r["failed"]),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": p99,
        "slo_attainment": (
            sum(1 for r in records if r["slo_met"]) / len(records) if records else None
        ),
        "ttft_p99_within_slo": p99 is not None and p99 <= a.ttft_slo_ms / 1000,
    }


def asleep_models(controller_url: str) -> set[str]:
    try:
        doc = ControllerClient(controller_url, find_admin_token(controller_url)).status()
    except ControllerError:
        return set()
    return {str(i["model"]) for i in doc.get("asleep", [])}


def run(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port, controller_port = free_port(), free_port()
    controller_url = f"http://127.0.0.1:{controller_port}"
    cluster = tmp / "cluster.yaml"
    cluster.write_text(CLUSTER.read_text())
    models = tmp / "models.yaml"
    models.write_text(
        MODELS.format(
            prompt=a.prompt_tokens, output=a.output_tokens,
            ttft_ms=a.ttft_slo_ms, tpot_ms=a.tpot_slo_ms,
        )
    )  # fmt: skip
    (tmp / "shift.yaml").write_text(
        SHIFT.format(window_s=a.window_s * a.time_scale, cooldown_s=a.cooldown_s * a.time_scale)
    )
    steady_trace, bursty_trace, bursts = write_traces(tmp, a)
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--port", str(port),
        "--controller-port", str(controller_port), "--time-scale", str(a.time_scale),
        "--tick-s", f"{a.tick_s * a.time_scale:.3f}", "--scale-to-zero",
        "--cluster", str(cluster), "--models", str(models),
        "--store", f"sqlite:///{tmp / 'fp.db'}", "--shift-config", str(tmp / "shift.yaml"),
        "--drain-timeout-s", f"{10 * a.time_scale:.3f}",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    notes: list[str] = []
    result: dict[str, Any] = {"notes": notes, "bursts_s": bursts}
    up = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, cwd=ROOT,
    )  # fmt: skip
    out = Output(up)
    replays: list[subprocess.Popen[str]] = []
    try:
        if out.wait_for(["instance(s) serving"], 180) is None:
            notes.append("`up` never reported its instances serving")
            return result
        deadline = time.monotonic() + a.max_sleep_wait_s
        while "bursty" not in asleep_models(controller_url) and time.monotonic() < deadline:
            time.sleep(0.25)
        result["asleep_before_first_burst"] = "bursty" in asleep_models(controller_url)
        files = (tmp / "steady.json", tmp / "bursty.json")
        for trace, model, path in zip(
            (steady_trace, bursty_trace), ("steady", "bursty"), files, strict=True
        ):
            with path.open("w") as f:
                replays.append(
                    subprocess.Popen(
                        replay_argv(trace, model, port, a), stdout=f,
                        stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                    )
                )  # fmt: skip
        for proc in replays:
            _, err = proc.communicate(timeout=a.max_wall_s)
            if proc.returncode != 0:
                notes.append(f"replay exited {proc.returncode}: {err.strip()[-300:]}")
        reports = [json.loads(p.read_text()) for p in files if p.stat().st_size]
        if len(reports) != 2:
            return result
        steady_rep, bursty_rep = reports
        result["steady"] = summarise(steady_rep["requests"], a)
        per_burst = []
        for start_s, end_s in bursts:
            mine = [  # the replay's arrival times are compressed: trace time x time scale
                r for r in bursty_rep["requests"]
                if start_s <= r["arrival_s"] / a.time_scale < end_s + 1e-6
            ]  # fmt: skip
            per_burst.append({"start_s": start_s, **summarise(mine, a)})
        result["bursts"] = per_burst
        said = [line for _, line in out.lines if "controller: shift (" in line]
        result["num_sleeps"] = sum(1 for line in said if "shift (down)" in line)
        result["num_wakes"] = sum(1 for line in said if "shift (wake)" in line)
        result["shifts"] = said[-40:]
        log = ShiftLog(Store(f"sqlite:///{tmp / 'fp.db'}"))
        result["decisions"] = [f"{e.kind} {e.trigger}: {e.reason}" for e in log.entries()][-12:]
        return result
    finally:
        for proc in replays:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        result["up_exit_code"] = stop_up(up, notes)
        kill_leftovers(tmp, port, notes)
        if up.returncode not in (0, None) or notes:
            result["up_tail"] = out.tail(30)


def verdict(result: dict[str, Any]) -> tuple[bool, str]:
    bursts = result.get("bursts")
    if not bursts:
        return False, "no result: " + "; ".join(result["notes"])
    failed = result["steady"]["num_failed"] + sum(b["num_failed"] for b in bursts)
    later_ok = all(b["ttft_p99_within_slo"] for b in bursts[1:])
    ok = failed == 0 and later_ok
    word = "ok" if ok else "MISSED"
    return ok, f"{word}: {failed} failed; bursts 2+ TTFT p99 within SLO: {later_ok}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench live_bursty")
    p.add_argument("--time-scale", type=float, default=0.25, help="wall s per modelled s")
    p.add_argument("--num-bursts", type=int, default=3)
    p.add_argument("--burst-s", type=float, default=20.0)
    p.add_argument("--gap-s", type=float, default=120.0, help="idle between bursts")
    p.add_argument("--burst-rate-per-s", type=float, default=6.0)
    p.add_argument("--lead-s", type=float, default=20.0, help="before the first burst")
    p.add_argument("--tail-s", type=float, default=10.0, help="after the last burst")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=60.0)
    p.add_argument("--tick-s", type=float, default=5.0)
    p.add_argument("--window-s", type=float, default=20.0, help="the rate's window")
    p.add_argument("--cooldown-s", type=float, default=30.0)
    p.add_argument("--max-sleep-wait-s", type=float, default=90.0, help="wall")
    p.add_argument("--max-wall-s", type=float, default=600.0)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="flexpipe-live-bursty-") as d:
        result = run(a, Path(d))
    ok, line = verdict(result)
    rows = [("steady", result.get("steady"))]
    bursts = result.get("bursts", [])
    rows += [(f"burst {n + 1} @{b['start_s']:g}s", b) for n, b in enumerate(bursts)]
    print(f"{'':16} {'reqs':>5} {'failed':>6} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'SLO met':>8}")
    for name, s in rows:
        if s is None:
            continue
        p50, p99, att = (
            "-" if v is None else f"{v:.{d}f}"
            for v, d in ((s["ttft_p50_s"], 2), (s["ttft_p99_s"], 2), (s["slo_attainment"], 3))
        )
        print(f"{name:16} {s['num_requests']:5} {s['num_failed']:6} {p50:>10} {p99:>10} {att:>8}")
    for note in result["notes"]:
        print("note:", note)
    print(line)
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = results / f"live_bursty-{stamp}.json"
    path.write_text(json.dumps({"args": vars(a), **result, "verdict": line}, indent=1))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
