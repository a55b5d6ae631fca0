"""When a recompute move cuts its stream over: right after the source's next token.

A stream's client waits about one engine step for every token anyway. Cut at a random
moment, a move throws away the source's step in progress: the client's gap starts at the
last token it got there, so it pays on average half a source step on top of the
destination's (the step in progress there and the one that prefills the rest). Cut right
after the source delivers a token (relayed to the client, and included in the
continuation), that half step is gone; the stream keeps flowing while the move waits, so the
wait costs the client nothing. The wait is bounded (a stream that stalls or ends must not
hold a drain): `TOKEN_WAIT_GAPS` of the stream's own gap between tokens, at most
`MAX_TOKEN_WAIT_S`; past it the move cuts over at once, as it did before.

While a move cuts over, new requests keep off its destination (`fence_until_s`): from the
moment no prefill is pending there (`gateway.moves.between_prefills`) until the moved
stream's first token there should have come (the wait for the source's token, then the
destination's step in progress and the one that takes the stream). A new request routed
there in that window would share the stream's step with its whole prompt's prefill (a
1,961-token prompt paused a 536-token context 7.7x its prefill, BENCHMARKS.md). The fence
only reorders: a fenced instance is taken when no other candidate has a slot
(`gateway.router.Router.pick`), so it never queues a request. The next move's warm-up
(`relay.warm_up`: a whole context's prefill) waits for the fence's end (`fence_wait_s`), and
a cut-over waits for no prefill there, a client's or a warm-up's.

Pure rules, shared by the gateway (`gateway.moves.move_request`) and the simulator
(`sim.shift_run`), so that the two cut over at the same moments.
"""

from __future__ import annotations

__all__ = [
    "FENCE_STEPS",
    "MAX_FENCE_S",
    "MAX_TOKEN_WAIT_S",
    "TOKEN_WAIT_GAPS",
    "cut_over_s",
    "fence_until_s",
    "fence_wait_s",
    "mean_gap_s",
    "token_wait_s",
]

# How long a move waits for the source's next token: this many of the stream's gaps (its
# next token comes within one, unless its batch grew or the machine stalls) ...
TOKEN_WAIT_GAPS = 1.5
# ... and never longer than this (also the bound when the gap is not known yet: fewer than
# two tokens, or a stream already continued elsewhere).
MAX_TOKEN_WAIT_S = 0.25


def mean_gap_s(first_token_s: float, last_token_s: float, num_tokens: int) -> float | None:
    """A stream's mean gap between tokens from its first to its last (`num_tokens` of them);
    None with fewer than two."""
    if num_tokens < 2:
        return None
    return max(0.0, last_token_s - first_token_s) / (num_tokens - 1)


def token_wait_s(gap_s: float | None, max_wait_s: float = MAX_TOKEN_WAIT_S) -> float:
    """How long a move waits for its source's next token before cutting over anyway:
    `TOKEN_WAIT_GAPS` of the stream's gap `gap_s`, at most `max_wait_s` (the bound when
    the gap is unknown)."""
    if gap_s is None:
        return max_wait_s
    return min(TOKEN_WAIT_GAPS * gap_s, max_wait_s)


def cut_over_s(
    now_s: float,
    next_token_s: float | None,
    gap_s: float | None,
    max_wait_s: float = MAX_TOKEN_WAIT_S,
) -> float:
    """When a move asked for at `now_s` cuts over: at its source's next token
    (`next_token_s`, None: none known to come) if that comes within the wait
    (`token_wait_s`), else at the end of the wait (what the gateway's timer does)."""
    deadline_s = now_s + token_wait_s(gap_s, max_wait_s)
    if next_token_s is not None and now_s <= next_token_s <= deadline_s:
        return next_token_s
    return deadline_s


# A cut-over's fence lasts the wait for the source's token plus this many of the
# destination's steps (the one in progress and the one that takes the moved stream) ...
FENCE_STEPS = 2.0
# ... and never longer than this (also its length when the destination's step is unknown).
MAX_FENCE_S = 0.5


def fence_until_s(now_s: float, wait_s: float, speed_tokens_per_s: float) -> float:
    """Until when new requests keep off a move's destination, for a cut-over asked at `now_s`
    that waits at most `wait_s` (for its source's token, or its KV) before the stream goes
    there: that wait and `FENCE_STEPS` of the destination's steps (one step per token at its
    measured decode speed `speed_tokens_per_s`; 0 = not measured yet), at most
    `MAX_FENCE_S` in all."""
    if speed_tokens_per_s <= 0:
        return now_s + MAX_FENCE_S
    return now_s + min(wait_s + FENCE_STEPS / speed_tokens_per_s, MAX_FENCE_S)


def fence_wait_s(fenced_until_s: float, now_s: float, bound_s: float) -> float:
    """How long a move's warm-up waits at `now_s` before its destination, fenced until
    `fenced_until_s`, takes its prefill: until the fence's end, unless that is not within
    `bound_s` (what is left of `MAX_FENCE_S` of such waits; then at once)."""
    wait_s = fenced_until_s - now_s
    return wait_s if 0 < wait_s < bound_s else 0.0
