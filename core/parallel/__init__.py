"""Tensor, expert and data parallel serving (docs/parallel.md)."""
from __future__ import annotations


def engine_class(config):
    """Engine for one rank, ParallelEngine when the config asks for several."""
    if config.world_size > 1:
        from shuili.core.parallel.engine import ParallelEngine

        return ParallelEngine
    from shuili.core.engine import Engine

    return Engine
