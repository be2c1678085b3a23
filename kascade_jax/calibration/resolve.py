"""`--anchors=auto|0,2,8,...`, `--num_anchors`, `--head_map=identity|auto|<path>`: flag values -> anchors, head map.

`load_or_calibrate` finds the artifact whose recorded `CalibrationKey` (model file identity, dataset and its config,
prompt count, min/max tokens, seed, k, tile_size, reduce, block_tiles, dtype) equals the one asked for, in the cache
directory (`artifact.default_cache_dir()`, or `cache_dir`) and then among the calibrations shipped in the package;
else it runs the calibration (dense forwards on the development set; announced on stderr with its prompt count, an
estimated time and the cached near misses it did not use, with their differing fields; a tqdm bar) and saves it
under `<stem>-<digest of the key>.json`, so calibrations that differ in any key field never share a file.
Two ways in, one per kind of caller:
- `resolve_recipe_flags`: the command lines (`experiments.common.build_strategy`, `experiments.eval`): `--anchors`
  / `--head_map` under a recipe, the one place a recipe's pinned anchors replace the DP's;
- `recipe_kascade` (internal: users call `kascade_jax.strategy_for`, which uses it, as does bench e2e): a
  recipe (default: the model's shipped one) -> the make_strategy keywords (anchors, head map, levers), its
  calibration keyed by the recipe's `calib_dtype` whatever the run's dtype; calibrate=False never starts one.
A test keeps the two equal for every shipped model and recipe (tests/kascade_jax/test_api.py).

k defaults to the official 64, raised to 2 * tile_size when the tile is that large (k must exceed the tile:
k - tile_size keys are selected on top of the diagonal tile).

Deliberately not here: building a strategy or KascadeConfig (callers plug the returned values in).
"""

from __future__ import annotations

import glob
import re
import sys
from pathlib import Path

import numpy as np

from kascade_jax.calibration.artifact import (CalibrationArtifact, CalibrationKey, artifact_name, default_cache_dir,
                                              read_key)
from kascade_jax.calibration.head_map import (check_anchors, head_map_for, identity_head_map, least_similar_layers,
                                              load_head_map_file)


def even_anchors(num_layers: int, m: int) -> tuple[int, ...]:
    """`m` evenly spaced layers, layer 0 first."""
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= num_layers:
        raise ValueError(f"num_anchors must lie in [1, {num_layers}], got {m!r}")
    return tuple(sorted({round(i * num_layers / m) for i in range(m)}))


def parse_anchors(value: str, num_layers: int, num_anchors: int | None = None):
    """The one meaning of `--anchors=` in every entry point: 'auto' -> 'auto' (the calibrated DP choice);
    'even' -> `num_anchors` evenly spaced layers; '' -> the registry default (the paper's anchors scaled to depth);
    '0,2,8,13,14' -> (0, 2, 8, 13, 14). Validated against num_layers."""
    value = str(value).strip()
    if value == "auto":
        return "auto"
    if value == "even":
        return even_anchors(num_layers, 5 if num_anchors is None else num_anchors)
    if value == "":
        from kascade_jax.registry import default_anchors  # noqa: PLC0415

        return default_anchors(num_layers)
    try:
        anchors = tuple(int(p) for p in value.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--anchors must be 'auto', 'even', '' or comma-separated layer indices like 0,2,8, "
                         f"got {value!r}") from None
    return check_anchors(anchors, num_layers)


def _calib_k(k, tile_size):
    return k if k is not None else max(64, 2 * tile_size)


# Calibrations shipped with the package (e.g. SmolLM2-135M on the built-in dev set, measured on an H200), searched
# after the user's cache so that `--anchors=auto` works offline and instantly for those models. Their JSON records
# their key like any other artifact; they keep their short (pre-key) file names.
PACKAGED_DIR = Path(__file__).resolve().parents[1] / "data" / "calibration"

# Rough throughput for the time estimate an on-the-spot calibration prints (FLOP/s of the forwards; a compile per
# padded length). Measured orders of magnitude, not promises: 2-core CPU, one H100/H200.
_RATE = {"cpu": (2e10, 20.0), "gpu": (1e14, 15.0)}


def calibration_key(model_name: str, *, dataset: str = "builtin", num_prompts: int = 64, k: int | None = None,
                    tile_size: int = 32, reduce: str = "min", min_tokens: int = 2048, max_tokens: int = 4096,
                    seed: int = 0, dtype: str = "float32", dataset_config: str | None = None,
                    dataset_split: str | None = "validation", block_tiles: int | None = None,
                    model_file: str | None = ...) -> CalibrationKey:  # ...: computed
    """The CalibrationKey of these parameters (k defaults to max(64, 2 * tile_size); model_file defaults to
    `artifact.model_fingerprint(model_name)`)."""
    fields = {} if model_file is ... else dict(model_file=model_file)
    return CalibrationKey.make(model_name, dataset=dataset, dataset_config=dataset_config,
                               dataset_split=dataset_split, num_prompts=int(num_prompts), min_tokens=int(min_tokens),
                               max_tokens=int(max_tokens), seed=int(seed), k=int(_calib_k(k, tile_size)),
                               tile_size=int(tile_size), reduce=reduce, block_tiles=block_tiles, dtype=dtype,
                               **fields)


