"""Calibrate Kascade for a model: anchors for every budget, head maps, S/w plots, one artifact.

    python -m experiments.calibrate --model=smollm2-135m                      # built-in offline dev set, 64 prompts
    python -m experiments.calibrate --dataset=bdsaglam/musique --dataset_config=answerable --calib_num_prompts=1000

Writes `<output_dir>/<model>-<dataset>-<n>-k<k>-ts<tile>-<digest>.json` (+ .npz, + _S.png / _w.png), the digest
being that of the full calibration key (kascade_jax.calibration.artifact.CalibrationKey), which the JSON records.
The default output_dir is the cache that `--anchors=auto` in generate/eval reads. The calibration flags have the
names of the recipe fields they correspond to in generate/eval (`--calib_num_prompts`, `--calib_k`,
`--calib_reduce`, `--calib_min_tokens`, `--calib_max_tokens`); the older `--num_prompts`, `--k`, `--reduce`,
`--min_tokens`, `--max_tokens` still work and warn. Prints the anchor sets for M = 3..8 with
their objective, the time taken, and (with --stability) the anchor sets found on two disjoint halves of the
prompts.
"""

from __future__ import annotations

import json
import time

from absl import flags

from experiments import cli

flags.DEFINE_string("model", "smollm2-135m", "Model: alias (smollm2-135m), HF safetensors dir, .gguf file or hub id.")
flags.DEFINE_string("dataset", "builtin", "'builtin' (offline RULER-style + prose dev set), 'builtin_answers' (the "
                    "same, each RULER-style prompt followed by its gold answer) or a HF datasets name.")
flags.DEFINE_string("dataset_config", None, "HF dataset config (e.g. 'answerable' for bdsaglam/musique).")
flags.DEFINE_string("dataset_split", "validation", "HF dataset split.")
flags.DEFINE_integer("calib_num_prompts", 64, "Development prompts.", lower_bound=1)
flags.DEFINE_integer("calib_min_tokens", 2048, "Shortest prompt (model tokens).")
flags.DEFINE_integer("calib_max_tokens", 4096, "Longest prompt (model tokens).")
flags.DEFINE_integer("calib_k", 64, "Statistics budget: k - tile_size selected keys + the diagonal tile (official: 64).")
flags.DEFINE_integer("tile_size", 32, "Query tile (tokens) pooled per index set.", lower_bound=1)
flags.DEFINE_enum("calib_reduce", "min", ["min", "mean", "tail"],
                  "Reduction over query tiles within a prompt (tail: the mean over its last 4 tiles, as a decode step).")
for _old, _new in (("num_prompts", "calib_num_prompts"), ("min_tokens", "calib_min_tokens"),
                   ("max_tokens", "calib_max_tokens"), ("k", "calib_k"), ("reduce", "calib_reduce")):
    cli.deprecated_alias(_old, _new)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Model dtype (scores are always fp32).")
flags.DEFINE_string("output_dir", "", "Where to write the artifact and plots ('' = the --anchors=auto cache).")
flags.DEFINE_integer("seed", 0, "Development-set seed.")
flags.DEFINE_integer("bucket", 512, "Prompts are padded to a multiple of this (one compile per padded length).")
flags.DEFINE_integer("block_tiles", 0, "Query tiles per softmax block (0 = a quarter of the prompt: 4 blocks).")
flags.DEFINE_boolean("stability", True, "Also select anchors on two disjoint halves of the prompts and compare.")
flags.DEFINE_boolean("plots", True, "Write the S heatmap and w bar chart.")
flags.DEFINE_string("xla_cache_dir", "", "Persistent XLA compilation cache ('' = off): reruns skip the compiles.")
FLAGS = flags.FLAGS


@flags.multi_flags_validator(["bucket", "tile_size"], message="--tile_size must divide --bucket")
def _check_bucket(values):
    from kascade_jax.calibration.runner import check_bucket  # noqa: PLC0415

    try:
        check_bucket(values["bucket"], values["tile_size"])
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


def _budgets(num_layers):
    return [m for m in range(3, 9) if m <= num_layers]


