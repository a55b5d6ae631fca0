"""Ray launcher: each instance is a placement group whose bundles are exactly its GPUs, and an
actor in it that runs the engine (implements `Launcher`).

- Bundles: one `{"GPU": 1}` per GPU of the plan, in pipeline order, each pinned to its node
  (a label selector on Ray's node id: the planner's choice of nodes holds); STRICT_PACK when
  the instance is on one node (a tensor-parallel group), PACK across nodes (a pipeline).
- Which GPUs: the engine's CUDA_VISIBLE_DEVICES is the plan's device indices on the node (the
  planner chose them for their links); Ray's bundles keep other Ray work off that many GPUs.
- The placement group is named `flexpipe:<deployment>:<instance>:<gpu ids>` and detached: it
  outlives a controller that crashes. The actor (launch/ray_actor.py) sits in bundle 0, is
  detached and named after its placement group's id (`flexpipe-engine:<pg id>`), starts the
  engine on its node and says where it listens; the launcher waits for GET /health 200 from
  here.
- After a controller restart, `adopt(records)` takes back the engines the store says were
  live whose placement group is whole and whose actor lives at the recorded endpoint (the
  controller's takeover then asks their /health); every other placement group of the
  deployment a previous controller left is removed (not in the store: a crash mid cold start;
  a group being re-placed after its node was lost; an actor gone). Without a store, the first
  `start()` removes them all, so a restarted controller starts clean.
- `stop()` stops the engine and removes the placement group. An actor that dies (its node
  lost) turns `returncode` to -1 and its placement group is removed (Ray would otherwise
  re-place it, holding GPUs for nothing): the controller's engine-death path takes it from
  there.

`engine="sim"` runs the sim engine with the spec's topology (the placement's GPUs and links);
`engine="vllm"` runs `vllm serve` on one node (a pipeline across nodes would need vLLM's own
Ray executor inside the placement group, which this launcher does not start yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from flexpipe import ray_client
from flexpipe.cluster.ray_inventory import node_name, pg_name, pg_prefix
from flexpipe.launch.base import EngineHandle, EngineSpec, HandleBase, LaunchError
from flexpipe.launch.command import VLLM_COMMAND, check_engine, engine_argv, engine_env
from flexpipe.launch.health import wait_ready
from flexpipe.launch.ray_actor import EngineProcess

if TYPE_CHECKING:
    from flexpipe.store.instance_registry import InstanceRecord

__all__ = ["RayEngine", "RayLauncher", "actor_name"]

log = logging.getLogger("flexpipe.launch.ray")

SIM_ARGV: tuple[str, ...] = ("{python}", "-m", "flexpipe.engine.sim")
WAIT_POLL_S = 5.0  # how long one `wait` call on the actor blocks (see EngineProcess.wait)


def actor_name(pg_id: str) -> str:
    """The engine actor's name: a restarted controller finds it from its placement group."""
    return f"flexpipe-engine:{pg_id}"


class RayEngine(HandleBase):
    """An engine in a placement group (implements EngineHandle)."""

    def __init__(
        self, name: str, endpoint: str, actor: ray_client.ActorRef, pg_id: str, grace_s: float
    ) -> None:
        super().__init__(name, endpoint)
        self.actor = actor
        self.pg_id = pg_id
        self.stop_grace_s = grace_s
        self._returncode: int | None = None
        self._watch: asyncio.Task[None] | None = None

    @property
    def returncode(self) -> int | None:
        """None while the engine runs; its exit status once it exited; -1 when its actor (or
        the actor's node) is gone."""
        return self._returncode

    def watch(self) -> None:
        """Notice, from now on, the engine exiting or the actor dying."""
        self._watch = asyncio.get_running_loop().create_task(self._wait())

    async def _wait(self) -> None:
        try:
            code = None
            while code is None:
                code = await self.actor.call("wait", WAIT_POLL_S)
            self._returncode = int(code)
        except ray_client.ActorDied:
            self._returncode = -1
        if not self._stopped:
            log.warning("engine %s (%s) is gone (%s)", self.name, self.endpoint, self._returncode)
            # a lost instance holds nothing: Ray would re-place the group (on a node that
            # comes back) and keep its GPUs for an engine that is no more
            with contextlib.suppress(Exception):
                await asyncio.to_thread(ray_client.remove_placement_group, self.pg_id)

    async def log_lines(self) -> str:
        try:
            tail = str(await asyncio.wait_for(self.actor.call("log_tail"), 5.0))
        except Exception:
            return ""
        return f"; last log lines:\n{tail}" if tail else ""

    async def exited_message(self) -> str:
        return (
            f"engine {self.name} ({self.endpoint}) exited ({self._returncode}) "
            "before it became ready" + await self.log_lines()
        )

    async def _stop(self) -> None:
        """Stop the engine, then remove the placement group (and the actor with it)."""
        if self._returncode is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self.actor.call("stop", self.stop_grace_s), self.stop_grace_s + 10.0
                )
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.to_thread(ray_client.remove_placement_group, self.pg_id)
        if self._returncode is None:
            self._returncode = 0


