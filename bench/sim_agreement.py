"""The simulator against the live system on the same requests (docs/simulator.md, "Trust").

Two sim engines (llama-2-7b, one L4 each: modelled decode steps of ~60 ms, prefills of
~60-200 ms) behind the gateway. The simulator runs the scenario (`scenario`); the same
requests (arrival times, prompt and output lengths) are then replayed live: two real
`python -m flexpipe.engine.sim` processes (`--cluster FILE --gpu-ids g0|g1`, the flags
`flexpipe up` gives them, cold start skipped) behind a real `python -m flexpipe gateway`
process, over HTTP on 127.0.0.1, with the official `openai` client streaming
`/v1/completions`; the gateway runs one worker, as the simulator routes. Each prompt is
`num_prompt_tokens - 1` words of 3 letters (the engine's tokenizer: one token a word, plus
BOS; the gateway's estimate: 4 bytes a token, as the simulator's prompts), the first unique
per request (no prefix-cache hits, as in the simulation). Live times are the client's (send,
first and last streamed token), divided by the engines' time scale.

Compared: output tokens/s (first arrival to last finish) and TTFT / TPOT p50 and p90.

    python -m bench sim_agreement [-- --duration-s 60 --rate 2 --time-scale 1 --seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import openai
import yaml

from flexpipe.engine.testing import ROOT, free_port, request, sim_engine
from flexpipe.gateway.core.pool import stream_tpot_s
from flexpipe.gears.gear import Gear
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.policy import PolicyView
from flexpipe.sim.report import percentile
from flexpipe.sim.request import SimRequest
from flexpipe.sim.scenario import Scenario, parse_scenario
from flexpipe.sim.simulator import SimResult, simulate

MODEL = "m"
MODEL_ID = "llama-2-7b"
MAX_NUM_SEQS = 16
CLUSTER = {"name": "two-l4", "nodes": [{"name": "n0", "gpus": [
    {"id": "g0", "type": "L4"}, {"id": "g1", "type": "L4"}]}]}  # fmt: skip
DEPLOYMENTS = tuple(
    Deployment(f"e{i}", MODEL, MODEL_ID, Gear(max_num_seqs=MAX_NUM_SEQS), ((f"g{i}",),))
    for i in range(2)
)
ADMIN_TOKEN = "sim-agreement"
START_S = 60.0  # after the simulated cold start (~27 s on an L4); live engines skip it
# Routing by turns, in both: least-load choices hinge on measured speeds and 1 s scrapes, so
# a few ms of difference re-routes a request and the two runs stop being comparable request
# by request (with prefix_affinity 25 of 45 requests went to the same engine in both)
ROUTING = "round_robin"
METRICS = ("throughput", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")


@dataclass
class Fixed:
    """A policy that runs `deps` from t = 0 and never changes them."""

    deps: tuple[Deployment, ...] = DEPLOYMENTS
    name: str = "fixed"
    routing: str | None = None
    interval_s: float | None = None

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None:
        return None if view.running else self.deps


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as a client saw it (seconds from the first arrival, modelled)."""

    request_id: int
    sent_s: float
    first_token_s: float
    last_token_s: float
    num_tokens: int
    instance: str  # the engine that served it (deployment name)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float:
        return stream_tpot_s(self.num_tokens, self.first_token_s, self.last_token_s) or 0.0


def scenario(duration_s: float, rate_per_s: float, seed: int) -> Scenario:
    doc = {
        "name": "agreement", "duration_s": START_S + duration_s, "seed": seed,
        "gateway": {"routing": {"policy": ROUTING}},
        "cluster": {"inline": CLUSTER},
        "models": [{"name": MODEL, "model": MODEL_ID,
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 200}}],
        "workloads": [{"model": MODEL,
                       "arrivals": {"process": "poisson", "rate_per_s": rate_per_s,
                                    "start_s": START_S},
                       "prompt_tokens": {"dist": "uniform", "min": 64, "max": 1500},
                       "output_tokens": {"dist": "uniform", "min": 16, "max": 64}}],
    }  # fmt: skip
    return parse_scenario(doc, Path("."))


def simulated(sc: Scenario) -> tuple[SimResult, list[Outcome]]:
    result = simulate(sc, Fixed())
    t0 = result.requests[0].arrival_s
    out = [
        Outcome(
            r.request_id,
            r.arrival_s - t0,
            r.first_token_s - t0,
            r.last_token_s - t0,
            r.num_generated_tokens,
            r.instance,
        )
        for r in result.requests
        if r.completed
    ]
    return result, out


