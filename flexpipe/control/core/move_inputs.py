"""What a move is planned on, from the gateway's request records (pure).

The executor reads `GET /admin/instances/requests` for each instance a shift drains or moves
requests to; the simulator builds the same records from its own requests. Both turn them into
`plan_moves`' inputs here, so that live and simulated moves are planned on the same numbers.
A record: {"id", "num_prompt_tokens", "num_output_tokens", "max_tokens"}.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flexpipe.cluster import Cluster
from flexpipe.model_spec import ModelSpec
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.migration import Destination, link_between, perf_model_of

__all__ = [
    "context_tokens",
    "decode_interval_s",
    "destination_of",
    "tokens_left",
    "warm_timeout_s",
]

Record = Mapping[str, Any]


def context_tokens(req: Record) -> int:
    """A request's context: prompt + tokens sent so far."""
    return int(req["num_prompt_tokens"]) + int(req["num_output_tokens"])


def tokens_left(req: Record) -> int:
    return max(0, int(req.get("max_tokens") or 0) - int(req["num_output_tokens"]))


def decode_interval_s(
    cluster: Cluster,
    instance: PlannedInstance,
    reqs: Sequence[Record],
    spec: ModelSpec | None = None,
) -> float:
    """Modelled time between two tokens of a request on `instance` at its current batch and
    mean context (the performance model's; `spec`: its model's, see `perf_model_of`)."""
    batch = max(1, len(reqs))
    context = sum(context_tokens(r) for r in reqs) // batch if reqs else 1
    return perf_model_of(cluster, instance, spec=spec).decode_interval_s(batch, max(1, context))


def destination_of(
    cluster: Cluster,
    sources: Sequence[tuple[str, PlannedInstance]],
    name: str,
    target: PlannedInstance,
    reqs: Sequence[Record],
    spec: ModelSpec | None = None,
    kv_moves: bool = True,
) -> Destination:
    """`target` (called `name`) as a move destination, from the requests it serves: its
    slots, the time left of each, the prompts it admitted and has not prefilled yet (the rest
    waits behind them), the link from each source (url, planned) and its batch (what a warmed
    recompute's cut-over waits for a step of). Without `kv_moves` (engines that cannot hand
    KV over) there is no link to move KV on: `plan_moves` offers only recomputes."""
    interval_s = decode_interval_s(cluster, target, reqs, spec)
    slots = target.gear.max_num_seqs
    decoding = sum(1 for r in reqs if int(r["num_output_tokens"]) > 0)
    fresh = [int(r["num_prompt_tokens"]) for r in reqs if int(r["num_output_tokens"]) == 0]
    return Destination(
        name,
        perf_model_of(cluster, target, spec=spec),
        {url: link_between(cluster, p, target) if kv_moves else None for url, p in sources},
        slots,
        tuple(tokens_left(r) * interval_s for r in reqs),
        sum(fresh[: max(0, slots - decoding)]),
        len(reqs),  # its batch as `decode_interval_s` counts it
        sum(context_tokens(r) for r in reqs),
    )


def warm_timeout_s(done_s: float, time_scale: float, warm: bool) -> float:
    """How long the gateway may pre-copy a recompute move (`relay.warm_up`) before cutting it
    over anyway, in wall seconds: twice the move's planned time to run on its destination
    (`MigrationChoice.done_s`, modelled seconds, scaled), at least 0.2 s; 0 (no warm-up)
    when moves are not warmed. The executor sends it with each recompute; the simulator
    bounds its warm-ups by it (time scale 1)."""
    return max(0.2, 2 * done_s * time_scale) if warm else 0.0
