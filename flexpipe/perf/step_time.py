"""Step time of one engine iteration: a roofline per pipeline stage plus communication.

An iteration runs any mix of prefill chunks (new tokens over already-cached context) and
decodes, as chunked-prefill engines do. Per stage, the linear layers and attention are each
bounded by max(bytes over HBM bandwidth, FLOPs over tensor-core rate), with efficiency
factors; tensor parallelism adds two ring all-reduces per layer over the stage's slowest link;
pipeline parallelism adds a hand-off of the hidden states between stages. The slowest stage
paces a pipeline (see `PerfModel.decode_interval_s`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.hardware import LinkSpec
from flexpipe.perf.calibration import LinkCalibration


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one iteration computes, in aggregates (so costing it is O(1) in batch size).

    prefill_attention_tokens: sum over chunks of new x (cached + new / 2), the number of
    query-key pairs the chunk's causal attention touches.
    decode_context_tokens: sum of the decoding sequences' context lengths.
    """

    num_prefill_tokens: int = 0
    prefill_attention_tokens: float = 0.0
    num_decode_seqs: int = 0
    decode_context_tokens: int = 0
    num_prefill_seqs: int = 0  # chunks in the batch (each samples one token if it completes)

    @classmethod
    def of(
        cls,
        prefills: Sequence[tuple[int, int]] = (),
        decode_contexts: Sequence[int] = (),
    ) -> BatchShape:
        """From explicit (new_tokens, cached_tokens) chunks and decode context lengths."""
        return cls(
            num_prefill_tokens=sum(n for n, _ in prefills),
            prefill_attention_tokens=float(sum(n * (c + n / 2) for n, c in prefills)),
            num_decode_seqs=len(decode_contexts),
            decode_context_tokens=sum(decode_contexts),
            num_prefill_seqs=len(prefills),
        )

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        return self.num_prefill_seqs + self.num_decode_seqs

    @property
    def is_empty(self) -> bool:
        return self.num_tokens == 0


def allreduce_s(
    message_bytes: float, tp: int, link: LinkSpec, bandwidth_efficiency: float = 1.0
) -> float:
    """Ring all-reduce of `message_bytes` over `tp` ranks: 2(t-1) steps, each paying the
    link latency, moving 2(t-1)/t of the message over the slowest link."""
    if tp <= 1:
        return 0.0
    steps = 2 * (tp - 1)
    bandwidth = link.bandwidth_bytes_per_s * bandwidth_efficiency
    return steps * link.latency_s + steps / tp * message_bytes / bandwidth


def p2p_s(message_bytes: float, link: LinkSpec, bandwidth_efficiency: float = 1.0) -> float:
    """One point-to-point send (pipeline hand-off, KV transfer)."""
    return link.latency_s + message_bytes / (link.bandwidth_bytes_per_s * bandwidth_efficiency)


def roofline_s(
    num_bytes: float, flops: float, bandwidth_bytes_per_s: float, flops_per_s: float
) -> float:
    """A kernel is bounded by the slower of moving its bytes and doing its math."""
    return max(num_bytes / bandwidth_bytes_per_s, flops / flops_per_s)


@dataclass(frozen=True, slots=True)
class LinkCost:
    """What collectives over one link achieve, resolved once per link.

    Per quantity the most specific figure wins: a value measured for this very link (cluster
    file) over a calibrated link class (`LinkCalibration`) over the catalog's datasheet figure
    with the generic efficiency. A cluster-measured bandwidth keeps the generic efficiency, as
    it always has; a calibrated bandwidth is already what collectives achieve.
    """

    link: LinkSpec
    allreduce_bandwidth_bytes_per_s: float
    allreduce_latency_s: float
    p2p_bandwidth_bytes_per_s: float
    p2p_latency_s: float
    factors: str  # "calibrated (source)" | "generic" | "measured ..." (for `estimate`)

    @classmethod
    def of(
        cls,
        link: LinkSpec,
        allreduce_efficiency: float,
        p2p_efficiency: float,
        calibration: LinkCalibration | None,
    ) -> LinkCost:
        ar_bw = link.bandwidth_bytes_per_s * allreduce_efficiency
        p2p_bw = link.bandwidth_bytes_per_s * p2p_efficiency
        ar_lat = p2p_lat = link.latency_s
        cal = calibration
        if cal is not None and not link.bandwidth_measured:
            ar_bw = cal.allreduce_bandwidth_bytes_per_s
            p2p_bw = cal.p2p_bandwidth_bytes_per_s or p2p_bw
        if cal is not None and not link.latency_measured:
            ar_lat = cal.allreduce_latency_s
            p2p_lat = link.latency_s if cal.p2p_latency_s is None else cal.p2p_latency_s
        notes = [f"calibrated from {cal.source}"] if cal is not None else ["generic factors"]
        if link.bandwidth_measured:
            notes.append("bandwidth measured in the cluster file")
        if link.latency_measured:
            notes.append("latency measured in the cluster file")
        return cls(link, ar_bw, ar_lat, p2p_bw, p2p_lat, "; ".join(notes))

    def allreduce_s(self, message_bytes: float, num_ranks: int) -> float:
        """Ring all-reduce: 2(t-1) steps, each paying the latency, moving 2(t-1)/t of it."""
        if num_ranks <= 1:
            return 0.0
        steps = 2 * (num_ranks - 1)
        return steps * self.allreduce_latency_s + (
            steps / num_ranks * message_bytes / self.allreduce_bandwidth_bytes_per_s
        )

    def p2p_s(self, message_bytes: float) -> float:
        return self.p2p_latency_s + message_bytes / self.p2p_bandwidth_bytes_per_s
