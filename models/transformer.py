"""Flax NNX decoder for the Llama / Qwen2 / Qwen3 family: GQA, RMSNorm, SwiGLU, RoPE (rotate_half convention).

The layer stack is an unrolled Python loop. Every layer's attention goes through `strategy.attend(layer, inputs,
state)` (models/attention.py), and the loop threads `state` from layer to layer, so a strategy can make each layer
dense, an anchor or a reuse layer without the model knowing; a strategy's per-layer entries that must outlive one
forward ride in the cache (`KVCache.strategy_state`, updated through `strategy.update_cache_state`). Parameter names mirror HF (`q_proj`, `input_layernorm`,
...) so checkpoint mapping is mechanical. Linear kernels are stored `(in, out)`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import AttentionInputs, check_no_cache_state, check_supports_paged
from models.cache import KVCache, write_chunk, write_token
from models.config import ModelConfig, RopeConfig
from models.paged import write_paged
from models.sharding import attend_per_shard


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * xf.astype(self.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int):
    inv = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return jnp.where(medium, smoothed, scaled)
    return inv


def apply_rope(x, positions, inv_freq):
    """x [batch, T, heads, d], positions [batch, T] -> rotated x (HF rotate_half pairs (i, i + d/2))."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, T, d/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


def _two_rows(f, x):
    """f(x) for x [..., features], with a single-row x padded to two rows on the way in.

    XLA rewrites a dot whose left operand is one row into multiply + reduce fusions, which ran at about half the
    H200's bandwidth: a decode step of the 8B Llama shape at 128K, batch 1 took 12.7 ms, 8.9 ms with this padding
    (byte floor 7.7 ms; benchmarks/NOTES.md, "e2e decode overhead"). The weights' bytes dominate a one-row matmul,
    so the padding row costs nothing measurable, and rows are independent, so row 0 is unchanged.
    """
    lead = x.shape[:-1]
    if math.prod(lead) != 1:
        return f(x)
    y = f(jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0))))
    return y[:1].reshape(*lead, y.shape[-1])


class Linear(nnx.Linear):
    """nnx.Linear that keeps one-row inputs (decode at batch 1) on the GEMM path (see `_two_rows`)."""

    def __call__(self, x):
        return _two_rows(super().__call__, x)


