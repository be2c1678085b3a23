"""Recipes and the accuracy report: paired bootstrap against dense, the 13-task average, the dev-split recipe choice."""

import json

import numpy as np
import pytest

from kascade_jax.eval import accuracy
from kascade_jax.recipes import CANDIDATES, PAPER, Recipe, candidate, load_recipe

TASKS = [f"t{i}" for i in range(13)]


def _records(rng, strategy, config, base, shift=0.0, n=12, split="test", model="m", ctx=4096):
    out = []
    for t in TASKS:
        for i in range(n):
            p = np.clip(base[(t, i)] + shift, 0, 1)
            out.append(dict(model=model, context_length=ctx, split=split, strategy=strategy, config=config, task=t,
                            index=i, score=float(rng.random() < p)))
    return out


def _base(rng, n=12):
    return {(t, i): float(rng.uniform(0.2, 0.9)) for t in TASKS for i in range(n)}


def test_paired_difference_and_average(rng):
    base = _base(rng)
    dense = _records(rng, "dense", "", base)
    same = [dict(r, strategy="kascade", config="k=0.1 recipe=paper") for r in dense]  # identical answers
    worse = _records(rng, "kascade", "k=0.1 recipe=sw", base, shift=-0.4)
    rows = accuracy.summarize(dense + same + worse, ruler_tasks=TASKS, reps=400)
    by = {(r["recipe"], r["task"]): r for r in rows if r["strategy"] == "kascade"}
    s = by[("paper", "ruler_avg")]
    assert s["diff_vs_dense"] == 0.0 and s["diff_ci_low"] == 0.0 and s["diff_ci_high"] == 0.0
    assert s["n"] == 13 * 12 and s["recipe"] == "paper" and s["topk_frac"] == 0.1
    d = [r for r in rows if r["strategy"] == "dense" and r["task"] == "ruler_avg"][0]
    task_means = [np.mean([x["score"] for x in dense if x["task"] == t]) * 100 for t in TASKS]
    assert d["score"] == pytest.approx(np.mean(task_means), abs=0.01)
    assert d["ci_low"] <= d["score"] <= d["ci_high"] and d["diff_vs_dense"] is None
    w = by[("sw", "ruler_avg")]
    assert w["diff_ci_high"] < 0 < -w["diff_vs_dense"]  # a 40-point drop is clearly resolved
    assert w["diff_ci_low"] <= w["diff_vs_dense"] <= w["diff_ci_high"]
    # per-task rows carry their own paired intervals
    assert by[("sw", "t0")]["n"] == 12 and by[("sw", "t0")]["diff_vs_dense"] is not None


def test_no_dense_twin_means_no_difference(rng):
    base = _base(rng)
    rows = accuracy.summarize(_records(rng, "kascade", "k=0.1 recipe=paper", base), ruler_tasks=TASKS, reps=100)
    assert all(r["diff_vs_dense"] is None for r in rows)
    # a dense run on another split is not a twin
    rows = accuracy.summarize(_records(rng, "kascade", "k=0.1 recipe=paper", base)
                              + _records(rng, "dense", "", base, split="dev"), ruler_tasks=TASKS, reps=100)
    assert all(r["diff_vs_dense"] is None for r in rows if r["strategy"] == "kascade")


def test_a_cell_in_two_runs_is_an_error_not_an_overwrite(rng):
    base = _base(rng)
    one = [dict(r, source="runA") for r in _records(rng, "kascade", "k=0.1 recipe=paper", base)]
    two = [dict(r, source="runB") for r in _records(rng, "kascade", "k=0.1 recipe=paper", base)]
    with pytest.raises(ValueError, match="is in two runs, runA and runB"):
        accuracy.summarize(one + two, ruler_tasks=TASKS, reps=10)
    other = [dict(r, config="k=0.1 recipe=sw") for r in two]  # another cell from the second run is fine
    assert accuracy.summarize(one + other, ruler_tasks=TASKS, reps=10)


def test_attention_cost_model():
    c = accuracy.attention_cost(24, 5, context=16384)
    r = accuracy.DECODE_RATIOS
    assert c["decode_cost"] == pytest.approx((r["a0"] + 4 * r["anchor"] + 19 * r["reuse"]) / 24, abs=1e-4)
    s = accuracy.attention_cost(24, 5, context=16384, dense_suffix=128)
    assert s["decode_cost"] == c["decode_cost"]
    assert s["prefill_cost"] == pytest.approx(c["prefill_cost"] + 23 / 24 * 2 * 128 / 16384, abs=1e-4)
    assert accuracy.attention_cost(24, 8, context=16384)["decode_speedup"] < c["decode_speedup"]


def test_choose_recipe(rng):
    base = _base(rng)
    recs = _records(rng, "dense", "", base, split="dev")
    recs += _records(rng, "kascade", "k=0.1 recipe=paper", base, shift=-0.3, split="dev")
    recs += _records(rng, "kascade", "k=0.1 recipe=sw", base, shift=-0.1, split="dev")
    recs += _records(rng, "kascade", "k=0.1 recipe=m8", base, shift=0.0, split="dev")  # best, but too slow
    recs += _records(rng, "kascade", "k=0.1 recipe=ds128", base, shift=-0.05, split="test")  # test: never used
    rows = accuracy.summarize(recs, ruler_tasks=TASKS, reps=100)
    doc = accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24)
    assert doc["chosen_from"] == "sw"
    assert doc["default"]["sink_tokens"] == 4 and doc["default"]["name"] == "default"
    assert {r["recipe"] for r in doc["measured"]} == {"paper", "sw", "m8"}
    assert not next(r for r in doc["measured"] if r["recipe"] == "m8")["qualifies"]
    # nothing beats the paper recipe on dev: it stays
    rows = accuracy.summarize([r for r in recs if "recipe=m8" not in r["config"] and "recipe=sw" not in r["config"]],
                              ruler_tasks=TASKS, reps=100)
    assert accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24)["chosen_from"] == "paper"
    with pytest.raises(ValueError, match="no dev ruler_avg for the 'paper' recipe"):
        accuracy.choose_recipe(rows, CANDIDATES, model="other", context=4096, num_layers=24)


