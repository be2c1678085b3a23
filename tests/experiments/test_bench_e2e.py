"""The end-to-end benchmark (kascade_jax/bench/e2e.py, e2e_models.py, store.py; flags: experiments/bench_e2e.py): its
pure parts on CPU (configs, memory arithmetic, kernel classification, rows, resume, Markdown/JSON/plot), the
on-device random initialisation at a tiny shape, and one GPU smoke run at a small shape."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import bench_e2e as front  # the flag parsers
from kascade_jax.bench import e2e, store, tables, timing
from kascade_jax.bench import e2e_models as em
from tests import cli_fork
from tests.conftest import run_on_8_simulated_devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Kernel names as CUPTI reported them on the H200 (benchmarks/decode.json, prefill.json).
CUDNN_DECODE = "cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35_16x128x128_1x4x1_cga1x1x1_kernel0_0"
CUDNN_COMBINE = "_ZN5cudnn6fusion21lean_reduction_kernelILb0ELb0ELb0EEEvPvPfS3_S3_S3_PKfS3_S3_S3_S3_S3_jjjj"
CUDNN_PREFILL = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0"

TINY_HF = dict(model_type="llama", vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
               tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)


def test_shipped_configs_parse_and_override():
    llama, note = em.load_shape_config(em.SPECS["llama3.1-8b-random"])
    assert note is None
    assert (llama.num_layers, llama.q_heads, llama.kv_heads, llama.head_dim, llama.ffn, llama.vocab) == \
        (32, 32, 8, 128, 14336, 128256)
    assert llama.rope.rope_type == "llama3" and llama.max_position_embeddings == 131072 and not llama.tie_embeddings
    qwen, _ = em.load_shape_config(em.SPECS["qwen3-8b-random"])
    assert (qwen.num_layers, qwen.kv_heads, qwen.ffn, qwen.vocab, qwen.qk_norm) == (36, 8, 12288, 151936, True)
    long, note = em.load_shape_config(em.SPECS["llama3.1-8b-random"], 262144)
    assert long.max_position_embeddings == 262144 and "131072" in note and "262144" in note
    # 8.03B and 8.19B parameters, 16.06 / 16.38 GB in bf16; KV 128 KiB / 144 KiB per token
    assert abs(em.param_count(llama) / 1e9 - 8.03) < 0.01 and abs(em.param_count(qwen) / 1e9 - 8.19) < 0.01
    assert em.kv_bytes_per_token(llama) == 131072 and em.kv_bytes_per_token(qwen) == 147456
    with pytest.raises(ValueError, match="no shipped config"):
        em.load_shape_config(em.ModelSpec("x", config_file="missing.json"))


@pytest.mark.parametrize("over", [dict(), dict(model_type="qwen2", tie_word_embeddings=True),
                                  dict(model_type="qwen3", head_dim=64)])
def test_param_count_matches_the_module(over):
    from models.transformer import Transformer

    spec = em.ModelSpec("tiny", config_dict=dict(TINY_HF, **over))
    cfg, _ = em.load_shape_config(spec)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert em.param_count(cfg) == n


def test_largest_batch_and_floor():
    llama, _ = em.load_shape_config(em.SPECS["llama3.1-8b-random"])
    per_seq = 131072 * em.kv_bytes_per_token(llama)  # 17.18 GB
    w = 2 * em.param_count(llama)
    assert abs(per_seq / 1e9 - 17.18) < 0.01
    assert em.largest_batch(139e9 * 0.95, w, per_seq, 10e9) == 6
    assert em.largest_batch(139e9 * 0.95, w, 32768 * em.kv_bytes_per_token(llama), 10e9) == 24  # not 32
    assert em.largest_batch(20e9, w, per_seq, 10e9) == 0
    with pytest.raises(ValueError, match="per_seq_bytes"):
        em.largest_batch(1e9, 0, 0, 0)
    # the 128K batch-1 floor: 16.06 GB + 17.18 GB at 4.3 TB/s = 7.7 ms
    assert abs(em.byte_floor_s(w, per_seq, 4.3) * 1e3 - 7.73) < 0.02


def test_parsers():
    assert front.parse_decode_specs(["32768:1", " 131072:max"]) == [(32768, 1), (131072, "max")]
    for bad in ("32768", "32768:0", "x:1", "32768:many", "-5:1"):
        with pytest.raises(ValueError, match="e2e_decode"):
            front.parse_decode_specs([bad])
    assert front.parse_steps(["8", "40"]) == (8, 40)
    for bad in (["40", "8"], ["0", "8"], ["8"], ["a", "b"]):
        with pytest.raises(ValueError, match="e2e_steps"):
            front.parse_steps(bad)
    assert e2e.plan(["ttft", "decode"], [32768], [(32768, "max")]) == [("ttft", 32768, 1), ("decode_step", 32768, "max")]
    assert e2e.plan(["decode", "ttft"], [65536], [(32768, 8)]) == [("decode_step", 32768, 8), ("ttft", 65536, 1)]
    with pytest.raises(ValueError, match="e2e_metrics"):
        e2e.plan(["tft"], [], [])
    with pytest.raises(ValueError, match="e2e_tag"):
        store.e2e_stem("../x")
    assert store.e2e_stem("") == "e2e" and store.e2e_stem("mesh8") == "e2e_mesh8"
    assert store.e2e_stem("", "data:1,model:2") == "e2e_mesh-data1-model2"
    assert store.e2e_stem("mine", "data:1,model:2") == "e2e_mine" and store.e2e_stem("", None) == "e2e"


def fake_mesh(data: int, model: int):
    """Only the axis sizes, for the arithmetic (real meshes: the 8-device tests below)."""
    return types.SimpleNamespace(shape={"data": data, "model": model})


def test_largest_batch_and_bytes_on_a_mesh():
    llama, _ = em.load_shape_config(em.SPECS["llama3.1-8b-random"])
    per_seq = 131072 * em.kv_bytes_per_token(llama)  # 17.18 GB
    w = 2 * em.param_count(llama)
    assert em.device_weight_bytes(llama, None) == w
    # model:M splits every layer's attention and MLP; embeddings, lm_head (2 x 1.05 GB) and norms stay whole
    whole = 2 * (2 * llama.vocab * llama.hidden + llama.hidden + 2 * llama.num_layers * llama.hidden)  # + norms
    for m in (1, 2, 4, 8):
        assert em.device_weight_bytes(llama, fake_mesh(1, m)) == whole + (w - whole) // m, m
        assert em.device_weight_bytes(llama, fake_mesh(4, m)) == em.device_weight_bytes(llama, fake_mesh(1, m))
    budget, head = 139e9 * 0.95, 10e9
    assert em.largest_batch(budget, w, per_seq, head, 1, 1) == em.largest_batch(budget, w, per_seq, head) == 6
    w2 = em.device_weight_bytes(llama, fake_mesh(1, 2))
    b2 = em.largest_batch(budget, w2, per_seq, head, 1, 2)  # (132 - 9.1 - 10) GB // 8.59 GB
    assert b2 == int((budget - w2 - head) // (per_seq / 2)) == 13
    b22 = em.largest_batch(budget, w2, per_seq, head, 2, 2)  # twice as many sequences, a multiple of data
    assert b22 == 2 * b2 and b22 % 2 == 0
    assert em.largest_batch(budget, w, per_seq, head, 3, 1) == 18
    assert em.largest_batch(20e9, w, per_seq, head, 2, 1) == 0
    with pytest.raises(ValueError, match="mesh sizes"):
        em.largest_batch(budget, w, per_seq, head, 0, 1)


def test_rows_of_another_mesh_are_other_rows(tmp_path):
    base = dict(model="llama3.1-8b-random", metric="decode_step", context=32768, batch=8)
    old = dict(base)  # written before meshes existed: no "mesh" field = one device
    sharded = dict(base, mesh="data:1,model:2", devices=2)
    one = dict(base, mesh=None, devices=1)
    assert store.row_key(old) == store.row_key(one) != store.row_key(sharded)
    assert em.mesh_name(None) is None
    rows = []
    store.add_run(rows, one, "dense", _run("dense", 11.6e-3, 8e-3, 3.6e-3))
    store.add_run(rows, sharded, "dense", _run("dense", 6.1e-3, 4e-3, 2.1e-3))
    store.add_run(rows, sharded, "kascade", _run("kascade", 3.9e-3, 1.5e-3, 2.4e-3))
    assert len(rows) == 2 and rows[0]["dense_s"] == 11.6e-3 and "kascade" not in rows[0]["runs"]
    assert store.has_run(rows, store.row_key(sharded), "kascade")
    assert not store.has_run(rows, store.row_key(one), "kascade")
    store.mark_skipped(rows, dict(base, batch=32, mesh="data:1,model:2", devices=2), "does not fit")
    store.mark_skipped(rows, dict(base, batch=32, mesh=None, devices=1), "does not fit one device")
    assert len(rows) == 4 and sorted(rows, key=store.order)[0]["mesh"] is None
    e2e.save(str(tmp_path), "e2e_mesh-data1-model2", dict(runs=[], notes=[]), rows)
    md = (tmp_path / "e2e_mesh-data1-model2.md").read_text()
    assert "| mesh (devices) |" in md and "| data:1,model:2 (2) | 32768 | 8 | 6.10 | 3.90 |" in md
    assert "| none (1) | 32768 | 8 | 11.60 |" in md and "mesh data:1,model:2: does not fit" in md


def test_a_batch_the_data_axis_does_not_divide_is_refused():
    specs = front.parse_decode_specs(["32768:8", "32768:3", "131072:max"])
    em.check_decode_batches(specs, None)
    em.check_decode_batches(specs, fake_mesh(1, 8))
    with pytest.raises(ValueError, match=r"data:2 does not divide the batch of 32768:3"):
        em.check_decode_batches(specs, fake_mesh(2, 1))
    em.check_decode_batches(front.parse_decode_specs(["32768:8", "131072:max"]), fake_mesh(2, 4))
    with pytest.raises(ValueError, match=r"data:4 does not divide the batch of 32768:2"):  # run() refuses it first
        e2e.run([em.SPECS["llama3.1-8b-random"]], metrics=["decode"], contexts=[], decode_specs=[(32768, 2)],
                strategies=["dense"], mesh=fake_mesh(4, 2), out_dir="/nonexistent")


def test_bench_help_lists_mesh_and_kernel_phases_refuse_it():
    res = cli_fork.run(["-m", "experiments.bench", "--help"], cli_fork.ENV, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--mesh" in res.stdout and "--e2e_models" in res.stdout and "--[no]distributed" in res.stdout
    res = cli_fork.run(["-m", "experiments.bench", "--phase=prefill", "--mesh=model:2"], cli_fork.ENV, cwd=ROOT)
    assert res.returncode != 0 and "is for --phase=e2e" in res.stdout + res.stderr


def test_classify_and_categories():
    for name in (CUDNN_DECODE, CUDNN_COMBINE, CUDNN_PREFILL, "kascade_anchor_scores", "kascade_topk_finish",
                 "kascade_reuse_decode", "kascade_prefill_select", "kascade_dense_decode",
                 "kascade_prefill_scores_mgpu_mosaic_gpu_kernel", "entry_mosaic_gpu_kernel"):  # Mosaic GPU
        assert timing.classify(name) == "attention", name
    for name, cat in (("loop_select_fusion_2", "fusion"), ("input_scatter_fusion_3", "cache_write"),
                      ("nvjet_tst_128x8_64x8_2x1_v_bz_TNT", "gemm"), ("triton_gemm_dot_12", "gemm"),
                      ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"), ("copy_fusion_1", "copy"),
                      ("wrapped_iota", "fusion"), ("loop_dynamic_update_slice_fusion", "cache_write")):
        assert timing.classify(name) == "rest" and timing.category(name) == cat, name


def test_tables_per_step_and_split():
    one = [("kascade_reuse_decode", 0.5), ("gemm_a", 2.0), ("kascade_reuse_decode", 0.5), ("fill", 7.0)]
    t1 = timing.kernel_table(one, 1)
    assert t1 == pytest.approx({"kascade_reuse_decode": 1e-3, "gemm_a": 2e-3, "fill": 7e-3})
    two = [[("a", 1.0), ("b", 3.0)], [("a", 3.0), ("b", 1.0)]]
    assert timing.kernel_table(two, 2) == pytest.approx({"a": 2e-3, "b": 2e-3})
    assert timing.kernel_table(None, 1) == {}
    # 8 and 40 steps: per-step kernels scale with steps, the fill runs once per call and cancels
    k8 = {"fill": 0.1, "kascade_reuse_decode": 8 * 2e-4, "gemm": 8 * 3e-3}
    k40 = {"fill": 0.1, "kascade_reuse_decode": 40 * 2e-4, "gemm": 40 * 3e-3, "late": 32e-6}
    step = timing.per_step(k8, k40, 8, 40)
    assert step == pytest.approx({"fill": 0.0, "kascade_reuse_decode": 2e-4, "gemm": 3e-3, "late": 1e-6})
    s = timing.split(step)
    assert s["attention_s"] == pytest.approx(2e-4) and s["rest_s"] == pytest.approx(3e-3 + 1e-6)
    assert s["attention_share"] == pytest.approx(2e-4 / (3.2e-3 + 1e-6))
    assert timing.split({})["attention_share"] is None
    top = timing.top_kernels(step, 2)
    assert [t[0] for t in top] == ["gemm", "kascade_reuse_decode"] and top[1][2] == "attention"
    assert timing.categories(step) == pytest.approx({"fusion": 1e-6, "gemm": 3e-3, "attention": 2e-4})


SETTINGS = dict(gpu="NVIDIA H200", jax_version="0.11.2", topk_frac=0.1, min_k=128, steps=(8, 40), seed=0,
                kascade_kw=dict(anchors=(0, 2, 8, 13, 14), head_map=None), date="2026-12-01 12:00 UTC")


def _settings(strategy, **over):
    return store.run_settings(strategy, **dict(SETTINGS, **over))


def _run(strategy, wall, att, rest, **over):
    """A run as run() stores it: times, top kernels and the settings (SETTINGS with `over`)."""
    return dict(wall_s=wall, kernel_s=att + rest, attention_s=att, rest_s=rest, attention_share=att / (att + rest),
                top=[["kascade_reuse_decode", att, "attention"]], settings=_settings(strategy, **over))


def test_rows_resume_markdown_json_and_plot(tmp_path):
    rows = []
    base = dict(model="llama3.1-8b-random", metric="decode_step", context=131072, batch=1, floor_s=7.7e-3)
    store.add_run(rows, base, "dense", _run("dense", 13.1e-3, 8.9e-3, 4.0e-3))
    assert rows[0]["speedup"] is None and not store.has_run(rows, store.row_key(base), "kascade")
    row = store.add_run(rows, base, "kascade", _run("kascade", 8.4e-3, 1.4e-3, 6.8e-3))
    assert len(rows) == 1 and store.has_run(rows, store.row_key(base), "kascade")
    assert row["dense_s"] == 13.1e-3 and row["kascade_s"] == 8.4e-3
    assert row["speedup"] == pytest.approx(13.1 / 8.4) and row["attention_speedup"] == pytest.approx(8.9 / 1.4)
    assert row["attention_share_dense"] == pytest.approx(8.9 / 12.9)
    assert row["attention_share_kascade"] == pytest.approx(1.4 / 8.2)
    store.add_run(rows, base, "dense_pallas", _run("dense_pallas", 11.0e-3, 6.8e-3, 4.0e-3))
    assert rows[0]["speedup_vs_dense_pallas"] == pytest.approx(11.0 / 8.4)
    ttft = dict(model="qwen3-8b-random", metric="ttft", context=65536, batch=1, notes=["qwen3: max positions raised"])
    store.add_run(rows, ttft, "dense", _run("dense", 3.5, 2.8, 0.7))
    store.add_run(rows, ttft, "kascade", _run("kascade", 2.0, 1.3, 0.7))
    store.mark_skipped(rows, dict(model="llama3.1-8b-random", metric="decode_step", context=32768, batch=32),
                      "does not fit one device")
    store.mark_skipped(rows, base, "dense_pallas: out of memory")  # on a measured row: a note, not a skip
    assert "skipped" not in rows[0] and "dense_pallas: out of memory" in rows[0]["notes"]
    meta = dict(runs=[dict(date="2026-12-01 12:00 UTC", gpu="NVIDIA H200", jax="0.11.2", command="bench")], notes=[])
    e2e.save(str(tmp_path), "e2e", meta, rows)
    md = (tmp_path / "e2e.md").read_text()
    assert "NVIDIA H200" in md and "JAX 0.11.2" in md and "**1.56x**" in md and "**1.75x**" in md
    assert "does not fit one device" in md and "qwen3: max positions raised" in md and "split-K Pallas" in md
    assert (tmp_path / "e2e.png").stat().st_size > 1000
    meta2, rows2 = store.load_e2e(str(tmp_path), "e2e")
    assert rows2 == json.loads(json.dumps(rows)) and meta2["runs"] == meta["runs"]
    doc = json.loads((tmp_path / "e2e.json").read_text())
    for r in doc["rows"]:
        if "runs" in r:
            assert {"model", "metric", "context", "batch", "dense_s", "kascade_s", "speedup",
                    "attention_share_dense", "attention_share_kascade"} <= set(r)
    assert store.load_e2e(str(tmp_path), "nothing") == ({"runs": [], "notes": []}, [])
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an e2e benchmark file"):
        store.load_e2e(str(tmp_path), "bad")


def test_estimates_order_the_work():
    kw = dict(weight_bytes=16e9, kv_per_token=131072)
    assert e2e.estimate_s("ttft", 32, 262144, 1, "dense", **kw) > e2e.estimate_s("ttft", 32, 131072, 1, "dense", **kw)
    assert e2e.estimate_s("ttft", 32, 131072, 1, "kascade", **kw) < e2e.estimate_s("ttft", 32, 131072, 1, "dense", **kw)
    assert e2e.estimate_s("decode_step", 32, 131072, 6, "dense", **kw) > e2e.estimate_s("decode_step", 32, 131072, 1,
                                                                                         "dense", **kw)


def test_random_model_on_device(rng):
    spec = em.ModelSpec("tiny", config_dict=dict(TINY_HF, model_type="qwen3", tie_word_embeddings=True))
    cfg, _ = em.load_shape_config(spec)
    seed = int(rng.integers(1 << 20))
    model = em.random_model(cfg, jnp.bfloat16, seed)
    again = em.random_model(cfg, jnp.bfloat16, seed)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, var in flat.items():
        x = np.asarray(var.get_value(), np.float32)
        assert var.get_value().dtype == jnp.bfloat16
        if str(path[-1]) == "weight":
            assert np.all(x == 1.0), path
        else:
            assert abs(x.std() - 0.02) < 0.004 and abs(x.mean()) < 0.004, (path, x.std())
    a = dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    assert all(np.array_equal(np.asarray(flat[p].get_value()), np.asarray(a[p].get_value())) for p in flat)
    q = flat[("layers", 0, "self_attn", "q_proj", "kernel")].get_value()
    k = flat[("layers", 0, "self_attn", "k_proj", "kernel")].get_value()
    assert not np.array_equal(np.asarray(q[:, :k.shape[1]]), np.asarray(k))  # distinct keys per parameter
    assert em.weight_bytes(model) == 2 * em.param_count(cfg)
    from models import generate as gen
    from models.attention import DenseStrategy
    from models.cache import KVCache

    cache = KVCache.init(cfg, 1, 128, dtype=jnp.bfloat16)
    logits, _ = gen.prefill(model, rng.integers(0, cfg.vocab, (1, 64)), [64], cache, DenseStrategy())
    assert np.all(np.isfinite(np.asarray(logits)))


def test_refuses_without_gpu(tmp_path):
    with pytest.raises(ValueError, match="needs a GPU"):
        e2e.run([em.SPECS["llama3.1-8b-random"]], metrics=["ttft"], contexts=[32768], decode_specs=[],
                strategies=["dense"], out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown model"):
        em.model_spec("llama-70b")


COMMITTED = os.path.join(ROOT, "benchmarks", "e2e.json")


def test_settings_decide_resume_and_speedups(tmp_path, rng):
    base = dict(model="llama3.1-8b-random", metric="decode_step", context=32768, batch=8, floor_s=4e-3)
    key = store.row_key(base)
    d, k = (float(x) for x in rng.uniform(5e-3, 2e-2, 2))
    rows = []
    store.add_run(rows, base, "dense", _run("dense", d, 0.6 * d, 0.4 * d))
    store.add_run(rows, base, "kascade", _run("kascade", k, 0.3 * k, 0.7 * k))
    assert rows[0]["speedup"] == pytest.approx(d / k) and "settings_note" not in rows[0]
    # resume: equal settings (another date) are done; another topk_frac, GPU, seed or unknown settings are not
    assert store.has_run(rows, key, "kascade", _settings("kascade", date="2026-12-24 00:00 UTC"))
    for over in (dict(topk_frac=0.2), dict(gpu="NVIDIA H100 80GB HBM3"), dict(seed=1), dict(steps=(8, 72)),
                 dict(kascade_kw=dict(anchors=(0, 3), head_map=None)),
                 dict(kascade_kw=dict(anchors=(0, 2, 8, 13, 14), head_map=[[0, 1]] * 32))):
        assert not store.has_run(rows, key, "kascade", _settings("kascade", **over)), over
    # a re-measured kascade run of other settings replaces the old one; dense / kascade is then refused with a note
    k2 = float(rng.uniform(2e-3, 4e-3))
    row = store.add_run(rows, base, "kascade", _run("kascade", k2, 0.3 * k2, 0.7 * k2, topk_frac=0.2))
    assert len(rows) == 1 and row["kascade_s"] == k2 and row["runs"]["kascade"]["settings"]["topk_frac"] == 0.2
    assert row["speedup"] is None and row["kernel_speedup"] is None and row["attention_speedup"] is None
    assert "topk_frac" in row["settings_note"] and "dense / kascade not computed" in row["settings_note"]
    e2e.save(str(tmp_path), "e2e", dict(runs=[], notes=[]), rows, with_plot=False)
    md = (tmp_path / "e2e.md").read_text()
    assert "different settings (topk_frac)" in md and f"| {1e3 * d:.2f} | {1e3 * k2:.2f} | – |" in md
    _, again = store.load_e2e(str(tmp_path), "e2e")
    assert again[0]["speedup"] is None and "topk_frac" in again[0]["settings_note"]
    # dense measured again with those settings: the ratio is back (the date never matters)
    d2 = float(rng.uniform(5e-3, 2e-2))
    row = store.add_run(rows, base, "dense", _run("dense", d2, 0.6 * d2, 0.4 * d2, topk_frac=0.2, date="later"))
    assert row["speedup"] == pytest.approx(d2 / k2) and "settings_note" not in row
    store.add_run(rows, base, "dense_pallas", _run("dense_pallas", d, 0.5 * d, 0.5 * d, gpu="other"))
    assert rows[0]["speedup_vs_dense_pallas"] is None and "dense_pallas / kascade" in rows[0]["settings_note"]
    assert rows[0]["speedup"] == pytest.approx(d2 / k2)
    with pytest.raises(ValueError, match="unknown strategy"):
        _settings("sparse")


def _committed_copy(tmp_path):
    if not os.path.exists(COMMITTED):
        pytest.skip("no committed benchmarks/e2e.json")
    folder = tmp_path / "copy"
    folder.mkdir()
    doc = json.loads(open(COMMITTED).read())
    (folder / "e2e.json").write_text(json.dumps(doc))
    return folder, doc


def test_runs_without_settings_are_kept_shown_and_measured_again(tmp_path):
    """A file written before runs stored their settings (the committed H200 file): every row and time loads as
    written, but no such run counts as done (resume measures it again) or is divided by; a new run replaces it."""
    folder, doc = _committed_copy(tmp_path)
    meta, rows = store.load_e2e(str(folder), "e2e")
    assert len(rows) == len(doc["rows"]) and meta["runs"] == doc["meta"]["runs"]
    measured = [r for r in rows if r.get("runs")]
    assert measured and all("settings" not in run for r in measured for run in r["runs"].values())
    for old, new in zip(doc["rows"], rows):
        assert store.row_key(old) == store.row_key(new)
        for f in ("dense_s", "kascade_s", "dense_attention_s", "kascade_attention_s"):
            assert old.get(f) == new.get(f), (old["model"], old["context"], old["batch"], f)
    # what a resumed H200 run with the defaults would measure as: not done, measured again
    r0 = next(r for r in measured if r["model"] == "qwen3-8b-random" and r["metric"] == "decode_step")
    now = store.run_settings("kascade", gpu="NVIDIA H200", jax_version="0.11.2", topk_frac=0.1, min_k=128,
                           steps=(8, 40), seed=0, kascade_kw=dict(anchors=em.SPECS["qwen3-8b-random"].anchors,
                                                                 head_map=None), date="now")
    key = store.row_key(r0)
    assert store.has_run(rows, key, "kascade") and not store.has_run(rows, key, "kascade", now)
    assert r0["speedup"] is None and "dense / kascade not computed" in r0["settings_note"]
    e2e.save(str(folder), "e2e", meta, rows, with_plot=False)
    md = (folder / "e2e.md").read_text()
    assert f"| {1e3 * r0['dense_s']:.2f} | {1e3 * r0['kascade_s']:.2f} | – |" in md  # kept and shown
    # a new run with settings replaces the old one of its strategy
    store.add_run(rows, r0, "dense", _run("dense", 1.0, 0.8, 0.2))
    assert r0["runs"]["dense"]["settings"]["gpu"] == "NVIDIA H200" and r0["dense_s"] == 1.0


def test_failure_notes_survive_later_successes():
    base = dict(model="qwen3-8b-random", metric="decode_step", context=131072, batch=6, notes=["qwen3: raised"])
    rows = []
    # kascade fails first, dense then succeeds: the failure stays next to the model note
    store.mark_skipped(rows, base, "kascade: out of memory: RESOURCE_EXHAUSTED")
    assert rows[0]["skipped"] == "kascade: out of memory: RESOURCE_EXHAUSTED"
    row = store.add_run(rows, base, "dense", _run("dense", 9e-3, 6e-3, 3e-3))
    assert "skipped" not in row and row["notes"] == ["qwen3: raised", "kascade: out of memory: RESOURCE_EXHAUSTED"]
    store.mark_skipped(rows, base, "kascade: RuntimeError: again")  # replaces kascade's older failure
    assert row["notes"] == ["qwen3: raised", "kascade: RuntimeError: again"]
    row = store.add_run(rows, base, "kascade", _run("kascade", 5e-3, 2e-3, 3e-3))
    assert row["notes"] == ["qwen3: raised"] and row["speedup"] == pytest.approx(9 / 5)
    # the reverse order: dense fails first, kascade succeeds; dense's reason is a note (the md shows it)
    rows = []
    store.mark_skipped(rows, base, "dense: out of memory: x")
    store.mark_skipped(rows, base, "dense_pallas: out of memory: y")  # another strategy's failure is kept too
    row = store.add_run(rows, base, "kascade", _run("kascade", 5e-3, 2e-3, 3e-3))
    assert "skipped" not in row
    assert row["notes"] == ["qwen3: raised", "dense: out of memory: x", "dense_pallas: out of memory: y"]
    md = tables.e2e_markdown(dict(runs=[], notes=[]), rows)
    assert "- dense: out of memory: x" in md and "| – | 5.00 | – |" in md
    row = store.add_run(rows, base, "dense", _run("dense", 9e-3, 6e-3, 3e-3))
    assert row["notes"] == ["qwen3: raised", "dense_pallas: out of memory: y"]
    # a planning reason (does not fit) on a measured row is a note; on an empty row it is replaced by a failure
    rows = []
    store.mark_skipped(rows, base, "does not fit one device")
    store.mark_skipped(rows, base, "kascade: out of memory")
    assert rows[0]["skipped"] == "kascade: out of memory" and rows[0]["notes"] == ["qwen3: raised"]


def test_untuned_gemms_are_flagged_and_recorded(monkeypatch, capsys):
    """The accuracy runner turns GEMM autotuning off; a timing taken so says so (warning, run line, header)."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert timing.xla_flags() == "" and timing.untuned_gemm_warning() is None
    assert timing.xla_flags_record() == {} and capsys.readouterr().err == ""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
    assert timing.untuned_gemm_warning() is None
    monkeypatch.setenv("XLA_FLAGS", " --xla_gpu_autotune_level=0 --xla_dump_to=/tmp/x ")
    assert "autotune_level=0" in timing.untuned_gemm_warning()
    assert timing.xla_flags() == "--xla_gpu_autotune_level=0 --xla_dump_to=/tmp/x"
    assert timing.xla_flags_record() == {"xla_flags": "--xla_gpu_autotune_level=0 --xla_dump_to=/tmp/x"}
    assert "warning: XLA_FLAGS turns GEMM autotuning off" in capsys.readouterr().err
    run = dict(date="d", gpu="NVIDIA H200", jax="0.11.2", command="bench", xla_flags=timing.xla_flags())
    md = tables.e2e_markdown(dict(runs=[run, dict(run, xla_flags="")], notes=[]), [])
    assert md.count("XLA_FLAGS `--xla_gpu_autotune_level=0 --xla_dump_to=/tmp/x`") == 1
    assert "JAX 0.11.2, one device, `bench`" in md  # the run without flags shows none
    head = tables._head("Paged", dict(run, title="x"))
    assert "XLA_FLAGS `--xla_gpu_autotune_level=0" in head[-1]