class RayLauncher:
    """Implements Launcher on a Ray cluster (`address`: `auto`, `HOST:PORT`)."""

    def __init__(
        self,
        address: str = "auto",
        engine: str = "sim",
        *,
        deployment: str = "default",
        time_scale: float = 1.0,
        sim_load_time_s: float | None = None,
        ready_timeout_s: float = 900.0,
        placement_timeout_s: float = 60.0,
        stop_grace_s: float = 10.0,
        engine_host: str | None = None,
        vllm_command: Sequence[str] = VLLM_COMMAND,
        env: dict[str, str] | None = None,
    ) -> None:
        """`engine_host`: the address engines bind (default: their node's Ray address)."""
        check_engine(engine)
        self.address = address
        self.engine = engine
        self.deployment = deployment
        self.time_scale = time_scale
        self.sim_load_time_s = sim_load_time_s
        self.ready_timeout_s = ready_timeout_s
        self.placement_timeout_s = placement_timeout_s
        self.stop_grace_s = stop_grace_s
        self.engine_host = engine_host
        self.vllm_command = tuple(vllm_command)
        self.env = env or {}
        self.num_leftovers_removed = 0
        self._connected = False
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        """Join the Ray cluster and remove the placement groups a previous controller of this
        deployment left (it crashed: nothing else leaves them), unless `adopt` took them."""
        async with self._lock:
            if self._connected:
                return
            await asyncio.to_thread(ray_client.connect, self.address)
            await self._remove_leftovers(keep=())
            self._connected = True

    async def adopt(self, records: Sequence[InstanceRecord]) -> Mapping[int, EngineHandle]:
        """After a controller restart, before anything is launched: the engines of `records`
        (the store's live instances) that still run, by record id — their placement group
        (named after the instance and its GPUs) created, its actor alive and listening at the
        recorded endpoint; their /health is for the caller to ask. Every other placement
        group of this deployment is removed."""
        async with self._lock:
            await asyncio.to_thread(ray_client.connect, self.address)
            prefix = pg_prefix(self.deployment)
            created: dict[str, list[str]] = {}  # placement group name -> ids of live ones
            for pg in await asyncio.to_thread(ray_client.placement_groups):
                if pg.name.startswith(prefix) and pg.state == "CREATED":
                    created.setdefault(pg.name, []).append(pg.pg_id)
            handles: dict[int, EngineHandle] = {}
            for rec in records:
                for pg_id in created.pop(pg_name(self.deployment, rec.name, rec.gpu_ids), []):
                    handle = await self._reattach(rec, pg_id)
                    if handle is not None:
                        handles[rec.id] = handle
                        break
            kept = {h.pg_id for h in handles.values() if isinstance(h, RayEngine)}
            await self._remove_leftovers(keep=kept)
            self._connected = True
        return handles

    async def _reattach(self, rec: InstanceRecord, pg_id: str) -> RayEngine | None:
        """A handle on the engine in placement group `pg_id` if its actor lives and listens
        where the store says (it reports the engine's death from now on, as at launch)."""
        actor = await asyncio.to_thread(ray_client.get_actor, actor_name(pg_id))
        if actor is None:
            return None
        try:
            endpoint = str(await asyncio.wait_for(actor.call("endpoint"), 10.0))
        except (ray_client.ActorDied, TimeoutError):
            return None
        if endpoint != rec.endpoint:
            return None
        handle = RayEngine(rec.name, endpoint, actor, pg_id, self.stop_grace_s)
        handle._cold_start_s = rec.cold_start_s or 0.0
        handle.watch()
        return handle

    async def _remove_leftovers(self, keep: Collection[str]) -> None:
        """Remove this deployment's placement groups but those in `keep` (ids)."""
        prefix = pg_prefix(self.deployment)
        for pg in await asyncio.to_thread(ray_client.placement_groups):
            if pg.name.startswith(prefix) and pg.state != "REMOVED" and pg.pg_id not in keep:
                log.warning("removing placement group %s left by a previous run", pg.name)
                await asyncio.to_thread(ray_client.remove_placement_group, pg.pg_id)
                self.num_leftovers_removed += 1

    def command(self, spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
        """The engine's argv (with placeholders the actor fills on its node) and environment."""
        # (Ray sets CUDA_VISIBLE_DEVICES to the GPUs of the actor's bundle)
        env = {**self.env, **engine_env(self.engine, spec, set_devices=False)}
        argv = engine_argv(
            self.engine,
            spec,
            "{host}",
            "{port}",
            sim_command=SIM_ARGV,
            vllm_command=self.vllm_command,
            cluster="{topology}" if spec.topology is not None else None,
            time_scale=self.time_scale,
            load_time_s=self.sim_load_time_s,
        )
        return argv, env

    async def start(self, spec: EngineSpec) -> RayEngine:
        if not spec.placement:
            raise LaunchError(f"engine {spec.name}: the Ray launcher needs the spec's placement")
        await self.connect()
        started = time.monotonic()
        alive = {node_name(n): n for n in await asyncio.to_thread(ray_client.nodes) if n.alive}
        missing = sorted({p.node for p in spec.placement if p.node not in alive})
        if missing:
            raise LaunchError(
                f"engine {spec.name}: no live Ray node named {', '.join(missing)} "
                f"(live: {', '.join(sorted(alive)) or 'none'})"
            )
        node_ids = [alive[p.node].node_id for p in spec.placement]
        if self.engine == "vllm" and len(set(node_ids)) > 1:
            raise LaunchError(
                f"engine {spec.name}: vLLM across nodes needs its Ray executor inside the "
                "placement group, which this launcher does not start yet; use --engine sim "
                "or a plan on one node"
            )
        name = pg_name(self.deployment, spec.name, [p.gpu_id for p in spec.placement])
        pg = await asyncio.to_thread(
            ray_client.create_placement_group,
            [{"GPU": 1.0}] * len(spec.placement),
            "STRICT_PACK" if len(set(node_ids)) == 1 else "PACK",
            name,
            node_ids,
        )
        if not await asyncio.to_thread(pg.ready, self.placement_timeout_s):
            await asyncio.to_thread(pg.remove)
            raise LaunchError(
                f"engine {spec.name}: Ray could not reserve GPUs "
                f"{', '.join(p.gpu_id for p in spec.placement)} within "
                f"{self.placement_timeout_s:g} s (held by other Ray work?)"
            )
        argv, env = self.command(spec)
        first = spec.placement[0].node
        indices = [str(p.index) for p in spec.placement if p.node == first]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(indices)
        try:
            actor = await asyncio.to_thread(
                ray_client.start_actor,
                EngineProcess,
                [spec.name, argv, env, self.engine_host, spec.topology],
                pg,
                0,
                1.0,
                actor_name(pg.pg_id),
            )
            endpoint = str(await asyncio.wait_for(actor.call("endpoint"), self.ready_timeout_s))
        except (ray_client.ActorDied, TimeoutError) as exc:
            await asyncio.to_thread(pg.remove)
            raise LaunchError(f"engine {spec.name}: its Ray actor did not start: {exc}") from None
        handle = RayEngine(spec.name, endpoint, actor, pg.pg_id, self.stop_grace_s)
        handle.watch()
        await wait_ready(handle, self.ready_timeout_s)
        handle._cold_start_s = time.monotonic() - started
        return handle