def test_attention_cost_of_the_prefill_levers():
    c = accuracy.attention_cost(24, 5, context=16384)
    pf = accuracy.attention_cost(24, 5, context=16384, prefill_topk_frac=0.2)
    lw = accuracy.attention_cost(24, 5, context=16384, local_window=1024)
    r = accuracy.PREFILL_RATIOS
    assert pf["decode_cost"] == lw["decode_cost"] == c["decode_cost"]  # decode keeps its 10%
    assert pf["prefill_cost"] == pytest.approx(c["prefill_cost"] + 19 / 24 * r["reuse"], abs=1e-4)
    assert lw["prefill_cost"] == pytest.approx(c["prefill_cost"] + 19 / 24 * r["reuse"] * 1.25, abs=1e-4)
    dc = accuracy.attention_cost(24, 5, context=16384, decode_topk_frac=0.2)  # decode budget doubled, prefill kept
    assert dc["prefill_cost"] == c["prefill_cost"]
    assert dc["decode_cost"] == pytest.approx(c["decode_cost"] + 19 / 24 * accuracy.DECODE_RATIOS["reuse"], abs=1e-4)
    assert accuracy.recipe_cost(dict(num_anchors=5, decode_topk_frac=0.2), num_layers=24, context=16384) == dc
    rr = accuracy.recipe_cost(dict(num_anchors=5, decode_rerank=3), num_layers=24, context=16384)  # 3k K + k V rows
    assert rr["prefill_cost"] == c["prefill_cost"]
    assert rr["decode_cost"] == pytest.approx(c["decode_cost"] + 19 / 24 * accuracy.DECODE_RATIOS["reuse"], abs=1e-4)
    rw = accuracy.recipe_cost(dict(num_anchors=5, decode_rerank=3, decode_rerank_worst=4), num_layers=24,
                              context=16384)  # only 4 of the 19 reuse layers pay it
    assert rw["decode_cost"] == pytest.approx(c["decode_cost"] + 4 / 24 * accuracy.DECODE_RATIOS["reuse"], abs=1e-4)


def test_measured_ratios_from_the_committed_benchmarks():
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    ratios = accuracy.bench_ratios(bench / "decode.json", bench / "prefill.json", context=32768, decode_batch=64)
    assert set(ratios["decode"]) == {0.1, 0.2, 0.3} and set(ratios["prefill"]) == {0.1}
    dec = json.loads((bench / "decode.json").read_text())["rows"]
    row = next(r for r in dec if (r["context"], r["batch"], r["topk_frac"]) == (32768, 64, 0.2))
    assert ratios["decode"][0.2]["reuse"] == pytest.approx(row["R"] / row["dense"])
    c10 = accuracy.attention_cost(24, 5, context=32768, ratios=ratios)
    c20 = accuracy.attention_cost(24, 5, context=32768, decode_topk_frac=0.2, ratios=ratios)  # the measured 20% row
    want = (ratios["decode"][0.2]["a0"] + 4 * ratios["decode"][0.2]["anchor"] + 19 * ratios["decode"][0.2]["reuse"]) / 24
    assert c20["decode_cost"] == pytest.approx(want, abs=1e-4) and c20["prefill_cost"] == c10["prefill_cost"]
    pf = accuracy.attention_cost(24, 5, context=32768, prefill_topk_frac=0.2, ratios=ratios)  # no 20% row: scaled
    assert pf["prefill_cost"] == pytest.approx(c10["prefill_cost"] + 19 / 24 * ratios["prefill"][0.1]["reuse"], abs=1e-4)
    with pytest.raises(ValueError, match="no decode row at"):
        accuracy.bench_ratios(bench / "decode.json", bench / "prefill.json", context=32768, decode_batch=32)


def test_choose_fastest_within_one_point_of_dense(rng, tmp_path):
    base = _base(rng)
    recs = _records(rng, "dense", "", base, split="dev")
    recs += _records(rng, "kascade", "k=0.1 recipe=paper", base, shift=-0.3, split="dev")  # far below dense
    dense = [r for r in recs if r["strategy"] == "dense"]
    recs += [dict(r, strategy="kascade", config="k=0.1 recipe=m8") for r in dense]  # equal to dense, slow
    recs += [dict(r, strategy="kascade", config="k=0.1 recipe=sw_ds128") for r in dense]  # equal to dense, faster
    rows = accuracy.summarize(recs, ruler_tasks=TASKS, reps=100)
    doc = accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24, within_dense=1.0)
    assert doc["chosen_from"] == "sw_ds128" and "fastest candidate within 1" in doc["default"]["note"]
    table = {r["recipe"]: r for r in doc["measured"]}
    assert table["m8"]["qualifies"] and not table["paper"]["qualifies"]
    assert table["m8"]["dev_diff_ci"] == [0.0, 0.0] and table["paper"]["dev_diff_ci"][1] < 0
    png = accuracy.plot_frontier(doc, tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 10_000 and png.endswith("frontier.png")
    # nobody within the tolerance: the best dev score, and the note says so
    rows = accuracy.summarize([r for r in recs if "m8" not in r["config"] and "sw_ds128" not in r["config"]],
                              ruler_tasks=TASKS, reps=100)
    doc = accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24, within_dense=1.0)
    assert doc["chosen_from"] == "paper" and "no candidate within 1" in doc["default"]["note"]


def test_choose_within_dense_at_every_dev_length(rng):
    """also_contexts: sw is at dense at 4096 but far below at 2048, so the slower m8 (at dense at both) wins;
    a candidate with no cell at 2048 does not qualify; speeds and the note stay those of the main length."""
    base, base2 = _base(rng), _base(rng)
    recs = _records(rng, "dense", "", base, split="dev") + _records(rng, "dense", "", base2, split="dev", ctx=2048)
    dense = [r for r in recs if r["strategy"] == "dense"]
    for name in ("m8", "sw_ds128", "sw"):  # all three at dense at 4096
        recs += [dict(r, strategy="kascade", config=f"k=0.1 recipe={name}") for r in dense
                 if r["context_length"] == 4096]
    recs += [dict(r, strategy="kascade", config="k=0.1 recipe=m8") for r in dense if r["context_length"] == 2048]
    recs += _records(rng, "kascade", "k=0.1 recipe=sw", base2, shift=-0.4, split="dev", ctx=2048)
    rows = accuracy.summarize(recs, ruler_tasks=TASKS, reps=100)
    one = accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24, within_dense=1.0)
    assert one["chosen_from"] == "sw"  # the cheapest of the three
    both = accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24, within_dense=1.0,
                                  also_contexts=[2048, 4096])
    table = {r["recipe"]: r for r in both["measured"]}
    assert both["chosen_from"] == "m8" and "dense here and at 2048 tokens" in both["default"]["note"]
    assert table["m8"]["also_dev_diff_vs_dense"] == {"2048": 0.0}
    assert table["sw_ds128"]["also_dev_diff_vs_dense"] == {"2048": None} and not table["sw_ds128"]["qualifies"]
    assert not table["sw"]["qualifies"] and table["sw"]["also_dev_diff_vs_dense"]["2048"] < -1
    assert both["rule"] == "fastest within 1 of dense (also at 2048)"
    assert table["m8"]["decode_speedup"] == next(r for r in one["measured"] if r["recipe"] == "m8")["decode_speedup"]
    with pytest.raises(ValueError, match="also_contexts needs within_dense"):
        accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24, also_contexts=[2048])


