"""Eval results are never lost or silently replaced: the --output_dir check, --overwrite, --resume, per-strategy
checkpoints, atomic writes and `partial` marks. The CLI runs with a stub model and a stub generator."""

import csv
import json
import os
import types
from pathlib import Path

import pytest
from absl import flags
from absl.testing import flagsaver

from experiments import eval as cli
from experiments import merge_eval
from kascade_jax.eval import harness, report, suite
from tests.kascade_jax.kj_helpers import FakeTokenizer

ROOT = Path(__file__).resolve().parents[2]
TOK = FakeTokenizer()
HEADER = types.SimpleNamespace(max_position_embeddings=4096)  # the stub model's window (`_model`)
FLAGS = flags.FLAGS
ARGS = ["--tasks=synthetic:niah_single_1", "--context_lengths=600", "--num_samples=2", "--batch_size=2",
        "--strategies=dense,kascade", "--max_new_tokens=8", "--anchors=", "--noprogress"]


def _model():
    return types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096, num_layers=4, kv_heads=1))


class Stubs:
    """A stub load_model and generate: counts model loads and generate calls, raises `interrupt` at call `stop`."""

    def __init__(self, monkeypatch):
        import models

        self.loads, self.calls, self.stop = 0, 0, None
        monkeypatch.setattr(models, "load_model", self.load)
        monkeypatch.setattr(models, "load_model_header", lambda *a, **kw: (HEADER, TOK))
        monkeypatch.setattr(harness, "_generate", self.generate)

    def load(self, *a, **kw):
        self.loads += 1
        return _model(), TOK

    def generate(self, model, tokenizer, prompts, strategy, key, max_len, limits, **kw):
        self.calls += 1
        if self.calls == self.stop:
            raise KeyboardInterrupt  # not an Exception: the harness does not catch it, like a killed run
        return [types.SimpleNamespace(text="nope", prompt_tokens=len(p), new_tokens=3, finish_reason="eos")
                for p in prompts]


def run_cli(out, *extra):
    with flagsaver.flagsaver():
        FLAGS.unparse_flags()
        FLAGS(["eval", *ARGS, f"--output_dir={out}", *extra])
        cli.main([])


def _json(out):
    return json.loads((Path(out) / "results.json").read_text())


def _csv_status(out):
    with open(Path(out) / "results.csv") as f:
        return {r["status"] for r in csv.DictReader(f)}


def test_default_output_dir_is_ignored_by_git():
    assert FLAGS["output_dir"].default == "runs/eval"
    assert "/runs/" in (ROOT / ".gitignore").read_text().split()


def test_existing_output_is_refused_before_the_model_loads(monkeypatch, tmp_path):
    stubs = Stubs(monkeypatch)
    full = tmp_path / "full"
    full.mkdir()
    (full / "results.json").write_text("{}")
    with pytest.raises(ValueError, match=r"--output_dir '.*full' is not empty .*--resume .*--overwrite"):
        run_cli(full)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"--output_dir '.*a_file' is an existing file.*no flag deletes it"):
        run_cli(a_file)
    with pytest.raises(ValueError, match=r"--overwrite and --resume exclude each other"):
        run_cli(full, "--overwrite", "--resume")
    assert stubs.loads == 0 and (full / "results.json").read_text() == "{}"
    run_cli(tmp_path / "new")  # a missing or empty directory needs no flag
    (tmp_path / "empty").mkdir()
    run_cli(tmp_path / "empty")
    assert stubs.loads == 2
    with pytest.raises(ValueError, match=r"is an existing file"):  # no flag deletes an ordinary file
        run_cli(a_file, "--overwrite")
    assert a_file.read_text() == "x" and stubs.loads == 2
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if not os.access(ro, os.W_OK):  # (root can write anywhere: nothing to check then)
            with pytest.raises(ValueError, match=r"--output_dir '.*ro/x' cannot be written"):
                run_cli(ro / "x")
            assert stubs.loads == 2  # refused before the model loads, not after the first block
    finally:
        ro.chmod(0o755)


