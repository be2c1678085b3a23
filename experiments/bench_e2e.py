"""End-to-end speed of Kascade inside the model: time to first token and decode ms/step, dense vs Kascade, with the
attention / rest split of every row. `python -m experiments.bench --phase=e2e [--e2e_* flags]`, on one GPU or on
`--mesh=data:D,model:M` (experiments/devices.py).

Two decisions a user sees: a rerun resumes (a (row, strategy) is measured again only when the file holds no run of
it with this run's settings: GPU, JAX, Kascade levers, steps, seed; `--noe2e_resume` re-measures the planned ones and
keeps every other row), and a mesh run writes e2e_mesh-data<D>-model<M>.* unless `--e2e_tag` is given, so one-GPU
numbers are never overwritten. The measurement is kascade_jax/bench/e2e.py (models: e2e_models.py, storage:
store.py); this parses the flags and refuses bad values before the devices are touched. Needs a GPU.
"""

from __future__ import annotations

import os

from absl import flags

from experiments import cli, devices

MODELS = flags.DEFINE_list("e2e_models", ["llama3.1-8b-random", "qwen3-8b-random", "qwen2.5-coder-1.5b"],
                           "Models: llama3.1-8b-random, qwen3-8b-random (real configs, random bf16 weights), "
                           "qwen2.5-coder-1.5b (the real model, if its alias resolves).")
METRICS = flags.DEFINE_list("e2e_metrics", ["ttft", "decode"], "Which rows: ttft, decode.")
CONTEXTS = flags.DEFINE_list("e2e_contexts", ["32768", "65536", "131072", "262144"], "TTFT prompt lengths (batch 1).")
DECODE = flags.DEFINE_list("e2e_decode", ["32768:1", "32768:8", "32768:32", "32768:max", "131072:1", "131072:max"],
                           "Decode rows as context:batch; batch 'max' = the largest batch that fits.")
STRATEGIES = flags.DEFINE_list("e2e_strategies", ["dense", "kascade"],
                               "dense (cuDNN), kascade (Pallas), dense_pallas (split-K Pallas dense decode; decode "
                               "rows only).")
STEPS = flags.DEFINE_list("e2e_steps", ["8", "40"], "Decode step counts N1,N2: per step = (t(N2) - t(N1)) / (N2 - N1).")
ITERS = flags.DEFINE_integer("e2e_iterations", 2, "CUPTI iterations per decode measurement (mean per kernel).")
WALL_REPS = flags.DEFINE_integer("e2e_wall_repeats", 2, "Blocked wall-clock calls per decode step count (min).")
TOPK_FRAC = flags.DEFINE_float("e2e_topk_frac", 0.1, "Kascade Top-k fraction.")
RECIPE = flags.DEFINE_string("e2e_recipe", "default", "Kascade recipe of the real models (default, paper, "
                             "candidate:<name> or a .json; kascade_jax.recipes); random-weight models keep the paper's "
                             "anchors and no levers. Give each recipe its own --e2e_tag.")
MIN_K = flags.DEFINE_integer("e2e_min_k", 128, "Kascade minimum Top-k budget.")
HEADROOM = flags.DEFINE_float("e2e_headroom_gb", 10.0, "Memory left free when choosing the largest batch (GB).")
HBM = flags.DEFINE_float("e2e_hbm_tbps", 4.3, "HBM bandwidth of the byte floor (TB/s).")
OUT = flags.DEFINE_string("e2e_out", "benchmarks", "Output folder for e2e[_<tag>].json/md/png.")
ANCHOR_BACKEND = flags.DEFINE_enum("e2e_anchor_backend", "auto", ["auto", "triton", "mgpu"], "Sparse prefill's "
                                   "anchor LSE and score passes (kernels_pallas.prefill.set_default_anchor_backend; "
                                   "auto: Mosaic GPU on Hopper); another value needs its own --e2e_tag.")
DECODE_FP8 = flags.DEFINE_boolean("e2e_decode_score_fp8", False, "Kascade's decode anchors score keys from an fp8 "
                                  "copy of K kept in the cache (the recipe lever decode_score_fp8, on top of "
                                  "--e2e_recipe); needs its own --e2e_tag.")
PREFILL_KB = flags.DEFINE_enum("e2e_prefill_key_block", "1", ["1", "8", "16", "32", "64"], "Kascade's prefill "
                               "anchors select aligned blocks of this many keys (the lever prefill_key_block, on top "
                               "of --e2e_recipe; random-weight models too); on Hopper the reuse then runs the Mosaic "
                               "GPU block reuse. Other than 1 needs its own --e2e_tag.")
TAG = flags.DEFINE_string("e2e_tag", "", "Output stem suffix: e2e_<tag>.* ('' = e2e.*).")
RESUME = flags.DEFINE_boolean("e2e_resume", True, "Skip (row, strategy) measurements already in the JSON with "
                              "the same settings; --noe2e_resume measures the planned ones again, keeping all other "
                              "rows of the file.")
DEADLINE = flags.DEFINE_float("e2e_deadline_s", 0.0, "Start no measurement predicted to end past this many seconds "
                              "after start (0 = no limit).")
PROFILE = flags.DEFINE_boolean("e2e_profile", False, "Print the top kernels of one decode step at "
                               "--e2e_profile_shape instead of the benchmark.")
