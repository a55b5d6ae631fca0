"""Synthetic workloads: pure generators of (arrival, prompt length, output length, prefix).

Arrivals are Poisson (exponential gaps) or Gamma (gaps with a coefficient of variation `cv`:
cv > 1 is bursty, cv = 1 is Poisson); a diurnal pattern modulates the rate as
`rate x (1 + amplitude x cos(2 pi (t - peak_s) / period_s))`, by thinning (candidates at the
peak rate, each kept with probability rate(t) / peak rate). On/off (`onoff`, `Bursts`) is
serverless traffic: idle for exponential off periods, then a burst of uniform length at
`rate_per_s` (Poisson inside the burst). Lengths come from `LengthDist`.
Everything random comes from the `random.Random` passed in: same seed, same requests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from flexpipe.sim.request import PREFIX_BLOCK_TOKENS, SimRequest

Arrival = tuple[float, int, int, tuple[int, ...]]  # (time_s, prompt, output, prefix ids)


def prompt_text(request: SimRequest) -> str:
    """The request's prompt as text, for an OpenAI-compatible endpoint (`flexpipe replay`):
    one word per token of the simulator's `prompt_token_ids()` (the id in hex), so the sim
    engine's tokenizer (flexpipe/engine/tokenizer.py: a word is a token, BOS comes first, so
    one word fewer) counts `num_prompt_tokens`, and requests that share prefix ids share that
    text exactly: prefix caching and prefix-aware routing see the trace's sharing. (A real
    tokenizer splits these words into several tokens: the sharing holds, the count does not.)
    """
    ids = request.prompt_token_ids()
    return " ".join([format(t, "x") for t in ids[: max(1, request.num_prompt_tokens - 1)]])


class WorkloadError(ValueError):
    """A workload description that cannot be used; one readable line. The checks of the
    classes below start with the field's name (`mean: must be >= 1 (got 0)`)."""


def _at_least(name: str, value: float, low: float) -> None:
    if not (math.isfinite(value) and value >= low):
        raise WorkloadError(f"{name}: must be a finite number >= {low:g} (got {value:g})")


