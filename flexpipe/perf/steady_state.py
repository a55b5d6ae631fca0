"""A gear's steady state at full concurrency: the one formula from step times to the figures
the planner compares with SLOs (TTFT, TPOT, tokens/s, requests/s).

Continuous batching with every one of `b` slots busy: per output step the engine decodes `b`
sequences (`decode_interval_s`), and prompts arrive at the rate sequences finish, so each step
also carries `b / output_tokens` prompts of prefill. With `d` the decode interval and `P` the
prefill time of one prompt on the slowest stage:

    tpot_s         = d + b * P / output_tokens          (time between two tokens of a sequence)
    requests_per_s = b / (output_tokens * tpot_s)       (Little's law: b in flight)
    ttft_s         = prefill_s(input) + tpot_s          (its own prefill + the step it joins)

TPOT here is a per-request mean; with outputs of ~100+ tokens the p99 over requests is close to
it, so the planner compares it with the TPOT p99 SLO. Queueing delay is kept bounded by loading
instances to `target_utilization` only (planner config).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.perf.model import PerfModel
from flexpipe.perf.step_time import BatchShape

__all__ = ["SteadyState", "Workload", "steady_state"]


@dataclass(frozen=True, slots=True)
class Workload:
    """The request shape a steady state is for (means of the demand's distribution)."""

    input_tokens: int
    output_tokens: int

    @property
    def mean_context_tokens(self) -> int:
        """Average context of a decoding sequence: the prompt plus half its output."""
        return self.input_tokens + self.output_tokens // 2


@dataclass(frozen=True, slots=True)
class SteadyState:
    """A gear's figures at concurrency `batch`."""

    batch: int  # concurrency (sequences in flight)
    output_tokens_per_s: float  # decode throughput of the whole instance
    requests_per_s: float
    ttft_s: float  # compared with the TTFT p99 SLO
    tpot_s: float  # compared with the TPOT p99 SLO
    e2e_s: float  # ttft + output x tpot

    @classmethod
    def from_times(
        cls, batch: int, ttft_s: float, tpot_s: float, output_tokens: int
    ) -> SteadyState:
        """Throughputs and e2e derived from TTFT and TPOT at concurrency `batch`."""
        out = max(1, output_tokens)
        return cls(
            batch=batch,
            output_tokens_per_s=batch / tpot_s,
            requests_per_s=batch / (out * tpot_s),
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            e2e_s=ttft_s + out * tpot_s,
        )


def steady_state(pm: PerfModel, batch: int, workload: Workload) -> SteadyState:
    """The module docstring's steady state of `pm` at concurrency `batch` (timing only: whether
    the batch fits in memory is the memory plan's answer)."""
    out = max(1, workload.output_tokens)
    decode_s = pm.decode_interval_s(batch, workload.mean_context_tokens)
    prefill_s = pm.prefill_s(workload.input_tokens) if workload.input_tokens > 0 else 0.0
    if pm.placement.pp > 1 and workload.input_tokens > 0:
        # Prompts pipeline through the stages: the slowest stage paces prefill throughput.
        times = pm.stage_times_s(BatchShape.of(prefills=[(workload.input_tokens, 0)]))
        paced_prefill_s = prefill_s * max(times) / sum(times)
    else:
        paced_prefill_s = prefill_s
    tpot_s = decode_s + batch * paced_prefill_s / out
    ttft_s = prefill_s + tpot_s
    return SteadyState.from_times(batch, ttft_s, tpot_s, workload.output_tokens)
