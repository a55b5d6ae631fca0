"""Why a model asked for never had an instance in a run: a note for the report, and the
reason in each of its requests that failed for it (the gateway's 404 could only say "not
yet")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from flexpipe.policies.planner import ModelDemand, Plan
from flexpipe.sim.request import SimRequest

__all__ = ["explain_unplaced"]


def explain_unplaced(
    policy: str,
    demands: Sequence[ModelDemand],
    placed: Iterable[str],
    requests: Sequence[SimRequest],
    peak: Plan,
) -> list[str]:
    """The notes for the models of `demands` with requests and none of `placed` (the models
    that had an instance); their requests that failed with a 404 say why."""
    placed = set(placed)
    notes: list[str] = []
    for demand in demands:
        asked = [r for r in requests if r.model == demand.name]
        if demand.name in placed or not asked:
            continue
        notes.append(_unplaced_note(policy, demand, peak))
        for r in asked:
            if r.failed.startswith("404"):
                r.failed = (
                    f"404: no instance of model {demand.name!r} was ever placed (the notes say why)"
                )
    return notes


def _unplaced_note(policy: str, demand: ModelDemand, peak: Plan) -> str:
    """Why a model never had an instance: its shape and SLOs, and what the planner said of
    the GPUs it left unused on this cluster."""
    slo = demand.slo
    why = (
        f"{demand.name} ({demand.model}): policy {policy} never placed an instance of it; "
        f"it asks {demand.input_tokens} tokens in / {demand.output_tokens} out at "
        f"{demand.request_rate_per_s:.3g} req/s within TTFT p99 {slo.ttft_p99_s * 1e3:.0f} ms "
        f"and TPOT p99 {slo.tpot_p99_s * 1e3:.0f} ms"
    )
    mine = [i for i in peak.instances if i.model == demand.name]
    if mine:
        return f"{why}; the planner would place {len(mine)} at the peak rate"
    reasons = sorted({f"{u.gpu_id}: {u.reason}" for u in peak.unused})
    return f"{why}; the planner, for this cluster: " + ("; ".join(reasons) or "no GPU is free")
