"""Pallas GPU prefill kernels for Kascade: sparse reuse prefill and the anchor prefill pipeline.

Design (all kernels are Pallas `pallas_call`s with the Triton lowering, the only `pallas_call` GPU path in JAX 0.11.2):
- One program owns one query tile of one KV head: `tile_size` tokens x `g_sub` query heads of the GQA group packed as
  matrix rows (padded to a power of two >= 16), so every gathered K/V row serves the whole group. Groups whose rows
  would exceed 128 are split into `n_sub` sub-groups (one program each; the pooled-score kernel loops over them).
- Reuse: online-softmax attention over the tile's selected keys (gathered row by row through the head map, blocks
  of `reuse_block_k` indices, bounded by the tile's rolling count) plus the causal diagonal tile. A tile whose prefix fits in its
  budget selected every prefix key, so it is dense by construction.
- Anchor: (1) a flash pass over the causal keys that yields the base-2 log-sum-exp per row (and for anchor layer 0
  the dense output too); (2) in chunks of tiles (<= ~1 GiB of fp32 scores at a time, never the O(L^2) tensor): a
  kernel that recomputes Q.K^T for the keys strictly before each tile, turns it into post-softmax probabilities with
  the stored LSE and pools them over the tile's valid rows and the GQA group, then (3) an exact threshold select per
  (tile, head): a `select_nb`-way (16) bisection on the fp32 bit patterns (non-negative floats order like their int32 bits),
  stopping as soon as the bracket holds exactly the budget, then one compaction pass (cumsum + scatter) that takes
  every key above the bracket and, among exact ties at the threshold, the lowest positions. No sort, no lax.top_k.
  With `key_block` kb > 1 it selects among block scores (XLA sums of kb aligned keys) and the blocks are expanded
  to kb ids each (`reference.select_blocks_reference`).
  Options: start from the row's [min, max] bits (`select_range`), and once the bracket holds <= `select_cand` keys,
  compact them into a small buffer so the remaining passes skip the full row (same result, fewer full-row reads).
  (4) The reuse kernel on its own indices (identity head map), unless `dense_out`.
- Anchor layer 0 may instead take its dense output and LSE from cuDNN flash attention (`anchor0_cudnn`, chunks at
  position 0 on a GPU): cuDNN returns fp32 softmax statistics (natural log), repacked to the kernels' base-2 rows.
- The reuse kernel is a gather of K/V rows; its launch order (`reuse_order`), row split (`reuse_rows`) and index
  prefetch (`reuse_prefetch`) are options so that they can be A/B-timed in one run. Offline compiles (Triton 3.9,
  sm_90) of the default show why it runs at memory + compute time: the pipeliner spends one stage on the index ->
  gather chain, so at 3 stages block j+1's gathers are issued after block j's matmuls and awaited at once. With the
  indices carried one block ahead the gathers get the full depth (3 stages, 64-key blocks: 128 KB of shared memory).
- Block sizes / pipelining live in `PrefillTuning`; measurements, floors and limits: benchmarks/notes_prefill.md.

Deliberately not done here: `pool="pre_softmax"` (reference only), fp8, paged caches, Mosaic-GPU (wgmma/TMA)
versions. Everything off-GPU (impl="reference", or "auto" on CPU) runs the pure-JAX references of
`kernels_pallas.reference`, which define the semantics; `interpret=True` runs the Pallas kernels on CPU for tests.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import reference as ref
from kernels_pallas.dispatch import replace_from_string, use_pallas

_LOG2E = 1.4426950408889634
_NEG = -1e30  # finite start for running maxima: a fully masked block then gives exp2(-inf) = 0, never inf - inf
_ROW_CAP = 128  # rows (tile tokens x heads) per program: 128 x d fp32 accumulators fit the register file
_TILE_SIZES = (16, 32, 64)
_HEAD_DIMS = (64, 128)
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_INF_BITS = 0x7F800000  # int32 bits of +inf: every finite non-negative fp32 score is below it
_SCORE_CHUNK_BYTES = 1 << 30  # fp32 pooled scores held at once by the anchor pipeline
_REUSE_ORDERS = ("tile_major", "head_major")
_REUSE_ROWS = (16, 32, 64, 128)
_ANCHOR_BACKENDS = ("auto", "triton", "mgpu")


def _hopper() -> bool:
    """Whether the default device is an sm_90 GPU (the Mosaic GPU kernels use wgmma: Hopper only)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).split(".")[0] == "9"


