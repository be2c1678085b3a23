"""Decode attention on a paged vs a contiguous KV cache: dense and the Kascade kernels, CUPTI kernel time.

    python -m experiments.bench_paged                      # H200: 32K and 128K, batch 8 and 64, page size 64
    python -m experiments.bench_paged --paged_page_sizes=16,64

For every (batch, context, page size), the paged / contiguous ratio of dense, A0, A, R and the weighted Kascade time
(`--num_layers`, `--num_anchors`), after a same-run check of every paged kernel against its contiguous twin. Writes
the "kernels" section of <--paged_out>/paged.json and paged.md (shared with serve_replay.py). The measurement and
the report are kascade_jax/bench/paged.py; this parses the flags. Needs a GPU. A row that runs out of device memory
(128K at batch 64 allocates 16 GiB caches and pools, which a fragmented BFC pool may not fit) is recorded as failed and
followed by a one-line hint: rerun it with XLA_PYTHON_CLIENT_ALLOCATOR=platform.
"""

from __future__ import annotations

import os

from absl import flags

from experiments import cli
from experiments.timing import shape_from_flags

CONTEXTS = flags.DEFINE_list("paged_contexts", ["32768", "131072"], "Cache lengths.")
BATCHES = flags.DEFINE_list("paged_batches", ["8", "64"], "Batch sizes.")
PAGE_SIZES = flags.DEFINE_list("paged_page_sizes", ["64"], "Page sizes (powers of two in 16..256).")
FRAC = flags.DEFINE_float("paged_topk_frac", 0.1, "Top-k fraction.")
MIN_K = flags.DEFINE_integer("paged_min_k", 128, "Minimum Top-k budget.")
ITERS = flags.DEFINE_integer("paged_iterations", 10, "CUPTI iterations per measurement (median reported).")
CHECK = flags.DEFINE_boolean("paged_check", True, "Check paged against contiguous kernels first.")
OUT = flags.DEFINE_string("paged_out", "benchmarks", "Output folder for paged.json / paged.md.")
STREAM_BLOCK = flags.DEFINE_integer("paged_stream_block", 128, "Keys per step of the paged whole-cache pass (dense, "
                                    "anchor scores); <= page size: one contiguous load per block, else a row gather.")
MASK = flags.DEFINE_enum("paged_mask", "none", ["none", "v", "kv"], "Paged rows loaded through a zero mask "
                         "(DecodeTuning.paged_mask): none (the cache keeps them finite), v, or k and v; the A/B of "
                         "the paged gap.")
MAX_GB = flags.DEFINE_float("paged_max_cache_gb", 100.0,
                            "Skip shapes whose peak K/V (one layout's K and V plus one paged pool) exceeds this (GB).")


def int_list(flag: str, values) -> list[int]:
    """--flag=a,b,c -> [a, b, c] as ints; a ValueError naming the flag and the value otherwise."""
    out = []
    for v in values:
        try:
            out.append(int(v))
        except ValueError:
            raise ValueError(f"--{flag} takes comma-separated integers, got {v!r} in {','.join(values)!r}") from None
    return out


OOM_HINT = ("hint: out of device memory: rerun that shape alone with XLA_PYTHON_CLIENT_ALLOCATOR=platform (no BFC "
            "pool to fragment; the CUPTI kernel times do not depend on the allocator; rows merge by shape)")


def with_oom_hint(log):
    """`log`, followed once by OOM_HINT after the first row that failed with RESOURCE_EXHAUSTED (unless the platform
    allocator is already on)."""
    shown = []

    def out(msg):
        log(msg)
        if (not shown and msg.startswith("FAILED") and "RESOURCE_EXHAUSTED" in msg
                and os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") != "platform"):
            shown.append(msg)
            log(OOM_HINT)

    return out


def main(argv):
    del argv
    from kascade_jax.bench import paged

    # One process, one GPU: both caches of a shape are resident at once, so let JAX take most of the memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    paged.run(int_list("paged_contexts", CONTEXTS.value), int_list("paged_batches", BATCHES.value),
              int_list("paged_page_sizes", PAGE_SIZES.value),
              frac=FRAC.value, min_k=MIN_K.value, iters=ITERS.value, do_check=CHECK.value, out_dir=OUT.value,
              max_cache_gb=MAX_GB.value, shape=shape_from_flags(), stream_block=STREAM_BLOCK.value,
              log=with_oom_hint(print), mask=MASK.value)


if __name__ == "__main__":
    cli.run(main)
