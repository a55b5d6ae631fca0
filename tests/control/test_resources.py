"""GPUs that come and go: cluster diffs, the admin's overrides, the cluster file watcher, and
`flexpipe cluster occupy|release` against a real HTTP server that implements the admin API's
contract (flexpipe.http.server on 127.0.0.1, the same Resources core the controller uses)."""

from __future__ import annotations

import asyncio
import getpass
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_gateway_fakes import LoopThread
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.cluster import Cluster, ClusterError, load_cluster, parse_cluster
from flexpipe.control.api.client import (
    OCCUPY_PATH,
    RELEASE_PATH,
    STATUS_PATH,
    AsyncControllerClient,
    ControllerClient,
    ControllerError,
    OccupyRequest,
    ReleaseRequest,
    admin_answer,
    bearer_ok,
    resolve_token,
)
from flexpipe.control.core.resources import (
    EventKind,
    Occupation,
    Overrides,
    ResourceError,
    ResourceEvent,
    Resources,
    UnknownGpuError,
    apply,
    diff,
)
from flexpipe.control.watch.cluster_watch import ClusterWatch
from flexpipe.hardware import GiB
from flexpipe.http.server import App, HttpError, Request, Response, json_response, serve

ROOT = Path(__file__).resolve().parents[2]
FRAGMENTED = ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"
TENANT = "tenant-b (fine-tuning job)"
NOW = 1_000.0

runner = CliRunner()


@pytest.fixture(scope="module")
def base() -> Cluster:
    return load_cluster(FRAGMENTED)


def doc_of(cluster: Cluster) -> dict[str, Any]:
    return cluster.to_doc()


# -- diff --------------------------------------------------------------------------------------


def test_same_cluster_has_no_events(base: Cluster) -> None:
    assert diff(base, base, NOW) == []
    assert diff(base, parse_cluster(doc_of(base)), NOW) == []


def test_tenant_leaving_gpu1_frees_40_gib(base: Cluster) -> None:
    after = base.with_used("gpu1", 0)
    assert diff(base, after, NOW) == [
        ResourceEvent(
            "gpu1",
            "node1",
            EventKind.FREED,
            NOW,
            40 * GiB,
            None,
            f"gpu1: {TENANT} released 40.0 GiB (80.0 GiB free now)",
        )
    ]


def test_more_memory_used_by_others_is_occupied_now(base: Cluster) -> None:
    after = base.with_used("gpu2", 60 * GiB, owner="job-7")
    (event,) = diff(base, after, NOW)
    assert event == ResourceEvent(
        "gpu2",
        "node1",
        EventKind.OCCUPIED,
        NOW,
        60 * GiB,
        NOW,
        "gpu2: job-7 took 60.0 GiB (holds 60.0 GiB, 20.0 GiB left free)",
    )
    assert event.has_deadline and event.grace_s == 0.0
    more = diff(after, after.with_used("gpu2", 70 * GiB), NOW)
    assert [(e.kind, e.num_bytes) for e in more] == [(EventKind.OCCUPIED, 10 * GiB)]
    assert more[0].why == "gpu2: another tenant took 10.0 GiB (holds 70.0 GiB, 10.0 GiB left free)"


def test_lease_set_earlier_later_and_lifted(base: Cluster) -> None:
    leased = base.with_gpu("gpu3", free_until_s=1_600.0)
    (notice,) = diff(base, leased, NOW)
    assert (notice.kind, notice.deadline_s, notice.grace_s) == (EventKind.RECLAIM, 1_600.0, 600.0)
    assert notice.num_bytes == base.gpu("gpu3").free_bytes
    assert notice.why == "gpu3: reclaimed: free only until 1600; vacate within 600 s"

    earlier = leased.with_gpu("gpu3", free_until_s=1_300.0)
    (sooner,) = diff(leased, earlier, NOW)
    assert sooner.kind is EventKind.RECLAIM and sooner.deadline_s == 1_300.0
    assert sooner.why == "gpu3: reclaimed: free only until 1300, was 1600; vacate within 300 s"

    overdue = diff(leased, leased.with_gpu("gpu3", free_until_s=900.0), NOW)
    assert overdue[0].grace_s == 0.0
    assert overdue[0].why.endswith("vacate now (overdue by 100 s)")

    later = diff(leased, leased.with_gpu("gpu3", free_until_s=2_000.0), NOW)
    assert [(e.kind, e.deadline_s, e.why) for e in later] == [
        (EventKind.EXTENDED, None, "gpu3: lease extended: free until 2000 (was until 1600)")
    ]
    lifted = diff(leased, leased.with_gpu("gpu3", free_until_s=None), NOW)
    assert [e.why for e in lifted] == ["gpu3: lease extended: free indefinitely (was until 1600)"]