def _backend(name: str, interpret: bool) -> str:
    """A PrefillTuning backend field resolved: "auto" is "mgpu" on a Hopper GPU (not in interpret mode), else
    "triton"."""
    if name != "auto":
        return name
    return "mgpu" if not interpret and jax.default_backend() == "gpu" and _hopper() else "triton"


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Block sizes and Triton pipelining per kernel. Defaults: the H200 tuning of 2026-11-29 (bench_prefill.py
    --prefill_tune=32768) plus the winners of the 128K sweep (benchmarks/prefill_sweep.md): LSE pass 128/2,
    candidate-buffer + range select, head-major reuse order, anchor 0 through cuDNN. Index prefetch in the reuse
    kernel measured slower (53.0 vs 48.8 ms) and stays off."""

    dense_block_k: int = 64  # keys per step of the dense pass (anchor layer 0: output + LSE)
    dense_stages: int = 3
    lse_block_k: int = 128  # keys per step of the LSE-only pass (other anchors)
    lse_stages: int = 2
    scores_block_k: int = 128  # keys per step of the pooled-score pass
    scores_stages: int = 2
    scores_transposed: bool = True  # K.Q^T so the pool over rows is an in-warp reduction (no shared-memory round trip)
    select_block: int = 1024  # scores per step of a select pass
    select_warps: int = 4
    select_stages: int = 3
    select_nb: int = 16  # thresholds per bisection pass: log2(nb) bits per pass, nb compares per score
    # 0: every bisection pass reads the whole row of scores. C > 0: once the bracket holds <= C keys, one pass takes
    # the keys above it and compacts the bracket's keys (bits + position) into a C-wide buffer; the remaining passes
    # read only that buffer (~3-4 full-row reads instead of ~7-8 at 128K).
    select_cand: int = 2048
    # Start the bisection from the row's [min, max] score bits (one cheap min/max pass) instead of all non-negative
    # floats: the pooled scores of a row span a few binades of the 255, so this saves ~2 counting passes.
    select_range: bool = True
    reuse_block_k: int = 128  # gathered keys per step of the reuse kernel
    reuse_stages: int = 3
    reuse_warps: int = 0  # 0: 4 for <= 64 rows, else 8
    # Launch order of the reuse programs. "tile_major": for each tile all KV heads (the CUDA block order of the
    # (batch, heads, tiles) grid), so the programs resident at one time gather from the prefixes of all 8 heads
    # (8 x 64 MB of K+V at 128K, far above the ~50 MB L2). "head_major": all tiles of one KV head (and sequence)
    # before the next, so resident programs share one head's K+V (<= 64 MB at 128K) and neighbouring tiles hit
    # rows their neighbours just pulled into L2.
    reuse_order: str = "head_major"
    # Rows (tile tokens x heads) per reuse program; a program holds at least one tile. 64 splits a tile's GQA group
    # over two sibling programs (adjacent in launch order, so the second one's gathers mostly hit L2) with half the
    # accumulators: more programs per SM to overlap one's gathers with another's matmuls.
    reuse_rows: int = 128
    # Load block j+1's indices in iteration j (loop carry). Then the K/V gathers depend on a loop-carried value instead
    # of a load of the same iteration, and Triton's pipeliner gives them the full `reuse_stages` depth (the indirect
    # index -> gather chain otherwise costs one stage: at 3 stages the gathers of block j+1 are issued after block j's
    # matmuls and awaited right away, so memory and compute never overlap).
    reuse_prefetch: bool = False
    # Anchor layer 0 (dense_out) with chunk_at_zero on a GPU, bf16/fp16: dense output and per-row LSE from cuDNN
    # flash attention instead of the Triton dense pass; elsewhere the Triton/interpret path.
    anchor0_cudnn: bool = True
    # The anchor's LSE pass (and its dense output where cuDNN does not give it) and pooled-score pass: "triton" (the
    # kernels of this file) or "mgpu" (`prefill_mgpu`'s Mosaic GPU kernels) for the calls they cover: batch 1, a chunk
    # at position 0 (q_start concrete 0 or chunk_at_zero; any kv_len, concrete or traced: `_mgpu_keys`), q_len a
    # multiple of 128, d 64 / 128, bf16 / fp16. Every other call takes the Triton path silently
    # (`prefill_mgpu.supported`). "auto" (the default): "mgpu" on a Hopper GPU, "triton" elsewhere and in interpret
    # mode; by the in-model A/B (H200, 8B shape, 128K, 2026-12-06: the two passes -7%, TTFT 1.89x -> 1.93x).
    anchor_backend: str = "auto"
    # The reuse of a selection of whole key blocks (`anchor_prefill(key_block=kb)`, kb > 1): "triton" (`_reuse_call` on
    # the expanded ids) or "mgpu" (`prefill_mgpu.reuse_blocks`: TMA copies of kb rows into a warp-specialised ring)
    # where its scope holds (`prefill_mgpu.reuse_unsupported_reason`: d 64 / 128, bf16 / fp16, kb 8-64 dividing the
    # tile, the cache length a multiple of kb); every other call takes the Triton path silently. Selections of
    # single keys (kb = 1) always take Triton. "auto" (the default): "mgpu" on a Hopper GPU, else "triton"; by
    # measurement (H200, 128K, 8B shape, with its column masks: 0.152 / 0.141 of cuDNN at kb 16 / 32 against
    # Triton's 0.187).
    reuse_backend: str = "auto"

    def __post_init__(self):
        for name in ("dense_block_k", "lse_block_k", "scores_block_k", "reuse_block_k", "select_block"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        for name in ("dense_stages", "lse_stages", "scores_stages", "select_stages", "reuse_stages"):
            if not 1 <= getattr(self, name) <= 8:
                raise ValueError(f"{name} must be in [1, 8], got {getattr(self, name)}")
        if self.select_warps not in (1, 2, 4, 8, 16) or self.reuse_warps not in (0, 1, 2, 4, 8, 16):
            raise ValueError(f"select_warps / reuse_warps must be a power of two <= 16 (reuse_warps 0: automatic), "
                             f"got {self.select_warps} / {self.reuse_warps}")
        if self.select_nb not in (2, 4, 8, 16, 32):
            raise ValueError(f"select_nb must be one of 2, 4, 8, 16, 32, got {self.select_nb}")
        if self.select_cand and (self.select_cand < 16 or self.select_cand & (self.select_cand - 1)):
            raise ValueError(f"select_cand must be 0 or a power of two >= 16, got {self.select_cand}")
        if self.reuse_order not in _REUSE_ORDERS:
            raise ValueError(f"reuse_order must be one of {_REUSE_ORDERS}, got {self.reuse_order!r}")
        if self.reuse_rows not in _REUSE_ROWS:
            raise ValueError(f"reuse_rows must be one of {_REUSE_ROWS}, got {self.reuse_rows}")
        if self.anchor_backend not in _ANCHOR_BACKENDS:
            raise ValueError(f"anchor_backend must be one of {_ANCHOR_BACKENDS}, got {self.anchor_backend!r}")
        if self.reuse_backend not in _ANCHOR_BACKENDS:
            raise ValueError(f"reuse_backend must be one of {_ANCHOR_BACKENDS}, got {self.reuse_backend!r}")


DEFAULT_TUNING = PrefillTuning()


def set_default_anchor_backend(name: str) -> None:
    """Process-wide: the anchor backend ("auto" | "triton" | "mgpu") of every later call that passes no tuning (the
    models' prefill). Set it before the first trace: a compiled program keeps the backend it was traced with."""
    global DEFAULT_TUNING
    DEFAULT_TUNING = dataclasses.replace(DEFAULT_TUNING, anchor_backend=name)  # (an unknown name raises)


def tuning_from_string(spec: str, base: PrefillTuning | None = None) -> PrefillTuning:
    """"field=value,field=value" -> PrefillTuning (for benchmark flags); values parsed by the field's type."""
    return replace_from_string(base or DEFAULT_TUNING, spec)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static shape facts shared by all kernels of one call."""

    batch: int
    q_len: int
    kv_heads: int
    group: int
    d: int
    max_len: int
    tile: int
    n_tiles: int
    g_sub: int  # query heads of the group per program
    n_sub: int  # programs per (tile, KV head)
    rows: int  # tile * g_sub real rows
    rows_pad: int  # power of two >= 16

    @property
    def warps(self) -> int:
        return 4 if self.rows_pad <= 64 else 8


def _check_common(q, k_cache, v_cache, q_start, kv_len, tile_size):
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q and caches must be 4-D [batch, len, heads, d], got {q.shape} and {k_cache.shape}")
    if v_cache is not None and v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    b, t, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {k_cache.shape} does not match q {q.shape} in batch or head_dim")
    if tile_size not in _TILE_SIZES:
        raise ValueError(f"tile_size must be one of {_TILE_SIZES}, got {tile_size}")
    if t < 1:
        raise ValueError(f"q_len must be >= 1, got {t}")
    if hq % k_cache.shape[2]:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({k_cache.shape[2]})")
    if jnp.shape(q_start) != (b,) or jnp.shape(kv_len) != (b,):
        raise ValueError(f"q_start and kv_len must have shape [batch]=({b},), got {jnp.shape(q_start)}, {jnp.shape(kv_len)}")


def _check_pallas(q, k_cache, v_cache):
    d = q.shape[-1]
    if d not in _HEAD_DIMS:
        raise ValueError(f"the Pallas prefill kernels support head_dim in {_HEAD_DIMS}, got {d}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of bfloat16, float16, float32, got {q.dtype}")
    for c in (k_cache, v_cache):
        if c is not None and c.dtype != q.dtype:
            raise ValueError(f"cache dtype {c.dtype} must equal q dtype {q.dtype}")


def _group_split(group: int, tile_size: int, row_cap: int) -> int:
    """Heads of a GQA group packed with one tile's tokens as matrix rows: the largest divisor of the group whose
    tile_size x heads rows fit in row_cap (at least one head)."""
    return max(s for s in range(1, group + 1) if group % s == 0 and tile_size * s <= max(row_cap, tile_size))


def _layout(q, k_cache, tile_size, row_cap=_ROW_CAP) -> _Layout:
    b, t, hq, d = q.shape
    kvh = k_cache.shape[2]
    g = hq // kvh
    g_sub = _group_split(g, tile_size, row_cap)
    rows = tile_size * g_sub
    return _Layout(batch=b, q_len=t, kv_heads=kvh, group=g, d=d, max_len=k_cache.shape[1], tile=tile_size,
                   n_tiles=-(-t // tile_size), g_sub=g_sub, n_sub=g // g_sub, rows=rows,
                   rows_pad=max(16, pl.next_power_of_2(rows)))


def _pack_q(q, lay: _Layout):
    """[batch, q_len, q_heads, d] -> [batch, kv_heads, n_sub, tiles, rows_pad, d]; row = tile_row * g_sub + head."""
    b, t, _, d = q.shape
    qp = jnp.pad(q, ((0, 0), (0, lay.n_tiles * lay.tile - t), (0, 0), (0, 0)))
    qp = qp.reshape(b, lay.n_tiles, lay.tile, lay.kv_heads, lay.n_sub, lay.g_sub, d)
    qp = qp.transpose(0, 3, 4, 1, 2, 5, 6).reshape(b, lay.kv_heads, lay.n_sub, lay.n_tiles, lay.rows, d)
    return jnp.pad(qp, ((0, 0),) * 4 + ((0, lay.rows_pad - lay.rows), (0, 0)))


def _unpack_out(o, lay: _Layout):
    b, d = lay.batch, lay.d
    o = o[..., : lay.rows, :].reshape(b, lay.kv_heads, lay.n_sub, lay.n_tiles, lay.tile, lay.g_sub, d)
    o = o.transpose(0, 3, 4, 1, 2, 5, 6).reshape(b, lay.n_tiles * lay.tile, lay.kv_heads * lay.group, d)
    return o[:, : lay.q_len]


def _iota(n):
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _gather_rows(ref_, b, idx, h, d, interpret):
    """Rows ref_[b, idx, h, :] -> [len(idx), d]. Interpret mode cannot mix array indices with slices."""
    if interpret:
        return ref_[b, idx[:, None], h, _iota(d)[None, :]]
    return ref_[b, idx, h, :]


def _dot_t(a, b):
    """a [m, d] . b[n, d]^T -> [m, n] fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _row_pos(lay: _Layout, q_start, t):
    """Per packed row: absolute position and whether the row is a real query of this chunk."""
    r = _iota(lay.rows_pad)
    local = t * lay.tile + r // lay.g_sub
    return q_start + local, (r < lay.rows) & (local < lay.q_len)


def _online_step(carry, sc, vb, with_out):
    """One online-softmax step on base-2 logits sc [rows, keys] (-inf = masked)."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    if with_out:
        acc = acc * alpha[:, None] + jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    return m_new, l, acc


# ---------------------------------------------------------------------------------------------------------------
# Kernel 1: causal flash pass -> base-2 LSE per packed row (+ dense output for anchor layer 0).


def _dense_kernel(qs_ref, kvl_ref, q_ref, k_ref, v_ref, *out_refs, lay: _Layout, scale2, block_k, with_out, interpret):
    b = pl.program_id(0)
    hs = pl.program_id(1)
    t = lay.n_tiles - 1 - pl.program_id(2)  # heaviest tiles first
    h, s = hs // lay.n_sub, hs % lay.n_sub
    q_start, kv_len = qs_ref[b], kvl_ref[b]
    q = q_ref[b, h, s, t]  # [rows_pad, d]
    pos, _ = _row_pos(lay, q_start, t)
    tile_start = q_start + t * lay.tile
    end = jnp.maximum(jnp.minimum(tile_start + lay.tile, kv_len), 0)
    n_full = jnp.maximum(jnp.minimum(tile_start, kv_len), 0) // block_k  # blocks wholly visible to every row
    n_all = (end + block_k - 1) // block_k

    def body(j, carry, masked):
        kidx = j * block_k + _iota(block_k)
        if masked or block_k > lay.max_len:  # (a static slice may not exceed the cache even in a dead loop)
            safe = jnp.minimum(kidx, lay.max_len - 1)
            kb = _gather_rows(k_ref, b, safe, h, lay.d, interpret)
            vb = _gather_rows(v_ref, b, safe, h, lay.d, interpret) if with_out else None
        else:
            kb = k_ref[b, pl.ds(j * block_k, block_k), h, :]
            vb = v_ref[b, pl.ds(j * block_k, block_k), h, :] if with_out else None
        sc = _dot_t(q, kb) * scale2
        if masked:
            ok = (kidx[None, :] <= pos[:, None]) & (kidx[None, :] < kv_len)
            sc = jnp.where(ok, sc, -jnp.inf)
        return _online_step(carry, sc, vb, with_out)

    carry = (jnp.full((lay.rows_pad,), _NEG, jnp.float32), jnp.zeros((lay.rows_pad,), jnp.float32),
             jnp.zeros((lay.rows_pad, lay.d), jnp.float32))
    carry = lax.fori_loop(0, n_full, lambda j, c: body(j, c, False), carry)
    m, l, acc = lax.fori_loop(n_full, n_all, lambda j, c: body(j, c, True), carry)
    lse_ref = out_refs[0]
    lse_ref[b, h, s, t] = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    if with_out:
        o_ref = out_refs[1]
        o_ref[b, h, s, t] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _dense_pass(qp, k_cache, v_cache, q_start, kv_len, lay: _Layout, scale, *, with_out, tuning, interpret):
    block_k = tuning.dense_block_k if with_out else tuning.lse_block_k
    stages = tuning.dense_stages if with_out else tuning.lse_stages
    kernel = lambda *refs: _dense_kernel(*refs, lay=lay, scale2=scale * _LOG2E, block_k=block_k,
                                         with_out=with_out, interpret=interpret)
    lse_shape = jax.ShapeDtypeStruct(qp.shape[:-1], jnp.float32)
    out_shape = [lse_shape] + ([jax.ShapeDtypeStruct(qp.shape, qp.dtype)] if with_out else [])
    res = pl.pallas_call(
        kernel, grid=(lay.batch, lay.kv_heads * lay.n_sub, lay.n_tiles), out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=lay.warps, num_stages=stages), interpret=interpret,
        name="kascade_prefill_dense" if with_out else "kascade_prefill_lse",
    )(q_start, kv_len, qp, k_cache, v_cache)
    return res if with_out else (res[0], None)


# ---------------------------------------------------------------------------------------------------------------
# Kernel 2: pooled post-softmax scores of a chunk of tiles over the keys strictly before each tile.


def _eligible(lay: _Layout, q_start, kv_len, t):
    """Keys a tile may select: [0, min(tile_start, kv_len)); none for padding tiles past the chunk."""
    e = jnp.maximum(jnp.minimum(q_start + t * lay.tile, kv_len), 0)
    return jnp.where(t < lay.n_tiles, e, 0)


def _scores_kernel(c_ref, qs_ref, kvl_ref, q_ref, lse_ref, k_ref, sc_ref, *, lay: _Layout, scale2, block_k, chunk,
                   transposed, interpret, sinks=0, window=0):
    b = pl.program_id(0)
    h = pl.program_id(1)
    tl = chunk - 1 - pl.program_id(2)
    t = c_ref[0] * chunk + tl
    q_start, kv_len = qs_ref[b], kvl_ref[b]
    e = _eligible(lay, q_start, kv_len, t)
    t_safe = jnp.minimum(t, lay.n_tiles - 1)
    pos, real = _row_pos(lay, q_start, t_safe)
    pooled_row = real & (pos < kv_len)  # padding queries are left out of the pool
    qs = [q_ref[b, h, s, t_safe] for s in range(lay.n_sub)]
    lses = [jnp.where(pooled_row, lse_ref[b, h, s, t_safe], jnp.inf) for s in range(lay.n_sub)]

    def body(j, carry, edge):
        kidx = j * block_k + _iota(block_k)
        if edge or block_k > lay.max_len:  # the last, partial block: clamp the rows it reads to the cache
            kb = _gather_rows(k_ref, b, jnp.minimum(kidx, lay.max_len - 1), h, lay.d, interpret)
        else:
            kb = k_ref[b, pl.ds(j * block_k, block_k), h, :]
        tot = jnp.zeros((block_k,), jnp.float32)
        for q, lse in zip(qs, lses):
            if transposed:
                tot = tot + jnp.sum(jnp.exp2(_dot_t(kb, q) * scale2 - lse[None, :]), axis=1)
            else:
                tot = tot + jnp.sum(jnp.exp2(_dot_t(q, kb) * scale2 - lse[:, None]), axis=0)
        if sinks or window:  # forced keys (reference.forced_prefill_mask): the first `sinks`, the `window` before the tile
            ts = q_start + t * lay.tile
            forced = (kidx < e) & ((kidx < sinks) | ((kidx >= ts - window) & (kidx < ts)))
            tot = jnp.where(forced, ref.FORCED_SCORE, tot)
        sc_ref[b, h, tl, pl.ds(j * block_k, block_k)] = tot
        return carry  # (returning a literal breaks the Triton lowering of the loop)

    lax.fori_loop(0, e // block_k, lambda j, c: body(j, c, False), jnp.int32(0))
    lax.fori_loop(e // block_k, (e + block_k - 1) // block_k, lambda j, c: body(j, c, True), jnp.int32(0))


# ---------------------------------------------------------------------------------------------------------------
# Kernel 3: exact top-`count` per (tile, head) by bisection on the fp32 bit patterns, then compaction.


def _bisect(keys, n_blk, k, state, nb, cap=None):
    """`nb`-way bisection of the int32 score bits read block by block through `keys(j)` -> (kidx, bits; -1 = none).

    Invariant: c_lo = #bits >= lo >= k > #bits >= hi = c_hi. Stops when c_lo == k, when the bracket is one value, or
    (cap) once the bracket holds <= cap keys."""
    ii = _iota(nb)

    def step(state):
        lo, hi, c_lo, c_hi = state
        width = (hi - lo + nb - 1) // nb
        thr = jnp.minimum(lo + ii * width, hi)

        def count(j, acc):
            _, kb = keys(j)
            return acc + jnp.sum((kb[None, :] >= thr[:, None]).astype(jnp.int32), axis=1)

        cnt = lax.fori_loop(0, n_blk, count, jnp.zeros((nb,), jnp.int32))
        sel = jnp.sum((cnt >= k).astype(jnp.int32)) - 1  # counts fall with the threshold; cnt[0] = c_lo > k
        last = sel == nb - 1
        pick = lambda v, i: jnp.sum(jnp.where(ii == i, v, 0))
        return (pick(thr, sel), jnp.where(last, hi, pick(thr, sel + 1)),
                pick(cnt, sel), jnp.where(last, c_hi, pick(cnt, sel + 1)))

    def cond(s):
        go = (s[2] > k) & (s[1] - s[0] > 1)
        return go if cap is None else go & (s[2] - s[3] > cap)

    return lax.while_loop(cond, step, state)


def _select_kernel(c_ref, qs_ref, kvl_ref, cnt_ref, sc_ref, idx_in_ref, idx_ref, *cand_refs, lay: _Layout, block, chunk,
                   width, nb, cap, use_range, interpret):
    del idx_in_ref  # aliased with idx_ref: tiles of other chunks stay as they are
    b = pl.program_id(0)
    h = pl.program_id(1)
    tl = pl.program_id(2)
    t = c_ref[0] * chunk + tl
    q_start, kv_len = qs_ref[b], kvl_ref[b]
    k = cnt_ref[b, t]
    e = jnp.where(k > 0, _eligible(lay, q_start, kv_len, t), 0)
    n_blk = (e + block - 1) // block
    lanes = _iota(block)

    def keys(j):
        kidx = j * block + lanes
        bits = lax.bitcast_convert_type(sc_ref[b, h, tl, pl.ds(j * block, block)], jnp.int32)
        return kidx, jnp.where(kidx < e, bits, -1)

    if use_range:
        def extent(j, carry):
            _, kb = keys(j)
            return (jnp.minimum(carry[0], jnp.min(jnp.where(kb >= 0, kb, _INF_BITS))),
                    jnp.maximum(carry[1], jnp.max(kb)))

        mn, mx = lax.fori_loop(0, n_blk, extent, (jnp.int32(_INF_BITS), jnp.int32(-1)))
        init = (jnp.minimum(mn, mx + 1), mx + 1, e, jnp.int32(0))  # every eligible key >= mn, none >= mx + 1
    else:
        init = (jnp.int32(0), jnp.int32(_INF_BITS), e, jnp.int32(0))
    lo, hi, c_lo, c_hi = _bisect(keys, n_blk, k, init, nb, cap or None)
    # Final bracket: take every key above it and the lowest positions inside it. Otherwise (cap: the bracket holds
    # <= cap keys but more than needed) take the keys above it and compact the bracket's keys into the candidate
    # buffer, in position order, for the remaining passes.
    final = (c_lo <= k) | (hi - lo <= 1) if cap else True
    need = k - c_hi

    def emit(kidx, take, off):
        take_i = take.astype(jnp.int32)
        pos = jnp.where(take, off + jnp.cumsum(take_i) - 1, width + _iota(take.shape[0]))  # masked: out of bounds
        plgpu.store(idx_ref.at[b, h, t, pos], kidx, mask=take)
        return off + jnp.sum(take_i)

    def compact(j, carry):
        off, taken, n_c = carry
        kidx, kb = keys(j)
        inb = (kb >= lo) & (kb < hi)
        inb_i = inb.astype(jnp.int32)
        off = emit(kidx, (kb >= hi) | (final & inb & (taken + jnp.cumsum(inb_i) - 1 < need)), off)
        if cap:
            cand = inb & jnp.logical_not(final)
            cand_i = cand.astype(jnp.int32)
            cpos = jnp.where(cand, n_c + jnp.cumsum(cand_i) - 1, cap + lanes)
            plgpu.store(cand_refs[0].at[b, h, tl, cpos], kb, mask=cand)
            plgpu.store(cand_refs[1].at[b, h, tl, cpos], kidx, mask=cand)
            n_c = n_c + jnp.sum(cand_i)
        return off, taken + jnp.sum(inb_i), n_c

    off, _, n_c = lax.fori_loop(0, n_blk, compact, (jnp.int32(0), jnp.int32(0), jnp.int32(0)))

    if cap:  # bisect and emit among the <= cap candidates only (cheap re-reads of a small buffer)
        if not interpret:
            plgpu.debug_barrier()  # the candidates written above by other threads of this program are visible
        cblock = min(block, cap)
        clanes = _iota(cblock)

        def ckeys(j):
            p = j * cblock + clanes
            cb = cand_refs[0][b, h, tl, pl.ds(j * cblock, cblock)]
            return cand_refs[1][b, h, tl, pl.ds(j * cblock, cblock)], jnp.where(p < n_c, cb, -1)

        nc_blk = (n_c + cblock - 1) // cblock
        lo2, hi2, _, c_hi2 = _bisect(ckeys, nc_blk, need, (lo, hi, c_lo - c_hi, jnp.int32(0)), nb)
        need2 = need - c_hi2

        def cemit(j, carry):
            off, taken = carry
            kidx, cb = ckeys(j)
            inb = ((cb >= lo2) & (cb < hi2)).astype(jnp.int32)
            take = (cb >= hi2) | ((inb > 0) & (taken + jnp.cumsum(inb) - 1 < need2))
            return emit(kidx, take, off), taken + jnp.sum(inb)

        lax.fori_loop(0, nc_blk, cemit, (off, jnp.int32(0)))

    def fill(j, carry):
        p = j * block + lanes
        ok = (p >= k) & (p < width)
        plgpu.store(idx_ref.at[b, h, t, jnp.where(ok, p, width + lanes)], jnp.full((block,), -1, jnp.int32), mask=ok)
        return carry

    lax.fori_loop(jnp.maximum(k, 0) // block, (width + block - 1) // block, fill, jnp.int32(0))


def _scores_call(lay: _Layout, scale, tuning, chunk, width_s, interpret, sinks=0, window=0):
    """The pooled-score kernel over one chunk of `chunk` tiles: (chunk id [1], q_start, kv_len, qp, lse, k_cache) ->
    [batch, kv_heads, chunk, width_s] fp32 (keys at or past each tile's start are not written)."""
    return pl.pallas_call(
        lambda *r: _scores_kernel(*r, lay=lay, scale2=scale * _LOG2E, block_k=tuning.scores_block_k, chunk=chunk,
                                  transposed=tuning.scores_transposed, interpret=interpret, sinks=sinks,
                                  window=window),
        grid=(lay.batch, lay.kv_heads, chunk),
        out_shape=jax.ShapeDtypeStruct((lay.batch, lay.kv_heads, chunk, width_s), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=lay.warps, num_stages=tuning.scores_stages),
        interpret=interpret, name="kascade_prefill_pooled_scores")


def _score_chunking(lay: _Layout, tuning) -> tuple[int, int, int]:
    """(width_s, chunk, n_chunks) of the pooled scores: rows padded to whole blocks of the score and select kernels,
    and a power-of-two number of tiles per chunk whose fp32 scores fit in _SCORE_CHUNK_BYTES."""
    block = max(tuning.select_block, tuning.scores_block_k)
    width_s = -(-lay.max_len // block) * block
    per_tile = lay.batch * lay.kv_heads * width_s * 4
    chunk = max(1, min(pl.next_power_of_2(lay.n_tiles), 1 << max(0, (_SCORE_CHUNK_BYTES // per_tile).bit_length() - 1)))
    return width_s, chunk, -(-lay.n_tiles // chunk)


def _block_rows(sc, cv, q_start, kv_len, lay: _Layout, chunk, key_block, block_s):
    """A window's key scores [batch, heads, chunk, width] -> block scores [batch, heads, chunk, width_b]: each tile's
    eligible keys summed over aligned blocks of key_block keys (the rest, unwritten by the score kernels, counts 0;
    the select masks blocks past the eligible ones), rows padded to whole select blocks of block_s."""
    t = cv[0] * chunk + jnp.arange(chunk)
    e = _eligible(lay, q_start[:, None], kv_len[:, None], t[None, :])  # [batch, chunk]
    sc = jnp.where(jnp.arange(sc.shape[-1]) < e[:, None, :, None], sc, 0.0)
    n_blk = -(-sc.shape[-1] // key_block)
    sc = jnp.pad(sc, ((0, 0),) * 3 + ((0, n_blk * key_block - sc.shape[-1]),))
    sc = sc.reshape(sc.shape[:3] + (n_blk, key_block)).sum(-1)
    return jnp.pad(sc, ((0, 0),) * 3 + ((0, -(-n_blk // block_s) * block_s - n_blk),))


def _anchor_select(qp, lse, k_cache, q_start, kv_len, counts, lay: _Layout, scale, k_max, pool, tuning, interpret,
                   sinks=0, window=0, mgpu_scores=None, key_block=1):
    """Exact per-tile top-k in chunks of tiles -> idx [batch, idx_heads, tiles, k_max]. mgpu_scores: a window of
    tiles' pooled scores from `prefill_mgpu` (a chunk at position 0: `_mgpu_keys`), (first tile [1], tiles,
    width) -> [1, kv_heads, tiles, width], instead of the Triton kernel on the packed `lse`. key_block = kb > 1:
    counts are blocks, the select runs on block scores (`_block_rows`) and idx is [..., ceil(k_max / kb) kb] of
    expanded blocks; the select kernel gets positions in blocks, as ceil(min(tile_start, kv_len) / kb) =
    min(ceil(q_start / kb) + t tile / kb, ceil(kv_len / kb)) when kb divides the tile."""
    width_s, chunk, n_chunks = _score_chunking(lay, tuning)
    block_s = tuning.select_block
    kb = key_block
    lay_s = lay if kb == 1 else dataclasses.replace(lay, tile=lay.tile // kb)
    qs_s, kvl_s = (q_start, kv_len) if kb == 1 else (-(-q_start // kb), -(-kv_len // kb))
    k_max = -(-k_max // kb)  # the select's width, in blocks
    idx_heads = lay.kv_heads if pool == "gqa" else 1
    n_pad = n_chunks * chunk
    counts_p = jnp.pad(counts, ((0, 0), (0, n_pad - lay.n_tiles)))
    if mgpu_scores is None:
        scores_call = _scores_call(lay, scale, tuning, chunk, width_s, interpret, sinks, window)
        chunk_scores = lambda cv: scores_call(cv, q_start, kv_len, qp, lse, k_cache)
    else:
        width_m = -(-width_s // 128) * 128  # (the select reads < width_s of each row)

        def chunk_scores(cv):
            sc = mgpu_scores(cv * chunk, chunk, width_m)
            if sinks or window:  # forced keys, as the Triton kernel writes them (every key of the chunk is valid)
                t = cv[0] * chunk + _iota(chunk)
                ts = t * lay.tile
                e = jnp.where(t < lay.n_tiles, ts, 0)
                forced = ref.forced_prefill_mask(ts[None], e[None], width_m, sinks, window)
                sc = jnp.where(forced[:, None], ref.FORCED_SCORE, sc)
            return sc
    cap = tuning.select_cand
    cand_shape = [jax.ShapeDtypeStruct((lay.batch, idx_heads, chunk, cap), jnp.int32)] * (2 if cap else 0)
    select_call = pl.pallas_call(
        lambda *r: _select_kernel(*r, lay=lay_s, block=block_s, chunk=chunk, width=k_max, nb=tuning.select_nb,
                                  cap=cap, use_range=tuning.select_range, interpret=interpret),
        grid=(lay.batch, idx_heads, chunk),
        out_shape=[jax.ShapeDtypeStruct((lay.batch, idx_heads, n_pad, k_max), jnp.int32)] + cand_shape,
        input_output_aliases={5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=tuning.select_warps, num_stages=tuning.select_stages),
        interpret=interpret, name="kascade_prefill_select")

    def one_chunk(c, idx):
        cv = jnp.reshape(c, (1,)).astype(jnp.int32)
        sc = chunk_scores(cv)
        if pool == "all":
            sc = jnp.sum(sc, axis=1, keepdims=True)
        if kb > 1:
            sc = _block_rows(sc, cv, q_start, kv_len, lay, chunk, kb, block_s)
        return select_call(cv, qs_s, kvl_s, counts_p, sc, idx)[0]  # (candidate buffers: scratch)

    idx = jnp.full((lay.batch, idx_heads, n_pad, k_max), -1, jnp.int32)
    idx = lax.fori_loop(0, n_chunks, one_chunk, idx)
    return ref.expand_blocks(idx[:, :, : lay.n_tiles], kb)


# ---------------------------------------------------------------------------------------------------------------
# Kernel 4: sparse reuse prefill.


def _reuse_ids(lay: _Layout, order):
    """(batch, KV head, sub-group, tile) of this program. Later tiles select more keys: they start first."""
    if order == "head_major":  # grid (tiles * n_sub, kv_heads, batch): CUDA launches axis 0 fastest
        p = pl.program_id(0)
        return pl.program_id(2), pl.program_id(1), p % lay.n_sub, lay.n_tiles - 1 - p // lay.n_sub
    hs = pl.program_id(1)  # grid (batch, kv_heads * n_sub, tiles): all heads of a tile, then the next tile
    return pl.program_id(0), hs // lay.n_sub, hs % lay.n_sub, lay.n_tiles - 1 - pl.program_id(2)


def _reuse_grid(lay: _Layout, order):
    if order == "head_major":
        return (lay.n_tiles * lay.n_sub, lay.kv_heads, lay.batch)
    return (lay.batch, lay.kv_heads * lay.n_sub, lay.n_tiles)


def _reuse_kernel(qs_ref, kvl_ref, cnt_ref, hm_ref, q_ref, k_ref, v_ref, idx_ref, o_ref, *, lay: _Layout, scale2,
                  block_k, width, order, prefetch, interpret):
    b, h, s, t = _reuse_ids(lay, order)
    src = hm_ref[h]
    q_start, kv_len = qs_ref[b], kvl_ref[b]
    cnt = cnt_ref[b, t]
    q = q_ref[b, h, s, t]
    pos, _ = _row_pos(lay, q_start, t)
    tile_start = q_start + t * lay.tile
    lanes = _iota(block_k)
    load_ix = lambda j: idx_ref[b, src, t, jnp.minimum(j * block_k + lanes, width - 1)]

    def step(j, carry, ix):
        lane = j * block_k + lanes
        ok = (lane < cnt) & (ix >= 0) & (ix < jnp.minimum(kv_len, tile_start))
        safe = jnp.where(ok, ix, 0)
        kb = _gather_rows(k_ref, b, safe, h, lay.d, interpret)
        vb = _gather_rows(v_ref, b, safe, h, lay.d, interpret)
        sc = jnp.where(ok[None, :], _dot_t(q, kb) * scale2, -jnp.inf)
        return _online_step(carry, sc, vb, True)

    carry = (jnp.full((lay.rows_pad,), _NEG, jnp.float32), jnp.zeros((lay.rows_pad,), jnp.float32),
             jnp.zeros((lay.rows_pad, lay.d), jnp.float32))
    n_blk = (jnp.maximum(cnt, 0) + block_k - 1) // block_k
    if prefetch:
        def body(j, c):
            nxt = load_ix(j + 1)
            return step(j, c[:3], c[3]) + (nxt,)

        carry = lax.fori_loop(0, n_blk, body, carry + (load_ix(0),))[:3]
    else:
        carry = lax.fori_loop(0, n_blk, lambda j, c: step(j, c, load_ix(j)), carry)
    # The causal diagonal tile, always attended.
    kidx = tile_start + _iota(lay.tile)
    safe = jnp.clip(kidx, 0, lay.max_len - 1)
    kb = _gather_rows(k_ref, b, safe, h, lay.d, interpret)
    vb = _gather_rows(v_ref, b, safe, h, lay.d, interpret)
    ok = (kidx[None, :] <= pos[:, None]) & (kidx[None, :] < kv_len) & (kidx[None, :] >= 0)
    sc = jnp.where(ok, _dot_t(q, kb) * scale2, -jnp.inf)
    _, l, acc = _online_step(carry, sc, vb, True)
    o_ref[b, h, s, t] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _reuse_call(qp, k_cache, v_cache, q_start, kv_len, idx, counts, head_map_row, lay: _Layout, scale, tuning,
                interpret):
    """qp packed with `lay` (whose row cap is tuning.reuse_rows) -> packed out."""
    block_k = tuning.reuse_block_k
    width = idx.shape[-1]
    kernel = lambda *r: _reuse_kernel(*r, lay=lay, scale2=scale * _LOG2E, block_k=block_k, width=width,
                                      order=tuning.reuse_order, prefetch=tuning.reuse_prefetch, interpret=interpret)
    return pl.pallas_call(
        kernel, grid=_reuse_grid(lay, tuning.reuse_order),
        out_shape=jax.ShapeDtypeStruct(qp.shape, qp.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.reuse_warps or lay.warps, num_stages=tuning.reuse_stages),
        interpret=interpret, name="kascade_prefill_reuse",
    )(q_start, kv_len, counts, head_map_row, qp, k_cache, v_cache, idx)


# ---------------------------------------------------------------------------------------------------------------
# Anchor layer 0 through cuDNN: dense output + per-row LSE (softmax statistics) from one cuDNN flash attention.


def cudnn_lse_ok(q, k_cache, interpret=False) -> bool:
    """cuDNN flash attention can serve this call: a GPU backend, bf16/fp16, head_dim a multiple of 8 up to 256."""
    return (not interpret and jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
            and k_cache.dtype == q.dtype and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def cudnn_attention_lse(q, k_cache, v_cache, kv_len, scale):
    """Causal attention of a chunk that starts at position 0 -> (out [batch, q_len, q_heads, d], lse [batch, q_len,
    q_heads] fp32, natural log of the scaled logits: the convention of models/README.md).

    `jax.nn.dot_product_attention(..., return_residual=True)` casts the LSE to the output dtype (bf16 would move
    every probability by up to ~3%), so this calls the cuDNN wrapper underneath it, which returns the fp32 softmax
    statistics [batch, q_heads, q_len]. All q_len query rows are kept (query lengths = q_len): rows at positions
    >= kv_len (padding) then attend every valid key, as in the reference.
    """
    from jax._src.cudnn import fused_attention_stablehlo as fa

    b, t = q.shape[:2]
    kk, vv = k_cache[:, :t], v_cache[:, :t]  # keys past the chunk are never causally visible from it
    q_len = jnp.full((b,), t, jnp.int32)
    kv = jnp.clip(kv_len, 0, t).astype(jnp.int32)
    out, stats = fa.dot_product_attention(q, kk, vv, None, None, q_len, kv, scale=scale,
                                          mask_type=fa.MaskType.PADDING_CAUSAL, return_residual=True)
    return out, jnp.transpose(stats.astype(jnp.float32), (0, 2, 1))


def pack_lse(lse, lay: _Layout):
    """Natural-log lse [batch, q_len, q_heads] -> the kernels' base-2 packed layout [batch, kv_heads, n_sub, tiles,
    rows_pad] (row = tile_row * g_sub + head, as `_pack_q`); padding rows hold -inf (never pooled)."""
    b, t, _ = lse.shape
    x = jnp.pad(lse.astype(jnp.float32) * _LOG2E, ((0, 0), (0, lay.n_tiles * lay.tile - t), (0, 0)),
                constant_values=-jnp.inf)
    x = x.reshape(b, lay.n_tiles, lay.tile, lay.kv_heads, lay.n_sub, lay.g_sub)
    x = x.transpose(0, 3, 4, 1, 2, 5).reshape(b, lay.kv_heads, lay.n_sub, lay.n_tiles, lay.rows)
    return jnp.pad(x, ((0, 0),) * 4 + ((0, lay.rows_pad - lay.rows),), constant_values=-jnp.inf)


# ---------------------------------------------------------------------------------------------------------------
# The Mosaic GPU anchor passes (`prefill_mgpu`, tuning.anchor_backend="mgpu") and their scope.


def _mgpu_keys(q, k_cache, v_cache, q_start, tile_size, chunk_at_zero, tuning, interpret):
    """(k, v) cut to the chunk's keys if `prefill_mgpu` takes this anchor call, else None (the Triton path).

    The Mosaic GPU kernels take no lengths, so the chunk must start at position 0 (q_start concrete 0, or
    chunk_at_zero). kv_len is not a condition (concrete or traced): from position 0 the keys past the chunk are never
    causally visible, and rows at or past kv_len (padding) are taken out of the pooled scores by an infinite LSE."""
    if _backend(tuning.anchor_backend, interpret) != "mgpu" or not (interpret or jax.default_backend() == "gpu"):
        return None
    from kernels_pallas import prefill_mgpu as M

    t = q.shape[1]
    if k_cache.shape[1] < t or v_cache is None:
        return None
    k, v = (k_cache, v_cache) if k_cache.shape[1] == t else (k_cache[:, :t], v_cache[:, :t])
    ok = M.supported(q, k, tile_size, q_start=None if chunk_at_zero else q_start)
    return (k, v) if ok else None


# ---------------------------------------------------------------------------------------------------------------
# Public API.


def _ints(x, name, b):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {x.dtype}")
    return x.astype(jnp.int32)


def _reuse_any(q, k_cache, v_cache, q_start, kv_len, idx, counts, head_map_row, tile_size, key_block, scale, tuning,
               interpret, qp=None, lay=None):
    """The Pallas reuse of either backend (`PrefillTuning.reuse_backend`) -> out [batch, q_len, q_heads, d]; qp / lay:
    q already packed for the Triton kernel (the anchor's own pack)."""
    if key_block > 1 and _backend(tuning.reuse_backend, interpret) == "mgpu":
        from kernels_pallas import prefill_mgpu as M

        if M.reuse_unsupported_reason(q, k_cache, tile_size, key_block) is None:
            return M.reuse_blocks(q, k_cache, v_cache, q_start, kv_len, idx, counts, head_map_row, tile_size,
                                  key_block, scale=scale, interpret=interpret)
    lay_r = _layout(q, k_cache, tile_size, tuning.reuse_rows)
    qp_r = qp if qp is not None and lay_r == lay else _pack_q(q, lay_r)
    o = _reuse_call(qp_r, k_cache, v_cache, q_start, kv_len, idx, counts, head_map_row, lay_r, scale, tuning,
                    interpret)
    return _unpack_out(o, lay_r)


def reuse_prefill(q, k_cache, v_cache, q_start, kv_len, idx, counts, head_map_row, tile_size, *, scale=None,
                  impl="auto", interpret=False, tuning: PrefillTuning | None = None, key_block: int = 1):
    """Sparse prefill: each query tile attends its selected keys (through head_map_row) plus its causal diagonal tile.

    q [batch, q_len, q_heads, d]; caches [batch, max_len, kv_heads, d] with this chunk written; q_start, kv_len
    [batch]; idx [batch, idx_heads, tiles, k_max] (distinct keys strictly before each tile, -1 past counts);
    counts [batch, tiles]; head_map_row [kv_heads] int32. Returns out [batch, q_len, q_heads, d]. key_block: the
    anchor's (`anchor_prefill`); its expanded blocks are ordinary key ids (ids at or past min(tile_start, kv_len)
    are masked), so it is only checked here.
    """
    _check_common(q, k_cache, v_cache, q_start, kv_len, tile_size)
    ref.check_key_block(key_block, tile_size)
    b = q.shape[0]
    n_tiles = -(-q.shape[1] // tile_size)
    if idx.ndim != 4 or idx.shape[0] != b or idx.shape[2] != n_tiles:
        raise ValueError(f"idx must be [batch={b}, idx_heads, tiles={n_tiles}, k_max], got {idx.shape}")
    if idx.shape[-1] % key_block:
        raise ValueError(f"key_block ({key_block}) must divide the idx width, got idx {idx.shape}")
    if jnp.shape(counts) != (b, n_tiles):
        raise ValueError(f"counts must be [batch, tiles] = ({b}, {n_tiles}), got {jnp.shape(counts)}")
    if jnp.shape(head_map_row) != (k_cache.shape[2],):
        raise ValueError(f"head_map_row must be [kv_heads] = ({k_cache.shape[2]},), got {jnp.shape(head_map_row)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q_start, kv_len = _ints(q_start, "q_start", b), _ints(kv_len, "kv_len", b)
    head_map_row = _ints(head_map_row, "head_map_row", b)
    if not use_pallas(impl, interpret):
        return ref.sparse_prefill_reference(q, k_cache, v_cache, q_start, kv_len, idx, head_map_row, tile_size,
                                            scale=scale)
    _check_pallas(q, k_cache, v_cache)
    tuning = tuning or DEFAULT_TUNING
    counts = jnp.minimum(_ints(counts, "counts", b), idx.shape[-1])  # never read past the index buffer
    return _reuse_any(q, k_cache, v_cache, q_start, kv_len, idx.astype(jnp.int32), counts, head_map_row, tile_size,
                      key_block, scale, tuning, interpret)


def dense_prefill_supported(q, k_cache) -> bool:
    """Whether `dense_prefill` runs its Pallas kernel for these operands (else callers keep another path)."""
    return q.shape[-1] in _HEAD_DIMS and q.dtype in (jnp.bfloat16, jnp.float16) and k_cache.dtype == q.dtype


def dense_prefill(q, k_cache, v_cache, q_start, kv_len, *, tile_size: int = 32, scale=None, impl="auto",
                  interpret=False, tuning: PrefillTuning | None = None):
    """Causal dense attention of a prefill chunk at any offset: the anchor pipeline's flash pass with its output
    (`_dense_kernel`), so a chunk after the first never materialises [batch, heads, chunk, keys] scores (the
    reference does; cuDNN serves only chunks at position 0). Rows at or past kv_len (padding) are finite and
    unspecified, as in the reference.

    q [batch, q_len, q_heads, d], caches [batch, keys, kv_heads, d], q_start / kv_len [batch] -> out like q."""
    _check_common(q, k_cache, v_cache, q_start, kv_len, tile_size)
    b = q.shape[0]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q_start, kv_len = _ints(q_start, "q_start", b), _ints(kv_len, "kv_len", b)
    if not use_pallas(impl, interpret):
        return ref.attention_reference(q, k_cache, v_cache, q_start, kv_len, scale=scale)
    _check_pallas(q, k_cache, v_cache)
    lay = _layout(q, k_cache, tile_size)
    _, out = _dense_pass(_pack_q(q, lay), k_cache, v_cache, q_start, kv_len, lay, scale, with_out=True,
                         tuning=tuning or DEFAULT_TUNING, interpret=interpret)
    return _unpack_out(out, lay)


def anchor_prefill(q, k_cache, v_cache, q_start, kv_len, seq_len, tile_size, *, topk_frac, min_k, k_max, rolling=True,
                   dense_out=False, pool="gqa", scale=None, impl="auto", interpret=False,
                   tuning: PrefillTuning | None = None, chunk_at_zero=False, sinks: int = 0, window: int = 0,
                   extra_k: int = 0, key_block: int = 1, score_fp8: bool = False):
    """Anchor prefill: pooled post-softmax scores per (tile, head), exact rolling top-k, then attention.

    Returns (out [batch, q_len, q_heads, d], idx [batch, idx_heads, tiles, k_max], counts [batch, tiles]); out is
    the sparse output on the layer's own indices, or the dense causal output with dense_out=True (anchor layer 0).
    key_block = kb > 1 (a divisor of tile_size): select aligned blocks of kb keys (`reference.select_blocks_reference`):
    idx is then [..., ceil(k_max / kb) kb] wide, each block's kb consecutive ids, and counts are blocks x kb.
    chunk_at_zero (static): the caller guarantees q_start == 0 for every sequence, which lets anchor layer 0 take
    its dense output and LSE from cuDNN (tuning.anchor0_cudnn, GPU only). `sinks` / `window`: forced keys of every
    tile (the first `sinks` keys and the `window` keys before the tile score `reference.FORCED_SCORE`). `extra_k`:
    keys added to every tile's budget (`reference.prefill_counts(extra=...)`), e.g. a forced local window that
    does not count against the Top-k. tuning.anchor_backend="mgpu": a chunk at position 0 takes the Mosaic GPU LSE
    and score passes whatever its kv_len (`_mgpu_keys`). score_fp8 (static; ignored with dense_out, whose dense pass
    gives the exact LSE anyway): the scores come from fp8 copies of q and the mean-centred k
    (`reference.fp8_score_operands`): on fp8 in the Mosaic GPU passes, widened to q's dtype elsewhere (same logits).
    """
    ref.check_forced(sinks, window)
    _check_common(q, k_cache, v_cache, q_start, kv_len, tile_size)
    ref.check_key_block(key_block, tile_size)
    if chunk_at_zero and not isinstance(q_start, jax.core.Tracer) and np.any(np.asarray(q_start) != 0):
        raise ValueError(f"chunk_at_zero=True needs q_start == 0 for every sequence, got {q_start}")
    if pool not in ("gqa", "all", "pre_softmax"):
        raise ValueError(f"pool must be 'gqa', 'all' or 'pre_softmax', got {pool!r}")
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    ref.frac_numerator(topk_frac)
    if min_k < 0:
        raise ValueError(f"min_k must be >= 0, got {min_k}")
    b, t = q.shape[:2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q_start_in = q_start  # (the Mosaic GPU scope check needs it as the caller gave it: concrete or not)
    q_start, kv_len = _ints(q_start, "q_start", b), _ints(kv_len, "kv_len", b)
    seq_len = _ints(jnp.broadcast_to(jnp.asarray(seq_len), (b,)), "seq_len", b)
    counts = ref.prefill_counts(q_start, kv_len, seq_len, t, tile_size, topk_frac, min_k, rolling, extra=extra_k)
    counts = jnp.minimum(counts, k_max)
    eligible = ref.prefill_eligible(q_start, kv_len, t, tile_size)[1]  # [batch, tiles]
    idx_heads = k_cache.shape[2] if pool != "all" else 1
    identity = jnp.arange(k_cache.shape[2], dtype=jnp.int32) if pool != "all" else jnp.zeros(k_cache.shape[2], jnp.int32)
    fp8 = bool(score_fp8) and not dense_out
    if fp8 and pool == "pre_softmax":
        raise ValueError("score_fp8 scores post-softmax pools (gqa, all), got pool='pre_softmax'")
    q_s, k_s = q, k_cache  # the score operands (fp8: the fp8 values widened, for the Triton and reference paths)
    mult = None  # fp8: the Mosaic GPU passes' scale_mult
    if fp8:
        q8, k8, mult = ref.fp8_score_operands(q, k_cache, kv_len)
        q_s, k_s = ref.fp8_widen(q8, mult, q.dtype), ref.fp8_widen(k8, None, k_cache.dtype)
    if not use_pallas(impl, interpret):
        scores, _ = ref.pooled_scores_prefill_reference(q_s, k_s, q_start, kv_len, tile_size, pool=pool, scale=scale,
                                                        sinks=sinks, window=window)
        if key_block > 1:
            idx, counts = ref.select_blocks_reference(scores, counts, eligible, k_max, key_block)
        else:
            idx = ref.select_topk_reference(scores, counts[:, None, :], k_max)
            idx = jnp.pad(idx, ((0, 0), (0, 0), (0, 0), (0, k_max - idx.shape[-1])), constant_values=-1)
        if dense_out:
            out = ref.attention_reference(q, k_cache, v_cache, q_start, kv_len, scale=scale)
        else:
            out = ref.sparse_prefill_reference(q, k_cache, v_cache, q_start, kv_len, idx, identity, tile_size,
                                               scale=scale)
        return out, idx, counts
    if pool == "pre_softmax":
        raise ValueError("pool='pre_softmax' has no Pallas kernel; use impl='reference'")
    _check_pallas(q, k_cache, v_cache)
    lay = _layout(q, k_cache, tile_size)
    qp = _pack_q(q, lay)
    tuning = tuning or DEFAULT_TUNING
    keys = _mgpu_keys(q, k_cache, v_cache, q_start_in, tile_size, chunk_at_zero, tuning, interpret)
    qp_s = _pack_q(q_s, lay) if fp8 and keys is None else qp  # (the Mosaic GPU passes take q unpacked)
    mq, mk = None, None  # the Mosaic GPU score passes' q and k (cut to the chunk)
    if keys is not None:
        from kernels_pallas import prefill_mgpu as M

        mq, mk = (q8, k8[:, : q.shape[1]]) if fp8 else (q, keys[0])
    lse2 = None  # Mosaic GPU scope: base-2 lse [1, q_heads, q_len] for `prefill_mgpu.pooled_scores`
    if dense_out and chunk_at_zero and tuning.anchor0_cudnn and cudnn_lse_ok(q, k_cache, interpret):
        out, lse_nat = cudnn_attention_lse(q, k_cache, v_cache, kv_len, scale)
        lse = pack_lse(lse_nat, lay)
        if keys is not None:
            lse2 = jnp.transpose(lse_nat, (0, 2, 1)) * _LOG2E
    elif keys is not None:
        if dense_out:
            out, lse2 = M.flash_lse(q, *keys, scale=scale, with_out=True, interpret=interpret)
        else:
            out, lse2 = M.flash_lse(mq, mk, scale=scale, with_out=False, interpret=interpret, scale_mult=mult)
        lse = None  # (the Triton score kernel's packed rows: `prefill_mgpu.lse_for_triton`)
    else:
        lse, out = _dense_pass(qp_s, k_s, v_cache, q_start, kv_len, lay, scale, with_out=dense_out,
                               tuning=tuning, interpret=interpret)
        out = _unpack_out(out, lay) if dense_out else None
    mgpu_scores = None
    if keys is not None:
        # padding rows (at or past kv_len) pool nothing: exp2(s - inf) = 0 (the Triton score pass masks them)
        lse2 = jnp.where(jnp.arange(t)[None, None, :] < kv_len[:, None, None], lse2, jnp.inf)
        packed = M.pack_scores_inputs(mq, mk, lse2, tile_size)  # once, outside the select's loop over windows
        mgpu_scores = lambda first, n, width: M.pooled_scores(mq, mk, lse2, tile_size, scale=scale,
                                                              interpret=interpret, first_tile=first, n_tiles=n,
                                                              width=width, packed=packed, scale_mult=mult)
    sel_counts = counts if key_block == 1 else ref.block_counts(counts, eligible, key_block)  # keys or blocks
    idx = _anchor_select(qp_s, lse, k_s, q_start, kv_len, sel_counts, lay, scale, k_max, pool, tuning, interpret,
                         sinks, window, mgpu_scores, key_block)
    if key_block > 1:
        counts = sel_counts * key_block
    assert idx.shape[1] == idx_heads
    if dense_out:
        return out, idx, counts
    out = _reuse_any(q, k_cache, v_cache, q_start, kv_len, idx, counts, identity, tile_size, key_block, scale, tuning,
                     interpret, qp=qp, lay=lay)
    return out, idx, counts
