"""Flags shared by the entry points (a flag has the name of the config field it sets) and strategy building."""

from __future__ import annotations

from absl import flags

MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model: alias (smollm2-135m), HF safetensors dir, .gguf file or hub id.")
DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Model and KV-cache dtype.")
ANCHORS = flags.DEFINE_string("anchors", "auto", "Kascade anchor layers: 'auto' (calibrated) or a list like 0,2,8,13,14.")
NUM_ANCHORS = flags.DEFINE_integer("num_anchors", 5, "With --anchors=auto: how many anchors (M, layer 0 included).")
HEAD_MAP = flags.DEFINE_string("head_map", "auto", "Kascade head map: identity, auto (calibrated) or a path to a .json/.npy file.")
TOPK_FRAC = flags.DEFINE_float("topk_frac", 0.10, "Top-k budget as a fraction of the context (k = max(topk_frac*L, min_k)).")
MIN_K = flags.DEFINE_integer("min_k", 128, "Minimum Top-k budget.", lower_bound=1)
TILE_SIZE = flags.DEFINE_integer("tile_size", 32, "Query tile (tokens) pooled for prefill selection.")
ROLLING = flags.DEFINE_boolean("rolling_prefill", True, "Per-tile rolling prefill budgets.")
CHUNK = flags.DEFINE_integer("chunk_size", None, "Prefill chunk (multiple of 64); default: whole prompt on GPU, 1024 on CPU.")
CALIB_PROMPTS = flags.DEFINE_integer("calib_prompts", 64, "With --anchors=auto and no saved calibration: dev prompts to calibrate on.")
RECIPE = flags.DEFINE_string("recipe", "default", "Kascade recipe: 'default' (tuned for this model on the dev split, shipped in "
                             "kascade_jax/data/recipes; the paper recipe where none is shipped), 'paper', "
                             "'candidate:<name>' or a .json file. --num_anchors / --calib_prompts given explicitly win.")


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


def recipe():
    """The --recipe for --model, with an explicitly given --num_anchors / --calib_prompts applied on top."""
    from kascade_jax.recipes import load_recipe

    over = {}
    if flags.FLAGS["num_anchors"].present:
        over["num_anchors"] = NUM_ANCHORS.value
    if flags.FLAGS["calib_prompts"].present:
        over["calib_num_prompts"] = CALIB_PROMPTS.value
    return load_recipe(MODEL.value, RECIPE.value).replace(**over)


KASCADE_FAMILY = ("kascade", "no_remap", "all_heads_pooled", "pre_softmax_pooling", "oracle_topk", "decode_only")
BUDGETED_BASELINES = ("quest", "omnikv", "less_is_more")


def build_strategy(name: str, model, tokenizer, *, topk_frac: float | None = None):
    """The strategy `name` for this model from the shared flags. Only the Kascade family resolves anchors (and so
    may load or run a calibration); on a GPU it runs the Pallas kernels, elsewhere the pure-JAX references."""
    import jax

    from kascade_jax.registry import make_strategy

    cfg = model.config
    frac = TOPK_FRAC.value if topk_frac is None else topk_frac
    if name in KASCADE_FAMILY:
        r = recipe()
        anchors, head_map = resolve_anchors_and_head_map(model, tokenizer, r)
        return make_strategy(name, cfg.num_layers, cfg.kv_heads, anchors=anchors, head_map=head_map, topk_frac=frac,
                             min_k=MIN_K.value, tile_size=TILE_SIZE.value, rolling_prefill=ROLLING.value,
                             kernels="pallas" if jax.default_backend() == "gpu" else "reference", **r.levers())
    if name in BUDGETED_BASELINES:
        return make_strategy(name, cfg.num_layers, cfg.kv_heads, topk_frac=frac, min_k=MIN_K.value)
    return make_strategy(name, cfg.num_layers, cfg.kv_heads)


def resolve_anchors_and_head_map(model, tokenizer, r=None):
    from kascade_jax.calibration import resolve_anchors, resolve_head_map

    cfg = model.config
    r = recipe() if r is None else r
    calib = dict(k=r.calib_k, reduce=r.calib_reduce, max_tokens=r.calib_max_tokens,
                 min_tokens=max(64, r.calib_max_tokens // 2))
    if ANCHORS.value == "auto":
        anchors, auto_map = resolve_anchors(model, tokenizer, model_name=MODEL.value, num_anchors=r.num_anchors,
                                            tile_size=TILE_SIZE.value, num_prompts=r.calib_num_prompts,
                                            importance=r.calib_importance, **calib)
    else:
        try:
            anchors = tuple(int(a) for a in ANCHORS.value.split(",") if a.strip())
        except ValueError:
            raise ValueError(f"--anchors must be 'auto' or comma-separated layer indices, got {ANCHORS.value!r}") from None
        auto_map = None
    head_map = resolve_head_map(HEAD_MAP.value, anchors, cfg.num_layers, cfg.kv_heads, auto_map=auto_map,
                                model=model, tokenizer=tokenizer, model_name=MODEL.value, tile_size=TILE_SIZE.value,
                                num_prompts=r.calib_num_prompts, **calib)
    return anchors, head_map
