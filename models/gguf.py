"""Read a GGUF file (llama.cpp's format) as an HF-style checkpoint: config dict + lazily dequantized tensors.

What it does:
- parses the header itself (gguf-py's GGUFReader is 5-10x slower on big vocabularies) and memory-maps the data,
  so nothing is read or dequantized up front;
- builds an HF `config.json`-style dict from the `{arch}.*` / `tokenizer.ggml.*` metadata (a `rope_freqs` tensor,
  llama.cpp's form of Llama 3.x RoPE scaling, is turned back into HF `llama3` rope parameters);
- maps GGUF tensor names to HF names (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
- dequantizes on access with `gguf.quants.dequantize` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants,
  the IQ types, ... whatever the installed gguf-py can dequantize) into float32 `(out, in)` arrays, i.e. HF shapes;
- undoes llama.cpp's Q/K row permutation for arch `llama` (see `unpermute_rows`), so the weights use HF's
  rotate_half RoPE convention like every other checkpoint in this repo.

What it deliberately does not do: keep weights packed (we always dequantize), support MoE / multimodal / non
Llama-Qwen architectures (they fail loudly with the offending tensor or arch named), or write GGUF files.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

_HF_ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Per-block GGUF tensor stem -> HF module path inside `model.layers.N.`.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that carry no weights the HF model has (RoPE caches); we skip them, except
# rope_freqs, which holds llama3-style frequency factors and is turned into config (see `gguf_config`).
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _open_error(path: str, why: str) -> ValueError:
    return ValueError(f"{path!r} is not a readable GGUF file: {why}")


# GGUF value types (gguf.GGUFValueType): fixed-size scalars by numpy dtype; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ne: tuple[int, ...]  # GGUF order (fastest dimension first): reversed numpy / HF shape
    qtype: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


class _Cursor:
    """Little-endian reader over the file bytes; struct.error / EOFError on running off the end."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise EOFError("string runs past the end of the file")
        s = str(self.buf[self.pos : self.pos + n], "utf-8")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub, n = self.scalar("<I"), self.scalar("<Q")
            if sub in _SCALARS:  # numeric arrays (token types, scores) in one go
                dt = np.dtype(_NUMPY[sub])
                if self.pos + n * dt.itemsize > len(self.buf):
                    raise EOFError("array runs past the end of the file")
                arr = np.frombuffer(self.buf, dt, n, self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self.value(sub) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo], np.memmap]:
    """(metadata, {gguf_name: GGUFTensorInfo}, memory map) of a GGUF v2/v3 file.

    Our own header parser: gguf-py's GGUFReader builds a numpy view per field part (~250k of them for a 49k
    vocabulary), which costs 2-10 s; this reads the same header in well under a second. Tensor data stays in
    the memory map until a loader slices it.
    """
    import gguf

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise _open_error(path, f"bad magic {magic!r} (expected b'GGUF')")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        cur = _Cursor(memoryview(mm))
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (supported: 2, 3; big-endian files are not)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        if n_tensors > size or n_kv > size:
            raise ValueError(f"implausible header counts (tensors={n_tensors}, kv={n_kv})")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
            ne = tuple(cur.scalar("<Q") for _ in range(n_dims))
            qtype, offset = cur.scalar("<I"), cur.scalar("<Q")
            infos.append((name, ne, qtype, offset))
    except (ValueError, EOFError, struct.error, UnicodeDecodeError) as e:
        raise _open_error(path, f"corrupt or truncated header ({type(e).__name__}: {e})") from e
    align = int(meta.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors = {}
    for name, ne, qtype, offset in infos:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except (ValueError, KeyError) as e:
            raise _open_error(path, f"tensor {name!r} has unknown quantization type id {qtype}") from e
        n = int(np.prod(ne)) if ne else 1
        if not ne or ne[0] % block:
            raise _open_error(path, f"tensor {name!r} row length {ne[:1]} is not a multiple of block size {block}")
        nbytes = n // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise _open_error(
                path, f"tensor {name!r} needs bytes [{start}, {start + nbytes}) but the file has {size} (truncated?)"
            )
        tensors[name] = GGUFTensorInfo(name, ne, qtype, start, nbytes)
    return meta, tensors, mm


