"""Jitted prefill, decode and generation over a `Transformer`, for any attention strategy.

- `forward` is one jitted call of the model over a chunk of tokens (cache donated).
- `prefill` runs a right-padded batch through the model in chunks of `chunk_size` tokens (multiples of 64, so Kascade
  tiles of 16/32/64 never straddle a chunk), so 32K+ prompts fit in memory; it returns each prompt's last logits.
- `decode_step` appends one token per sequence (cache donated).
- `generate_shared_prefill` runs several strategies with a dense prefill over the same prompts from one prefill
  (the eval's dense-prefill cells: dense, decode-only Kascade, quest, omnikv), each decoding from a copy of the cache.
- `generate` compiles the whole decode loop (`lax.while_loop`, greedy or temperature/top-p/top-k sampling with a
  seed, per-sequence EOS) into one jitted call. Stop strings need the text, so with `stop` the loop runs in jitted
  segments and the host checks the text between them.
- A strategy's cache state (models.attention.init_cache_state) is created fresh by `prefill` and rides in the cache
  through every decode step (and `generate`'s loop); paged caches and a mesh refuse a strategy that needs one.
- A paged cache (models/paged.py) works in forward / prefill / decode_step when the strategy sets supports_paged
  and every page of the positions written or read is allocated (checked on the host, `_check_pages`). prefill
  traces every later chunk's program before the first chunk runs, so a trace-time refusal never meets a donated
  cache.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import check_no_cache_state, init_cache_state
from models.cache import KVCache
from models.sharding import init_cache, to_host

CHUNK_MULTIPLE = 64
OUT_MULTIPLE = 128  # generated-token buffers are this wide a multiple, so nearby max_new_tokens share a compile


def _meta(phase, offset, q_start, kv_len, seq_len, lengths, chunk_at_zero=False):
    return dict(phase=phase, offset=offset, q_start=q_start, kv_len=kv_len, seq_len=seq_len, lengths=lengths,
                chunk_at_zero=chunk_at_zero)


@functools.partial(jax.jit, static_argnames=("graphdef", "strategy", "at_zero", "all_logits"), donate_argnames=("cache",))
def _prefill_chunk(graphdef, params, tokens, cache, prompt_lens, offset, strategy, at_zero, all_logits):
    """One prefill chunk at `offset` (traced, so every chunk after the first shares one compilation)."""
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    offset = jnp.asarray(offset, jnp.int32)
    q_start = jnp.full((b,), offset, jnp.int32)
    kv_len = jnp.minimum(prompt_lens, offset + t).astype(jnp.int32)
    meta = _meta("prefill", offset, q_start, kv_len, prompt_lens, jnp.maximum(cache.lengths, kv_len), at_zero)
    last = None if all_logits else jnp.clip(prompt_lens - 1 - offset, 0, t - 1)
    return model(tokens, cache, strategy, meta, last_only=last)


@functools.partial(jax.jit, static_argnames=("graphdef", "strategy"), donate_argnames=("cache",))
def _decode(graphdef, params, tokens, cache, strategy):
    return _step(nnx.merge(graphdef, params), tokens, cache, strategy)


@functools.partial(jax.jit, static_argnames=("graphdef", "strategy"), donate_argnames=("cache",))
def _decode_with_state(graphdef, params, tokens, cache, strategy):
    model = nnx.merge(graphdef, params)
    q_start = cache.lengths
    kv_len = q_start + 1
    meta = _meta("decode", None, q_start, kv_len, kv_len, kv_len)
    return model(tokens[:, None], cache, strategy, meta, last_only=jnp.zeros_like(q_start))


def _step(model, tokens, cache, strategy):
    """Traced body of one decode step: tokens [batch] at each sequence's length -> (logits [batch, vocab], cache)."""
    q_start = cache.lengths
    kv_len = q_start + 1
    meta = _meta("decode", None, q_start, kv_len, kv_len, kv_len)
    logits, cache, _ = model(tokens[:, None], cache, strategy, meta, last_only=jnp.zeros_like(q_start))
    return logits, cache


