"""An `EngineConfig` -> the engine core it runs (block manager, scheduler, step time).

One place for it: the sim engine process (`SimServer`) and the simulator (one core per
simulated instance, flexpipe.sim.engine_factory) build their cores here, so the two cannot
drift apart.
"""

from __future__ import annotations

from flexpipe.engine.args import EngineConfig
from flexpipe.engine.block_manager import BlockManager
from flexpipe.engine.core import EngineCore
from flexpipe.engine.scheduler import Scheduler, SchedulerConfig


def engine_core(cfg: EngineConfig, lazy_decodes: bool = False) -> EngineCore:
    """`lazy_decodes`: see flexpipe.engine.scheduler (the simulator's; the live engine
    streams every token of every request, step by step)."""
    gear = cfg.gear
    block_manager = BlockManager(cfg.num_kv_blocks, gear.block_size, gear.enable_prefix_caching)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=gear.max_num_seqs,
            max_num_batched_tokens=gear.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            policy=cfg.scheduling_policy,
        ),
        block_manager,
        lazy_decodes,
    )
    return EngineCore(scheduler, cfg.pm.step_time_s)


__all__ = ["engine_core"]
