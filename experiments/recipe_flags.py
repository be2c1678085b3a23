"""The Kascade recipe flags, one definition shared by every entry point that builds Kascade (generate, speed, eval).

A flag has the name of the recipe field it sets (`kascade_jax.recipes.Recipe`): `--num_anchors`, `--calib_k`,
`--calib_reduce`, `--calib_importance`, `--calib_num_prompts`, `--calib_max_tokens`, `--calib_dtype`, `--calib_dataset`,
`--sink_tokens`, `--recent_window`, `--dense_suffix`, `--local_window`, `--prefill_topk_frac`, `--decode_topk_frac`,
`--prefill_key_block`, `--prefill_dense_anchors`, `--decode_only`, `--decode_rerank`, `--decode_rerank_worst`,
`--decode_tail_stride`, `--decode_tail_cap`, `--pool`, `--decode_dense_layers`, `--decode_prefill_keys`; each defaults
to None, "the recipe's", and an explicitly given value wins over the `--recipe`. `--anchors` is defined here too, so
it parses and means the same everywhere (`kascade_jax.calibration.resolve.parse_anchors`). `--calib_prompts` is a
deprecated spelling of `--calib_num_prompts` (it warns; see `experiments.cli.deprecated_alias`).

Deliberately not here: the model flags (`experiments.common`), building strategies.
"""

from __future__ import annotations

import sys

from absl import flags

from experiments import cli
from kascade_jax.config import POOLS

ANCHORS_HELP = ("Kascade anchor layers: 'auto' = the DP's choice on the dev-set calibration (shipped for SmolLM2 "
                "and both Qwen models, else cached, else calibrated now), 'even' = --num_anchors evenly spaced "
                "layers, '' = the registry default (the paper's anchors scaled to depth), or a list like 0,2,8,13,14")
ANCHORS = flags.DEFINE_string("anchors", "auto", ANCHORS_HELP)
def _shipped_defaults() -> list[str]:
    from kascade_jax.recipes import shipped_defaults  # noqa: PLC0415

    return shipped_defaults()


RECIPE = flags.DEFINE_string("recipe", "default", "Kascade recipe (kascade_jax.recipes): 'default' (tuned on the "
                             "dev split for this model, shipped in kascade_jax/data/recipes; dps_all, with a printed "
                             "note, where none is shipped), 'paper' (the paper's method exactly), 'candidate:<name>' "
                             "or a .json path; experiments.eval takes a comma-separated list (one process, one "
                             "model load). The recipe flags below, given explicitly, override its fields. "
                             "Shipped defaults: "
                             + " | ".join(_shipped_defaults()))
NUM_ANCHORS = flags.DEFINE_integer("num_anchors", None, "anchor count M for --anchors=auto|even (recipe's; a "
                                   "recipe that pins its anchors, given another M, lets the DP pick M instead)")
SINK = flags.DEFINE_integer("sink_tokens", None, "recipe lever: first keys forced into every anchor selection")
RECENT = flags.DEFINE_integer("recent_window", None, "recipe lever: keys just before the query/tile forced into "
                              "every anchor selection")
SUFFIX = flags.DEFINE_integer("dense_suffix", None, "recipe lever: last prompt tokens that attend densely in prefill")
LOCAL = flags.DEFINE_integer("local_window", None, "recipe lever (prefill): keys before each query tile attended on "
                             "top of the Top-k budget")
PREFILL_FRAC = flags.DEFINE_float("prefill_topk_frac", None, "recipe lever: prefill budget fraction (default: "
                                  "--topk_frac; decode keeps --topk_frac)")
KEY_BLOCK = flags.DEFINE_integer("prefill_key_block", None, "recipe lever (prefill): anchors select aligned blocks "
                                  "of this many keys (1, 8, 16, 32 or 64, dividing the tile) instead of single keys")
DECODE_FRAC = flags.DEFINE_float("decode_topk_frac", None, "recipe lever: decode budget fraction (default: "
                                 "--topk_frac; prefill keeps --topk_frac)")
RERANK = flags.DEFINE_integer("decode_rerank", None, "recipe lever (decode): anchors select C x the budget and each "
                              "reuse layer keeps its own Top-k of those (1: off)", lower_bound=1)
RERANK_WORST = flags.DEFINE_integer("decode_rerank_worst", None, "recipe lever (decode, with --decode_rerank > 1): "
                                    "only the N reuse layers least similar to their anchor in the calibration rerank",
                                    lower_bound=1)
TAIL = flags.DEFINE_integer("decode_tail_stride", None, "recipe lever (decode): every sparse layer also attends the "
                            "unselected keys at multiples of S, each weighted by S (a sampled tail; 0: off)",
                            lower_bound=0)