def test_noresume_keeps_the_other_rows_and_resume_checks_settings(tmp_path, monkeypatch):
    """run() on CPU (the GPU check lifted; a 1 ns deadline defers every measurement, so nothing is timed): the
    committed rows survive --noe2e_resume, and only runs of other settings are planned again."""
    folder, doc = _committed_copy(tmp_path)
    spec = em.ModelSpec("tiny-random", config_dict=dict(TINY_HF, hidden_size=128, intermediate_size=256,
                                                         num_hidden_layers=2, head_dim=32), anchors=(0,))
    mine = dict(model=spec.name, metric="decode_step", context=1024, batch=2, mesh=None, devices=1)
    settings = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__, topk_frac=0.1, min_k=128,
                    steps=(4, 12), seed=0, kascade_kw=dict(anchors=(0,), head_map=None), date="earlier")
    rows = doc["rows"]
    store.add_run(rows, mine, "dense", dict(_run("dense", 1e-3, 5e-4, 5e-4), settings=store.run_settings("dense",
                                                                                                      **settings)))
    store.add_run(rows, mine, "kascade", dict(_run("kascade", 1e-3, 5e-4, 5e-4),
                                            settings=store.run_settings("kascade", **dict(settings, topk_frac=0.2))))
    (folder / "e2e.json").write_text(json.dumps(doc))
    monkeypatch.setattr(e2e, "require_gpu", lambda: None)
    kw = dict(metrics=["decode"], contexts=[], decode_specs=[(1024, 2)], strategies=["dense", "kascade"],
              steps=(4, 12), out_dir=str(folder), deadline_s=1e-9)
    for resume, want in ((True, ["kascade"]), (False, ["dense", "kascade"])):
        log = []
        e2e.run([spec], resume=resume, log=log.append, **kw)
        assert [re.search(r"\) (\w+): predicted", m).group(1) for m in log if m.startswith("deferred")] == want, log
        meta, rows = store.load_e2e(str(folder), "e2e")
        assert len(rows) == len(doc["rows"]) and len(meta["runs"]) == len(doc["meta"]["runs"]) + 1
        for old, new in zip(doc["rows"][:-1], rows[:-1]):  # every committed row, its runs untouched
            assert store.row_key(old) == store.row_key(new) and old.get("runs", {}).keys() == new.get("runs", {}).keys()
            assert all(new["runs"][s]["wall_s"] == old["runs"][s]["wall_s"] for s in old.get("runs", {}))
        doc["meta"]["runs"] = meta["runs"]


