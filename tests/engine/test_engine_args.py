"""`vllm serve` flags -> sim engine config: hardware, cluster GPUs, readable errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flexpipe.engine.args import EngineArgsError, parse_engine_args
from flexpipe.perf import perf_model_for

CLUSTER = str(Path(__file__).resolve().parents[2] / "examples/clusters/fragmented-4gpu.yaml")


def test_defaults_are_one_a100_per_tp_rank_on_nvlink() -> None:
    cfg = parse_engine_args(["llama-2-7b", "-tp", "2", "--max-model-len", "1024", "--foo", "1"])
    pm = perf_model_for("llama-2-7b", "tp=2", "A100-80G-SXM", "nvlink3", max_model_len=1024)
    assert cfg.num_kv_blocks == pm.memory.num_kv_blocks
    assert cfg.host == "127.0.0.1" and cfg.served_model_name == "llama-2-7b"
    assert cfg.ignored_flags == ("--foo",)
    assert cfg.load_time_s == pytest.approx(pm.cold_start_s())


def test_cluster_gpus_set_the_hardware() -> None:
    fast = parse_engine_args(
        ["llama-2-7b", "--cluster", CLUSTER, "--gpu-ids", "gpu1,gpu2", "-tp", "2"]
    )
    slow = parse_engine_args(
        ["llama-2-7b", "--cluster", CLUSTER, "--gpu-ids", "gpu0;gpu3", "-pp", "2"]
    )
    assert fast.pm.placement.tp == 2 and slow.pm.placement.pp == 2
    assert slow.pm.decode_step_s(8, 100) > fast.pm.decode_step_s(8, 100)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["nope-model"], "unknown model"),
        (["llama-2-70b"], "needs"),
        (["llama-2-7b", "--cluster", CLUSTER, "--gpu-ids", "gpu9"], "unknown GPU 'gpu9'"),
        (["llama-2-7b", "--cluster", CLUSTER], "--gpu-ids"),
        (["llama-2-7b", "--num-gpu-blocks-override", "2"], "lower --max-model-len"),
    ],
)
def test_bad_flags_give_one_readable_line(argv: list[str], needle: str) -> None:
    with pytest.raises(EngineArgsError) as info:
        parse_engine_args(argv)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_cli_exits_with_one_line_for_an_infeasible_gear() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flexpipe", "engine", "sim", "llama-2-70b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: cannot run llama-2-70b") and out.stderr.count("\n") == 1
    assert "Traceback" not in out.stderr


def test_vllm_pp_layer_partition_sets_uneven_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["llama-2-7b", "--cluster", CLUSTER, "--gpu-ids", "gpu2;gpu0", "-pp", "2"]
    even = parse_engine_args(argv)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "26,6")  # the L4 (gpu0) gets fewer layers
    uneven = parse_engine_args(argv)
    assert [s.num_layers for s in even.pm.placement.stages] == [16, 16]
    assert [s.num_layers for s in uneven.pm.placement.stages] == [26, 6]
    assert uneven.pm.decode_interval_s(8, 512) < even.pm.decode_interval_s(8, 512)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "20,20")
    with pytest.raises(EngineArgsError, match="summing to the model's 32 layers"):
        parse_engine_args(argv)


def test_secrets_come_from_flags_files_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["llama-2-7b", "--max-model-len", "1024"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("FLEXPIPE_ADMIN_TOKEN", raising=False)
    cfg = parse_engine_args(base)
    assert (cfg.api_key, cfg.admin_token) == (None, None)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    monkeypatch.setenv("FLEXPIPE_ADMIN_TOKEN", "admin-env")
    cfg = parse_engine_args(base)
    assert (cfg.api_key, cfg.admin_token) == ("from-env", "admin-env")
    key_file, token_file = tmp_path / "key", tmp_path / "token"
    key_file.write_text("  from-file \nsecond line ignored\n")
    token_file.write_text("admin-file")
    cfg = parse_engine_args(
        [*base, "--api-key-file", str(key_file), "--admin-token-file", str(token_file)]
    )
    assert (cfg.api_key, cfg.admin_token) == ("from-file", "admin-file")  # files beat env
    cfg = parse_engine_args([*base, "--api-key", "flag", "--admin-token", "admin-flag"])
    assert (cfg.api_key, cfg.admin_token) == ("flag", "admin-flag")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--api-key", "k", "--api-key-file", "{key}"], "not both"),
        (["--admin-token-file", "{missing}"], "No such file"),
        (["--api-key-file", "{empty}"], "is empty"),
    ],
)
def test_bad_secret_files_give_one_readable_line(
    tmp_path: Path, extra: list[str], needle: str
) -> None:
    (tmp_path / "key").write_text("k")
    (tmp_path / "empty").write_text("\n")
    paths = {n: str(tmp_path / n) for n in ("key", "missing", "empty")}
    argv = ["llama-2-7b", "--max-model-len", "1024", *(a.format(**paths) for a in extra)]
    with pytest.raises(EngineArgsError) as info:
        parse_engine_args(argv)
    assert needle in str(info.value) and "\n" not in str(info.value)
