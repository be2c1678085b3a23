"""`--anchors=auto|0,2,8,...`, `--num_anchors`, `--head_map=identity|auto|<path>`: flag values -> anchors, head map.

`resolve_anchors` finds the artifact of (model, dataset, num_prompts, k, tile_size, reduce) in the cache
directory (`artifact.default_cache_dir()`, or `cache_dir`), or runs the calibration (dense forwards on the
development set) and saves it there, then returns the DP's anchor set for `num_anchors` with its head map.
`resolve_flags` is what `experiments/generate.py` and `experiments/eval.py` call with their raw flag values.

k defaults to the official 64, raised to 2 * tile_size when the tile is that large (k must exceed the tile:
k - tile_size keys are selected on top of the diagonal tile).

Deliberately not here: building a strategy or KascadeConfig (callers plug the returned values in).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kascade_jax.calibration.artifact import CalibrationArtifact, artifact_name, default_cache_dir
from kascade_jax.calibration.head_map import check_anchors, head_map_for, identity_head_map, load_head_map_file


def parse_anchors(value: str, num_layers: int):
    """'auto' -> 'auto'; '0,2,8,13,14' -> (0, 2, 8, 13, 14), validated against num_layers."""
    value = str(value).strip()
    if value == "auto":
        return "auto"
    try:
        anchors = tuple(int(p) for p in value.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--anchors must be 'auto' or comma-separated layer indices like 0,2,8, got {value!r}") from None
    return check_anchors(anchors, num_layers)


def _calib_k(k, tile_size):
    return k if k is not None else max(64, 2 * tile_size)


def artifact_path(model_name: str, *, dataset: str = "builtin", num_prompts: int = 64, k: int | None = None,
                  tile_size: int = 32, reduce: str = "min", cache_dir=None) -> Path:
    d = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return d / artifact_name(model_name, dataset, num_prompts, _calib_k(k, tile_size), tile_size, reduce)


# Calibrations shipped with the package (e.g. SmolLM2-135M on the built-in dev set, measured on an H200), searched
# after the user's cache so that `--anchors=auto` works offline and instantly for those models.
PACKAGED_DIR = Path(__file__).resolve().parents[1] / "data" / "calibration"


def _find_cached(path: Path, model_name, dataset, num_prompts, k, tile_size, reduce) -> Path | None:
    """The exact artifact, else the same calibration on more prompts (at least as good an estimate); the user's
    cache first, then the calibrations shipped in the package."""
    for folder in (path.parent, PACKAGED_DIR):
        if (folder / path.name).is_file():
            return folder / path.name
        best, best_n = None, num_prompts
        for cand in folder.glob("*.json") if folder.is_dir() else ():
            for n in re.findall(r"-(\d+)-k", cand.name):
                if int(n) > best_n and cand.name == artifact_name(model_name, dataset, int(n), k, tile_size, reduce):
                    best, best_n = cand, int(n)
        if best is not None:
            return best
    return None


def load_or_calibrate(model_name: str, *, dataset: str = "builtin", num_prompts: int = 64, k: int | None = None,
                      tile_size: int = 32, reduce: str = "min", min_tokens: int = 2048, max_tokens: int = 4096,
                      seed: int = 0, cache_dir=None, model=None, tokenizer=None, dtype: str = "float32",
                      recalibrate: bool = False, dataset_config: str | None = None,
                      dataset_split: str = "validation") -> CalibrationArtifact:
    """The cached artifact of this calibration, else run it (loading the model if not given) and cache it."""
    k = _calib_k(k, tile_size)
    path = artifact_path(model_name, dataset=dataset, num_prompts=num_prompts, k=k, tile_size=tile_size,
                         reduce=reduce, cache_dir=cache_dir)
    if not recalibrate:
        found = _find_cached(path, model_name, dataset, num_prompts, k, tile_size, reduce)
        if found is not None:
            return CalibrationArtifact.load(found)
    from kascade_jax.calibration.devset import load_devset
    from kascade_jax.calibration.runner import calibrate

    if model is None or tokenizer is None:
        from models import load_model

        model, tokenizer = load_model(model_name, dtype)
    prompts = load_devset(dataset, tokenizer, num_prompts, min_tokens=min_tokens, max_tokens=max_tokens, seed=seed,
                          dataset_config=dataset_config, dataset_split=dataset_split)
    art = calibrate(model, prompts, model_name=model_name, dataset=dataset, k=k, tile_size=tile_size, reduce=reduce,
                    meta=dict(seed=seed, min_tokens=min_tokens, max_tokens=max_tokens, dtype=dtype))
    art.save(path)
    return art


def resolve_anchors(name_or_model, config=None, num_anchors: int = 5, dataset: str = "builtin",
                    num_prompts: int = 64, *, num_layers: int | None = None, kv_heads: int | None = None,
                    model_name: str | None = None, importance: str = "paper", **calibration_kwargs):
    """(anchors, head_map [num_layers, kv_heads] int32) for `num_anchors` anchors of the matching calibration.

    config: anything with `tile_size` (and `num_layers`/`kv_heads`), e.g. a KascadeConfig, or None (tile 32).
    Also accepted: `resolve_anchors(model, tokenizer, model_name=..., ...)` (a loaded model, no reload).
    """
    if isinstance(name_or_model, str):
        model_name = name_or_model
    else:  # the (model, tokenizer) form
        calibration_kwargs.update(model=name_or_model, tokenizer=config)
        config = name_or_model.config
        model_name = model_name or getattr(config, "name", "")
        if not model_name:
            raise ValueError("resolve_anchors(model, tokenizer, ...) needs model_name=... to key the calibration cache")
    tile_size = int(getattr(config, "tile_size", calibration_kwargs.pop("tile_size", 32)))
    num_layers = getattr(config, "num_layers", num_layers)
    kv_heads = getattr(config, "kv_heads", kv_heads)
    art = load_or_calibrate(model_name, dataset=dataset, num_prompts=num_prompts, tile_size=tile_size,
                            **calibration_kwargs)
    if num_layers is not None or kv_heads is not None:
        art.check_model(art.num_layers if num_layers is None else num_layers,
                        art.kv_heads if kv_heads is None else kv_heads)
    anchors = art.anchors_for(num_anchors, importance)
    return anchors, art.head_map(anchors)


def resolve_head_map(value: str, anchors, num_layers: int, kv_heads: int, *, artifact=None, auto_map=None,
                     model_name: str | None = None, **calibration_kwargs) -> np.ndarray:
    """'identity' | 'auto' | a .npy/.json path -> [num_layers, kv_heads] int32.

    'auto' uses `auto_map` if given (the map `resolve_anchors` returned for these anchors), else derives the map
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


def resolve_flags(model_name: str, anchors: str, head_map: str, *, num_layers: int, kv_heads: int,
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
