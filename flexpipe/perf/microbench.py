"""Micro-benchmarks for `flexpipe calibrate`, through PyTorch, on the GPUs of this machine.

What is timed, all in 16 bit with random weights at the model's shapes, each the median of
`repeats` runs after warm-up (CUDA events on a GPU):

- the four GEMMs of a layer (QKV, O, gate+up, down) at every TP degree the heads allow,
  over a ladder of token counts (1 .. 8,192);
- the five memory-bound ops (two RMSNorms, RoPE, SiLU-and-mul, residual add), same ladder;
- an HBM copy of 1 GiB (`hbm_copy`, bytes read + written);
- one whole decoder layer (`layer_prefill` / `layer_decode`) at several batch sizes and
  context lengths, to check the fitted model against a real layer;
- all-reduce and send/recv through NCCL over every visible GPU (and over 2) when more than
  one GPU is visible, from 2 KiB to 64 MiB.

Rows are `flexpipe.perf.sample.Sample`s: the measurement CSV that `flexpipe.perf.fit` reads.
PyTorch is an optional extra (`pip install 'flexpipe[calibrate]'`); it is imported only here,
and only when a benchmark runs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flexpipe.model_spec import ModelSpec
from flexpipe.perf.operator import GEMM_OPS, LayerShape
from flexpipe.perf.sample import Sample

INSTALL_HINT = (
    "flexpipe calibrate measures through PyTorch, which is not installed: "
    "pip install 'flexpipe[calibrate]' (or fit recorded measurements: --from-csv FILE)"
)
TOKEN_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_TOKEN_LADDER = (1, 8, 64, 256, 1024, 4096)
# (batch, prompt tokens each) for prefill; (batch, context) for decode.
PREFILL_POINTS = ((1, 512), (1, 2048), (4, 1024))
DECODE_POINTS = ((1, 512), (8, 512), (32, 2048), (128, 1024))
MESSAGE_SIZES = tuple(2**k for k in range(11, 27))


class CalibrateError(RuntimeError):
    """The benchmarks cannot run here; the message says what to do."""


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _torch() -> Any:
    if not torch_available():
        raise CalibrateError(INSTALL_HINT)
    return importlib.import_module("torch")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    tokens: Sequence[int] = TOKEN_LADDER
    prefill_points: Sequence[tuple[int, int]] = PREFILL_POINTS
    decode_points: Sequence[tuple[int, int]] = DECODE_POINTS
    repeats: int = 20
    warmup: int = 3
    device: str = "cuda"  # "cpu" only to exercise this code without a GPU

    @classmethod
    def quick(cls, device: str = "cuda") -> BenchConfig:
        return cls(QUICK_TOKEN_LADDER, PREFILL_POINTS[:1], DECODE_POINTS[:2], 5, 1, device)


class _Timer:
    def __init__(self, torch: Any, config: BenchConfig) -> None:
        self.torch, self.config = torch, config
        self.cuda = config.device.startswith("cuda")

    def median_s(self, fn: Callable[[], object]) -> float:
        torch, cfg = self.torch, self.config
        for _ in range(cfg.warmup):
            fn()
        times: list[float] = []
        for _ in range(cfg.repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _tp_degrees(model: ModelSpec) -> list[int]:
    return [tp for tp in (1, 2, 4, 8) if model.num_heads % tp == 0]


def _kernel_samples(
    torch: Any, timer: _Timer, model: ModelSpec, gpu_type: str, config: BenchConfig
) -> list[Sample]:
    dev, dtype = config.device, torch.float16
    shape = LayerShape.of(model)
    out: list[Sample] = []

    def sample(op: str, seconds: float, tokens: int, tp: int) -> Sample:
        return Sample(
            gpu_type,
            op,
            seconds,
            tokens,
            tp,
            model.hidden_size,
            model.intermediate_size,
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
            source=f"flexpipe calibrate {model.name}",
        )

    for tp in _tp_degrees(model):
        dims = shape.gemm_dims(tp)
        weights = {op: torch.randn(k, n, device=dev, dtype=dtype) for op, (k, n) in dims.items()}
        elems = shape.memory_elements_per_token(tp)
        for tokens in config.tokens:
            for op in GEMM_OPS:
                k, _ = dims[op]
                x = torch.randn(tokens, k, device=dev, dtype=dtype)
                gemm = functools.partial(torch.matmul, x, weights[op])
                out.append(sample(op, timer.median_s(gemm), tokens, tp))
            ops = _memory_ops(torch, model, tp, tokens, elems["attn_rope"] // 2, config.device)
            for op, fn in ops.items():
                out.append(sample(op, timer.median_s(fn), tokens, tp))
        del weights
    return out


def _memory_ops(
    torch: Any, model: ModelSpec, tp: int, tokens: int, qk_width: int, dev: str
) -> dict[str, Callable[[], object]]:
    """The five memory-bound ops of a layer on `tokens` tokens, eager PyTorch."""
    f, dtype, h = torch.nn.functional, torch.float16, model.hidden_size
    inter = model.intermediate_size // tp
    x = torch.randn(tokens, h, device=dev, dtype=dtype)
    residual = torch.randn(tokens, h, device=dev, dtype=dtype)
    norm_w = torch.ones(h, device=dev, dtype=dtype)
    qk = torch.randn(tokens, qk_width, device=dev, dtype=dtype)
    cos, sin = torch.randn_like(qk), torch.randn_like(qk)
    gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dtype)

    def rope() -> object:
        return qk * cos + torch.roll(qk, 64, -1) * sin

    def silu_and_mul() -> object:
        return f.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    return {
        "input_layernorm": functools.partial(f.rms_norm, x, (h,), norm_w),
        "post_attention_layernorm": functools.partial(f.rms_norm, x + residual, (h,), norm_w),
        "attn_rope": rope,
        "mlp_act": silu_and_mul,
        "add": functools.partial(torch.add, x, residual),
    }


def _copy_sample(torch: Any, timer: _Timer, gpu_type: str, config: BenchConfig) -> Sample:
    num_bytes = 2**30 if config.device.startswith("cuda") else 2**26
    src = torch.empty(num_bytes, device=config.device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = timer.median_s(functools.partial(dst.copy_, src))
    return Sample(gpu_type, "hbm_copy", seconds, message_bytes=2 * num_bytes, source="hbm copy")


class _Layer:
    """One Llama-style decoder layer with random weights (GQA, RoPE, gated SiLU MLP)."""

    def __init__(self, torch: Any, model: ModelSpec, device: str) -> None:
        self.torch, self.m = torch, model
        dtype = torch.float16
        h, i, d = model.hidden_size, model.intermediate_size, model.head_dim
        q, kv = model.num_heads * d, model.num_kv_heads * d
        self.qkv = torch.randn(h, q + 2 * kv, device=device, dtype=dtype) * 0.02
        self.o = torch.randn(q, h, device=device, dtype=dtype) * 0.02
        self.gate_up = torch.randn(h, 2 * i, device=device, dtype=dtype) * 0.02
        self.down = torch.randn(i, h, device=device, dtype=dtype) * 0.02
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.device, self.dtype = device, dtype

    def forward(self, x: Any, k_cache: Any | None, v_cache: Any | None) -> Any:
        """x: (batch, new tokens, hidden); caches: (batch, kv heads, context, head dim)."""
        torch, m = self.torch, self.m
        f = torch.nn.functional
        b, t, h = x.shape
        d, nh, nkv = m.head_dim, m.num_heads, m.num_kv_heads
        y = f.rms_norm(x, (h,), self.norm)
        qkv = y @ self.qkv
        q = qkv[..., : nh * d].view(b, t, nh, d).transpose(1, 2)
        k = qkv[..., nh * d : (nh + nkv) * d].view(b, t, nkv, d).transpose(1, 2)
        v = qkv[..., (nh + nkv) * d :].view(b, t, nkv, d).transpose(1, 2)
        if k_cache is not None:
            k = torch.cat([k_cache, k], dim=2)
            v = torch.cat([v_cache, v], dim=2)
        attn = f.scaled_dot_product_attention(
            q, k, v, is_causal=k_cache is None, enable_gqa=nkv != nh
        )
        x = x + attn.transpose(1, 2).reshape(b, t, nh * d) @ self.o
        y = f.rms_norm(x, (h,), self.norm)
        gu = y @ self.gate_up
        inter = m.intermediate_size
        return x + (f.silu(gu[..., :inter]) * gu[..., inter:]) @ self.down


def _layer_samples(
    torch: Any, timer: _Timer, model: ModelSpec, gpu_type: str, config: BenchConfig
) -> list[Sample]:
    layer = _Layer(torch, model, config.device)
    dev, dtype, h = config.device, layer.dtype, model.hidden_size
    kv_shape = (model.num_kv_heads, model.head_dim)
    out: list[Sample] = []
    base = dict(
        tp=1,
        hidden_size=h,
        intermediate_size=model.intermediate_size,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        source=f"flexpipe calibrate {model.name} layer",
    )
    with torch.inference_mode():
        for batch, prompt in config.prefill_points:
            x = torch.randn(batch, prompt, h, device=dev, dtype=dtype)
            seconds = timer.median_s(functools.partial(layer.forward, x, None, None))
            out.append(
                Sample(gpu_type, "layer_prefill", seconds, batch * prompt, num_seqs=batch, **base)  # type: ignore[arg-type]
            )
        for batch, context in config.decode_points:
            x = torch.randn(batch, 1, h, device=dev, dtype=dtype)
            kc = torch.randn(batch, kv_shape[0], context, kv_shape[1], device=dev, dtype=dtype)
            vc = torch.randn_like(kc)
            seconds = timer.median_s(functools.partial(layer.forward, x, kc, vc))
            out.append(
                Sample(
                    gpu_type,
                    "layer_decode",
                    seconds,
                    batch,
                    num_seqs=batch,
                    context_len=context,
                    **base,  # type: ignore[arg-type]
                )
            )
    return out


def _collective_worker(
    rank: int, world: int, port: int, link: str, repeats: int, results: Any
) -> None:
    torch = importlib.import_module("torch")
    dist = importlib.import_module("torch.distributed")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    timer = _Timer(torch, BenchConfig(repeats=repeats))
    rows: list[Sample] = []
    for size in MESSAGE_SIZES:
        buf = torch.empty(size // 2, device=f"cuda:{rank}", dtype=torch.float16)
        seconds = timer.median_s(functools.partial(dist.all_reduce, buf))
        rows.append(
            Sample(
                "",
                "all_reduce",
                seconds,
                link=link,
                num_ranks=world,
                message_bytes=size,
                source=f"nccl all_reduce x{world}",
            )
        )
        if world == 2:

            def send_recv(buf: Any = buf) -> None:
                if rank == 0:
                    dist.send(buf, 1)
                else:
                    dist.recv(buf, 0)

            seconds = timer.median_s(send_recv)
            rows.append(
                Sample(
                    "",
                    "send_recv",
                    seconds,
                    link=link,
                    num_ranks=2,
                    message_bytes=size,
                    source="nccl send/recv",
                )
            )
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _collective_samples(torch: Any, link: str, repeats: int) -> list[Sample]:
    count = torch.cuda.device_count()
    if count < 2:
        return []
    mp = importlib.import_module("torch.multiprocessing")
    ctx = mp.get_context("spawn")
    out: list[Sample] = []
    for world in sorted({2, count}):
        results = ctx.SimpleQueue()
        mp.start_processes(
            _collective_worker,
            args=(world, 29500 + world, link, repeats, results),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        out.extend(results.get())
    return out


def run_benchmarks(
    model: ModelSpec, gpu_type: str, link: str | None, config: BenchConfig
) -> list[Sample]:
    """Every measurement above on this machine's first GPU (and all of them for NCCL)."""
    torch = _torch()
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise CalibrateError("flexpipe calibrate needs a CUDA GPU; torch sees none here")
    timer = _Timer(torch, config)
    with torch.inference_mode():
        samples = _kernel_samples(torch, timer, model, gpu_type, config)
        samples.append(_copy_sample(torch, timer, gpu_type, config))
    samples += _layer_samples(torch, timer, model, gpu_type, config)
    if config.device.startswith("cuda") and link is not None:
        samples += _collective_samples(torch, link, config.repeats)
    return samples


def visible_gpu(torch_module: Any | None = None) -> tuple[str, float, int]:
    """(NVML-style name, memory bytes, count) of the visible GPUs."""
    torch = torch_module or _torch()
    props = torch.cuda.get_device_properties(0)
    return str(props.name), float(props.total_memory), int(torch.cuda.device_count())
