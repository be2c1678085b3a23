"""experiments.recipe_flags: the calibration keywords an entry point derives from --recipe and --dtype find every
shipped calibration (no on-the-spot calibration) at --dtype float32 and bfloat16."""

import pytest
from absl import flags
from absl.testing import flagsaver

from experiments import cli, recipe_flags
from kascade_jax import recipes
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


def test_calib_dataset_flag_reaches_the_calibration_key_and_the_config_string():
    from kascade_jax.eval import accuracy

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--recipe=candidate:dps_tail", "--calib_dataset=builtin_answers"])
        r = recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")
        kw = recipe_flags.calibration_kwargs(r, "bfloat16")
    assert r.name == "dps_tail*" and kw["dataset"] == "builtin_answers" and kw["reduce"] == "tail"
    key = resolve.calibration_key("qwen2.5-coder-0.5b", tile_size=32, **{k: v for k, v in kw.items()
                                                                        if k != "recalibrate"})
    assert "builtin_answers" in key.name()
    assert "calib=k64/tail/w=paper/d=builtin_answers " in r.describe() + " "
    assert accuracy.config_fields(r.describe())["calib_dataset"] == "builtin_answers"
    assert "calib_dataset" not in accuracy.config_fields(recipes.candidate("dps").describe())


def test_decode_rerank_worst_flag_reaches_the_recipe_and_the_config_string():
    from kascade_jax.eval import accuracy

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--recipe=candidate:dps_rr4", "--decode_rerank_worst=3"])
        r = recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")
    assert r.name == "dps_rr4*" and (r.decode_rerank, r.decode_rerank_worst) == (4, 3)
    fields = accuracy.config_fields(r.describe())
    assert (fields["decode_rerank"], fields["decode_rerank_worst"]) == (4, 3)
    assert accuracy.recipe_cost(fields, num_layers=24, context=16384) != accuracy.recipe_cost(
        dict(fields, decode_rerank_worst=None), num_layers=24, context=16384)
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--recipe=candidate:dps", "--decode_rerank_worst=3"])
        with pytest.raises(ValueError, match="decode_rerank_worst=3 needs decode_rerank > 1"):
            recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")


def test_pool_flag_reaches_the_recipe_and_is_refused_with_the_rerank():
    from kascade_jax.eval import accuracy

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--recipe=candidate:dps", "--pool=all"])
        r = recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")
    assert r.name == "dps*" and r.levers()["pool"] == "all"
    assert accuracy.config_fields(r.describe())["pool"] == "all"
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--recipe=candidate:dps_rr4", "--pool=all"])
        with pytest.raises(ValueError, match="pool 'all' shares one index set"):
            recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")


def test_prefill_key_block_flag_reaches_the_recipe_and_the_config_string():
    from kascade_jax.eval import accuracy

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--recipe=paper", "--prefill_key_block=16"])
        r = recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")
    assert r.name == "paper*" and r.levers()["prefill_key_block"] == 16
    assert accuracy.config_fields(r.describe())["prefill_key_block"] == 16
    assert recipes.candidate("kb16").levers()["prefill_key_block"] == 16
    assert "prefill_key_block" not in recipes.PAPER.levers()  # not named: KascadeConfig's 1
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--prefill_key_block=12"])
        with pytest.raises(ValueError, match="prefill_key_block must be null or one of"):
            recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")


def test_prefill_score_fp8_flag_reaches_the_recipe():
    from kascade_jax.eval import accuracy

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--recipe=paper", "--prefill_score_fp8"])
        r = recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")
    assert r.name == "paper*" and r.levers()["prefill_score_fp8"] is True
    assert accuracy.config_fields(r.describe())["prefill_score_fp8"] is True
    assert recipes.candidate("fp8s").levers()["prefill_score_fp8"] is True


# experiments.eval defines flags another entry point also defines: it runs in a subprocess of its own
EVAL_ANCHORS = """
from experiments import cli, eval as ev, recipe_flags
cli._parse_flags(["eval", "--model=smollm2-135m", "--recipe=candidate:smol_p5", "--dtype=bfloat16"])
r = recipe_flags.resolve_recipe("smollm2-135m")
anchors, head_map, note = ev.resolve_anchor_flags(None, None, 30, 3, r)
print(list(anchors), head_map is not None and len(head_map) == 30, note)
"""


def test_eval_runs_a_recipes_pinned_anchors_with_the_calibrated_head_map():
    from tests import cli_fork  # forked from a server that has imported the libraries

    res = cli_fork.run(["-c", EVAL_ANCHORS], cli_fork.ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines()[-1] == ("[0, 2, 8, 18, 21] True anchors: auto -> [0, 2, 8, 18, 21] (pinned by the "
                                           "recipe), head_map: auto")


def test_num_anchors_given_to_a_pinned_recipe_lets_the_dp_choose_that_many():
    """SmolLM2's shipped default pins six anchors; --num_anchors=5 asks for five: the pins go, the recipe is renamed,
    and --anchors=auto takes the calibration's five. The same count keeps the pins."""
    from kascade_jax.recipes import load_recipe

    shipped = load_recipe("smollm2-135m", "default")
    assert shipped.anchors == (0, 2, 8, 18, 21, 24)
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--num_anchors=5"])
        r = recipe_flags.resolve_recipe("smollm2-135m")
    assert (r.name, r.num_anchors, r.anchors) == ("default*", 5, None)
    assert r.levers() == shipped.levers()
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--num_anchors=6"])
        assert recipe_flags.resolve_recipe("smollm2-135m") == shipped
    import experiments.timing  # noqa: F401, PLC0415  (its --num_anchors, default 5, is the same flag)

    with flagsaver.flagsaver():  # not given: the recipe's count, whatever another module's same flag defaults to
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate"])
        assert recipe_flags.resolve_recipe("smollm2-135m") == shipped


def test_the_untuned_fallback_is_announced_once(capsys):
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate"])
        r = recipe_flags.resolve_recipe("my-own-model")
        shipped = recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")
    recipe_flags._NOTIFIED.discard(recipes.untuned_notice(r))
    for _ in range(2):
        recipe_flags.notify_untuned(r)
        recipe_flags.notify_untuned(shipped)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"note: {recipes.untuned_notice(r)}"] and "'my-own-model': dps_all" in err[0]


def test_a_mesh_drops_the_recipes_fp8_copy(capsys):
    """The 1.5B's default reads its decode anchors' scores from an fp8 K copy, a cache state that a --mesh does not
    carry: there the recipe runs without it (with a note); --decode_score_fp8 given explicitly is refused."""
    from experiments import devices  # noqa: F401  (defines --mesh)

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate"])
        assert recipe_flags.resolve_recipe("qwen2.5-coder-1.5b").decode_score_fp8
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--mesh=data:2"])
        r = recipe_flags.resolve_recipe("qwen2.5-coder-1.5b")
        assert not r.decode_score_fp8 and r.decode_topk_frac == 0.3 and r.decode_only
        assert "decode_score_fp8 (the decode anchors' fp8 K copy) is not implemented on a mesh yet" in \
            capsys.readouterr().err
        assert not recipe_flags.resolve_recipes("qwen2.5-coder-1.5b")[0].decode_score_fp8  # experiments.eval's path
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--mesh=data:2", "--decode_score_fp8"])
        with pytest.raises(ValueError, match="--decode_score_fp8 is not implemented with --mesh yet"):
            recipe_flags.resolve_recipe("qwen2.5-coder-0.5b")
