"""experiments/kascade_agreement.py: --anchors=auto brings the calibrated head map and the recipe levers, and a bad
--anchors fails before the model loads. Subprocesses: the entry point defines --model, as experiments.eval does."""

import json
import numpy as np

from tests import cli_fork  # the probes: forked from a server that has imported the libraries

SCRIPT = """
import json, sys
from experiments import kascade_agreement as ka
from models import load_model
model, tok = load_model("smollm2-135m", "float32")
out = [ka.resolve_kascade(model, tok, a, h, "smollm2-135m", 32) for a, h in
       [("auto", None), ("0,4,12,20", None), ("0,4,12,20", "auto")]]
print(json.dumps(out))
"""


def test_auto_anchors_keep_the_calibrated_head_map_and_the_recipe():
    from kascade_jax.calibration.artifact import CalibrationArtifact
    from kascade_jax.calibration.resolve import PACKAGED_DIR

    res = cli_fork.run(["-c", SCRIPT], cli_fork.ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (anchors, head_map, levers, desc), (a2, hm2, lev2, _), (_, hm3, _, _) = json.loads(res.stdout.splitlines()[-1])
    art = CalibrationArtifact.load(PACKAGED_DIR / "smollm2-135m-builtin-64-k64-ts32.json")
    # the shipped default (session 19, smol_p6_dec30) pins its anchors: those, with the calibration's head map
    assert tuple(anchors) == (0, 2, 8, 18, 21, 24) and "smollm2-135m-builtin-64-k64-ts32.json" in desc
    expected = art.head_map(tuple(anchors))
    assert not np.array_equal(expected, np.tile(np.arange(expected.shape[1]), (expected.shape[0], 1)))  # non-trivial
    assert np.array_equal(np.asarray(head_map), expected)
    assert levers == dict(sink_tokens=4, recent_window=60, dense_suffix=0, local_window=0, decode_only=True,
                                 decode_topk_frac=0.3)
    # explicit anchors: identity unless asked, no levers; --head_map=auto: the calibrated map of those anchors
    assert a2 == [0, 4, 12, 20] and hm2 is None and lev2 == {}
    assert np.array_equal(np.asarray(hm3), art.head_map((0, 4, 12, 20)))


def test_bad_anchors_fail_before_the_model_loads():
    res = cli_fork.run(["-m", "experiments.kascade_agreement", "--anchors=0,x", "--model=/nonexistent/model"],
                       cli_fork.ENV)
    assert res.returncode == 2 and res.stderr.strip().startswith("error: --anchors must be"), res.stderr[-2000:]
