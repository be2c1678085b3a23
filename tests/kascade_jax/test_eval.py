"""Harness plumbing (stub generator), reporting, suite spec, the CLI, and one real-SmolLM2 end-to-end run."""

import csv
import dataclasses
import importlib.util
import json
import os
import types

import numpy as np
import pytest

from kascade_jax.eval import harness, report, sections, suite
from tests.kascade_jax.kj_helpers import FakeTokenizer


TOK = FakeTokenizer()


class StubModel:
    config = types.SimpleNamespace(max_position_embeddings=4096, num_layers=2, kv_heads=1)


def _samples(n=5):
    return [dict(task="t", index=i, context_length=100, input=f"prompt number {i} " * (i + 1), answers=[f"ans{i}"],
                 metric="string_match_all", max_new_tokens=4) for i in range(n)]


def make_stub(fail_on=(), calls=None):
    """Echo the answer for even indices, a wrong one for odd; raise when a prompt of index in fail_on is batched."""
    def gen(model, tokenizer, prompts, strategy, key, max_len, limits, **kw):  # kw: chunk_size, timings
        if calls is not None:
            calls.append((len(prompts), key, max_len, tuple(limits)))
        outs = []
        for p in prompts:
            i = (len(p) // 3) - 1  # FakeTokenizer: 3 tokens per repetition
            if i in fail_on:
                raise RuntimeError(f"boom {i}")
            outs.append(types.SimpleNamespace(text=f"ans{i}" if i % 2 == 0 else "nope", prompt_tokens=len(p),
                                              new_tokens=3, finish_reason="eos"))
        return outs
    return gen


def test_run_samples_scores_in_order_with_fixed_batch_shape():
    calls = []
    res = harness.run_samples(StubModel(), TOK, _samples(5), "S", batch_size=2, progress=False,
                              generate_fn=make_stub(calls=calls))
    assert [r.index for r in res] == [0, 1, 2, 3, 4]
    assert [r.score for r in res] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert all(c[0] == 2 for c in calls)  # last batch padded to batch_size
    assert {c[2] for c in calls} == {128}  # one cache length: the context length (100) rounded up to 64
    assert not any(r.failed for r in res)


def test_failures_are_counted_not_dropped():
    res = harness.run_samples(StubModel(), TOK, _samples(5), "S", batch_size=2, progress=False,
                              generate_fn=make_stub(fail_on=(2,)))
    assert len(res) == 5
    failed = [r for r in res if r.failed]
    assert [r.index for r in failed] == [2] and "boom 2" in failed[0].error and failed[0].score == 0.0
    assert res[3].score == 0.0 and res[4].score == 1.0  # the batch-mate of the failure was retried alone
    row = report.make_row(res, model="m", task="t", family="ruler", context_length=100, strategy="S")
    assert row["examples"] == 5 and row["failures"] == 1
    assert row["score"] == pytest.approx(40.0) and row["score_ok"] == pytest.approx(50.0)


def test_metric_errors_are_failures():
    s = _samples(1)
    s[0]["metric"] = "no_such_metric"
    (r,) = harness.run_samples(StubModel(), TOK, s, "S", progress=False, generate_fn=make_stub())
    assert r.failed and "unknown metric" in r.error


def test_grouping_by_sampling_settings_with_per_row_limits():
    s = _samples(4)
    s[1]["max_new_tokens"] = 8
    s[3].update(temperature=0.6, top_p=0.95, sample_seed=3)
    calls = []
    harness.run_samples(StubModel(), TOK, s, "S", batch_size=4, progress=False, generate_fn=make_stub(calls=calls))
    by_key = {c[1]: c for c in calls}
    assert len(calls) == 2 and set(by_key) == {(0.0, 1.0, 0, ()), (0.6, 0.95, 3, ())}
    # answer lengths 4 and 8 share one batch, sorted by limit, each row with its own limit
    assert by_key[(0.0, 1.0, 0, ())][3] == (4, 4, 8) and by_key[(0.6, 0.95, 3, ())][3] == (4,)


@pytest.mark.parametrize("n,batch,size", [(325, 32, 30), (5, 2, 2), (64, 32, 32), (1, 8, 1), (33, 32, 17)])
def test_balanced_batches_pad_less_than_one_row_per_batch(n, batch, size):
    assert harness.balanced_batch(n, batch) == size
    calls, stats = [], {}
    s = [dict(x, index=i) for i, x in enumerate(_samples(1) * n)]
    harness.run_samples(StubModel(), TOK, s, "S", batch_size=batch, progress=False, generate_fn=make_stub(calls=calls),
                        stats=stats)
    batches = -(-n // batch)
    assert len(calls) == batches and {c[0] for c in calls} == {size}
    assert stats["padded_rows"] == size * batches - n < batches and stats["prompts"] == n
    assert stats["batch_sizes"] == [size] and stats["prompts_per_s"] > 0 and stats["first_batch_s"] >= 0
    assert batches == 1 or stats["warm_prompts_per_s"] > 0
    assert calls[-1][3][len(calls[-1][3]) - stats["padded_rows"]:] == (1,) * stats["padded_rows"]  # pad rows: 1 token


def test_first_line_scoring():
    s = dict(metric="qa_f1", answers=["Paris"], first_line=True)
    assert harness.score_prediction(s, "\nParis\nLondon Berlin") == 1.0


def test_batch_size_error():
    with pytest.raises(ValueError, match="batch_size"):
        harness.run_samples(StubModel(), TOK, _samples(1), "S", batch_size=0, generate_fn=make_stub())


def test_confidence_intervals(rng):  # the seeded per-test generator (conftest)
    lo, hi = report.wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert report.wilson(0, 10)[0] == 0.0 and report.wilson(10, 10)[1] == 1.0
    x = rng.uniform(0, 1, 400)
    lo, hi = report.confidence_interval(x)
    se = x.std() / np.sqrt(x.size)
    assert lo < x.mean() < hi and hi - lo == pytest.approx(2 * 1.96 * se, rel=0.2)
    assert np.isnan(report.confidence_interval([])[0])


def _rows():
    rows = []
    for strat, frac in (("dense", None), ("kascade", 0.1), ("kascade", 0.2)):
        for ctx in (1024, 2048):
            for task in ("a", "b"):
                res = [harness.ExampleResult("t", i, ctx, float(i % 2), "", [], 100, 5, 0.1) for i in range(4)]
                rows.append(report.make_row(res, model="m", task=task, family="ruler", context_length=ctx,
                                            strategy=strat, config="" if frac is None else f"k={frac}",
                                            topk_frac=frac))
    return rows


def test_report_files(tmp_path):
    rows = _rows()
    paths = report.write(rows, str(tmp_path), env=dict(date="d", device="cpu", backend="cpu", jax="x", command="c"),
                         examples=[dict(a=1)], extra_sections=["## extra"])
    with open(paths["csv"]) as f:
        got = list(csv.DictReader(f))
    assert len(got) == 12 and set(report.ROW_FIELDS) | {"status"} == set(got[0])
    assert {g["status"] for g in got} == {"complete"}
    data = json.load(open(paths["json"]))
    assert len(data["rows"]) == 12 and len(data["averages"]) == 6
    assert [json.loads(line) for line in open(paths["examples"])] == [dict(a=1)]
    md = open(paths["markdown"]).read()
    assert "| a | 1024 | dense |" in md and "## extra" in md and "Average over tasks" in md
    for p in paths["plots"]:
        assert os.path.getsize(p) > 1000
    assert "kascade" in report.text_table(rows)


def test_expand_tasks_and_spec_errors():
    assert suite.expand_tasks(["synthetic"])[:1] == ["synthetic:niah_single_1"]
    assert len(suite.expand_tasks(["synthetic"])) == 11
    assert suite.expand_tasks(["longbench:trec", "hotpotqa", "aime24", "fidelity", "synthetic:vt", "synthetic:vt"]) == [
        "trec", "hotpotqa", "aime24", "fidelity", "synthetic:vt"]
    with pytest.raises(ValueError, match="unknown task"):
        suite.expand_tasks(["mmlu"])
    # an answers block is one per context length, like fidelity: a resume finds it finished by its length
    assert suite.block_key(dict(task="answers", context_length=4096, strategy="kascade", config="c")) == (
        "answers", 4096, "kascade", "c")
    for kw, msg in ((dict(num_samples=0), "num_samples"), (dict(batch_size=0), "batch_size"),
                    (dict(context_lengths=(10,)), "context_lengths"), (dict(topk_fracs=(0.0,)), "topk_fracs"),
                    (dict(max_new_tokens=0), "max_new_tokens"), (dict(split="train"), "split"),
                    (dict(strategies=()), "strategies"), (dict(tasks=()), "tasks"), (dict(kernels="cuda"), "kernels"),
                    (dict(prefill_chunk=100), "prefill_chunk")):
        with pytest.raises(ValueError, match=msg):
            suite.EvalSpec(**kw)


def test_check_context_lengths_names_the_most_demanding_task():
    """The shortest context against every generated task's smallest prompt (experiments.eval, before the model
    loads): the error names the task with the largest minimum of those that do not fit; other families are skipped."""
    from kascade_jax.tasks import ruler, synthetic

    spec = suite.EvalSpec(tasks=("synthetic:niah_single_1", "synthetic:cwe", "synthetic:vt", "fidelity", "trec"),
                          context_lengths=(4096, 300), max_new_tokens=8)
    assert suite.sized_tasks(spec) == ["synthetic:niah_single_1", "synthetic:cwe", "synthetic:vt"]
    need = synthetic.min_context_length("cwe", TOK, 300, 8)
    assert need > synthetic.min_context_length("vt", TOK, 300, 8) > 300
    with pytest.raises(ValueError, match=rf"^--ctx=300 is too small for synthetic:cwe \(the most demanding of 2 tasks "
                                         rf"that do not fit\) with max_new_tokens=8: its smallest prompt has "
                                         rf"{need - 8} tokens, so --ctx must be >= {need}$"):
        suite.check_context_lengths(spec, TOK, "--ctx")
    suite.check_context_lengths(dataclasses.replace(spec, context_lengths=(4096,)), TOK)
    if importlib.util.find_spec("long_context_eval"):  # `answers` runs the 13 RULER tasks' prompts
        assert suite.sized_tasks(suite.EvalSpec(tasks=("answers", "vt"))) == ["vt"] + [
            t for t in ruler.TASKS if t != "vt"]


def test_build_strategies_configs():
    spec = suite.EvalSpec(strategies=("dense", "kascade", "quest", "streaming_llm", "oracle_topk"),
                          topk_fracs=(0.1, 0.2), anchors=(0, 3, 6))
    runs = suite.build_strategies(spec, num_layers=8, kv_heads=2)
    labels = [(r.label, r.topk_frac) for r in runs]
    assert labels == [("dense", None), ("kascade", 0.1), ("kascade", 0.2), ("quest", 0.1), ("quest", 0.2),
                      ("streaming_llm", None), ("oracle_topk", 0.1), ("oracle_topk", 0.2)]
    assert runs[1].anchors == "0,3,6" and runs[1].strategy.config.topk_frac == 0.1
    assert runs[3].strategy.budget_frac == 0.1 and runs[6].anchors == ""
    assert runs[1].strategy.kernels == "reference"
    pallas = suite.build_strategies(dataclasses.replace(spec, kernels="pallas"), num_layers=8, kv_heads=2)
    assert [r.strategy.kernels for r in pallas if r.label in ("kascade", "oracle_topk")] == ["pallas"] * 4
    for r in runs:
        hash(r.strategy)


def test_run_with_stub_generation(monkeypatch, tmp_path):
    """suite.run end to end with a stub model: rows per (task, ctx, strategy), records, no crash."""
    monkeypatch.setattr(harness, "_generate", make_stub())
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096, num_layers=4, kv_heads=1))
    spec = suite.EvalSpec(tasks=("synthetic:niah_single_1",), context_lengths=(600, 800), num_samples=2,
                          strategies=("dense", "kascade"), max_new_tokens=8)
    rows, records, fid = suite.run(spec, model, TOK, progress=False)
    assert [(r["context_length"], r["strategy"]) for r in rows] == [(600, "dense"), (600, "kascade"),
                                                                    (800, "dense"), (800, "kascade")]
    assert len(records) == 8 and all(r["examples"] == 2 for r in rows) and fid == {}