def prompt_text(req: SimRequest) -> str:
    """`num_prompt_tokens - 1` three-letter words (BOS makes the last token), 4 bytes each;
    the first word is the request's own, so no two prompts share a KV block."""
    rng = random.Random(req.request_id)
    letters = "abcdefghijklmnopqrstuvwxyz"
    first = "q" + letters[req.request_id // 26 % 26] + letters[req.request_id % 26]
    words = [first] + ["".join(rng.choices(letters, k=3)) for _ in range(req.num_prompt_tokens - 2)]
    return " ".join(words)


async def _one(
    client: openai.AsyncOpenAI,
    req: SimRequest,
    t0: float,
    offset_s: float,
    scale: float,
    names: dict[str, str],
) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + offset_s * scale - time.monotonic()))
    sent = time.monotonic()
    first = last = -1.0
    num_tokens = 0
    stream = await client.completions.create(
        model=MODEL, prompt=prompt_text(req), max_tokens=req.num_output_tokens, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    served = names.get(stream.response.headers.get("x-flexpipe-instance", ""), "?")
    async for chunk in stream:
        now = time.monotonic()
        if chunk.choices and chunk.choices[0].text:
            if first < 0:
                first = now
            last = now
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    return Outcome(req.request_id, (sent - t0) / scale, (first - t0) / scale,
                   (last - t0) / scale, num_tokens, served)  # fmt: skip


async def _replay(
    url: str, reqs: Sequence[SimRequest], scale: float, names: dict[str, str]
) -> list[Outcome]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        base = reqs[0].arrival_s
        t0 = time.monotonic() + 0.5
        tasks = [_one(client, r, t0, r.arrival_s - base, scale, names) for r in reqs]
        return list(await asyncio.gather(*tasks))
    finally:
        await client.close()


def _scraped(url: str, num_instances: int) -> bool:
    """Healthy, and every engine's capacity scraped (the simulator's pool starts so too: with
    capacities still unequal, round_robin's credits would start out of step)."""
    if request("GET", url + "/health", timeout_s=1).status != 200:
        return False
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    res = request("GET", url + "/admin/instances", headers=auth, timeout_s=1)
    found = res.json()["instances"] if res.status == 200 else []
    return len(found) == num_instances and all(i["max_num_seqs"] > 0 for i in found)


@contextlib.contextmanager
def _gateway(backends: Sequence[str]) -> Iterator[str]:
    port = free_port()
    # one worker: the simulator routes as one gateway process does (with --workers N each
    # worker keeps its own round_robin credits, and the kernel deals connections between them)
    cmd = [sys.executable, "-m", "flexpipe", "gateway", "--port", str(port), "--model", MODEL,
           "--policy", ROUTING, "--workers", "1"]  # fmt: skip
    for b in backends:
        cmd += ["--backend", b]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEXPIPE_ADMIN_TOKEN": ADMIN_TOKEN}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"gateway exited: {log.read().decode()[-2000:]}")
                with contextlib.suppress(OSError):
                    if _scraped(url, len(backends)):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("gateway not healthy within 60 s")
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def live(sc: Scenario, reqs: Sequence[SimRequest], time_scale: float) -> list[Outcome]:
    """Replay `reqs` through a real gateway and two real sim engines (see the docstring)."""
    with tempfile.TemporaryDirectory(prefix="sim-agreement-") as tmp:
        cluster_file = Path(tmp) / "cluster.yaml"
        cluster_file.write_text(yaml.safe_dump(CLUSTER))
        with contextlib.ExitStack() as stack:
            urls = []
            for dep in DEPLOYMENTS:
                args = [
                    "--model", MODEL_ID, "--served-model-name", MODEL,
                    "--cluster", str(cluster_file), "--gpu-ids", dep.stages[0][0],
                    "--max-num-seqs", str(dep.gear.max_num_seqs),
                    "--time-scale", str(time_scale), "--load-time-s", "0",
                ]  # fmt: skip
                urls.append(stack.enter_context(sim_engine(args, timeout_s=60)).url)
            for u in urls:  # the first request of a fresh process pays its imports: not here
                body = {"model": MODEL, "prompt": "warm up", "max_tokens": 2}
                assert request("POST", u + "/v1/completions", body, timeout_s=30).status == 200
            gw = stack.enter_context(_gateway(urls))
            body = {"model": MODEL, "prompt": "warm up", "max_tokens": 2}
            for _ in urls:  # the gateway's first requests (one a turn: back to the first)
                assert request("POST", gw + "/v1/completions", body, timeout_s=30).status == 200
            # round_robin rotates in name order (sim://e0, sim://e1 in the simulator): the
            # engine whose URL sorts first plays e0 (both are the same L4 and gear)
            names = {u: d.name for u, d in zip(sorted(urls), DEPLOYMENTS, strict=True)}
            return asyncio.run(_replay(gw, reqs, time_scale, names))


def summary(outs: Sequence[Outcome]) -> dict[str, float]:
    span = max(o.last_token_s for o in outs) - min(o.sent_s for o in outs)
    ttft = [o.ttft_s for o in outs]
    tpot = [o.tpot_s for o in outs if o.num_tokens > 1]
    return {
        "throughput": sum(o.num_tokens for o in outs) / span,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p90": percentile(tpot, 90),
    }


def compare(
    duration_s: float, rate_per_s: float, seed: int, time_scale: float
) -> tuple[dict[str, float], dict[str, float], int, int, int]:
    """(simulated summary, live summary, requests, completed live, served by the same engine
    in both)."""
    sc = scenario(duration_s, rate_per_s, seed)
    result, sim = simulated(sc)
    assert len(sim) == len(result.requests), "the simulation failed requests"
    outs = live(sc, result.requests, time_scale)
    done = [o for o in outs if o.num_tokens > 0]
    served = {o.request_id: o.instance for o in outs}
    same = sum(1 for o in sim if served[o.request_id] == o.instance)
    return summary(sim), summary(done), len(result.requests), len(done), same


def deviation(sim: float, live: float) -> float:
    return (sim - live) / live if live else float("inf")


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="python -m bench sim_agreement")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=3.0, help="requests/s (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0)
    args = p.parse_args(list(argv))
    sim, real, n, done, same = compare(args.duration_s, args.rate, args.seed, args.time_scale)
    print(f"{n} requests, {done} completed live, {same} served by the same engine in both; "
          f"time scale {args.time_scale:g}")  # fmt: skip
    print(f"{'metric':<12} {'simulated':>10} {'live':>10} {'sim vs live':>12}")
    for k in METRICS:
        unit = 1.0 if k == "throughput" else 1e3
        print(f"{k:<12} {sim[k] * unit:10.1f} {real[k] * unit:10.1f} "
              f"{deviation(sim[k], real[k]):+11.1%}")  # fmt: skip
    return 0


__all__ = ["compare", "deviation", "main", "summary"]
