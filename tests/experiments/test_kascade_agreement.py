"""experiments/kascade_agreement.py: --anchors=auto (the default) is `kascade_jax.strategy_for`'s Kascade under the
--recipe and recipe flags, explicit anchors run without levers, and bad flags fail with one line before the model
loads. Subprocesses: the entry point's flags cannot share a process with the other entry points' (it defines --model,
as experiments.common does); the model is a stand-in with a shipped calibration, nothing loads."""

import json

import numpy as np

import kascade_jax
from kascade_jax.calibration.artifact import CalibrationArtifact
from kascade_jax.calibration.resolve import PACKAGED_DIR
from kascade_jax.recipes import load_recipe
from tests import cli_fork  # the probes: forked from a server that has imported the libraries
from tests.kascade_jax.kj_helpers import shipped_model, strategy_record

MODEL = "smollm2-135m"
SCRIPT = """
import json, sys
from absl import flags
from experiments import cli, kascade_agreement as ka
from tests.kascade_jax.kj_helpers import shipped_model, strategy_record
out = []
for argv in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    cli._parse_flags(["kascade_agreement", *argv])
    ka.check_kascade_flags()
    out.append(strategy_record(ka.kascade_strategy("kascade", shipped_model("smollm2-135m"), None, 0.2,
                                                   verbose=False)))
print(json.dumps(out))
"""

# (flags, the recipe strategy_for gets, its keywords); None: explicit anchors, checked below
CASES = [
    ([], "default", {}),
    (["--recipe=paper", "--kernels=pallas", "--min_k=64"], "paper", dict(kernels="pallas", min_k=64)),
    (["--recipe=candidate:smol_p5", "--sink_tokens=8", "--tile_size=16"],
     load_recipe(MODEL, "candidate:smol_p5").replace(sink_tokens=8, tile_size=16), {}),
    (["--anchors=0,4,12,20"], None, None),
    (["--anchors=0,4,12,20", "--head_map=auto"], None, None),
]


def test_strategy_is_the_apis_and_explicit_anchors_run_without_levers():
    res = cli_fork.run(["-c", SCRIPT, json.dumps([c[0] for c in CASES])], cli_fork.ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    for (argv, recipe, kw), g in zip(CASES, got):
        if recipe is not None:  # --anchors=auto: exactly kascade_jax.strategy_for with the same recipe and budget
            api = kascade_jax.strategy_for(shipped_model(MODEL), recipe=recipe, topk_frac=0.2,
                                           **{"min_k": 128, "kernels": "reference", **kw}, calibrate=False,
                                           verbose=False)
            assert g == strategy_record(api), argv
    default, paper, pinned, explicit, explicit_auto = (g["config"] for g in got)
    art = CalibrationArtifact.load(PACKAGED_DIR / f"{MODEL}-builtin-64-k64-ts32.json")
    # the shipped default (session 19, smol_p6_dec30) pins its anchors, with the calibration's head map and levers
    assert default["anchors"] == [0, 2, 8, 18, 21, 24]
    assert np.array_equal(default["head_map"], art.head_map((0, 2, 8, 18, 21, 24)))
    levers = ("sink_tokens", "recent_window", "decode_only", "decode_topk_frac", "tile_size")
    assert [default[f] for f in levers] == [4, 60, True, 0.3, 32]
    assert got[1]["kernels"] == "pallas" and paper["min_k"] == 64 and paper["sink_tokens"] == 0
    assert pinned["anchors"] == [0, 2, 8, 18, 21] and pinned["sink_tokens"] == 8 and pinned["tile_size"] == 16
    # explicit anchors: identity unless asked, no levers; --head_map=auto: the calibrated map of those anchors
    assert explicit["anchors"] == [0, 4, 12, 20] and explicit["head_map"] is None
    assert [explicit[f] for f in levers] == [0, 0, False, None, 32]
    assert np.array_equal(explicit_auto["head_map"], art.head_map((0, 4, 12, 20)))


def test_bad_flags_fail_with_one_line_before_the_model_loads():
    for argv, needle in [
        (["--anchors=0,x"], "error: --anchors must be"),
        (["--head_map=identity"], "error: --head_map=identity: not used here: --anchors=auto is kascade_jax"),
        (["--anchors=0,4,12,20", "--sink_tokens=4", "--decode_only"],
         "error: --sink_tokens, --decode_only: not used here: explicit --anchors=0,4,12,20 run without recipe levers"),
        (["--kernels=triton"], "--kernels"),
        (["--recipe=default,paper"], "error: --recipe: this command runs one recipe"),
        (["--recipe=candidate:nosuch"], "nosuch"),
    ]:
        res = cli_fork.run(["-m", "experiments.kascade_agreement", "--model=/nonexistent/model", *argv], cli_fork.ENV)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], (argv, res.stderr[-2000:])