def test_batch_tokens_and_block_checkpoints(monkeypatch):
    """--batch_tokens sizes batches per context length; on_block sees the rows of every finished block."""
    calls = []
    stub = make_stub()

    def spy(model, tok, prompts, strategy, key, max_len, limits, **kw):
        calls.append(len(prompts))
        return stub(model, tok, prompts, strategy, key, max_len, limits)

    monkeypatch.setattr(harness, "_generate", spy)
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096, num_layers=4, kv_heads=1))
    spec = suite.EvalSpec(tasks=("synthetic:niah_single_1", "synthetic:vt"), context_lengths=(600, 1200), num_samples=3,
                          strategies=("dense",), max_new_tokens=8, batch_tokens=1300)
    assert (spec.batch_for(600), spec.batch_for(1200), spec.batch_for(5000)) == (2, 1, 1)
    seen = []
    rows, _, _ = suite.run(spec, model, TOK, progress=False, on_block=lambda r, rec, fid: seen.append(len(r)))
    assert seen == [2, 4] and len(rows) == 4  # one pooled block per context length: both tasks batched together
    assert sorted(set(calls)) == [1, 2]  # batches of 2 at 600 tokens, 1 at 1200
    with pytest.raises(ValueError, match="batch_tokens"):
        suite.EvalSpec(batch_tokens=0)


