"""What each kind of engine can do, declared once (docs/engines.md).

flexpipe runs three kinds of engine: its own sim engine, vLLM and SGLang. They differ in what
the controller and the gateway may ask of them: exporting a request's KV cache to another
instance (only the sim engine has `/admin/export` and `/admin/import`), sleeping and waking
(vLLM's levels 1 and 2), prefix caching, pipelines across nodes, and the names of their
Prometheus metrics. Whoever needs one of these facts reads it here; nothing else spells them.

Pure: plain data and functions of it (the shift pricing and the simulator read it too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "ENGINE_KINDS",
    "SIGNALS",
    "EngineKind",
    "engine_kind",
    "kv_move_possible",
]

# The gateway's per-instance signals (flexpipe/gateway/prober.py's fields) an engine's metrics
# feed: running and waiting requests, the KV cache's used fraction, its size in tokens, tokens
# generated, prefix-cache queries and hits (the last two in tokens).
SIGNALS = (
    "num_running",
    "num_waiting",
    "kv_usage",
    "num_kv_tokens",
    "num_generated_tokens",
    "num_prefix_queries",
    "num_prefix_hits",
)


# vLLM's metric names; the sim engine exports the same (docs/sim-engine.md)
_VLLM_METRICS: Mapping[str, str] = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:generation_tokens_total": "num_generated_tokens",
    "vllm:prefix_cache_queries_total": "num_prefix_queries",
    "vllm:prefix_cache_hits_total": "num_prefix_hits",
}


@dataclass(frozen=True, slots=True)
class EngineKind:
    """One kind of engine and what it supports."""

    name: str
    kv_export_import: bool  # POST /admin/export and /admin/import: a request moves with its KV
    sleep_levels: tuple[int, ...]  # levels of POST /sleep?level=N (empty: cannot sleep)
    prefix_caching: bool  # reuses the KV of a shared prompt prefix
    prefix_caching_default: bool  # on unless turned off
    pp_across_nodes: (
        bool  # one instance's pipeline stages on different nodes (flexpipe's launchers)
    )
    # starts on a GPU another engine holds awake: the sim engine accounts memory per process;
    # vLLM and SGLang check at start-up that the GPU's free memory covers their share, so a
    # standby beside an awake engine loads only while that engine sleeps (time-sharing,
    # docs/shift-policy.md)
    loads_beside_awake: bool
    # Prometheus metric name (as exposed, counters with _total) -> gateway signal (SIGNALS)
    metrics: Mapping[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    models_path: str = "/v1/models"
    metrics_path: str = "/metrics"


ENGINE_KINDS: Mapping[str, EngineKind] = {
    k.name: k
    for k in (
        EngineKind(
            name="sim",
            kv_export_import=True,
            sleep_levels=(1, 2),  # as vLLM's, with --enable-sleep-mode (docs/sim-engine.md)
            prefix_caching=True,
            prefix_caching_default=True,
            pp_across_nodes=True,  # a sim engine stands for any placement (Ray: one process)
            loads_beside_awake=True,
            metrics=_VLLM_METRICS,
        ),
        EngineKind(
            name="vllm",
            kv_export_import=False,
            sleep_levels=(1, 2),  # 1: weights to CPU, KV dropped; 2: weights dropped too
            prefix_caching=True,
            prefix_caching_default=True,
            pp_across_nodes=True,  # --distributed-executor-backend ray
            loads_beside_awake=False,  # its --gpu-memory-utilization share must be free
            metrics=_VLLM_METRICS,
        ),
        EngineKind(
            name="sglang",
            kv_export_import=False,
            # (SGLang's /release_memory_occupation is not vLLM's sleep API; not used yet)
            sleep_levels=(),
            prefix_caching=True,  # the radix cache
            prefix_caching_default=True,
            # multi-node SGLang is one process per node (--nnodes, --node-rank), which
            # flexpipe's launchers do not start
            pp_across_nodes=False,
            loads_beside_awake=False,  # its --mem-fraction-static share must be free
            metrics={
                "sglang:num_running_reqs": "num_running",
                "sglang:num_queue_reqs": "num_waiting",
                "sglang:token_usage": "kv_usage",
                "sglang:max_total_num_tokens": "num_kv_tokens",
                "sglang:generation_tokens_total": "num_generated_tokens",
                "sglang:prompt_tokens_total": "num_prefix_queries",
                "sglang:cached_tokens_total": "num_prefix_hits",
            },
        ),
    )
}


def engine_kind(name: str) -> EngineKind:
    """The declaration of engine kind `name`; ValueError naming the known ones."""
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; use one of {', '.join(ENGINE_KINDS)}") from None


def kv_move_possible(src_kind: str, dst_kind: str) -> bool:
    """Whether a request can move from an engine of `src_kind` to one of `dst_kind` with its
    KV cache (export on one end, import on the other); otherwise it moves by recompute."""
    return engine_kind(src_kind).kv_export_import and engine_kind(dst_kind).kv_export_import