def test_bad_values_name_their_flag(tmp_path):
    assert front.parse_contexts(["32768", " 65536"]) == [32768, 65536]
    for bad in ("x", "0", "-1", "1.5"):
        with pytest.raises(ValueError, match=rf"--e2e_contexts: .* got '{bad}'"):
            front.parse_contexts(["32768", bad])
    with pytest.raises(ValueError, match=r"--e2e_steps: .* got 'x' in '8,x'"):
        front.parse_steps(["8", "x"])
    with pytest.raises(ValueError, match=r"--e2e_decode"):
        front.parse_decode_specs(["32768:x"])
    # strategies and metrics are refused before the GPU check
    kw = dict(contexts=[32768], decode_specs=[], out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--e2e_strategies: unknown strategy 'sparse'"):
        e2e.run([em.SPECS["llama3.1-8b-random"]], metrics=["ttft"], strategies=["dense", "sparse"], **kw)
    with pytest.raises(ValueError, match="--e2e_metrics"):
        e2e.run([em.SPECS["llama3.1-8b-random"]], metrics=["tft"], strategies=["dense"], **kw)
    # a results file that is not JSON is an error naming it, never an empty start
    (tmp_path / "e2e.json").write_text('{"meta": {}, "rows": [')
    with pytest.raises(ValueError, match=r"e2e\.json is not valid JSON .* move it away"):
        store.load_e2e(str(tmp_path), "e2e")
    (tmp_path / "e2e_rows.json").write_text('{"meta": {}, "rows": [{"model": "m"}]}')
    with pytest.raises(ValueError, match="not an e2e benchmark file"):
        store.load_e2e(str(tmp_path), "e2e_rows")
    res = cli_fork.run(["-m", "experiments.bench", "--phase=e2e", "--e2e_contexts=32768,x"], cli_fork.ENV, cwd=ROOT)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and err and err[-1].startswith("error: --e2e_contexts:") and "'x'" in err[-1], \
        res.stderr[-2000:]


def test_a_decode_step_lost_in_noise_fails_with_its_numbers(rng):
    t1 = float(rng.uniform(0.5, 1.0))
    step = float(rng.uniform(1e-3, 1e-2))
    kernels = {"gemm": step * 0.9}
    assert e2e.decode_step_s({8: t1, 40: t1 + 32 * step}, kernels, 8, 40) == pytest.approx(step)
    for t2 in (t1 - 1e-4, t1):
        with pytest.raises(RuntimeError, match=r"not positive: wall t\(40\) = .* t\(8\) = .*--e2e_steps"):
            e2e.decode_step_s({8: t1, 40: t2}, kernels, 8, 40)
    with pytest.raises(RuntimeError, match="kernels per step"):
        e2e.decode_step_s({8: t1, 40: t1 + 32 * step}, {"gemm": -1e-6}, 8, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("mesh_text", [None, "data:1,model:1"])
def test_gpu_smoke_small_shape(tmp_path, mesh_text):
    """One GPU, unsharded and on a mesh of size 1 (the sharded code path: per-shard attention, laid-out caches)."""
    from models.sharding import parse_mesh

    mesh = parse_mesh(mesh_text)
    stem = "e2e_smoke" if mesh is None else "e2e_mesh-data1-model1"
    spec = em.ModelSpec("tiny-random", config_dict=TINY_HF, anchors=(0, 2))
    kw = dict(metrics=["ttft", "decode"], contexts=[2048], decode_specs=[(2048, 2), (2048, 100000)],
              strategies=["dense", "kascade", "dense_pallas"], steps=(4, 12), iterations=2, wall_repeats=1,
              out_dir=str(tmp_path), tag="smoke" if mesh is None else "", mesh=mesh)
    rows = e2e.run([spec], **kw)
    assert all(r["mesh"] == mesh_text and r["devices"] == 1 for r in rows)
    done = [r for r in rows if "runs" in r]
    assert {(r["metric"], r["batch"]) for r in done} == {("ttft", 1), ("decode_step", 2)}
    for r in done:
        for s, run in r["runs"].items():
            assert run["wall_s"] > 0 and run["kernel_s"] > 0 and run["attention_s"] > 0, (r["metric"], s, run)
        assert r["speedup"] is not None and 0 < r["attention_share_dense"] < 1
    assert any("does not fit" in r.get("skipped", "") for r in rows)
    dec = next(r for r in done if r["metric"] == "decode_step")
    assert any(name == "kascade_dense_decode" for name, _, _ in dec["runs"]["dense_pallas"]["top"])
    assert dec["runs"]["kascade"]["categories"]["attention"] > 0
    assert not any(name.startswith("kascade_") for name, _, _ in dec["runs"]["dense"]["top"])
    assert (tmp_path / f"{stem}.md").exists() and (tmp_path / f"{stem}.png").exists()
    again = e2e.run([spec], **kw)  # resume: nothing left to measure, the same rows come back
    assert [r.get("runs", {}).keys() for r in again] == [r.get("runs", {}).keys() for r in rows]
    prof = e2e.profile(spec, 2048, 2, ["dense", "kascade"], steps=(4, 12), out_dir=str(tmp_path), mesh=mesh)
    assert prof["mesh"] == mesh_text
    assert set(prof["strategies"]) == {"dense", "kascade"}
    assert len(prof["strategies"]["kascade"]["top"]) > 0


def test_prepared_programs_are_the_product_path(rng):
    """The measured TTFT program gives the product's first token (prefill + greedy sample); the measured decode
    program runs exactly the requested steps; compiling on threads gives the same programs."""
    from models import generate as gen
    from models.cache import KVCache

    small = dict(TINY_HF, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=64, num_attention_heads=4)
    cfg, _ = em.load_shape_config(em.ModelSpec("tiny", config_dict=small))
    model = em.random_model(cfg, jnp.float32, int(rng.integers(1 << 20)))
    strats = em.make_strategies(["dense", "kascade"], cfg, dict(anchors=(0,), head_map=None), 0.25, 16)
    ctx, seed = 128, int(rng.integers(1 << 20))
    for name, strategy in strats.items():
        prep = e2e.prepare_ttft(model, strategy, ctx, seed)
        tok, cache = prep.compiled(*prep.args)
        tokens = np.asarray(prep.args[1])
        logits, _ = gen.prefill(model, tokens, [ctx], KVCache.init(cfg, 1, ctx, jnp.float32), strategy, chunk_size=ctx)
        assert int(tok[0]) == int(np.argmax(np.asarray(logits)[0])), name
        assert cache.k[0].shape == (1, ctx, cfg.kv_heads, cfg.head_dim)
    jobs = [(n, lambda s=s: e2e.prepare_decode(model, s, ctx, 2, (2, 5), seed)) for n, s in strats.items()]
    serial, threaded = e2e.prepare_all(jobs, 1), e2e.prepare_all(jobs, 2, log=lambda *a: None)
    for name in strats:
        out_a, n_a = serial[name].compiled(*serial[name].args, jnp.int32(5))
        out_b, n_b = threaded[name].compiled(*threaded[name].args, jnp.int32(5))
        assert int(n_a) == int(n_b) == 5 and np.array_equal(np.asarray(out_a), np.asarray(out_b))
        out = np.asarray(out_a)
        assert np.all((out[:, :5] >= 0) & (out[:, :5] < cfg.vocab)) and np.all(out[:, 5:] == -1)
        out3, n3 = serial[name].compiled(*serial[name].args, jnp.int32(3))
        assert int(n3) == 3 and np.array_equal(np.asarray(out3)[:, :3], out[:, :3])  # the same steps, fewer of them
    with pytest.raises(ValueError, match="must exceed the step count"):
        e2e.prepare_decode(model, strats["dense"], 8, 1, (4, 8), seed)
    bad = e2e.prepare_all([("x", lambda: e2e.prepare_decode(model, strats["dense"], 8, 1, (4, 8), seed))], 1)
    assert isinstance(bad["x"], ValueError)


def test_the_real_model_gets_its_shipped_recipe():
    """What bench e2e builds for the real model: calibration.resolve.recipe_kascade, never calibrating."""
    from kascade_jax.calibration.resolve import recipe_kascade
    from kascade_jax.registry import make_strategy

    kw, note = recipe_kascade("qwen2.5-coder-1.5b", 28, 2, dtype="bfloat16", calibrate=False)
    assert kw["anchors"] == (0, 2, 5, 14, 27) and len(kw["head_map"]) == 28 and all(len(r) == 2 for r in kw["head_map"])
    assert (kw["sink_tokens"], kw["recent_window"]) == (4, 60) and "default" in note
    assert kw["decode_only"] is True  # the 1.5B's default since issue 21's third dev round: dense prefill
    strategy = make_strategy("kascade", 28, 2, topk_frac=0.1, min_k=128, kernels="pallas", **kw)
    assert strategy.config.anchors == (0, 2, 5, 14, 27)
    with pytest.raises(ValueError):
        recipe_kascade("qwen2.5-coder-1.5b", 30, 2, dtype="bfloat16", calibrate=False)  # wrong model shape


# ---------------------------------------------------------------------------------------------------------------
# The measured programs on a mesh: 8 simulated CPU devices (in a subprocess, see tests/models/test_sharding.py)
# ---------------------------------------------------------------------------------------------------------------

needs8 = pytest.mark.skipif("len(jax.devices()) < 8", reason="needs 8 (simulated) devices")
MESH_HF = dict(TINY_HF, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32,
               num_attention_heads=8, num_key_value_heads=4, vocab_size=256)


def _lively(model):
    """Scale the 0.02 random weights up (elementwise, so a sharded parameter keeps its sharding): at 0.02 every
    position emits the same token, and the tokens would not depend on attention."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, var in flat:
        v = var.get_value()
        if str(path[-1]) == "kernel":
            var.set_value(v * (1.5 / np.sqrt(v.shape[0]) / 0.02))
        elif str(path[-1]) == "embedding":
            var.set_value(v * 50.0)
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def _mesh_strategies(cfg):
    from kascade_jax.registry import make_strategy

    return dict(dense=make_strategy("dense", cfg.num_layers, cfg.kv_heads),
                kascade=make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=0.1, min_k=8, anchors=(0,),
                                      kernels="reference"))


@functools.cache
def _unsharded(name: str, program: str):
    """The unsharded model's outputs (host arrays) of one program, the same for every mesh below: computed once
    (its TTFT and decode-loop programs were compiled and run again for each mesh, test time, issue 24)."""
    cfg, _ = em.load_shape_config(em.ModelSpec("tiny", config_dict=MESH_HF))
    seed, ctx, batch = 3, 256, 4
    plain = _lively(em.random_model(cfg, jnp.float32, seed))
    assert getattr(plain, "mesh", None) is None
    strategy = _mesh_strategies(cfg)[name]
    if program == "decode":
        want = e2e.prepare_decode(plain, strategy, ctx, batch, (2, 5), seed)
        out, n = want.compiled(*want.args, jnp.int32(5))
        return np.asarray(out), int(n)
    want = e2e.prepare_ttft(plain, strategy, ctx, seed)
    tok, cache = want.compiled(*want.args)
    return int(tok[0]), np.asarray(cache.k[-1])


@needs8
@pytest.mark.parametrize("shape", [(1, 2), (2, 1), (2, 4)])
def test_mesh_programs_equal_unsharded(shape):
    """The bench's TTFT and decode-loop programs with the random model created on a (data, model) mesh give the
    unsharded first token and decode tokens, dense and Kascade; parameters and caches have the mesh's layout."""
    from jax.sharding import NamedSharding

    from models import sharding

    cfg, _ = em.load_shape_config(em.ModelSpec("tiny", config_dict=MESH_HF))
    mesh = sharding.make_mesh(*shape)
    seed, ctx, batch = 3, 256, 4
    placed = _lively(em.random_model(cfg, jnp.float32, seed, mesh=mesh))
    assert placed.mesh is mesh
    flat = nnx.to_flat_state(nnx.state(placed, nnx.Param))
    for path, var in flat:
        x = var.get_value()
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, sharding.param_spec(path, x.shape, cfg, mesh)), x.ndim)
    dev0 = mesh.devices.flat[0]
    on_dev0 = sum(sh.data.nbytes for _, v in flat for sh in v.get_value().addressable_shards if sh.device == dev0)
    assert em.device_weight_bytes(cfg, mesh, itemsize=4) == on_dev0
    strats = _mesh_strategies(cfg)
    kv = NamedSharding(mesh, sharding.CACHE_SPEC)
    for name, strategy in strats.items():
        if name == "dense" and shape != (2, 4):  # (dense attention is Kascade's layer 0 here: one mesh for it)
            continue
        out_w, n_w = _unsharded(name, "decode")
        got = e2e.prepare_decode(placed, strategy, ctx, batch, (2, 5), seed)
        out_g, n_g = got.compiled(*got.args, jnp.int32(5))
        assert int(n_w) == int(n_g) == 5
        assert np.array_equal(np.asarray(out_g), np.asarray(out_w)), (name, shape)
        assert len(set(np.asarray(out_w)[:, :5].ravel().tolist())) > 2, "tokens do not depend on the input"
        if shape[0] > 1:
            with pytest.raises(ValueError, match="does not divide the batch of 1"):
                e2e.prepare_ttft(placed, strategy, ctx, seed)
            with pytest.raises(ValueError, match="does not divide the batch of 3"):
                e2e.prepare_decode(placed, strategy, ctx, 3, (2, 5), seed)
            continue
        tok_w, k_last_w = _unsharded(name, "ttft")
        got = e2e.prepare_ttft(placed, strategy, ctx, seed)
        tok_g, cache_g = got.compiled(*got.args)
        assert int(tok_g[0]) == tok_w, (name, shape)
        assert cache_g.k[0].sharding.is_equivalent_to(kv, 4) and cache_g.v[-1].sharding.is_equivalent_to(kv, 4)
        np.testing.assert_allclose(np.asarray(cache_g.k[-1]), k_last_w, rtol=1e-4, atol=1e-4)