def test_fidelity_plot(tmp_path):
    rng = np.random.default_rng(0)
    fid = {"k @ 256": dict(strategy="kascade", config="k=0.1", documents=2, mass_ratio=list(rng.uniform(0.8, 1, 6)),
                           mass_ratio_heads=rng.uniform(0.8, 1, (6, 3)).tolist())}
    paths = report.plot_fidelity(fid, str(tmp_path))
    assert len(paths) == 1 and os.path.getsize(paths[0]) > 5000
    fid["k @ 256"].update(config="k=0.1 anchors=0,2,4", failures=1, decode_mass_ratio=list(rng.uniform(0.7, 1, 6)))
    plain = os.path.getsize(paths[0])
    paths = report.plot_fidelity(fid, str(tmp_path))  # decode mass dashed, anchors marked
    assert len(paths) == 1 and os.path.getsize(paths[0]) != plain
    assert report.plot_fidelity({"d": dict(strategy="dense", mass_ratio=None)}, str(tmp_path)) == []
    answers = {"k @ 256 answers": dict(task="answers", strategy="kascade", config="k=0.1", prompts=3, mass_ratio=None,
                                       decode_mass_ratio=list(rng.uniform(0.7, 1, 6)),
                                       decode_mass_ratio_heads=rng.uniform(0.7, 1, (6, 3)).tolist())}
    assert len(report.plot_fidelity(answers, str(tmp_path))) == 1  # decode only: its line and its heatmap