def test_overwrite_clears_old_results_and_keeps_other_files(monkeypatch, tmp_path):
    Stubs(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("fidelity_mass_by_layer.png", "examples.jsonl", ".results.json.abc.tmp"):
        (out / name).write_text("old")
    (out / "notes.txt").write_text("mine")
    run_cli(out, "--overwrite")
    assert not (out / "fidelity_mass_by_layer.png").exists()  # a plot of the old run would sit next to new numbers
    assert not (out / ".results.json.abc.tmp").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert len((out / "examples.jsonl").read_text().splitlines()) == 4


def test_interrupted_run_keeps_finished_strategies_and_resume_appends(monkeypatch, tmp_path):
    stubs = Stubs(monkeypatch)
    out = tmp_path / "out"
    stubs.stop = 2  # dense's one batch finishes, kascade's is interrupted
    with pytest.raises(KeyboardInterrupt):  # a sparse-prefill recipe (a decode_only one shares dense's prefill pass)
        run_cli(out, "--recipe=paper")
    data = _json(out)
    assert [r["strategy"] for r in data["rows"]] == ["dense"] and data["environment"]["partial"]
    assert _csv_status(out) == {"partial"} and "**partial**" in (out / "summary.md").read_text()
    assert len((out / "examples.jsonl").read_text().splitlines()) == 2
    assert data["spec"]["seed"] == 0 and data["spec"]["dtype"] == "float32"

    stubs.calls, stubs.stop = 0, None
    run_cli(out, "--resume", "--recipe=paper")
    assert stubs.calls == 1  # only kascade ran
    data2 = _json(out)
    assert [r["strategy"] for r in data2["rows"]] == ["dense", "kascade"]
    assert data2["rows"][0] == data["rows"][0] and "partial" not in data2["environment"]
    assert len(data2["resumed_from"]) == 1 and data2["resumed_from"][0]["partial"]
    recs = [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in recs] == ["dense"] * 2 + ["kascade"] * 2
    assert _csv_status(out) == {"complete"} and "partial" not in (out / "summary.md").read_text()
    assert (out / "score_vs_context.png").is_file()

    stubs.calls = 0  # a resume may add blocks (another context length); finished ones still do not rerun
    run_cli(out, "--resume", "--recipe=paper", "--context_lengths=600,640")
    assert stubs.calls == 2 and [r["context_length"] for r in _json(out)["rows"]] == [600, 600, 640, 640]
    stubs.calls = 0  # and change the performance knobs (batch, prefill chunk), which move results by rounding only
    run_cli(out, "--resume", "--recipe=paper", "--context_lengths=600,640,704", "--chunk_size=128", "--batch_size=3")
    assert stubs.calls == 2 and len(_json(out)["rows"]) == 6


def test_resume_of_several_recipes_goes_on(monkeypatch, tmp_path):
    # the variants are resolved with the model: the early check must not compare them (it once saw variants=[])
    stubs = Stubs(monkeypatch)
    out = tmp_path / "out"
    stubs.stop = 3  # dense and the first recipe finish, the second is interrupted
    with pytest.raises(KeyboardInterrupt):
        run_cli(out, "--recipe=paper,candidate:sw_ds128")  # sparse prefills: one pass each
    assert len(_json(out)["spec"]["variants"]) == 2 and len(_json(out)["rows"]) == 2
    stubs.calls, stubs.stop = 0, None
    run_cli(out, "--resume", "--recipe=paper,candidate:sw_ds128")
    assert stubs.calls == 1 and len(_json(out)["rows"]) == 3
    with pytest.raises(ValueError, match=r"was run with variants=.* but this run has variants="):
        run_cli(out, "--resume", "--recipe=paper,candidate:dps")  # the second recipe differs


@pytest.mark.parametrize("flag, field", [("--seed=1", "seed"), ("--num_samples=3", "num_samples"),
                                         ("--split=dev", "split"), ("--dtype=bfloat16", "dtype"),
                                         ("--model=other-model", "model")])
def test_resume_with_another_spec_is_refused(monkeypatch, tmp_path, flag, field):
    stubs = Stubs(monkeypatch)
    out = tmp_path / "out"
    run_cli(out)
    monkeypatch.setattr(cli, "resolve_recipes", lambda: [__import__("kascade_jax.recipes", fromlist=["x"]).load_recipe(
        "smollm2-135m", "default")])  # --model=other-model has no recipe to load; the spec check comes first anyway
    with pytest.raises(ValueError, match=rf"--resume: .* was run with {field}=.* but this run has {field}="):
        run_cli(out, "--resume", flag)
    assert stubs.loads == 1


def test_resume_refuses_results_without_a_spec(monkeypatch, tmp_path):
    Stubs(monkeypatch)
    out = tmp_path / "out"
    run_cli(out)
    data = _json(out)
    del data["spec"]
    (out / "results.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="without a run spec"):
        run_cli(out, "--resume")


def test_resume_refuses_other_anchors(monkeypatch, tmp_path):
    Stubs(monkeypatch)
    out = tmp_path / "out"
    run_cli(out)
    with pytest.raises(ValueError, match=r"was run with anchors=.* but this run has anchors=\[0, 2\]"):
        run_cli(out, "--resume", "--anchors=0,2")


def test_on_block_after_every_strategy_and_previous_blocks_are_skipped(monkeypatch):
    stubs = Stubs(monkeypatch)
    spec = suite.EvalSpec(tasks=("synthetic:niah_single_1",), context_lengths=(600,), num_samples=2,
                          strategies=("dense", "kascade"), max_new_tokens=8)
    seen = []
    rows, records, _ = suite.run(spec, _model(), TOK, progress=False,
                                 on_block=lambda r, rec, fid: seen.append((len(r), len(rec))))
    assert seen == [(1, 2), (2, 4)]
    # a record ahead of results.json (a write stopped between the files) is dropped, not duplicated
    stale = dict(records[-1], index=99)
    stubs.calls = 0
    got, got_records, _ = suite.run(spec, _model(), TOK, progress=False, previous=(rows[:1], records[:2] + [stale], {}))
    assert stubs.calls == 1 and got[0] == rows[0] and [r["strategy"] for r in got] == ["dense", "kascade"]
    assert [r["index"] for r in got_records] == [0, 1, 0, 1]


def _rows():
    res = [harness.ExampleResult("t", i, 1024, float(i % 2), "", [], 100, 5, 0.1) for i in range(4)]
    return [report.make_row(res, model="m", task="a", family="ruler", context_length=1024, strategy=s,
                            config="" if s == "dense" else "k=0.1", topk_frac=None if s == "dense" else 0.1)
            for s in ("dense", "kascade")]


ENV = dict(date="d", device="cpu", backend="cpu", jax="x", command="c")


def test_every_output_file_is_written_atomically(monkeypatch, tmp_path):
    targets, real = [], os.replace

    def spy(src, dst):
        assert os.path.dirname(src) == os.path.dirname(dst) and os.path.basename(src).endswith(".tmp")
        targets.append(dst)
        real(src, dst)

    monkeypatch.setattr(report.os, "replace", spy)
    fid = {"k @ 256": dict(strategy="kascade", config="k=0.1", documents=2, mass_ratio=[1.0, 0.9])}
    paths = report.write(_rows(), str(tmp_path), env=ENV, examples=[dict(a=1)], extra=dict(fidelity=fid))
    written = [paths["examples"], paths["csv"], paths["markdown"], *paths["plots"], paths["json"]]
    assert targets == written and len(paths["plots"]) == 3  # results.json last
    assert os.stat(paths["json"]).st_mode & 0o044  # readable beyond the owner, unlike mkstemp's default


def test_a_failed_write_keeps_the_old_file(monkeypatch, tmp_path):
    report.write(_rows(), str(tmp_path), env=ENV, plots=False)
    old = (tmp_path / "summary.md").read_text()

    def boom(*a, **kw):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "averages", boom)  # fails inside the markdown, mid-write
    with pytest.raises(RuntimeError, match="disk full"):
        report.write(_rows()[:1], str(tmp_path), env=ENV, plots=False)
    assert (tmp_path / "summary.md").read_text() == old
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_partial_is_marked_in_every_file(tmp_path):
    paths = report.write(_rows(), str(tmp_path), env=dict(ENV, partial=True), plots=False)
    assert json.load(open(paths["json"]))["environment"]["partial"] is True
    assert _csv_status(tmp_path) == {"partial"} and "**partial**" in open(paths["markdown"]).read()


def test_merge_replaces_only_an_earlier_merge_and_stays_partial(tmp_path):
    a, b, merged = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    report.write(_rows()[:1], str(a), env=ENV, plots=False)
    report.write(_rows()[1:], str(b), env=dict(ENV, partial=True), plots=False)
    merged.mkdir()
    (merged / "fidelity_mass_by_layer.png").write_text("stale")
    if not FLAGS.is_parsed():  # alone (pytest -k), no earlier test has parsed the flags
        FLAGS(["merge_eval"])
    with flagsaver.flagsaver(inputs=[str(a), str(b)], merged_dir=str(merged)):
        with pytest.raises(ValueError, match=r"--merged_dir '.*m' is not empty .*--overwrite"):
            merge_eval.main([])  # a folder that holds anything is replaced only when asked
        assert (merged / "fidelity_mass_by_layer.png").exists()
    with flagsaver.flagsaver(inputs=[str(a), str(b)], merged_dir=str(merged), overwrite=True):
        merge_eval.main([])
        assert _json(merged)["environment"]["partial"] and _csv_status(merged) == {"partial"}
        assert not (merged / "fidelity_mass_by_layer.png").exists()  # no stale plot beside the new numbers
        merge_eval.main([])  # an earlier merge is rebuilt
    before = (merged / "results.json").read_text()
    for name, text, message in (("bad", "{bad", r"bad/results.json is not valid JSON \(line 1"),
                                ("lst", "[]", r"lst/results.json is not an experiments.eval results file \(it holds "
                                              r"a JSON list"),
                                ("norows", "{}", r"norows/results.json holds no rows")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(text)
        with flagsaver.flagsaver(inputs=[str(a), str(tmp_path / name)], merged_dir=str(merged), overwrite=True):
            with pytest.raises(ValueError, match=message):  # named, and the earlier merge is left whole
                merge_eval.main([])
        assert (merged / "results.json").read_text() == before and (merged / "summary.md").exists()
    with flagsaver.flagsaver(inputs=[str(a)], merged_dir=str(b), overwrite=True):
        with pytest.raises(ValueError, match=r"--merged_dir '.*b' holds the results of an eval run"):
            merge_eval.main([])
    with flagsaver.flagsaver(inputs=[str(a)], merged_dir=str(a)):
        with pytest.raises(ValueError, match="is one of --inputs"):
            merge_eval.main([])
    assert _json(b)["rows"][0]["strategy"] == "kascade"


def test_decode_rerank_worst_reaches_every_recipe_of_the_eval(monkeypatch, tmp_path):
    # the eval once ran `candidate:dps_rr4w5` as plain dps_rr4 (every reuse layer reranked; H200 dev 2026-12-03:
    # identical predictions on all 260 prompts): its layers come from the calibration, as in the API
    import kascade_jax
    from tests.kascade_jax.kj_helpers import shipped_model

    import models

    seen = {}
    model = shipped_model("smollm2-135m")
    model.config.max_position_embeddings = 4096
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: (model, TOK))
    monkeypatch.setattr(models, "load_model_header", lambda *a, **kw: (HEADER, TOK))

    def generate(model, tokenizer, prompts, strategy, key, max_len, limits, **kw):
        seen[strategy.config.decode_rerank_layers] = strategy.config.decode_rerank
        return [types.SimpleNamespace(text="nope", prompt_tokens=len(p), new_tokens=3, finish_reason="eos")
                for p in prompts]

    monkeypatch.setattr(harness, "_generate", generate)
    api = kascade_jax.strategy_for(model, recipe="candidate:dps_rr4w5", calibrate=False, verbose=False).config
    assert len(api.decode_rerank_layers) == 5
    for recipes in ("candidate:dps_rr4w5", "candidate:dps_rr4,candidate:dps_rr4w5"):
        seen.clear()
        run_cli(tmp_path / recipes, "--model=smollm2-135m", "--anchors=auto", "--head_map=auto",
                "--strategies=kascade", f"--recipe={recipes}")
        assert seen[api.decode_rerank_layers] == 4
        assert seen == ({api.decode_rerank_layers: 4} if "," not in recipes else
                        {api.decode_rerank_layers: 4, None: 4})
        spec = _json(tmp_path / recipes)["spec"]
        assert [v["strategy_kwargs"][-1] for v in spec["variants"]][-1] == ["decode_rerank_layers",
                                                                             list(api.decode_rerank_layers)]


def test_eval_kascade_is_the_apis_for_every_shipped_model_and_recipe(monkeypatch, tmp_path):
    """experiments.eval builds its Kascade through its own flags (anchors, head map, recipe levers, variants): for
    every shipped model and recipe it is kascade_jax.strategy_for's (the reference kernels, eval's default), as
    tests/kascade_jax/test_api.py shows for generate's / speed's."""
    import kascade_jax
    from tests.kascade_jax.kj_helpers import shipped_model, strategy_record
    from tests.kascade_jax.test_api import RECIPES, SHIPPED

    import models

    seen = []

    def generate(model, tokenizer, prompts, strategy, key, max_len, limits, **kw):
        if strategy.name == "kascade":
            seen.append(strategy_record(strategy))
        return [types.SimpleNamespace(text="nope", prompt_tokens=len(p), new_tokens=3, finish_reason="eos")
                for p in prompts]

    monkeypatch.setattr(harness, "_generate", generate)
    monkeypatch.setattr(models, "load_model_header", lambda *a, **kw: (HEADER, TOK))
    for m in SHIPPED:
        model = shipped_model(m)
        model.config.max_position_embeddings = 4096
        monkeypatch.setattr(models, "load_model", lambda *a, model=model, **kw: (model, TOK))
        for recipe in RECIPES:
            seen.clear()
            run_cli(tmp_path / f"{m}-{recipe}", f"--model={m}", "--anchors=auto", "--strategies=kascade",
                    f"--recipe={recipe}")
            api = kascade_jax.strategy_for(model, recipe=recipe, kernels="reference", calibrate=False, verbose=False)
            assert seen and all(s == strategy_record(api) for s in seen), (m, recipe, seen[:1], strategy_record(api))
