"""A model takes its own GPU back from a guest (policies/shift/standby_sleepers.py, pure;
`standby.hosts_take_back`): `guests` names the standbys placed beside another model's
engine, and `swaps_aside` puts such a guest to sleep for its host's sleeper even while the
guest serves or its own model needs more engines. Exact, with the fakes of
test_standby_time_share.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[0]))
from test_standby_sleepers import inst
from test_standby_time_share import swaps

from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_sleepers import (
    StandbyParams,
)
from flexpipe.policies.shift.time_share import (
    guests,
    yields_to,
)


def test_guests_are_the_standbys_placed_beside_another_models_instance() -> None:
    before = (inst("a", "gpu0"), inst("b", "gpu1"))
    placed = [inst("a", "gpu1"), inst("c", "gpu2"), inst("d", "gpu2"), inst("a", "gpu3")]
    # a beside b on gpu1; d beside c, placed ahead of it on gpu2; a alone on gpu3
    assert guests(placed, before) == {instance_key(placed[0]), instance_key(placed[2])}
    # beside its own model's instance no standby is a guest
    assert guests([inst("b", "gpu1")], before) == set()


def test_a_guest_yields_to_its_host_even_while_it_serves_or_is_pressed() -> None:
    x = inst("x", "gpu1")
    assert not yields_to(x, "a", {}, (), 1.0)  # serving, no guest: keeps the GPU
    assert yields_to(x, "a", {}, (), 1.0, guest=True)
    assert yields_to(x, "a", {}, ("x",), 1.0, guest=True)  # x needs more engines itself
    assert not yields_to(x, "a", {"x": 2.0}, (), 0.0, guest=True)  # higher priority: never
    assert not yields_to(x, "x", {}, (), 0.0, guest=True)  # its own model


def test_a_host_swaps_its_busy_guest_out_and_a_guest_does_not() -> None:
    x1, y2 = inst("x", "gpu1"), inst("y", "gpu2")
    busy = {instance_key(x1): 3.0, instance_key(y2): 2.0}
    pressed = {"a": 1, "x": 1, "y": 1}
    # both holders serve and their models are pressed: no swap
    assert swaps(in_flight_by_key=busy, waiting_by_model=pressed) == []
    # y on gpu2 is a guest beside a's sleeper there: it yields; x on gpu1 is none
    guest_y = {instance_key(y2)}
    got = swaps(in_flight_by_key=busy, waiting_by_model=pressed, guest_keys=guest_y)
    assert got == [("a@gpu2", ["y"])]
    # a's sleeper on gpu2 is a guest itself (placed beside y): no take-back
    both = guest_y | {instance_key(inst("a", "gpu2", 9.0))}
    assert swaps(in_flight_by_key=busy, waiting_by_model=pressed, guest_keys=both) == []


def test_take_back_is_off_unless_asked() -> None:
    assert StandbyParams().hosts_take_back is False
