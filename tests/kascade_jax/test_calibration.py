"""Calibration: pooled scores vs the reference, the similarity formula, a planted model, artifacts, flag resolution."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kascade_jax.calibration import artifact as art_lib
from kascade_jax.calibration import resolve
from kascade_jax.calibration.artifact import CalibrationArtifact
from kascade_jax.calibration.head_map import check_head_map, head_map_for, load_head_map_file
from kascade_jax.calibration.stats import TAIL_TILES, CalibrationStrategy, dense_with_pooled, importance, layer_scores
from tests.kascade_jax.kj_helpers import FakeTokenizer
from kernels_pallas.reference import attention_reference, pooled_scores_prefill_reference
from models.attention import AttentionInputs


def _inputs(q, k, v, kv_len):
    b = q.shape[0]
    return AttentionInputs(q, k, v, jnp.zeros((b,), jnp.int32), jnp.asarray(kv_len, jnp.int32),
                           jnp.asarray(kv_len, jnp.int32), "prefill", chunk_at_zero=True)


def _rand(rng, *shape, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)


@pytest.mark.parametrize("t,kv_len,block_tiles", [(96, (96, 70), 2), (100, (100, 33), 8)])
def test_dense_with_pooled_matches_reference(rng, t, kv_len, block_tiles):
    q, k, v = _rand(rng, 2, t, 6, 8, scale=2.0), _rand(rng, 2, t, 2, 8), _rand(rng, 2, t, 2, 8)
    kv = jnp.asarray(kv_len, jnp.int32)
    out, scores, diag = jax.jit(dense_with_pooled, static_argnums=(4, 5))(q, k, v, kv, 16, block_tiles)
    zero = jnp.zeros((2,), jnp.int32)
    ref_out = jax.jit(attention_reference)(q, k, v, zero, kv)
    ref_sc, ref_diag = jax.jit(pooled_scores_prefill_reference, static_argnums=4)(q, k, zero, kv, 16)
    valid_rows = np.arange(t)[None, :] < np.asarray(kv_len)[:, None]
    np.testing.assert_allclose(np.asarray(out)[valid_rows], np.asarray(ref_out)[valid_rows], atol=2e-5)
    assert scores.shape == ref_sc.shape and diag.shape == ref_diag.shape
    np.testing.assert_array_equal(np.isfinite(scores), np.isfinite(ref_sc))
    fin = np.isfinite(np.asarray(ref_sc))
    np.testing.assert_allclose(np.asarray(scores)[fin], np.asarray(ref_sc)[fin], atol=2e-5)
    np.testing.assert_allclose(diag, ref_diag, atol=2e-5)


def _naive_sim(A_b, D_b, A_a, kv_len, tile_size, kp, reduce="min"):
    """numpy statement of r_t for one prompt: A [H, T, S] (-inf = ineligible), D [H, T] -> reduced over tiles [h, g]
    (min, or "tail": the mean over the last TAIL_TILES tiles that hold a query)."""
    H, T, _ = A_b.shape
    out = np.zeros((H, H))
    for h in range(H):
        for g in range(H):
            rs = []
            for t in range(1, T):
                if t * tile_size >= kv_len:
                    continue
                elig = np.flatnonzero(np.isfinite(A_b[h, t]))
                n = min(kp, len(elig))
                top_b = elig[np.argsort(-A_b[h, t, elig], kind="stable")[:n]]
                top_a = elig[np.argsort(-A_a[g, t, elig], kind="stable")[:n]]
                rs.append((A_b[h, t, top_a].sum() + D_b[h, t]) / (A_b[h, t, top_b].sum() + D_b[h, t]))
            out[h, g] = min(rs) if reduce == "min" else np.mean(rs[-TAIL_TILES:])
    return out


def test_similarity_matches_naive_and_bounds(rng):
    L, H, hq, d, t, ts, k = 3, 2, 4, 8, 80, 16, 24
    kv_len = (80, 57)
    strategy = CalibrationStrategy(num_layers=L, kv_heads=H, tile_size=ts, k=k, block_tiles=2)
    qs, ks, vs = _rand(rng, L, 2, t, hq, d, scale=2.0), _rand(rng, L, 2, t, H, d), _rand(rng, L, 2, t, H, d)
    zero, kv = jnp.zeros(2, jnp.int32), jnp.asarray(kv_len, jnp.int32)

    @jax.jit
    def run(qs, ks, vs):
        state, outs, layers = None, [], []
        for layer in range(L):
            out, state = strategy.attend(layer, _inputs(qs[layer], ks[layer], vs[layer], kv_len), state)
            outs.append(out - attention_reference(qs[layer], ks[layer], vs[layer], zero, kv))
            layers.append(pooled_scores_prefill_reference(qs[layer], ks[layer], zero, kv, ts))
        return state, outs, layers

    state, errs, layers = run(qs, ks, vs)
    assert max(float(jnp.abs(e).max()) for e in errs) < 2e-5
    sim = np.asarray(state["sim"])  # [batch, a, b, h, g]
    assert np.all((sim >= 0) & (sim <= 1))
    for b in range(L):
        for bi in range(2):
            np.testing.assert_allclose(np.diagonal(sim[bi, b, b], axis1=0, axis2=1), 1.0, atol=1e-6)
    for a, b in ((0, 2), (1, 2), (0, 1)):
        for bi in range(2):
            A_b, D_b = (np.asarray(x[bi]) for x in layers[b])
            A_a = np.asarray(layers[a][0][bi])
            np.testing.assert_allclose(sim[bi, a, b], _naive_sim(A_b, D_b, A_a, kv_len[bi], ts, k - ts), atol=1e-5)
    assert np.all(sim[:, 2, 0] == 0)  # lower triangle never filled
    mean_strategy = CalibrationStrategy(num_layers=1, kv_heads=H, tile_size=ts, k=k, reduce="mean")
    q, kk, v = _rand(rng, 2, t, hq, d), _rand(rng, 2, t, H, d), _rand(rng, 2, t, H, d)
    _, st = jax.jit(mean_strategy.attend, static_argnums=0)(0, _inputs(q, kk, v, kv_len), None)
    np.testing.assert_allclose(np.diagonal(np.asarray(st["sim"])[:, 0, 0], axis1=1, axis2=2), 1.0, atol=1e-6)


def test_tail_reduce_is_the_mean_over_the_last_tiles(rng):
    # the decode-side statistic: only the prompt's last TAIL_TILES tiles (where the question is read) count
    L, H, hq, d, t, ts, k = 2, 2, 4, 8, 160, 16, 24
    kv_len = (160, 100)  # last tiles 6-9 and 3-6 of 10
    qs, ks, vs = _rand(rng, L, 2, t, hq, d, scale=2.0), _rand(rng, L, 2, t, H, d), _rand(rng, L, 2, t, H, d)
    zero, kv = jnp.zeros(2, jnp.int32), jnp.asarray(kv_len, jnp.int32)
    sims = {}
    for reduce in ("tail", "mean"):
        strategy = CalibrationStrategy(num_layers=L, kv_heads=H, tile_size=ts, k=k, reduce=reduce)
        state = None
        for layer in range(L):
            _, state = strategy.attend(layer, _inputs(qs[layer], ks[layer], vs[layer], kv_len), state)
        sims[reduce] = np.asarray(state["sim"])
    layers = [pooled_scores_prefill_reference(qs[i], ks[i], zero, kv, ts) for i in range(L)]
    for bi in range(2):
        A_b, D_b = (np.asarray(x[bi]) for x in layers[1])
        want = _naive_sim(A_b, D_b, np.asarray(layers[0][0][bi]), kv_len[bi], ts, k - ts, reduce="tail")
        np.testing.assert_allclose(sims["tail"][bi, 0, 1], want, atol=1e-5)
    assert np.abs(sims["tail"] - sims["mean"]).max() > 1e-3  # not the mean over every tile


def test_importance(rng):
    x, o = _rand(rng, 2, 10, 16), _rand(rng, 2, 10, 16, scale=0.5)
    kv = jnp.asarray([10, 6], jnp.int32)
    w = np.asarray(importance(x, o, kv))
    xn, yn = np.asarray(x), np.asarray(x + o)
    for b, n in enumerate((10, 6)):
        cos = (xn[b, :n] * yn[b, :n]).sum(-1) / np.linalg.norm(xn[b, :n], axis=-1) / np.linalg.norm(yn[b, :n], axis=-1)
        assert w[b] == pytest.approx(1 - cos.mean(), abs=1e-5)


def test_planted_anchors_and_head_permutation(rng):
    """Layers 0-2 and 3-5 form blocks sharing key preferences; each layer permutes its KV heads."""
    L, H, g, d, t, ts, k = 6, 3, 2, 16, 192, 16, 32
    blocks = [(0, 1, 2), (3, 4, 5)]
    keys = rng.normal(size=(H, t, d))  # shared keys per logical head
    perms = [rng.permutation(H) for _ in range(L)]  # KV head h of layer l plays logical head perms[l][h]
    strategy = CalibrationStrategy(num_layers=L, kv_heads=H, tile_size=ts, k=k)
    x, attn = _rand(rng, 1, t, 32), _rand(rng, 1, t, 32, scale=0.3)
    qs, ks = [], []
    for block in blocks:
        queries = rng.normal(size=(H, t, d)) * 1.5  # this block's preferences per logical head
        for layer in block:
            p = perms[layer]
            q = queries[p][:, :, None, :] + 0.05 * rng.normal(size=(H, t, g, d))  # [H, t, g, d]
            qs.append(q.transpose(1, 0, 2, 3).reshape(1, t, H * g, d))
            ks.append(keys[p].transpose(1, 0, 2)[None])
    v = _rand(rng, L, 1, t, H, d)

    @jax.jit
    def run(qs, ks, v, x, attn):  # the model's layer loop, in one compile
        state = None
        for layer in range(L):
            _, state = strategy.attend(layer, _inputs(qs[layer], ks[layer], v[layer], [t]), state)
            state = strategy.post_attention(layer, x, attn, state)  # equal importance in every layer
        return state["sim"], state["w"]

    sim, w = run(jnp.asarray(np.stack(qs), jnp.float32), jnp.asarray(np.stack(ks), jnp.float32), v, x, attn)
    sim, w = np.asarray(sim[0]), np.asarray(w[0])
    np.testing.assert_allclose(w, w[0], rtol=1e-6)
    S = np.asarray(layer_scores(sim, w))
    assert S[0, 1] > 0.95 * w[0] and S[3, 5] > 0.95 * w[0] and S[0, 4] < 0.9 * w[0]
    art = CalibrationArtifact.from_statistics(sim, w, model_name="planted", dataset="synthetic", num_prompts=1,
                                              k=k, tile_size=ts, reduce="min")
    assert art.anchors[2] == (0, 3)
    hm = art.head_map((0, 3))
    for layer in range(L):
        a = 0 if layer < 3 else 3
        inv = np.argsort(perms[a])  # logical head -> KV head of the anchor
        np.testing.assert_array_equal(hm[layer], inv[perms[layer]])


def test_strategy_errors(rng):
    with pytest.raises(ValueError, match="k must exceed tile_size"):
        CalibrationStrategy(num_layers=2, kv_heads=1, tile_size=32, k=32)
    with pytest.raises(ValueError, match="reduce"):
        CalibrationStrategy(num_layers=2, kv_heads=1, reduce="max")
    with pytest.raises(ValueError, match="num_layers"):
        CalibrationStrategy(num_layers=0, kv_heads=1)
    s = CalibrationStrategy(num_layers=1, kv_heads=2, tile_size=16, k=32)
    q, k = _rand(rng, 1, 1, 2, 8), _rand(rng, 1, 32, 2, 8)
    dec = AttentionInputs(q, k, k, jnp.asarray([31]), jnp.asarray([32]), jnp.asarray([32]), "decode", False)
    with pytest.raises(ValueError, match="prefill"):
        s.attend(0, dec, None)
    wrong = AttentionInputs(_rand(rng, 1, 32, 3, 8), _rand(rng, 1, 32, 3, 8), _rand(rng, 1, 32, 3, 8),
                            jnp.zeros(1, jnp.int32), jnp.asarray([32]), jnp.asarray([32]), "prefill", True)
    with pytest.raises(ValueError, match="kv_heads"):
        s.attend(0, wrong, None)


def _random_artifact(rng, L=5, H=3):
    sim = np.zeros((L, L, H, H), np.float32)
    for a in range(L):
        for b in range(a, L):
            sim[a, b] = rng.uniform(0.5, 1.0, (H, H))
        sim[a, a] = np.maximum(sim[a, a], np.eye(H))
    return CalibrationArtifact.from_statistics(sim, rng.uniform(0.05, 0.3, L), model_name="m", dataset="builtin",
                                               num_prompts=7, k=64, tile_size=32, reduce="min", meta=dict(seed=3))


def test_artifact_round_trip_and_mismatch(rng, tmp_path):
    art = _random_artifact(rng)
    path = art.save(tmp_path / "a.json")
    assert path.with_suffix(".npz").is_file()
    doc = json.loads(path.read_text())
    assert doc["anchors"]["3"] == list(art.anchors[3]) and doc["k"] == 64 and doc["num_prompts"] == 7
    for p in (path, path.with_suffix(".npz"), tmp_path / "a"):
        back = CalibrationArtifact.load(p)
        assert back.anchors == art.anchors and back.scores == art.scores and back.meta["seed"] == 3
        for f in ("sim", "w", "S", "head_maps"):
            np.testing.assert_array_equal(getattr(back, f), getattr(art, f))
    CalibrationArtifact.load(path, num_layers=5, kv_heads=3)
    with pytest.raises(ValueError, match="num_layers=5, kv_heads=3, but the model has num_layers=6"):
        CalibrationArtifact.load(path, num_layers=6, kv_heads=3)
    with pytest.raises(ValueError, match="kv_heads=2"):
        art.check_model(5, 2)
    with pytest.raises(ValueError, match="no calibration artifact"):
        CalibrationArtifact.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="num_anchors"):
        art.anchors_for(9)
    hm = art.head_maps[2]
    np.testing.assert_array_equal(hm, head_map_for(art.sim, art.anchors[3]))
    for a in art.anchors[3]:
        np.testing.assert_array_equal(hm[a], np.arange(3))
    assert art_lib.artifact_name("smollm2-135m", "bdsaglam/musique", 64, 64, 32) == \
        "smollm2-135m-bdsaglam_musique-64-k64-ts32.json"


def test_flag_resolution(rng, tmp_path):
    art = _random_artifact(rng)
    assert resolve.parse_anchors("0, 2,4", 5) == (0, 2, 4)
    assert resolve.parse_anchors("auto", 5) == "auto"
    for bad, msg in (("1,2", "layer 0"), ("0,3,2", "increasing"), ("0,5", r"\[0, 4\]"), ("0,x", "comma-separated")):
        with pytest.raises(ValueError, match=msg):
            resolve.parse_anchors(bad, 5)
    np.testing.assert_array_equal(resolve.resolve_head_map("identity", (0, 2), 5, 3), np.tile(np.arange(3), (5, 1)))
    np.testing.assert_array_equal(resolve.resolve_head_map("auto", (0, 2), 5, 3, artifact=art),
                                  head_map_for(art.sim, (0, 2)))
    with pytest.raises(ValueError, match="needs a calibration artifact"):
        resolve.resolve_head_map("auto", (0, 2), 5, 3)
    hm = art.head_map((0, 2)).copy()
    hm[1] = [1, 2, 0]  # a reuse row for anchors (0, 2); never the identity (a random map can be, by chance)
    np.save(tmp_path / "hm.npy", hm)
    np.testing.assert_array_equal(resolve.resolve_head_map(str(tmp_path / "hm.npy"), (0, 2), 5, 3), hm)
    with pytest.raises(ValueError, match="identity"):  # anchor row 1 is not the identity
        resolve.resolve_head_map(str(tmp_path / "hm.npy"), (0, 1), 5, 3)
    with pytest.raises(ValueError, match="shape"):
        resolve.resolve_head_map(str(tmp_path / "hm.npy"), (0, 2), 6, 3)
    with pytest.raises(ValueError, match="existing"):
        resolve.resolve_head_map(str(tmp_path / "nope.npy"), (0, 2), 5, 3)
    bad = hm.copy()
    bad[1, 0] = 7
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        check_head_map(bad, 5, 3)
    (tmp_path / "hm.json").write_text(json.dumps({"head_map": hm.tolist()}))
    np.testing.assert_array_equal(load_head_map_file(str(tmp_path / "hm.json"), 5, 3), hm)


def _keyed_artifact(rng, **key_fields):
    art = _random_artifact(rng)
    key = resolve.calibration_key("m", num_prompts=7, **key_fields)
    return dataclasses.replace(art, key=key.to_dict()), key


def test_resolve_recipe_flags_uses_the_recipes_cached_artifact_and_its_pins(rng, tmp_path):
    """What every command line runs: 'auto' -> the DP's anchors for the recipe's M and their head map, from the
    cached artifact keyed by the recipe's calibration fields; a recipe that pins anchors -> those, same artifact's map;
    '' or 'even' with an identity map -> no calibration at all."""
    from kascade_jax.recipes import Recipe

    art, key = _keyed_artifact(rng)
    art.save(resolve.artifact_path(key, tmp_path))
    r = Recipe(name="r", calib_num_prompts=7, num_anchors=3)
    rows = lambda hm: tuple(map(tuple, np.asarray(hm).tolist()))  # noqa: E731
    got, hm, note = resolve.resolve_recipe_flags("m", r, "auto", "", num_layers=5, kv_heads=3, cache_dir=tmp_path)
    assert got == art.anchors[3] and hm == rows(art.head_maps[2]) and note.startswith("anchors: auto -> ")
    with pytest.raises(ValueError, match="num_layers=5"):
        resolve.resolve_recipe_flags("m", r, "auto", "", num_layers=4, kv_heads=3, cache_dir=tmp_path)
    pinned = Recipe(name="p", calib_num_prompts=7, num_anchors=2, anchors=(0, 2))
    got, hm, note = resolve.resolve_recipe_flags("m", pinned, "auto", "", num_layers=5, kv_heads=3, cache_dir=tmp_path)
    assert got == (0, 2) and hm == rows(art.head_map((0, 2))) and "(pinned by the recipe)" in note
    got, hm, _ = resolve.resolve_recipe_flags("m", pinned, "0,1", "identity", num_layers=5, kv_heads=3)
    assert (got, hm) == ((0, 1), None)  # explicit anchors win over the pins
    empty = tmp_path / "empty"
    assert resolve.resolve_recipe_flags("m", r, "", "", num_layers=5, kv_heads=3, cache_dir=empty)[:2] == (None, None)
    assert resolve.resolve_recipe_flags("m", r, "even", "identity", num_layers=5, kv_heads=3,
                                        cache_dir=empty)[:2] == (resolve.even_anchors(5, 3), None)





def test_builtin_devset_sizes_determinism_and_disjoint_subsets():
    from kascade_jax.calibration.devset import builtin_devset, load_devset

    tok = FakeTokenizer()
    ps = builtin_devset(tok, 5, min_tokens=500, max_tokens=800, seed=1)
    assert {p.kind for p in ps} == {"niah_multikey_1", "vt", "prose", "niah_multivalue", "niah_multiquery"}
    for p in ps:
        assert 400 <= len(p.token_ids) <= 800, (p.kind, len(p.token_ids))
    again = builtin_devset(tok, 5, min_tokens=500, max_tokens=800, seed=1)
    assert [p.token_ids for p in again] == [p.token_ids for p in ps]
    later = builtin_devset(tok, 5, min_tokens=500, max_tokens=800, seed=1, start=5)  # the second, disjoint half
    assert not {p.token_ids for p in later} & {p.token_ids for p in ps}
    with pytest.raises(ValueError, match="min_tokens"):
        builtin_devset(tok, 2, min_tokens=600, max_tokens=300)
    with pytest.raises(ValueError, match="num_prompts"):
        builtin_devset(tok, 0)


def test_builtin_answers_devset_ends_each_task_prompt_with_its_answer(monkeypatch):
    from kascade_jax.calibration.devset import load_devset
    from kascade_jax.tasks import synthetic

    tok, seen, real = FakeTokenizer(), [], synthetic.generate_sample
    monkeypatch.setattr(synthetic, "generate_sample", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    plain = load_devset("builtin", tok, 5, min_tokens=500, max_tokens=800, seed=1)
    seen.clear()
    ans = load_devset("builtin_answers", tok, 5, min_tokens=500, max_tokens=800, seed=1)
    assert [p.kind for p in ans] == [p.kind for p in plain] and len(seen) == 4  # prose has no gold answer
    samples = iter(seen)
    for p, a in zip(plain, ans):
        if p.kind == "prose":
            assert a.token_ids == p.token_ids
            continue
        gold = tok.encode(" " + " ".join(next(samples)["answers"]))
        assert a.token_ids == p.token_ids + tuple(gold) and gold, p.kind


def test_hf_devset_offline_error(monkeypatch):
    from kascade_jax.calibration.devset import load_devset

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not load dataset .*--dataset=builtin"):
        load_devset("no-such-user/no-such-dataset-kascade", FakeTokenizer(), 2)


def test_collect_statistics_on_a_tiny_model(rng):
    """Real forward: output stays dense, and padding to a longer bucket does not change the statistics."""
    from flax import nnx

    from kascade_jax.calibration.runner import calibrate, collect_statistics
    from models.config import ModelConfig
    from models.transformer import Transformer

    cfg = ModelConfig(model_type="llama", vocab=97, hidden=32, ffn=64, num_layers=3, q_heads=4, kv_heads=2,
                      head_dim=8, max_position_embeddings=256)
    model = Transformer(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    prompts = [rng.integers(0, 97, n) for n in (70, 120)]
    a = collect_statistics(model, prompts, k=32, tile_size=16, bucket=128, progress=False)
    b = collect_statistics(model, prompts, k=32, tile_size=16, bucket=256, progress=False)
    assert a.compile_buckets == (128,) and b.compile_buckets == (256,)
    np.testing.assert_allclose(a.sim, b.sim, atol=1e-5)
    np.testing.assert_allclose(a.w, b.w, atol=1e-5)
    assert a.sim.shape == (2, 3, 3, 2, 2) and np.all((a.sim >= 0) & (a.sim <= 1))
    assert np.all(a.w > 0)
    art = calibrate(model, prompts, model_name="tiny", dataset="random", k=32, tile_size=16, bucket=128,
                    progress=False)
    assert art.num_prompts == 2 and art.anchors[1] == (0,) and len(art.anchors[2]) == 2
    with pytest.raises(ValueError, match="prompt lengths"):
        collect_statistics(model, [rng.integers(0, 97, 10)], k=32, tile_size=16, bucket=128, progress=False)


KEY_CHANGES = dict(num_prompts=8, seed=1, min_tokens=1024, max_tokens=2048, k=96, tile_size=16, reduce="mean",
                   dtype="bfloat16", block_tiles=2, dataset="bdsaglam/musique")


@pytest.mark.parametrize("field", sorted(KEY_CHANGES) + ["model_file", "dataset_config"])
def test_calibration_key_separates_every_field(rng, tmp_path, field):
    """A cached calibration is found only under its own key: changing any field misses it (a near miss that names
    the field), and loading it under the changed key is an error that names the field."""
    art, key = _keyed_artifact(rng)
    path = art.save(resolve.artifact_path(key, tmp_path))
    assert resolve.find_cached(key, tmp_path) == (path, [])
    if field == "model_file":
        other = dataclasses.replace(key, model_file="sha256=00 size=1")
    elif field == "dataset_config":
        key = dataclasses.replace(key, dataset="bdsaglam/musique", dataset_split="validation")
        art = dataclasses.replace(art, key=key.to_dict())
        path = art.save(resolve.artifact_path(key, tmp_path))
        other = dataclasses.replace(key, dataset_config="answerable")
    else:
        other = resolve.calibration_key("m", **{"num_prompts": 7, field: KEY_CHANGES[field]})
    assert other.name() != key.name()
    found, near = resolve.find_cached(other, tmp_path)
    assert found is None
    if field not in ("num_prompts", "k", "tile_size", "reduce", "dataset"):  # these change the file stem
        assert [p for p, _ in near] == [path] and any(d.startswith(f"{field}:") for d in near[0][1])
    with pytest.raises(ValueError, match=rf"does not match .*{field}: recorded"):
        CalibrationArtifact.load(path, key=other)
    CalibrationArtifact.load(path, key=key)


def test_model_fingerprint_tracks_the_weights_file(tmp_path):
    f = tmp_path / "w.gguf"
    f.write_bytes(bytes(range(256)) * 16_000)
    a = art_lib.model_fingerprint(str(f))
    assert a.startswith("sample-sha256=") and a.endswith(f"size={f.stat().st_size}")
    data = bytearray(f.read_bytes())
    data[-5] ^= 1  # the tail of the file is hashed too
    f.write_bytes(bytes(data))
    assert art_lib.model_fingerprint(str(f)) != a
    assert art_lib.model_fingerprint("qwen2.5-coder-0.5b").startswith("sha256=1d9614638d")  # the registry's, no read
    assert art_lib.model_fingerprint("no-such-model-anywhere") is None


@pytest.mark.parametrize("model_name,dtype", [("qwen2.5-coder-0.5b", "bfloat16"), ("qwen2.5-coder-1.5b", "bfloat16"),
                                              ("smollm2-135m", "float32")])
def test_shipped_calibrations_are_found_under_their_keys(tmp_path, model_name, dtype):
    """--anchors=auto with the shipped recipes finds the shipped artifacts offline (an empty user cache); the
    Qwen recipes calibrate in bfloat16, as the shipped artifacts were, whatever the run's --dtype."""
    from kascade_jax.recipes import load_recipe

    r = load_recipe(model_name, "default")
    assert (r.calib_dtype or "float32") == dtype
    key = resolve.calibration_key(model_name, num_prompts=r.calib_num_prompts, k=r.calib_k, reduce=r.calib_reduce,
                                  max_tokens=r.calib_max_tokens, min_tokens=max(64, r.calib_max_tokens // 2),
                                  dtype=dtype)
    found, _ = resolve.find_cached(key, tmp_path)
    assert found is not None and found.parent == resolve.PACKAGED_DIR
    art = CalibrationArtifact.load(found, key=key)
    assert art.model_name == model_name and len(art.anchors_for(r.num_anchors)) == r.num_anchors


SHIPPED = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


@pytest.mark.parametrize("model_name", SHIPPED)
@pytest.mark.parametrize("run_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe_name", ["default", "paper"])
def test_recipe_kascade_finds_every_shipped_calibration_at_any_run_dtype(tmp_path, model_name, run_dtype,
                                                                         recipe_name):
    """The default path (recipe -> calibration keywords -> key) hits the shipped artifact of every shipped alias at
    --dtype float32 and bfloat16 (calibrate=False: a miss raises instead of starting a calibration), and returns
    the recipe's levers with the artifact's DP anchors and head map. No model weights are loaded."""
    from kascade_jax.recipes import load_recipe

    shipped = next(resolve.PACKAGED_DIR.glob(f"{model_name}-builtin-64-k64-ts32.json"))
    ref = CalibrationArtifact.load(shipped)
    r = load_recipe(model_name, recipe_name)
    kw, desc = resolve.recipe_kascade(model_name, ref.num_layers, ref.kv_heads, recipe=recipe_name, dtype=run_dtype,
                                      calibrate=False, cache_dir=tmp_path)
    assert shipped.name in desc
    want = tuple(r.anchors) if r.anchors else tuple(ref.anchors_for(r.num_anchors, r.calib_importance))
    assert kw["anchors"] == want
    assert np.array_equal(np.asarray(kw["head_map"]), ref.head_map(kw["anchors"]))
    assert {f: kw[f] for f in r.levers()} == r.levers()
    if recipe_name == "default":  # issue 21: 0.5B dps_all_dec20, 1.5B dps_all_dec30_fp8d, smollm2 smol_p6_dec30
        dps_all = dict(sink_tokens=4, recent_window=60, dense_suffix=0, local_window=0, decode_only=True, pool="all")
        expected = {"qwen2.5-coder-0.5b": (dict(dps_all, decode_topk_frac=0.2), None),
                    "qwen2.5-coder-1.5b": (dict(dps_all, decode_topk_frac=0.3, decode_score_fp8=True), None),
                    "smollm2-135m": (dict(sink_tokens=4, recent_window=60, dense_suffix=0, local_window=0,
                                          decode_only=True, decode_topk_frac=0.3), (0, 2, 8, 18, 21, 24))}
        assert (r.levers(), r.anchors) == expected[model_name]
    with pytest.raises(ValueError, match=r"no shipped or cached calibration .*dtype: recorded"):
        resolve.recipe_kascade(model_name, ref.num_layers, ref.kv_heads, recipe=r.replace(
            calib_dtype="float16"), calibrate=False, cache_dir=tmp_path)


@pytest.mark.parametrize("text,problem", [("{not json", "not valid JSON"), ('{"rows": [[0]]}', "'head_map' entry"),
                                          ('[[0, 1], [1]]', "equal-length rows of ints"),
                                          ('[[0, 1.5], [0, 1]]', "equal-length rows of ints"),
                                          ('[[0, 1], [0, 1], [0, 1]]', "shape")])
def test_malformed_head_map_json_names_the_file_and_the_problem(tmp_path, text, problem):
    path = tmp_path / "hm.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"--head_map={path}: .*{re.escape(problem)}"):
        resolve.resolve_head_map(str(path), (0,), 2, 2)
    (tmp_path / "bad.npy").write_bytes(b"not an array")
    with pytest.raises(ValueError, match="bad.npy: not a readable .npy"):
        load_head_map_file(str(tmp_path / "bad.npy"), 2, 2)


def test_tile_size_must_divide_the_calibration_bucket():
    from kascade_jax.calibration.runner import BUCKET, check_bucket

    check_bucket(BUCKET, 32)
    for tile in (48, 96, 1024):
        with pytest.raises(ValueError, match=f"--tile_size={tile} does not divide the calibration bucket"):
            check_bucket(BUCKET, tile)
    with pytest.raises(ValueError, match="does not divide the calibration bucket"):  # before any model or prompt
        resolve.load_or_calibrate("no-such-model", tile_size=48, num_prompts=2, cache_dir="/nonexistent")


def test_on_the_spot_calibration_announces_itself_and_is_cached_under_its_key(rng, tmp_path, capfd):
    """No cached artifact matches: the calibration says so on stderr (prompt count, an estimated time, where it
    goes, and the cached near misses it does not use, with their differing field), shows a tqdm bar, and saves
    under its key, where the next identical request finds it without running anything."""
    from flax import nnx

    from models.config import ModelConfig
    from models.transformer import Transformer

    cfg = ModelConfig(model_type="llama", vocab=50_000, hidden=32, ffn=64, num_layers=3, q_heads=4, kv_heads=2,
                      head_dim=8, max_position_embeddings=1024)
    model = Transformer(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    kw = dict(num_prompts=1, min_tokens=300, max_tokens=400, k=32, tile_size=16, cache_dir=tmp_path, model=model,
              tokenizer=FakeTokenizer())
    art = resolve.load_or_calibrate("tiny-m", **kw)
    err = capfd.readouterr().err
    assert "calibrating tiny-m now (no cached calibration matches): 1 builtin dev prompts of 300-400 tokens" in err
    assert "min (a rough estimate)" in err and "calibration forwards" in err and "1/1" in err  # the tqdm bar
    key = resolve.calibration_key("tiny-m", num_prompts=1, min_tokens=300, max_tokens=400, k=32, tile_size=16)
    assert art.key == key.to_dict() and resolve.find_cached(key, tmp_path)[0] == tmp_path / key.name()
    again = resolve.load_or_calibrate("tiny-m", **kw)
    assert "calibrating" not in capfd.readouterr().err
    np.testing.assert_array_equal(again.sim, art.sim)
    resolve.load_or_calibrate("tiny-m", **kw, seed=1)
    err = capfd.readouterr().err
    assert f"not using {key.name()}: seed: recorded 0, asked 1" in err


def test_dense_with_pooled_memory_is_bounded_at_16k():
    """The 16K calibration died on the H200 allocating 37.5 GiB: every query block's scores stayed alive. One block
    at a time keeps XLA's temporaries near SCORE_BLOCK_BYTES (compiled, not run: the CPU memory analysis)."""
    q = jax.ShapeDtypeStruct((1, 16384, 14, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 16384, 2, 64), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    compiled = jax.jit(dense_with_pooled, static_argnums=(4, 5)).lower(q, kv, kv, lens, 32, None).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 2 << 30, f"{temp / 2**30:.1f} GiB of temporaries at 16K"