def test_on_8_simulated_cpu_devices():
    """The 8-device tests of this file in a subprocess with 8 simulated CPU devices."""
    if jax.default_backend() != "cpu":
        pytest.skip("the simulated-device tier runs on CPU")
    if len(jax.devices()) >= 8:
        pytest.skip("this process already has 8 devices: the tests ran directly")
    res, tail = run_on_8_simulated_devices(__file__, "mesh_programs_equal_unsharded", timeout=600)
    assert res.returncode == 0, tail
    summary = res.stdout.strip().splitlines()[-1]
    assert "3 passed" in summary and "failed" not in summary and "skipped" not in summary, summary


def test_decode_program_with_the_fp8_k_copy(rng):
    """decode_score_fp8 through the measured decode program: the filled cache gets the copies a prefill would leave
    (`with_prompt_state`: fp8_decode_keys of each anchor's rows) and the steps run; a state of another kind is
    refused by name."""
    from kernels_pallas.reference import fp8_decode_keys
    from models.cache import KVCache

    small = dict(TINY_HF, hidden_size=128, intermediate_size=256, num_hidden_layers=3, head_dim=64, num_attention_heads=4)
    cfg, _ = em.load_shape_config(em.ModelSpec("tiny", config_dict=small))
    model = em.random_model(cfg, jnp.float32, int(rng.integers(1 << 20)))
    kw = dict(anchors=(0, 1), head_map=None, decode_score_fp8=True)
    st = em.make_strategies(["kascade"], cfg, kw, 0.25, 16)["kascade"]
    k = [jax.random.normal(jax.random.key(i), (2, 128, cfg.kv_heads, cfg.head_dim)) for i in range(3)]
    cache = KVCache(k=tuple(k), v=tuple(k), lengths=jnp.asarray([100, 60], jnp.int32))
    state = e2e.with_prompt_state(st, cache, cfg).strategy_state
    assert state[0] is None and state[2] is None
    want = fp8_decode_keys(k[1], cache.lengths)
    np.testing.assert_array_equal(np.asarray(state[1]["k8"].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)))
    prep = e2e.prepare_decode(model, st, 128, 2, (2, 5), 3)
    out, n = prep.compiled(*prep.args, jnp.int32(5))
    assert int(n) == 5 and np.all((np.asarray(out)[:, :5] >= 0))
    pk = em.make_strategies(["kascade"], cfg, dict(anchors=(0,), head_map=None, decode_only=True,
                                                   decode_prefill_keys=0.1), 0.25, 16)["kascade"]
    with pytest.raises(ValueError, match="build no decode_prefill_keys state"):
        e2e.with_prompt_state(pk, cache, cfg)