TAIL_CAP = flags.DEFINE_boolean("decode_tail_cap", None, "recipe lever (with --decode_tail_stride): a sampled key as "
                                "heavy as the row's lightest selected key counts once, not S times")
DENSE_LAYERS = flags.DEFINE_string("decode_dense_layers", None, "recipe lever (decode): layers that output dense "
                                   "attention, comma-separated, negatives counted from the end (-3,-2,-1: the last "
                                   "three; '': none)")
PREFILL_KEYS = flags.DEFINE_float("decode_prefill_keys", None, "recipe lever (decode, with --decode_only): each "
                                  "reuse layer also attends its own Top-s fraction of the keys the prompt's last "
                                  "tile attends in the dense prefill (e.g. 0.05; 0: off)")
POOL = flags.DEFINE_enum("pool", None, list(POOLS), "recipe lever: the anchors' selection pool "
                         "(gqa: one Top-k per KV head, Kascade; all: one set pooled over every query head and shared, "
                         "no head map, as --strategies=all_heads_pooled)")
DENSE_ANCHORS = flags.DEFINE_boolean("prefill_dense_anchors", None, "recipe lever (prefill): anchor layers output "
                                     "dense attention (they still select the Top-k for the reuse layers)")
SCORE_FP8 = flags.DEFINE_boolean("prefill_score_fp8", None, "recipe lever (prefill): anchors after layer 0 score keys "
                                 "from fp8 copies of q and the mean-centred k (faster Mosaic GPU score passes)")
DECODE_FP8 = flags.DEFINE_boolean("decode_score_fp8", None, "recipe lever (decode): anchors with a sparse output "
                                  "score keys from an fp8 copy of K kept in the cache (half the anchor pass's bytes)")
DECODE_ONLY = flags.DEFINE_boolean("decode_only", None, "recipe lever: dense prefill, Kascade decode (as the "
                                   "decode_only strategy)")
CALIB_K = flags.DEFINE_integer("calib_k", None, "--anchors/--head_map=auto: similarity budget k of the calibration "
                               "(recipe: 64)")
CALIB_REDUCE = flags.DEFINE_enum("calib_reduce", None, ["min", "mean", "tail"], "--anchors/--head_map=auto: "
                                 "reduction over query tiles (recipe: min; tail: the last 4 tiles, as a decode step)")
CALIB_IMPORTANCE = flags.DEFINE_enum("calib_importance", None, ["paper", "sqrt", "none"], "--anchors=auto: DP "
                                     "layer weighting (paper: the measured importance w; sqrt(w); none)")
CALIB_NUM_PROMPTS = flags.DEFINE_integer("calib_num_prompts", None, "--anchors/--head_map=auto: development-set "
                                         "prompts of the calibration (recipe: 64)", lower_bound=1)
CALIB_MAX_TOKENS = flags.DEFINE_integer("calib_max_tokens", None, "--anchors/--head_map=auto: longest dev prompt "
                                        "(shortest: half; recipe: 4096)")
CALIB_DTYPE = flags.DEFINE_enum("calib_dtype", None, ["float32", "bfloat16", "float16"], "--anchors/--head_map=auto: "
                                "dtype of the calibration forwards (recipe; else the model's --dtype)")
CALIB_DATASET = flags.DEFINE_string("calib_dataset", None, "--anchors/--head_map=auto: development set of the "
                                    "calibration: builtin, builtin_answers (each RULER-style prompt followed by its "
                                    "gold answer) or a HF datasets name (recipe: builtin)")
RECALIBRATE = flags.DEFINE_boolean("recalibrate", False, "--anchors/--head_map=auto: calibrate anew even when a "
                                   "cached calibration matches")
cli.deprecated_alias("calib_prompts", "calib_num_prompts")


