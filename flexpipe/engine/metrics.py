"""The sim engine's Prometheus metrics, with vLLM V1's names, types and labels.

Every series carries `model_name` (the served model name) and `engine` ("0"), as vLLM V1
does. State (running/waiting counts, KV usage, prefix-cache and preemption counters) is read
from the scheduler at scrape time; request latencies are observed from the engine core's plans
and events (`observe_plan`, `observe_step`), whose timestamps are the clock the core is driven
on: the wall clock in a live engine (what a client sees, whatever the time scale).

vLLM names: vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc,
vllm:gpu_cache_usage_perc (the pre-V1 name, still read by many routers),
vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total, vllm:num_preemptions_total,
vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total
{finished_reason}, vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds,
vllm:request_prompt_tokens, vllm:request_generation_tokens, vllm:iteration_tokens_total,
vllm:cache_config_info (value 1; the config in labels).

flexpipe additions: flexpipe:num_tokens_queued_running (prompt + output tokens of every
waiting and running request: a load signal for least-load routing), flexpipe:max_num_seqs
(the scheduler's limit on running sequences: vLLM exports no scheduler config, so a router
learns a sim engine's capacity from this and vLLM's from registration or
vllm:cache_config_info's num_gpu_blocks x block_size), flexpipe:num_kv_blocks_free,
flexpipe:engine_lag_seconds (how far the engine loop runs behind modelled time),
with --enable-sleep-mode vLLM's vllm:engine_sleep_state{sleep_state} and flexpipe's
flexpipe:gpu_memory_bytes / flexpipe:host_memory_bytes (what the engine holds, asleep or not:
vLLM exports no memory gauge),
flexpipe:engine_steps_total, flexpipe:modelled_busy_seconds_total; and what the engine's own
timing costs at time scales > 0, for the faithfulness benchmark:
flexpipe:engine_wakeup_late_seconds (how late the loop woke up after each step's deadline:
timer resolution plus CPU contention),
flexpipe:engine_emit_seconds (the loop's own work after a step: bookkeeping and writing every
stream's chunk; flexpipe:engine_emit_cpu_seconds_total is its CPU time: the rest of the wall
time went waiting for a CPU), flexpipe:gc_pause_seconds (each garbage collection of the
engine process).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flexpipe.engine.core import StepEvents
from flexpipe.engine.request import EngineRequest
from flexpipe.engine.scheduler import Scheduler, StepPlan
from flexpipe.engine.sleep import SLEEP_STATES, SleepState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# the engine's own timing: 50 us to 100 ms
OVERHEAD_BUCKETS = (
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.05,
    0.1,
)

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def num_queued_tokens(scheduler: Scheduler) -> int:
    """flexpipe:num_tokens_queued_running: the tokens still to process of every waiting
    request (all of them) and running one (the rest of its prompt, or its next token)."""
    return sum(r.num_tokens for r in scheduler.waiting) + sum(
        r.num_tokens - r.num_computed_tokens + 1 for r in scheduler.running
    )


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return out
            out.append(float(value))
        exponent += 1


class _StateCollector(Collector):
    """Reads the scheduler's state at scrape time (no per-step bookkeeping)."""

    def __init__(self, engine: EngineMetrics) -> None:
        self.m = engine

    def collect(self) -> Iterator[Metric]:
        m = self.m
        s = m.scheduler
        names = ["model_name", "engine"]
        labels = [m.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(labels, value)
            return c

        usage = s.bm.usage
        st = s.bm.stats
        queued = num_queued_tokens(s)
        for name, doc, value in (
            ("vllm:num_requests_running", _DOC_RUNNING, s.num_running),
            ("vllm:num_requests_waiting", _DOC_WAITING, s.num_waiting),
            ("vllm:kv_cache_usage_perc", _DOC_USAGE, usage),
            ("vllm:gpu_cache_usage_perc", _DOC_USAGE, usage),
            ("flexpipe:num_tokens_queued_running", _DOC_QUEUED, queued),
            ("flexpipe:num_kv_blocks_free", _DOC_FREE, s.bm.num_free_blocks),
            ("flexpipe:max_num_seqs", _DOC_MAX_SEQS, s.config.max_num_seqs),
            ("flexpipe:engine_lag_seconds", _DOC_LAG, m.lag_s),
        ):
            yield gauge(name, doc, value)
        for name, doc, value in (
            ("vllm:prefix_cache_queries", _DOC_QUERIES, st.num_queries_tokens),
            ("vllm:prefix_cache_hits", _DOC_HITS, st.num_hit_tokens),
            ("vllm:num_preemptions", _DOC_PREEMPT, s.num_preemptions),
            ("flexpipe:engine_steps", "Engine iterations run.", m.num_steps),
            ("flexpipe:modelled_busy_seconds", _DOC_BUSY, m.busy_s),
            ("flexpipe:engine_emit_cpu_seconds", _DOC_EMIT_CPU, m.emit_cpu_s),
        ):
            yield counter(name, doc, value)
        sleep = m.sleep
        if sleep is not None:
            # vLLM registers this gauge only with --enable-sleep-mode: one series per state,
            # 1 for the state the engine is in
            state = GaugeMetricFamily(
                "vllm:engine_sleep_state", _DOC_SLEEP_STATE, labels=[*names, "sleep_state"]
            )
            now = sleep.sleep_state
            for label in SLEEP_STATES:
                state.add_metric([*labels, label], 1.0 if label == now else 0.0)
            yield state
            yield gauge("flexpipe:gpu_memory_bytes", _DOC_GPU_MEMORY, sleep.gpu_memory_bytes)
            yield gauge("flexpipe:host_memory_bytes", _DOC_HOST_MEMORY, sleep.host_memory_bytes)


_DOC_SLEEP_STATE = (
    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
)
_DOC_GPU_MEMORY = "GPU memory the engine holds now, all its GPUs together (bytes; less asleep)."
_DOC_HOST_MEMORY = "Host RAM holding the sleeping copy of the weights (bytes; level 1)."
_DOC_RUNNING = "Number of requests in model execution batches."
_DOC_WAITING = "Number of requests waiting to be processed."
_DOC_USAGE = "KV-cache usage. 1 means 100 percent usage."
_DOC_QUEUED = "Tokens of waiting requests plus tokens left to compute of running ones."
_DOC_MAX_SEQS = "Maximum number of sequences running at once (the engine's max_num_seqs)."
_DOC_FREE = "Free KV blocks (cached blocks that may be evicted count as free)."
_DOC_LAG = "How far the engine loop runs behind the modelled step deadlines."
_DOC_QUERIES = "Prefix cache queries, in terms of number of queried tokens."
_DOC_HITS = "Prefix cache hits, in terms of number of cached tokens."
_DOC_PREEMPT = "Cumulative number of preemption from the engine."
_DOC_BUSY = "Sum of modelled step times (unscaled)."
_DOC_EMIT_CPU = "CPU time of the engine loop's emits (less than their wall time: CPU contention)."


class EngineMetrics:
    """One server's metrics, in its own registry (two engines in one process do not mix)."""

    def __init__(
        self,
        model_name: str,
        scheduler: Scheduler,
        max_model_len: int,
        cache_config: Mapping[str, object],
    ) -> None:
        self.model_name = model_name
        self.scheduler = scheduler
        self.sleep: SleepState | None = None  # with --enable-sleep-mode: its gauges
        self.registry = CollectorRegistry()
        self.lag_s = 0.0
        self.num_steps = 0
        self.busy_s = 0.0
        self.emit_cpu_s = 0.0  # CPU time of the emits (their wall time: emit_time's sum)
        r = self.registry
        names = ["model_name", "engine"]
        lv = (model_name, "0")
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=r
        ).labels(*lv)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=r
        ).labels(*lv)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        self.success = {
            reason: self._success.labels(*lv, reason) for reason in ("stop", "length", "abort")
        }
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(*lv)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(*lv)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(*lv)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(*lv)
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            names,
            buckets=token_buckets,
            registry=r,
        ).labels(*lv)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            names,
            buckets=token_buckets,
            registry=r,
        ).labels(*lv)
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            names,
            buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
            registry=r,
        ).labels(*lv)
        self.wakeup_late = Histogram(
            "flexpipe:engine_wakeup_late_seconds",
            "How late the engine loop woke up after each step's deadline.",
            names,
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        ).labels(*lv)
        self.emit_time = Histogram(
            "flexpipe:engine_emit_seconds",
            "The engine loop's own work after each step (bookkeeping, writing the chunks).",
            names,
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        ).labels(*lv)
        self.gc_pause = Histogram(
            "flexpipe:gc_pause_seconds",
            "Each garbage collection's pause in the engine process.",
            names,
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        ).labels(*lv)
        self._gc_start_s = 0.0
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine for cache_config",
            [*cache_config.keys(), "engine"],
            registry=r,
        )
        info.labels(*(str(v) for v in cache_config.values()), "0").set(1)
        r.register(_StateCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- observations: fed from the engine core's plans and events (their timestamps are
    # the core's `now`, so a virtual clock gives the same observations as a real one) ---
    def observe_plan(self, plan: StepPlan) -> None:
        """A planned step: its modelled time, the queue time of its first admissions."""
        for req in plan.rejected:
            self.observe_finished(req)
        if plan.is_empty:
            return
        self.num_steps += 1
        self.busy_s += plan.duration_s
        for req in plan.admitted:
            self.queue_time.observe(req.queue_s)

    def observe_step(self, events: StepEvents) -> None:
        """A completed step: its tokens, TTFTs, inter-token gaps and finishes."""
        self.iteration_tokens.observe(events.plan.batch.num_tokens)
        if not events.progressed:
            return
        self.generation_tokens.inc(len(events.progressed))
        for req in events.first_token:
            self.ttft.observe(req.ttft_s)
            self.prompt_tokens.inc(req.num_prompt_tokens)
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
        itl = self.itl.observe
        for gap_s in events.itl_s:
            itl(gap_s)
        for req in events.finished:
            self.observe_finished(req)

    def observe_finished(self, req: EngineRequest) -> None:
        """A request that ended by itself ("stop", "length") or could never run ("error")."""
        reason = req.finish_reason or "abort"
        if reason in self.success:
            self.success[reason].inc()
        if reason != "error":
            self.e2e.observe(req.e2e_s)
            self.request_generation_tokens.observe(req.num_output_tokens)

    def observe_abort(self, req: EngineRequest) -> None:
        self.success["abort"].inc()

    # --- garbage-collection pauses (a process-wide hook: install in the engine process) ---
    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start_s = time.perf_counter()
        elif self._gc_start_s:
            self.gc_pause.observe(time.perf_counter() - self._gc_start_s)
            self._gc_start_s = 0.0

    def watch_gc(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
