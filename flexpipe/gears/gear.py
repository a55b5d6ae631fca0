"""Gears (one complete way to run a model) and placements (a gear bound to concrete GPUs).

A gear is what the scheduler shifts between: tensor- and pipeline-parallel sizes, precision,
max batch and KV policy. A placement says which GPUs each pipeline stage runs on, over which
links, and how many layers each stage holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from flexpipe.hardware import GpuSpec, LinkSpec, gpu_spec, link_spec
from flexpipe.precision import Precision, precision

NO_LINK = "none"  # the link class of a single-GPU gear
# the share of each GPU's memory an engine takes (weights, activations, KV cache) unless told
# otherwise: vLLM's --gpu-memory-utilization default
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class GearError(ValueError):
    """A gear string or placement that does not make sense."""


@dataclass(frozen=True, slots=True)
class Gear:
    tp: int = 1
    pp: int = 1
    dtype: str = "bf16"  # a precision name (flexpipe.precision)
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # chunked-prefill token budget per step
    block_size: int = 16
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise GearError(f"tp and pp must be >= 1 (got tp={self.tp}, pp={self.pp})")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise GearError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        precision(self.dtype)  # validates

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def precision(self) -> Precision:
        return precision(self.dtype)

    def key(self) -> str:
        """A stable short id: `tp2-pp1-bf16-kvauto-s256`."""
        return f"{self.family_key()}-s{self.max_num_seqs}"

    def family_key(self) -> str:
        """The key without the batch cap, `tp2-pp1-bf16-kvauto`: what a gear table curve is
        matched on (its points are concurrencies of one family)."""
        return f"tp{self.tp}-pp{self.pp}-{self.dtype}-kv{self.kv_cache_dtype}"

    def __str__(self) -> str:
        return (
            f"tp={self.tp},pp={self.pp},dtype={self.dtype},kv_cache_dtype={self.kv_cache_dtype},"
            f"max_num_seqs={self.max_num_seqs}"
        )


_GEAR_FIELDS = {
    "tp": "tp",
    "tensor_parallel_size": "tp",
    "pp": "pp",
    "pipeline_parallel_size": "pp",
    "dtype": "dtype",
    "precision": "dtype",
    "kv": "kv_cache_dtype",
    "kv_cache_dtype": "kv_cache_dtype",
    "max_num_seqs": "max_num_seqs",
    "batch": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "block_size": "block_size",
    "prefix_caching": "enable_prefix_caching",
    "enable_prefix_caching": "enable_prefix_caching",
}


def parse_gear(text: str, base: Gear | None = None) -> Gear:
    """Parse `tp=2,pp=1,dtype=bf16,max_num_seqs=128` (any subset; the rest from `base`)."""
    values: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not sep or key not in _GEAR_FIELDS:
            known = ", ".join(sorted(_GEAR_FIELDS))
            raise GearError(f"bad gear item {part!r}: expected KEY=VALUE with KEY one of {known}")
        target = _GEAR_FIELDS[key]
        raw = raw.strip()
        if target in ("dtype", "kv_cache_dtype"):
            values[target] = precision(raw).name if target == "dtype" else raw.lower()
        elif target == "enable_prefix_caching":
            values[target] = raw.lower() in ("1", "true", "yes", "on")
        else:
            try:
                values[target] = int(raw)
            except ValueError:
                raise GearError(f"bad gear item {part!r}: {key} must be an integer") from None
    return replace(base or Gear(), **values)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class GpuSlot:
    """One concrete GPU as a placement sees it: its spec and the memory free for us."""

    name: str  # cluster id, e.g. "node0/gpu1", or "gpu0" for ad-hoc groups
    spec: GpuSpec
    free_bytes: float

    @classmethod
    def whole(cls, gpu_type: str, name: str) -> GpuSlot:
        spec = gpu_spec(gpu_type)
        return cls(name, spec, spec.memory_bytes)


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage: `tp` GPUs joined by `tp_link` (None when tp == 1)."""

    gpus: tuple[GpuSlot, ...]
    tp_link: LinkSpec | None
    num_layers: int


@dataclass(frozen=True, slots=True)
class Placement:
    """A gear's GPUs: stages in pipeline order and the links between consecutive stages."""

    stages: tuple[Stage, ...]
    pp_links: tuple[LinkSpec, ...] = field(default=())  # len(stages) - 1 entries

    def __post_init__(self) -> None:
        if not self.stages:
            raise GearError("a placement needs at least one stage")
        if len(self.pp_links) != len(self.stages) - 1:
            raise GearError("a placement needs one link between each pair of stages")
        tps = {len(s.gpus) for s in self.stages}
        if len(tps) != 1:
            raise GearError("every pipeline stage must have the same tensor-parallel size")

    @property
    def tp(self) -> int:
        return len(self.stages[0].gpus)

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def gpus(self) -> tuple[GpuSlot, ...]:
        return tuple(g for s in self.stages for g in s.gpus)

    @property
    def num_layers(self) -> int:
        return sum(s.num_layers for s in self.stages)


def even_layer_split(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage for equal stages (the first stages take the remainder)."""
    if pp > num_layers:
        raise GearError(f"pp={pp} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))


def uniform_placement(
    gpus: list[GpuSlot],
    tp: int,
    pp: int,
    num_layers: int,
    tp_link: LinkSpec | str | None = "nvlink3",
    pp_link: LinkSpec | str | None = None,
    layers_per_stage: tuple[int, ...] | None = None,
) -> Placement:
    """Group `gpus` (tp*pp of them, in order) into pp stages of tp GPUs each."""
    if len(gpus) != tp * pp:
        raise GearError(f"gear needs {tp * pp} GPUs (tp={tp} x pp={pp}); got {len(gpus)}")
    tp_spec = link_spec(tp_link) if isinstance(tp_link, str) else tp_link
    pp_spec = link_spec(pp_link) if isinstance(pp_link, str) else pp_link
    if pp_spec is None:
        pp_spec = tp_spec if tp_spec is not None else link_spec("pcie4")
    layers = layers_per_stage or even_layer_split(num_layers, pp)
    if len(layers) != pp or sum(layers) != num_layers:
        raise GearError(f"layers_per_stage {layers} must give {pp} stages summing to {num_layers}")
    stages = tuple(
        Stage(tuple(gpus[i * tp : (i + 1) * tp]), tp_spec if tp > 1 else None, layers[i])
        for i in range(pp)
    )
    return Placement(stages, tuple(pp_spec for _ in range(pp - 1)))


def whole_gpu_placement(
    gear: Gear, gpu_types: Sequence[str], link: str, num_layers: int
) -> Placement:
    """Whole GPUs of the given types (one per rank, or one type for all) joined by the catalog
    link `link` ("none" for one GPU), layers split evenly: the hardware `gears show` and
    gear_bench name on the command line."""
    types = list(gpu_types)
    if len(types) == 1:
        types = types * gear.num_gpus
    if len(types) != gear.num_gpus:
        raise GearError(
            f"gear {gear.key()} needs {gear.num_gpus} GPUs; {len(types)} GPU types given"
        )
    slots = [GpuSlot.whole(t, f"gpu{i}") for i, t in enumerate(types)]
    lk = link_spec(link if link != NO_LINK else "nvlink3")
    return uniform_placement(slots, gear.tp, gear.pp, num_layers, lk, lk)