def artifact_path(key: CalibrationKey, cache_dir=None) -> Path:
    """Where the calibration of `key` is saved in the cache (`<stem>-<digest of the key>.json`)."""
    d = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return d / key.name()


def find_cached(key: CalibrationKey, cache_dir=None) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """(the artifact whose recorded key equals `key`, or None; the near misses: artifacts of the same model,
    dataset, prompt count, k, tile size and reduce that differ elsewhere, with the differing fields). The user's
    cache first, then the calibrations shipped in the package."""
    stem = artifact_name(key.model_name, key.dataset, key.num_prompts, key.k, key.tile_size, key.reduce)[:-5]
    near = []
    folder0 = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    for folder in (folder0, PACKAGED_DIR):
        exact = folder / key.name()
        cands = [exact] if exact.is_file() else []
        cands += sorted(p for p in folder.glob(f"{glob.escape(stem)}*.json") if p != exact) if folder.is_dir() else []
        for cand in cands:
            if cand.name != f"{stem}.json" and not re.fullmatch(re.escape(stem) + r"-[0-9a-f]{10}\.json", cand.name):
                continue  # another reduce (`-mean`) or another stem that merely starts the same
            diff = key.diff(read_key(cand))
            if not diff:
                return cand, near
            near.append((cand, diff))
    return None, near


