"""`flexpipe estimate` as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.perf import perf_model_for
from flexpipe.perf.steady_state import Workload, steady_state

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_estimate_prints_plan_and_steps() -> None:
    result = runner.invoke(
        app,
        [
            "estimate",
            "--model",
            "llama-2-7b",
            "--gear",
            "tp=2,pp=1,dtype=bf16",
            "--gpus",
            "A100-80G-SXM:2",
            "--link",
            "nvlink3",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Memory plan" in result.output and "decode tokens/s" in result.output


def test_estimate_json_has_batches_1_8_32_and_max() -> None:
    result = runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    batches = [s["batch"] for s in report["steps"]]
    assert batches[:3] == [1, 8, 32] and batches[-1] == report["memory"]["max_batch"]
    tokens_per_s = [s["decode_tokens_per_s"] for s in report["steps"]]
    assert tokens_per_s == sorted(tokens_per_s)


def test_estimate_reports_an_infeasible_gear_with_its_reason() -> None:
    result = runner.invoke(app, ["estimate", "--model", "llama-2-70b", "--json"])
    assert result.exit_code == 0
    report = json.loads(result.output)
    assert report["feasible"] is False and "GiB per GPU" in report["reason"]


def test_estimate_bad_input_is_one_line_and_exit_2() -> None:
    for args in (
        ["estimate", "--model", "no-such-model"],
        ["estimate", "--model", "llama-2-7b", "--gear", "tp=two"],
        ["estimate", "--model", "llama-2-7b", "--gpus", "B200:1"],
        ["estimate", "--model", "llama-2-7b", "--gear", "tp=2", "--gpus", "A100-80G-SXM:1"],
        ["estimate", "--model", "llama-2-7b", "--set", "hbm_eficiency=1"],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "error:" in result.output and "Traceback" not in result.output


def _json(args: list[str]) -> dict[str, object]:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert isinstance(report, dict)
    return report


def test_estimate_answers_ttft_tpot_and_tokens_per_s_at_the_points_asked() -> None:
    args = ["estimate", "--model", "llama-2-7b", "--batch", "4,1", "--prompt-len", "512"]
    report = _json([*args, "--output-len", "64"])
    steps = report["steps"]
    assert isinstance(steps, list) and [s["batch"] for s in steps] == [1, 4]
    # The very numbers the planner prices (its steady state on the same performance model).
    pm = perf_model_for("llama-2-7b", "tp=1")
    expected = steady_state(pm, 4, Workload(512, 64))
    assert steps[1]["ttft_ms"] == round(expected.ttft_s * 1e3, 3)
    assert steps[1]["tpot_ms"] == round(expected.tpot_s * 1e3, 3)
    assert steps[1]["output_tokens_per_s"] == round(expected.output_tokens_per_s, 1)
    assert report["context_len"] == 512 + 32


def test_estimate_says_which_factor_set_priced_each_gpu_type() -> None:
    calibrated = _json(["estimate", "--model", "llama-2-7b", "--gpus", "A100-80G-SXM:1"])
    assert calibrated["factors"] == {
        "A100-80G-SXM": "calibrated from vidur-profiling (microsoft/vidur@7d47513 "
        "data/profiling, MIT)"
    }
    generic = _json(["estimate", "--model", "llama-2-7b", "--gpus", "A100-80G-SXM:1", "--generic"])
    assert generic["factors"] == {
        "A100-80G-SXM": "generic factors (no measurements of this GPU type)"
    }
    h20 = _json(["estimate", "--model", "llama-2-7b", "--gpus", "H20-96G:1"])
    assert h20["factors"] == {"H20-96G": "generic factors (no measurements of this GPU type)"}
    text = runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--batch", "2"]).output
    assert "TTFT ms" in text and "TPOT ms" in text and "output tokens/s" in text
    assert "factors for A100-80G-SXM: calibrated from vidur-profiling" in text


def test_estimate_bad_points_are_one_line_and_exit_2() -> None:
    for extra in (["--batch", "0"], ["--batch", "a,b"], ["--prompt-len", "0"]):
        result = runner.invoke(app, ["estimate", "--model", "llama-2-7b", *extra])
        assert result.exit_code == 2, (extra, result.output)
        assert "error:" in result.output and "Traceback" not in result.output


def test_estimate_prints_cold_start_and_wake_per_weight_source() -> None:
    result = runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--batch", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["source"]: r for r in json.loads(result.output)["weight_sources"]}
    pm = perf_model_for("llama-2-7b", "tp=1", "A100-80G-SXM")
    assert list(rows) == [
        "peer_gpu",
        "host_ram",
        "page_cache",
        "local_nvme",
        "network_storage",
        "storage",
    ]  # fastest first
    assert rows["storage"]["cold_start_s"] == round(pm.cold_start_s(), 3)  # today's number
    assert rows["host_ram"]["wake_s"] == round(pm.wake_s(1), 3)
    assert rows["host_ram"]["gb_per_s"] == 25.6  # PCIe gen4 x16 at 80%
    assert (rows["local_nvme"]["gb_per_s"], rows["peer_gpu"]["gb_per_s"]) == (7.0, 240.0)
    text = runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--batch", "1"]).output
    assert "Cold start and wake-up by weight source" in text and "network_storage" in text


def test_estimate_reads_the_nodes_storage_from_the_cluster_file() -> None:
    result = runner.invoke(
        app,
        [
            "estimate",
            "--model",
            "llama-2-7b",
            "--gear",
            "tp=1,pp=2",
            "--cluster",
            str(EXAMPLES / "clusters" / "fragmented-4gpu.yaml"),
            "--on",
            "gpu0,gpu3",
            "--batch",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = {r["source"]: r for r in json.loads(result.output)["weight_sources"]}
    # gpu0 is alone in its node: its peer is across the node's 100 GbE
    assert rows["peer_gpu"]["detail"] == "a peer GPU over eth100"
    assert rows["peer_gpu"]["gb_per_s"] == 10.0
    # one stage per node: each node's disk reads only its stage's half
    assert rows["local_nvme"]["load_s"] == 0.963


def test_estimate_offers_no_copy_in_ram_where_host_ram_cannot_hold_it(tmp_path: Path) -> None:
    cluster = tmp_path / "small-ram.yaml"
    cluster.write_text(
        "name: small-ram\n"
        "nodes:\n"
        "  - name: n0\n"
        "    host_ram_gib: 8\n"
        "    gpus: [{id: g0, type: A100-80G-SXM}]\n"
    )
    args = ["estimate", "--model", "llama-2-7b", "--cluster", str(cluster), "--on", "g0"]
    result = runner.invoke(app, [*args, "--batch", "1", "--json"])
    assert result.exit_code == 0, result.output
    sources = [r["source"] for r in json.loads(result.output)["weight_sources"]]
    # 12.6 GiB of weights > 8 GiB of RAM: neither a sleeping copy nor the page cache
    assert sources == ["local_nvme", "network_storage", "peer_gpu", "storage"]  # peer: 25 GbE