def test_unix_time_leases_read_as_utc(base: Cluster) -> None:
    now = 1_764_600_000.0  # 2025-12-01T14:40:00Z
    (notice,) = diff(base, base.with_gpu("gpu3", free_until_s=now + 90), now)
    assert notice.why == (
        "gpu3: reclaimed: free only until 1764600090 (2025-12-01T14:41:30Z); vacate within 90 s"
    )


def test_node_gone_and_node_joined(base: Cluster) -> None:
    doc = doc_of(base)
    gone = parse_cluster({**doc, "nodes": doc["nodes"][:2]})
    assert [(e.gpu, e.kind, e.deadline_s, e.why) for e in diff(base, gone, NOW)] == [
        ("gpu3", EventKind.LOST, NOW, "gpu3: node node2 is gone from the cluster")
    ]
    doc["nodes"].append(
        {"name": "node3", "gpus": [{"id": "gpu4", "type": "H100-80G-SXM", "used_gib": 16}]}
    )
    grown = parse_cluster(doc)
    (joined,) = diff(base, grown, NOW)
    assert (joined.gpu, joined.node, joined.kind, joined.num_bytes) == (
        "gpu4",
        "node3",
        EventKind.JOINED,
        64 * GiB,
    )
    assert joined.why == "gpu4: joined (H100-80G-SXM on new node node3, 64.0 GiB free)"
    assert joined.deadline_s is None and joined.grace_s is None


def test_gpu_gone_from_a_remaining_node_and_a_replaced_device(base: Cluster) -> None:
    doc = doc_of(base)
    doc["nodes"][1]["gpus"] = doc["nodes"][1]["gpus"][:1]
    doc["nodes"][1].pop("links")
    (lost,) = diff(base, parse_cluster(doc), NOW)
    assert (lost.gpu, lost.why, lost.num_bytes) == ("gpu2", "gpu2: gone from the cluster", 80 * GiB)

    doc = doc_of(base)
    doc["nodes"][2]["gpus"][0]["type"] = "L4"
    events = diff(base, parse_cluster(doc), NOW)
    assert [(e.gpu, e.kind) for e in events] == [
        ("gpu3", EventKind.LOST),
        ("gpu3", EventKind.JOINED),
    ]
    assert events[0].why == "gpu3: replaced: was L40S index 0 on node2, now L4 index 0 on node2"


def test_events_are_sorted_most_urgent_first_then_file_order(base: Cluster) -> None:
    doc = doc_of(base)
    doc["nodes"] = [n for n in doc["nodes"] if n["name"] != "node0"]  # gpu0 lost
    doc["nodes"][0]["gpus"][0].pop("used_gib")  # gpu1 freed
    doc["nodes"][0]["gpus"][1]["used_gib"] = 8  # gpu2 occupied
    doc["nodes"][1]["gpus"][0]["free_until_s"] = 1_200.0  # gpu3 reclaimed
    doc["nodes"].append({"name": "node9", "gpus": [{"id": "gpu9", "type": "L4"}]})
    events = diff(base, parse_cluster(doc), NOW)
    assert [(e.gpu, e.kind.value) for e in events] == [
        ("gpu0", "lost"),
        ("gpu2", "occupied"),
        ("gpu3", "reclaim"),
        ("gpu1", "freed"),
        ("gpu9", "joined"),
    ]
    assert [e.deadline_s for e in events] == [NOW, NOW, 1_200.0, None, None]


