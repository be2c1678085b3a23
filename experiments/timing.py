"""CUPTI kernel timing shared by the benchmarks (device time only, no Python dispatch), and their output files."""

from __future__ import annotations

import json
import os
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


def write_outputs(out_dir: str, stem: str, payload: dict, markdown: str, plot=None) -> None:
    """<out_dir>/<stem>.json (payload), <stem>.md and, if `plot` is given, <stem>.png written by plot(path)."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    with open(base + ".json", "w") as fh:
        json.dump(payload, fh, indent=1)
    with open(base + ".md", "w") as fh:
        fh.write(markdown)
    if plot is not None:
        plot(base + ".png")