def _check_room(cache: KVCache, needed: int, what: str, model_max: int):
    if needed > model_max:
        raise ValueError(f"{what} needs {needed} positions, more than the model's maximum context {model_max}")
    if needed > cache.max_len:
        raise ValueError(f"{what} needs {needed} positions, more than the cache holds (max_len={cache.max_len})")


def _check_pages(cache, needed, what: str) -> None:
    """A paged cache (models/paged.py) used directly: every page holding positions [0, needed[b]) of sequence b
    must be allocated (in [0, num_pages)). Writes to a -1 page are dropped and the Pallas kernels read it as the
    sequence's first page, so a missing page would give silently wrong logits. Host check (one device->host
    copy of the page table); the serving engine grows its pages itself and skips it in decode."""
    table = getattr(cache, "page_table", None)
    if table is None:
        return
    pt = np.asarray(table)
    ps, n = cache.page_size, cache.num_pages
    needed = np.broadcast_to(np.asarray(needed, np.int64), (pt.shape[0],))
    for b in range(pt.shape[0]):
        k = -(-int(needed[b]) // ps)
        row = pt[b, :k]
        bad = np.flatnonzero((row < 0) | (row >= n))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"{what}: sequence {b} needs positions [0, {int(needed[b])}), but position {j * ps} "
                             f"lies on page-table entry [{b}, {j}] = {int(row[j])}, not an allocated page in "
                             f"[0, {n}); allocate the pages of every position written or read first")


def forward(model, tokens, cache: KVCache, strategy, *, q_start: int = 0, seq_len=None):
    """One jitted pass over tokens [batch, T] at positions q_start.. (q_start a multiple of 64 unless 0).

    Returns (logits [batch, T, vocab] fp32, cache, state). The cache is donated.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    _check_room(cache, q_start + t, "forward", model.config.max_position_embeddings)
    lens = jnp.full((b,), q_start + t, jnp.int32) if seq_len is None else jnp.asarray(seq_len, jnp.int32)
    if getattr(cache, "page_table", None) is not None:  # contiguous caches may be traced here (calibration's jit)
        _check_pages(cache, np.minimum(np.asarray(lens), q_start + t), "forward")
    graphdef, params = nnx.split(model)
    return _prefill_chunk(graphdef, params, tokens, cache, lens, q_start, strategy, q_start == 0, True)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def prefill_plan(width: int, max_len: int, chunk_size: int | None = None) -> list[tuple[int, int]]:
    """The (offset, width) chunks `prefill` runs over a right-padded batch of `width` token columns in a cache of
    `max_len` positions: chunks of `chunk_size` (default: the whole prompt on GPU, 1024 elsewhere) over the columns
    rounded up to a multiple of CHUNK_MULTIPLE. The chunk holding a row's last prompt token gives its logits."""
    if chunk_size is not None and (chunk_size <= 0 or chunk_size % CHUNK_MULTIPLE):
        raise ValueError(f"chunk_size must be a positive multiple of {CHUNK_MULTIPLE}, got {chunk_size}")
    if chunk_size is None:
        chunk_size = _round_up(width, CHUNK_MULTIPLE) if jax.default_backend() == "gpu" else 1024
    total = min(_round_up(width, CHUNK_MULTIPLE), max_len)
    return [(o, min(chunk_size, total - o)) for o in range(0, total, chunk_size)]


def trace_prefill_chunks(model, batch: int, plan, cache, prompt_lens, strategy, all_logits=False) -> None:
    """Trace the programs of every chunk after the first, so that a strategy refusing one (a trace-time ValueError)
    fails before any buffer has been donated."""
    graphdef, params = nnx.split(model)
    plens = jnp.asarray(prompt_lens)
    for width, offset in {w: o for o, w in plan[1:]}.items():
        _prefill_chunk.eval_shape(graphdef, params, jax.ShapeDtypeStruct((batch, width), jnp.int32), cache, plens,
                                  offset, strategy, False, all_logits)