def test_event_json_round_trip(base: Cluster) -> None:
    events = diff(base, base.with_gpu("gpu3", free_until_s=1_600.0).with_used("gpu1", 0), NOW)
    assert [ResourceEvent.from_json(e.to_json()) for e in events] == events
    assert events[0].to_json() == {
        "gpu": "gpu3",
        "node": "node2",
        "kind": "reclaim",
        "at_s": NOW,
        "num_bytes": base.gpu("gpu3").capacity_bytes,
        "deadline_s": 1_600.0,
        "why": "gpu3: reclaimed: free only until 1600; vacate within 600 s",
    }


# -- overrides ---------------------------------------------------------------------------------


def test_apply_occupies_until_the_time_then_frees(base: Cluster) -> None:
    overrides = Overrides().occupy(["gpu2", "gpu9"], "alice", 1_300.0, NOW)
    assert overrides.occupied["gpu2"] == Occupation("alice", NOW, 1_300.0)
    during = apply(base, overrides, 1_299.0)
    assert during.gpu("gpu2").used_bytes == 80 * GiB and during.gpu("gpu2").owner == "alice"
    assert during.gpu("gpu2").free_bytes == 0.0
    assert during.gpu("gpu1") == base.gpu("gpu1")  # untouched; gpu9 (not in the cluster) ignored
    assert apply(base, overrides, 1_300.0) == base
    assert overrides.next_expiry_s(NOW) == 1_300.0 and overrides.next_expiry_s(1_300.0) is None
    assert overrides.expired(1_300.0) == Overrides()
    forever = Overrides().occupy(["gpu1"], "bob", None, NOW)
    assert apply(base, forever, 1e12).gpu("gpu1").used_bytes == 80 * GiB
    assert forever.release(["gpu1"]) == Overrides()
    both = overrides.occupy(["gpu1"], "bob", None, NOW + 5)
    assert Overrides.from_json(both.to_json()) == both
    assert both.to_json()["gpu1"] == {"owner": "bob", "since_s": NOW + 5, "until_s": None}


