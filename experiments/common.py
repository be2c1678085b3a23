"""Flags shared by the entry points (a flag has the name of the config field it sets) and strategy building.

The recipe and calibration flags (--anchors, --recipe, --num_anchors, --calib_*, the levers) live in
`experiments.recipe_flags`, shared with `experiments.eval`.
"""

from __future__ import annotations

import sys

from absl import flags

from experiments import recipe_flags
from kascade_jax.registry import BUDGETED_BASELINES, KASCADE_FAMILY

MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model: alias (smollm2-135m), HF safetensors dir, .gguf file or hub id.")
DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Model and KV-cache dtype.")
ANCHORS = recipe_flags.ANCHORS
HEAD_MAP = flags.DEFINE_string("head_map", "auto", "Kascade head map: identity, auto (calibrated) or a path to a .json/.npy file.")
TOPK_FRAC = flags.DEFINE_float("topk_frac", 0.10, "Top-k budget as a fraction of the context (k = max(topk_frac*L, min_k)).")
MIN_K = flags.DEFINE_integer("min_k", 128, "Minimum Top-k budget.", lower_bound=1)
TILE_SIZE = flags.DEFINE_integer("tile_size", 32, "Query tile (tokens) pooled for prefill selection.")
ROLLING = flags.DEFINE_boolean("rolling_prefill", True, "Per-tile rolling prefill budgets.")
CHUNK = flags.DEFINE_integer("chunk_size", None, "Prefill chunk (multiple of 64); default: whole prompt on GPU, 1024 on CPU.")


@flags.validator("topk_frac")
def _check_topk_frac(value):
    """At flag parsing, before any model loads: the rule of KascadeConfig and the budgeted baselines (nan, inf,
    values outside (0, 1] and finer than 1e-4 are rejected)."""
    from kernels_pallas.reference import frac_numerator

    try:
        frac_numerator(value)
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


@flags.multi_flags_validator(["tile_size", "anchors", "head_map"],
                             message="--tile_size must divide the calibration bucket")
def _check_tile_size(values):
    """With --anchors/--head_map=auto, a --tile_size the calibration cannot pad to is refused at flag parsing,
    before the model loads (kascade_jax.calibration.runner.check_bucket)."""
    if "auto" in (values["anchors"], values["head_map"]) and values["tile_size"] is not None:
        from kascade_jax.calibration.runner import BUCKET, check_bucket

        try:
            check_bucket(BUCKET, values["tile_size"])
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
    return True


def recipe():
    """The --recipe for --model, with the explicitly given recipe flags applied on top."""
    return recipe_flags.resolve_recipe(MODEL.value)


def check_strategy_flags(name: str) -> None:
    """What build_strategy will need that does not need the model (the strategy name, the --recipe and its file),
    checked before the model loads."""
    from kascade_jax.registry import STRATEGY_NAMES

    if name not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {list(STRATEGY_NAMES)}")
    if name in KASCADE_FAMILY:
        recipe()


def build_strategy(name: str, model, tokenizer, *, topk_frac: float | None = None):
    """The strategy `name` for this model from the shared flags. Only the Kascade family resolves anchors (and so
    may load or run a calibration); on a GPU it runs the Pallas kernels, elsewhere the pure-JAX references."""
    import jax

    from kascade_jax.registry import make_strategy

    cfg = model.config
    frac = TOPK_FRAC.value if topk_frac is None else topk_frac
    if name in KASCADE_FAMILY:
        r = recipe()
        recipe_flags.notify_untuned(r)
        anchors, head_map = resolve_anchors_and_head_map(model, tokenizer, r)
        levers = r.levers()
        if TILE_SIZE.present or "tile_size" not in levers:  # an explicit --tile_size wins over the recipe's
            levers["tile_size"] = TILE_SIZE.value
        if r.decode_rerank_worst:
            levers["decode_rerank_layers"] = rerank_layers(model, tokenizer, r, anchors, head_map)
        return make_strategy(name, cfg.num_layers, cfg.kv_heads, anchors=anchors, head_map=head_map, topk_frac=frac,
                             min_k=MIN_K.value, rolling_prefill=ROLLING.value,
                             kernels="pallas" if jax.default_backend() == "gpu" else "reference", **levers)
    if name in BUDGETED_BASELINES:
        return make_strategy(name, cfg.num_layers, cfg.kv_heads, topk_frac=frac, min_k=MIN_K.value)
    return make_strategy(name, cfg.num_layers, cfg.kv_heads)


