"""Lazy decodes: the scheduler's bookkeeping for requests that cost nothing per step.

With `Scheduler(..., lazy_decodes=True)` (the simulator's engines), a running request that
decodes a known token every step (a one-token vocabulary that can only end it by length, see
`EngineRequest._plain_token`) costs nothing per step. It keeps the step it went lazy at and
its token count then; its true state is a function of the step counter (`num_steps`). What
happens at a particular step is kept by step: how many lazy requests need a new KV block
(`schedule`; a dict of step -> count, as every step's are taken in turn and a lazy request
needs a block every `block_size` steps, so a step's count moves on by `block_size` steps), it
finishes by max_tokens / max_model_len (`finish_step`; a heap, as a stretch asks for the
first). A decode's new blocks are anonymous (no prefix-cache entry), so the step takes them
off the free queue in one go and a request's `KVState` is told of them only when it is
materialised: its block count is a function of its tokens (`_lazy_blocks`). The step's
`BatchShape` comes from running sums, as a decode step's context is affine in the step. A
step then does O(changes) work, and the block manager ends every step in exactly the state
the per-step path leaves (a step's allocations only take free blocks from the head of the
queue, so their order within the step does not matter; frees stay in batch order). A decode
never registers a block in
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

# (step, place in `running`, generation, request): an entry whose generation is not the
# request's current one is stale (the request stopped decoding lazily since)
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
        self._block_due: dict[int, int] = {}  # step -> lazy requests needing a new block then
        self._blocks_through = -1  # the last step whose lazy requests' new blocks were taken
        self._finish_due: list[_Due] = []  # a lazy request finishes at step

    def materialize(self, req: EngineRequest) -> None:
        """Bring a lazily decoding request's tokens, computed count, last token time and
        block hashes up to date (it stays lazy). A no-op for any other request."""
        if req._lazy_step < 0:
            return
        blocks = self._lazy_blocks(req)
        if blocks > req.kv.num_blocks:
            req.kv.add_anonymous(blocks - req.kv.num_blocks)
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

    def _lazy_blocks(self, req: EngineRequest) -> int:
        """The blocks a lazy request holds now: those of its `KVState`, or as many as its
        tokens up to the last step whose new blocks were taken need (each step computes one
        more; `token_ids` holds its tokens at step `_lazy_step`), if more."""
        through = self._blocks_through
        if through < req._lazy_step:
            return req.kv.num_blocks
        num_tokens = len(req.token_ids) + through - req._lazy_step
        return max(req.kv.num_blocks, -(-num_tokens // self.bm.block_size))

    def _pending_block_step(self, req: EngineRequest) -> int:
        """The next step at which a lazy request needs a new block (counted in `_block_due`):
        its first, or one `block_size` steps after the last taken."""
        first = req._next_block_step
        through = self._blocks_through
        if through < first:
            return first
        return first + ((through - first) // self.bm.block_size + 1) * self.bm.block_size

    def _not_due(self, req: EngineRequest) -> None:
        """A lazy request leaves: uncount its pending new block."""
        step = self._pending_block_step(req)
        n = self._block_due[step] - 1
        if n:
            self._block_due[step] = n
        else:
            del self._block_due[step]

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
        heappush(self._finish_due, (limit - 1 - n + step, req._run_seq, req._lazy_gen, req))
        # the step whose token count first exceeds the blocks it holds (>= `step`: the blocks
        # hold at least the tokens computed so far)
        nxt = req.kv.num_blocks * self.bm.block_size - n + step + 1
        req._next_block_step = nxt
        due = self._block_due
        due[nxt] = due.get(nxt, 0) + 1

    def _take_due_blocks(self, step: int) -> None:
        """The new blocks the lazy requests need at `step` (the caller checked they fit)."""
        n = self._block_due.pop(step, 0)
        if n:
            self.bm.allocate_detached(n)
            later = step + self.bm.block_size
            self._block_due[later] = self._block_due.get(later, 0) + n
        self._blocks_through = step

    def lazy_blocks_needed(self, first_step: int, num_steps: int) -> int:
        """The new blocks the lazy requests need in steps [first_step, first_step +
        num_steps), none taken yet (a stretch's)."""
        end = first_step + num_steps
        bs = self.bm.block_size
        return sum(n * ((end - 1 - s) // bs + 1) for s, n in self._block_due.items() if s < end)

    def _unlazy(self, req: EngineRequest) -> None:
        """Materialise `req` and track it step by step from now on."""
        self.materialize(req)
        self._not_due(req)
        self._num_lazy -= 1
        self._lazy_context -= len(req.token_ids) - req._lazy_step
        req._lazy_step = -1
        req._lazy_gen += 1

    def _unlazy_all(self) -> None:
        for req in self.running:
            if req._lazy_step >= 0:
                self._unlazy(req)
        assert self._num_lazy == 0 and self._lazy_context == 0
        assert not self._block_due
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

    def _finish_lazy(
        self, req: EngineRequest, step: int, out: list[EngineRequest], stamps: TokenStamps | None
    ) -> None:
        """A lazy request's last token, at `step`: materialised, finished, blocks freed."""
        if req.status is not Status.RUNNING:
            return
        n = len(req.token_ids)
        k = step - req._lazy_step  # tokens at `step`: n + k
        blocks = self._lazy_blocks(req)
        if blocks > req.kv.num_blocks:
            req.kv.add_anonymous(blocks - req.kv.num_blocks)
        self._not_due(req)
        self._num_lazy -= 1
        self._lazy_context -= n - req._lazy_step
        req._lazy_step = -1
        req._lazy_gen += 1
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
        # every due step's count, taken at once (nothing else takes or frees blocks meanwhile)
        bs = self.bm.block_size
        due: dict[int, int] = {}
        num_new = 0
        for s, n in self._block_due.items():
            k = (end - 1 - s) // bs + 1 if s < end else 0
            num_new += n * k
            later = s + k * bs
            due[later] = due.get(later, 0) + n
        if num_new:
            self.bm.allocate_detached(num_new)
        self._block_due = due
        self._blocks_through = end - 1
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
