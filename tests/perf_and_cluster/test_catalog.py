"""The catalogs: model shapes against published parameter counts, GPU and link lookups, gears."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexpipe.gears.gear import Gear, GearError, parse_gear
from flexpipe.hardware import (
    GB,
    GPUS,
    LINKS,
    CatalogError,
    GiB,
    gpu_spec,
    link_spec,
)
from flexpipe.model_spec import ModelSpecError, catalog_model_ids, load_model_spec
from flexpipe.precision import PrecisionError

SHIPPED = catalog_model_ids()

# -- model shapes ----------------------------------------------------------------------------


def test_every_listed_model_is_shipped() -> None:
    expected = {
        "llama-2-7b",
        "llama-2-13b",
        "llama-2-70b",
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen2.5-7b",
        "qwen2.5-14b",
        "qwen2.5-32b",
        "qwen2.5-72b",
        "mistral-7b",
        "mixtral-8x7b",
    }
    assert expected <= set(SHIPPED)


@pytest.mark.parametrize("model_id", SHIPPED)
def test_parameter_count_within_2_percent_of_published(model_id: str) -> None:
    spec = load_model_spec(model_id)
    assert spec.published_params is not None, f"{model_id} has no published count"
    assert spec.num_params == pytest.approx(spec.published_params, rel=0.02)


# Published counts written here with their sources, independent of the data files.
PUBLISHED = [
    # Hugging Face model page of meta-llama/Llama-2-7b-hf: "6.74B params" (safetensors).
    ("llama-2-7b", 6.74e9),
    # Hugging Face model page of meta-llama/Llama-2-70b-hf: "69B params" (68.98B).
    ("llama-2-70b", 68.98e9),
    # Meta Llama 3.1 model card / HF page of meta-llama/Llama-3.1-8B: "8.03B params".
    ("llama-3.1-8b", 8.03e9),
    # Mistral AI, "Mixtral of experts" (Dec 2023): "46.7B total parameters".
    ("mixtral-8x7b", 46.7e9),
    # Qwen2.5-7B model card: "Number of Parameters: 7.61B".
    ("qwen2.5-7b", 7.61e9),
    # Qwen2.5-72B model card: "Number of Parameters: 72.7B".
    ("qwen2.5-72b", 72.7e9),
]


@pytest.mark.parametrize(("model_id", "published"), PUBLISHED)
def test_parameter_count_matches_number_from_source(model_id: str, published: float) -> None:
    assert load_model_spec(model_id).num_params == pytest.approx(published, rel=0.02)


def test_qwen_non_embedding_parameters() -> None:
    # Qwen2.5-7B model card: "Number of Parameters (Non-Embedding): 6.53B" (untied lm_head).
    spec = load_model_spec("qwen2.5-7b")
    non_embedding = spec.num_params - spec.embedding_params - spec.lm_head_params
    assert non_embedding == pytest.approx(6.53e9, rel=0.01)


def test_moe_active_parameters() -> None:
    # Mistral AI, "Mixtral of experts": "only uses 12.9B parameters per token".
    mixtral = load_model_spec("mixtral-8x7b")
    assert mixtral.is_moe and mixtral.num_experts == 8 and mixtral.num_experts_per_tok == 2
    assert mixtral.active_params_per_token == pytest.approx(12.9e9, rel=0.02)
    assert mixtral.active_params_per_token < mixtral.num_params / 3
    dense = load_model_spec("llama-2-7b")
    assert not dense.is_moe and dense.active_params_per_token == dense.num_params


def test_gqa_and_tied_embedding_shapes() -> None:
    llama70 = load_model_spec("llama-2-70b")
    assert (llama70.num_heads, llama70.num_kv_heads, llama70.head_dim) == (64, 8, 128)
    assert llama70.kv_elements_per_token_per_layer() == 2 * 8 * 128
    qwen7 = load_model_spec("qwen2.5-7b")
    assert qwen7.attention_bias and not qwen7.tie_word_embeddings
    assert load_model_spec("llama-2-7b").lm_head_params == 32000 * 4096


def test_load_by_short_id_and_hf_repo_id_give_the_same_shape() -> None:
    by_id = load_model_spec("llama-2-7b")
    by_repo = load_model_spec("meta-llama/Llama-2-7b-hf")
    assert by_repo == by_id
    assert by_id.hf_repo == "meta-llama/Llama-2-7b-hf"
    assert load_model_spec("META-LLAMA/llama-2-7B-HF").num_layers == 32


def _llama_config() -> dict[str, object]:
    return {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    }


def test_load_by_config_json_path_and_folder(tmp_path: Path) -> None:
    # TinyLlama-1.1B's shape (HF TinyLlama/TinyLlama-1.1B-Chat-v1.0 config.json): 1.1B params.
    (tmp_path / "config.json").write_text(json.dumps(_llama_config()))
    by_file = load_model_spec(str(tmp_path / "config.json"))
    by_folder = load_model_spec(str(tmp_path))
    assert by_file.num_layers == by_folder.num_layers == 22
    assert by_file.num_kv_heads == 4 and by_file.head_dim == 64
    assert by_file.num_params == pytest.approx(1.1e9, rel=0.02)
    assert by_file.published_params is None


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ModelSpecError) as info:
        load_model_spec("llama-9-1b")
    message = str(info.value)
    assert "unknown model 'llama-9-1b'" in message
    assert "llama-2-7b" in message and "qwen2.5-72b" in message


def test_unsupported_or_broken_config_is_a_clear_error(tmp_path: Path) -> None:
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    with pytest.raises(ModelSpecError, match="model_type 'gpt2' is not supported"):
        load_model_spec(str(gpt2))
    incomplete = _llama_config()
    del incomplete["hidden_size"]
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(incomplete))
    with pytest.raises(ModelSpecError, match="lacks 'hidden_size'"):
        load_model_spec(str(partial))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ModelSpecError, match=r"cannot read config\.json"):
        load_model_spec(str(garbage))


# -- GPUs and links --------------------------------------------------------------------------


def test_gpu_catalog_has_every_listed_gpu() -> None:
    listed = {
        "A100-40G-SXM",
        "A100-80G-SXM",
        "A100-80G-PCIe",
        "H100-80G-SXM",
        "H100-80G-PCIe",
        "H200-141G",
        "L40S",
        "L4",
        "A10G",
        "V100-32G",
        "RTX-4090",
        "A40",
        "L20",
        "H20-96G",
        "B200-180G",
        "MI300X",
    }
    assert listed == set(GPUS)


def test_gpu_lookup_is_case_insensitive() -> None:
    assert gpu_spec("a100-80g-sxm") is GPUS["A100-80G-SXM"]
    assert gpu_spec(" H100_80G_SXM ") is GPUS["H100-80G-SXM"]
    assert gpu_spec("l4").memory_bytes == 24 * GiB


def test_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(CatalogError) as info:
        gpu_spec("A100")
    message = str(info.value)
    assert message.startswith("unknown GPU type 'A100'; known: ")
    assert all(name in message for name in GPUS)


def test_link_lookup_is_case_insensitive_and_takes_aliases() -> None:
    assert link_spec("NVLink3") is LINKS["nvlink3"]
    assert link_spec("25GbE") is LINKS["eth25"]
    assert link_spec("ndr") is LINKS["ib400"]
    assert link_spec("sys") is LINKS["cpu"]


def test_unknown_link_lists_the_known_ones() -> None:
    with pytest.raises(CatalogError) as info:
        link_spec("nvlink9")
    message = str(info.value)
    assert message.startswith("unknown link 'nvlink9'; known: ")
    assert "nvlink3" in message and "eth25" in message and "25gbe" in message


@pytest.mark.parametrize("name", sorted(GPUS))
def test_every_gpu_has_positive_figures(name: str) -> None:
    gpu = GPUS[name]
    assert gpu.memory_bytes > 0 and gpu.hbm_bandwidth_bytes_per_s > 0
    assert gpu.fp16_flops_per_s > 0
    for optional in (gpu.bf16_flops_per_s, gpu.fp8_flops_per_s, gpu.int8_ops_per_s):
        assert optional is None or optional > 0
    if gpu.nvlink_generation is not None:
        assert gpu.nvlink_bandwidth_bytes_per_s is not None
        assert link_spec(gpu.nvlink_generation).bandwidth_bytes_per_s == pytest.approx(
            gpu.nvlink_bandwidth_bytes_per_s
        )


def test_datasheet_spot_checks() -> None:
    # A100 datasheet: 80GB SXM 2,039 GB/s, 312 TF bf16 dense; H100 SXM 3.35 TB/s.
    a100 = gpu_spec("A100-80G-SXM")
    assert a100.memory_bytes == 80 * GiB
    assert a100.hbm_bandwidth_bytes_per_s == 2039 * GB
    assert a100.bf16_flops_per_s == 312e12
    assert gpu_spec("H100-80G-SXM").hbm_bandwidth_bytes_per_s == 3350 * GB
    assert gpu_spec("H200-141G").memory_bytes == 141 * GiB
    # H20: 96 GB HBM3 at 4.0 TB/s, but only 148 TF bf16: far more bytes per FLOP than an H100.
    h20 = gpu_spec("H20-96G")
    assert h20.hbm_bandwidth_bytes_per_s == 4000 * GB and h20.bf16_flops_per_s == 148e12
    assert gpu_spec("L20").hbm_bandwidth_bytes_per_s == 864 * GB
    assert gpu_spec("B200-180G").fp8_flops_per_s == 4500e12
    assert link_spec("nvlink5").bandwidth_bytes_per_s == 900 * GB
    mi300x = gpu_spec("MI300X")
    assert mi300x.memory_bytes == 192 * GiB and mi300x.bf16_flops_per_s == 1307.4e12
    assert link_spec("xgmi") is LINKS["infinity-fabric"]
    assert gpu_spec("A40").hbm_bandwidth_bytes_per_s == 696 * GB


def test_link_classes_are_ordered_nvlink_pcie_network() -> None:
    nvlinks = [lk for n, lk in LINKS.items() if n.startswith(("nvlink", "nvswitch"))]
    pcies = [lk for n, lk in LINKS.items() if n.startswith("pcie")]
    networks = [lk for lk in LINKS.values() if not lk.intra_node]
    ethernets = [lk for n, lk in LINKS.items() if n.startswith("eth")]
    assert nvlinks and pcies and networks and ethernets
    slowest_nvlink = min(lk.bandwidth_bytes_per_s for lk in nvlinks)
    fastest_pcie = max(lk.bandwidth_bytes_per_s for lk in pcies)
    fastest_network = max(lk.bandwidth_bytes_per_s for lk in networks)
    assert slowest_nvlink > fastest_pcie
    # A NIC sits in a PCIe x16 slot: no network outruns the fastest PCIe (NDR = gen5 x16).
    assert fastest_pcie >= fastest_network
    for pcie in pcies:
        assert all(pcie.bandwidth_bytes_per_s > eth.bandwidth_bytes_per_s for eth in ethernets)
    # Through the CPU is the slowest way inside a node, and still beats TCP Ethernet.
    intra = [lk.bandwidth_bytes_per_s for lk in LINKS.values() if lk.intra_node]
    assert LINKS["cpu"].bandwidth_bytes_per_s == min(intra)
    assert LINKS["cpu"].bandwidth_bytes_per_s > LINKS["eth25"].bandwidth_bytes_per_s
    assert all(lk.latency_s > 0 for lk in LINKS.values())
    assert min(lk.latency_s for lk in networks) > max(lk.latency_s for lk in nvlinks)


@pytest.mark.parametrize(
    ("name", "has_fp8"),
    [
        ("H100-80G-SXM", True),
        ("H100-80G-PCIe", True),
        ("H200-141G", True),
        ("L40S", True),
        ("L4", True),
        ("L20", True),
        ("H20-96G", True),
        ("B200-180G", True),
        ("MI300X", True),
        ("A40", False),
        ("A100-40G-SXM", False),
        ("A100-80G-SXM", False),
        ("A100-80G-PCIe", False),
        ("V100-32G", False),
        ("A10G", False),
    ],
)
def test_fp8_only_on_hopper_ada_blackwell_and_cdna3(name: str, has_fp8: bool) -> None:
    assert (gpu_spec(name).fp8_flops_per_s is not None) is has_fp8


def test_v100_has_no_bf16() -> None:
    assert gpu_spec("V100-32G").bf16_flops_per_s is None
    assert gpu_spec("A100-80G-SXM").bf16_flops_per_s is not None


# -- gears -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gear",
    [
        Gear(),
        Gear(tp=2, pp=1, dtype="bf16"),
        Gear(tp=4, pp=2, dtype="fp8", kv_cache_dtype="fp8", max_num_seqs=64),
        Gear(tp=1, pp=3, dtype="int4-awq", max_num_seqs=8),
    ],
)
def test_parse_gear_round_trips(gear: Gear) -> None:
    assert parse_gear(str(gear)) == gear


def test_parse_gear_reads_aliases_and_keeps_the_base() -> None:
    gear = parse_gear("tensor_parallel_size=2, precision=bfloat16, batch=32")
    assert (gear.tp, gear.pp, gear.dtype, gear.max_num_seqs) == (2, 1, "bf16", 32)
    base = Gear(tp=4, max_num_seqs=16)
    assert parse_gear("pp=2", base) == Gear(tp=4, pp=2, max_num_seqs=16)
    assert parse_gear("dtype=int4").dtype == "int4-awq"
    assert Gear(tp=2).key() == "tp2-pp1-bf16-kvauto-s256"
    assert Gear(tp=2, pp=3).num_gpus == 6


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ("tp2", GearError, "bad gear item 'tp2': expected KEY=VALUE"),
        ("warp=9", GearError, "bad gear item 'warp=9'"),
        ("tp=two", GearError, "tp must be an integer"),
        ("tp=0", GearError, "tp and pp must be >= 1"),
        ("pp=-1", GearError, "tp and pp must be >= 1"),
        ("max_num_seqs=0", GearError, "must be >= 1"),
        ("dtype=fp7", PrecisionError, "unknown precision 'fp7'"),
    ],
)
def test_bad_gear_strings_are_errors(text: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_gear(text)
    assert issubclass(error, ValueError)
