"""`python -m experiments.accuracy`: the accuracy report and the dev-split recipe choice from `experiments.eval` runs.

  --mode=choose  --inputs=runs/dev_*  --model=qwen2.5-coder-0.5b --context=16384 --num_layers=24 --out=recipe.json
      picks the default recipe among the candidate recipes (kascade_jax.recipes.CANDIDATES, run as
      `--recipe=candidate:NAME`) from their DEV-split results only: the fastest (estimated weighted attention
      speed) within --within_dense points of dense, and writes the recipe file (`{"default": ..., "measured": ...}`)
      with the calibration dtype of the model's shipped recipe;
      --also_for=MODEL:LAYERS,... writes the same fields for other models (marked as chosen on this model).
  --mode=report  --inputs=runs/*  --out_dir=runs/accuracy
      writes summary.json (one row per cell and task, `ruler_avg` = the 13-task mean; paired bootstrap intervals of
      the difference to dense on the same prompts), summary.md and score-vs-context plots.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from pathlib import Path

from absl import app, flags

from experiments import cli

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "report", ["report", "choose", "compare"], "what to do (compare: the paired difference "
                  "of two cells, --a minus --b, per split and pooled)")
flags.DEFINE_string("a", "", "--mode=compare: a cell, STRATEGY[:RECIPE][@ANCHORS] (e.g. kascade:dps_rr4, dense)")
flags.DEFINE_string("b", "dense", "--mode=compare: the cell it is compared with")
flags.DEFINE_list("splits", ["test"], "--mode=compare: splits to compare on (e.g. dev,dev-seed1: each, then pooled)")
flags.DEFINE_list("inputs", [], "experiments.eval output folders (globs allowed)")
flags.DEFINE_string("model", "", "--mode=choose: the model whose dev results decide")
flags.DEFINE_integer("context", 16384, "--mode=choose: the context length whose dev results decide")
flags.DEFINE_list("also_contexts", [], "--mode=choose with --within_dense>=0: other dev lengths (e.g. 8192) where "
                  "a candidate must also be within --within_dense of dense to qualify")
flags.DEFINE_list("dev_splits", ["dev"], "--mode=choose: the dev draws whose prompts decide, pooled (e.g. "
                  "dev,dev-seed1,dev-seed2: eval --seed=1 and 2 runs; only cells run on every draw compete)")
flags.DEFINE_integer("num_layers", 0, "--mode=choose: the model's layer count (for the speed model)")
flags.DEFINE_float("max_slowdown", 0.15, "--mode=choose with --within_dense<0: allowed loss of weighted attention "
                   "speed vs the paper recipe (issue 17's rule)")
flags.DEFINE_float("within_dense", 1.0, "--mode=choose: the fastest candidate at most this many points below dense on "
                   "dev wins (issue 21's rule; none: the smallest worst-length loss among those faster than dense); "
                   "< 0: issue 17's rule (best dev score within --max_slowdown)")
flags.DEFINE_float("speed_tie", 0.03, "--mode=choose with --within_dense>=0: qualifying candidates whose estimated "
                   "cost is within this fraction of the cheapest count as equally fast, and the best dev score among "
                   "them wins (two benchmark runs of the same kernels differ by up to ~3.5%: session 15's pool run)")
flags.DEFINE_list("also_for", [], "--mode=choose: MODEL:LAYERS entries that get the same recipe fields")
flags.DEFINE_string("out", "", "--mode=choose: recipe file to write (an existing one needs --overwrite, e.g. to "
                    "replace a shipped kascade_jax/data/recipes/<model>.json)")
flags.DEFINE_string("frontier", "", "--mode=choose: also plot the accuracy-speed frontier of every candidate "
                    "(dev score vs estimated weighted attention speedup) to this PNG")
flags.DEFINE_string("bench_decode", "", "--mode=choose: experiments.bench decode json at the model's shape "
                    "(results/accuracy/bench_shapes.sh), or several joined by '+' (plain layers from the first, "
                    "the levers' rows from all): its per-layer ratios replace the 8B-shape constants")
flags.DEFINE_string("bench_prefill", "", "--mode=choose: the matching experiments.bench prefill json")
flags.DEFINE_integer("bench_batch", 32, "--mode=choose: the decode batch of --bench_decode to use")
flags.DEFINE_list("speed_bench", [], "--mode=report: MODEL:DECODE_JSON:PREFILL_JSON entries (experiments.bench at "
                  "that model's shape): each cell of MODEL at a benchmarked length gets its measured weighted "
                  "decode / prefill attention speedup over cuDNN (summary.json's decode_speedup / prefill_speedup, "
                  "the headline's speed column); DECODE_JSON may join several files with '+' (e.g. the rerank's and "
                  "the pools' runs)")
flags.DEFINE_string("out_dir", "runs/accuracy", "--mode=report: where summary.json / summary.md / plots go (a folder "
                    "that holds a summary needs --overwrite)")


cli.number_list("also_contexts", "int", "8192 (dev context lengths)")


def _dirs(patterns):
    from kascade_jax.eval import report  # noqa: PLC0415

    if not patterns:
        raise app.UsageError("--inputs: give the experiments.eval output folders to report on (globs allowed), e.g. "
                             "--inputs='runs/*'")
    out = []
    for p in patterns:
        out += sorted(glob.glob(os.path.expanduser(p))) or [p]
    out = [d for d in out if report.examples_path(d) and (Path(d) / "results.json").is_file()]
    if not out:
        raise app.UsageError(f"no experiments.eval output folders (examples.jsonl or .gz + results.json) in {patterns}")
    return out


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def main(argv):
    del argv
    from kascade_jax.eval import accuracy  # noqa: PLC0415
    from kascade_jax.recipes import CANDIDATES  # noqa: PLC0415
    from kascade_jax.tasks import ruler  # noqa: PLC0415

    if FLAGS.mode == "choose":
        if not (FLAGS.model and FLAGS.num_layers and FLAGS.out):
            raise app.UsageError("--mode=choose needs --model, --num_layers and --out")
        cli.check_output([FLAGS.out] + [p for p in [FLAGS.frontier] if p] + [
            str(Path(FLAGS.out).with_name(f"{e.rsplit(':', 1)[0]}.json")) for e in FLAGS.also_for], "--out")
    else:
        cli.check_output([Path(FLAGS.out_dir) / "summary.json", Path(FLAGS.out_dir) / "summary.md"], "--out_dir")
    bench = {}
    for entry in FLAGS.speed_bench:
        parts = entry.split(":")
        if len(parts) != 3 or not all(parts):
            raise app.UsageError(f"--speed_bench entries are MODEL:DECODE_JSON:PREFILL_JSON, got {entry!r}")
        for p in (*parts[1].split("+"), parts[2]):
            if not Path(p).is_file():
                raise app.UsageError(f"--speed_bench {entry!r}: {p} is not a file")
        bench[parts[0]] = (parts[1], parts[2])
    if FLAGS.mode == "compare" and not (FLAGS.a and FLAGS.model):
        raise app.UsageError("--mode=compare needs --a (and --b, default dense) and --model")
    examples = accuracy.load_examples(_dirs(FLAGS.inputs))
    if FLAGS.mode == "compare":
        for r in accuracy.compare(examples, FLAGS.a, FLAGS.b, model=FLAGS.model, context=FLAGS.context,
                                  splits=FLAGS.splits, ruler_tasks=list(ruler.TASKS)):
            print(f"{r['a']} - {r['b']} on {r['split']} ({r['n']} paired prompts): {r['diff']:+.1f} "
                  f"[{r['ci_low']:+.1f}, {r['ci_high']:+.1f}]")
        return
    if FLAGS.mode == "choose" and len(FLAGS.dev_splits) > 1:
        if FLAGS.dev_splits[0] != "dev" or not all(re.fullmatch(r"dev-seed\d+", s) for s in FLAGS.dev_splits[1:]):
            raise app.UsageError(f"--dev_splits are dev and its other draws dev-seed<N>, got {FLAGS.dev_splits}")
        examples, dropped = accuracy.pool_draws(examples, FLAGS.dev_splits, into="dev")
        print(f"dev pooled over {','.join(FLAGS.dev_splits)}; cells not run on every draw left out: {len(dropped)}")
    rows = accuracy.summarize(examples, ruler_tasks=list(ruler.TASKS))
    if not rows:
        raise ValueError(f"--inputs hold no real-RULER results ({len(examples)} example records; this report needs "
                         "experiments.eval runs with --tasks=ruler): nothing to summarise")
    if FLAGS.mode == "choose":
        from kascade_jax.recipes import load_recipe  # noqa: PLC0415

        candidates = dict(CANDIDATES)
        shipped = load_recipe(FLAGS.model, "default")
        cells = {r["config"] for r in rows if r["model"] == FLAGS.model and r["context"] == FLAGS.context
                 and r["split"] == "dev" and r["recipe"] == "default" and r["task"] == "ruler_avg"}
        if cells and all(shipped.describe() in c for c in cells):  # a dev cell of today's shipped default
            candidates["default"] = {k: v for k, v in dataclasses.asdict(shipped).items()
                                     if k not in ("name", "note", "calib_dtype") and v is not None}
        elif cells:
            print(f"the dev 'default' cells ran another recipe than today's shipped default "
                  f"({shipped.describe()}): left out of the choice")
        ratios = None
        if bool(FLAGS.bench_decode) != bool(FLAGS.bench_prefill):
            raise app.UsageError("--bench_decode and --bench_prefill go together")
        if FLAGS.bench_decode:
            ratios = accuracy.bench_ratios(FLAGS.bench_decode, FLAGS.bench_prefill, context=FLAGS.context,
                                           decode_batch=FLAGS.bench_batch)
        doc = accuracy.choose_recipe(rows, candidates, ratios=ratios, model=FLAGS.model, context=FLAGS.context,
                                     num_layers=FLAGS.num_layers, max_slowdown=FLAGS.max_slowdown,
                                     speed_tie=FLAGS.speed_tie, also_contexts=[int(c) for c in FLAGS.also_contexts],
                                     within_dense=FLAGS.within_dense if FLAGS.within_dense >= 0 else None)
        if len(FLAGS.dev_splits) > 1:
            doc["dev_splits"] = list(FLAGS.dev_splits)
            doc["default"]["note"] += f"; dev pooled over {len(FLAGS.dev_splits)} draws ({','.join(FLAGS.dev_splits)})"
        if shipped.calib_dtype and not doc["default"].get("calib_dtype"):  # candidates calibrate in the shipped dtype
            doc["default"]["calib_dtype"] = shipped.calib_dtype
        out = Path(FLAGS.out).expanduser()
        _write_json(out, doc)
        print(json.dumps({k: doc[k] for k in ("chosen_from", "default")}, indent=1))
        if FLAGS.frontier:
            print("frontier plot:", accuracy.plot_frontier(doc, FLAGS.frontier))
        miss = (f"more than {FLAGS.within_dense:g} below dense" if FLAGS.within_dense >= 0 else
                f"over {FLAGS.max_slowdown:.0%} slower than paper")
        if FLAGS.also_contexts and FLAGS.within_dense >= 0:
            miss += f" (at {FLAGS.context} or at {','.join(FLAGS.also_contexts)}, or not run there)"
        for r in doc["measured"]:
            also = "".join(f" at {c}: {'not run' if d is None else f'{d:+.2f}'}"
                           for c, d in r.get("also_dev_diff_vs_dense", {}).items())
            print(f"  {r['recipe']:<14} dev {r['dev_score']:5.1f} [{r['dev_ci'][0]:.1f}, {r['dev_ci'][1]:.1f}] "
                  f"vs dense {r['dev_diff_vs_dense']}{also}  decode {r['decode_speedup']:.2f}x prefill "
                  f"{r['prefill_speedup']:.2f}x {'ok' if r['qualifies'] else miss}")
        for entry in FLAGS.also_for:
            name, layers = entry.rsplit(":", 1)
            other = dict(doc, model=name)
            other["default"] = dict(doc["default"], note=doc["default"]["note"] + f" (chosen on {FLAGS.model}'s dev "
                                    f"split and applied unchanged to {name}, {layers} layers)")
            _write_json(out.with_name(f"{name}.json"), other)
        return
    out_dir = Path(FLAGS.out_dir)
    if bench:
        rows = accuracy.add_speed(rows, bench)
    _write_json(out_dir / "summary.json", rows)
    from kascade_jax.recipes import chosen_from, load_recipe  # noqa: PLC0415

    models = sorted({r["model"] for r in rows})
    defaults = {m: load_recipe(m, "default").describe() for m in models}
    chosen = {m: chosen_from(m) for m in models}
    head = accuracy.headline_rows(rows, defaults, chosen=chosen)
    text = ["# Accuracy summary (generated by experiments.accuracy)", ""]
    if head:
        text += ["## Headline: test split, RULER 13-task average (paired differences to dense)", "",
                 accuracy.headline_markdown(head), "",
                 "The default is today's shipped recipe per model (`kascade_jax/data/recipes/`); speedups are the "
                 "weighted attention speedups over cuDNN of its layer mix from the measured per-layer kernels at the "
                 "model's shape (decode at batch 32), where `--speed_bench` gave them. The baselines are accuracy "
                 "simulations without kernels.", ""]
    into, pooled = accuracy.pooled_headline(examples, defaults, ruler_tasks=list(ruler.TASKS), chosen=chosen,
                                            bench=bench)
    if pooled:
        text += [f"## Headline over every test draw ({into}; cells run on each draw, pooled, paired within each "
                 "draw)", "", accuracy.headline_markdown(pooled), ""]
    text += ["## RULER 13-task average", "", accuracy.markdown_table(rows), ""]
    tmp = out_dir / "summary.md.tmp"
    tmp.write_text("\n".join(text))
    os.replace(tmp, out_dir / "summary.md")
    print("\n".join(text))
    plots = accuracy.plot_summary(rows, out_dir)
    print(f"wrote {out_dir / 'summary.json'} ({len(rows)} rows), summary.md and {len(plots)} plots")


if __name__ == "__main__":
    cli.run(main)