def test_choose_when_nothing_is_within_dense_takes_the_least_worst_loss_among_faster_than_dense(rng):
    """No candidate within 1 at both lengths: sw equals dense at 4096 but loses most at 2048, m8 loses less at both,
    so m8 (the smaller worst loss) wins; dps_dec100 (a 100% decode budget, estimated slower than dense) equals
    dense at both lengths and neither qualifies nor wins."""
    base, base2 = _base(rng), _base(rng)
    recs = _records(rng, "dense", "", base, split="dev") + _records(rng, "dense", "", base2, split="dev", ctx=2048)
    dense = [r for r in recs if r["strategy"] == "dense"]
    recs += [dict(r, strategy="kascade", config="k=0.1 recipe=dps_dec100") for r in dense]
    recs += [dict(r, strategy="kascade", config="k=0.1 recipe=sw") for r in dense if r["context_length"] == 4096]
    recs += _records(rng, "kascade", "k=0.1 recipe=sw", base2, shift=-0.4, split="dev", ctx=2048)
    for ctx, b in ((4096, base), (2048, base2)):
        recs += _records(rng, "kascade", "k=0.1 recipe=m8", b, shift=-0.15, split="dev", ctx=ctx)
    rows = accuracy.summarize(recs, ruler_tasks=TASKS, reps=100)
    doc = accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24, within_dense=1.0,
                                 also_contexts=[2048])
    table = {r["recipe"]: r for r in doc["measured"]}
    assert table["dps_dec100"]["decode_speedup"] < 1 and not table["dps_dec100"]["qualifies"]
    assert table["dps_dec100"]["dev_diff_vs_dense"] == 0.0 and table["dps_dec100"]["also_dev_diff_vs_dense"] == {
        "2048": 0.0}
    m8 = [table["m8"]["dev_diff_vs_dense"], table["m8"]["also_dev_diff_vs_dense"]["2048"]]
    assert max(m8) < -1 and min(m8) > table["sw"]["also_dev_diff_vs_dense"]["2048"]  # m8's worst beats sw's
    assert table["sw"]["dev_diff_vs_dense"] == 0.0 and not table["sw"]["qualifies"]  # sw is the better at 4096
    assert doc["chosen_from"] == "m8"
    assert "the smallest loss at its worst dev length among those faster than dense" in doc["default"]["note"]
    one = accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24, within_dense=1.0)
    assert one["chosen_from"] == "sw"  # at 4096 alone sw is within 1 (and faster than dense)
    only_slow = {n: CANDIDATES[n] for n in ("paper", "dps_dec100")}  # paper: no cell here, so only the slow one
    slow = accuracy.choose_recipe(rows, only_slow, model="m", context=4096, num_layers=24, within_dense=1.0)
    assert slow["chosen_from"] == "dps_dec100" and "(none is faster than dense)" in slow["default"]["note"]


def test_shipped_defaults_help_lines():
    from kascade_jax.recipes import RECIPE_DIR, shipped_defaults

    lines = shipped_defaults()
    assert len(lines) == len(list(RECIPE_DIR.glob("*.json"))) >= 3
    by = {line.split(":", 1)[0]: line for line in lines}
    for m in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):  # one selection shared by all heads, dense prefill
        assert "decode_only pool=all" in by[m]
    assert "decode_topk_frac=0.3" in by["qwen2.5-coder-1.5b"] and "vs dense on 260 prompts" in by["qwen2.5-coder-1.5b"]
    # session 21: the 0.5B's dps_all_dec20, chosen on three pooled dev draws (780 prompts), tested on two (650)
    assert "decode_topk_frac=0.2" in by["qwen2.5-coder-0.5b"] and "vs dense on 780 prompts" in by["qwen2.5-coder-0.5b"]
    assert "smol_p6_dec30 (M=6 pinned=0,2,8,18,21,24" in by["smollm2-135m"] and "not tuned" not in by["smollm2-135m"]
    assert by["qwen2.5-coder-0.5b"].endswith("test -0.9 [-2.1, +0.3] vs dense on 650 prompts)")  # blind
    # at its dev length; the test cell ran before the choice (its rule was written down first), and says so
    assert by["qwen2.5-coder-1.5b"].endswith("test -0.4 [-1.5, +0.6] vs dense on 325 prompts, known before the choice)")
    assert "decode_score_fp8" in by["qwen2.5-coder-1.5b"]  # session 35: dps_all_dec30_fp8d
    # session 19: SmolLM2's test cell ran after its choice (blind), so nothing is added to it
    assert by["smollm2-135m"].endswith("test -0.8 [-2.8, +1.2] vs dense on 325 prompts)")


def test_shipped_defaults_show_a_test_result_only_for_the_recipe_it_measured(tmp_path, monkeypatch):
    import json

    from kascade_jax import recipes

    doc = json.loads((recipes.RECIPE_DIR / "qwen2.5-coder-1.5b.json").read_text())
    (tmp_path / "m.json").write_text(json.dumps(doc))
    monkeypatch.setattr(recipes, "RECIPE_DIR", tmp_path)
    line = recipes.shipped_defaults()[0]
    assert "test -0.4" in line and " tokens" not in line.split("test")[-1]  # tested at the length it was chosen at
    doc["test"]["context"], doc["test"]["blind"] = 8192, True  # a test cell at another length than the choice's
    (tmp_path / "m.json").write_text(json.dumps(doc))
    assert recipes.shipped_defaults()[0].endswith("vs dense on 325 prompts at 8192 tokens)")
    doc["chosen_from"] = "sw_ds128"  # a later choice: the old test result no longer describes the default
    (tmp_path / "m.json").write_text(json.dumps(doc))
    assert "test -0.4" not in recipes.shipped_defaults()[0]