def test_e2e_recipe_is_checked_before_the_gpu():
    """--e2e_recipe: an unknown recipe names the flag, and a recipe other than the default needs its own --e2e_tag
    (else it would be measured over the default recipe's rows of e2e.json); both before any device is touched."""
    base = ["-m", "experiments.bench", "--phase=e2e", "--e2e_models=qwen2.5-coder-0.5b", "--e2e_out=/nonexistent"]
    res = cli_fork.run([*base, "--e2e_recipe=candidate:no_such", "--e2e_tag=x"], cli_fork.ENV, cwd=ROOT)
    assert res.returncode == 2 and "--e2e_recipe=candidate:no_such" in res.stderr, res.stderr[-2000:]
    res = cli_fork.run([*base, "--e2e_recipe=candidate:dps_rr4"], cli_fork.ENV, cwd=ROOT)
    assert res.returncode == 2 and "needs its own --e2e_tag" in res.stderr, res.stderr[-2000:]
    res = cli_fork.run([*base, "--e2e_anchor_backend=mgpu"], cli_fork.ENV, cwd=ROOT)  # the anchor A/B, the same way
    assert res.returncode == 2 and "--e2e_anchor_backend=mgpu needs its own --e2e_tag" in res.stderr, res.stderr[-2000:]
    res = cli_fork.run([*base, "--e2e_decode_score_fp8"], cli_fork.ENV, cwd=ROOT)
    assert res.returncode == 2 and "--e2e_decode_score_fp8 needs its own --e2e_tag" in res.stderr, res.stderr[-2000:]
    res = cli_fork.run([*base, "--e2e_prefill_key_block=16"], cli_fork.ENV, cwd=ROOT)
    assert res.returncode == 2 and "--e2e_prefill_key_block=16 needs its own --e2e_tag" in res.stderr, \
        res.stderr[-2000:]
    assert "qwen2.5-coder-0.5b" in em.SPECS and not em.SPECS["qwen2.5-coder-0.5b"].random
