"""Fingerprints of simulator runs: did a change (a speed-up, a refactor) keep every outcome?

    python -m bench sim_fingerprint                          # the six default runs
    git archive main | tar -x -C /tmp/base                   # before/after, side by side:
    python -m bench sim_fingerprint -- --baseline /tmp/base
    python -m bench sim_fingerprint -- --runs speed:300,seed-fragmented:0

A fingerprint is the sha256 of every request's outcome (instance, first and last token and
finish times, tokens generated and cached, preemptions, failure) plus the run's events and
engine steps. `speed:D` is `bench.sim_speed`'s scenario (256 GPUs, 100 req/s) for D seconds;
any other name is a built-in scenario (`flexpipe sim list`), D its duration (0: its own).
Each run is a fresh process importing the checkout's flexpipe; with `--baseline`, the exit
status is 1 when any fingerprint differs. The scenario files are the input, read from this
checkout for both sides: a scenario renamed since the baseline (`bursty-serverless-small`,
the first `bursty-serverless`) still runs the same file on both.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from bench._checkout import run_child

DEFAULT_RUNS = ("speed:300,seed-fragmented:0,mooncake-prefix:300,multi-model-diurnal:1800,"
                "bursty-serverless-small:600,azure-conversation:600")  # fmt: skip

_CHILD = """
import dataclasses, hashlib, json, sys, time
from pathlib import Path
from bench.sim_speed import scenario_doc
from flexpipe.sim.scenario import load_scenario, parse_scenario
from flexpipe.sim.simulator import simulate
name, duration_s, scenarios = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
if name == "speed":
    sc = parse_scenario(scenario_doc(256, duration_s, 100.0), Path("."))
else:
    sc = load_scenario(scenarios / f"{name}.yaml")
    if duration_s:
        sc = dataclasses.replace(sc, duration_s=duration_s)
t0 = time.process_time()
res = simulate(sc)
cpu_s = time.process_time() - t0
h = hashlib.sha256()
for r in res.requests:
    h.update(repr((r.request_id, r.instance, r.first_token_s, r.last_token_s, r.finish_s,
                   r.num_generated_tokens, r.num_cached_tokens, r.num_preemptions,
                   r.failed)).encode())
steps = sum(i.instance.num_steps for i in res.instances if i.instance)
h.update(repr((res.num_events, steps)).encode())
print(json.dumps({"fingerprint": h.hexdigest()[:16], "requests": len(res.requests),
                  "events": res.num_events, "cpu_s": cpu_s}))
"""


SCENARIOS = Path(__file__).resolve().parents[1] / "flexpipe" / "sim" / "scenarios"


def fingerprint(checkout: Path, name: str, duration_s: float) -> dict[str, object]:
    """One run in a fresh process importing `checkout`'s flexpipe, on this checkout's
    scenario file."""
    return run_child(checkout, _CHILD, name, str(duration_s), str(SCENARIOS))


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="python -m bench sim_fingerprint")
    p.add_argument("--runs", default=DEFAULT_RUNS, help="NAME:DURATION_S, comma-separated")
    p.add_argument("--baseline", default=None, help="another checkout to compare with")
    args = p.parse_args(list(argv))
    here = Path(__file__).resolve().parents[1]
    base = Path(args.baseline).resolve() if args.baseline else None
    print(f"{'run':28s} {'requests':>8s} {'events':>8s}  {'fingerprint':16s}  {'CPU s':>6s}"
          + ("  baseline          same" if base else ""))  # fmt: skip
    num_differ = 0
    for item in args.runs.split(","):
        name, _, dur = item.partition(":")
        r = fingerprint(here, name, float(dur or 0))
        line = (f"{item:28s} {r['requests']:>8} {r['events']:>8}  {r['fingerprint']}  "
                f"{r['cpu_s']:6.1f}")  # fmt: skip
        if base is not None:
            b = fingerprint(base, name, float(dur or 0))
            same = b["fingerprint"] == r["fingerprint"]
            num_differ += not same
            line += f"  {b['fingerprint']}  {'yes' if same else 'NO'}"
        print(line, flush=True)
    return 1 if num_differ else 0
