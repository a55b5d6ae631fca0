"""`flexpipe up --demo`: a built-in load and the seed's resource timeline, so a newcomer watches
flexpipe start on fragments and shift up within a few minutes.

The timeline (seed 000 §4): at the start another tenant holds gpu1 (the controller starts with
it occupied, `flexpipe controller --occupy gpu1`), so the first plan serves on the fragments
left: the lone L4, the lone A100 and the L40S behind the slow link. Open-loop Poisson load
starts once the model serves; a minute later (modelled) the tenant leaves gpu1: the demo
releases it through the controller's admin API (`flexpipe cluster release gpu1` does the
same), and the controller re-plans and shifts up onto the freed A100, make-before-break,
while the load runs. Watch it with `flexpipe status --watch`,
`flexpipe top`, the dashboard (/ui) and `flexpipe shifts`.

The load is streamed completions through the gateway with flexpipe's own HTTP client (no
extra dependency): a few shared system prompts (so the prefix cache has something to hit)
plus a question of its own, seeded, with `ignore_eos` so each answer has its planned length.
Arrival times and bodies are pure functions of a seeded `random.Random` (`requests`)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from flexpipe.cluster import Cluster
from flexpipe.control.api.client import AsyncControllerClient, ControllerError, resolve_token
from flexpipe.control.core.resources import Resources
from flexpipe.examples import example_path
from flexpipe.http.client import ClientPool, Timeouts, UpstreamError

__all__ = [
    "DEMO_GPU",
    "DemoLoad",
    "DemoRequest",
    "DemoRun",
    "controller_args",
    "demo_cluster",
    "demo_shift_config",
    "requests",
]

DEMO_GPU = "gpu1"  # the GPU the other tenant holds at the start, then gives back
DEMO_OWNER = "tenant-b (demo)"

_WORDS = (
    "river",
    "stone",
    "light",
    "garden",
    "window",
    "quiet",
    "bright",
    "open",
    "cloud",
    "paper",
    "silver",
    "north",
    "table",
    "field",
    "echo",
    "lantern",
)


def controller_args() -> list[str]:
    """What `flexpipe up --demo` adds to the controller's command line: the tenant on gpu1."""
    return ["--occupy", DEMO_GPU, "--occupy-owner", DEMO_OWNER]


def demo_cluster(cluster: Cluster, now_s: float) -> Cluster:
    """The cluster as the demo's controller starts with it: gpu1 held by the other tenant."""
    resources, _ = Resources.of(cluster, now_s).occupy([DEMO_GPU], DEMO_OWNER, None, now_s)
    return resources.effective


def demo_shift_config() -> Path:
    """The demo's shift policy settings (examples/demo/shift.yaml): quick to react, never
    shrinking while the load warms up."""
    return example_path("demo/shift.yaml")


@dataclass(frozen=True)
class DemoLoad:
    """What the demo sends, per modelled second (the wall rate is divided by the time scale)."""

    rate_per_s: float = 3.0
    num_system_prompts: int = 4
    system_prompt_tokens: int = 400  # shared by every request that uses that prompt
    min_question_tokens: int = 64
    max_question_tokens: int = 1024
    short_output_tokens: int = 64
    long_output_tokens: int = 1024
    long_share: float = 0.1
    tenant_leaves_after_s: float = 60.0  # modelled seconds after the load starts
    report_every_s: float = 30.0
    seed: int = 0


@dataclass(frozen=True)
class DemoRequest:
    at_s: float  # modelled seconds after the load started
    prompt: str
    max_tokens: int


def _system_prompts(load: DemoLoad) -> list[str]:
    rng = random.Random(load.seed + 1)
    return [
        f"system {k}: " + " ".join(rng.choice(_WORDS) for _ in range(load.system_prompt_tokens))
        for k in range(load.num_system_prompts)
    ]


def requests(load: DemoLoad) -> Iterator[DemoRequest]:
    """The demo's requests, endless: Poisson arrivals, a shared system prompt and a question."""
    rng = random.Random(load.seed)
    systems = _system_prompts(load)
    at_s = 0.0
    index = 0
    while True:
        at_s += rng.expovariate(load.rate_per_s)
        num_words = rng.randint(load.min_question_tokens, load.max_question_tokens)
        question = " ".join(rng.choice(_WORDS) for _ in range(num_words))
        long = rng.random() < load.long_share
        max_tokens = load.long_output_tokens if long else load.short_output_tokens
        yield DemoRequest(at_s, f"{rng.choice(systems)}\nuser {index}: {question}", max_tokens)
        index += 1


