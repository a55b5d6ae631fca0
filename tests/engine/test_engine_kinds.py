"""The engine kinds' declaration: which moves keep their KV cache, what each kind supports,
and the gateway's signals read from each kind's own metric names."""

from __future__ import annotations

import pytest

from flexpipe.engine_kinds import (
    ENGINE_KINDS,
    SIGNALS,
    engine_kind,
    kv_move_possible,
)
from flexpipe.gateway.core.engine_metrics import parse_engine_metrics
from flexpipe.launch import ENGINES


@pytest.mark.parametrize(
    ("src", "dst", "possible"),
    [
        ("sim", "sim", True),
        ("sim", "vllm", False),
        ("vllm", "sim", False),
        ("vllm", "vllm", False),
        ("sglang", "sglang", False),
        ("vllm", "sglang", False),
    ],
)
def test_a_kv_move_needs_export_and_import_on_both_ends(src: str, dst: str, possible: bool) -> None:
    assert kv_move_possible(src, dst) is possible


def test_what_each_kind_supports() -> None:
    assert {
        k: (v.kv_export_import, v.sleep_levels, v.pp_across_nodes) for k, v in ENGINE_KINDS.items()
    } == {
        "sim": (True, (1, 2), True),
        "vllm": (False, (1, 2), True),
        "sglang": (False, (), False),
    }
    assert ENGINES == ("sim", "vllm", "sglang")  # the launchers run exactly the declared kinds
    for kind in ENGINE_KINDS.values():
        assert set(kind.metrics.values()) <= set(SIGNALS), kind.name
        assert kind.health_path == "/health" and kind.models_path == "/v1/models"


def test_an_unknown_kind_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"unknown engine 'tgi'; use one of sim, vllm, sglang"):
        engine_kind("tgi")
    with pytest.raises(ValueError, match="unknown engine"):
        kv_move_possible("sim", "tgi")


SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="llama-7b",tp_rank="0"} 12.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="llama-7b",tp_rank="0"} 3.0
sglang:token_usage{model_name="llama-7b",tp_rank="0"} 0.42
sglang:max_total_num_tokens{model_name="llama-7b",tp_rank="0"} 215040.0
sglang:gen_throughput{model_name="llama-7b",tp_rank="0"} 812.5
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="llama-7b"} 9100.0
sglang:prompt_tokens_total{model_name="llama-7b"} 40960.0
sglang:cached_tokens_total{model_name="llama-7b"} 20480.0
"""


def test_sglang_metrics_feed_the_gateways_routing_record() -> None:
    """The gateway reads each kind's declared names: SGLang's running and queued requests, KV
    usage and size land in the same fields as vLLM's."""
    assert parse_engine_metrics(SGLANG_METRICS.encode()) == {
        "num_running": 12.0,
        "num_waiting": 3.0,
        "kv_usage": 0.42,
        "num_kv_tokens": 215040.0,
    }


def test_vllm_metrics_are_summed_over_label_sets() -> None:
    text = (
        b'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        b'vllm:kv_cache_usage_perc{engine="0",model_name="a b"} 0.25\n'
        b"vllm:num_requests_waiting 4\n"
    )
    assert parse_engine_metrics(text) == {"num_running": 5.0, "kv_usage": 0.25, "num_waiting": 4.0}
