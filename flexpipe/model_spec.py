"""Model shapes, read from Hugging Face `config.json` dicts (never weights).

`load_model_spec` accepts a short id (`llama-2-7b`), a Hugging Face repo id
(`meta-llama/Llama-2-7b-hf`), or a path to any `config.json` (or a folder holding one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "mixtral")


class ModelSpecError(ValueError):
    """A model that cannot be found or a config.json that cannot be read."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # the id users typed or the catalog id
    hf_repo: str | None
    architecture: str  # model_type: llama, qwen2, mistral, mixtral
    num_layers: int
    hidden_size: int
    intermediate_size: int  # per expert for MoE
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_experts: int = 1  # 1 = dense
    num_experts_per_tok: int = 1
    attention_bias: bool = False  # qkv bias (Qwen2)
    published_params: float | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        params = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            params += self.q_size + 2 * self.kv_size
        return params

    @property
    def mlp_params_per_expert(self) -> int:
        # gate, up and down projections (SwiGLU)
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def mlp_params_per_layer(self) -> int:
        router = self.hidden_size * self.num_experts if self.is_moe else 0
        return self.num_experts * self.mlp_params_per_expert + router

    @property
    def params_per_layer(self) -> int:
        norms = 2 * self.hidden_size
        return self.attention_params_per_layer + self.mlp_params_per_layer + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        final_norm = self.hidden_size
        return (
            self.num_layers * self.params_per_layer
            + self.embedding_params
            + self.lm_head_params
            + final_norm
        )

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token touches (MoE: only its top-k experts)."""
        inactive = (self.num_experts - self.num_experts_per_tok) * self.mlp_params_per_expert
        return self.num_params - self.num_layers * inactive

    def kv_elements_per_token_per_layer(self) -> int:
        """K and V elements one token adds to one layer's cache (all KV heads)."""
        return 2 * self.kv_size


def model_spec_from_config(
    config: dict[str, Any],
    name: str,
    hf_repo: str | None = None,
    published_params: float | None = None,
) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config.json dict."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelSpecError(
            f"{name}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        spec = ModelSpec(
            name=name,
            hf_repo=hf_repo,
            architecture=model_type,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            num_experts=int(config.get("num_local_experts", 1) or 1),
            num_experts_per_tok=int(config.get("num_experts_per_tok", 1) or 1),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            published_params=published_params,
        )
    except KeyError as exc:
        raise ModelSpecError(f"{name}: config.json lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelSpecError(f"{name}: config.json has a bad value: {exc}") from None
    if spec.num_heads % spec.num_kv_heads:
        raise ModelSpecError(f"{name}: num_attention_heads is not a multiple of kv heads")
    return spec


@cache
def _catalog() -> dict[str, dict[str, Any]]:
    """Shipped shapes, by short id and by Hugging Face repo id (lower-cased)."""
    out: dict[str, dict[str, Any]] = {}
    folder = resources.files("flexpipe") / "data" / "models"
    for entry in folder.iterdir():
        if not entry.name.endswith(".json"):
            continue
        doc: dict[str, Any] = json.loads(entry.read_text())
        out[doc["id"].lower()] = doc
        out[doc["hf_repo"].lower()] = doc
    return out


def catalog_model_ids() -> list[str]:
    """Short ids of the shipped model shapes."""
    return sorted({doc["id"] for doc in _catalog().values()})


def load_model_spec(name_or_path: str) -> ModelSpec:
    doc = _catalog().get(name_or_path.strip().lower())
    if doc is not None:
        return model_spec_from_config(
            doc["config"], doc["id"], doc["hf_repo"], doc.get("published_params")
        )
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelSpecError(f"{path}: cannot read config.json: {exc}") from None
        if not isinstance(config, dict):
            raise ModelSpecError(f"{path}: config.json is not a JSON object")
        return model_spec_from_config(config, name_or_path)
    raise ModelSpecError(
        f"unknown model {name_or_path!r}: not a shipped shape ({', '.join(catalog_model_ids())}) "
        "and not a path to a config.json"
    )