def main(argv):
    del argv
    from pathlib import Path

    import numpy as np

    from kascade_jax.calibration.artifact import CalibrationArtifact
    from kascade_jax.calibration.resolve import artifact_path, calibration_key
    from kascade_jax.calibration.devset import load_devset
    from kascade_jax.calibration.runner import calibrate
    from models import load_model

    if FLAGS.xla_cache_dir:
        import jax

        jax.config.update("jax_compilation_cache_dir", str(Path(FLAGS.xla_cache_dir).expanduser()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    key = calibration_key(FLAGS.model, dataset=FLAGS.dataset, num_prompts=FLAGS.calib_num_prompts, k=FLAGS.calib_k,
                          tile_size=FLAGS.tile_size, reduce=FLAGS.calib_reduce, min_tokens=FLAGS.calib_min_tokens,
                          max_tokens=FLAGS.calib_max_tokens, seed=FLAGS.seed, dtype=FLAGS.dtype,
                          dataset_config=FLAGS.dataset_config, dataset_split=FLAGS.dataset_split,
                          block_tiles=FLAGS.block_tiles or None)  # checked (k > tile_size, ...) before the load
    t0 = time.perf_counter()
    model, tokenizer = load_model(FLAGS.model, FLAGS.dtype)
    t_load = time.perf_counter() - t0
    prompts = load_devset(FLAGS.dataset, tokenizer, FLAGS.calib_num_prompts, min_tokens=FLAGS.calib_min_tokens,
                          max_tokens=FLAGS.calib_max_tokens, seed=FLAGS.seed, dataset_config=FLAGS.dataset_config,
                          dataset_split=FLAGS.dataset_split)
    t_data = time.perf_counter() - t0 - t_load
    meta = dict(seed=FLAGS.seed, min_tokens=FLAGS.calib_min_tokens, max_tokens=FLAGS.calib_max_tokens, dtype=FLAGS.dtype,
                dataset_config=FLAGS.dataset_config, dataset_split=FLAGS.dataset_split,
                kinds=sorted({p.kind for p in prompts}))
    art, stats = calibrate(model, prompts, model_name=FLAGS.model, dataset=FLAGS.dataset, k=FLAGS.calib_k,
                           tile_size=FLAGS.tile_size, reduce=FLAGS.calib_reduce, bucket=FLAGS.bucket, meta=meta,
                           block_tiles=FLAGS.block_tiles or None, key=key,
                           return_stats=True)
    path = art.save(artifact_path(key, FLAGS.output_dir or None))
    print(f"model {FLAGS.model}: {art.num_layers} layers, {art.kv_heads} kv_heads; {len(prompts)} prompts of "
          f"{stats.lengths.min()}-{stats.lengths.max()} tokens (mean {stats.lengths.mean():.0f}); k={FLAGS.calib_k}, "
          f"tile_size={FLAGS.tile_size}, reduce={FLAGS.calib_reduce}")
    print(f"time: load {t_load:.1f}s, dev set {t_data:.1f}s, forwards {stats.seconds:.1f}s "
          f"(compiled lengths {list(stats.compile_buckets)}; their first prompts, compile included, took "
          f"{stats.first_seconds:.1f}s; the other {len(prompts) - len(stats.compile_buckets)} prompts "
          f"{stats.seconds - stats.first_seconds:.1f}s), total {time.perf_counter() - t0:.1f}s "
          f"[{art.meta['backend']}]")
    print("w:", np.array2string(art.w, precision=3, max_line_width=140))
    for m in _budgets(art.num_layers):
        print(f"M={m}: anchors {list(art.anchors[m])}  score {art.scores[m]:.4f}")
    summary = dict(artifact=str(path), seconds=round(stats.seconds, 2),
                   anchors={m: list(art.anchors[m]) for m in _budgets(art.num_layers)})
    if FLAGS.stability and len(prompts) >= 4:
        half = len(prompts) // 2
        halves = []
        for sel in (np.arange(half), np.arange(half, 2 * half)):
            sim, w = stats.mean(sel)
            halves.append(CalibrationArtifact.from_statistics(sim, w, model_name=FLAGS.model, dataset=FLAGS.dataset,
                                                              num_prompts=half, k=FLAGS.calib_k, tile_size=FLAGS.tile_size,
                                                              reduce=FLAGS.calib_reduce))
        print(f"stability: two disjoint halves of {half} prompts")
        same = 0
        for m in _budgets(art.num_layers):
            a, b = set(halves[0].anchors[m]), set(halves[1].anchors[m])
            same += a == b
            # the other half's set, scored on this half's S: how much objective is lost by the disagreement
            loss = halves[0].scores[m] - _objective(halves[0].S, halves[1].anchors[m])
            print(f"  M={m}: {sorted(a)} vs {sorted(b)}  jaccard {len(a & b) / len(a | b):.2f}  "
                  f"objective loss {loss:.4f} ({100 * loss / halves[0].scores[m]:.2f}%)")
        print(f"  identical sets for {same}/{len(_budgets(art.num_layers))} budgets")
        summary["stability"] = {m: [list(h.anchors[m]) for h in halves] for m in _budgets(art.num_layers)}
    if FLAGS.plots:
        from kascade_jax.calibration.plots import save_plots

        for p in save_plots(art, path.with_suffix("")):
            print("plot:", p)
    print("artifact:", path)
    print(json.dumps(summary))


def _objective(S, anchors):
    from kascade_jax.calibration.dp import objective

    return objective(S, anchors)


if __name__ == "__main__":
    cli.run(main)