def prefill_chunk(model, chunk_tokens, prompt_lens, cache, strategy, offset: int, all_logits=False, *, split=None):
    """One chunk of `prefill` (`prefill_plan`'s (offset, width), tokens [batch, width]): (logits, cache) with the
    logits of each row's last prompt token when it lies in this chunk (else of a clipped position), or
    [batch, width, vocab] with all_logits; cache donated. The serving engine interleaves these with decode steps.
    split: the model's `nnx.split(model)` when the caller keeps one (a split costs host time per layer, per call)."""
    graphdef, params = split if split is not None else nnx.split(model)
    logits, cache, _ = _prefill_chunk(graphdef, params, jnp.asarray(chunk_tokens, jnp.int32), cache,
                                      jnp.asarray(prompt_lens), offset, strategy, offset == 0, all_logits)
    return logits, cache


def prefill(model, tokens, prompt_lens, cache: KVCache, strategy, *, chunk_size: int | None = None, all_logits=False,
            join_logits: bool = True):
    """Chunked prefill of a right-padded batch. Returns (logits [batch, vocab] at each last prompt token, or
    [batch, P, vocab] with all_logits, cache). With all_logits and join_logits=False the logits come as the list of
    the chunks' [batch, width, vocab] arrays (P columns in all), never joined: a 16K x 152K fp32 join is a 10 GB
    copy."""
    tokens = np.asarray(tokens, np.int32)
    prompt_lens = np.asarray(prompt_lens, np.int32)
    b, p = tokens.shape
    if prompt_lens.shape != (b,) or prompt_lens.min() < 1 or prompt_lens.max() > p:
        raise ValueError(f"prompt_lens must be [batch] in [1, {p}], got {prompt_lens.tolist()}")
    _check_room(cache, int(prompt_lens.max()), "the prompt", model.config.max_position_embeddings)
    _check_pages(cache, prompt_lens, "prefill")
    paged = getattr(cache, "page_table", None) is not None
    if paged:
        check_no_cache_state(strategy, "paged caches", paged=True)
    if getattr(model, "mesh", None) is not None:
        check_no_cache_state(strategy, "a mesh")
    cstate = init_cache_state(strategy, model.config.num_layers, b, cache.max_len, model.config.kv_heads,
                              model.config.head_dim, pages=(cache.num_pages, cache.page_size) if paged else None)
    if cstate is not None or getattr(cache, "strategy_state", None) is not None:  # a new prompt starts it fresh
        cache = dataclasses.replace(cache, strategy_state=cstate)
    plan = prefill_plan(p, cache.max_len, chunk_size)
    total = plan[-1][0] + plan[-1][1]
    toks = np.zeros((b, total), np.int32)
    toks[:, :min(p, total)] = tokens[:, :total]
    plens = jnp.asarray(prompt_lens)
    # The cache is donated chunk by chunk: trace every later chunk's program (its distinct width) before the first
    # runs, so a strategy that refuses one (a trace-time ValueError) fails before any buffer was donated.
    trace_prefill_chunks(model, b, plan, cache, prompt_lens, strategy, all_logits)
    outs, last, split = [], None, nnx.split(model)
    for offset, width in plan:
        logits, cache = prefill_chunk(model, toks[:, offset:offset + width], plens, cache, strategy, offset,
                                      all_logits, split=split)
        if all_logits:
            outs.append(logits)
        else:
            here = (prompt_lens - 1 >= offset) & (prompt_lens - 1 < offset + width)
            last = logits if last is None else jnp.where(jnp.asarray(here)[:, None], logits, last)
    cache = dataclasses.replace(cache, lengths=plens)
    if all_logits and not join_logits:
        return [lg[:, :max(0, min(o + w, p) - o)] for lg, (o, w) in zip(outs, plan) if o < p], cache
    if all_logits:
        return jnp.concatenate(outs, axis=1)[:, :p], cache
    return last, cache