def estimate_seconds(model, key: CalibrationKey) -> float:
    """A rough wall time for calibrating `model` on `key`'s prompts (see _RATE): forwards plus one compile per
    512-token padded length."""
    import jax  # noqa: PLC0415

    cfg = model.config
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(_state(model)))
    n = (key.min_tokens + key.max_tokens) / 2
    flops = key.num_prompts * (2 * params * n + 2 * cfg.num_layers * cfg.q_heads * cfg.head_dim * n * n)
    rate, compile_s = _RATE.get(jax.default_backend(), _RATE["cpu"])
    lengths = len(range(-(-key.min_tokens // 512), -(-key.max_tokens // 512) + 1))
    return flops / rate + lengths * compile_s


def _dtype_name(model) -> str | None:
    dt = getattr(model, "dtype", None)
    return None if dt is None else np.dtype(dt).name


def _state(model):
    from flax import nnx  # noqa: PLC0415

    return nnx.state(model, nnx.Param)


def _announce(key: CalibrationKey, path: Path, near, model) -> None:
    try:
        eta = f"about {max(1, round(estimate_seconds(model, key) / 60))} min (a rough estimate)"
    except Exception:  # noqa: BLE001  (a model without the usual config: no estimate, the calibration still runs)
        eta = "time unknown"
    lines = [f"calibrating {key.model_name} now (no cached calibration matches): {key.num_prompts} {key.dataset} "
             f"dev prompts of {key.min_tokens}-{key.max_tokens} tokens, k={key.k}, tile_size={key.tile_size}, "
             f"reduce={key.reduce}, dtype={key.dtype}, seed={key.seed}; {eta}; saved to {path}"]
    for cand, diff in near[:3]:
        lines.append(f"  not using {cand.name}: " + "; ".join(diff))
    print("\n".join(lines), file=sys.stderr, flush=True)


def load_or_calibrate(model_name: str, *, dataset: str = "builtin", num_prompts: int = 64, k: int | None = None,
                      tile_size: int = 32, reduce: str = "min", min_tokens: int = 2048, max_tokens: int = 4096,
                      seed: int = 0, cache_dir=None, model=None, tokenizer=None, dtype: str = "float32",
                      recalibrate: bool = False, dataset_config: str | None = None,
                      dataset_split: str = "validation", block_tiles: int | None = None,
                      progress: bool = True) -> CalibrationArtifact:
    """The cached artifact whose key equals this calibration's, else run it (loading the model if not given, or
    if it is not in `dtype`), announce it with an estimated time, and cache it under its key."""
    key = calibration_key(model_name, dataset=dataset, num_prompts=num_prompts, k=k, tile_size=tile_size,
                          reduce=reduce, min_tokens=min_tokens, max_tokens=max_tokens, seed=seed, dtype=dtype,
                          dataset_config=dataset_config, dataset_split=dataset_split, block_tiles=block_tiles)
    found, near = find_cached(key, cache_dir)
    if found is not None and not recalibrate:
        return CalibrationArtifact.load(found, key=key)
    from kascade_jax.calibration.devset import load_devset
    from kascade_jax.calibration.runner import BUCKET, calibrate, check_bucket

    check_bucket(BUCKET, tile_size)  # before the model loads or any prompt is made

    if model is None or tokenizer is None or _dtype_name(model) not in (None, dtype):
        from models import load_model

        model, tokenizer = load_model(model_name, dtype)
    path = artifact_path(key, cache_dir)
    _announce(key, path, near, model)
    prompts = load_devset(dataset, tokenizer, num_prompts, min_tokens=min_tokens, max_tokens=max_tokens, seed=seed,
                          dataset_config=dataset_config, dataset_split=dataset_split)
    art = calibrate(model, prompts, model_name=model_name, dataset=dataset, k=key.k, tile_size=tile_size,
                    reduce=reduce, block_tiles=block_tiles, progress=progress, key=key,
                    meta=dict(seed=seed, min_tokens=min_tokens, max_tokens=max_tokens, dtype=dtype))
    art.save(path)
    return art


def resolve_head_map(value: str, anchors, num_layers: int, kv_heads: int, *, artifact=None, auto_map=None,
                     model_name: str | None = None, **calibration_kwargs) -> np.ndarray:
    """'identity' | 'auto' | a .npy/.json path -> [num_layers, kv_heads] int32.

    'auto' uses `auto_map` if given (the map `recipe_kascade` returned for these anchors), else derives the map
    for `anchors` from `artifact`'s head similarity, else loads/runs the calibration of `model_name`.
    """
    anchors = check_anchors(anchors, num_layers)
    if value == "identity":
        return identity_head_map(num_layers, kv_heads)
    if value == "auto":
        if auto_map is not None:
            from kascade_jax.calibration.head_map import check_head_map

            return check_head_map(auto_map, num_layers, kv_heads, anchors)
        if artifact is None and model_name:
            artifact = load_or_calibrate(model_name, **calibration_kwargs)
        if artifact is None:
            raise ValueError("--head_map=auto needs a calibration artifact (run experiments.calibrate, or use "
                             "--anchors=auto), or pass --head_map=identity or a .npy path")
        artifact.check_model(num_layers, kv_heads)
        return head_map_for(artifact.sim, anchors)
    return load_head_map_file(value, num_layers, kv_heads, anchors)


def _resolve_flags(model_name: str, anchors: str, head_map: str, *, num_layers: int, kv_heads: int,
                   num_anchors: int = 5, tile_size: int = 32, importance: str = "paper", **calibration_kwargs):
    """Raw flag values -> (anchors tuple, head_map as a tuple of rows, or None for identity): KascadeConfig-ready.

    The calibration runs (or loads from the cache) only when `anchors == 'auto'` or `head_map == 'auto'`.
    `importance`: the DP's layer weighting (`stats.importance_weights`), applied to the stored statistics.
    """
    parsed = parse_anchors(anchors, num_layers)
    art = None
    if parsed == "auto" or head_map == "auto":
        art = load_or_calibrate(model_name, tile_size=tile_size, **calibration_kwargs)
        art.check_model(num_layers, kv_heads)
    if parsed == "auto":
        parsed = art.anchors_for(num_anchors, importance)
    hm = resolve_head_map(head_map, parsed, num_layers, kv_heads, artifact=art)
    if head_map == "identity":
        return parsed, None
    return parsed, tuple(tuple(int(h) for h in row) for row in hm)


def resolve_recipe_flags(model_name: str, recipe, anchors: str, head_map: str, *, num_layers: int, kv_heads: int,
                         dtype: str = "float32", tile_size: int | None = None, recalibrate: bool = False, model=None,
                         tokenizer=None, cache_dir=None) -> tuple[tuple[int, ...] | None, tuple | None, str]:
    """`--anchors` / `--head_map` under a recipe -> (anchors or None, head map rows or None, a note): what every
    command line runs. 'auto' takes the recipe's pinned anchors when it has them, else the DP's for its anchor count,
    with the head map of the recipe's calibration (`head_map` '' means 'auto' there, 'identity' for explicit
    anchors); '' (the registry default) or 'even' with an identity map need no calibration."""
    value, hm = str(anchors).strip(), str(head_map).strip()
    pinned = value == "auto" and bool(recipe.anchors)
    if pinned:  # the recipe pins its anchors: those instead of the DP's, same head map
        value, hm = ",".join(map(str, recipe.anchors)), hm or "auto"
    parsed = parse_anchors(value, num_layers, recipe.num_anchors)
    if value in ("", "even") and hm in ("", "identity"):
        got = parsed if value == "even" else None
        return got, None, "anchors: " + ("evenly spaced" if got else "registry default")
    hm = hm or ("auto" if value == "auto" else "identity")
    kw = dict(recipe.calibration_kwargs(dtype), recalibrate=recalibrate)
    if tile_size:
        kw["tile_size"] = tile_size
    got, rows = _resolve_flags(model_name, value if parsed == "auto" else ",".join(map(str, parsed)), hm,
                               num_layers=num_layers, kv_heads=kv_heads, num_anchors=recipe.num_anchors,
                               importance=recipe.calib_importance, model=model, tokenizer=tokenizer,
                               cache_dir=cache_dir, **kw)
    how = " (pinned by the recipe)" if pinned else ""
    return tuple(got), rows, f"anchors: {str(anchors).strip()} -> {list(got)}{how}, head_map: {hm}"


def rerank_layers(model_name: str, recipe, anchors, head_map, *, num_layers: int, kv_heads: int,
                  tile_size: int = 32, model=None, tokenizer=None, cache_dir=None, artifact=None,
                  **calib) -> tuple[int, ...] | None:
    """The `decode_rerank_layers` of `recipe` with these anchors and head map: None unless it sets
    `decode_rerank_worst` N, else the N reuse layers least similar to their anchor in its calibration (`artifact`
    when the caller has it loaded, else `load_or_calibrate` with `calib`; the one the anchors came from, or for
    explicit anchors the recipe's all the same). Every entry point resolves the lever here: the eval once ran such a
    recipe as plain `decode_rerank`."""
    if not recipe.decode_rerank_worst:
        return None
    if anchors is None:
        raise ValueError(f"recipe {recipe.name!r}: decode_rerank_worst needs the anchors (--anchors=auto or a list), "
                         f"not the registry default")
    art = artifact
    if art is None:
        art = load_or_calibrate(model_name, tile_size=tile_size, cache_dir=cache_dir, model=model,
                                tokenizer=tokenizer, **{**calib, "recalibrate": False})
    art.check_model(num_layers, kv_heads)
    hm = identity_head_map(num_layers, kv_heads) if head_map is None else head_map
    return least_similar_layers(art.sim, anchors, hm, recipe.decode_rerank_worst)


def recipe_kascade(model_name: str, num_layers: int, kv_heads: int, *, recipe="default", dtype: str = "float32",
                   tile_size: int = 32, model=None, tokenizer=None, calibrate: bool = True, cache_dir=None,
                   recalibrate: bool = False) -> tuple[dict, str]:
    """(make_strategy keywords, description) of `recipe` for `model_name`: the levers (sink_tokens, recent_window,
    dense_suffix) and the anchors (its pinned `anchors`, else the DP's for `num_anchors` and `calib_importance`) and
    the head map of the recipe's calibration,
    keyed by the recipe's calibration fields and its `calib_dtype` (else `dtype`, the run's), the same path as
    `experiments.common.build_strategy` with `--anchors=auto --head_map=auto`.

    recipe: a `kascade_jax.recipes.Recipe` or a name for `load_recipe` ('default', 'paper', a .json path).
    calibrate=False: never runs a calibration; with no shipped or cached one it raises a ValueError naming the key
    and the near misses. model/tokenizer: a loaded model for an on-the-spot calibration (else it is loaded).
    """
    from kascade_jax.recipes import Recipe, load_recipe  # noqa: PLC0415

    r = recipe if isinstance(recipe, Recipe) else load_recipe(model_name, recipe)
    kw = r.calibration_kwargs(dtype)
    key = calibration_key(model_name, tile_size=tile_size, **kw)
    found, near = find_cached(key, cache_dir)
    if found is not None and not recalibrate:
        art, src = CalibrationArtifact.load(found, key=key), found.name
    elif not calibrate:
        miss = "; ".join(f"{p.name} differs in {', '.join(d)}" for p, d in near) or "none near"
        raise ValueError(f"{model_name}: no shipped or cached calibration for {key.name()} ({miss}); run "
                         f"experiments.calibrate first")
    else:
        art = load_or_calibrate(model_name, tile_size=tile_size, cache_dir=cache_dir, model=model,
                                tokenizer=tokenizer, recalibrate=recalibrate, **kw)
        src = f"{artifact_path(key, cache_dir).name} (calibrated now)"
    art.check_model(num_layers, kv_heads)
    anchors = r.anchors or tuple(int(a) for a in art.anchors_for(r.num_anchors, r.calib_importance))
    check_anchors(anchors, num_layers)
    head_map = tuple(tuple(int(h) for h in row) for row in art.head_map(anchors))
    kw = dict(anchors=anchors, head_map=head_map, **r.levers())
    layers = rerank_layers(model_name, r, anchors, head_map, num_layers=num_layers, kv_heads=kv_heads, artifact=art)
    if layers is not None:
        kw["decode_rerank_layers"] = layers
    how = f"pinned by the recipe, head map from {src}" if r.anchors else f"from {src}"
    return kw, f"recipe {r.describe()}, anchors {list(anchors)} {how}"
