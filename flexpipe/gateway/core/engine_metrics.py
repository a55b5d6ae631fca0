"""An engine's /metrics into the gateway's routing record (pure): the live prober scrapes
over HTTP and the simulator's gateway reads its sim engines, and both hand the numbers to
`apply_engine_metrics` (the metric names each engine kind declares; the sim engine's exact
token count and max_num_seqs; the KV cache's size from vllm:cache_config_info or SGLang's
max_total_num_tokens)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping

from flexpipe.engine_kinds import ENGINE_KINDS
from flexpipe.gateway.core.pool import Instance, Pool

__all__ = ["apply_engine_metrics", "parse_engine_metrics"]

# Metric name -> Instance field: each engine kind's declared names (flexpipe/engine_kinds.py:
# vLLM's, SGLang's) for the fields routing reads, older vLLM's spelling of the KV one, and the
# sim engine's exact token count and scheduler limit.
_ROUTING_FIELDS = ("num_running", "num_waiting", "kv_usage", "num_kv_tokens")
_METRICS = {
    name.encode(): signal
    for kind in ENGINE_KINDS.values()
    for name, signal in kind.metrics.items()
    if signal in _ROUTING_FIELDS
} | {
    b"vllm:gpu_cache_usage_perc": "kv_usage",
    b"flexpipe:num_tokens_queued_running": "num_tokens",
    b"flexpipe:max_num_seqs": "max_num_seqs",
}
_PREFIXES = tuple({name[: name.index(b":") + 1] for name in _METRICS})
_CACHE_INFO = b"vllm:cache_config_info"
_LABEL = re.compile(rb'(\w+)="([^"]*)"')


def parse_engine_metrics(text: bytes) -> dict[str, float]:
    """Sum the samples of the metrics routing needs over all their label sets; the KV cache's
    size in tokens (`num_kv_tokens`) from vllm:cache_config_info's labels."""
    out: dict[str, float] = {}
    for line in text.split(b"\n"):
        if not line.startswith(_PREFIXES):
            continue
        name_end = min(i for i in (line.find(b"{"), line.find(b" ")) if i >= 0)
        field = _METRICS.get(line[:name_end])
        if field is None:
            if line[:name_end] == _CACHE_INFO:
                labels = dict(_LABEL.findall(line))
                with contextlib.suppress(KeyError, ValueError):
                    blocks = int(labels[b"num_gpu_blocks"]) * int(labels[b"block_size"])
                    out["num_kv_tokens"] = out.get("num_kv_tokens", 0.0) + blocks
            continue
        try:
            value = float(line.rsplit(b" ", 1)[1])
        except (ValueError, IndexError):
            continue
        out[field] = out.get(field, 0.0) + value
    return out


def apply_engine_metrics(
    pool: Pool, inst: Instance, values: Mapping[str, float], mean_request_tokens: float, now: float
) -> None:
    """One scrape's engine counts (`parse_engine_metrics`' fields) into the routing record, and
    the capacity the engine reports into the pool. Pure: the simulator calls it too."""
    inst.num_running = int(values.get("num_running", 0))
    inst.num_waiting = int(values.get("num_waiting", 0))
    inst.kv_usage = values.get("kv_usage", 0.0)
    if "num_tokens" in values:
        inst.num_scraped_tokens = values["num_tokens"]
    else:  # vLLM: estimate from the request counts
        inst.num_scraped_tokens = (inst.num_running + inst.num_waiting) * mean_request_tokens
    inst.num_tokens_sent_since_scrape = 0.0
    inst.scraped_at_s = now
    pool.report_capacity(
        inst,
        int(values.get("max_num_seqs", 0)),
        int(values.get("num_kv_tokens", 0)),
        mean_request_tokens,
    )
