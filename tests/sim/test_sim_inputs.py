"""Bad input to `flexpipe sim`: one readable line naming the field (and file), exit 2; never a
traceback or a hang. Trace replay times: the full date, sorted, from the earliest row."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.sim.scenario import ScenarioError, load_scenario, parse_scenario
from flexpipe.sim.trace import read_azure, read_mooncake
from flexpipe.sim.workload import WorkloadError

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _base() -> dict[str, Any]:
    """llama-2-7b at 1 req/s on a generated 1 x 2 cluster (A10Gs), 4 s."""
    return {
        "name": "base", "duration_s": 4, "seed": 1,
        "models": [{"name": "m7", "model": "llama-2-7b",
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}}],
        "workloads": [{"model": "m7", "arrivals": {"process": "poisson", "rate_per_s": 1},
                       "prompt_tokens": {"dist": "fixed", "mean": 64},
                       "output_tokens": {"dist": "fixed", "mean": 8}}],
        "cluster": {"generate": {"nodes": 1, "gpus_per_node": 2, "seed": 0}},
    }  # fmt: skip


def _error(doc: dict[str, Any], base: Path = Path(".")) -> str:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(doc, base, "s.yaml")
    message = str(info.value)
    assert "\n" not in message
    return message


def _with(path: str, value: Any) -> dict[str, Any]:
    """The base scenario with the value at a dotted path (`workloads.0.arrivals.rate_per_s`)."""
    doc = _base()
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    node[int(last) if isinstance(node, list) else last] = value
    return doc


NAN, INF = float("nan"), float("inf")
R = "workloads[0].arrivals"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("duration_s", NAN, "s.yaml: duration_s: expected a number, got nan"),
        ("duration_s", INF, "s.yaml: duration_s must be a finite number (got inf)"),
        ("workloads.0.arrivals.rate_per_s", NAN, f"s.yaml: {R}.rate_per_s: expected a number, "
         "got nan"),
        ("workloads.0.arrivals.rate_per_s", INF, f"s.yaml: {R}.rate_per_s: expected a finite "
         "number, got inf"),
        ("workloads.0.arrivals.rate_per_s", "abc", f"s.yaml: {R}.rate_per_s: expected a number, "
         "got 'abc'"),
        ("workloads.0.arrivals.rate_per_s", 0, f"s.yaml: {R}.rate_per_s: must be a finite "
         "number > 0 (got 0)"),
        ("workloads.0.arrivals.cv", INF, f"s.yaml: {R}.cv: expected a finite number, got inf"),
        ("workloads.0.arrivals.start_s", -1, f"s.yaml: {R}.start_s: must be a finite number "
         ">= 0 (got -1)"),
        ("workloads.0.arrivals.rate_per_sec", 2, f"s.yaml: {R}: unknown key(s) rate_per_sec; "
         "known: process, rate_per_s, cv, start_s, off_mean_s, burst_min_s, burst_max_s"),
        ("workloads.0.arrivals.process", "weibull", f"s.yaml: {R}.process: unknown arrival "
         "process 'weibull': use poisson, gamma or onoff"),
        ("workloads.0.prompt_tokens.maxx", 3, "s.yaml: workloads[0].prompt_tokens: unknown "
         "key(s) maxx; known: dist, mean, cv, min, max"),
        ("workloads.0.prompt_tokens.mean", INF, "s.yaml: workloads[0].prompt_tokens.mean: "
         "expected a finite number, got inf"),
        ("workloads.0.output_tokens.max", 2.5, "s.yaml: workloads[0].output_tokens.max: "
         "expected an integer, got 2.5"),
        ("workloads.0.output_tokens.mean", 0, "s.yaml: workloads[0].output_tokens.mean: must "
         "be a finite number >= 1 (got 0)"),
        ("workloads.0.shared_prefix", {"num_groups": 0, "num_tokens": 512}, "s.yaml: "
         "workloads[0].shared_prefix.num_groups: must be a finite number >= 1 (got 0)"),
        ("workloads.0.diurnal", {"period_s": INF}, "s.yaml: workloads[0].diurnal.period_s: "
         "expected a finite number, got inf"),
        ("seed", "abc", "s.yaml: seed: expected an integer, got 'abc'"),
        ("cluster.generate.nodes", "x", "s.yaml: cluster.generate.nodes: expected an integer, "
         "got 'x'"),
        ("cluster.generate.gpu_type", "H100", "s.yaml: cluster.generate: unknown key(s) "
         "gpu_type; known: nodes, gpus_per_node, seed"),
        ("controller", {"tick_s": 0}, "s.yaml: controller.tick_s: must be >= 0.001 (got 0)"),
        ("controller", {"tick_s": -5}, "s.yaml: controller.tick_s: must be >= 0.001 (got -5)"),
        ("controller", {"tick_s": INF}, "s.yaml: controller.tick_s: expected a finite number, "
         "got inf"),
        # a NaN anywhere, in the sections other parsers read too
        ("controller", {"shift": {"triggers": {"cooldown_s": NAN}}}, "s.yaml: "
         "controller.shift.triggers.cooldown_s: expected a number, got nan"),
        ("gateway", {"max_queue_wait_s": NAN}, "s.yaml: gateway.max_queue_wait_s: expected a "
         "number, got nan"),
        ("models.0.slo.ttft_p99_ms", NAN, "s.yaml: models[0].slo.ttft_p99_ms: expected a number, "
         "got nan"),
        ("controller", {"drain_deadline_s": -5}, "s.yaml: controller.drain_deadline_s: must be "
         ">= 0 (got -5)"),
        ("controller", {"min_instances_floor": "x"}, "s.yaml: controller.min_instances_floor: "
         "expected an integer, got 'x'"),
        ("report_interval_s", 0, "s.yaml: report_interval_s: must be > 0 (got 0)"),
        ("report_interval_s", -60, "s.yaml: report_interval_s: must be > 0 (got -60)"),
        ("report_interval_s", 1e-9, "s.yaml: report_interval_s 1e-09 cuts duration_s 4 into "
         "4e+09 intervals (at most 1,000,000)"),
        ("workloads.0.arrivals.rate_per_s", "1e9", "s.yaml: the workloads' rate_per_s over "
         "duration_s 4 s would generate ~4e+09 requests (at most 10,000,000)"),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line_naming_its_field(path: str, value: Any, message: str) -> None:
    assert _error(_with(path, value)) == message


def test_numbers_written_as_strings_still_read() -> None:
    """PyYAML reads `1e3` as a string: it is a number to the scenario, as before."""
    sc = parse_scenario(_with("workloads.0.arrivals.rate_per_s", "1.5e0"), Path("."))
    assert sc.workloads[0].source.rate_per_s == 1.5  # type: ignore[union-attr]
    assert parse_scenario(_with("seed", "7"), Path(".")).seed == 7


def test_occupy_is_checked_against_the_gpus_memory() -> None:
    doc = _base()
    gpu = "a10g-000/gpu0"
    doc["resources"] = [{"at_s": 1, "occupy": [gpu], "used_gib": 500}]
    assert _error(doc) == (
        f"s.yaml: resources[0]: used_gib on {gpu}: 500.0 GiB used exceeds the A10G's 24.0 GiB"
    )
    doc["resources"] = [{"at_s": 1, "occupy": [gpu], "used_gib": -5}]
    assert _error(doc) == "s.yaml: resources[0]: used_gib must be a finite number >= 0 (got -5)"
    doc["resources"] = [{"at_s": INF, "release": [gpu]}]
    assert _error(doc) == "s.yaml: resources[0]: at_s must be a finite number >= 0 (got inf)"
    # a GPU that joins later is checked against its own type
    doc["resources"] = [
        {"at_s": 1, "join": {"node": "n9", "gpus": [{"id": "h", "type": "H100-80G-SXM"}]}},
        {"at_s": 2, "occupy": ["h"], "used_gib": 81},
    ]
    assert "used_gib on h: 81.0 GiB used exceeds the H100-80G-SXM's 80.0 GiB" in _error(doc)
    doc["resources"][1]["used_gib"] = 70
    ev = parse_scenario(doc, Path("."), "s.yaml").resources[1]
    assert ev.used_bytes == 70 * 2**30


def test_yaml_syntax_error_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\n  bad: [\n", encoding="utf-8")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert str(info.value) == (
        f"{path}: line 2, column 6: YAML syntax error: mapping values are not allowed here"
    )


# -- traces ----------------------------------------------------------------------------------


def test_azure_times_cross_a_month_and_are_sorted_from_the_earliest(tmp_path: Path) -> None:
    month = tmp_path / "month.csv"
    month.write_text(HEADER + "2023-11-30 23:59:50.0,374,44\n2023-12-01 00:00:05.0,300,10\n"
                     "2023-12-01 00:00:10.0,300,10\n")  # fmt: skip
    assert [r[0] for r in read_azure(month)] == [0.0, 15.0, 20.0]
    late = tmp_path / "unsorted.csv"
    late.write_text(HEADER + "2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:36.0,300,10\n"
                    "2023-11-16 18:15:50.0,301,10\n2023-11-16 18:15:50.0,302,10\n"
                    "2023-11-16 18:15:30.0,0,10\n")  # fmt: skip
    # the row with no prompt is skipped, but it is the earliest: times count from it
    assert read_azure(late) == [
        (6.0, 300, 10, ()), (16.68, 374, 44, ()), (20.0, 301, 10, ()), (20.0, 302, 10, ())
    ]  # fmt: skip
    seven = tmp_path / "seven.csv"  # the trace's own format: 7 fractional digits, exact
    seven.write_text(HEADER + "2023-11-16 18:15:46.6805900,1,1\n2023-11-16 18:15:50.9951690,1,1\n")
    assert read_azure(seven)[1][0] == (509951690 - 466805900) / 1e7 == 4.314579


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ("2023-11-16 18:15:47.0,abc,10", "invalid literal for int() with base 10: 'abc'"),
        ("2023-11-16 18:15:47.0,-5,10", "ContextTokens must be >= 0 (got -5)"),
        ("2023-11-16 18:15:47.0,5", "expected TIMESTAMP,ContextTokens,GeneratedTokens"),
        ("2023-13-16 18:15:47.0,5,5", "month must be in 1..12"),
        ("16/11/2023 18:15:47,5,5", "TIMESTAMP '16/11/2023 18:15:47' is not YYYY-MM-DD "
         "hh:mm:ss.fffffff"),
    ],
)  # fmt: skip
def test_a_malformed_azure_row_names_its_line(tmp_path: Path, row: str, why: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(HEADER + "2023-11-16 18:15:46.68,374,44\n" + row + "\n")
    with pytest.raises(WorkloadError) as info:
        read_azure(path)
    assert str(info.value) == f"{path}:3: cannot read {row!r}: {why}"


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ({"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [-1]},
         "hash_ids must be integers in [0, 1073741823] (got -1)"),
        ({"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [0, 1]},
         "2 hash_ids for input_length 100: at most 1 blocks of 512 tokens"),
        ({"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": "12"},
         "hash_ids must be a list of integers (got '12')"),
        ({"timestamp": -1, "input_length": 100, "output_length": 5},
         "timestamp must be a finite number of ms >= 0 (got -1)"),
        ({"timestamp": 0, "input_length": 1.5, "output_length": 5},
         "input_length must be an integer >= 0 (got 1.5)"),
        ({"timestamp": 0, "output_length": 5}, "missing input_length"),
        ([1, 2], "not a JSON object"),
    ],
)  # fmt: skip
def test_a_malformed_mooncake_row_names_its_line(tmp_path: Path, row: Any, why: str) -> None:
    path = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 1025, "output_length": 5, "hash_ids": [0, 1, 2]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(WorkloadError) as info:
        read_mooncake(path)
    assert str(info.value) == f"{path}:2: not a Mooncake trace row: {why}"
    path.write_text(json.dumps(good) + "\n")
    assert read_mooncake(path) == [(0.0, 1025, 5, (0, 1, 2))]  # 3 blocks: ceil(1025 / 512)


def test_an_empty_or_bad_trace_is_an_error_when_the_scenario_loads(tmp_path: Path) -> None:
    (tmp_path / "empty.csv").write_text(HEADER + "2023-11-16 18:15:46.68,0,44\n")
    doc = _with("workloads.0", {"model": "m7", "trace": {"kind": "azure", "file": "empty.csv"}})
    assert _error(doc, tmp_path) == (
        f"s.yaml: workloads[0].trace: {tmp_path / 'empty.csv'}: no requests in the trace "
        "(rows with tokens)"
    )
    doc["workloads"][0]["trace"].update(file="neg.jsonl", kind="mooncake")
    (tmp_path / "neg.jsonl").write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [-1]}\n'
    )
    assert _error(doc, tmp_path).startswith(f"s.yaml: workloads[0].trace: {tmp_path}/neg.jsonl:1:")
    doc["workloads"][0]["trace"].update(speedup=INF)
    assert _error(doc, tmp_path) == (
        "s.yaml: workloads[0].trace.speedup: expected a finite number, got inf"
    )
    doc["workloads"][0]["trace"] = {"kind": "azure", "file": "empty.csv", "speed": 2}
    assert _error(doc, tmp_path) == (
        "s.yaml: workloads[0].trace: unknown key(s) speed; known: kind, file, speedup, offset_s"
    )


# -- the command -----------------------------------------------------------------------------


def _cli(tmp_path: Path, *args: str) -> tuple[int, str]:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_base()), encoding="utf-8")
    out = CliRunner().invoke(app, ["sim", str(path), "--quiet", *args])
    return out.exit_code, out.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--duration-s", "nan"), "--duration-s must be a positive number (got nan)"),
        (("--duration-s", "inf"), "--duration-s must be a finite number (got inf)"),
        (("--compare", ","), "--compare: give at least one policy name (got ',')"),
        (("--compare", "static,static"), "--compare: static given more than once"),
    ],
)
def test_cli_bad_options_are_one_line(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    code, output = _cli(tmp_path, *args)
    assert code == 2
    assert re.sub(r"\s+", " ", output).strip() == f"error: {message}"


def test_cli_compare_json_is_one_document(tmp_path: Path) -> None:
    code, output = _cli(tmp_path, "--compare", "static,round_robin", "--json")
    assert code == 0, output
    doc = json.loads(output)
    assert list(doc) == ["static", "round_robin"]
    assert [doc[k]["policy"] for k in doc] == ["static", "round_robin"]
    assert doc["static"]["duration_s"] == 4
    code, output = _cli(tmp_path, "--policy", "static", "--json")  # one policy: its report
    assert code == 0 and json.loads(output)["policy"] == "static"


def test_an_event_that_would_do_nothing_is_an_error_and_one_after_the_run_a_note() -> None:
    from flexpipe.sim.simulator import simulate

    doc = _base()
    g0, g1 = "a10g-000/gpu0", "a10g-000/gpu1"  # (gpu0: a tenant holds it; gpu1: free)
    doc["resources"] = [{"at_s": 1, "release": [g1]}]
    assert _error(doc) == (
        f"s.yaml: resources: the other tenant leaves {g1} at 1 s: GPU(s) ['{g1}'] are not held "
        "by another tenant then (nothing to release)"
    )
    doc["resources"] = [{"at_s": 1, "release": [g0]}, {"at_s": 2, "release": [g0]}]
    assert "not held by another tenant then" in _error(doc)
    doc["resources"] = [{"at_s": 1, "fail": [g1]}, {"at_s": 2, "fail": [g1]}]
    assert "GPU(s) ['a10g-000/gpu1'] failed before it" in _error(doc)
    doc["resources"] = [{"at_s": 1, "fail": [g1]}, {"at_s": 2, "occupy": [g1]}]
    assert "failed before it" in _error(doc)
    # occupied, then released: fine; an event after the run is a note in the report
    doc["resources"] = [{"at_s": 1, "occupy": [g1]}, {"at_s": 2, "release": [g1]},
                        {"at_s": 1000, "occupy": [g1]}]  # fmt: skip
    result = simulate(parse_scenario(doc, Path("."), "s.yaml"))
    (note,) = [n for n in result.notes if n.startswith("resources:")]
    assert note.startswith("resources: ") and "at 1000 s did not happen: the run ended at" in note
