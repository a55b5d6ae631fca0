"""One simulated client request: what the workload asks, and how it ended.

Prompts are made of blocks: `prefix_ids` are shared block ids (a Mooncake trace's hash ids:
requests that share leading ids share that prefix), each `prefix_block_tokens` long; the rest
of the prompt is unique to the request. Token ids and the prompt bytes the gateway hashes are
both derived from those ids, so prefix caching (engine) and prefix-aware routing (gateway)
see the same sharing as a real prompt would give them.

The unique part's first token id is the request's own (`_UNIQUE_BASE` + its id, above every
shared block's ids); the rest count 1, 2, 3, ... in every request. The engine's block hashes
are chained (each covers every token before it), so no block of it matches another
request's, as with ids unique throughout; and the ids are the same few int objects in every
prompt, not a new one per token of every request (the simulator's most frequent allocation).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, repeat

from flexpipe.policies.routing.prefix_index import chain_block_hashes, prompt_block_hashes

PREFIX_BLOCK_TOKENS = 512  # tokens per shared block id (the Mooncake trace's block)
_BYTES_PER_TOKEN = 4  # the gateway estimates a token per 4 bytes of prompt
GENERATED_TOKEN_ID = 100  # the sim model's one-token vocabulary (`stretch.SIM_GEN_IDS`)
_UNIQUE_BASE = 1 << 40  # + request id: a unique prompt part's first token (shared blocks: below)
_COUNT: list[int] = [0]  # 0, 1, 2, ...: a unique part's other tokens (grown on demand)


def _count_to(n: int) -> list[int]:
    """[0, 1, ..., n - 1] (shared: copy what you take)."""
    if len(_COUNT) < n:
        _COUNT.extend(range(len(_COUNT), n))
    return _COUNT


@dataclass(slots=True)
class SimRequest:
    request_id: int  # position in the run's arrival order (0, 1, ...)
    arrival_s: float  # when the client sends it to the gateway
    model: str  # the served model name
    num_prompt_tokens: int
    num_output_tokens: int  # max_tokens: the sim model talks until cut off
    prefix_ids: tuple[int, ...] = ()  # shared prompt blocks (see module docstring)
    num_kv_tokens: int = 0  # a moved request's context whose KV arrived by transfer
    priority: int = 0  # the engine's admission order (a controller's move: MOVE_PRIORITY)
    # a continuation (or its warm-up): its prompt is this client request's prompt followed by
    # the tokens generated so far, as the gateway's continuation body sends it (so a warm-up
    # and the cut-over after it share their leading blocks); None: a client request
    context_of: SimRequest | None = None
    # outcome (set by the simulator)
    instance: str = ""
    first_token_s: float = -1.0
    last_token_s: float = -1.0
    finish_s: float = -1.0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    failed: str = ""  # why it failed ("" while pending or when completed)

    @property
    def completed(self) -> bool:
        return self.finish_s >= 0 and not self.failed

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        n = self.num_generated_tokens
        return (self.last_token_s - self.first_token_s) / (n - 1) if n > 1 else 0.0

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    def prompt_token_ids(self) -> list[int]:
        n = self.num_prompt_tokens
        if self.context_of is not None:
            ids = self.context_of.prompt_token_ids()
            return ids + [GENERATED_TOKEN_ID] * (n - len(ids))
        if not self.prefix_ids and n > 0:  # all unique: one copy of the count
            out = _count_to(n)[:n]
            out[0] = _UNIQUE_BASE + self.request_id
            return out
        out = []
        for block in self.prefix_ids:
            start = block * PREFIX_BLOCK_TOKENS
            out.extend(range(start, start + PREFIX_BLOCK_TOKENS))
            if len(out) >= n:
                del out[n:]
                return out
        out.append(_UNIQUE_BASE + self.request_id)
        out += _count_to(n)[1 : n - len(out) + 1]
        return out

    @property
    def num_prompt_bytes(self) -> int:
        return self.num_prompt_tokens * _BYTES_PER_TOKEN  # (len(self.prompt_bytes()))

    def prompt_block_hashes(self, block_chars: int) -> tuple[int, ...]:
        """`prompt_block_hashes(self.prompt_bytes(), block_chars)`, without the bytes: each
        shared block's bytes, and the unique part's, are 8 bytes repeated, so every full
        block of them is the same (when `block_chars` divides a shared block's bytes and is a
        multiple of 8; else from the bytes)."""
        shared_bytes = PREFIX_BLOCK_TOKENS * _BYTES_PER_TOKEN
        if block_chars % 8 or shared_bytes % block_chars:
            return prompt_block_hashes(self.prompt_bytes(), block_chars)
        runs: list[repeat[bytes]] = []
        left = self.num_prompt_tokens
        for block in self.prefix_ids:
            if left <= 0:
                break
            take = min(left, PREFIX_BLOCK_TOKENS)  # (less: the prompt ends in this block)
            data = block.to_bytes(8, "little") * (block_chars // 8)
            runs.append(repeat(data, take * _BYTES_PER_TOKEN // block_chars))
            left -= take
        if left > 0:
            data = (self.request_id | (1 << 62)).to_bytes(8, "little") * (block_chars // 8)
            runs.append(repeat(data, left * _BYTES_PER_TOKEN // block_chars))
        return chain_block_hashes(runs[0] if len(runs) == 1 else chain.from_iterable(runs))

    def prompt_bytes(self) -> bytes:
        """Stand-in prompt text for the gateway's prefix hashes: shared blocks give shared
        bytes, unique tokens unique bytes, `_BYTES_PER_TOKEN` bytes per token."""
        parts: list[bytes] = []
        left = self.num_prompt_tokens
        per_block = PREFIX_BLOCK_TOKENS * _BYTES_PER_TOKEN // 8
        for block in self.prefix_ids:
            if left <= 0:
                break
            take = min(left, PREFIX_BLOCK_TOKENS)
            parts.append((block.to_bytes(8, "little") * per_block)[: take * _BYTES_PER_TOKEN])
            left -= take
        if left > 0:
            unique = (self.request_id | (1 << 62)).to_bytes(8, "little")
            parts.append((unique * (left * _BYTES_PER_TOKEN // 8 + 1))[: left * _BYTES_PER_TOKEN])
        return b"".join(parts)
