"""One request as the sim engine tracks it: tokens, progress, KV blocks, and how it ends.

There is no prefill or decode phase: `num_computed_tokens` catches up with `num_tokens`; when
it does, the "model" samples one more token (as vLLM V1 does). Chunked prefill, prefix-cache
hits, preemption by recompute and transferred KV are all just different values of
`num_computed_tokens`.

Under a lazy scheduler (`Scheduler(..., lazy_decodes=True)`, the simulator's), a request that
decodes a known token every step is advanced without being touched: its `token_ids`,
`num_computed_tokens` and `last_token_s` lag until the scheduler materialises it
(`Scheduler.materialize`; done for you when it finishes, is aborted or preempted).

Generated tokens are deterministic: a `random.Random` seeded from (seed, prompt token ids)
draws from the tokenizer's generation vocabulary. When the client gives max_tokens, the sim
"model" talks until it is cut off (finish_reason "length"); without max_tokens it stops by
itself (an EOS, finish_reason "stop") after a deterministic 8 to 256 tokens.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flexpipe.engine.block_manager import KVState
from flexpipe.engine.tokenizer import EOS_ID

if TYPE_CHECKING:
    import asyncio

NATURAL_LEN_RANGE = (8, 256)  # EOS after this many tokens when max_tokens is not given


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = None  # None: stop "naturally" (see module docstring)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    seed: int | None = None


def context_error(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> str:
    """Why a request does not fit the context ("" when it does): vLLM's 400 message. At least
    one token must be left to generate, and prompt + max_tokens may not exceed the limit."""
    limit = max_model_len
    out = max_tokens or 0
    if num_prompt_tokens < limit and num_prompt_tokens + out <= limit:
        return ""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{num_prompt_tokens + out} tokens ({num_prompt_tokens} in the messages, {out} in the "
        "completion). Please reduce the length of the messages or completion."
    )


@dataclass(eq=False, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_output_tokens: int  # hard cap: min(max_tokens, max_model_len - prompt)
    gen_ids: Sequence[int]  # the vocabulary generated tokens are drawn from
    engine_seed: int = 0
    fragments: dict[int, str] | None = None  # token id -> text, needed for stop strings
    arrival_s: float = 0.0  # set by EngineCore.add
    num_preloaded_tokens: int = 0  # KV that arrived by transfer (migration): never computed
    priority: int = 0  # lower first (scheduling policy "priority"; vLLM's request priority)
    # progress
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    kv: KVState = field(default_factory=KVState)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    admitted: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    error: str | None = None
    # generation
    _rng: random.Random | None = None
    _natural_len: int = 0
    _text_tail: str = ""
    _num_prompt: int = 0  # len(prompt_token_ids), read once per step by `sample`
    _fixed_token: int = -1  # the token of a one-token vocabulary (nothing to draw), else -1
    # `_fixed_token` when sampling it can only end the request by length (not EOS, not a stop
    # token, no stop strings): the scheduler then appends it inline (see `sample`), else -1
    _plain_token: int = -1
    # a lazy scheduler's (see flexpipe.engine.scheduler, "Lazy decodes"): the step from which
    # this request decodes one `_plain_token` a step without being touched (-1: it is not),
    # the generation of its entries in the scheduler's heaps, its place in `running` (a
    # counter of admissions), and the step at which it needs its next KV block
    _lazy_step: int = -1
    _lazy_gen: int = 0
    _run_seq: int = 0
    _next_block_step: int = 0
    # timing: set by EngineCore from the `now` it is given (a wall clock or a virtual one)
    scheduled_s: float = 0.0  # first admitted (queue time ends)
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    finished_s: float = 0.0
    # the async runner's: how its consumer is told of progress
    waiter: asyncio.Future[None] | None = None
    sink: Any = None  # a runner.ProgressSink: told of progress by the loop (see runner)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self._num_prompt = len(self.prompt_token_ids)
        self._fixed_token = self.gen_ids[0] if len(self.gen_ids) == 1 else -1
        params = self.params
        if (
            self._fixed_token >= 0
            and self._fixed_token != EOS_ID
            and self._fixed_token not in params.stop_token_ids
            and not (params.stop and self.fragments is not None)
        ):
            self._plain_token = self._fixed_token
        if self.params.max_tokens is None and not self.params.ignore_eos:
            lo, hi = NATURAL_LEN_RANGE
            self._natural_len = max(self._new_rng().randint(lo, hi), self.params.min_tokens)
        else:
            self._natural_len = 1 << 62

    def _new_rng(self) -> random.Random:
        """The request's generator, made on first use (seeding one costs ~10 us, and a
        request that never draws, such as the simulator's, never needs it)."""
        seed = self.params.seed if self.params.seed is not None else self.engine_seed
        self._rng = random.Random(hash((seed, tuple(self.prompt_token_ids))))
        return self._rng

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    # --- latencies (valid once the event they end has happened) --------------------------
    @property
    def queue_s(self) -> float:
        return self.scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 with fewer than two tokens)."""
        n = self.num_output_tokens
        return (self.last_token_s - self.first_token_s) / (n - 1) if n > 1 else 0.0

    def sample(self) -> int:
        """Append the next generated token; set finish_reason when it ends the request."""
        n_out = len(self.token_ids) - self._num_prompt + 1
        params = self.params
        if n_out >= self._natural_len:
            tok = EOS_ID
        elif self._fixed_token >= 0:
            tok = self._fixed_token  # nothing to draw (and every later draw is from it too)
        else:
            gen = self.gen_ids
            rng = self._rng or self._new_rng()
            tok = gen[int(rng.random() * len(gen))]
        self.token_ids.append(tok)
        if tok == EOS_ID and not params.ignore_eos:
            self.finish_reason = "stop"
        elif params.stop_token_ids and tok in params.stop_token_ids and n_out > params.min_tokens:
            self.finish_reason = "stop"
            self.stop_reason = tok
        elif params.stop and self.fragments is not None and n_out > params.min_tokens:
            self._text_tail = (self._text_tail + self.fragments.get(tok, ""))[-256:]
            for s in params.stop:
                if s and s in self._text_tail:
                    self.finish_reason = "stop"
                    self.stop_reason = s
                    break
        if self.finish_reason is None and n_out >= self.max_output_tokens:
            self.finish_reason = "length"
        return tok
