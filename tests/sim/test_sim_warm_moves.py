"""The simulator pre-copies recompute moves as the live gateway does (`relay.warm_up`): the
executor's `plan_moves(..., warm=True)` prices them so, the destination's real engine core
prefills a one-token warm-up of the context at priority -1 while the request keeps
generating on its source, and the cut-over then prefills only what its prefix cache lacks.
Exact values: the run is deterministic."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flexpipe.control.core import shift_moves
from flexpipe.control.core.move_inputs import warm_timeout_s
from flexpipe.gateway.core.warm_up import warms
from flexpipe.policies.shift.migration import perf_model_of
from flexpipe.sim import report, simulate
from flexpipe.sim.controller import ControllerParams
from flexpipe.sim.scenario import parse_scenario

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_sim_trust import _check_conservation

ROOT = Path(__file__).resolve().parents[2]


def _one_move() -> Any:
    """The seed's cluster at 0.5 req/s of 1500-token prompts and answers: when gpu1 is
    released at 100 s the shift down leaves three requests at a 0.5 s drain deadline."""
    doc = {
        "name": "one-move", "duration_s": 160, "seed": 0, "report_interval_s": 30,
        "cluster": {"file": str(ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml")},
        "models": [{"name": "llama-7b", "model": "llama-2-7b",
                    "demand": {"request_rate_per_s": 8, "input_tokens": 1024,
                               "output_tokens": 256},
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}, "dtypes": ["bf16", "fp8"]}],
        "workloads": [{"model": "llama-7b", "arrivals": {"rate_per_s": 0.5, "start_s": 30},
                       "prompt_tokens": {"dist": "fixed", "mean": 1500},
                       "output_tokens": {"dist": "fixed", "mean": 1500}}],
        "resources": [{"at_s": 100, "release": ["gpu1"]}],
    }  # fmt: skip
    sc = parse_scenario(doc, ROOT)
    return replace(sc, controller=ControllerParams(drain_deadline_s=0.5))


def test_the_warm_rule_and_bound_are_the_gateways_and_executors() -> None:
    assert warm_timeout_s(0.05, 1.0, True) == 0.2  # at least 0.2 s
    assert warm_timeout_s(0.5, 2.0, True) == 2.0
    assert warm_timeout_s(0.5, 1.0, False) == 0.0
    assert warms(0.2, 4, 3) and warms(0.2, 0, 99)  # a free slot (0: unbounded)
    assert not warms(0.2, 4, 4) and not warms(0.0, 4, 0)


def test_a_recompute_move_is_priced_warm_and_pre_copied_on_the_destinations_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    planned: list[tuple[bool, Any]] = []
    plan_moves = shift_moves.plan_moves

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = plan_moves(*args, **kwargs)
        planned.extend((kwargs.get("warm", False), m) for m in out)
        return out

    monkeypatch.setattr(shift_moves, "plan_moves", spy)
    sc = _one_move()
    r = simulate(sc, "flexpipe")
    rep = report(r)
    # planned as the executor plans: warm, the recompute priced at its cut-over
    assert [(w, m.id, m.choice.method) for w, m in planned] == [
        (True, 21, "recompute"), (True, 20, "kv"), (True, 19, "kv")
    ]  # fmt: skip
    choice = planned[0][1].choice
    assert choice.warmed and choice.warm_up_s == pytest.approx(0.146247, abs=1e-6)
    assert choice.pause_s == pytest.approx(0.025373, abs=1e-6)
    assert r.shifts[1]["migrated"] == {"finished_in_place": 1, "kv_moved": 2, "recomputed": 1}
    assert r.warm_ups == {"warmed": 1} and rep["move_warm_ups"] == {"warmed": 1}
    (move,) = [m for m in r.moves if m.method == "recomputed"]
    seg = move.continuation
    assert (move.request_id, move.warm) == (21, "warmed")
    # the destination's prefix cache held the context's full blocks: the cut-over computes
    # only the last partial block and the tokens generated during the warm-up
    # (and the token its source gave right before the cut-over: 1962 + 1)
    assert (seg.num_prompt_tokens, seg.num_cached_tokens) == (1963, 1952)
    dst = next(i for i in r.instances if i.dep.name == seg.instance)
    assert dst.planned is not None
    model = perf_model_of(sc.cluster, dst.planned)
    full_prefill_s = model.prefill_s(seg.num_prompt_tokens)
    assert full_prefill_s == pytest.approx(0.1325, abs=1e-4)
    # it cut over right at its source's next token (gateway.cut_over: 3.7 ms after it was
    # ready; cut at once, its gap began 10.8 ms before, at the token before, and paused
    # 42.5 ms), so its pause is the destination's step in progress and the cut-over's short
    # step: about a fifth of the prefill an unwarmed recompute would pause for
    assert move.at_s == move.last_token_s
    assert seg.first_token_s - move.at_s == pytest.approx(0.0280, abs=1e-4)
    assert move.pause_s == pytest.approx(0.0280, abs=1e-4) and move.pause_s < full_prefill_s / 4
    # the warm-up is no client request: every request ends once, with all its tokens
    assert rep["num_failed"] == 0 and rep["num_requests"] == len(r.requests)
    assert all(q.num_generated_tokens == q.num_output_tokens for q in r.requests)
    _check_conservation(sc, r)  # and every engine empty, all its KV blocks free
    # deterministic: the same scenario, the same report bytes
    again = report(simulate(sc, "flexpipe"))
    assert json.dumps(again, sort_keys=True) == json.dumps(rep, sort_keys=True)


def test_without_a_free_slot_or_bound_the_move_cuts_over_unwarmed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bound of 0 (the executor with `warm_moves` off) skips the warm-up: the cut-over
    prefills the whole context, with no prefix-cache hit, as before the pre-copy."""
    monkeypatch.setattr(shift_moves, "warm_timeout_s", lambda done_s, scale, warm: 0.0)
    r = simulate(_one_move(), "flexpipe")
    (move,) = [m for m in r.moves if m.method == "recomputed"]
    assert move.warm == "skipped" and r.warm_ups == {"skipped": 1}
    assert move.continuation.num_cached_tokens == 0
    assert move.pause_s > 0.1324
