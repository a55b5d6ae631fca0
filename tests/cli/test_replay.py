"""`flexpipe replay` against a real gateway and real sim engines on 127.0.0.1: exact counts,
the JSON report's keys and its attainment recomputed from its own per-request records, prompts
of the trace's length with the trace's shared prefixes, late requests under a concurrency
bound, a clean stop, and one error line for a bad trace or a URL that does not answer."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_gateway_api import Running
from test_gateway_fakes import LoopThread
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.cli.replay import model_slos
from flexpipe.engine.testing import sim_engine
from flexpipe.engine.tokenizer import Tokenizer
from flexpipe.launch import free_port
from flexpipe.policies.planner import Slo
from flexpipe.replay import Target, build_report, load_requests, replay
from flexpipe.sim.request import PREFIX_BLOCK_TOKENS, SimRequest
from flexpipe.sim.workload import prompt_text

DATA = Path(__file__).resolve().parents[1] / "data"
AZURE = DATA / "azure_conv_head.csv"  # 40 rows, the longest 4,155 tokens with its output
MOONCAKE = DATA / "replay_mooncake_slice.jsonl"  # 24 rows, all sharing hash id 0
MODEL = "pool-model"
runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    """Two sim engines (no sleeping: time scale 0) behind a gateway; its /v1 URL."""
    args = ["llama-3.1-8b", "--load-time-s", "0", "--time-scale", "0"]
    args += ["--max-model-len", "16384", "--served-model-name", MODEL]
    lt = LoopThread()
    try:
        with sim_engine(args) as a, sim_engine(args) as b:
            r = Running(lt, [], backends=[{"url": a.url}, {"url": b.url}])
            try:
                yield r.url + "/v1"
            finally:
                r.close()
    finally:
        lt.stop()


def _json(args: list[str]) -> dict[str, Any]:
    result = runner.invoke(app, ["replay", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _one_error_line(args: list[str]) -> str:
    result = runner.invoke(app, ["replay", *args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    return lines[0]


def _trace_rows() -> list[tuple[int, int]]:
    with AZURE.open() as f:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]


REPORT_KEYS = {
    "trace", "kind", "url", "speed_up", "stream", "max_concurrency", "duration_s", "elapsed_s",
    "interrupted", "num_in_slice", "num_sent", "num_not_sent", "num_late", "num_requests",
    "num_completed", "num_failed", "failed_by_reason", "goodput_requests_per_s",
    "slo_attainment", "throughput_tokens_per_s", "span_throughput_tokens_per_s", "ttft_s",
    "tpot_s", "e2e_s", "first_served_s", "prefix_cache_hit_tokens", "failed_by_why", "models",
    "requests",
}  # fmt: skip


def test_an_azure_slice_is_replayed_whole_and_counted_exactly(gateway: str) -> None:
    rep = _json([str(AZURE), "--url", gateway, "--speed-up", "1000", "--max-requests", "30",
                 "--slo-ttft-ms", "20", "--slo-tpot-ms", "5"])  # fmt: skip
    assert set(rep) == REPORT_KEYS
    assert (rep["num_in_slice"], rep["num_sent"], rep["num_not_sent"]) == (30, 30, 0)
    assert rep["num_sent"] == rep["num_completed"] + rep["num_failed"] == len(rep["requests"])
    assert (rep["num_failed"], rep["failed_by_reason"], rep["interrupted"]) == (0, {}, False)
    assert list(rep["models"]) == [MODEL]
    assert rep["models"][MODEL]["slo"] == {"ttft_s": 0.02, "tpot_s": 0.005}
    rows = _trace_rows()[:30]
    recs = rep["requests"]
    # each request asked for the trace's lengths and got them (the engine counted the prompt)
    assert [(r["num_prompt_tokens"], r["num_generated_tokens"]) for r in recs] == rows
    assert all(r["failed"] == "" and r["instance"].startswith("http://127.0.0.1:") for r in recs)
    good = [r for r in recs if r["ttft_s"] <= 0.02 and r["tpot_s"] <= 0.005]
    assert 0.0 <= rep["slo_attainment"] <= 1.0
    assert rep["slo_attainment"] == round(len(good) / len(recs), 6)
    assert [r["slo_met"] for r in recs] == [r in good for r in recs]
    assert rep["models"][MODEL]["num_requests"] == 30


def test_mooncake_shared_blocks_reach_the_engines_prefix_cache(gateway: str) -> None:
    rep = _json([str(MOONCAKE), "--url", gateway, "--speed-up", "1000",
                 "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100"])  # fmt: skip
    assert rep["num_sent"] == rep["num_completed"] == 24
    recs = rep["requests"]
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    assert [r["num_prompt_tokens"] for r in recs] == [row["input_length"] for row in rows]
    # every row starts with hash id 0: a later request finds its 512 tokens cached
    assert max(r["num_cached_tokens"] for r in recs) >= PREFIX_BLOCK_TOKENS
    assert rep["prefix_cache_hit_tokens"] == sum(r["num_cached_tokens"] for r in recs)


def test_requests_beyond_the_concurrency_bound_wait_and_count_as_late(gateway: str) -> None:
    rep = _json([str(MOONCAKE), "--url", gateway, "--speed-up", "1e6", "--max-requests", "8",
                 "--max-concurrency", "1", "--slo-ttft-ms", "0.001"])  # fmt: skip
    assert rep["num_sent"] == rep["num_completed"] == 8  # none dropped
    assert rep["num_late"] == 7  # all eight are due at once; one slot
    # no TTFT is a microsecond: completed, yet none met the SLO
    assert (rep["slo_attainment"], rep["goodput_requests_per_s"]) == (0.0, 0.0)
    sent = [r["sent_s"] for r in rep["requests"]]
    assert sent == sorted(sent)


def test_a_stop_reports_what_was_sent(gateway: str) -> None:
    """Ctrl-C (the stop event): no more sending, what was sent is counted."""
    reqs = load_requests(MOONCAKE, "mooncake", MODEL, 1.0, None, None)
    slos = {MODEL: Slo(2.0, 0.1)}

    async def main() -> Any:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(1.0, stop.set)  # the third row is due at 3 s
        return await replay(reqs, Target.parse(gateway, None), {}, slos, max_concurrency=8,
                            stream=True, timeout_s=30, stop=stop)  # fmt: skip

    run = asyncio.run(main())
    rep = build_report(run, reqs, slos, {}, 3.0, {})
    assert run.interrupted and (rep["num_sent"], rep["num_not_sent"]) == (2, 22)
    assert rep["num_sent"] == rep["num_completed"] + rep["num_failed"]


def test_the_prompt_has_the_trace_length_and_shares_its_prefix_text() -> None:
    tok = Tokenizer(128_256)
    a = SimRequest(0, 0.0, "m", 1300, 5, (7, 8, 9))
    b = SimRequest(1, 0.0, "m", 1100, 5, (7, 8, 4))
    c = SimRequest(2, 0.0, "m", 40, 5)
    for req in (a, b, c):
        assert len(tok.encode(prompt_text(req))) == req.num_prompt_tokens
    words_a, words_b = prompt_text(a).split(" "), prompt_text(b).split(" ")
    shared = 2 * PREFIX_BLOCK_TOKENS  # two blocks of words (the engine adds BOS before them)
    assert words_a[:shared] == words_b[:shared]
    assert words_a[shared] != words_b[shared]
    assert prompt_text(c).split(" ")[0] != prompt_text(SimRequest(3, 0.0, "m", 40, 5))[0]


def test_slos_come_from_the_models_file_and_flags_override(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(
        "models:\n  - name: m\n    model: llama-2-7b\n"
        "    demand: {request_rate_per_s: 1, input_tokens: 100, output_tokens: 10}\n"
        "    slo: {ttft_p99_ms: 1500, tpot_p99_ms: 40}\n"
    )
    assert model_slos(models, {"m"}, None, None) == {"m": Slo(1.5, 0.04)}
    assert model_slos(models, {"m"}, 300, None) == {"m": Slo(0.3, 0.04)}
    with pytest.raises(ValueError, match="has no model 'x'"):
        model_slos(models, {"x"}, None, None)


def test_a_bad_trace_is_one_line_and_exit_2(gateway: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,x\n")
    line = _one_error_line([str(bad), "--url", gateway])
    assert f"{bad}:2: cannot read" in line
    line = _one_error_line([str(tmp_path / "none.csv"), "--url", gateway])
    assert "does not exist" in line


def test_a_url_that_does_not_answer_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    line = _one_error_line([str(AZURE), "--url", url])
    assert line.startswith(f"error: {url}/models does not answer: connect:")


def test_every_failure_is_counted_with_its_reason(gateway: str) -> None:
    rows = [json.loads(line) for line in (DATA / "mooncake_head.jsonl").read_text().splitlines()]
    too_long = sum(1 for r in rows[:12] if r["input_length"] + r["output_length"] > 16384)
    rep = _json([str(DATA / "mooncake_head.jsonl"), "--url", gateway, "--speed-up", "1e6",
                 "--max-requests", "12"])  # fmt: skip
    assert too_long == 4 and rep["failed_by_reason"] == {"http 400": too_long}
    assert (rep["num_sent"], rep["num_completed"], rep["num_failed"]) == (12, 8, 4)
    failed = [r for r in rep["requests"] if r["failed"]]
    assert all(r["ttft_s"] is None and not r["slo_met"] for r in failed)
    rep = _json([str(AZURE), "--url", gateway, "--max-requests", "3", "--timeout-s", "1e-6",
                 "--speed-up", "1000"])  # fmt: skip
    assert rep["failed_by_reason"] == {"timeout": 3} and rep["num_completed"] == 0
    assert rep["slo_attainment"] == 0.0


def test_ctrl_c_prints_what_it_has_and_exits_130(gateway: str) -> None:
    argv = [sys.executable, "-m", "flexpipe", "replay", str(MOONCAKE), "--url", gateway, "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stderr is not None
        assert b"replaying 24 requests" in proc.stderr.readline()  # Ctrl-C is handled now
        time.sleep(1.0)  # the first two rows sent (the third is due at 3 s)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    rep = json.loads(out)
    assert rep["interrupted"] and rep["num_in_slice"] == 24
    assert rep["num_sent"] == rep["num_completed"] + rep["num_failed"] == 2


def test_a_scenario_replays_its_traffic_with_its_slos_mapped_to_the_pool(gateway: str) -> None:
    rep = _json(["azure-conversation", "--url", gateway, "--speed-up", "1000",
                 "--max-requests", "10", "--model-map", f"llama-8b={MODEL}"])  # fmt: skip
    assert (rep["kind"], rep["num_sent"], rep["num_completed"]) == ("scenario", 10, 10)
    entry = rep["models"]["llama-8b"]
    assert entry["pool_model"] == MODEL
    assert entry["slo"] == {"ttft_s": 2.0, "tpot_s": 0.06}  # the scenario's models section
    rows = _trace_rows()[:10]  # its trace is the same conversation trace, from its start
    assert [r["num_prompt_tokens"] for r in rep["requests"]] == [p for p, _ in rows]


def test_a_model_the_endpoint_does_not_serve_is_one_line(gateway: str) -> None:
    line = _one_error_line([str(AZURE), "--url", gateway, "--model", "nope"])
    assert line == f"error: {gateway} serves {MODEL}, not nope: give --model-map or --model"