@pytest.mark.parametrize(
    ("until_s", "message"),
    [
        (NOW, "until_s 1000 is not in the future (now 1000)"),
        (float("inf"), "until_s must be unix seconds or null, got inf"),
    ],
)
def test_occupy_refuses_a_bad_until(until_s: float, message: str) -> None:
    with pytest.raises(ResourceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Overrides().occupy(["gpu1"], "alice", until_s, NOW)


def test_resources_report_occupy_tick_release_and_file_changes(base: Cluster) -> None:
    res = Resources.of(base, NOW)
    assert res.effective == base and res.next_change_s() is None

    res, events = res.occupy(["gpu2", "gpu2"], "alice", 1_300.0, NOW)
    assert [(e.gpu, e.kind, e.num_bytes, e.why) for e in events] == [
        (
            "gpu2",
            EventKind.OCCUPIED,
            80 * GiB,
            "gpu2: alice took 80.0 GiB (holds 80.0 GiB, 0.0 GiB left free)",
        )
    ]
    assert res.next_change_s() == 1_300.0
    assert res.tick(1_200.0)[1] == []
    # The tenant leaves gpu1 in the file: reported; gpu2 stays occupied.
    res, events = res.file_changed(base.with_used("gpu1", 0), 1_250.0)
    assert [(e.gpu, e.kind) for e in events] == [("gpu1", EventKind.FREED)]
    assert res.effective.gpu("gpu2").free_bytes == 0.0
    # The occupation runs out: gpu2 is free again, its occupation forgotten.
    res, events = res.tick(1_300.0)
    assert [(e.gpu, e.kind, e.why) for e in events] == [
        ("gpu2", EventKind.FREED, "gpu2: alice released 80.0 GiB (80.0 GiB free now)")
    ]
    assert res.overrides == Overrides() and res.effective == base.with_used("gpu1", 0)

    res, _ = res.occupy(["gpu0"], None, None, 1_400.0)
    assert res.effective.gpu("gpu0").owner == "admin"
    assert res.to_json()["gpus"][0]["occupied"] == {
        "owner": "admin",
        "since_s": 1_400.0,
        "until_s": None,
    }
    # A file change under an occupied GPU is not reported: for flexpipe it stays full.
    res, events = res.file_changed(res.file.with_used("gpu0", 4 * GiB, owner="x"), 1_450.0)
    assert events == []
    res, events = res.release(["gpu0"], 1_500.0)
    assert [(e.gpu, e.kind, e.num_bytes) for e in events] == [
        ("gpu0", EventKind.FREED, base.gpu("gpu0").capacity_bytes - 4 * GiB)
    ]


def test_resources_refuse_unknown_gpus_and_releasing_what_the_api_did_not_occupy(
    base: Cluster,
) -> None:
    res = Resources.of(base, NOW)
    with pytest.raises(UnknownGpuError) as info:
        res.occupy(["gpu1", "gpu7", "gpu8"], "alice", None, NOW)
    assert str(info.value) == (
        "unknown GPU 'gpu7', 'gpu8' in cluster fragmented-4gpu; known: gpu0, gpu1, gpu2, gpu3"
    )
    with pytest.raises(ResourceError) as refused:
        res.release(["gpu1"], NOW)
    assert str(refused.value) == (
        "GPU 'gpu1' is not occupied through the admin API (occupied: none); memory a tenant "
        "holds in the cluster file changes with the file"
    )
    with pytest.raises(ResourceError, match="no GPUs given"):
        res.occupy([], "alice", None, NOW)


# -- the watcher -------------------------------------------------------------------------------


def write_atomically(path: Path, text: str, age_s: float = 10.0) -> None:
    """As config tools do (a new inode); mtime `age_s` in the past so reads are not racy."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    stamp = time.time() - age_s
    os.utime(tmp, (stamp, stamp))
    os.replace(tmp, path)


@pytest.fixture
def cluster_file(tmp_path: Path, base: Cluster) -> Path:
    path = tmp_path / "cluster.yaml"
    write_atomically(path, base.to_yaml())
    return path


def test_watch_polls_reports_changes_and_keeps_the_last_good_cluster(
    cluster_file: Path, base: Cluster
) -> None:
    reported: list[str] = []
    watch = ClusterWatch(cluster_file, 2.0, report=reported.append)
    assert watch.cluster == base and watch.num_reads == 1
    assert watch.poll(NOW) is None and watch.num_reads == 1  # stamp unchanged: no read

    write_atomically(cluster_file, base.to_yaml() + "# a comment\n")
    assert watch.poll(NOW) is None and watch.num_reads == 2  # read, same cluster

    write_atomically(cluster_file, base.with_used("gpu1", 0).to_yaml())
    change = watch.poll(NOW)
    assert change is not None
    cluster, events = change
    assert cluster == base.with_used("gpu1", 0) == watch.cluster
    assert [(e.gpu, e.kind) for e in events] == [("gpu1", EventKind.FREED)]

    bad = base.to_yaml().replace("type: L40S", "type: L40X")
    write_atomically(cluster_file, bad)
    for _ in range(3):
        assert watch.poll(NOW) is None
    assert len(reported) == 1
    assert reported[0].startswith(f"{cluster_file}: nodes[2].gpus[0].type: unknown GPU type")
    assert reported[0].endswith("(keeping the last good cluster)")
    assert watch.cluster == base.with_used("gpu1", 0) and watch.error == reported[0]

    cluster_file.unlink()
    assert watch.poll(NOW) is None and watch.poll(NOW) is None
    assert reported[1:] == [
        f"{cluster_file}: cannot read the file: No such file or directory "
        "(keeping the last good cluster)"
    ]
    # Fixed: compared with the last good cluster, not with the broken file.
    write_atomically(cluster_file, base.with_gpu("gpu3", free_until_s=1_600.0).to_yaml())
    change = watch.poll(NOW)
    assert change is not None and watch.error is None
    assert [(e.gpu, e.kind) for e in change[1]] == [
        ("gpu1", EventKind.OCCUPIED),
        ("gpu3", EventKind.RECLAIM),
    ]
    assert len(reported) == 2


def test_watch_rereads_a_file_changed_within_one_mtime_tick(
    cluster_file: Path, base: Cluster
) -> None:
    watch = ClusterWatch(cluster_file)
    one, two = base.with_used("gpu1", 30 * GiB), base.with_used("gpu1", 50 * GiB)
    assert len(one.to_yaml()) == len(two.to_yaml())
    stamp_ns = time.time_ns()
    cluster_file.write_text(one.to_yaml())  # in place: same inode
    os.utime(cluster_file, ns=(stamp_ns, stamp_ns))
    first = watch.poll(NOW)
    assert first is not None and first[0] == one
    cluster_file.write_text(two.to_yaml())  # same size, same mtime: the stamp does not move
    os.utime(cluster_file, ns=(stamp_ns, stamp_ns))
    second = watch.poll(NOW)
    assert second is not None and second[0] == two


def test_watch_changes_runs_on_an_injected_sleep(cluster_file: Path, base: Cluster) -> None:
    sleeps: list[float] = []
    versions = [base.with_used("gpu1", 0), base.with_used("gpu1", 0), base]

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) <= len(versions):
            write_atomically(
                cluster_file, versions[len(sleeps) - 1].to_yaml(), age_s=10 + len(sleeps)
            )

    watch = ClusterWatch(cluster_file, 0.5, sleep=fake_sleep, clock=lambda: 42.0)

    async def first_two() -> list[tuple[Cluster, list[ResourceEvent]]]:
        out = []
        async for change in watch.changes():
            out.append(change)
            if len(out) == 2:
                break
        return out

    changes = asyncio.run(asyncio.wait_for(first_two(), 10))
    assert sleeps == [0.5, 0.5, 0.5]  # the second write changed nothing: no change yielded
    assert [[(e.gpu, e.kind, e.at_s) for e in events] for _, events in changes] == [
        [("gpu1", EventKind.FREED, 42.0)],
        [("gpu1", EventKind.OCCUPIED, 42.0)],
    ]


def test_watch_needs_a_good_first_read_and_a_positive_interval(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="cannot read the file"):
        ClusterWatch(tmp_path / "none.yaml")
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        ClusterWatch(FRAGMENTED, 0)


# -- the contract and its inputs ---------------------------------------------------------------


def test_request_bodies_are_read_strictly() -> None:
    assert OccupyRequest.from_json({"gpus": ["gpu1", "gpu1", " gpu2"], "until_s": 5}) == (
        OccupyRequest(("gpu1", "gpu2"), 5.0, "admin")
    )
    assert ReleaseRequest.from_json({"gpus": ["gpu1"]}) == ReleaseRequest(("gpu1",))
    cases: list[tuple[object, str]] = [
        ([], "the body must be a JSON object"),
        ({"gpus": []}, '"gpus" must be a non-empty list of GPU ids'),
        ({"gpus": "gpu1"}, '"gpus" must be a non-empty list of GPU ids'),
        ({"gpus": [1]}, '"gpus" must hold GPU ids (strings); got 1'),
        ({"gpus": ["g"], "until_s": "10m"}, "\"until_s\" must be unix seconds or null; got '10m'"),
        ({"gpus": ["g"], "until_s": True}, '"until_s" must be unix seconds or null; got True'),
        ({"gpus": ["g"], "owner": ""}, "\"owner\" must be a non-empty string; got ''"),
        ({"gpus": ["g"], "user": "x"}, "unknown field 'user'; allowed: gpus, until_s, owner"),
    ]
    for body, message in cases:
        with pytest.raises(ResourceError) as info:
            OccupyRequest.from_json(body)
        assert str(info.value) == message


def test_resolve_token(tmp_path: Path) -> None:
    env = {"FLEXPIPE_CONTROLLER_TOKEN": "from-env"}
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert resolve_token("given", None, env) == "given"
    assert resolve_token(None, token_file, env) == "from-file"
    assert resolve_token(None, None, env) == "from-env"
    assert resolve_token(None, None, {}) is None
    with pytest.raises(ValueError, match="give --token or --token-file, not both"):
        resolve_token("a", token_file, {})
    with pytest.raises(ValueError, match="cannot read: No such file or directory"):
        resolve_token(None, tmp_path / "nope", {})
    assert bearer_ok(None, None) and bearer_ok("Bearer s3cret", "s3cret")
    assert not bearer_ok("Bearer wrong", "s3cret") and not bearer_ok(None, "s3cret")


# -- a real admin API server and the CLI -------------------------------------------------------


class AdminServer:
    """The admin API's contract on flexpipe.http.server, over the same Resources core (a
    stand-in for the controller's routes, not for the client)."""

    def __init__(self, cluster: Cluster, token: str | None) -> None:
        self.resources = Resources.of(cluster, time.time())
        self.token = token
        self.app = App()
        self.app.route("POST", OCCUPY_PATH)(self.occupy)
        self.app.route("POST", RELEASE_PATH)(self.release)
        self.app.route("GET", STATUS_PATH)(self.status)

    def _auth(self, req: Request) -> None:
        if not bearer_ok(req.headers.get("authorization"), self.token):
            raise HttpError(401, "admin API: missing or wrong bearer token")

    def _change(self, call: Any, gpus: tuple[str, ...]) -> Response:
        try:
            self.resources, events = call()
        except UnknownGpuError as exc:
            raise HttpError(404, str(exc)) from None
        except ResourceError as exc:
            raise HttpError(400, str(exc)) from None
        return json_response(admin_answer(gpus, events))

    async def occupy(self, req: Request) -> Response:
        self._auth(req)
        try:
            body = OccupyRequest.from_json(req.json())
        except ResourceError as exc:
            raise HttpError(400, str(exc)) from None
        return self._change(
            lambda: self.resources.occupy(body.gpus, body.owner, body.until_s, time.time()),
            body.gpus,
        )

    async def release(self, req: Request) -> Response:
        self._auth(req)
        try:
            body = ReleaseRequest.from_json(req.json())
        except ResourceError as exc:
            raise HttpError(400, str(exc)) from None
        return self._change(lambda: self.resources.release(body.gpus, time.time()), body.gpus)

    async def status(self, req: Request) -> Response:
        self._auth(req)
        return json_response({"resources": self.resources.to_json()})


@pytest.fixture
def admin(base: Cluster) -> Iterator[tuple[AdminServer, str]]:
    loop = LoopThread()
    server_state = AdminServer(base, token="s3cret")
    server = loop.run(serve(server_state.app, "127.0.0.1", 0))
    try:
        yield server_state, f"http://127.0.0.1:{server.port}"
    finally:
        loop.run(server.close())
        loop.stop()


def cli(url: str, *args: str, token: str | None = "s3cret") -> Any:
    extra = ["--controller", url] + (["--token", token] if token else [])
    return runner.invoke(app, ["cluster", *args, *extra], env={"FLEXPIPE_CONTROLLER_TOKEN": ""})


def test_cli_occupy_and_release_through_a_real_admin_api(
    admin: tuple[AdminServer, str], base: Cluster
) -> None:
    server, url = admin
    before = time.time()
    result = cli(url, "occupy", "gpu2", "--until", "10m", "--owner", "alice")
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith("occupied gpu2 for alice until ")
    assert line.endswith(": gpu2: alice took 80.0 GiB (holds 80.0 GiB, 0.0 GiB left free)")
    occupation = server.resources.overrides.occupied["gpu2"]
    assert occupation.owner == "alice"
    assert (
        occupation.until_s is not None and before + 600 <= occupation.until_s <= time.time() + 600
    )

    status = ControllerClient(url, "s3cret").status()
    gpu2 = next(g for g in status["resources"]["gpus"] if g["id"] == "gpu2")
    assert gpu2["free_bytes"] == 0.0 and gpu2["occupied"]["owner"] == "alice"

    again = cli(url, "occupy", "gpu1", "gpu2")  # gpu2 already full: only gpu1's 40 GiB
    assert again.exit_code == 0, again.output
    assert again.stdout.strip() == (
        f"occupied gpu1, gpu2 for {getpass.getuser()} until released: gpu1: "
        f"{getpass.getuser()} took 40.0 GiB (holds 80.0 GiB, 0.0 GiB left free)"
    )

    released = cli(url, "release", "gpu1", "gpu2")
    assert released.exit_code == 0, released.output
    assert released.stdout.strip() == (
        f"released gpu1, gpu2: gpu1: {getpass.getuser()} released 40.0 GiB (40.0 GiB free now); "
        f"gpu2: {getpass.getuser()} released 80.0 GiB (80.0 GiB free now)"  # took it over
    )
    assert server.resources.effective == base


@pytest.mark.parametrize(
    ("args", "token", "code", "message"),
    [
        (
            ["occupy", "gpu7"],
            "s3cret",
            1,
            "error: the controller refused (404): unknown GPU 'gpu7' in cluster "
            "fragmented-4gpu; known: gpu0, gpu1, gpu2, gpu3",
        ),
        (
            ["release", "gpu1"],
            "s3cret",
            1,
            "error: the controller refused (400): GPU 'gpu1' is not occupied through the admin "
            "API (occupied: none); memory a tenant holds in the cluster file changes with the file",
        ),
        (
            ["occupy", "gpu1"],
            "wrong",
            1,
            "error: the controller refused (401): admin API: missing or wrong bearer token "
            "(give --token, --token-file or $FLEXPIPE_CONTROLLER_TOKEN)",
        ),
        (
            ["occupy", "gpu1", "--until", "soon"],
            "s3cret",
            2,
            "error: --until 'soon': expected a duration (90s, 10m, 2h, 1h30m, 1d) or an ISO "
            "time (2026-12-01T15:00, 2026-12-01T15:00:00Z)",
        ),
    ],
)
def test_cli_errors_are_one_line(
    admin: tuple[AdminServer, str], args: list[str], token: str, code: int, message: str
) -> None:
    _, url = admin
    result = cli(url, *args, token=token)
    assert result.exit_code == code
    assert result.stderr.strip() == message and "Traceback" not in result.output


def test_cli_unreachable_controller_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    result = cli(url, "release", "gpu1")
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"error: cannot reach the controller at {url}: connection refused (is `flexpipe "
        "controller` running? --controller gives its URL)"
    )
    bad_url = cli("localhost:8100", "release", "gpu1")
    assert bad_url.exit_code == 2
    assert (
        bad_url.stderr.strip()
        == "error: controller URL 'localhost:8100': expected http://HOST:PORT"
    )


def test_async_client_speaks_the_same_contract(admin: tuple[AdminServer, str]) -> None:
    server, url = admin

    async def calls() -> tuple[Any, ...]:
        client = AsyncControllerClient(url, "s3cret")
        try:
            taken = await client.occupy(["gpu3"], time.time() + 60, "bob")
            status = await client.status()
            with pytest.raises(ControllerError) as refused:
                await client.release(["gpu0"])
            given = await client.release(["gpu3"])
            return taken, status, refused.value, given
        finally:
            await client.close()

    taken, status, refused, given = asyncio.run(calls())
    assert taken.gpus == ("gpu3",) and [e.kind for e in taken.events] == [EventKind.OCCUPIED]
    assert taken.summary().startswith("gpu3: bob took ")
    assert [g["occupied"] is not None for g in status["resources"]["gpus"]] == [
        False,
        False,
        False,
        True,
    ]
    assert refused.status == 400 and "GPU 'gpu0' is not occupied" in str(refused)
    assert [e.kind for e in given.events] == [EventKind.FREED]
    assert server.resources.overrides == Overrides()
