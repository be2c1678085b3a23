"""Helpers for the kascade_jax tests: random per-layer attention inputs and a model-like layer loop."""

import dataclasses
import functools
import json
import re
import types
import zlib

import jax
import jax.numpy as jnp

from kernels_pallas.reference import attention_reference
from models.attention import AttentionInputs


def random_layer(rng, batch, max_len, q_heads, kv_heads, head_dim, peaky=2.0):
    """One layer's full-sequence q [b, max_len, hq, d] and k, v caches [b, max_len, kvh, d] (fp32, peaky logits)."""
    q = rng.normal(size=(batch, max_len, q_heads, head_dim)) * peaky
    k = rng.normal(size=(batch, max_len, kv_heads, head_dim))
    v = rng.normal(size=(batch, max_len, kv_heads, head_dim))
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v))


def prefill_inputs(layer_qkv, q_start: int, q_len: int, prompt_lens):
    """AttentionInputs of a prefill chunk [q_start, q_start + q_len) of right-padded prompts of lengths prompt_lens."""
    q, k, v = layer_qkv
    b = q.shape[0]
    lens = jnp.asarray(prompt_lens, jnp.int32)
    kv_len = jnp.minimum(lens, q_start + q_len)
    return AttentionInputs(q[:, q_start:q_start + q_len], k, v, jnp.full((b,), q_start, jnp.int32), kv_len, lens,
                           "prefill", chunk_at_zero=q_start == 0)


def decode_inputs(layer_qkv, kv_len):
    """AttentionInputs of one decode token per sequence at position kv_len - 1 (q taken from that row)."""
    q, k, v = layer_qkv
    kv_len = jnp.asarray(kv_len, jnp.int32)
    qd = jnp.take_along_axis(q, (kv_len - 1)[:, None, None, None], axis=1)
    return AttentionInputs(qd, k, v, kv_len - 1, kv_len, kv_len, "decode", chunk_at_zero=False)


def _run_layers(strategy, inputs_per_layer):
    state, outs, states = None, [], []
    for layer, inputs in enumerate(inputs_per_layer):
        out, state = strategy.attend(layer, inputs, state)
        outs.append(out)
        states.append(state)
    return outs, states


_run_layers_jit = jax.jit(_run_layers, static_argnums=0)


def run_layers(strategy, inputs_per_layer, jit=True):
    """Thread state through the layers like the model does (one jitted call, as in the model's forward).

    Returns (outputs, states after each layer)."""
    if jit:
        return _run_layers_jit(strategy, list(inputs_per_layer))
    return _run_layers(strategy, inputs_per_layer)


@jax.jit
def dense_reference(inputs):
    """attention_reference on the inputs' causal, valid keys."""
    return attention_reference(inputs.q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len)


def valid_rows(out, q_start, prompt_lens):
    """Zero the rows of padded queries (positions >= prompt length), whose outputs nobody reads."""
    pos = q_start + jnp.arange(out.shape[1])
    return out * (pos[None, :] < jnp.asarray(prompt_lens)[:, None])[:, :, None, None]


class FakeTokenizer:
    """Word/punctuation tokenizer with a ChatML template: fast, and token counts behave like a real BPE."""

    def encode(self, text):
        return [zlib.crc32(t.encode()) % 50_000 for t in re.findall(r"<\|\w+\|>|\w+|[^\w\s]", text)]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def flag_recipe(*argv, model: str = "qwen2.5-coder-0.5b"):
    """The recipe an entry point resolves for `model` from these command-line flags (the flags restored after)."""
    from absl import flags  # noqa: PLC0415
    from absl.testing import flagsaver  # noqa: PLC0415

    from experiments import cli, recipe_flags  # noqa: PLC0415

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", *argv])
        return recipe_flags.resolve_recipe(model)


def shipped_model(name: str):
    """A loaded model as the strategy builders see it (its config's layers, KV heads and name, its dtype), for a model
    with a shipped calibration: no weights to load."""
    from kascade_jax.calibration.resolve import PACKAGED_DIR  # noqa: PLC0415

    art = json.loads(next(PACKAGED_DIR.glob(f"{name}-builtin-64-k64-ts32.json")).read_text())
    cfg = types.SimpleNamespace(num_layers=art["num_layers"], kv_heads=art["kv_heads"], name=name)
    return types.SimpleNamespace(config=cfg, dtype=jnp.dtype("float32"))


def strategy_record(s) -> dict:
    """A Kascade-family strategy as JSON-comparable data: its name, kernels and every config field."""
    return json.loads(json.dumps(dict(name=s.name, kernels=s.kernels, config=dataclasses.asdict(s.config))))


@functools.lru_cache(maxsize=1)
def peaky_tiny_model():
    """conftest's tiny_config random model (seed 7) with its queries scaled up: peaky attention, so that a Top-k has
    no near ties."""
    from conftest import tiny_config  # noqa: PLC0415
    from models.params import random_model  # noqa: PLC0415

    m = random_model(tiny_config(), seed=7)
    for layer in m.layers:
        layer.self_attn.q_proj.kernel.value = layer.self_attn.q_proj.kernel.value * 12.0
    return m


def ragged_tokens(rng, lens, width=320):
    """[len(lens), width] int32 prompts of those lengths (ids 5..99), zero-padded on the right."""
    import numpy as np  # noqa: PLC0415

    toks = np.zeros((len(lens), width), np.int32)
    for b, n in enumerate(lens):
        toks[b, :n] = rng.integers(5, 100, size=n)
    return toks

