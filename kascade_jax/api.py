"""The public way in: a model's Kascade exactly as the command lines build it.

    import kascade_jax
    model, tok, kascade = kascade_jax.load("qwen2.5-coder-1.5b", dtype="bfloat16")    # recipe="default"
    paper = kascade_jax.strategy_for(model, recipe="paper")                            # an already-loaded model

Both apply the recipe (`kascade_jax.recipes`: its levers, anchor count and calibration fields), the DP anchors and
head map of its calibration (shipped, else cached, else calibrated now with a printed notice), the budget
(`topk_frac`, `min_k`) and the kernels (Pallas on a GPU, the pure-JAX references elsewhere), through the same
`calibration.resolve` and `registry.make_strategy` that `experiments.common.build_strategy` uses.
"""

from __future__ import annotations

import sys
from typing import Any


def strategy_for(model, name: str = "kascade", *, recipe: Any = "default", model_name: str | None = None,
                 tokenizer=None, topk_frac: float = 0.1, min_k: int = 128, kernels: str | None = None,
                 calibrate: bool = True, verbose: bool = True):
    """The strategy `name` (a `kascade_jax.registry` name) for a loaded model.

    recipe: 'default' (the model's shipped choice), 'paper', 'candidate:<name>', a .json path or a `Recipe`.
    model_name: the alias that keys the calibration (default: the name the model was loaded under).
    calibrate=False: never runs a calibration (a missing one raises, naming the key).
    """
    import jax  # noqa: PLC0415

    from kascade_jax.registry import BUDGETED_BASELINES, KASCADE_FAMILY, STRATEGY_NAMES, make_strategy  # noqa: PLC0415

    cfg = model.config
    if name not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {list(STRATEGY_NAMES)}")
    if name not in KASCADE_FAMILY:
        budget = dict(topk_frac=topk_frac, min_k=min_k) if name in BUDGETED_BASELINES else {}
        return make_strategy(name, cfg.num_layers, cfg.kv_heads, **budget)
    from kascade_jax.calibration.resolve import recipe_kascade  # noqa: PLC0415
    from kascade_jax.recipes import Recipe, load_recipe, untuned_notice  # noqa: PLC0415

    model_name = model_name or getattr(cfg, "name", "")
    if not model_name:
        raise ValueError("strategy_for: the model has no name (config.name); pass model_name=... (the alias that "
                         "keys its calibration)")
    r = recipe if isinstance(recipe, Recipe) else load_recipe(model_name, recipe)
    notice = untuned_notice(r)
    if verbose and notice:
        print(f"note: {notice}", file=sys.stderr, flush=True)
    dtype = getattr(getattr(model, "dtype", None), "name", None) or str(getattr(model, "dtype", "float32"))
    kw, desc = recipe_kascade(model_name, cfg.num_layers, cfg.kv_heads, recipe=r, dtype=dtype, model=model,
                              tokenizer=tokenizer, calibrate=calibrate)
    kw.setdefault("tile_size", 32)
    if kernels is None:
        kernels = "pallas" if jax.default_backend() == "gpu" else "reference"
    if verbose:
        print(f"kascade_jax: {name} for {model_name}: {desc}")
    return make_strategy(name, cfg.num_layers, cfg.kv_heads, topk_frac=topk_frac, min_k=min_k, kernels=kernels, **kw)


def load(model: str, name: str = "kascade", *, recipe: Any = "default", dtype: str = "bfloat16", **kwargs):
    """(model, tokenizer, strategy): `models.load_model(model, dtype)` and `strategy_for` on it (kwargs go there)."""
    from models import load_model  # noqa: PLC0415

    m, tok = load_model(model, dtype)
    return m, tok, strategy_for(m, name, recipe=recipe, tokenizer=tok, **kwargs)