def test_pivot_and_merge(tmp_path):
    from experiments import merge_eval

    rows = _rows()
    pivot = report.pivot_markdown(rows)
    assert pivot.splitlines()[0].startswith("| strategy | config | avg 1024 | avg 2048 |")
    assert "| kascade | k=0.1 | **50.0** (+0.0) |" in pivot
    env = dict(date="d", device="cpu", backend="cpu", jax="x", command="c")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    report.write(rows[:4], a, env=env, examples=[dict(strategy="dense", x=1)], plots=False)
    report.write(rows[4:8], b, env=dict(env, partial=True), examples=[dict(strategy="kascade", x=2)], plots=False)
    got, records, fid, envs = merge_eval.merge([a, b], {b: "kascade_even"})
    assert [r["strategy"] for r in got] == ["dense"] * 4 + ["kascade_even"] * 4
    assert [r["strategy"] for r in records] == ["dense", "kascade_even"] and envs[1]["partial"]
    with pytest.raises(ValueError, match="results.json"):
        merge_eval.merge([str(tmp_path / "missing")], {})


# ----------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_end_to_end_real_smollm2(tmp_path, smollm2):
    """1 sample, ~300-token prompt, dense vs kascade, 8 new tokens, through the CLI's library path (the model as the
    CLI loads it: load_model("smollm2-135m"), float32, shared with the other real-model tests by the session fixture)."""
    model, tok = smollm2
    spec = suite.EvalSpec(tasks=("synthetic:niah_single_1",), context_lengths=(320,), num_samples=1, batch_size=1,
                          strategies=("dense", "kascade"), max_new_tokens=8, strategy_kwargs=(("min_k", 16),))
    rows, records, _ = suite.run(spec, model, tok, progress=False)
    assert [r["strategy"] for r in rows] == ["dense", "kascade"]
    for r in rows:
        assert r["examples"] == 1 and r["failures"] == 0, records
        assert 250 < r["prefill_tokens"] <= 312 and 1 <= r["decode_tokens"] <= 8
    assert all(rec["prediction"] for rec in records)
    paths = report.write(rows, str(tmp_path), env=report.environment(["test"]), examples=records, plots=False)
    assert os.path.exists(paths["csv"])


# ----------------------------------------------------------------------------- fidelity
def test_layer_mass_matches_numpy(rng):
    import jax.numpy as jnp
    from kj_helpers import prefill_inputs, random_layer

    from kascade_jax.config import KascadeConfig
    from kascade_jax.eval import fidelity

    b, max_len, hq, kvh, d, ts = 2, 96, 4, 2, 8, 16
    qkv = random_layer(rng, b, max_len, hq, kvh, d)
    inputs = prefill_inputs(qkv, 64, 32, [96, 90])
    cfg = KascadeConfig(num_layers=2, kv_heads=kvh, anchors=(0,), tile_size=ts, min_k=4, topk_frac=0.25,
                        head_map=((0, 1), (1, 0)))
    k_max, tiles = 24, 2
    idx = np.full((b, kvh, tiles, k_max), -1, np.int32)
    counts = rng.integers(1, 20, size=(b, tiles)).astype(np.int32)
    for bb in range(b):
        for h in range(kvh):
            for t in range(tiles):
                start = 64 + t * ts
                idx[bb, h, t, :counts[bb, t]] = rng.choice(start, size=counts[bb, t], replace=False)
    prev = {"idx": jnp.asarray(idx), "counts": jnp.asarray(counts)}
    got = np.asarray(fidelity._layer_mass(cfg, 1, inputs, prev, prev))
    # brute force
    q, k = np.asarray(inputs.q, np.float64), np.asarray(qkv[1], np.float64)
    kv_len = np.asarray(inputs.kv_len)
    sel_all, orc_all = [[] for _ in range(kvh)], [[] for _ in range(kvh)]
    for bb in range(b):
        for h in range(hq):
            kh = h // (hq // kvh)
            src = cfg.head_map_row(1)[kh]
            for r in range(32):
                p = 64 + r
                if p >= kv_len[bb]:  # padding rows of the shorter prompt are excluded
                    continue
                logits = k[bb, :p + 1, kh] @ q[bb, r, h] / np.sqrt(d)
                probs = np.exp(logits - logits.max())
                probs /= probs.sum()
                t = r // ts
                ts0 = 64 + t * ts
                chosen = [j for j in idx[bb, src, t] if j >= 0]
                diag = probs[ts0:].sum()
                sel_all[kh].append(probs[chosen].sum() + diag)
                orc_all[kh].append(np.sort(probs[:ts0])[::-1][:counts[bb, t]].sum() + diag)
    np.testing.assert_allclose(got, [[np.mean(x) for x in sel_all], [np.mean(x) for x in orc_all]], rtol=1e-4)
    assert np.all(got[0] <= got[1] + 1e-6)