def resolve_anchors_and_head_map(model, tokenizer, r=None):
    """(anchors or None, head map rows or None) from --anchors / --head_map under the recipe (the recipe's pinned
    anchors for 'auto' when it has them): `calibration.resolve.resolve_recipe_flags`, as experiments.eval runs."""
    from kascade_jax.calibration.resolve import resolve_recipe_flags

    cfg = model.config
    r = recipe() if r is None else r
    anchors, head_map, _ = resolve_recipe_flags(MODEL.value, r, ANCHORS.value, HEAD_MAP.value,
                                                num_layers=cfg.num_layers, kv_heads=cfg.kv_heads, dtype=DTYPE.value,
                                                tile_size=TILE_SIZE.value, recalibrate=recipe_flags.RECALIBRATE.value,
                                                model=model, tokenizer=tokenizer)
    return anchors, head_map


def rerank_layers(model, tokenizer, r, anchors, head_map) -> tuple[int, ...]:
    """The recipe's `decode_rerank_worst` reuse layers least similar to their anchor, from its calibration."""
    from kascade_jax.calibration.resolve import rerank_layers as resolve_rerank_layers

    cfg = model.config
    return resolve_rerank_layers(MODEL.value, r, anchors, head_map, num_layers=cfg.num_layers,
                                 kv_heads=cfg.kv_heads, tile_size=TILE_SIZE.value, model=model, tokenizer=tokenizer,
                                 **recipe_flags.calibration_kwargs(r, DTYPE.value))


def describe_strategy(strategy) -> str:
    """One short block: the strategy, its kernels, and the anchors and head map it runs with."""
    cfg = getattr(strategy, "config", None)
    kernels = getattr(strategy, "kernels", None)
    lines = [f"strategy: {strategy.name}, kernels: " + (f"{kernels} (kascade_jax kernels)" if kernels else
                                                        "jnp attention (XLA)")]
    if cfg is not None and hasattr(cfg, "anchors"):
        src = "auto (calibrated)" if ANCHORS.value == "auto" else ANCHORS.value or "registry default"
        lines.append(f"anchors ({src}): {list(cfg.anchors)}; recipe: {recipe().describe()}")
        hm = cfg.head_map
        if hm is None:
            lines.append(f"head_map ({HEAD_MAP.value}): identity")
        else:
            rows = " ".join(f"L{l}:{list(row)}" for l, row in enumerate(hm) if list(row) != list(range(len(row))))
            lines.append(f"head_map ({HEAD_MAP.value}; rows not listed are the identity): {rows or 'identity'}")
        if getattr(cfg, "decode_rerank", 1) > 1:
            rr = cfg.decode_rerank_layers
            which = "every reuse layer" if rr is None else f"layers {list(rr)}"
            lines.append(f"decode rerank: {cfg.decode_rerank} x the budget as candidates, in {which}")
        if getattr(cfg, "decode_dense_layers", None):
            lines.append(f"decode dense layers: {list(cfg.decode_dense_layers)}")
        extra = [f"{f}={getattr(cfg, f)}" for f in ("topk_frac", "min_k", "tile_size") if hasattr(cfg, f)]
        lines.append("budget: " + ", ".join(extra))
    return "\n".join(lines)


def print_strategy(strategy) -> None:
    print(describe_strategy(strategy), file=sys.stderr, flush=True)
