"""`python -m bench shift` reads the controller's move lines (control/executor.py) and says
why each moved request paused one prefill or more: exact, on hand-built lines and rows."""

from __future__ import annotations

from typing import Any

from bench._shift_load import RequestRecord, excess_pause_s
from bench.shift import _MOVED, _move_word, pause_measures, why_paused


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


def test_the_excess_pause_is_the_gap_beyond_the_stream_s_usual_gap_just_before() -> None:
    # tokens every 20 ms, then 25 ms, then a 90 ms gap (the move), then 30 ms
    token_s = [0.0, 0.02, 0.04, 0.06, 0.08, 0.10, 0.125, 0.215, 0.245]
    rec = RequestRecord(0, "chat", 10, 0.0, token_s=token_s)
    gap_s, num_before = rec.max_gap() or (0.0, 0)
    assert num_before == 7 and abs(gap_s - 0.09) < 1e-9
    # the last 5 gaps before it: 20, 20, 20, 20, 25 ms -> median 20 ms (the first one is out)
    assert abs((rec.usual_gap(num_before, 5) or 0) - 0.02) < 1e-9
    assert abs(excess_pause_s(gap_s, 0.02) - 0.07) < 1e-9
    assert excess_pause_s(0.015, 0.02) == 0.0  # never below 0
    # a gap that is the stream's first: its usual gap is that of the first ones after
    first = RequestRecord(1, "chat", 10, 0.0, token_s=[0.0, 0.1, 0.12, 0.15, 0.17])
    assert abs((first.usual_gap(1, 2) or 0) - 0.025) < 1e-9
    assert RequestRecord(2, "chat", 10, 0.0, token_s=[0.0, 0.1]).usual_gap(1) is None


def test_the_verdict_names_both_measures_and_which_meets_the_target() -> None:
    text = pause_measures({"pause_over_prefill_p99": 2.6, "excess_over_prefill_p99": 0.8})
    assert text == (" | target, moved requests' pause p99 below one prefill: "
                    "raw pause 2.60x MISSED, excess pause 0.80x MET")  # fmt: skip
    assert pause_measures({}) == ""