def decode_step(model, tokens, cache: KVCache, strategy, *, with_state: bool = False):
    """Append tokens [batch] at each sequence's length. Returns (logits [batch, vocab], cache), plus the strategy's
    final layer state with `with_state` (probes such as the fidelity mass probe); cache donated."""
    if getattr(cache, "page_table", None) is not None:  # no host copy of the lengths for a contiguous cache
        _check_pages(cache, np.asarray(cache.lengths) + 1, "decode_step")
    graphdef, params = nnx.split(model)
    if with_state:
        return _decode_with_state(graphdef, params, jnp.asarray(tokens, jnp.int32), cache, strategy)
    return _decode(graphdef, params, jnp.asarray(tokens, jnp.int32), cache, strategy)


def check_sampling(temperature: float, top_p: float, top_k: int, vocab: int | None = None) -> None:
    """Raise a ValueError naming the bad value among sampling parameters that `sample` cannot use. Non-finite values
    are rejected explicitly: every comparison with nan is false, so `temperature < 0` lets it through, and a nan or
    inf temperature samples garbage instead of failing."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a finite number in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if vocab is not None and top_k > vocab:
        raise ValueError(f"top_k={top_k} is larger than the vocabulary ({vocab} tokens)")


def sample(logits, key, temperature: float, top_p: float, top_k: int):
    """logits [batch, vocab] -> tokens [batch]. temperature 0 is greedy."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        srt = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "strategy", "temperature", "top_p", "top_k", "eos"),
                   donate_argnames=("carry",))
def _decode_loop(graphdef, params, carry, seed, strategy, steps, limits, temperature, top_p, top_k, eos):
    """Run up to `steps` decode steps; row b records at most `limits[b]` tokens. carry = (cache, tok [batch] (sampled,
    not yet recorded), finished, i, out). `steps` and `limits` are traced: one compilation serves every generation
    length whose output buffer (`out`, OUT_MULTIPLE-rounded) has the same width. The loop ends as soon as every row
    has ended (EOS or its own limit), so a batch of short answers never waits for the longest limit."""
    model = nnx.merge(graphdef, params)
    eos_arr = jnp.asarray(eos if eos else (-1,), jnp.int32)
    stop_at = jnp.minimum(carry[3] + steps, jnp.max(limits))

    def cond(c):
        _, _, finished, i, out = c
        return (i < jnp.minimum(stop_at, out.shape[1])) & ~jnp.all(finished | (i >= limits))

    def body(c):
        cache, tok, finished, i, out = c
        finished = finished | (i >= limits)
        out = out.at[:, i].set(jnp.where(finished, -1, tok))
        finished = finished | jnp.isin(tok, eos_arr)
        logits, cache = _step(model, tok, cache, strategy)
        nxt = sample(logits, jax.random.fold_in(jax.random.key(seed), i), temperature, top_p, top_k)
        return cache, nxt, finished, i + 1, out

    return jax.lax.while_loop(cond, body, carry)


@dataclasses.dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens, EOS excluded
    prompt_tokens: int
    new_tokens: int  # decode length, counting the EOS token if one was emitted
    finish_reason: str  # "eos" | "stop" | "length"


