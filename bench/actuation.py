"""Fast actuation: a cold start against vLLM's sleep mode and a peer copy, modelled and live.

Modelled (the performance model, flexpipe/perf/actuation.py): for llama-2 7B, 13B and 70B on
L4, A100-80G-SXM and H100-80G-SXM (the smallest tensor-parallel size that fits), the seconds
of a cold start from the default storage (today's 2 GB/s + 20 s) and from the node's NVMe, a
level-1 sleep and wake-up (host RAM over PCIe), a level-2 wake-up from the NVMe, and a copy
from a peer GPU holding the same layers (NVLink where the GPU has it, else PCIe).

Live: for each model on each GPU, sim engines standing for that gear at a small time scale:
the cold start (weights from the NVMe: from the port opening to /health 200), each sleep and
wake-up over HTTP, and a level-2 wake of an engine whose weights come from a peer GPU (the
peer copy); each timed, divided by the time scale, against the modelled seconds.

    python -m bench actuation [--time-scale 0.5] [--repeats 3] [--no-live]
        [--live-models llama-2-7b --live-gpus A100-80G-SXM]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Sequence

from flexpipe.engine.testing import request, sim_engine
from flexpipe.hardware import gpu_spec
from flexpipe.perf import InfeasibleGear, PerfModel, perf_model_for
from flexpipe.perf.actuation import peer_link_for
from flexpipe.perf.weights import local_nvme, network_storage, peer_gpu

MODELS = ("llama-2-7b", "llama-2-13b", "llama-2-70b")
# per live operation, on top of 10%: HTTP and timers on a shared machine (wall s: divided by
# the time scale, as the measurement is)
ALLOWANCE_WALL_S = 0.02
GPUS = ("L4", "A100-80G-SXM", "H100-80G-SXM")


def _smallest_gear(model: str, gpu: str) -> PerfModel | None:
    """The smallest tensor-parallel size that fits, its ranks joined as a peer copy would be."""
    link = peer_link_for(gpu_spec(gpu)).name
    for tp in (1, 2, 4, 8):
        pm = perf_model_for(model, f"tp={tp}", gpu, link=link)
        if pm.feasible:
            return pm
    return None


def modelled_table() -> list[str]:
    head = (
        "| model | GPU | gear | GiB/GPU | cold start (2 GB/s) s | cold start (NVMe) s "
        "| L1 sleep s | L1 wake s | L2 wake (NVMe) s | L2 wake (25 GbE storage) s "
        "| peer copy s (link) |"
    )
    lines = [head, "|" + " --- |" * 11]
    for model in MODELS:
        for gpu in GPUS:
            pm = _smallest_gear(model, gpu)
            if pm is None:
                lines.append(f"| {model} | {gpu} | does not fit on 8 | " + "- | " * 8)
                continue
            link = peer_link_for(pm.placement.gpus[0].spec)
            peer = peer_gpu(link, pm.efficiency.p2p_bandwidth_efficiency)
            per_gpu_gib = max(g.weights_bytes for g in pm.memory.per_gpu) / 2**30
            cells = (
                f"{pm.cold_start_s():.1f}",
                f"{pm.cold_start_s(None, local_nvme()):.1f}",
                f"{pm.sleep_s(1):.2f}",
                f"{pm.wake_s(1):.2f}",
                f"{pm.wake_s(2, local_nvme()):.2f}",
                f"{pm.wake_s(2, network_storage()):.2f}",
                f"{pm.weights_load_s(peer):.3f} ({link.name})",
            )
            lines.append(
                f"| {model} | {gpu} | tp={pm.gear.tp} | {per_gpu_gib:.1f} | "
                + " | ".join(cells)
                + " |"
            )
    return lines


def _timed_post(url: str) -> float:
    t0 = time.monotonic()
    r = request("POST", url, raw=b"")
    if r.status != 200:
        raise RuntimeError(f"{url}: {r.status} {r.text}")
    return time.monotonic() - t0


def _until_healthy(url: str, timeout_s: float) -> float:
    """Wall seconds from now until `url`/health answers 200 (polled every 5 ms)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(OSError):
            if request("GET", url + "/health").status == 200:
                return time.monotonic() - t0
        time.sleep(0.005)
    raise RuntimeError(f"{url}: not healthy within {timeout_s:.0f} s")


def _engine_args(pm: PerfModel, time_scale: float, source: list[str]) -> list[str]:
    """A sim engine standing for `pm`'s gear on its GPU type, able to sleep."""
    gpu = pm.placement.gpus[0].spec
    return [
        pm.model.name, "--tensor-parallel-size", str(pm.gear.tp), "--gpu-type", gpu.name,
        "--link", peer_link_for(gpu).name, "--max-model-len", "512",
        "--time-scale", str(time_scale), "--enable-sleep-mode", *source,
    ]  # fmt: skip


