"""One measured kernel time, and the measurement CSV that holds them.

The same CSV comes from two places: public operator profiles converted by
`bench/perf_model_error.py` (shipped as flexpipe/perf/data/vidur_samples.csv) and
`flexpipe calibrate --out` on the user's GPUs. The fit (`flexpipe/perf/fit.py`) reads either.

Ops: the GEMMs and memory-bound ops of `flexpipe.perf.operator` (per layer, on one of `tp`
ranks, model dims given); `all_reduce` / `send_recv` of `message_bytes` over `num_ranks` GPUs on
`link`; `hbm_copy` of `message_bytes` (read + written); `layer_prefill` / `layer_decode`: one
whole decoder layer for `num_seqs` sequences (prefill: `num_tokens` new tokens in all, no
cache; decode: one token each over `context_len` tokens of context), kept to check the model.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import astuple, dataclass, fields

COLLECTIVE_OPS = ("all_reduce", "send_recv")
LAYER_OPS = ("layer_prefill", "layer_decode")
COPY_OP = "hbm_copy"


@dataclass(frozen=True, slots=True)
class Sample:
    gpu_type: str  # catalog name ("" for a collective: the link names it)
    op: str
    time_s: float  # median of the repetitions
    num_tokens: int = 0
    tp: int = 1
    hidden_size: int = 0
    intermediate_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    link: str = ""
    num_ranks: int = 0
    message_bytes: int = 0
    num_seqs: int = 0
    context_len: int = 0
    source: str = ""  # setup the row came from, e.g. "vidur a100 Llama-2-7b-hf"

    def __post_init__(self) -> None:
        if not self.time_s > 0:
            raise ValueError(f"sample {self.op} has non-positive time {self.time_s}")


COLUMNS = tuple(f.name for f in fields(Sample))
_TYPES = {f.name: f.type for f in fields(Sample)}


def write_samples_csv(samples: Iterable[Sample]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for s in samples:
        writer.writerow(f"{v:.6g}" if isinstance(v, float) else v for v in astuple(s))
    return out.getvalue()


def read_samples_csv(text: str, where: str = "measurement CSV") -> list[Sample]:
    """Parse a measurement CSV; a bad row is a ValueError naming its line."""
    reader = csv.DictReader(io.StringIO(text))
    missing = {"gpu_type", "op", "time_s"} - set(reader.fieldnames or ())
    if missing:
        raise ValueError(f"{where}: missing column(s) {', '.join(sorted(missing))}")
    out: list[Sample] = []
    for line, row in enumerate(reader, start=2):
        values: dict[str, object] = {}
        try:
            for name in COLUMNS:
                raw = (row.get(name) or "").strip()
                kind = _TYPES[name]
                if kind == "str":
                    values[name] = raw
                elif kind == "float":
                    values[name] = float(raw)
                else:
                    values[name] = int(float(raw)) if raw else 0
            out.append(Sample(**values))  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where} line {line}: {exc}") from None
    return out