def test_a_recipe_pins_anchors():
    r = candidate("smol_p5")
    assert r.anchors == (0, 2, 8, 18, 21) and "M=5 pinned=0,2,8,18,21 calib=" in r.describe()
    fields = accuracy.config_fields("k=0.1 anchors=0,2,8,18,21 head_map=calibrated " + r.describe())
    assert fields["anchors"] == (0, 2, 8, 18, 21) and fields["num_anchors"] == 5
    assert Recipe.from_dict(dict(num_anchors=3, anchors=[0, 4, 9]), "f").anchors == (0, 4, 9)  # JSON lists
    for bad, msg in ((dict(num_anchors=4, anchors=(0, 2, 8, 18, 21)), "num_anchors=4 but anchors pins 5"),
                     (dict(num_anchors=2, anchors=(1, 5)), "start at layer 0 and increase"),
                     (dict(num_anchors=2, anchors="0,5"), "list of layer indices")):
        with pytest.raises(ValueError, match=msg):
            Recipe(**bad)
    six = r.replace(num_anchors=6)  # another count than the pinned set's: the pins go, the DP picks six (as the CLI)
    assert six.anchors is None and six.num_anchors == 6 and six.name == "smol_p5*" and "pinned" not in six.describe()
    assert r.replace(num_anchors=5) is r  # the same count changes nothing
    assert r.replace(num_anchors=3, anchors=(0, 2, 8)).anchors == (0, 2, 8)  # new pins with their count
    with pytest.raises(ValueError, match="num_anchors=3 but anchors pins 5"):
        r.replace(num_anchors=3, anchors=(0, 2, 8, 18, 21))


def test_recipes(tmp_path):
    assert load_recipe("any-model", "paper") == PAPER
    d = load_recipe("a-model-without-a-recipe", "default")  # the untuned fallback: dps_all, and it says so
    assert d.name == "default" and d.levers() == candidate("dps_all").levers() and d.levers() != PAPER.levers()
    assert d.num_anchors == 5 and d.anchors is None and d.calib_dtype is None
    from kascade_jax.recipes import untuned_notice

    text = untuned_notice(d)
    assert "no tuned recipe shipped for 'a-model-without-a-recipe': dps_all" in text and "your own model" in text
    assert untuned_notice(d.replace(num_anchors=6)) == text  # explicit flags on top keep the notice
    assert untuned_notice(load_recipe("qwen2.5-coder-0.5b", "default")) is None
    assert untuned_notice(load_recipe("a-model-without-a-recipe", "paper")) is None
    assert candidate("sw").levers() == dict(sink_tokens=4, recent_window=60, dense_suffix=0, local_window=0)
    assert load_recipe("m", "candidate:m6").num_anchors == 6
    assert PAPER.replace(num_anchors=5) is PAPER
    changed = PAPER.replace(num_anchors=8, sink_tokens=None)
    assert changed.name == "paper*" and changed.num_anchors == 8 and "M=8" in changed.describe()
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"default": dict(num_anchors=6, dense_suffix=128, note="x"), "measured": []}))
    r = load_recipe("m", str(f))
    assert r.num_anchors == 6 and r.dense_suffix == 128
    dec = candidate("dec20_imp_none_ds512s")
    assert dec.levers()["decode_topk_frac"] == 0.2 and "prefill_topk_frac" not in dec.levers()
    assert "decode_topk_frac=0.2" in dec.describe() and dec.calib_importance == "none"
    for bad, match in ((dict(num_anchors=0), "num_anchors"), (dict(sink_tokens=-1), "sink_tokens"),
                       (dict(calib_reduce="max"), "calib_reduce"), (dict(calib_importance="x"), "calib_importance"),
                       (dict(decode_topk_frac=0.0), "decode_topk_frac"), (dict(decode_topk_frac=2), "decode_topk_frac")):
        with pytest.raises(ValueError, match=match):
            Recipe(**bad)
    with pytest.raises(ValueError, match="unknown fields"):
        Recipe.from_dict(dict(num_anchor=5), "r")
    with pytest.raises(ValueError, match="--recipe must be"):
        load_recipe("m", "fast")
    with pytest.raises(ValueError, match="unknown candidate"):
        load_recipe("m", "candidate:nope")
    with pytest.raises(ValueError, match="no recipe file"):
        load_recipe("m", str(tmp_path / "missing.json"))


def test_attention_cost_of_dense_anchors_and_dense_prefill():
    r = accuracy.PREFILL_RATIOS
    c = accuracy.attention_cost(24, 5, context=16384)
    pda = accuracy.recipe_cost(dict(num_anchors=5, prefill_dense_anchors=True), num_layers=24, context=16384)
    assert pda["decode_cost"] == c["decode_cost"]
    assert pda["prefill_cost"] == pytest.approx(c["prefill_cost"] + 4 / 24 * (r["a0"] - r["anchor"]), abs=1e-4)
    ds = accuracy.recipe_cost(dict(num_anchors=5, prefill_dense_anchors=True, dense_suffix=512), num_layers=24,
                              context=16384)  # the suffix adds to the 19 sparse layers only
    assert ds["prefill_cost"] == pytest.approx(pda["prefill_cost"] + 19 / 24 * 2 * 512 / 16384, abs=1e-4)
    dps = accuracy.recipe_cost(dict(num_anchors=5, decode_only=True), num_layers=24, context=16384)
    assert dps["prefill_cost"] == 1.0 and dps["decode_cost"] == c["decode_cost"]


def test_choose_takes_a_decode_only_cell_for_the_dense_prefill_candidate(rng):
    """A `--strategies=decode_only` cell stands for the dense-prefill candidate whose decode side it ran (prefill-only
    levers such as the dense suffix do not matter there); one with another decode side does not."""
    assert accuracy.config_fields("k=0.1 recipe=x M=7 calib=k64/min/w=none sink_tokens=4 dense_suffix=128 "
                                  "decode_topk_frac=0.2 decode_only") == dict(
        num_anchors=7, calib_k=64, calib_reduce="min", calib_importance="none", sink_tokens=4, dense_suffix=128,
        decode_topk_frac=0.2, decode_only=True)
    base = _base(rng)
    recs = _records(rng, "dense", "", base, split="dev")
    recs += _records(rng, "kascade", "k=0.1 recipe=paper M=5 calib=k64/min/w=paper", base, shift=-0.3, split="dev")
    dense = [r for r in recs if r["strategy"] == "dense"]
    sw = "M=5 calib=k64/min/w=paper sink_tokens=4 recent_window=60"
    recs += [dict(r, strategy="decode_only", config=f"k=0.1 recipe=default {sw} dense_suffix=128") for r in dense]
    rows = accuracy.summarize(recs, ruler_tasks=TASKS, reps=100)
    doc = accuracy.choose_recipe(rows, CANDIDATES, model="m", context=4096, num_layers=24, within_dense=1.0)
    assert doc["chosen_from"] == "dps" and doc["default"]["decode_only"] is True
    row = next(r for r in doc["measured"] if r["recipe"] == "dps")
    assert row["prefill_speedup"] == 1.0 and "strategy decode_only" in row["measured_as"]
    other = [dict(r, config=r["config"].replace("recent_window=60", "recent_window=30")) if
             r["strategy"] == "decode_only" else r for r in recs]  # another decode side: not the candidate
    doc = accuracy.choose_recipe(accuracy.summarize(other, ruler_tasks=TASKS, reps=100), CANDIDATES, model="m",
                                 context=4096, num_layers=24, within_dense=1.0)
    assert doc["chosen_from"] == "paper" and "dps" not in {r["recipe"] for r in doc["measured"]}