def _first_stop(text: str, stop: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None


def generate(model, tokenizer, prompts, strategy, *, max_new_tokens: int | Sequence[int] = 64,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop: Sequence[str] = (),
             chat: bool = True, max_len: int | None = None, chunk_size: int | None = None, segment: int = 32,
             bucket: int = 512, timings: dict | None = None) -> list[GenerationResult]:
    """Generate for a batch of prompts (strings, or token-id lists used as they are).

    Prompts are right-padded to a multiple of `bucket` tokens and the cache to a multiple of `bucket` positions, so
    batches of slightly different lengths reuse one compilation. `max_new_tokens` is one limit for every prompt or
    one per prompt (tasks with different answer lengths share a batch; the loop stops when every row has ended).
    `timings`: a dict that gets the wall seconds of the prefill (`prefill_s`, synchronised) and of the decode loop
    (`decode_s`) and the decode steps run (`decode_steps`), added to what it holds.
    """
    return generate_shared_prefill(model, tokenizer, prompts, [strategy], max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop, chat=chat,
                                   max_len=max_len, chunk_size=chunk_size, segment=segment, bucket=bucket,
                                   timings=None if timings is None else [timings])[0]


def prefill_is_dense(strategy) -> bool:
    """Whether `strategy` declares its prefill identical to DenseStrategy's (`prefill_is_dense`, see
    models.attention.AttentionStrategy): the same dense attention in every layer and no state carried into decode."""
    return bool(getattr(strategy, "prefill_is_dense", False))


def generate_shared_prefill(model, tokenizer, prompts, strategies, *, max_new_tokens: int | Sequence[int] = 64,
                            temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                            stop: Sequence[str] = (), chat: bool = True, max_len: int | None = None,
                            chunk_size: int | None = None, segment: int = 32, bucket: int = 512,
                            timings: Sequence[dict] | None = None) -> list[list[GenerationResult]]:
    """`generate` for several strategies over the same prompts with ONE prefill: every strategy must have a dense
    prefill (`prefill_is_dense`), so the prefilled cache and first token are the same for all; each strategy then
    decodes from its own copy of that cache (the last one from the cache itself: one extra cache in memory).
    Returns one result list per strategy, each what `generate(..., strategy)` returns. `timings`: one dict per
    strategy; each gets the shared prefill's seconds (`prefill_s`, the same in every dict) and its own decode's.
    One strategy alone may have any prefill: `generate` is this with [strategy]."""
    strategies = list(strategies)
    if not strategies:
        raise ValueError("generate_shared_prefill needs at least one strategy")
    if len(strategies) > 1:
        bad = [getattr(s, "name", type(s).__name__) for s in strategies if not prefill_is_dense(s)]
        if bad:
            raise ValueError(f"strategies {bad} have no dense prefill (prefill_is_dense), so they cannot share one "
                             "prefill; generate them one at a time")
    if timings is not None and len(timings) != len(strategies):
        raise ValueError(f"timings has {len(timings)} dicts for {len(strategies)} strategies")
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    if isinstance(max_new_tokens, (int, np.integer)) and not isinstance(max_new_tokens, bool):
        limits = [int(max_new_tokens)] * len(prompts)
    else:
        limits = list(max_new_tokens)
        if len(limits) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(limits)} limits for {len(prompts)} prompts")
    bad = [m for m in limits if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1]
    if bad:
        raise ValueError(f"max_new_tokens must be ints >= 1, got {bad[0]!r}")
    max_new_tokens = max(int(m) for m in limits)
    check_sampling(temperature, top_p, top_k, vocab=model.config.vocab)
    ids = []
    for p in prompts:
        if isinstance(p, str):
            p = tokenizer.encode_chat([{"role": "user", "content": p}]) if chat else tokenizer.encode(p)
        if len(p) == 0:
            raise ValueError("empty prompt")
        ids.append(list(p))
    cfg = model.config
    lens = np.array([len(p) for p in ids], np.int32)
    need = int((lens + np.asarray(limits, np.int32)).max())
    if int(lens.max()) > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {int(lens.max())} tokens exceeds the model's maximum context "
                         f"{cfg.max_position_embeddings}")
    if need > cfg.max_position_embeddings:
        raise ValueError(f"prompt + max_new_tokens = {need} tokens (longest: {int(lens.max())} + {max_new_tokens}) "
                         f"exceeds the model's maximum context {cfg.max_position_embeddings}")
    if bucket <= 0 or bucket % CHUNK_MULTIPLE:
        raise ValueError(f"bucket must be a positive multiple of {CHUNK_MULTIPLE}, got {bucket}")
    max_len = max_len or min(_round_up(need, bucket), cfg.max_position_embeddings)
    if need > max_len:
        raise ValueError(f"prompt + max_new_tokens = {need} exceeds the cache max_len {max_len}")
    tokens = np.zeros((len(ids), min(_round_up(int(lens.max()), bucket), max_len)), np.int32)
    for i, p in enumerate(ids):
        tokens[i, :len(p)] = p
    cache = init_cache(model, len(ids), max_len)  # KVCache.init, laid out on the model's mesh if it has one
    t0 = time.perf_counter()
    logits, cache = prefill(model, tokens, lens, cache, strategies[0], chunk_size=chunk_size)
    if timings is not None:
        jax.block_until_ready(logits)
    t_prefill = time.perf_counter() - t0
    tok = sample(logits, jax.random.fold_in(jax.random.key(seed), 1 << 30), temperature, top_p, top_k)
    tok_eos = getattr(tokenizer, "eos_token_ids", None)
    eos = tuple(sorted(set(cfg.eos_token_ids if tok_eos is None else tok_eos)))
    out = []
    for n, strategy in enumerate(strategies):
        last = n == len(strategies) - 1
        # The decode loop donates its carry (cache and first token): every strategy but the last gets copies.
        mine, first = (cache, tok) if last else (jax.tree.map(jnp.copy, cache), jnp.copy(tok))
        t1 = time.perf_counter()
        rows, steps = _decode_rows(model, tokenizer, mine, first, strategy, limits, max_new_tokens, lens, seed, stop,
                                   segment, temperature, top_p, top_k, eos)
        if timings is not None:
            t = timings[n]
            for k, v in (("prefill_s", t_prefill), ("decode_s", time.perf_counter() - t1), ("decode_steps", steps)):
                t[k] = t.get(k, 0) + v
        out.append(rows)
    return out