def _recipe_names() -> list[str]:
    names = [n.strip() for n in RECIPE.value.split(",")]
    if not all(names):
        raise ValueError(f"--recipe: empty recipe name in {RECIPE.value!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"--recipe names a recipe twice: {RECIPE.value!r}")
    return names


def _given(holder):
    """The flag's value if it was given (on the command line or set), else None. Not `holder.value`: the benchmarks'
    --num_anchors (default 5, experiments.timing) is the same flag, and in a process that imports both (a test
    session) its default would silently override every recipe's anchor count."""
    return None if flags.FLAGS[holder.name].using_default_value else holder.value


def _int_list(holder) -> tuple[int, ...] | None:
    """A comma-separated list-of-ints flag as a tuple (None: not given; '': the empty tuple)."""
    if holder.value is None:
        return None
    try:
        return tuple(int(x) for x in holder.value.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{holder.name} takes comma-separated ints such as -3,-2,-1, got {holder.value!r}") from None


def _apply_flags(recipe):
    return recipe.replace(  # another --num_anchors than a pinned set's size drops the pins (Recipe.replace)
        num_anchors=_given(NUM_ANCHORS), sink_tokens=SINK.value, recent_window=RECENT.value, dense_suffix=SUFFIX.value,
        local_window=LOCAL.value, prefill_topk_frac=PREFILL_FRAC.value, decode_topk_frac=DECODE_FRAC.value,
        prefill_key_block=KEY_BLOCK.value,
        prefill_dense_anchors=DENSE_ANCHORS.value, prefill_score_fp8=SCORE_FP8.value,
        decode_score_fp8=DECODE_FP8.value, decode_only=DECODE_ONLY.value, decode_rerank=RERANK.value,
        decode_rerank_worst=RERANK_WORST.value, decode_tail_stride=TAIL.value,
        decode_tail_cap=TAIL_CAP.value, pool=POOL.value, decode_dense_layers=_int_list(DENSE_LAYERS),
        decode_prefill_keys=PREFILL_KEYS.value,
        calib_k=CALIB_K.value, calib_reduce=CALIB_REDUCE.value,
        calib_importance=CALIB_IMPORTANCE.value,
        calib_num_prompts=CALIB_NUM_PROMPTS.value, calib_max_tokens=CALIB_MAX_TOKENS.value,
        calib_dtype=CALIB_DTYPE.value, calib_dataset=CALIB_DATASET.value)


def _fit_mesh(recipe):
    """A --mesh carries no cache state yet (models.attention.check_no_cache_state), so the fp8 K copy of
    decode_score_fp8 cannot run there: from a recipe (the 1.5B's default) it is dropped with a note, so that the
    default runs on every mesh; asked for explicitly (--decode_score_fp8) it is refused before the model loads."""
    if not recipe.decode_score_fp8 or "mesh" not in flags.FLAGS or not flags.FLAGS.mesh:
        return recipe
    if not flags.FLAGS["decode_score_fp8"].using_default_value:
        raise ValueError("--decode_score_fp8 is not implemented with --mesh yet (its fp8 K copy is a cache state, "
                         "which a mesh does not carry); drop one of the two")
    _note(f"{recipe.name}: decode_score_fp8 (the decode anchors' fp8 K copy) is not implemented on a mesh yet: "
          "running without it (the bf16 selection it approximates)")
    return recipe.replace(decode_score_fp8=False)


def resolve_recipe(model_name: str):
    """The --recipe for `model_name`, with every explicitly given recipe flag applied on top."""
    from kascade_jax.recipes import load_recipe  # noqa: PLC0415

    names = _recipe_names()
    if len(names) > 1:
        raise ValueError(f"--recipe: this command runs one recipe, got {len(names)} ({RECIPE.value!r}); "
                         "experiments.eval evaluates several in one process")
    return _fit_mesh(_apply_flags(load_recipe(model_name, names[0])))


def resolve_recipes(model_name: str) -> list:
    """Every recipe of a comma-separated --recipe (experiments.eval), each with the explicit recipe flags on top."""
    from kascade_jax.recipes import load_recipe  # noqa: PLC0415

    return [_fit_mesh(_apply_flags(load_recipe(model_name, n))) for n in _recipe_names()]


def check_levers_fit(recipes, prompt_tokens: int, where: str) -> None:
    """A dense suffix or local window that covers the whole prompt (`prompt_tokens`, described by `where`) leaves
    nothing of the prefill sparse: refused by name when the lever is an explicit flag, a warning when it comes from
    the recipe. Run before the model's work (calibration, a dense pass) starts."""
    for r in recipes:
        for holder in (SUFFIX, LOCAL):
            n = getattr(r, holder.name)
            if not n or n < prompt_tokens:
                continue
            what = f"{r.name}: {holder.name}={n} covers the whole prompt {where}"
            if flags.FLAGS[holder.name].present:
                raise ValueError(f"--{holder.name}: {what}: Kascade's prefill would be dense; use a smaller value")
            print(f"warning: {what} (from the recipe): Kascade's prefill is dense on these prompts", file=sys.stderr,
                  flush=True)


_NOTIFIED: set[str] = set()


def _note(text: str) -> None:
    """Print `note: text` once per process (stderr)."""
    if text not in _NOTIFIED:
        _NOTIFIED.add(text)
        print(f"note: {text}", file=sys.stderr, flush=True)


def notify_untuned(recipe) -> None:
    """Print, once per process, that `recipe` is the fallback of a model without a tuned recipe (and what to do)."""
    from kascade_jax.recipes import untuned_notice  # noqa: PLC0415

    text = untuned_notice(recipe)
    if text:
        _note(text)


def calibration_kwargs(recipe, dtype: str) -> dict:
    """`load_or_calibrate` keywords of `recipe` (its calibration fields; the run's dtype unless it names one)."""
    return dict(recipe.calibration_kwargs(dtype), recalibrate=RECALIBRATE.value)
