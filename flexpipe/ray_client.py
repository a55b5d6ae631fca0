"""The small, typed part of Ray that flexpipe uses: connect, list nodes and placement groups,
create and remove placement groups, start an actor in a bundle, run a task on a node.

Ray is an optional extra (`pip install flexpipe[ray]`): it is imported here, lazily, and
nowhere else, so flexpipe works (and type-checks) without it. Ray's own types are partial;
everything that leaves this module is a plain, typed value. Every call blocks (Ray's client
API does): async callers run them in a thread, except `ActorRef.call`, which returns an
awaitable.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

T = TypeVar("T")

__all__ = [
    "NODE_ID_LABEL",
    "ActorDied",
    "ActorRef",
    "PlacementGroupRef",
    "RayNode",
    "RayPlacementGroup",
    "RayUnavailable",
    "connect",
    "create_placement_group",
    "get_actor",
    "nodes",
    "placement_groups",
    "remove_placement_group",
    "run_on_nodes",
    "start_actor",
]

NODE_ID_LABEL = "ray.io/node-id"  # set by Ray on every node: pins a bundle to one node
NAMESPACE = "flexpipe"


class RayUnavailable(RuntimeError, ValueError):
    """Ray is not installed, or the cluster cannot be reached; one line for the user (a
    ValueError too: the CLI prints it as `error: ...`)."""


class ActorDied(RuntimeError):
    """The actor (or its node) is gone."""


def _ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise RayUnavailable(
            "Ray is not installed: pip install 'flexpipe[ray]' (on every node of the cluster)"
        ) from None


def _module(name: str) -> Any:
    _ray()
    return importlib.import_module(name)


def connect(address: str, namespace: str = NAMESPACE) -> None:
    """Join the Ray cluster at `address` (`auto`, `HOST:PORT`, `ray://HOST:10001`) as a
    driver, once per process."""
    ray = _ray()
    if ray.is_initialized():
        return
    try:
        ray.init(
            address=address,
            namespace=namespace,
            log_to_driver=False,
            logging_level="warning",
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RayUnavailable(f"cannot reach the Ray cluster at {address!r}: {first}") from None


def disconnect() -> None:
    ray = _ray()
    if ray.is_initialized():
        ray.shutdown()


@dataclass(frozen=True, slots=True)
class RayNode:
    node_id: str  # hex
    alive: bool
    ip: str
    hostname: str
    labels: Mapping[str, str]
    total: Mapping[str, float]  # resource -> amount the node declares
    available: Mapping[str, float]  # resource -> amount not held by any task, actor or bundle


def nodes() -> list[RayNode]:
    """Every node Ray knows of (dead ones too, `alive=False`), with its resources."""
    ray = _ray()
    available: dict[str, dict[str, float]] = {}
    try:
        per_node = ray._private.state.available_resources_per_node()
        available = {str(k): {str(r): float(v) for r, v in d.items()} for k, d in per_node.items()}
    except Exception:  # an older Ray without it: treat everything as free
        available = {}
    out = []
    for n in ray.nodes():
        node_id = str(n["NodeID"])
        total = {str(k): float(v) for k, v in dict(n.get("Resources") or {}).items()}
        out.append(
            RayNode(
                node_id=node_id,
                alive=bool(n.get("Alive", n.get("alive", False))),
                ip=str(n.get("NodeManagerAddress", "")),
                hostname=str(n.get("NodeManagerHostname", "")),
                labels={str(k): str(v) for k, v in dict(n.get("Labels") or {}).items()},
                total=total,
                # Ray leaves out a resource none of which is available: that one is 0
                available=(
                    {r: available[node_id].get(r, 0.0) for r in total}
                    if node_id in available
                    else total
                ),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class RayPlacementGroup:
    pg_id: str  # hex
    name: str
    state: str  # PENDING, CREATED, REMOVED, RESCHEDULING
    bundles: tuple[Mapping[str, float], ...]
    bundle_nodes: tuple[str | None, ...]  # node id of each bundle (None: not placed)


def placement_groups() -> list[RayPlacementGroup]:
    """Every placement group of the cluster (all namespaces), removed ones included."""
    ray = _ray()
    table = cast(dict[str, dict[str, Any]], ray.util.placement_group_table())
    out = []
    for pg_id, info in table.items():
        bundles = dict(info.get("bundles") or {})
        nodes_of = dict(info.get("bundles_to_node_id") or {})
        keys = sorted(bundles, key=int)
        out.append(
            RayPlacementGroup(
                pg_id=str(pg_id),
                name=str(info.get("name") or ""),
                state=str(info.get("state") or ""),
                bundles=tuple({str(r): float(v) for r, v in bundles[k].items()} for k in keys),
                bundle_nodes=tuple((str(nodes_of[k]) if nodes_of.get(k) else None) for k in keys),
            )
        )
    return out


class PlacementGroupRef:
    """A placement group this process created."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg

    @property
    def pg_id(self) -> str:
        return str(self._pg.id.hex())

    def ready(self, timeout_s: float) -> bool:
        """Wait until every bundle is reserved; False if that takes longer than timeout_s."""
        ray = _ray()
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout_s)
        return bool(ready)

    def remove(self) -> None:
        remove_placement_group(self.pg_id)


