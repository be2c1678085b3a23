"""experiments.recipe_flags: the calibration keywords an entry point derives from --recipe and --dtype find every
shipped calibration (no on-the-spot calibration) at --dtype float32 and bfloat16."""

import pytest
from absl import flags
from absl.testing import flagsaver

from experiments import cli, recipe_flags
from kascade_jax.calibration import resolve


@pytest.mark.parametrize("model_name", ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", ["default", "paper"])
def test_flag_path_finds_the_shipped_calibration(tmp_path, model_name, dtype, recipe):
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", f"--recipe={recipe}"])
        r = recipe_flags.resolve_recipe(model_name)
        kw = recipe_flags.calibration_kwargs(r, dtype)
    kw.pop("recalibrate")
    found, near = resolve.find_cached(resolve.calibration_key(model_name, tile_size=32, **kw), tmp_path)
    assert found is not None and found.parent == resolve.PACKAGED_DIR, near