PROFILE_SHAPE = flags.DEFINE_string("e2e_profile_shape", "llama3.1-8b-random:131072:1", "model:context:batch.")
SEED = flags.DEFINE_integer("e2e_seed", 0, "Seed of the random weights, prompts and caches.")
COMPILE_THREADS = flags.DEFINE_integer("e2e_compile_threads", 1, "Compile a model's pending programs on this many "
                                       "threads before measuring (saves wall time; XLA's GEMM autotuning then shares "
                                       "the GPU, so choices may differ slightly from a serial compile).")


def parse_decode_specs(items) -> list[tuple[int, int | str]]:
    """['32768:1', '131072:max'] -> [(32768, 1), (131072, 'max')]."""
    out = []
    for item in items:
        ctx, sep, b = str(item).strip().partition(":")
        try:
            ctx_i = int(ctx)
            b_v = "max" if b.strip() == "max" else int(b)
        except ValueError:
            raise ValueError(f"--e2e_decode entries are context:batch (batch an int or 'max'), got {item!r}") from None
        if not sep or ctx_i <= 0 or (b_v != "max" and b_v <= 0):
            raise ValueError(f"--e2e_decode entries are context:batch with positive values, got {item!r}")
        out.append((ctx_i, b_v))
    return out


def parse_contexts(items) -> list[int]:
    """['32768', '65536'] -> [32768, 65536]: positive integers, else a ValueError naming --e2e_contexts."""
    out = []
    for item in items:
        try:
            c = int(str(item).strip())
        except ValueError:
            raise ValueError(f"--e2e_contexts: prompt lengths are positive integers, got {item!r}") from None
        if c <= 0:
            raise ValueError(f"--e2e_contexts: prompt lengths are positive integers, got {item!r}")
        out.append(c)
    return out


def parse_steps(items) -> tuple[int, int]:
    items = list(items)
    if len(items) != 2:
        raise ValueError(f"--e2e_steps: must be two integers N1,N2, got {','.join(map(str, items))!r}")
    try:
        n1, n2 = (int(str(x).strip()) for x in items)
    except ValueError:
        bad = next(x for x in items if not str(x).strip().lstrip("-").isdigit())
        raise ValueError(f"--e2e_steps: must be two integers N1,N2, got {bad!r} in "
                         f"{','.join(map(str, items))!r}") from None
    if not 1 <= n1 < n2:
        raise ValueError(f"--e2e_steps: needs 1 <= N1 < N2, got {n1},{n2}")
    return n1, n2


def main(argv):
    del argv
    from kascade_jax.bench import e2e
    from kascade_jax.bench.e2e_models import model_spec

    # One process, one GPU: let JAX take most of the memory (the largest-batch rows need it), unless told otherwise.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    # every flag value is checked before the devices are touched
    steps = parse_steps(STEPS.value)
    e2e.check_strategies(STRATEGIES.value)
    from kascade_jax.recipes import load_recipe

    if not TAG.value and not PROFILE.value:  # a variant's rows would be measured over the default's in e2e.json
        for changed, flag, default in (
                (RECIPE.value != "default", f"--e2e_recipe={RECIPE.value}", "the default recipe's"),
                (ANCHOR_BACKEND.value != "auto", f"--e2e_anchor_backend={ANCHOR_BACKEND.value}",
                 "the default backend's"),
                (DECODE_FP8.value, "--e2e_decode_score_fp8", "the plain decode's"),
                (PREFILL_KB.value != "1", f"--e2e_prefill_key_block={PREFILL_KB.value}",
                 "the single-key selection's")):
            if changed:
                raise ValueError(f"{flag} needs its own --e2e_tag: the rows of e2e.json are {default}, and would be "
                                 "measured over")
    from kernels_pallas import prefill

    prefill.set_default_anchor_backend(ANCHOR_BACKEND.value)
    levers = {**(dict(decode_score_fp8=True) if DECODE_FP8.value else {}),
              **(dict(prefill_key_block=int(PREFILL_KB.value)) if PREFILL_KB.value != "1" else {})}
    if not PROFILE.value:
        specs = [model_spec(m) for m in MODELS.value]
        for spec in specs:
            if not spec.random:
                try:
                    load_recipe(spec.alias, RECIPE.value)
                except ValueError as e:
                    raise ValueError(f"--e2e_recipe={RECIPE.value}: {e}") from None
        contexts, decode_specs = parse_contexts(CONTEXTS.value), parse_decode_specs(DECODE.value)
        e2e.plan(METRICS.value, contexts, decode_specs)  # --e2e_metrics
    mesh = devices.setup()  # --mesh / --distributed (experiments/devices.py); None: one device
    kw = dict(steps=steps, iterations=ITERS.value, topk_frac=TOPK_FRAC.value, min_k=MIN_K.value,
              headroom_gb=HEADROOM.value, hbm_tbps=HBM.value, out_dir=OUT.value, seed=SEED.value, mesh=mesh,
              recipe=RECIPE.value, levers=levers)
    if PROFILE.value:
        parts = PROFILE_SHAPE.value.split(":")
        if len(parts) != 3:
            raise ValueError(f"--e2e_profile_shape must be model:context:batch, got {PROFILE_SHAPE.value!r}")
        (ctx, b), = parse_decode_specs([f"{parts[1]}:{parts[2]}"])
        e2e.profile(model_spec(parts[0]), ctx, b, STRATEGIES.value, **kw)
        return
    e2e.run(specs, metrics=METRICS.value, contexts=contexts, decode_specs=decode_specs, strategies=STRATEGIES.value,
            wall_repeats=WALL_REPS.value, tag=TAG.value, resume=RESUME.value, deadline_s=DEADLINE.value,
            compile_threads=COMPILE_THREADS.value, **kw)


if __name__ == "__main__":
    cli.run(main)
