"""`python -m bench shift` reads the controller's move lines (control/executor.py) and says
why each moved request paused one prefill or more: exact, on hand-built lines and rows."""

from __future__ import annotations

from typing import Any

from bench.shift import _MOVED, _move_word, why_paused


def test_the_move_line_parses_into_each_request_s_price_method_warm_up_and_destination() -> None:
    line = (
        "controller: moved 2 request(s) off http://127.0.0.1:1 before the drain deadline "
        "(kv 1, recompute 1, warmed 1) at 1796147073.479 in 0.012 s: "
        "a=95ms:kv@http://127.0.0.1:2 b=31ms:recompute:timed_out@http://127.0.0.1:3"
    )
    m = _MOVED.search(line)
    assert m is not None and m["url"] == "http://127.0.0.1:1" and m["at"] == "1796147073.479"
    assert [_move_word(w) for w in m["ids"].split()] == [
        {"id": "a", "priced_ms": 95.0, "method": "kv", "warm": None, "to": "http://127.0.0.1:2"},
        {"id": "b", "priced_ms": 31.0, "method": "recompute", "warm": "timed_out",
         "to": "http://127.0.0.1:3"},
    ]  # fmt: skip
    # older lines: the price alone, or the id alone
    assert _move_word("c=40ms") == {"id": "c", "priced_ms": 40.0, "method": None,
                                    "warm": None, "to": None}  # fmt: skip
    assert _move_word("d")["priced_ms"] is None


def row(**kw: Any) -> dict[str, Any]:
    base = {"pause_over_prefill": 2.0, "method": "recompute", "warm": "warmed",
            "prefill_ms": 60.0, "floor_ms": 40.0, "pause_ms": 120.0,
            "cadence_before_ms": 20.0, "step_after_ms": 20.0,
            "unmoved_gap_ms": 20.0}  # fmt: skip
    return {**base, **kw}


def test_why_a_moved_request_paused_one_prefill_or_more() -> None:
    assert why_paused(row(pause_over_prefill=0.9)) == "within one prefill"
    assert why_paused(row(method="kv", warm=None)) == "KV move"
    assert why_paused(row(warm="skipped")) == "recompute, warm-up skipped"
    # under the floor (40 ms), and within its worst case (20 + 2 x 20 ms): the floor
    assert why_paused(row(prefill_ms=40.0, pause_ms=60.0)).startswith("short context")
    assert why_paused(row(prefill_ms=40.0, pause_ms=61.0)) == "unexplained"
    assert why_paused(row(unmoved_gap_ms=70.0)).startswith("machine stall")
    assert why_paused(row(other_prefill_tokens=1800)).startswith("new requests' prefills")
    assert why_paused(row()) == "unexplained"