def _linear(i, o, bias, dtype, param_dtype, rngs):
    return Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02), precision=jax.lax.Precision.HIGHEST)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs):
        d, hq, hk = cfg.head_dim, cfg.q_heads, cfg.kv_heads
        self.q_proj = _linear(cfg.hidden, hq * d, cfg.qkv_bias, dtype, param_dtype, rngs)
        self.k_proj = _linear(cfg.hidden, hk * d, cfg.qkv_bias, dtype, param_dtype, rngs)
        self.v_proj = _linear(cfg.hidden, hk * d, cfg.qkv_bias, dtype, param_dtype, rngs)
        self.o_proj = _linear(hq * d, cfg.hidden, False, dtype, param_dtype, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(d, cfg.rms_eps, dtype=dtype, param_dtype=param_dtype)
        self.cfg = cfg

    def __call__(self, layer, x, positions, k_cache, v_cache, meta, strategy, state, inv_freq, mesh=None,
                 cache_state=None):
        """Returns (out, k_cache, v_cache, state, cache_state): cache_state is the layer's entry of the strategy's
        cache state, updated by strategy.update_cache_state before attend, which sees the update (None passes
        through)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.q_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        page_table = meta.get("page_table")
        if mesh is not None:  # cache write + attention per shard of the mesh (models/sharding.py)
            if page_table is not None:
                raise ValueError("a paged KV cache on a device mesh is not supported; use the contiguous KVCache "
                                 "with --mesh, or the paged cache on one device")
            out, k_cache, v_cache, state = attend_per_shard(mesh, strategy, layer, q, k, v, k_cache, v_cache, meta,
                                                            state)
            out = self.o_proj(out.astype(x.dtype).reshape(b, t, cfg.q_heads * cfg.head_dim))
            return out, k_cache, v_cache, state, cache_state
        if page_table is not None:  # paged cache: k_cache / v_cache are this layer's pools
            k_cache, v_cache = (write_paged(k_cache, k, page_table, positions),
                                write_paged(v_cache, v, page_table, positions))
        elif meta["phase"] == "decode":
            k_cache, v_cache = write_token(k_cache, k, meta["q_start"]), write_token(v_cache, v, meta["q_start"])
        else:
            k_cache, v_cache = write_chunk(k_cache, k, meta["offset"]), write_chunk(v_cache, v, meta["offset"])
        inputs = AttentionInputs(q=q, k_cache=k_cache, v_cache=v_cache, q_start=meta["q_start"], kv_len=meta["kv_len"],
                                 seq_len=meta["seq_len"], phase=meta["phase"], chunk_at_zero=meta["chunk_at_zero"],
                                 page_table=page_table, cache_state=cache_state)
        if cache_state is not None:
            cache_state = strategy.update_cache_state(layer, inputs)
            inputs = dataclasses.replace(inputs, cache_state=cache_state)
        out, state = strategy.attend(layer, inputs, state)
        out = self.o_proj(out.astype(x.dtype).reshape(b, t, cfg.q_heads * cfg.head_dim))
        return out, k_cache, v_cache, state, cache_state


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs):
        self.gate_proj = _linear(cfg.hidden, cfg.ffn, False, dtype, param_dtype, rngs)
        self.up_proj = _linear(cfg.hidden, cfg.ffn, False, dtype, param_dtype, rngs)
        self.down_proj = _linear(cfg.ffn, cfg.hidden, False, dtype, param_dtype, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs):
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype=dtype, param_dtype=param_dtype)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(cfg.vocab, cfg.hidden, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype=dtype, param_dtype=param_dtype)
        self.lm_head = None if cfg.tie_embeddings else _linear(cfg.hidden, cfg.vocab, False, dtype, param_dtype, rngs)
        self.mesh = None  # a jax.sharding.Mesh once models.sharding.shard_model placed the model (static)

    def logits(self, x):
        """Normed hidden states [..., hidden] -> fp32 logits [..., vocab].

        Tied embeddings in bf16/fp16: one dot in the parameter dtype with fp32 accumulation and output. Products of
        two bf16/fp16 numbers are exact in fp32, so this equals upcasting both operands first up to the summation
        order, without writing an fp32 copy of the whole [vocab, hidden] matrix every decode step."""
        if self.lm_head is not None:
            return self.lm_head(x).astype(jnp.float32)
        emb = self.embed_tokens.embedding[...]  # [vocab, hidden]
        if emb.dtype == jnp.float32 or x.dtype != emb.dtype:
            dot = lambda h: jnp.dot(h.astype(jnp.float32), emb.astype(jnp.float32).T,  # noqa: E731
                                    precision=jax.lax.Precision.HIGHEST)
        else:
            dot = lambda h: jnp.dot(h, emb.T, precision=jax.lax.Precision.HIGHEST,  # noqa: E731
                                    preferred_element_type=jnp.float32)
        return _two_rows(dot, x)

    def __call__(self, tokens, cache: KVCache, strategy, meta, *, last_only=None):
        """tokens [batch, T]; meta: phase and chunk_at_zero (static), offset (prefill chunk start), q_start/kv_len/
        seq_len/lengths ([batch] int32).

        Returns (logits [batch, T, vocab] fp32 (or [batch, vocab] at rows `last_only`), new cache, strategy state).
        """
        cfg = self.config
        b, t = tokens.shape
        positions = meta["q_start"][:, None] + jnp.arange(t)[None, :]
        inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        x = self.embed_tokens(tokens)
        state = None
        page_table = getattr(cache, "page_table", None)  # a models.paged.PagedKVCache has one
        if page_table is not None:
            check_supports_paged(strategy)
            check_no_cache_state(strategy, "paged caches", paged=True)
        if self.mesh is not None:
            check_no_cache_state(strategy, "a mesh")
        meta = dict(meta, page_table=page_table)
        ks, vs = list(cache.k), list(cache.v)
        cstate = getattr(cache, "strategy_state", None)  # per layer, carried across forwards (models/cache.py)
        cs = [None] * len(self.layers) if cstate is None else list(cstate)
        for i, layer in enumerate(self.layers):  # unrolled: each layer's role is a trace-time Python fact
            h = layer.input_layernorm(x)
            attn, ks[i], vs[i], state, cs[i] = layer.self_attn(i, h, positions, ks[i], vs[i], meta, strategy, state,
                                                               inv_freq, self.mesh, cs[i])
            post = getattr(strategy, "post_attention", None)
            if post is not None:
                state = post(i, x, attn, state)
            x = x + attn
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if last_only is not None:
            x = jnp.take_along_axis(x, last_only[:, None, None], axis=1)[:, 0]
        logits = self.logits(self.norm(x))
        new_cache = dataclasses.replace(cache, k=tuple(ks), v=tuple(vs), lengths=meta["lengths"])
        if cstate is not None:
            new_cache = dataclasses.replace(new_cache, strategy_state=tuple(cs))
        return logits, new_cache, state