def test_a_run_with_another_seed_is_a_replicate_with_its_own_dense_twin(rng, tmp_path):
    # seed 1 draws other prompts under the same indices: pairing them with seed 0's dense would be wrong, and
    # reporting both runs together used to stop at "is in two runs"
    base = _base(rng, n=4)
    for name, seed, shift in (("d0", 0, 0.0), ("k0", 0, -0.3), ("d1", 1, 0.0), ("k1", 1, 0.0)):
        run = tmp_path / name
        run.mkdir()
        strategy = "dense" if name[0] == "d" else "kascade"
        recs = _records(rng, strategy, "" if strategy == "dense" else "k=0.1 recipe=dps", base, shift=shift, n=4,
                           split="dev")
        (run / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        spec = {} if name == "k1" else dict(spec=dict(seed=seed))  # k1: an older run without a saved spec
        (run / "results.json").write_text(json.dumps(dict(
            environment=dict(command=f"eval --split=dev{' --seed=1' if seed else ''}"), rows=[], **spec)))
    ex = accuracy.load_examples([tmp_path / n for n in ("d0", "k0", "d1", "k1")])
    assert sorted({(r["source"][-2:], r["split"]) for r in ex}) == [
        ("d0", "dev"), ("d1", "dev-seed1"), ("k0", "dev"), ("k1", "dev-seed1")]
    rows = {(r["split"], r["strategy"]): r for r in accuracy.summarize(ex, ruler_tasks=TASKS, reps=200)
            if r["task"] == "ruler_avg"}
    assert rows[("dev", "kascade")]["diff_vs_dense"] < -10  # paired with its own seed's dense
    assert rows[("dev-seed1", "kascade")]["diff_vs_dense"] is not None


_ACC = __import__("pathlib").Path(__file__).resolve().parents[2] / "results" / "accuracy"
_RR05 = _ACC / "h200_2026-12-03_i21s11" / "bench" / "decode_qwen05_rr.json"
_PF05 = _ACC / "h200_2026-12-02_i21s3" / "bench" / "prefill_qwen05.json"


def test_the_rerank_is_priced_by_its_measured_layers():
    """bench --decode_reranks rows (A0/A/R_rr{C}) reach the speed model: a reranking reuse layer costs what the
    benchmark timed, not the bytes estimate; with decode_rerank_worst only N reuse layers pay it."""
    ratios = accuracy.bench_ratios(_RR05, _PF05, context=16384)
    row = next(r for r in json.loads(_RR05.read_text())["rows"] if r["context"] == 16384)
    q = ratios["decode_rerank"][4]
    assert set(ratios["decode_rerank"]) == {2, 4} and q["reuse"] == pytest.approx(row["R_rr4"] / row["dense"])
    all4 = accuracy.attention_cost(24, 5, context=16384, decode_rerank=4, ratios=ratios)
    assert all4["decode_speedup"] == pytest.approx(row["speedup_rr4"], rel=1e-3)  # the benchmark's own weighting
    w5 = accuracy.attention_cost(24, 5, context=16384, decode_rerank=4, decode_rerank_worst=5, ratios=ratios)
    plain = ratios["decode"][0.1]["reuse"]
    want = (q["a0"] + 4 * q["anchor"] + 5 * q["reuse"] + 14 * plain) / 24
    assert w5["decode_cost"] == pytest.approx(want, abs=1e-4)
    guess = accuracy.attention_cost(24, 5, context=16384, decode_rerank=4)  # no measured rerank: the bytes floor
    assert guess["decode_speedup"] > 3 * all4["decode_speedup"]
    # a benchmark that timed the worst-layers mix (--decode_rerank_worst=5: A, R, F) is used as measured
    import tempfile
    from pathlib import Path

    doc = json.loads(_RR05.read_text())
    for r in doc["rows"]:
        r.update(A0_rr4w5=r["A0_rr4"], A_rr4w5=2 * r["A_rr4"], R_rr4w5=r["R_rr4"], F_rr4w5=1.5 * r["R"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.json"
        path.write_text(json.dumps(doc))
        timed = accuracy.bench_ratios(path, _PF05, context=16384)
    w = timed["decode_rerank_worst"][(4, 5)]
    assert w["anchor"] == pytest.approx(2 * q["anchor"]) and w["first"] == pytest.approx(1.5 * plain)
    got = accuracy.attention_cost(24, 5, context=16384, decode_rerank=4, decode_rerank_worst=5, ratios=timed)
    want = (w["a0"] + 4 * w["anchor"] + 5 * w["reuse"] + 14 * w["first"]) / 24
    assert got["decode_cost"] == pytest.approx(want, abs=1e-4)
    other = accuracy.attention_cost(24, 5, context=16384, decode_rerank=4, decode_rerank_worst=3, ratios=timed)
    assert other["decode_cost"] == pytest.approx((q["a0"] + 4 * q["anchor"] + 3 * q["reuse"] + 16 * plain) / 24,
                                                 abs=1e-4)  # another N than timed: the lower bound


def test_the_shared_selection_is_priced_by_its_measured_layers(tmp_path):
    """bench --decode_pools rows (A0/A/R_pool{P}) reach the speed model as each piece's ratio to the gqa selection
    through the same path; an all_heads_pooled row without them gets no decode speed (never plain Kascade's), and
    a row's explicit anchors count over its recipe's M."""
    doc = json.loads(_RR05.read_text())
    for r in doc["rows"]:
        r.update(A0_poolgqa=r["A0"], A_poolgqa=r["A"], R_poolgqa=r["R"],
                 A0_poolall=r["A0"], A_poolall=0.5 * r["A"], R_poolall=2 * r["R"])
    path = tmp_path / "d.json"
    path.write_text(json.dumps(doc))
    ratios = accuracy.bench_ratios(path, _PF05, context=16384)
    plain = ratios["decode"][0.1]
    assert set(ratios["pool"]) == {"gqa", "all"}
    got = accuracy.attention_cost(24, 5, context=16384, pool="all", dense_prefill=True, ratios=ratios)
    want = (plain["a0"] + 4 * 0.5 * plain["anchor"] + 19 * 2 * plain["reuse"]) / 24
    assert got["decode_cost"] == pytest.approx(want, abs=1e-4) and got["prefill_cost"] == 1.0
    assert accuracy.attention_cost(24, 5, context=16384, ratios=ratios)["decode_cost"] != got["decode_cost"]
    bare = accuracy.bench_ratios(_RR05, _PF05, context=16384)  # no pool rows: the shared set's price is unknown
    unknown = accuracy.attention_cost(24, 5, context=16384, pool="all", ratios=bare)
    assert unknown["decode_speedup"] is None and unknown["prefill_speedup"] is not None
    cfg = "k=0.1 anchors=0,1,3,5,9 head_map=identity recipe=dps M=5 calib=k64/min/w=paper decode_only"
    row = dict(model="qwen2.5-coder-0.5b", task="ruler_avg", context=16384, split="dev", strategy="all_heads_pooled",
               config=cfg, topk_frac=0.1, anchors="0,1,3,5,9")
    bench = {"qwen2.5-coder-0.5b": (_RR05, _PF05)}
    assert accuracy.add_speed([row], bench)[0]["decode_speedup"] is None
    timed = accuracy.add_speed([row], {"qwen2.5-coder-0.5b": (path, _PF05)})[0]
    assert timed["decode_speedup"] == pytest.approx(1 / want, rel=1e-3)
    # --mode=choose: a shared-set candidate at dense but with no measured price does not qualify (nor plot)
    from kascade_jax.recipes import CANDIDATES

    rng = np.random.default_rng(5)
    base = _base(rng)
    recs = _records(rng, "dense", "", base, split="dev", ctx=16384)
    recs += [dict(r, strategy="kascade", config=f"k=0.1 recipe={n}") for r in recs for n in ("dps_all", "dps")]
    cands = {n: CANDIDATES[n] for n in ("dps_all", "dps")}
    rows = accuracy.summarize(recs, ruler_tasks=TASKS, reps=100)
    doc = accuracy.choose_recipe(rows, cands, model="m", context=16384, num_layers=24, within_dense=1.0,
                                 baseline="dps", ratios=bare)
    table = {r["recipe"]: r for r in doc["measured"]}
    assert doc["chosen_from"] == "dps" and not table["dps_all"]["qualifies"] and table["dps"]["qualifies"]
    accuracy.plot_frontier(doc, tmp_path / "frontier.png")
    doc = accuracy.choose_recipe(rows, cands, model="m", context=16384, num_layers=24, within_dense=1.0,
                                 baseline="dps", ratios=ratios)  # timed (R twice gqa's here): priced, slower
    table = {r["recipe"]: r for r in doc["measured"]}
    assert doc["chosen_from"] == "dps" and table["dps_all"]["qualifies"]
    assert table["dps_all"]["decode_cost"] == pytest.approx(want, abs=1e-4)
    four = dict(row, strategy="kascade", anchors="0,2,8,18", config=cfg.replace("0,1,3,5,9", "0,2,8,18"))
    want4 = (plain["a0"] + 3 * plain["anchor"] + 20 * plain["reuse"]) / 24
    assert accuracy.add_speed([four], bench)[0]["decode_speedup"] == pytest.approx(1 / want4, rel=1e-3)


def test_report_rows_get_measured_speed_and_a_headline():
    cfg = "k=0.1 anchors=0,1,3,5,9 head_map=calibrated recipe=default M=5 calib=k64/min/w=paper decode_only"
    paper = "k=0.1 anchors=0,1,3,5,9 head_map=calibrated recipe=paper M=5 calib=k64/min/w=paper"

    def row(strategy, config, score, diff, ctx=16384, model="qwen2.5-coder-0.5b", split="test"):
        return dict(model=model, task="ruler_avg", context=ctx, split=split, strategy=strategy,
                    recipe=accuracy.recipe_of(config), config=config, topk_frac=0.1 if config else None,
                    anchors=accuracy._anchors(config), score=score, n=325, ci_low=score - 3, ci_high=score + 3,
                    diff_vs_dense=diff, diff_ci_low=None if diff is None else diff - 2,
                    diff_ci_high=None if diff is None else diff + 2)

    rows = [row("dense", "", 62.6, None), row("kascade", cfg, 61.0, -1.6), row("kascade", paper, 55.0, -7.6),
            row("quest", "budget=0.1", 51.1, -11.5), row("omnikv", "budget=0.1", 25.6, -37.0),
            row("dense", "", 50.0, None, ctx=8192)]
    out = accuracy.add_speed(rows, {"qwen2.5-coder-0.5b": (_RR05, _PF05)})
    ratios = accuracy.bench_ratios(_RR05, _PF05, context=16384)
    want = accuracy.attention_cost(24, 5, context=16384, dense_prefill=True, ratios=ratios)
    assert (out[0]["decode_speedup"], out[0]["prefill_speedup"]) == (1.0, 1.0)
    assert (out[1]["decode_speedup"], out[1]["prefill_speedup"]) == (want["decode_speedup"], 1.0)
    assert out[2]["prefill_speedup"] != 1.0 and out[3]["decode_speedup"] is None  # a baseline: no kernels timed
    assert out[5]["decode_speedup"] is None  # 8K was not benchmarked
    head = accuracy.headline_rows(out, {"qwen2.5-coder-0.5b": "recipe=default M=5 calib=k64/min/w=paper decode_only"})
    h16 = next(h for h in head if h["context"] == 16384)
    assert h16["default"]["score"] == 61.0 and h16["paper"]["score"] == 55.0
    assert h16["best_baseline"]["strategy"] == "quest"
    md = accuracy.headline_markdown(head)
    assert "-1.6 [-3.6, +0.4]" in md and f"{want['decode_speedup']:.2f}x / 1.00x" in md and "quest -11.5" in md
    # a default cell of another recipe than today's shipped one is not shown as the default
    other = accuracy.headline_rows(out, {"qwen2.5-coder-0.5b": "recipe=default M=5 calib=k64/min/w=paper dense_suffix=512"})
    assert next(h for h in other if h["context"] == 16384)["default"] is None
    assert "not run (an older default: -1.6" in accuracy.headline_markdown(other)
    # the shipped default's own candidate cell (same levers, its DP anchors) stands for it; an anchor experiment
    # of that candidate or a cell of other levers does not
    pool = "M=5 calib=k64/min/w=paper decode_only pool=all"
    mine = [row("kascade", f"k=0.1 anchors=0,1,3,5,9 head_map=identity recipe=dps_all {pool}", 61.5, -1.1),
            row("kascade", f"k=0.1 anchors=0,2,8,18 head_map=identity recipe=dps_all {pool}", 40.0, -22.6),
            row("kascade", f"k=0.1 anchors=0,1,3,5,9 head_map=identity recipe=dps_all {pool}", 30.0, -32.6,
                ctx=8192)]
    want = {"qwen2.5-coder-0.5b": f"recipe=default {pool}"}
    rows2 = [r for r in out if r["recipe"] != "default"] + mine
    head = accuracy.headline_rows(rows2, want, chosen={"qwen2.5-coder-0.5b": "dps_all"})
    assert [(h["context"], h["default"]["score"]) for h in head] == [(8192, 30.0), (16384, 61.5)]
    assert all(h["default"] is None for h in accuracy.headline_rows(rows2, want))  # without `chosen`: none
    assert all(h["default"] is None for h in accuracy.headline_rows(
        rows2, {"qwen2.5-coder-0.5b": "recipe=default M=5 calib=k64/min/w=paper decode_only"},
        chosen={"qwen2.5-coder-0.5b": "dps_all"}))


def test_compare_two_cells_per_split_and_pooled(rng):
    """--mode=compare: a - b on the same prompts of each split, then pooled over the splits (prompts resampled within
    each split's tasks); a spec matching two cells asks for @ANCHORS; a missing cell is named."""
    ex = []
    for split, shift in (("dev", -0.2), ("dev-seed1", -0.4)):
        base = _base(rng)
        ex += _records(rng, "kascade", "k=0.1 anchors=0,1 recipe=dps", base, split=split)
        ex += _records(rng, "kascade", "k=0.1 anchors=0,1 recipe=rr4", base, shift=shift, split=split)
        ex += _records(rng, "kascade", "k=0.1 anchors=0,1,2 recipe=dps", base, split=split)
    rows = accuracy.compare(ex, "kascade:rr4", "kascade:dps@0,1", model="m", context=4096,
                            splits=["dev", "dev-seed1"], ruler_tasks=TASKS, reps=300)
    assert [r["split"] for r in rows] == ["dev", "dev-seed1", "dev+dev-seed1"]
    assert [r["n"] for r in rows] == [156, 156, 312]
    assert rows[0]["diff"] > rows[1]["diff"] and rows[2]["ci_low"] < rows[2]["diff"] < rows[2]["ci_high"]
    assert rows[2]["diff"] == pytest.approx((rows[0]["diff"] + rows[1]["diff"]) / 2, abs=0.02)
    assert rows[2]["ci_high"] - rows[2]["ci_low"] < rows[0]["ci_high"] - rows[0]["ci_low"]  # more prompts: narrower
    with pytest.raises(ValueError, match="matches 2 cells.*add @ANCHORS"):
        accuracy.compare(ex, "kascade:rr4", "kascade:dps", model="m", context=4096, splits=["dev"], ruler_tasks=TASKS)
    with pytest.raises(ValueError, match="no complete RULER cell 'dense'"):
        accuracy.compare(ex, "kascade:rr4", "dense", model="m", context=4096, splits=["dev"], ruler_tasks=TASKS)


def test_the_pooled_headline_covers_every_test_draw(rng):
    """The report's second headline: the default's cell on test and test-seed1 (each with its own dense) pooled, the
    difference the mean of the two draws' (paired within each draw), on twice the prompts; a cell on one draw only
    (the paper recipe here) is not run there; fewer than two draws give none."""
    cfg = "k=0.1 anchors=0,1 head_map=identity recipe=default M=2 decode_only pool=all"
    ex = []
    for split, shift in (("test", -0.1), ("test-seed1", -0.3)):
        base = _base(rng)
        ex += _records(rng, "dense", "", base, split=split)
        ex += _records(rng, "kascade", cfg, base, shift=shift, split=split)
    ex += _records(rng, "kascade", "k=0.1 anchors=0,1 recipe=paper M=2", _base(rng), split="test")
    want = {"m": "recipe=default M=2 decode_only pool=all"}
    into, head = accuracy.pooled_headline(ex, want, ruler_tasks=TASKS, reps=300)
    assert into == "test+test-seed1" and len(head) == 1
    h = head[0]
    assert h["n"] == h["default"]["n"] == 2 * 13 * 12 and h["paper"] is None
    each = [next(r for r in accuracy.summarize([e for e in ex if e["split"] == sp], ruler_tasks=TASKS, reps=300)
                 if r["task"] == "ruler_avg" and r["strategy"] == "kascade" and r["recipe"] == "default")
            for sp in ("test", "test-seed1")]
    assert h["default"]["diff_vs_dense"] == pytest.approx(sum(e["diff_vs_dense"] for e in each) / 2, abs=0.02)
    assert accuracy.test_draws(ex + [dict(ex[0], split="test-seed10"), dict(ex[0], split="dev-seed1")]) == [
        "test", "test-seed1", "test-seed10"]
    assert accuracy.pooled_headline([e for e in ex if e["split"] == "test"], want, ruler_tasks=TASKS) == ("", [])


def test_pool_draws_pairs_within_each_draw_and_keeps_only_cells_on_every_draw(rng):
    """--mode=choose --dev_splits: two dev draws become one dev split of twice the prompts, each prompt still paired
    with its own draw's dense answer; a cell run on one draw only is left out (named), other splits pass unchanged."""
    ex = []
    for split, shift in (("dev", -0.1), ("dev-seed1", -0.5)):
        base = _base(rng)
        ex += _records(rng, "dense", "", base, split=split)
        ex += _records(rng, "kascade", "k=0.1 recipe=a", base, shift=shift, split=split)
    ex += _records(rng, "kascade", "k=0.1 recipe=b", _base(rng), split="dev")  # one draw only
    ex += _records(rng, "dense", "", _base(rng), split="test")
    pooled, dropped = accuracy.pool_draws(ex, ["dev", "dev-seed1"])
    assert dropped == [("m", 4096, "kascade", "k=0.1 recipe=b")]
    assert {r["split"] for r in pooled} == {"dev", "test"} and len(pooled) == len(ex) - 13 * 12
    rows = {(r["split"], r["recipe"] or r["strategy"]): r for r in accuracy.summarize(pooled, ruler_tasks=TASKS, reps=300)
            if r["task"] == "ruler_avg"}
    assert rows[("dev", "a")]["n"] == rows[("dev", "dense")]["n"] == 2 * 13 * 12 and ("dev", "b") not in rows
    each = [accuracy.summarize([r for r in ex if r["split"] == sp], ruler_tasks=TASKS, reps=300) for sp in
            ("dev", "dev-seed1")]
    per = [next(r["diff_vs_dense"] for r in e if r["task"] == "ruler_avg" and r["recipe"] == "a") for e in each]
    assert rows[("dev", "a")]["diff_vs_dense"] == pytest.approx(sum(per) / 2, abs=0.02)  # paired within each draw
    with pytest.raises(ValueError, match="at least two draws"):
        accuracy.pool_draws(ex, ["dev"])
    with pytest.raises(ValueError, match="no cell was run on every draw"):
        accuracy.pool_draws(ex, ["dev", "dev-seed7"])


def test_gzipped_examples_read_as_the_plain_file(rng, tmp_path):
    """Committed runs keep examples.jsonl gzipped (the tree travels with every device call): every reader (the
    accuracy report, a resume's read_results; merge_eval and the accuracy CLI's folder discovery go through the
    same report.examples_path / iter_examples) sees the same records; a damaged line names the .gz file; a folder
    with neither file is refused by name."""
    import gzip

    from kascade_jax.eval import report

    recs = _records(rng, "dense", "", _base(rng, n=3), n=3, split="dev")
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    for run in (plain, packed):
        run.mkdir()
        (run / "results.json").write_text(json.dumps(dict(environment=dict(command="eval --split=dev"), rows=[])))
    text = "".join(json.dumps(r) + "\n" for r in recs)
    (plain / "examples.jsonl").write_text(text)
    with gzip.open(packed / "examples.jsonl.gz", "wt") as f:
        f.write(text)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "source"} for r in rs]  # noqa: E731
    assert strip(accuracy.load_examples([packed])) == strip(accuracy.load_examples([plain])) != []
    assert report.read_results(str(packed))[1] == report.read_results(str(plain))[1] == recs
    assert report.examples_path(packed).endswith(".gz") and report.examples_path(tmp_path) is None
    with gzip.open(packed / "examples.jsonl.gz", "wt") as f:
        f.write(text + "{not json\n")
    with pytest.raises(ValueError, match=rf"examples\.jsonl\.gz line {len(recs) + 1} is not valid JSON"):
        accuracy.load_examples([packed])
    (packed / "examples.jsonl.gz").unlink()
    with pytest.raises(ValueError, match="holds no examples.jsonl"):
        accuracy.load_examples([packed])


def test_decode_benchmarks_joined_with_plus_merge_their_levers():
    """A '+'-joined decode path (the rerank's run + the pools' run of one shape, as the report passes them): the
    plain layers come from the first file, the rerank and the pools from whichever file timed them; the plain ratios
    are exactly the first file's alone."""
    pool05 = _ACC / "h200_2026-12-04_i21s15" / "bench" / "decode_qwen05_pool.json"
    alone = accuracy.bench_ratios(_RR05, _PF05, context=16384)
    both = accuracy.bench_ratios(f"{_RR05}+{pool05}", _PF05, context=16384)
    assert both["decode"] == alone["decode"] and both["decode_rerank"] == alone["decode_rerank"]
    assert "pool" not in alone and set(both["pool"]) == {"gqa", "all"}
    row = next(r for r in json.loads(pool05.read_text())["rows"] if r["context"] == 16384)
    assert both["pool"]["all"]["reuse"] == pytest.approx(row["R_poolall"] / row["dense"])
    shared = accuracy.attention_cost(24, 5, context=16384, pool="all", dense_prefill=True, ratios=both)
    assert shared["decode_speedup"] is not None and 0.5 < shared["decode_speedup"] / alone_speed(alone) < 2


def alone_speed(ratios):
    return accuracy.attention_cost(24, 5, context=16384, dense_prefill=True, ratios=ratios)["decode_speedup"]


def test_speed_ties_go_to_the_better_dev_score(rng):
    """--mode=choose's speed_tie: among qualifying candidates whose costs differ by less than the tie, the better dev
    score wins; a truly faster qualifying candidate still wins; a bad tie is refused. The prices are session 15's
    measured pool run (dps_all within ~1% of dps) and a clearly slower rerank (dps_rr4)."""
    from kascade_jax.recipes import CANDIDATES

    pool05 = _ACC / "h200_2026-12-04_i21s15" / "bench" / "decode_qwen05_pool.json"
    ratios = accuracy.bench_ratios(f"{_RR05}+{pool05}", _PF05, context=16384)
    dense = [dict(r, score=1.0) for r in _records(rng, "dense", "", _base(rng), split="dev", ctx=16384)]
    recs = list(dense)
    for name, miss in (("dps", 1), ("dps_all", 0), ("dps_rr4", 0)):  # dps misses 1 prompt of each task: -8.3
        recs += [dict(r, strategy="kascade", config=f"k=0.1 recipe={name}", score=float(r["index"] >= miss))
                 for r in dense]
    rows = accuracy.summarize(recs, ruler_tasks=TASKS, reps=100)
    cands = {n: CANDIDATES[n] for n in ("dps", "dps_all", "dps_rr4")}

    def pick(within, tie):
        return accuracy.choose_recipe(rows, cands, model="m", context=16384, num_layers=24, within_dense=within,
                                      baseline="dps", ratios=ratios, speed_tie=tie)

    costs = {r["recipe"]: r["decode_cost"] + r["prefill_cost"] for r in pick(10, 0)["measured"]}
    assert abs(costs["dps_all"] / costs["dps"] - 1) < 0.03 and costs["dps_rr4"] > 1.5 * costs["dps"]
    fastest = min(("dps", "dps_all"), key=costs.get)
    assert pick(10, 0.0)["chosen_from"] == fastest  # no tie: the cheaper of the two, whatever its score
    doc = pick(10, 0.03)
    assert doc["chosen_from"] == "dps_all" and "count as equal" in doc["default"]["note"]
    assert pick(1, 0.03)["chosen_from"] == "dps_all"  # dps does not qualify at 1 point
    assert pick(10, 5.0)["chosen_from"] in ("dps_all", "dps_rr4")  # everything tied: the best score (both 100)
    with pytest.raises(ValueError, match="speed_tie"):
        pick(1, -0.1)


def test_choose_reads_a_recipe_from_its_own_anchors_not_an_anchor_experiment(rng):
    """A recipe also run with explicit anchors (an anchor experiment on the same dev prompts) has several dev cells;
    --mode=choose judges the recipe by the cell with the anchor set the other cells of its M share (the DP's)."""
    from kascade_jax.recipes import CANDIDATES

    dense = [dict(r, score=1.0) for r in _records(rng, "dense", "", _base(rng), split="dev", ctx=16384)]
    recs = list(dense)
    for name, anchors, miss in (("dps_all", "0,1,3,5,9", 0), ("dps", "0,1,3,5,9", 0), ("dps", "0,2,8,18", 6)):
        recs += [dict(r, strategy="kascade", config=f"k=0.1 anchors={anchors} recipe={name} M=5",
                      score=float(r["index"] >= miss)) for r in dense]
    rows = accuracy.summarize(recs, ruler_tasks=TASKS, reps=100)
    doc = accuracy.choose_recipe(rows, {n: CANDIDATES[n] for n in ("dps", "dps_all")}, model="m", context=16384,
                                 num_layers=24, within_dense=1.0, baseline="dps")
    table = {r["recipe"]: r for r in doc["measured"]}
    assert table["dps"]["dev_diff_vs_dense"] == 0.0 and table["dps"]["qualifies"]