def _decode_rows(model, tokenizer, cache, tok, strategy, limits, max_new_tokens, lens, seed, stop, segment,
                 temperature, top_p, top_k, eos) -> tuple[list[GenerationResult], int]:
    """The decode loop from a prefilled cache (donated) and first token `tok` [batch]; (results, steps run)."""
    b = len(limits)
    out = jnp.full((b, _round_up(max_new_tokens, OUT_MULTIPLE)), -1, jnp.int32)
    carry = (cache, tok, jnp.zeros((b,), bool), jnp.asarray(0, jnp.int32), out)
    graphdef, params = nnx.split(model)
    steps = max_new_tokens if not stop else segment
    row_limits = jnp.asarray(limits, jnp.int32)
    stopped = [None] * b
    while True:
        carry = _decode_loop(graphdef, params, carry, seed, strategy, jnp.int32(steps), row_limits,
                             float(temperature), float(top_p), int(top_k), eos)
        i = int(carry[3])
        if i >= max_new_tokens or bool(jnp.all(carry[2] | (i >= row_limits))):
            break
        if stop:
            texts = [tokenizer.decode([t for t in row[:i] if t >= 0 and t not in eos]) for row in to_host(carry[4])]
            for j, t in enumerate(texts):
                if stopped[j] is None and _first_stop(t, stop) is not None:
                    stopped[j] = True
            ended = to_host(carry[2]) | (i >= np.asarray(limits))
            if all(s or f for s, f in zip(stopped, ended)):
                break
    out = to_host(carry[4])[:, :max_new_tokens]
    results = []
    for j in range(b):
        row = [int(t) for t in out[j] if t >= 0]
        reason, n_new = "length", len(row)
        if any(t in eos for t in row):
            cut = next(k for k, t in enumerate(row) if t in eos)
            row, reason, n_new = row[:cut], "eos", cut + 1
        text = tokenizer.decode(row)
        pos = _first_stop(text, stop) if stop else None
        if pos is not None:
            text, reason = text[:pos], "stop"
        results.append(GenerationResult(text=text, token_ids=row, prompt_tokens=int(lens[j]), new_tokens=n_new,
                                        finish_reason=reason))
    return results, int(carry[3])
