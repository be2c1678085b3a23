"""Kascade calibration: head-level cross-layer similarity, layer importance, DP anchor selection, head maps.

Pipeline: `devset` (prompts) -> `runner.collect_statistics` (dense forwards with `stats.CalibrationStrategy`)
-> `stats.layer_scores` (S) -> `dp.dp_all_budgets` (best anchors for every budget) -> `head_map.head_map_for`
-> `artifact.CalibrationArtifact` (JSON + npz). `resolve` turns a recipe and the `--anchors/--head_map` flag values
into anchors and head maps (`resolve_recipe_flags` for the command lines; `resolve.recipe_kascade`, internal, for
`kascade_jax.strategy_for`, the public way in), running or loading a calibration for `auto`.
"""

from kascade_jax.calibration.artifact import CalibrationArtifact, artifact_name, default_cache_dir
from kascade_jax.calibration.dp import dp_all_budgets, objective, select_anchors
from kascade_jax.calibration.head_map import head_map_for, identity_head_map
from kascade_jax.calibration.resolve import load_or_calibrate, parse_anchors, resolve_head_map, resolve_recipe_flags
from kascade_jax.calibration.stats import CalibrationStrategy, layer_scores

__all__ = [
    "CalibrationArtifact", "CalibrationStrategy", "artifact_name", "default_cache_dir", "dp_all_budgets", "head_map_for",
    "identity_head_map", "layer_scores", "load_or_calibrate", "objective", "parse_anchors",
    "resolve_head_map", "resolve_recipe_flags", "select_anchors",
]
