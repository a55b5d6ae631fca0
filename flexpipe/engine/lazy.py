"""Lazy decodes: the scheduler's bookkeeping for requests that cost nothing per step.

With `Scheduler(..., lazy_decodes=True)` (the simulator's engines), a running request that
decodes a known token every step (a one-token vocabulary that can only end it by length, see
`EngineRequest._plain_token`) costs nothing per step. It keeps the step it went lazy at and
its token count then; its true state is a function of the step counter (`num_steps`). What
happens at a particular step is kept by step: it needs a new KV block (`schedule`; a dict of
step -> entries, as every step's are taken in turn and a lazy request needs a block every
`block_size` steps: cheaper than a heap), it finishes by max_tokens / max_model_len
(`finish_step`; a heap, as a stretch asks for the first). The step's `BatchShape` comes from
running sums, as a decode step's context is affine in the step. A step then does O(changes)
work, with the block manager called in exactly the order the per-step path calls it
(allocations in `running` order, then admissions; frees in batch order), so every block id,
free-queue position and prefix-cache entry is the same. A decode never registers a block in
the prefix cache (`schedule` marks every block it holds as registered before `finish_step`
could; so block size >= 2 is required), and a decode's block hashes are a pure function of
its tokens, so both wait until the request is materialised. A step whose budget or free
blocks do not cover every running request (chunking, preemption) materialises all of them
and runs the per-step path; they go lazy again when it ends. `StepPlan.scheduled` and
`finish_step`'s result then list only the requests not decoding lazily (`plan.num_lazy`
counts the others), plus those that finish.

`LazyDecodes` is a part of `Scheduler` (flexpipe.engine.scheduler), kept here so that the
scheduler's policy reads on its own; it uses the scheduler's state.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING

from flexpipe.engine.block_manager import BlockManager
from flexpipe.engine.request import EngineRequest, Status

if TYPE_CHECKING:
    from flexpipe.engine.scheduler import SchedulerConfig, TokenStamps

# (place in `running`, generation, request): an entry whose generation is not the request's
# current one is stale (the request stopped decoding lazily since)
_Entry = tuple[int, int, EngineRequest]
# (step, place in `running`, generation, request)
_Due = tuple[int, int, int, EngineRequest]


class LazyDecodes:
    # the scheduler's (set by `Scheduler.__init__`)
    config: SchedulerConfig
    bm: BlockManager
    running: list[EngineRequest]
    num_steps: int

    def _init_lazy(self, lazy_decodes: bool) -> None:
        self.lazy = lazy_decodes and self.bm.block_size >= 2
        self._last_now_s = 0.0  # the last stamped step's `now`
        self._num_lazy = 0
        self._lazy_context = 0  # sum of len(token_ids) - _lazy_step over lazy requests
        self._block_due: dict[int, list[_Entry]] = {}  # step -> lazy requests needing a block
        self._finish_due: list[_Due] = []  # a lazy request finishes at step

    def materialize(self, req: EngineRequest) -> None:
        """Bring a lazily decoding request's tokens, computed count, last token time and
        block hashes up to date (it stays lazy). A no-op for any other request."""
        if req._lazy_step < 0:
            return
        k = self.num_steps - req._lazy_step
        if k <= 0:
            return
        token_ids = req.token_ids
        token_ids.extend([req._plain_token] * k)
        req.num_computed_tokens = len(token_ids) - 1
        req.last_token_s = self._last_now_s
        req._lazy_step = self.num_steps
        if self.bm.enable_caching:
            self.bm.update_hashes(req.kv, token_ids)

    def _lazify(self, req: EngineRequest, step: int) -> None:
        """From `step` on, `req` (which just got a token and is not finished) decodes lazily,
        if it can only end by length before any natural end."""
        n = len(req.token_ids)
        prompt = req._num_prompt
        limit = min(prompt + req.max_output_tokens, self.config.max_model_len)
        if limit - prompt >= req._natural_len:
            return
        req._lazy_step = step
        self._num_lazy += 1
        self._lazy_context += n - step
        gen = req._lazy_gen
        seq = req._run_seq
        heappush(self._finish_due, (limit - 1 - n + step, seq, gen, req))
        # the step whose token count first exceeds the blocks it holds (>= `step`: the blocks
        # hold at least the tokens computed so far)
        nxt = req.kv.num_blocks * self.bm.block_size - n + step + 1
        req._next_block_step = nxt
        self._due_at(nxt, (seq, gen, req))

    def _due_at(self, step: int, entry: _Entry) -> None:
        entries = self._block_due.get(step)
        if entries is None:
            self._block_due[step] = [entry]
        else:
            entries.append(entry)

    def _blocks_due(self, step: int) -> list[EngineRequest]:
        """The lazy requests that need a new block at `step`, in `running` order (taken)."""
        entries = self._block_due.pop(step, None)
        if entries is None:
            return []
        if len(entries) > 1:
            entries.sort()
        return [req for _, gen, req in entries if gen == req._lazy_gen and req._lazy_step >= 0]

    def _unlazy(self, req: EngineRequest) -> None:
        """Materialise `req` and track it step by step from now on."""
        self.materialize(req)
        self._num_lazy -= 1
        self._lazy_context -= len(req.token_ids) - req._lazy_step
        req._lazy_step = -1
        req._lazy_gen += 1
        if not self._num_lazy:
            self._block_due.clear()  # (only stale entries left)

    def _unlazy_all(self) -> None:
        for req in self.running:
            if req._lazy_step >= 0:
                self._unlazy(req)
        assert self._num_lazy == 0 and self._lazy_context == 0
        self._block_due.clear()
        self._finish_due.clear()

    @staticmethod
    def _due(heap: list[_Due], end: int) -> list[EngineRequest]:
        """Pop the live entries due before step `end`, in (step, place in `running`) order."""
        out: list[EngineRequest] = []
        while heap and heap[0][0] < end:
            _, _, gen, req = heappop(heap)
            if gen == req._lazy_gen and req._lazy_step >= 0:
                out.append(req)
        return out

    def _new_blocks(self, reqs: list[EngineRequest], step: int) -> None:
        """Lazy requests' new blocks at `step`, in this order (`schedule`'s allocations for
        their decodes)."""
        if not reqs:
            return
        ok = self.bm.append_blocks([req.kv for req in reqs])
        assert ok, "a lazy decode ran out of blocks (the step's check must prevent it)"
        # their tokens at `step` filled the blocks they held, plus one: the next block is due
        # once those fill too
        nxt = step + self.bm.block_size
        entries = self._block_due.get(nxt)
        if entries is None:
            entries = self._block_due[nxt] = []
        for req in reqs:
            req._next_block_step = nxt
            entries.append((req._run_seq, req._lazy_gen, req))

    def _finish_lazy(
        self, req: EngineRequest, step: int, out: list[EngineRequest], stamps: TokenStamps | None
    ) -> None:
        """A lazy request's last token, at `step`: materialised, finished, blocks freed."""
        if req.status is not Status.RUNNING:
            return
        n = len(req.token_ids)
        k = step - req._lazy_step  # tokens at `step`: n + k
        self._num_lazy -= 1
        self._lazy_context -= n - req._lazy_step
        req._lazy_step = -1
        req._lazy_gen += 1
        if not self._num_lazy:
            self._block_due.clear()  # (only stale entries left)
        req.token_ids.extend([req._plain_token] * (k + 1))
        req.num_computed_tokens = n + k
        req.finish_reason = "length"
        req.status = Status.FINISHED
        self.bm.free(req.kv)
        if stamps is not None:
            now = stamps.now_s
            stamps.itl_s.append(now - self._last_now_s)  # (its previous token's step)
            req.last_token_s = now
            req.finished_s = now
            stamps.finished.append(req)
        out.append(req)

    def advance(self, num_steps: int, now: float) -> None:
        """Apply `num_steps` decode steps of a batch that only decodes lazily, with nothing
        admitted and nothing finishing (a simulator's closed-form stretch); the last ends at
        `now`. Their new blocks are allocated in the per-step order."""
        if num_steps <= 0:
            return
        end = self.num_steps + num_steps
        due = self._block_due
        for step in range(self.num_steps, end):
            if due:
                self._new_blocks(self._blocks_due(step), step)
        assert self.first_lazy_finish_step() >= end, "a lazy request finishes in the stretch"
        self.num_steps = end
        self._last_now_s = now

    def first_lazy_finish_step(self) -> int:
        """The first step at which a lazy request finishes (huge when none does)."""
        heap = self._finish_due
        while heap:
            _, _, gen, req = heap[0]
            if gen == req._lazy_gen and req._lazy_step >= 0:
                return heap[0][0]
            heappop(heap)
        return 1 << 62