def test_fidelity_on_tiny_model(tiny_model, rng):
    from kascade_jax.eval import fidelity
    from kascade_jax.registry import make_strategy

    cfg = tiny_model.config
    doc = rng.integers(0, cfg.vocab, size=200).tolist()  # 192 prefill tokens (the last 64 probed), 8 decode steps
    kw = dict(tile_size=16, min_k=4)
    strategies = {
        "full": make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=1.0, anchors=(0, 2), **kw),
        "kascade": make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=0.05, anchors=(0, 2), **kw),
    }
    res = fidelity.evaluate_fidelity(tiny_model, [doc], strategies, progress=False)
    assert all(r["failures"] == 0 for r in res.values()), {k: r["errors"] for k, r in res.items()}
    full = res["full"]
    assert full["kl"] < 1e-5 and full["top1"] == 1.0
    np.testing.assert_allclose(full["mass_ratio"], 1.0, atol=1e-5)
    np.testing.assert_allclose(full["decode_mass_ratio"], 1.0, atol=1e-5)  # every key selected in decode too
    sparse = res["kascade"]
    assert len(sparse["decode_mass_ratio"]) == cfg.num_layers and sparse["decode_mass_ratio"][0] == 1.0
    assert all(0.0 < r <= 1.0 + 1e-5 for r in sparse["decode_mass_ratio"])
    assert min(sparse["decode_mass_ratio"][1:]) < 1.0  # reuse layers with 5% of the keys lose some mass
    for name in ("kascade",):
        ratio = np.asarray(res[name]["mass_ratio"])
        assert ratio.shape == (cfg.num_layers,) and np.all(ratio <= 1 + 1e-5) and np.all(ratio > 0)
        assert ratio[0] == 1.0  # layer 0 is dense
        assert np.asarray(res[name]["mass_ratio_heads"]).shape == (cfg.num_layers, cfg.kv_heads)
        assert res[name]["kl"] > 0
    assert not fidelity.supports_mass(make_strategy("streaming_llm", cfg.num_layers, cfg.kv_heads))


