"""Baselines against masks computed by hand (numpy loops) on small examples."""

import numpy as np
import pytest

from kascade_jax.baselines import LessIsMoreStrategy, OmniKVStrategy, QuestStrategy, StreamingLLMStrategy
from kascade_jax.registry import make_strategy
from kj_helpers import decode_inputs, dense_reference, prefill_inputs, random_layer, run_layers, valid_rows


def _np_masked_attention(q, k, v, allowed):
    """q [t, hq, d], k/v [keys, kvh, d], allowed [t, hq, keys] bool -> out [t, hq, d] (numpy, fp64)."""
    t, hq, d = q.shape
    g = hq // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    logits = np.einsum("thd,shd->ths", q, kk) / np.sqrt(d)
    logits = np.where(allowed, logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return np.einsum("ths,shd->thd", p, vv)


def _np(x):
    return np.asarray(x, np.float64)


@pytest.mark.parametrize("phase,score_elems", [("prefill", 1 << 27), ("prefill", 2 * 4 * 40 * 5), ("decode", 1 << 27)])
def test_streaming_llm_hand_mask(rng, phase, score_elems):
    """score_elems = 5 query rows per block: the prefill's 32 rows run in 7 blocks, the last one padded."""
    kvh, g, d, max_len, lens = 2, 2, 8, 40, [40, 27]
    strategy = StreamingLLMStrategy(sinks=2, window_frac=0.3, min_window=6, score_elems=score_elems)
    lay = random_layer(rng, 2, max_len, kvh * g, kvh, d)
    x = prefill_inputs(lay, 8, max_len - 8, lens) if phase == "prefill" else decode_inputs(lay, lens)
    out, _ = strategy.attend(0, x, None)
    for bi, n in enumerate(lens):
        window = min(max(int(0.3 * n), 6), n)  # seq_len = prompt length in prefill, kv_len in decode
        positions = range(8, n) if phase == "prefill" else [n - 1]
        allowed = np.zeros((len(positions), kvh * g, max_len), bool)
        for r, p in enumerate(positions):
            for j in range(p + 1):
                allowed[r, :, j] = j < 2 or j >= p + 1 - (window - 2)
        assert np.any(allowed[:, 0].sum(-1) < np.array(positions) + 1)  # the mask really drops keys
        q = _np(x.q[bi])[: len(positions)]
        want = _np_masked_attention(q, _np(x.k_cache[bi]), _np(x.v_cache[bi]), allowed)
        np.testing.assert_allclose(out[bi, : len(positions)], want, rtol=2e-5, atol=2e-5)


def test_quest_hand_mask(rng):
    kvh, g, d, max_len, lens = 2, 2, 8, 45, [45, 38]  # 45 = 11 full pages of 4 + 1 partial
    strategy = QuestStrategy(page_size=4, budget_frac=0.1, min_budget=12, min_pages=2, dense_layers=2)
    lay = random_layer(rng, 2, max_len, kvh * g, kvh, d)
    x = decode_inputs(lay, lens)
    out, _ = strategy.attend(2, x, None)
    for bi, n in enumerate(lens):
        q, k = _np(x.q[bi, 0]), _np(x.k_cache[bi])
        n_pages = -(-n // 4)
        n_sel = max(2, min(max(int(0.1 * n), 12), n) // 4)
        allowed = np.zeros((1, kvh * g, max_len), bool)
        for h in range(kvh * g):
            bounds = []
            for pg in range(n_pages):
                keys = k[pg * 4: min(n, pg * 4 + 4), h // g]  # valid keys of the page
                bounds.append(sum(max(q[h, c] * keys[:, c].min(), q[h, c] * keys[:, c].max()) for c in range(d)))
            for pg in np.argsort(-np.array(bounds), kind="stable")[:n_sel]:
                allowed[0, h, pg * 4: min(n, pg * 4 + 4)] = True
        assert allowed.sum() < kvh * g * n  # sparse
        want = _np_masked_attention(q[None], k, _np(x.v_cache[bi]), allowed)
        np.testing.assert_allclose(out[bi], want, rtol=2e-5, atol=2e-5)
    # dense layers and prefill are dense
    np.testing.assert_allclose(strategy.attend(1, x, None)[0], dense_reference(x), atol=1e-6)
    xp = prefill_inputs(lay, 0, max_len, lens)
    np.testing.assert_allclose(strategy.attend(3, xp, None)[0], dense_reference(xp), atol=1e-6)


def test_omnikv_hand_mask(rng):
    kvh, g, d, max_len, lens, num_layers = 2, 2, 8, 50, [50, 33], 7
    strategy = OmniKVStrategy(filter_layers=(1, 4), budget_frac=0.1, min_budget=8, dense_layers=1)
    layers = [random_layer(rng, 2, max_len, kvh * g, kvh, d) for _ in range(num_layers)]
    xs = [decode_inputs(lay, lens) for lay in layers]
    outs, _ = run_layers(strategy, xs)
    dense_layers = {0, 1, 2, 4, 5}
    for layer in range(num_layers):
        if layer in dense_layers:
            np.testing.assert_allclose(outs[layer], dense_reference(xs[layer]), rtol=1e-5, atol=1e-6)
            continue
        filt = 1 if layer < 4 else 4
        for bi, n in enumerate(lens):
            fq, fk = _np(xs[filt].q[bi, 0]), _np(xs[filt].k_cache[bi])
            logits = np.einsum("hd,shd->hs", fq, np.repeat(fk[:n], g, axis=1)) / np.sqrt(d)
            probs = np.exp(logits - logits.max(1, keepdims=True))
            probs /= probs.sum(1, keepdims=True)
            keep = np.argsort(-probs.max(axis=0), kind="stable")[: min(max(int(0.1 * n), 8), n)]
            allowed = np.zeros((1, kvh * g, max_len), bool)
            allowed[:, :, keep] = True
            x = xs[layer]
            want = _np_masked_attention(_np(x.q[bi]), _np(x.k_cache[bi]), _np(x.v_cache[bi]), allowed)
            np.testing.assert_allclose(outs[layer][bi], want, rtol=2e-5, atol=2e-5)


def test_less_is_more_hand_mask(rng):
    kvh, g, d, max_len, lens, num_layers = 2, 2, 8, 60, [60, 41], 5
    strategy = LessIsMoreStrategy(selection_layers=(1, 3), budget_frac=0.1, min_budget=16, recent_frac=0.25, sinks=2)
    layers = [random_layer(rng, 2, max_len, kvh * g, kvh, d) for _ in range(num_layers)]
    xs = [decode_inputs(lay, lens) for lay in layers]
    outs, _ = run_layers(strategy, xs)
    for layer in (0, 1, 3):
        np.testing.assert_allclose(outs[layer], dense_reference(xs[layer]), rtol=1e-5, atol=1e-6)
    for layer in (2, 4):
        sel_layer = layer - 1
        for bi, n in enumerate(lens):
            budget = min(max(int(0.1 * n), 16), n)  # 16
            recent = int(0.25 * budget) - 2  # 2 recent tokens besides the 2 sinks
            keep = set(range(2)) | set(range(n - recent, n))
            middle = list(range(2, n - recent))
            fq, fk = _np(xs[sel_layer].q[bi, 0]), _np(xs[sel_layer].k_cache[bi])
            logits = np.einsum("hd,shd->hs", fq, np.repeat(fk, g, axis=1))[:, middle]
            order = [[middle[i] for i in np.argsort(-logits[h], kind="stable")] for h in range(kvh * g)]
            chosen = []
            for r in range(len(middle)):  # rank-major union across heads
                for h in range(kvh * g):
                    if order[h][r] not in chosen and len(chosen) < budget - len(keep):
                        chosen.append(order[h][r])
            allowed = np.zeros((1, kvh * g, max_len), bool)
            allowed[:, :, sorted(keep | set(chosen))] = True
            assert allowed[0, 0].sum() == budget
            x = xs[layer]
            want = _np_masked_attention(_np(x.q[bi]), _np(x.k_cache[bi]), _np(x.v_cache[bi]), allowed)
            np.testing.assert_allclose(outs[layer][bi], want, rtol=2e-5, atol=2e-5)


def test_decode_only_baselines_prefill_dense_and_full_budget_dense(rng):
    kvh, g, d, max_len, lens, num_layers = 2, 3, 8, 40, [40, 17], 4
    layers = [random_layer(rng, 2, max_len, kvh * g, kvh, d) for _ in range(num_layers)]
    pre = [prefill_inputs(lay, 0, max_len, lens) for lay in layers]
    dec = [decode_inputs(lay, lens) for lay in layers]
    for name in ("dense", "quest", "omnikv", "less_is_more", "streaming_llm"):
        s = make_strategy(name, num_layers, kvh)  # paper defaults: budgets >= 128 > L, so everything is dense
        for xs in (pre, dec):
            outs, _ = run_layers(s, xs)
            for out, x in zip(outs, xs):
                want = dense_reference(x)
                if x.phase == "prefill":
                    out, want = valid_rows(out, 0, lens), valid_rows(want, 0, lens)
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_registry_and_bad_args():
    s = make_strategy("omnikv", 6, 2)
    assert s.filter_layers == (2,)  # (2, 8, 18) clipped to 6 layers
    assert make_strategy("less_is_more", 30, 3).selection_layers == (2, 13)
    assert make_strategy("less_is_more", 10, 3, selection_layers="1,4").selection_layers == (1, 4)
    k = make_strategy("kascade", 30, 3, anchors="0,4,12,20", topk_frac=0.2, min_k=None)
    assert k.config.anchors == (0, 4, 12, 20) and k.config.topk_frac == 0.2 and k.config.min_k == 128
    assert make_strategy("kascade", 30, 3).config.anchors == (0, 2, 8, 12, 13)
    assert make_strategy("oracle_topk", 30, 3).config.oracle_topk
    with pytest.raises(ValueError, match="unknown strategy 'h2o'"):
        make_strategy("h2o", 4, 2)
    with pytest.raises(ValueError, match=r"does not take \['anchors'\]"):
        make_strategy("quest", 4, 2, anchors="0,1")
    with pytest.raises(ValueError, match="comma-separated"):
        make_strategy("kascade", 4, 2, anchors="0,x")
    with pytest.raises(ValueError, match=".npy or .json"):
        make_strategy("kascade", 4, 2, head_map="map.txt")
    with pytest.raises(ValueError, match="strictly increasing"):
        OmniKVStrategy(filter_layers=(8, 2))
    with pytest.raises(ValueError, match="page_size"):
        QuestStrategy(page_size=0)
    with pytest.raises(ValueError, match="sinks"):
        StreamingLLMStrategy(sinks=-1)
    with pytest.raises(ValueError, match="topk_frac"):
        LessIsMoreStrategy(recent_frac=1.5)


def test_registry_budget_aliases():
    s = make_strategy("quest", 30, 3, topk_frac=0.2, min_k=64)
    assert (s.budget_frac, s.min_budget) == (0.2, 64)
    with pytest.raises(ValueError, match=r"does not take \['topk_frac'\]"):
        make_strategy("streaming_llm", 30, 3, topk_frac=0.2)