def gguf_metadata(path: str) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (vocabulary, chat template, hyper-parameters)."""
    return read_gguf(path)[0]


def _dequantizable(qtype) -> bool:
    import gguf
    from gguf import quants

    return qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or qtype in quants._type_traits


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation (GGUF -> HF), for weights `(n_head*hd, in)` or biases `(n_head*hd,)`.

    llama.cpp reorders each head's rows so RoPE can rotate adjacent pairs (2i, 2i+1); HF rotates (i, i+hd/2).
    Inside head h: HF row r = GGUF row 2r and HF row r + hd/2 = GGUF row 2r + 1.
    """
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads with an even head_dim")
    hd = rows // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, hd // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF (llama.cpp's converter); the inverse of `unpermute_rows`. Used by tests."""
    rows = w.shape[0]
    hd = rows // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def hf_name(gguf_name: str, path: str) -> str | None:
    """HF name for a GGUF tensor name; None for tensors we skip; ValueError for ones we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _IGNORED:
        return None
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        if parts[3] in ("weight", "bias"):
            return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(
        f"{path!r}: unsupported GGUF tensor {gguf_name!r} (only dense Llama/Qwen2/Qwen3 decoder tensors are "
        f"supported: {sorted(_BLOCK_NAMES)} per block, {sorted(_GLOBAL_NAMES)})"
    )


def gguf_config(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: str, rope_freqs=None) -> dict:
    """HF config.json-style dict from GGUF metadata and the (GGUF-named) tensor shapes."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path!r}: unsupported GGUF architecture {arch!r}; supported: {list(SUPPORTED_ARCHS)}")

    def key(name, default=None, required=False):
        full = f"{arch}.{name}"
        if full not in meta:
            if required:
                raise ValueError(f"{path!r}: GGUF metadata is missing required key {full!r}")
            return default
        value = meta[full]
        if isinstance(value, list):  # per-layer values (hybrid models); fine only when all layers agree
            if len(set(value)) != 1:
                raise ValueError(f"{path!r}: per-layer {full!r} = {value[:8]}... is not supported")
            value = value[0]
        return value

    hidden = int(key("embedding_length", required=True))
    n_head = int(key("attention.head_count", required=True))
    n_kv = int(key("attention.head_count_kv", n_head))
    head_dim = int(key("attention.key_length", hidden // n_head))
    rot = key("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(
            f"{path!r}: partial rotary embeddings (rope.dimension_count={rot} != head_dim={head_dim}) are not supported"
        )
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path!r}: GGUF has no token_embd.weight tensor")
    vocab = int(shapes["token_embd.weight"][0])
    n_tokens = len(meta.get("tokenizer.ggml.tokens", ())) or vocab
    theta = float(key("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": [_HF_ARCH_CLASS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", 2048)),
        # Stored as f32 in the file (1e-5 -> 9.999999747e-06); kept as-is, like transformers does.
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": None,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in shapes,
        "vocab_size": vocab,
        "torch_dtype": "float32",
    }
    if n_tokens != vocab:
        cfg["tokenizer_vocab_size"] = n_tokens  # padded embedding (common for Qwen): logits wider than vocab
    for hf_key, gg_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
        ("unk_token_id", "unknown_token_id"),
    ):
        if f"tokenizer.ggml.{gg_key}" in meta:
            cfg[hf_key] = int(meta[f"tokenizer.ggml.{gg_key}"])

    scaling_type = key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = float(key("rope.scaling.factor", 1.0))
        scaling = {"rope_type": scaling_type, "factor": factor}
        orig = key("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = scaling
    if rope_freqs is not None:
        # llama.cpp stores llama3-style scaling as per-frequency divisors, not as config: inv_freq[i] =
        # theta**(-2i/hd) / freq_factors[i]. We recover HF's llama3 parameters when they reproduce the factors;
        # otherwise the raw factors are passed on (a model that does not know "freq_factors" must refuse them).
        if cfg["rope_scaling"] is not None:
            raise ValueError(f"{path!r}: both rope.scaling.* metadata and a rope_freqs tensor; not supported")
        factors = np.asarray(rope_freqs, np.float64).reshape(-1)
        if factors.shape != (head_dim // 2,):
            raise ValueError(f"{path!r}: rope_freqs has {factors.size} entries, expected head_dim/2 = {head_dim // 2}")
        cfg["rope_scaling"] = _llama3_from_factors(factors, theta, head_dim) or {
            "rope_type": "freq_factors", "freq_factors": [float(x) for x in factors]
        }
    params = {"rope_theta": theta, "rope_type": "default"}
    if cfg["rope_scaling"] is not None:
        params.update(cfg["rope_scaling"])
    cfg["rope_parameters"] = params  # transformers v5 spelling of the same information
    return cfg


def llama3_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_max_position_embeddings: int) -> np.ndarray:
    """Per-frequency divisors of HF's llama3 RoPE scaling (what llama.cpp's converter writes as rope_freqs)."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    orig = original_max_position_embeddings
    smooth = (orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high_freq_factor, 1.0, np.where(wavelen > orig / low_freq_factor, factor, mid))


def _llama3_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """HF llama3 rope parameters reproducing `factors`, or None. Only orig/(high-low) and low/(high-low) are
    identifiable, so low_freq_factor is fixed to 1 (Llama 3.x's value); needs >= 2 factors in the smooth band."""
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_wavelen = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * np.pi)
    band = (factors > 1.0 + 1e-4) & (factors < factor * (1 - 1e-4))
    if band.sum() < 2:
        return None
    s = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)  # s = a / wavelen + b
    a, b = np.polyfit(inv_wavelen[band], s, 1)
    if b >= 0 or a <= 0:
        return None
    high = 1.0 - 1.0 / b
    orig = a * (high - 1.0)
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(round(high, 4)),
        "original_max_position_embeddings": int(round(orig)),
    }
    check = llama3_factors(theta, head_dim, **{k: v for k, v in params.items() if k != "rope_type"})
    return params if np.allclose(check, factors, rtol=1e-4, atol=1e-6) else None


def load_gguf(path: str) -> tuple[dict, dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]], dict]:
    """(config, {hf_name: (shape, loader)}, metadata) for a GGUF file; loaders dequantize to float32."""
    import gguf
    from gguf import dequantize

    meta, by_name, mm = read_gguf(path)
    Q = gguf.GGMLQuantizationType
    for name, t in by_name.items():
        if not _dequantizable(Q(t.qtype)):
            raise ValueError(
                f"{path!r}: tensor {name!r} has quantization type {Q(t.qtype).name}, which the installed gguf-py "
                f"({_gguf_version()}) cannot dequantize"
            )
    shapes = {name: t.shape for name, t in by_name.items()}

    def raw(t: GGUFTensorInfo) -> np.ndarray:
        data = mm[t.offset : t.offset + t.nbytes]
        qtype = Q(t.qtype)
        if qtype == Q.F32:
            return np.array(data.view(np.float32).reshape(t.shape))  # copy: do not hand out the read-only map
        if qtype == Q.F16:
            return data.view(np.float16).astype(np.float32).reshape(t.shape)
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
        w = dequantize(data.reshape(rows, t.nbytes // rows), qtype)  # [rows, ne0] float32
        return np.asarray(w, dtype=np.float32).reshape(t.shape)

    rope_freqs = raw(by_name["rope_freqs.weight"]) if "rope_freqs.weight" in by_name else None
    config = gguf_config(meta, shapes, path, rope_freqs)
    permute_heads = {}
    if config["model_type"] == "llama":
        permute_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    tensors = {}
    for name, t in by_name.items():
        target = hf_name(name, path)
        if target is None:
            continue
        n_head = permute_heads.get(name.split(".")[2]) if name.startswith("blk.") else None

        def load(t=t, n_head=n_head):
            w = raw(t)
            return unpermute_rows(w, n_head) if n_head else w

        tensors[target] = (shapes[name], load)
    return config, tensors, meta


def _gguf_version() -> str:
    try:
        import importlib.metadata

        return "gguf " + importlib.metadata.version("gguf")
    except Exception:
        return "gguf"