def test_fidelity_one_pass_equals_whole_prefill_and_counts_failures(tiny_model, rng):
    """The chunked lockstep pass gives the KL of two whole teacher-forced prefills; a strategy that fails is counted
    and the others go on; one log line per document."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from kascade_jax.eval import fidelity
    from kascade_jax.registry import make_strategy
    from models import generate as gen
    from models.attention import DenseStrategy
    from models.cache import KVCache

    @dataclasses.dataclass(frozen=True)
    class Broken:
        name: str = "broken"

        def attend(self, layer, inputs, state):
            raise RuntimeError("planted failure")

        def post_attention(self, layer, x, attn_out, state):
            return state

    cfg = tiny_model.config
    docs = [rng.integers(0, cfg.vocab, size=264).tolist() for _ in range(2)]  # 256 prefill tokens + 8
    sparse = make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=0.05, anchors=(0, 2), tile_size=16,
                           min_k=4)
    lines = []
    res = fidelity.evaluate_fidelity(tiny_model, docs, {"kascade": sparse, "broken": Broken()}, progress=False,
                                     log=lines.append)
    assert res["broken"]["failures"] == 2 and "planted failure" in res["broken"]["errors"][0]
    assert res["kascade"]["failures"] == 0 and len(lines) == 2 and "1 of 2 strategies failed" in lines[0]

    def logits(doc, strategy):
        cache = KVCache.init(cfg, 1, 320, dtype=tiny_model.dtype)
        out, _ = gen.prefill(tiny_model, np.asarray(doc[:256])[None], np.array([256]), cache, strategy,
                             all_logits=True)
        return jax.nn.log_softmax(out[0].astype(jnp.float32), -1)

    want = []
    for doc in docs:
        ld, lo = logits(doc, DenseStrategy()), logits(doc, sparse)
        want.append(float(jnp.mean(jnp.sum(jnp.exp(ld) * (ld - lo), -1))))
    np.testing.assert_allclose(res["kascade"]["kl_per_doc"], want, rtol=1e-4, atol=1e-7)


def test_prose_documents_and_errors():
    from kascade_jax.eval import fidelity

    docs = fidelity.prose_documents(TOK, 3, 256)
    assert [len(d) for d in docs] == [256 + fidelity.DECODE_STEPS] * 3 and docs[0] != docs[1]
    assert docs == fidelity.prose_documents(TOK, 3, 256)
    assert fidelity.prose_documents(TOK, 1, 256, split="dev")[0] != docs[0]
    with pytest.raises(ValueError, match="multiple of 64"):
        fidelity.prose_documents(TOK, 1, 200)


def test_cli_helpers():
    from experiments import eval as cli

    assert cli.even_anchors(30, 5) == (0, 6, 12, 18, 24)
    with pytest.raises(ValueError, match="num_anchors"):
        cli.even_anchors(30, 0)
    fid = {"x": dict(strategy="kascade", config="k=0.1", context_length=256, documents=2, failures=0, kl=0.1,
                     top1=0.9, kl_late=0.2, mass_ratio=[1.0, 0.8, 0.9],
                     mass_ratio_heads=[[1.0, 1.0], [0.7, 0.9], [0.9, 0.9]])}
    text = sections.fidelity_section(fid)
    assert "| kascade | k=0.1 | 256 | 2 | 0 | 0.1000 | 90.0 | 0.2000 | 0.900 | L1: 0.800 | L1 H0: 0.700 | - | - |" in text
    fid["x"].update(decode_mass_ratio=[1.0, 0.6, 0.9])
    assert "| L1 H0: 0.700 | 0.833 | L1: 0.600 |" in sections.fidelity_section(fid)
    failed = {"y": dict(strategy="kascade", config="k=0.1", context_length=256, documents=2, failures=2,
                        kl=float("nan"), top1=float("nan"), kl_late=float("nan"), errors=["JaxRuntimeError: OOM"])}
    text = sections.fidelity_section(failed)  # every document failed: dashes and the first error, never "nan"
    assert "| 2 | 2 | - | - | - |" in text and "2 failed documents, first: JaxRuntimeError: OOM" in text
    assert "nan" not in text
    ans = dict(task="answers", strategy="kascade", config="k=0.1", context_length=256, prompts=13, failures=0, steps=64,
               agree=0.9712, first_agree=1.0, reproduced=0.8, kl=0.0123, decode_mass_ratio=[1.0, 0.6, 0.9])
    text = sections.fidelity_section({"z @ 256 answers": ans})  # answers alone: their table only
    assert "teacher forcing on prose" not in text and "along dense's answers" in text
    assert "| kascade | k=0.1 | 256 | 13 | 0 | 64 | 97.12 | 100.0 | 80.0 | 0.0123 | 0.833 | L1: 0.600 |" in text
    cut = sections.fidelity_section({"z @ 256 answers": dict(ans, prompts_done=4, state={})})
    assert "| 4 of 13 (cut; --resume goes on) | 0 | 64 |" in cut
    both = sections.fidelity_section({**fid, "z @ 256 answers": ans})
    assert both.index("teacher forcing on prose") < both.index("along dense's answers")
    rows = [dict(family="longbench", strategy="dense", config="", task=t, score=s)
            for t, s in (("hotpotqa", 40.0), ("musique", 20.0), ("trec", 50.0))]
    lb = sections.longbench_section(rows)
    assert "| dense |  | - | 30.0 | - | 50.0 | - | - |" in lb


def test_run_longbench_and_aime_with_stub(monkeypatch):
    fixtures = os.path.join(os.path.dirname(__file__), "..", "fixtures")
    calls = []
    monkeypatch.setattr(harness, "_generate", make_stub(calls=calls))
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=8192, num_layers=4, kv_heads=1))
    spec = suite.EvalSpec(tasks=("hotpotqa", "trec", "aime24"), context_lengths=(4096,), num_samples=2,
                          strategies=("dense",), longbench_dir=os.path.join(fixtures, "longbench"),
                          aime_path=os.path.join(fixtures, "aime24.jsonl"), aime_runs=3, max_new_tokens=16)
    rows, records, _ = suite.run(spec, model, TOK, progress=False)
    assert [(r["task"], r["family"], r["examples"]) for r in rows] == [
        ("hotpotqa", "longbench", 2), ("trec", "longbench", 2), ("aime24", "aime24", 6)]
    assert rows[0]["context_length"] == 4096 and rows[2]["context_length"] == 8192
    aime_keys = {c[1] for c in calls if c[1][0] == 0.6}  # (temperature, top_p, seed, stop)
    assert {k[2] for k in aime_keys} == {0, 1, 2} and all(k[1] == 0.95 for k in aime_keys)  # seeded runs


def test_variants_build_one_kascade_run_per_recipe():
    v1 = suite.Variant("recipe=a M=2", (0, 3), None, (("dense_suffix", 64),))
    v2 = suite.Variant("recipe=b M=3", (0, 2, 5), None, (("local_window", 32), ("prefill_topk_frac", 0.2)))
    spec = suite.EvalSpec(strategies=("dense", "kascade"), variants=(v1, v2))
    runs = suite.build_strategies(spec, num_layers=8, kv_heads=2)
    assert [r.label for r in runs] == ["dense", "kascade", "kascade"]
    a, b = runs[1].strategy.config, runs[2].strategy.config
    assert a.anchors == (0, 3) and a.dense_suffix == 64 and a.local_window == 0
    assert b.anchors == (0, 2, 5) and b.local_window == 32 and b.prefill_topk_frac == 0.2
    assert "recipe=a" in runs[1].config and "recipe=b" in runs[2].config
    assert "min_k" not in runs[1].config  # a run-level --min_k is named in the config (its cells are other cells)
    floor = suite.build_strategies(dataclasses.replace(spec, variants=(suite.Variant(
        "recipe=a M=2", (0, 3), None, (("dense_suffix", 64), ("min_k", 4915))),)), num_layers=8, kv_heads=2)
    assert floor[1].config.endswith("recipe=a M=2 min_k=4915") and floor[1].strategy.config.min_k == 4915
    with pytest.raises(ValueError, match="distinct recipe"):
        suite.EvalSpec(variants=(v1, v1))
    with pytest.raises(ValueError, match="sample_workers"):
        suite.EvalSpec(sample_workers=0)


def test_pooled_samples_in_worker_processes_do_not_depend_on_the_split_into_jobs():
    # (Against a serial build only outside pytest: pytest patches pdb/typing, whose docstrings feed the synthetic
    # prose, so the parent's prose differs from a fresh worker's; tests/kascade_jax/test_ruler.py compares RULER.)
    spec = suite.EvalSpec(tasks=("synthetic:niah_single_1", "synthetic:vt"), num_samples=5, max_new_tokens=8)
    logs = []
    two = suite.build_pooled_samples(dataclasses.replace(spec, sample_workers=2), TOK, list(spec.tasks), 400, 4096,
                                     log=logs.append)
    three = suite.build_pooled_samples(dataclasses.replace(spec, sample_workers=3), TOK, list(spec.tasks), 400, 4096)
    assert two == three and [len(v) for v in two.values()] == [5, 5] and "2 processes" in logs[0]
    assert [s["index"] for s in two["synthetic:vt"]] == list(range(5))

    class Unpicklable(type(TOK)):
        def __reduce__(self):
            raise TypeError("no pickling")

    logs.clear()
    local = suite.build_pooled_samples(dataclasses.replace(spec, sample_workers=2), Unpicklable(), list(spec.tasks),
                                       400, 4096, log=logs.append)
    assert [len(v) for v in local.values()] == [5, 5] and "cannot be pickled" in logs[0] and "1 process" in logs[1]


def test_pooled_run_mixes_tasks_in_one_batch_and_records_throughput(monkeypatch):
    calls = []
    monkeypatch.setattr(harness, "_generate", make_stub(calls=calls))
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096, num_layers=4, kv_heads=1))
    spec = suite.EvalSpec(tasks=("synthetic:niah_single_1", "synthetic:vt"), context_lengths=(600,), num_samples=2,
                          strategies=("dense",), batch_size=4)
    rows, _, _ = suite.run(spec, model, TOK, progress=False)
    assert len(calls) == 1 and calls[0][0] == 4  # both tasks' prompts in one batch of 4
    assert sorted(calls[0][3]) == sorted(calls[0][3]) and len(set(calls[0][3])) == 2  # their own answer lengths
    assert all(r["prompts_per_s"] > 0 and r["pass_prompts"] == 4 for r in rows)


def test_fidelity_resumes_after_a_cut_with_the_same_numbers():
    """A fidelity block cut after some documents keeps them (on_block saves after each document, JSON-able), and a
    resumed run goes on from there to the numbers of one uninterrupted run."""
    import json

    from conftest import tiny_config
    from models.params import random_model

    model = random_model(tiny_config(vocab_size=50_000, max_position_embeddings=512), seed=3)
    spec = suite.EvalSpec(tasks=("fidelity",), context_lengths=(256,), num_samples=3, strategies=("kascade",),
                          anchors=(0, 2), strategy_kwargs=(("tile_size", 16), ("min_k", 4)))
    full_rows, _, full = suite.run(spec, model, TOK, progress=False)

    class Cut(Exception):
        pass

    saved = []

    def save_then_cut(rows, records, fid):
        saved.append(json.loads(json.dumps(fid)))  # what results.json holds
        if next(iter(fid.values()))["documents_done"] == 2:
            raise Cut

    with pytest.raises(Cut):
        suite.run(spec, model, TOK, progress=False, on_block=save_then_cut)
    assert [next(iter(f.values()))["documents_done"] for f in saved] == [1, 2] and all(
        "state" in f for f in saved[-1].values())
    partial = next(iter(saved[-1].values()))
    from kascade_jax.eval import fidelity

    with pytest.raises(ValueError, match="one documents_done of 4 documents"):  # another document list: refused
        fidelity.evaluate_fidelity(model, [[0]] * 4, {"k": None}, prior={"k": partial}, progress=False)
    lines = []
    rows, _, fid = suite.run(spec, model, TOK, progress=False, previous=([], [], saved[-1]), log=lines.append)
    assert any("resuming after document 2/3" in x for x in lines)
    assert [x.split(" (")[0] for x in lines if x.startswith("fidelity: document")] == ["fidelity: document 3/3"]
    assert fid.keys() == full.keys() and [r["score"] for r in rows] == [r["score"] for r in full_rows]
    for key, f in fid.items():
        assert "state" not in f and f["documents_done"] == 3
        for name in ("kl_per_doc", "top1_per_doc", "mass_ratio", "decode_mass_ratio", "mass_ratio_heads"):
            np.testing.assert_allclose(f[name], full[key][name], rtol=1e-6, atol=1e-9)


def _greedy(model, prompts, strategy, steps, max_len):
    """Free-running greedy tokens [prompts, steps]: an independent statement of what `reproduced` claims."""
    from models import generate as gen
    from models.cache import KVCache

    lens = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lens.max())), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    logits, cache = gen.prefill(model, tokens, lens, KVCache.init(model.config, len(prompts), max_len,
                                                                   dtype=model.dtype), strategy)
    out = []
    for j in range(steps):
        out.append(np.argmax(np.asarray(logits), axis=-1).astype(np.int32))
        if j + 1 < steps:
            logits, cache = gen.decode_step(model, out[-1], cache, strategy)
    return np.stack(out, axis=1)


def test_answer_fidelity_on_tiny_model(tiny_model, rng):
    """Every key selected agrees with dense at every step and keeps all the decode mass; a sparse strategy's decode
    mass is measured per layer; per-task numbers follow the names given."""
    from kascade_jax.eval import fidelity
    from kascade_jax.registry import make_strategy

    cfg = tiny_model.config
    prompts = [rng.integers(0, cfg.vocab, size=n).tolist() for n in (100, 120, 90)]
    kw = dict(tile_size=16, min_k=4, anchors=(0, 2))
    strategies = {"full": make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=1.0, **kw),
                  "sparse": make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=0.05, **kw)}
    res = fidelity.evaluate_answers(tiny_model, prompts, strategies, eos=(), steps=4, batch=4, tasks=["a", "b", "a"],
                                    progress=False)
    full, sparse = res["full"], res["sparse"]
    assert full["failures"] == sparse["failures"] == 0 and full["prompts"] == 3
    assert full["agree"] == full["reproduced"] == full["first_agree"] == 1.0 and full["kl"] < 1e-5
    np.testing.assert_allclose(full["decode_mass_ratio"], 1.0, atol=1e-5)
    assert len(sparse["decode_mass_ratio"]) == cfg.num_layers and min(sparse["decode_mass_ratio"][1:]) < 1.0
    assert sparse["per_task"]["a"]["n"] == 2 and sparse["per_task"]["b"]["n"] == 1
    # the steps after dense's first end-of-sequence token do not count; the answer itself is unchanged
    from models.attention import DenseStrategy

    one = {"sparse": strategies["sparse"]}
    first = fidelity._answer_pass(tiny_model, prompts, DenseStrategy(), one, steps=4, eos=())
    eos = int(first["_answer"][0, 2])
    f = next(j for j, t in enumerate(first["_answer"][0]) if t == eos)
    again = fidelity._answer_pass(tiny_model, prompts, DenseStrategy(), one, steps=4, eos=(eos,))
    assert again["_valid"][0, :f + 1].all() and not again["_valid"][0, f + 1:].any()
    np.testing.assert_array_equal(again["_answer"], first["_answer"])


def test_answer_fidelity_resumes_after_a_cut_with_the_same_numbers(tiny_model, rng):
    """Cut after a batch (on_batch gets JSON-able partial results), resumed at another batch size: the numbers of
    one uninterrupted run; a prior over other steps is refused."""
    import json

    from kascade_jax.eval import fidelity
    from kascade_jax.registry import make_strategy

    cfg = tiny_model.config
    prompts = [rng.integers(0, cfg.vocab, size=100).tolist() for _ in range(4)]
    st = {"k": make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=0.05, tile_size=16, min_k=4,
                             anchors=(0, 2))}
    kw = dict(eos=(), steps=3, tasks=["a", "b", "a", "b"], progress=False)
    whole = fidelity.evaluate_answers(tiny_model, prompts, st, batch=4, **kw)["k"]

    class Cut(Exception):
        pass

    saved = []

    def save_then_cut(res):
        saved.append(json.loads(json.dumps(res)))
        raise Cut

    with pytest.raises(Cut):
        fidelity.evaluate_answers(tiny_model, prompts, st, batch=2, on_batch=save_then_cut, **kw)
    assert saved[0]["k"]["prompts_done"] == 2 and "state" in saved[0]["k"]
    with pytest.raises(ValueError, match="one prompts_done of 4 prompts and 5 steps"):
        fidelity.evaluate_answers(tiny_model, prompts, st, batch=2, prior=saved[0], **dict(kw, steps=5))
    resumed = fidelity.evaluate_answers(tiny_model, prompts, st, batch=2, prior=saved[0], **kw)["k"]
    assert resumed["prompts_done"] == 4 and "state" not in resumed and resumed["per_task"]["b"]["n"] == 2
    assert resumed["per_prompt"] == whole["per_prompt"] and len(whole["per_prompt"]["first_diff"]) == 4
    for key in ("agree", "first_agree", "reproduced", "kl"):
        np.testing.assert_allclose(resumed[key], whole[key], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(resumed["decode_mass_ratio"], whole["decode_mass_ratio"], rtol=1e-5)


def test_answer_fidelity_counts_what_greedy_decoding_would_write(smollm2):
    """On a real model, `reproduced` is exactly the share of prompts whose own greedy decode writes dense's answer,
    `first_agree` the share whose first token (from the prefill) does. The setting (prose, dense prefill, a sparse
    decode of 32 keys) reproduces some answers and not others, so a wrong teacher-forced token shows."""
    from kascade_jax.eval import fidelity
    from kascade_jax.registry import make_strategy
    from models.attention import DenseStrategy

    model, tokenizer = smollm2
    cfg = model.config
    prompts = [d[:n] for d, n in zip(fidelity.prose_documents(tokenizer, 6, 128), (100, 120, 90, 110, 105, 95))]
    sparse = make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=0.1, tile_size=16, min_k=32,
                           decode_only=True)
    steps = 5
    res = fidelity.evaluate_answers(model, prompts, {"s": sparse}, eos=(), steps=steps, batch=6, mass=False,
                                    progress=False)["s"]
    dense = _greedy(model, prompts, DenseStrategy(), steps, 128)
    mine = _greedy(model, prompts, sparse, steps, 128)
    assert res["failures"] == 0 and res["decode_mass_ratio"] is None
    assert 0.0 < res["reproduced"] == np.mean((dense == mine).all(axis=1)) < 1.0
    assert res["first_agree"] == np.mean(dense[:, 0] == mine[:, 0])
    assert 0.0 < res["agree"] < 1.0 and res["kl"] > 1e-3
    same = dense == mine  # per prompt, in the prompts' order: whether and where its own answer leaves dense's
    assert res["per_prompt"]["reproduced"] == same.all(axis=1).astype(int).tolist()
    assert res["per_prompt"]["first_diff"] == [int(np.argmin(s)) if not s.all() else -1 for s in same]