class DemoRun:
    """The load and the timeline in a thread of their own (its own event loop), next to
    `flexpipe up`'s supervisor. `stop()` ends it; requests in flight are abandoned (the
    gateway aborts them upstream)."""

    def __init__(
        self,
        gateway_url: str,
        controller_url: str,
        model: str,
        say: Callable[[str], None],
        time_scale: float = 1.0,
        load: DemoLoad | None = None,
    ) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.controller_url = controller_url
        self.model = model
        self.say = say
        self.scale = time_scale if time_scale > 0 else 1.0
        self.load = load or DemoLoad()
        self.num_sent = self.num_ok = self.num_failed = 0
        self.released = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="flexpipe-demo", daemon=True)

    def start(self) -> DemoRun:
        self._thread.start()
        return self

    def halt(self) -> None:
        """No new requests (flexpipe up is stopping); returns at once."""
        self._stop.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _sleep(self, wall_s: float) -> bool:
        """Sleep up to `wall_s`; False when stopped meanwhile."""
        deadline = time.monotonic() + wall_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            await asyncio.sleep(min(left, 0.2))
        return False

    async def _run(self) -> None:
        pool = ClientPool()
        tasks: set[asyncio.Task[None]] = set()
        try:
            if not await self._wait_serving(pool):
                return
            lo = self.load
            self.say(
                f"demo: load started: {lo.rate_per_s:g} requests/s (modelled) of {self.model}; "
                f"the other tenant leaves {DEMO_GPU} in {lo.tenant_leaves_after_s:g} s. Watch: "
                "flexpipe status --watch | flexpipe top | flexpipe shifts"
            )
            t0 = time.monotonic()
            next_report_s = lo.report_every_s
            for req in requests(lo):
                wall_at = t0 + req.at_s * self.scale
                if not await self._sleep(wall_at - time.monotonic()):
                    break
                modelled_s = (time.monotonic() - t0) / self.scale
                if not self.released and modelled_s >= lo.tenant_leaves_after_s:
                    self.released = True
                    tasks.add(asyncio.create_task(self._release()))
                if modelled_s >= next_report_s:
                    next_report_s += lo.report_every_s
                    self.say(
                        f"demo: {self.num_sent} sent, {self.num_ok} answered, "
                        f"{self.num_failed} failed, {self.num_sent - self.num_ok - self.num_failed}"
                        " in flight"
                    )
                task = asyncio.create_task(self._one(pool, req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                self.num_sent += 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pool.close()

    async def _wait_serving(self, pool: ClientPool) -> bool:
        """Until the gateway has an active instance (its /health is 200)."""
        quick = Timeouts(connect_s=1.0, ttfb_s=2.0, idle_s=2.0)
        while not self._stop.is_set():
            try:
                resp = await pool.request(self.gateway_url, "GET", "/health", b"", None, quick)
                await resp.read()
                resp.release()
                if resp.status == 200:
                    return True
            except UpstreamError:
                pass
            await self._sleep(0.5)
        return False

    async def _release(self) -> None:
        client = AsyncControllerClient(self.controller_url, resolve_token(None, None))
        try:
            result = await client.release([DEMO_GPU])
            self.say(f"demo: the other tenant left {DEMO_GPU}: {result.summary()}")
        except ControllerError as exc:
            self.say(f"error: demo: could not release {DEMO_GPU}: {exc}")
        finally:
            await client.close()

    async def _one(self, pool: ClientPool, req: DemoRequest) -> None:
        body = orjson.dumps(
            {
                "model": self.model,
                "prompt": req.prompt,
                "max_tokens": req.max_tokens,
                "stream": True,
                "ignore_eos": True,
            }
        )
        timeouts = Timeouts(connect_s=5.0, ttfb_s=600.0, idle_s=120.0)
        headers = {"content-type": "application/json"}
        try:
            resp = await pool.request(
                self.gateway_url, "POST", "/v1/completions", body, headers, timeouts
            )
            try:
                data = await resp.read()
            finally:
                resp.release()
        except UpstreamError:
            self.num_failed += 1
            return
        ok = resp.status == 200 and b"[DONE]" in data and b'"error"' not in data
        if ok:
            self.num_ok += 1
        else:
            self.num_failed += 1
