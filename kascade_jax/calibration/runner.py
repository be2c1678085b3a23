"""Calibration driver: dense forwards over a development set -> prompt-averaged statistics -> artifact.

Every prompt runs through `models.generate.forward` with a `CalibrationStrategy`, wrapped in our own jit that
returns only the statistics, so XLA drops the unused [T, vocab] logits (as large as the attention work on a
small model). Prompts are right-padded to a multiple of `bucket` tokens, so the jitted forward compiles once
per bucket length and is reused across prompts. Statistics are kept per prompt ([L, L, kv_heads, kv_heads] +
[L], a few KB) so subsets (stability checks) can be averaged without running the model again.

Deliberately not here: choosing prompts (`devset.py`), the DP (`dp.py`), file formats (`artifact.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kascade_jax.calibration.artifact import CalibrationArtifact
from kascade_jax.calibration.stats import CalibrationStrategy


@dataclasses.dataclass(frozen=True)
class PromptStats:
    sim: np.ndarray  # [N, L, L, kv_heads, kv_heads]: one row per prompt
    w: np.ndarray  # [N, L]
    lengths: np.ndarray  # [N] prompt tokens
    seconds: float  # wall time of the forwards, compiles included
    compile_buckets: tuple[int, ...]  # padded lengths that were compiled
    first_seconds: float = 0.0  # wall time of the first prompt of each padded length (compile + run)

    def mean(self, select=None):
        """(sim [L, L, H, H], w [L]) averaged over the prompts in `select` (all by default)."""
        sel = slice(None) if select is None else np.asarray(select)
        return self.sim[sel].mean(0), self.w[sel].mean(0)


BUCKET = 512  # calibration prompts are right-padded to a multiple of this (one compile per padded length)


def check_bucket(bucket: int, tile_size: int) -> None:
    """ValueError unless `tile_size` divides the padding bucket and the bucket is a multiple of 64 (a prompt is
    padded to whole query tiles); cheap, so callers run it before loading a model."""
    for name, v in (("bucket", bucket), ("tile_size", tile_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"calibration {name} must be an int >= 1, got {v!r}")
    if bucket % 64 or bucket % tile_size:
        raise ValueError(f"--tile_size={tile_size} does not divide the calibration bucket ({bucket} tokens: prompts "
                         f"are padded to a multiple of it, in whole query tiles); use a tile_size that divides "
                         f"{bucket}" + (f", or a --bucket that is a multiple of 64 and of {tile_size}"
                                        if bucket % 64 == 0 else f"; the bucket must be a multiple of 64"))


@functools.partial(jax.jit, static_argnames=("graphdef", "strategy"))
def _stats_forward(graphdef, params, tokens, prompt_lens, strategy):
    from models import generate as gen
    from models.cache import KVCache

    model = nnx.merge(graphdef, params)
    cache = KVCache.init(model.config, tokens.shape[0], tokens.shape[1], dtype=model.dtype)
    _, _, state = gen.forward(model, tokens, cache, strategy, q_start=0, seq_len=prompt_lens)
    return state["sim"], state["w"]


def collect_statistics(model, prompts, *, k: int = 64, tile_size: int = 32, reduce: str = "min", bucket: int = BUCKET,
                       block_tiles: int | None = None, progress: bool = True) -> PromptStats:
    """Per-prompt head similarity and layer importance. prompts: sequences of token ids (or DevPrompt)."""
    cfg = model.config
    check_bucket(bucket, tile_size)
    ids = [np.asarray(getattr(p, "token_ids", p), np.int32) for p in prompts]
    if not ids:
        raise ValueError("need at least one prompt")
    bad = [len(i) for i in ids if not tile_size < len(i) <= cfg.max_position_embeddings]
    if bad:
        raise ValueError(f"prompt lengths must lie in ({tile_size}, {cfg.max_position_embeddings}] tokens (more than one "
                         f"tile, within the model's context), got {bad[:5]}")
    strategy = CalibrationStrategy(num_layers=cfg.num_layers, kv_heads=cfg.kv_heads, tile_size=tile_size, k=k,
                                   reduce=reduce, block_tiles=block_tiles)
    graphdef, params = nnx.split(model)
    sims, ws, buckets = [], [], []
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # buckets in increasing length: each compiles once
    it = order
    if progress:
        from tqdm import tqdm

        it = tqdm(order, desc="calibration forwards", unit="prompt")
    t0 = time.perf_counter()
    results, first = {}, 0.0
    for i in it:
        t1 = time.perf_counter()
        n = len(ids[i])
        padded = min(-(-n // bucket) * bucket, cfg.max_position_embeddings)
        new_bucket = padded not in buckets
        if new_bucket:
            buckets.append(padded)
        tokens = np.zeros((1, padded), np.int32)
        tokens[0, :n] = ids[i]
        sim, w = _stats_forward(graphdef, params, jnp.asarray(tokens), jnp.asarray([n], jnp.int32), strategy)
        results[i] = (np.asarray(sim[0]), np.asarray(w[0]))
        if new_bucket:
            first += time.perf_counter() - t1
    seconds = time.perf_counter() - t0
    sims = np.stack([results[i][0] for i in range(len(ids))])
    ws = np.stack([results[i][1] for i in range(len(ids))])
    return PromptStats(sim=sims, w=ws, lengths=np.array([len(i) for i in ids]), seconds=seconds,
                       compile_buckets=tuple(buckets), first_seconds=first)


def calibrate(model, prompts, *, model_name: str, dataset: str, k: int = 64, tile_size: int = 32, reduce: str = "min",
              bucket: int = 512, progress: bool = True, meta: dict | None = None,
              return_stats: bool = False, block_tiles: int | None = None, key=None):
    """Run the statistics over `prompts` and build the artifact (DP for every budget, head maps). `key`: the
    CalibrationKey the artifact records (the parameters asked for; its k, tile_size and reduce are this run's)."""
    if key is not None and (key.k, key.tile_size, key.reduce) != (k, tile_size, reduce):
        raise ValueError(f"calibration key k={key.k}, tile_size={key.tile_size}, reduce={key.reduce} does not "
                         f"describe this run (k={k}, tile_size={tile_size}, reduce={reduce})")
    stats = collect_statistics(model, prompts, k=k, tile_size=tile_size, reduce=reduce, bucket=bucket,
                               block_tiles=block_tiles, progress=progress)
    sim, w = stats.mean()
    meta = dict(meta or {})
    meta.update(num_selected=k - tile_size, forward_seconds=round(stats.seconds, 2), first_prompt_per_length_seconds=round(stats.first_seconds, 2),
                backend=jax.default_backend(),
                prompt_tokens=dict(min=int(stats.lengths.min()), mean=float(stats.lengths.mean()),
                                   max=int(stats.lengths.max())),
                compiled_lengths=list(stats.compile_buckets))
    art = CalibrationArtifact.from_statistics(sim, w, model_name=model_name, dataset=dataset,
                                              num_prompts=len(stats.lengths), k=k, tile_size=tile_size, reduce=reduce,
                                              meta=meta, key=key)
    return (art, stats) if return_stats else art
