"""CUPTI kernel timing shared by the benchmarks (device time only, no Python dispatch)."""

from __future__ import annotations

import statistics


def cupti_time(fn, args, iters: int):
    """(median total kernel ms per call, {kernel name: mean ms per call}); several launches of one name add up."""
    from jax.experimental.mosaic.gpu import profiler

    _, timings = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
    totals = [sum(t for _, t in it) for it in timings]
    per: dict[str, list[float]] = {}
    for it in timings:
        for name, t in it:
            per.setdefault(name, []).append(t)
    return statistics.median(totals), {name: sum(ts) / len(timings) for name, ts in per.items()}
