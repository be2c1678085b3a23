"""One prefill shared by the dense-prefill strategies (models.generate.generate_shared_prefill, the eval's groups):
the same tokens as running each strategy alone, and only strategies whose prefill is dense may join."""

import types

import pytest

from kascade_jax.eval import harness, suite
from kascade_jax.registry import make_strategy
from models import generate as gen
from models.attention import DenseStrategy
from tests.kascade_jax.kj_helpers import FakeTokenizer


class Tok(FakeTokenizer):
    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


class ToyTokenizer:
    eos_token_ids = ()  # never stop early: fixed-length generations compare token by token

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _strategies(model):
    cfg = model.config
    kw = dict(anchors=(0, 2), topk_frac=0.1, min_k=8, tile_size=16)
    return [DenseStrategy(),
            make_strategy("decode_only", cfg.num_layers, cfg.kv_heads, **kw),
            make_strategy("quest", cfg.num_layers, cfg.kv_heads, budget_frac=0.1)]


def test_shared_prefill_gives_each_strategy_its_own_generation(rng):
    from conftest import tiny_config
    from models.params import random_model

    model = random_model(tiny_config(tie_word_embeddings=False), seed=1)  # untied: greedy tokens vary
    prompts = [rng.integers(5, 128, n).tolist() for n in (300, 170)]
    sts = _strategies(model)
    assert all(gen.prefill_is_dense(s) for s in sts)
    timings = [{} for _ in sts]
    shared = gen.generate_shared_prefill(model, ToyTokenizer(), prompts, sts, max_new_tokens=[12, 5],
                                         chat=False, timings=timings)
    alone = [gen.generate(model, ToyTokenizer(), prompts, s, max_new_tokens=[12, 5], chat=False) for s in sts]
    assert [[r.token_ids for r in rs] for rs in shared] == [[r.token_ids for r in rs] for rs in alone]
    assert len({tuple(alone[0][0].token_ids)}) == 1 and len(set(alone[0][0].token_ids)) > 3  # not a constant run
    assert len({t["prefill_s"] for t in timings}) == 1 and all(t["decode_steps"] == 12 for t in timings)


def test_only_dense_prefill_strategies_share(tiny_model):
    cfg = tiny_model.config
    sparse = make_strategy("kascade", cfg.num_layers, cfg.kv_heads, anchors=(0, 2), topk_frac=0.1, min_k=8,
                           tile_size=16)
    assert not gen.prefill_is_dense(sparse)
    with pytest.raises(ValueError, match=r"\['kascade'\] have no dense prefill"):
        gen.generate_shared_prefill(tiny_model, ToyTokenizer(), [[5, 6, 7]], [DenseStrategy(), sparse],
                                    max_new_tokens=2, chat=False)
    # alone, any strategy runs (generate is generate_shared_prefill with one strategy)
    (res,) = gen.generate_shared_prefill(tiny_model, ToyTokenizer(), [[5, 6, 7] * 40], [sparse], max_new_tokens=2,
                                         chat=False)
    assert len(res[0].token_ids) == 2


def test_groups_take_dense_prefill_runs_with_the_same_work():
    def run(name, dense):
        return suite.StrategyRun(name, "", None, "", types.SimpleNamespace(prefill_is_dense=dense))

    runs = [run("dense", True), run("kascade", False), run("dps", True), run("quest", True), run("late", True)]
    todo = [["a", "b"], ["a", "b"], ["a", "b"], [], ["b"]]
    groups = suite.prefill_groups(runs, todo, share=True)
    assert [[r.label for r in g] for g in groups] == [["dense", "dps"], ["kascade"], ["late"]]
    alone = suite.prefill_groups(runs, todo, share=False)
    assert [[r.label for r in g] for g in alone] == [["dense"], ["kascade"], ["dps"], ["late"]]


def test_eval_with_shared_prefill_equals_separate_runs():
    """suite.run on a real (random) model: dense, decode_only and quest share each batch's prefill and predict what
    they predict one at a time; the sparse-prefill kascade never joins the group."""
    from conftest import tiny_config
    from models.params import random_model

    model = random_model(tiny_config(vocab_size=50_000, max_position_embeddings=2048, tie_word_embeddings=False),
                         seed=3)
    tok = Tok()
    base = dict(tasks=("synthetic:niah_single_1", "synthetic:vt"), context_lengths=(512,), num_samples=2,
                strategies=("dense", "decode_only", "quest", "kascade"), batch_size=4, anchors=(0, 2),
                strategy_kwargs=(("tile_size", 16), ("min_k", 8)), max_new_tokens=6)
    out = {}
    for share in (True, False):
        rows, records, _ = suite.run(suite.EvalSpec(share_prefill=share, **base), model, tok, progress=False)
        out[share] = (rows, {(r["strategy"], r["task"], r["index"]): r["prediction"] for r in records})
    assert out[True][1] == out[False][1] and len(out[True][1]) == 4 * 2 * 2
    by = {s: [p for (st, _, _), p in sorted(out[False][1].items()) if st == s] for s in base["strategies"]}
    assert by["dense"] != by["decode_only"] and by["dense"] != by["quest"]  # a swap of results would show
    shared = {r["strategy"]: r["shared_prefill"] for r in out[True][0]}
    assert shared == {"dense": 3, "decode_only": 3, "quest": 3, "kascade": 1}
    assert {r["shared_prefill"] for r in out[False][0]} == {1}
    assert not any(r["failures"] for r in out[True][0] + out[False][0])
    assert all(r["prompts_per_s"] > 0 for r in out[True][0])


def test_a_failing_strategy_does_not_fail_its_group(monkeypatch):
    """A group's batch that raises retries each example, then each strategy alone: only the failing one's examples
    are failures."""
    def shared(*a, **k):
        raise RuntimeError("group boom")

    def alone(model, tokenizer, prompts, strategy, key, max_len, limits, **kw):
        if strategy == "bad":
            raise RuntimeError("bad strategy")
        return [types.SimpleNamespace(text="ans0", prompt_tokens=len(p), new_tokens=1, finish_reason="eos")
                for p in prompts]

    monkeypatch.setattr(harness, "_generate_shared", shared)
    monkeypatch.setattr(harness, "_generate", alone)
    samples = [dict(task="t", index=i, context_length=100, input=f"p {i}", answers=["ans0"],
                    metric="string_match_all", max_new_tokens=2) for i in range(3)]
    good, bad = harness.run_samples_shared(types.SimpleNamespace(config=None), FakeTokenizer(), samples,
                                           ["good", "bad"], batch_size=2, progress=False)
    assert [r.score for r in good] == [1.0] * 3 and not any(r.failed for r in good)
    assert all(r.failed and "bad strategy" in r.error for r in bad)
