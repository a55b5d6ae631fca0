"""How long `flexpipe up` takes to take gpu1 back once the load needs it again
(docs/shift-policy.md, "Fast up, slow down"), under the policy's code defaults and under the
live profile (examples/shift/live.yaml, what `flexpipe up` runs without --shift-config):

    python -m bench live_retake                       # both, ~7 minutes at time scale 0.25
    python -m bench live_retake -- --only live        # the live profile alone

`flexpipe up` (gateway, controller, sim engines: real processes on 127.0.0.1) serves the
built-in example: the seed's fragmented 4-GPU cluster and llama-7b (2048-token prompts,
256-token answers). A light load (`--low-rate-per-s`) lets the controller shift down onto
gpu2 alone, releasing gpu1; as soon as it does, `--high-rate-per-s` more arrives for
`--high-s` (with the light load, which goes on from the start until the high load ends, for
at most `--low-s`: 4 req/s by default), more than the example serves without gpu1 (gpu2,
gpu3 and gpu0 carry about 3.4 SLO-meeting req/s, the four GPUs 5.4). Both loads are
`flexpipe replay` runs of Mooncake traces written here, compressed by 1 / time scale.

Durations are MODELLED seconds: the live controller's tick and every duration of the profile
its policy keeps on the wall clock (the triggers' and the forecast's, `wall_durations`) are
the profile's multiplied by the time scale. Measured from
the shift log: release (the down-shift that left gpu1 ended) to the decision that takes
gpu1 back, and to the end of that shift (gpu1 serving); the requests and failures of each
replay. Verdict "ok" (exit 0) when the live profile took gpu1 back within `--max-ticks`
ticks of the release with no failed request. JSON goes to bench/results/live_retake-<UTC>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from bench.shift import Output, kill_leftovers, stop_up
from flexpipe.cli.run_dir import find_admin_token
from flexpipe.control.api.client import ControllerClient, ControllerError
from flexpipe.examples import DEFAULT_CLUSTER, DEFAULT_MODELS, DEFAULT_SHIFT
from flexpipe.launch import free_port
from flexpipe.policies.shift import ShiftParams
from flexpipe.replay import INTERRUPTED
from flexpipe.store import Store
from flexpipe.store.shift_entry import ShiftEntry
from flexpipe.store.shift_log import ShiftLog

ROOT = Path(__file__).resolve().parent.parent
GPU = "gpu1"
# the sections of the shift profile whose durations the live policy keeps on the
# controller's (wall) clock: the triggers' windows, cooldowns, leads and backlog drain, the
# forecast's horizon and spans; scaled by the time scale so that they mean the same
# modelled time
WALL_SECTIONS = ("triggers", "forecast")
# durations of those sections the policy reads in MODELLED seconds: fast up divides the queue
# by `backlog_drain_s` into a rate added to the arrivals (per modelled second), and falls
# back to the TTFT SLO (policies/shift/policy.py)
MODELLED = frozenset({"backlog_drain_s"})


def wall_durations(section: str) -> dict[str, float]:
    """The wall-clock duration fields of `section` of the shift parameters (named `_s`; not
    the rates, `_per_s`, nor the `MODELLED` ones) and their code defaults (ShiftParams())."""
    params = getattr(ShiftParams(), section)
    return {
        f.name: float(getattr(params, f.name))
        for f in dataclasses.fields(params)
        if f.name.endswith("_s") and not f.name.endswith("_per_s") and f.name not in MODELLED
    }


def shift_doc(profile: str, time_scale: float) -> dict[str, Any]:
    """`defaults` (the policy's code defaults) or `live` (examples/shift/live.yaml), with every
    wall-clock duration (`wall_durations` of `WALL_SECTIONS`) scaled."""
    doc: dict[str, Any] = {"shift": {}}
    if profile == "live":
        doc = yaml.safe_load(DEFAULT_SHIFT.read_text())
    for section in WALL_SECTIONS:
        values = doc["shift"].setdefault(section, {})
        for key, default_s in wall_durations(section).items():
            values[key] = round(float(values.get(key, default_s)) * time_scale, 3)
    return doc


def write_trace(path: Path, rate_per_s: float, duration_s: float, a: argparse.Namespace) -> None:
    """An even stream of `rate_per_s` for `duration_s` (Mooncake JSONL, timestamps in ms)."""
    num = round(rate_per_s * duration_s)
    rows = [
        {"timestamp": round(i / rate_per_s * 1000), "input_length": a.prompt_tokens,
         "output_length": a.output_tokens}
        for i in range(num)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def replay(trace: Path, model: str, port: int, out: Path, a: argparse.Namespace) -> Any:
    argv = [
        sys.executable, "-m", "flexpipe", "replay", str(trace), "--kind", "mooncake",
        "--url", f"http://127.0.0.1:{port}/v1", "--model", model,
        "--speed-up", f"{1 / a.time_scale:g}", "--json", "--quiet", "--timeout-s", "300",
    ]  # fmt: skip
    with out.open("w") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def serving_gpus(client: ControllerClient) -> set[str] | None:
    try:
        doc = client.status()
    except ControllerError:
        return None
    return {g for i in doc.get("instances", []) for g in i.get("gpus", ())}


def retake_times(entries: list[ShiftEntry], time_scale: float) -> dict[str, Any]:
    """Release of GPU (the first finished shift whose target leaves it out, after a plan that
    had it) to the decision and the end of the first later shift whose target has it back,
    in modelled seconds."""
    shifts = [e for e in entries if e.kind in ("plan", "shift") and e.outcome == "succeeded"]
    release = next(
        (e for e in shifts if e.target is not None and GPU in {g for c in e.current
                                                               for g in c.gpu_ids}
         and GPU not in {g for t in e.target for g in t.gpu_ids}),
        None,
    )  # fmt: skip
    if release is None or release.finished_at is None:
        return {}
    out: dict[str, Any] = {"release": f"{release.trigger}: {release.reason}"}
    back = next(
        (e for e in shifts if e.at > release.finished_at and e.target is not None
         and GPU in {g for t in e.target for g in t.gpu_ids}),
        None,
    )  # fmt: skip
    if back is None:
        return out
    out["retake"] = f"{back.trigger}: {back.reason}"
    out["release_to_decision_s"] = (back.at - release.finished_at).total_seconds() / time_scale
    if back.finished_at is not None:
        serving_s = (back.finished_at - release.finished_at).total_seconds() / time_scale
        out["release_to_serving_s"] = serving_s
    between = [e for e in entries if release.finished_at < e.at <= back.at and e.kind == "hold"]
    out["holds_between"] = len(between)
    return out


def run(profile: str, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port, controller_port = free_port(), free_port()
    controller_url = f"http://127.0.0.1:{controller_port}"
    cluster = tmp / "cluster.yaml"
    cluster.write_text(DEFAULT_CLUSTER.read_text())
    shift = tmp / "shift.yaml"
    shift.write_text(yaml.safe_dump(shift_doc(profile, a.time_scale), sort_keys=False))
    low, high = tmp / "low.jsonl", tmp / "high.jsonl"
    write_trace(low, a.low_rate_per_s, a.low_s, a)
    write_trace(high, a.high_rate_per_s, a.high_s, a)
    store_url = f"sqlite:///{tmp / 'fp.db'}"
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--port", str(port),
        "--controller-port", str(controller_port), "--time-scale", str(a.time_scale),
        "--tick-s", f"{a.tick_s * a.time_scale:.3f}", "--cluster", str(cluster),
        "--models", str(DEFAULT_MODELS), "--store", store_url, "--shift-config", str(shift),
        "--drain-timeout-s", f"{30 * a.time_scale:.3f}",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    notes: list[str] = []
    result: dict[str, Any] = {"profile": profile, "notes": notes}
    up = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, cwd=ROOT,
    )  # fmt: skip
    out = Output(up)
    replays: list[tuple[str, Any, Path]] = []
    try:
        if out.wait_for(["instance(s) serving"], 180) is None:
            notes.append("`up` never reported its instances serving")
            return result
        client = ControllerClient(controller_url, find_admin_token(controller_url))
        replays.append(
            ("low", replay(low, "llama-7b", port, tmp / "low.json", a), tmp / "low.json")
        )
        deadline = time.monotonic() + a.low_s * a.time_scale + 60
        seen = False
        while time.monotonic() < deadline:
            gpus = serving_gpus(client)
            seen = seen or (gpus is not None and GPU in gpus)
            if seen and gpus is not None and GPU not in gpus:
                break
            time.sleep(0.2)
        else:
            notes.append(f"{GPU} was never released")
            result["log"] = [
                f"{e.kind} {e.trigger} {e.outcome}: {e.reason}"[:200]
                for e in ShiftLog(Store(store_url)).entries()
            ]
            return result
        high_json = tmp / "high.json"
        replays.append(("high", replay(high, "llama-7b", port, high_json, a), high_json))
        for name, proc, path in reversed(replays):  # the high load first
            if name == "low" and proc.poll() is None:
                # the measurement is over with the high load: the light one stops there (its
                # requests in flight fail as interrupted: `replay`'s clean Ctrl-C, not counted)
                proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=a.max_wall_s)
            if proc.returncode not in (0, 130 if name == "low" else 0):
                notes.append(f"{name} replay exited {proc.returncode}: {err.strip()[-300:]}")
            if path.stat().st_size:
                records = json.loads(path.read_text())["requests"]
                result[name] = {
                    "num_requests": len(records),
                    "num_failed": sum(
                        1 for r in records if r["failed"] and r["failed"] != INTERRUPTED
                    ),
                }
        log = ShiftLog(Store(store_url))
        entries = log.entries()
        result.update(retake_times(entries, a.time_scale))
        result["shifts"] = [line for _, line in out.lines if "controller: shift (" in line]
        return result
    finally:
        for _, proc, _ in replays:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        result["up_exit_code"] = stop_up(up, notes)
        kill_leftovers(tmp, port, notes)
        if up.returncode not in (0, None) or notes:
            result["up_tail"] = out.tail(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench live_retake")
    p.add_argument("--only", choices=("defaults", "live"), default=None)
    p.add_argument("--time-scale", type=float, default=0.25, help="wall s per modelled s")
    p.add_argument("--tick-s", type=float, default=10.0, help="`up`'s default tick")
    p.add_argument("--low-rate-per-s", type=float, default=1.0)
    p.add_argument("--low-s", type=float, default=400.0, help="the light load's length")
    p.add_argument("--high-rate-per-s", type=float, default=3.0)
    p.add_argument("--high-s", type=float, default=300.0)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--max-ticks", type=int, default=3)
    p.add_argument("--max-wall-s", type=float, default=600.0)
    a = p.parse_args(argv)
    profiles = [a.only] if a.only else ["defaults", "live"]
    results = []
    for profile in profiles:
        with tempfile.TemporaryDirectory(prefix=f"flexpipe-live-retake-{profile}-") as d:
            results.append(run(profile, a, Path(d)))
    ok = True
    for r in results:
        decided, serving = r.get("release_to_decision_s"), r.get("release_to_serving_s")
        failed = sum(r.get(k, {}).get("num_failed", 0) for k in ("low", "high"))
        words = "not taken back" if decided is None else f"decided {decided:.0f} s"
        words += "" if serving is None else f", serving {serving:.0f} s"
        print(f"{r['profile']:9} release -> retake of {GPU}: {words}; {failed} failed requests")
        for note in r["notes"]:
            print("  note:", note)
        if r["profile"] == "live":
            ok = decided is not None and decided <= a.max_ticks * a.tick_s and failed == 0
    path = ROOT / "bench" / "results"
    path.mkdir(exist_ok=True)
    out = path / f"live_retake-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps({"args": vars(a), "runs": results}, indent=1, default=str))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
