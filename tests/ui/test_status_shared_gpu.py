"""`flexpipe status`'s GPUs table with a GPU shared in memory (docs/gpu-sharing.md): every
instance on it, a row each under the GPU's, not only one of them."""

from __future__ import annotations

import json
from dataclasses import replace

from test_observe import _text, readings

from flexpipe.observe.render import gpus_table
from flexpipe.observe.status_snapshot import snapshot

GEAR = "tp1-pp1-bf16-kvauto-s8"


def test_a_shared_gpu_lists_every_instance_on_it() -> None:
    before, now = readings()
    status = dict(now.status)
    # m-1 joins m-0 on g0 (each with its own memory fraction): g1 is left free
    status["instances"] = [
        {**i, "gpus": ["g0"], "state": "active"} if i["name"] == "m-1" else i
        for i in status["instances"]
    ]
    snap = snapshot(replace(now, status=status), before)
    g0, g1, _ = snap.gpus
    assert (g0.instance, g0.gear, g0.state) == ("m-0", GEAR, "active")
    assert g0.shared_with == (("m-1", GEAR, "active"),)
    assert (g1.instance, g1.shared_with) == (None, ())
    lines = _text(gpus_table(snap)).splitlines()
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert rows[:3] == [
        ["g0", "n0", "A100-80G-SXM", "80", "0", "m-0", GEAR, "active"],
        ["", "", "", "", "", "m-1", GEAR, "active"],
        ["g1", "n0", "A100-80G-SXM", "80", "0", "—", "—", "unused"],
    ]
    doc = json.loads(json.dumps(snap.to_json()))  # (as `flexpipe status --json` prints it)
    assert doc["gpus"][0]["shared_with"] == [["m-1", GEAR, "active"]]