def _live_row(pm: PerfModel, time_scale: float, repeats: int) -> dict[str, tuple[float, float]]:
    """Operation -> (modelled s, measured s: the median of `repeats`, divided by the time
    scale). Two engines: one reading its weights from the node's NVMe (its cold start, from
    the port opening to /health 200; the sleeps and wakes), one whose weights come from a peer
    GPU (a level-2 wake is then the peer copy)."""
    link = peer_link_for(pm.placement.gpus[0].spec)
    peer = peer_gpu(link, pm.efficiency.p2p_bandwidth_efficiency)
    assert peer.bandwidth_bytes_per_s is not None
    nvme = ["--weight-source", "local_nvme"]
    from_peer = ["--weight-source", "peer_gpu", "--weight-source-gb-per-s",
                 repr(peer.bandwidth_bytes_per_s / 1e9)]  # fmt: skip
    steps = (
        ("sleep level 1", "/sleep?level=1", pm.sleep_s(1)),
        ("wake from level 1", "/wake_up", pm.wake_s(1)),
        ("sleep level 2", "/sleep?level=2", pm.sleep_s(2)),
        ("wake from level 2 (NVMe)", "/wake_up", pm.wake_s(2, local_nvme())),
    )
    measured: dict[str, list[float]] = {name: [] for name, _, _ in steps}
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    cold_s = pm.cold_start_s(None, local_nvme())
    with sim_engine(_engine_args(pm, time_scale, nvme), env=env) as eng:
        cold = _until_healthy(eng.url, cold_s * time_scale + 60) / time_scale
        for _ in range(repeats):
            for name, path, _ in steps:
                measured[name].append(_timed_post(eng.url + path) / time_scale)
    peer_s = pm.wake_s(2, peer)
    copies = []
    with sim_engine(_engine_args(pm, time_scale, from_peer), env=env) as eng:
        _until_healthy(eng.url, pm.cold_start_s(None, peer) * time_scale + 60)
        for _ in range(repeats):
            _timed_post(eng.url + "/sleep?level=2")
            copies.append(_timed_post(eng.url + "/wake_up") / time_scale)
    out = {"cold start (NVMe)": (cold_s, cold)}
    out |= {name: (m, statistics.median(measured[name])) for name, _, m in steps}
    out[f"peer copy ({link.name})"] = (peer_s, statistics.median(copies))
    return out


def live_table(
    time_scale: float, repeats: int, models: Sequence[str], gpus: Sequence[str]
) -> tuple[list[str], float]:
    """(table lines, the worst error of measured / time scale against modelled, as a share
    of its allowance: 10% of the modelled seconds plus 20 ms of wall time for HTTP and timers
    on a shared machine) over each model on each GPU (its smallest tensor-parallel size that
    fits)."""
    lines = [
        f"| model | GPU | gear | operation (time scale {time_scale:g}) | modelled s "
        "| measured s (median / scale) | error |",
        "|" + " --- |" * 7,
    ]
    worst = 0.0
    for model in models:
        for gpu in gpus:
            pm = _smallest_gear(model, gpu)
            if pm is None:
                continue
            for name, (modelled, got) in _live_row(pm, time_scale, repeats).items():
                err = got - modelled
                allowed_s = 0.1 * modelled + ALLOWANCE_WALL_S / time_scale
                worst = max(worst, abs(err) / allowed_s)
                lines.append(
                    f"| {model} | {gpu} | tp={pm.gear.tp} | {name} | {modelled:.3f} "
                    f"| {got:.3f} | {err * 1e3:+.0f} ms |"
                )
    return lines, worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench actuation")
    p.add_argument("--time-scale", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-live", action="store_true")
    p.add_argument("--live-models", default=",".join(MODELS), help="comma-separated")
    p.add_argument("--live-gpus", default=",".join(GPUS), help="comma-separated")
    args = p.parse_args(argv or [])
    try:
        print("\n".join(modelled_table()))
    except InfeasibleGear as exc:
        print(f"actuation: {exc}")
        return 1
    if args.no_live:
        return 0
    lines, worst = live_table(
        args.time_scale, args.repeats, args.live_models.split(","), args.live_gpus.split(",")
    )
    print()
    print("\n".join(lines))
    # HTTP and timer overhead on a shared machine: a few ms on sub-second operations
    ok = worst <= 1.0
    verdict = "ok" if ok else "over"
    print(f"actuation: live worst error {worst:.0%} of its allowance (10% + 20 ms wall): {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
