"""The flags the kernel benchmarks share (bench_decode, bench_prefill, bench_paged): the attention shape and layer
mix they time (`--heads`, `--num_layers`, `--num_anchors`) and the tag of their output files (`--bench_tag`).

What is timed and how is the library's (kascade_jax/bench/timing.py: `BenchShape`, CUPTI); this is only flags.
"""

from __future__ import annotations

from absl import flags

from kascade_jax.bench.timing import BenchShape

HEADS = flags.DEFINE_list("heads", ["32", "8", "128"], "Attention shape timed and checked: q_heads,kv_heads,head_dim "
                          "(Llama-3.1-8B 32,8,128; Qwen2.5-Coder-0.5B 14,2,64; Qwen2.5-Coder-1.5B 12,2,128).")
# allow_override: the same concept as the model entry points' --num_layers / --num_anchors, so a process (e.g. a
# test session) that imports both keeps working instead of raising DuplicateFlagError.
NUM_LAYERS = flags.DEFINE_integer("num_layers", 32, "Layers L of the weighted Kascade time "
                                  "(1*A0 + (M-1)*A + (L-M)*R)/L.", allow_override=True)
NUM_ANCHORS = flags.DEFINE_integer("num_anchors", 5, "Anchor layers M (layer 0 included) of the weighted Kascade "
                                   "time.", allow_override=True)
BENCH_TAG = flags.DEFINE_string("bench_tag", "", "Output file stem suffix: decode_<tag>.md/json/png, "
                                "prefill_<tag>.*, prefill_sweep_<tag>.* ('' = decode.* etc., which hold only the "
                                "default shape 32,8,128 with 32 layers and 5 anchors).")


def shape_from_flags() -> BenchShape:
    """The BenchShape of --heads, --num_layers and --num_anchors."""
    return BenchShape.parse(HEADS.value, NUM_LAYERS.value, NUM_ANCHORS.value)