def create_placement_group(
    bundles: Sequence[Mapping[str, float]],
    strategy: str,
    name: str,
    node_ids: Sequence[str] | None = None,
    detached: bool = True,
) -> PlacementGroupRef:
    """Reserve bundles; `node_ids[i]` pins bundle i to that node (a label selector on Ray's
    own node-id label). Detached: it outlives this driver until removed."""
    ray = _ray()
    selectors = [{NODE_ID_LABEL: n} for n in node_ids] if node_ids is not None else None
    pg = ray.util.placement_group(
        [dict(b) for b in bundles],
        strategy=strategy,
        name=name,
        lifetime="detached" if detached else None,
        bundle_label_selector=selectors,
    )
    return PlacementGroupRef(pg)


def remove_placement_group(pg_id: str) -> None:
    """Remove a placement group by id; its actors die with it. Gone already: nothing."""
    ray = _ray()
    pg_id_type = _module("ray._raylet").PlacementGroupID
    pg_type = _module("ray.util.placement_group").PlacementGroup
    try:
        ray.util.remove_placement_group(pg_type(pg_id_type(bytes.fromhex(pg_id))))
    except Exception as exc:  # already removed
        if "does not exist" not in str(exc) and "not found" not in str(exc).lower():
            raise


class ActorRef:
    """An actor this process started. `call` returns an awaitable of the method's result;
    a dead actor (or node) raises ActorDied."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def call(self, method: str, *args: Any) -> Awaitable[Any]:
        ref = getattr(self._actor, method).remote(*args)
        return _await_ref(ref)

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            _ray().kill(self._actor, no_restart=True)


async def _await_ref(ref: Any) -> Any:
    ray = _ray()
    try:
        return await ref
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
        raise ActorDied(str(exc).strip().splitlines()[0] if str(exc).strip() else "dead") from None


def get_actor(name: str, namespace: str = NAMESPACE) -> ActorRef | None:
    """A named (detached) actor another driver started, e.g. a controller before its restart;
    None when there is none by that name (it died, or its placement group was removed)."""
    ray = _ray()
    try:
        return ActorRef(ray.get_actor(name, namespace=namespace))
    except ValueError:
        return None


def start_actor(
    cls: type,
    args: Sequence[Any],
    pg: PlacementGroupRef,
    bundle_index: int,
    num_gpus: float,
    name: str | None = None,
    max_concurrency: int = 4,
    env: Mapping[str, str] | None = None,
) -> ActorRef:
    """Start `cls(*args)` as a detached actor in one bundle of `pg`."""
    ray = _ray()
    strategies = _module("ray.util.scheduling_strategies")
    remote_cls = ray.remote(cls)
    options: dict[str, Any] = {
        "num_cpus": 0,
        "num_gpus": num_gpus,
        "lifetime": "detached",
        "max_concurrency": max_concurrency,
        "max_restarts": 0,
        "scheduling_strategy": strategies.PlacementGroupSchedulingStrategy(
            pg._pg, placement_group_bundle_index=bundle_index
        ),
    }
    if name:
        options["name"] = name
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    return ActorRef(remote_cls.options(**options).remote(*args))


def run_on_nodes(node_ids: Sequence[str], fn: Callable[[], T], timeout_s: float) -> dict[str, T]:
    """Run `fn()` on each node at once (no CPU, GPU or memory reserved); the answers of the
    nodes that gave one within timeout_s (a node whose task fails or is late is absent)."""
    ray = _ray()
    strategies = _module("ray.util.scheduling_strategies")
    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {
        node_id: task.options(
            scheduling_strategy=strategies.NodeAffinitySchedulingStrategy(node_id, soft=False)
        ).remote()
        for node_id in node_ids
    }
    done, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for ref in late:
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
    out: dict[str, T] = {}
    finished = set(done)
    for node_id, ref in refs.items():
        if ref in finished:
            with contextlib.suppress(Exception):
                out[node_id] = cast(T, ray.get(ref))
    return out