def _above(name: str, value: float, low: float) -> None:
    if not (math.isfinite(value) and value > low):
        raise WorkloadError(f"{name}: must be a finite number > {low:g} (got {value:g})")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Token counts: `fixed` (mean), `uniform` (min..max), `exponential` (mean) or
    `lognormal` (mean, cv); always clamped to [min, max]."""

    dist: str = "fixed"
    mean: float = 256.0
    cv: float = 1.0
    min: int = 1
    max: int = 1 << 20

    def __post_init__(self) -> None:
        if self.dist not in ("fixed", "uniform", "exponential", "lognormal"):
            raise WorkloadError(
                f"dist: unknown length distribution {self.dist!r}: "
                "use fixed, uniform, exponential or lognormal"
            )
        _at_least("mean", self.mean, 1)
        _above("cv", self.cv, 0)
        _at_least("min", self.min, 1)
        if self.max < self.min:
            raise WorkloadError(f"max: must be >= min ({self.min}) (got {self.max})")

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            x = self.mean
        elif self.dist == "uniform":
            return rng.randint(self.min, self.max)
        elif self.dist == "exponential":
            x = rng.expovariate(1.0 / self.mean)
        else:
            sigma2 = math.log(1.0 + self.cv * self.cv)
            x = rng.lognormvariate(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2))
        return min(self.max, max(self.min, round(x)))


@dataclass(frozen=True, slots=True)
class Diurnal:
    period_s: float = 86_400.0
    amplitude: float = 0.5  # 0..1: the rate swings between (1 - a) and (1 + a) x mean
    peak_s: float = 0.0  # when the rate peaks (mod period)

    def __post_init__(self) -> None:
        if not 0 <= self.amplitude <= 1:
            raise WorkloadError(f"amplitude: must be in [0, 1] (got {self.amplitude:g})")
        _above("period_s", self.period_s, 0)
        if not math.isfinite(self.peak_s):
            raise WorkloadError(f"peak_s: must be a finite number (got {self.peak_s:g})")

    def factor(self, t_s: float) -> float:
        return 1.0 + self.amplitude * math.cos(2 * math.pi * (t_s - self.peak_s) / self.period_s)


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Requests start with one of `num_groups` shared prefixes of `num_tokens` tokens
    (system prompts, few-shot examples), drawn uniformly."""

    num_groups: int = 8
    num_tokens: int = 1024

    def __post_init__(self) -> None:
        _at_least("num_groups", self.num_groups, 1)
        _at_least("num_tokens", self.num_tokens, 1)

    def ids(self, group: int) -> tuple[int, ...]:
        num_blocks = max(1, self.num_tokens // PREFIX_BLOCK_TOKENS)
        base = (1 << 30) + group * num_blocks  # far from trace hash ids
        return tuple(range(base, base + num_blocks))


@dataclass(frozen=True, slots=True)
class Bursts:
    """On/off arrivals: off periods exponential with mean `off_mean_s`, bursts uniform in
    [`burst_min_s`, `burst_max_s`]; a stream starts with an off period."""

    off_mean_s: float = 300.0
    burst_min_s: float = 10.0
    burst_max_s: float = 60.0

    def __post_init__(self) -> None:
        _above("off_mean_s", self.off_mean_s, 0)
        _above("burst_min_s", self.burst_min_s, 0)
        if not (math.isfinite(self.burst_max_s) and self.burst_max_s >= self.burst_min_s):
            raise WorkloadError(
                f"burst_max_s: must be >= burst_min_s ({self.burst_min_s:g}) "
                f"(got {self.burst_max_s:g})"
            )

    @property
    def duty(self) -> float:
        """The share of time in bursts (the mean rate over the burst rate)."""
        on = (self.burst_min_s + self.burst_max_s) / 2
        return on / (on + self.off_mean_s)


@dataclass(frozen=True, slots=True)
class Synthetic:
    rate_per_s: float
    prompt: LengthDist
    output: LengthDist
    arrival: str = "poisson"  # or "gamma", or "onoff" (with `bursts`)
    cv: float = 1.0  # gamma: coefficient of variation of the gaps
    diurnal: Diurnal | None = None
    shared_prefix: SharedPrefix | None = None
    start_s: float = 0.0
    bursts: Bursts | None = None  # onoff: the on/off periods (`rate_per_s` is the burst's)

    def __post_init__(self) -> None:
        if self.arrival not in ("poisson", "gamma", "onoff"):
            raise WorkloadError(
                f"process: unknown arrival process {self.arrival!r}: use poisson, gamma or onoff"
            )
        if (self.arrival == "onoff") != (self.bursts is not None):
            raise WorkloadError("process: onoff arrivals, and only they, take bursts")
        _above("rate_per_s", self.rate_per_s, 0)
        _above("cv", self.cv, 0)
        _at_least("start_s", self.start_s, 0)

    @property
    def peak_rate_per_s(self) -> float:
        return self.rate_per_s * (1.0 + (self.diurnal.amplitude if self.diurnal else 0.0))

    def arrivals(self, rng: random.Random, until_s: float) -> Iterator[Arrival]:
        if self.bursts is not None:
            yield from self._on_off(self.bursts, rng, until_s)
            return
        peak = self.peak_rate_per_s
        shape = 1.0 / (self.cv * self.cv)
        t = self.start_s
        while True:
            if self.arrival == "poisson":
                t += rng.expovariate(peak)
            else:
                t += rng.gammavariate(shape, 1.0 / (peak * shape))
            if t > until_s:
                return
            if self.diurnal is not None and rng.random() * peak > self.rate_per_s * (
                self.diurnal.factor(t)
            ):
                continue
            yield self._request(t, rng)

    def _on_off(self, bursts: Bursts, rng: random.Random, until_s: float) -> Iterator[Arrival]:
        """Off (exponential), then a burst (uniform length, Poisson at `rate_per_s`), again.
        (Diurnal and shared prefixes apply as to the other processes.)"""
        on_until_s = self.start_s
        t = self.start_s
        while t <= until_s:
            t = on_until_s + rng.expovariate(1.0 / bursts.off_mean_s)
            on_until_s = t + rng.uniform(bursts.burst_min_s, bursts.burst_max_s)
            while True:
                t += rng.expovariate(self.peak_rate_per_s)
                if t > min(on_until_s, until_s):
                    break
                if self.diurnal is not None and rng.random() * self.peak_rate_per_s > (
                    self.rate_per_s * self.diurnal.factor(t)
                ):
                    continue
                yield self._request(t, rng)
            t = on_until_s

    def _request(self, t: float, rng: random.Random) -> Arrival:
        prefix: tuple[int, ...] = ()
        if self.shared_prefix is not None:
            prefix = self.shared_prefix.ids(rng.randrange(self.shared_prefix.num_groups))
        prompt = self.prompt.sample(rng)
        if prefix:
            prompt = max(prompt, self.shared_prefix.num_tokens + 1)  # type: ignore[union-attr]
        return t, prompt, self.output.sample(rng), prefix
