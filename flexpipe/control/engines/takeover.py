"""What one controller leaves to the next (docs/controller.md, "Crash safety"), apart from the
Controller class.

While it runs, every engine is in the store's instance registry from its spawn on (the local
launcher's `on_spawn` hook, before the engine is ready; the Ray launcher's engines from when
they are ready: its `adopt` removes placement groups the store does not know) and follows its
lifecycle there, so a controller killed at any moment leaves no engine its successor does not
know of. After a restart, the successor closes the shift log's pending changes as aborted,
takes the policy's shift history back, asks the launcher which of the registry's live
instances still run (`AdoptingLauncher.adopt`: a handle on each), probes their /health and
reads the memory fraction each runs with (adopt.py: one that shares its GPU keeps its share),
adopts those today's plan keeps — no duplicate launch —, and drains and stops the others once
the plan serves (make before break, as a shift). One path for every launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, MutableMapping, Sequence

from flexpipe.cluster import Cluster
from flexpipe.control.api.gateway_client import GatewayAdmin, GatewayError
from flexpipe.control.engines.adopt import healthy, memory_fractions
from flexpipe.control.engines.launching import gpu_memory_utilization
from flexpipe.control.executor import LiveInstance
from flexpipe.gears.gear import parse_gear
from flexpipe.launch import AdoptingLauncher, EngineHandle, EngineSpec
from flexpipe.lifecycle import State
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.snapshot import ShiftRecord, instance_key
from flexpipe.store.instance_registry import InstanceRecord, InstanceRegistry
from flexpipe.store.shift_log import ShiftLog

__all__ = ["Takeover", "shared_fraction", "stub"]


class Takeover:
    """The store's side of a controller's engines: the spawn registry and the instance
    lifecycle it records while running, the adoption of survivors after a restart. With no
    store (`registry` None) every step is a no-op."""

    def __init__(
        self,
        registry: InstanceRegistry | None,
        shift_log: ShiftLog | None,
        launcher: AdoptingLauncher,
        gateway: GatewayAdmin,
        engine_kind: str,
        engine_admin_token: str | None,
        drain_deadline_s: float,
        say: Callable[[str], None],
    ) -> None:
        self.registry = registry
        self.shift_log = shift_log
        self.launcher = launcher
        self.gateway = gateway
        self.engine_kind = engine_kind
        self.engine_admin_token = engine_admin_token
        self.drain_deadline_s = drain_deadline_s
        self.say = say
        self._spawned_ids: dict[str, int] = {}  # endpoint -> registry id, not yet claimed
        self._handles: dict[int, EngineHandle] = {}  # registry id -> survivor's handle
        # registry id -> the --gpu-memory-utilization a survivor reports (its /metrics)
        self.fractions: dict[int, float] = {}

    # ------------------------------------------------------------------ while running
    def spawned(self, spec: EngineSpec, pid: int, endpoint: str) -> None:
        """An engine process exists (not ready yet): in the store from now on, so that a
        controller killed during its cold start leaves no engine unknown to its successor
        (which finds it unreachable or not in its plan, and stops it)."""
        assert self.registry is not None
        model = spec.served_model_name or spec.model
        record = self.registry.register(
            spec.name,
            model,
            str(spec.gear),
            spec.gpu_ids,
            endpoint,
            self.engine_kind,
            pid=pid,
            pgid=pid,
        )
        self._spawned_ids[endpoint] = record.id

    def sweep_spawned(self) -> None:
        """Engines spawned that never became an instance (did not get ready, stopped): gone."""
        if self.registry is None:
            return
        for endpoint, record_id in list(self._spawned_ids.items()):
            del self._spawned_ids[endpoint]
            if self.registry.get(record_id).live:
                self.registry.mark_gone(record_id, "the engine did not start")

    def record_state(self, inst: LiveInstance, state: str) -> None:
        """An instance entered `state`: registered on its first state (claiming the record
        its spawn made, if any), then moved through the lifecycle in the store."""
        if self.registry is None:
            return
        p = inst.planned
        if inst.store_id is None and inst.url in self._spawned_ids:
            inst.store_id = self._spawned_ids.pop(inst.url)
            pid = getattr(inst.handle, "pid", None)
            self.registry.set_process(inst.store_id, pid, pid, None, inst.handle.cold_start_s)
            if state == "starting":
                return
        if inst.store_id is None:
            pid = getattr(inst.handle, "pid", None)
            record = self.registry.register(
                p.name,
                p.model,
                str(p.gear),
                p.gpu_ids,
                inst.url,
                self.engine_kind,
                pid=pid,
                pgid=pid,
            )
            inst.store_id = record.id
            self.registry.set_process(record.id, pid, pid, inst.url, inst.handle.cold_start_s)
            if state == "starting":
                return
        if self.registry.get(inst.store_id).state != state:
            self.registry.transition(inst.store_id, state)

    # ------------------------------------------------------------------ after a restart
    def resume_history(self) -> list[ShiftRecord] | None:
        """Changes the previous controller left pending are closed as aborted; the policy's
        shift history (cooldown and blacklist survive). None with no store."""
        if self.registry is None or self.shift_log is None:
            return None
        for entry in self.shift_log.pending():
            assert entry.id is not None
            self.shift_log.update_outcome(
                entry.id, outcome="aborted", error="the controller restarted mid-change"
            )
        return list(self.shift_log.history())

    async def survivors(self) -> list[InstanceRecord]:
        """The live instances of the store's registry that the launcher still runs and whose
        engine answers /health; the others are gone (what is left of them stopped, out of the
        gateway). The launcher removes what else of its own a previous controller left. Call
        after `resume_history`, before launching anything."""
        if self.registry is None or self.shift_log is None:
            return []
        handles = await self.launcher.adopt(self.registry.live_instances())
        ok = await healthy(handles)
        # e.g. an engine killed with its controller mid cold start
        await asyncio.gather(*(h.stop() for i, h in handles.items() if i not in ok))
        adopted, gone = self.registry.reconcile(ok, "not reachable after a controller restart")
        self._handles = {i: handles[i] for i in ok}
        self.fractions = await memory_fractions(self._handles)
        if gone:
            urls = {i["url"] for i in await self.gateway.instances()}
            for rec in gone:
                if rec.endpoint in urls:
                    with contextlib.suppress(GatewayError):
                        await self.gateway.remove(rec.endpoint)
        return adopted

    def fraction_of(self, record: InstanceRecord, cluster: Cluster) -> float | None:
        """A survivor's memory fraction when it shares its GPU (`shared_fraction`, from what
        its engine reported to `survivors`), else None."""
        alone = gpu_memory_utilization(cluster, record.gpu_ids)
        return shared_fraction(self.fractions.get(record.id), alone, record.gpu_ids)

    async def adopt(
        self,
        planned: Sequence[PlannedInstance],
        adopted: Sequence[InstanceRecord],
        running: MutableMapping[str, LiveInstance],
    ) -> list[InstanceRecord]:
        """Take over into `running` the surviving instances that the plan has (they serve: a
        shift cut short left them starting, rehearsing or draining). Returns those it lacks:
        drained and stopped once the plan serves (`retire`)."""
        if self.registry is None or not adopted:
            return []
        gateway = {i["url"]: str(i.get("state")) for i in await self.gateway.instances()}
        by_key = {_flat_key(p.model, p.gear.key(), p.gpu_ids): p for p in planned}
        leaving = []
        for rec in adopted:
            p = by_key.get(_flat_key(rec.model, parse_gear(rec.gear).key(), rec.gpu_ids))
            if p is None:
                leaving.append(rec)
                continue
            inst = LiveInstance(p, self._handles.pop(rec.id), rec.state.value, rec.id)
            running[instance_key(p)] = inst
            if rec.endpoint not in gateway:
                await self.gateway.add(
                    rec.endpoint, p.model, p.gear.max_num_seqs, admin_token=self.engine_admin_token
                )
            elif gateway[rec.endpoint] != State.ACTIVE.value:
                # cut short mid-shift (starting, rehearsing or draining): it serves again
                await self.gateway.set_state(rec.endpoint, State.ACTIVE.value)
            if rec.state is not State.ACTIVE:
                self.registry.transition(rec.id, State.ACTIVE, reason="adopted")
                inst.state = "active"
        if running:
            self.say(f"controller: adopted {len(running)} running instance(s)")
        return leaving

    async def retire(self, leaving: Sequence[InstanceRecord]) -> None:
        """Live instances of the previous controller that today's plan lacks: drained and
        stopped (after the plan serves, or first where a new instance needs their GPUs)."""
        assert self.registry is not None or not leaving
        for rec in leaving:
            with contextlib.suppress(GatewayError):
                await self.gateway.drain(rec.endpoint, self.drain_deadline_s)
            with contextlib.suppress(GatewayError):
                await self.gateway.remove(rec.endpoint)
            handle = self._handles.pop(rec.id, None)
            if handle is not None:
                await handle.stop()
            if self.registry is not None:
                self.registry.mark_gone(rec.id, "not in the plan after a controller restart")


def stub(
    record: InstanceRecord,
    like: Sequence[PlannedInstance],
    gpu_memory_fraction: float | None = None,
) -> PlannedInstance | None:
    """A surviving instance as the planner's `running` input: its model, gear, GPUs and, when
    it shares its GPU, its memory fraction (`shared_fraction`; the planner re-evaluates it as
    it runs; the rest is copied from an instance of the same model in `like`). None for a
    model no longer planned. Stages: the GPUs in order, `tp` each; layers split evenly (as the
    sim engine does)."""
    template = next((p for p in like if p.model == record.model), None)
    if template is None:
        return None
    gear = parse_gear(record.gear)
    ids = record.gpu_ids
    stages = tuple(tuple(ids[i : i + gear.tp]) for i in range(0, len(ids), gear.tp))
    num_layers = sum(template.layers_per_stage)
    base, extra = divmod(num_layers, max(1, len(stages)))
    layers = tuple(base + (1 if i < extra else 0) for i in range(len(stages)))
    return dataclasses.replace(
        template,
        name=record.name,
        gear=gear,
        stages=stages,
        layers_per_stage=layers,
        gpu_memory_fraction=gpu_memory_fraction,
    )


def shared_fraction(reported: float | None, alone: float, gpu_ids: Sequence[str]) -> float | None:
    """A survivor's memory fraction when it shares its GPU (docs/gpu-sharing.md), else None:
    what its engine reports (`reported`, its --gpu-memory-utilization), when that is below
    what an engine alone on its GPUs is launched with (`alone`, control/engines/launching.py's
    `gpu_memory_utilization`). Only single-GPU instances share."""
    if reported is None or len(gpu_ids) != 1:
        return None
    # (both rounded to 1/1000 at launch: a smaller one is a share, not float noise)
    return reported if reported < alone - 5e-4 else None


def _flat_key(model: str, gear_key: str, gpu_ids: Sequence[str]) -> str:
    """Model, gear and GPUs in order: what a registry record and a planned instance share."""
    return f"{model}|{gear_key}|{','.join(gpu_ids)}"
