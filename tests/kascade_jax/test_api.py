"""kascade_jax.load / strategy_for: the strategy a Python user gets equals the command line's, for every shipped
model and recipe (same recipe levers, DP anchors, head map, budget and kernels)."""

import json
import types

import jax.numpy as jnp
import pytest

import kascade_jax
from kascade_jax.recipes import RECIPE_DIR
from tests import cli_fork  # the CLI probe: forked from a server that has imported the libraries
from tests.kascade_jax.kj_helpers import shipped_model, strategy_record

SHIPPED = sorted(p.stem for p in RECIPE_DIR.glob("*.json"))
RECIPES = ["default", "paper", "candidate:dec20_ds512s", "candidate:dps_rr4w5", "candidate:smol_p5"]

# The command line's strategy (experiments.common.build_strategy after flag parsing), in a subprocess: the
# experiments' flag modules cannot share one process with the other entry points' tests.
CLI = """
import json, sys
from absl import flags
from experiments import cli, common
from tests.kascade_jax.kj_helpers import shipped_model, strategy_record
out = {}
for name in json.loads(sys.argv[1]):
    for recipe in json.loads(sys.argv[2]):
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", f"--model={name}", f"--recipe={recipe}"])
        s = common.build_strategy("kascade", shipped_model(name), None)
        out[name + "|" + recipe] = strategy_record(s)
print(json.dumps(out))
"""


def test_api_strategy_equals_the_cli_strategy():
    res = cli_fork.run(["-c", CLI, json.dumps(SHIPPED), json.dumps(RECIPES)], cli_fork.ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    from_cli = json.loads(res.stdout.splitlines()[-1])
    for m in SHIPPED:
        for recipe in RECIPES:
            s = kascade_jax.strategy_for(shipped_model(m), recipe=recipe, calibrate=False, verbose=False)
            assert strategy_record(s) == from_cli[m + "|" + recipe], (m, recipe)
            if recipe != "paper":  # the recipe's levers reach the strategy (the notebook used to lose them)
                assert s.config.sink_tokens == 4
            if recipe == "default" and m.startswith("qwen"):  # dps_all_dec*: dense prefill, one selection for all heads
                assert s.config.decode_only and s.config.pool == "all" and s.config.head_map is None
                assert s.config.decode_topk_frac == (0.3 if "1.5b" in m else 0.2)  # dps_all_dec30_fp8d / _dec20
                assert s.config.decode_score_fp8 == ("1.5b" in m)  # the 1.5B's anchors score on an fp8 K copy
            elif recipe == "candidate:dec20_ds512s":
                assert s.config.dense_suffix == 512
            if recipe == "candidate:smol_p5":  # pinned anchors instead of the DP's, the calibration's head map
                assert s.config.anchors == (0, 2, 8, 18, 21) and s.config.head_map is not None
            if recipe == "default" and m == "smollm2-135m":  # smol_p6_dec30: pinned six, dense prefill, 30% decode
                assert s.config.anchors == (0, 2, 8, 18, 21, 24) and s.config.decode_only and s.config.head_map
                assert s.config.decode_topk_frac == 0.3
            if recipe == "candidate:dps_rr4w5":  # the calibration's five least similar reuse layers, both ways
                assert s.config.decode_rerank == 4 and len(s.config.decode_rerank_layers) == 5
                assert not set(s.config.decode_rerank_layers) & set(s.config.anchors)
    assert len(from_cli) == len(SHIPPED) * len(RECIPES) >= 15


def test_api_announces_the_untuned_fallback(capsys):
    """A model without a shipped recipe gets dps_all and a printed note (before the calibration it needs)."""
    model = types.SimpleNamespace(config=types.SimpleNamespace(num_layers=4, kv_heads=1, name="my-own-model"),
                                  dtype=jnp.dtype("float32"))
    with pytest.raises(ValueError, match="no shipped or cached calibration"):
        kascade_jax.strategy_for(model, calibrate=False)
    assert "note: no tuned recipe shipped for 'my-own-model': dps_all" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no shipped or cached calibration"):
        kascade_jax.strategy_for(model, calibrate=False, verbose=False)
    assert capsys.readouterr().err == ""


def test_api_baselines_and_errors():
    model = shipped_model("qwen2.5-coder-0.5b")
    q = kascade_jax.strategy_for(model, "quest", topk_frac=0.2, min_k=64)
    assert q.budget_frac == 0.2 and q.min_budget == 64
    assert kascade_jax.strategy_for(model, "dense").name == "dense"
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        kascade_jax.strategy_for(model, "fast")
    nameless = types.SimpleNamespace(config=types.SimpleNamespace(num_layers=24, kv_heads=2, name=""))
    with pytest.raises(ValueError, match="pass model_name="):
        kascade_jax.strategy_for(nameless)
    with pytest.raises(ValueError, match="no shipped or cached calibration"):
        kascade_jax.strategy_for(types.SimpleNamespace(config=types.SimpleNamespace(
            num_layers=24, kv_heads=2, name="some-other-model")), calibrate=False)
