"""Calibration statistics as an attention strategy: head-level cross-layer similarity and layer importance.

`CalibrationStrategy` runs inside an ordinary dense forward (`models.generate.forward`, prefill, one chunk at
position 0). In every layer b its `attend`:
1. computes the DENSE output (so later layers see the exact model, unlike the official code, which sparsified
   every layer while collecting) together with the pooled post-softmax scores A_b[h, t, j] (summed over the
   GQA group and the valid queries of query tile t, keys strictly before the tile) and the diagonal-tile mass
   D_b[h, t], from one softmax per query block;
2. takes its own Top-k' set I_b[h, t] with k' = k - tile_size (the official calibration: k = 64 -> 32
   selected keys + the always-attended diagonal tile of 32);
3. for every earlier-or-same layer a <= b and heads (h of b, g of a) computes
       r_t = (sum_{j in I_a[g,t]} A_b[h,t,j] + D_b[h,t]) / (sum_{j in I_b[h,t]} A_b[h,t,j] + D_b[h,t])
   and reduces over the valid query tiles (min, mean, or the mean over the last TAIL_TILES: "tail", the prompt's
   end where the question is read and the answer starts, i.e. what a decode step sees), giving the row sim[:, b];
4. drops A_b. Only the small index sets of earlier layers ([kv_heads, tiles, k'] per layer) stay in the state,
   so memory is O(L * kv_heads * tiles * k' + one layer's scores), never [L x L x S x S].
`post_attention` records the layer importance w_b = 1 - mean over valid tokens of cos(x_b, x_b + attn_out_b).

Tiles that have no eligible key (tile 0) or no valid query (right padding) are skipped in the reduction.
Because I_b is the best k'-set for A_b and all layers see the same eligible keys, 0 <= r_t <= 1 up to float
rounding (clipped), and sim[b, b, h, h] = 1.

Deliberately not here: decode rows (the official code appended them; calibration here is prefill only), the
average over prompts (the driver in `runner.py` does that) and anything about anchors (`dp.py`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

REDUCES = ("min", "mean", "tail")
TAIL_TILES = 4  # reduce="tail": the mean over the last valid query tiles (4 x 32 tokens: the question's end)


@dataclasses.dataclass(frozen=True)
class CalibrationStrategy:
    num_layers: int
    kv_heads: int
    tile_size: int = 32
    k: int = 64  # total budget of the official statistics: k - tile_size selected keys + the diagonal tile
    reduce: str = "min"  # over query tiles: "min" (the paper), "mean" (Fig. 3) or "tail" (the last TAIL_TILES)
    block_tiles: int | None = None  # query tiles per softmax block; None: bounded by SCORE_BLOCK_BYTES
    name: str = "calibration"

    def __post_init__(self):
        for f in ("num_layers", "kv_heads", "tile_size", "k", "block_tiles"):
            v = getattr(self, f)
            if f == "block_tiles" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be an int >= 1, got {v!r}")
        if self.k <= self.tile_size:
            raise ValueError(f"k must exceed tile_size ({self.tile_size}): k - tile_size keys are selected on top of "
                             f"the diagonal tile, got k={self.k}")
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {REDUCES}, got {self.reduce!r}")

    @property
    def num_selected(self) -> int:
        """k' = k - tile_size: keys each (tile, KV head) selects before its own diagonal tile."""
        return self.k - self.tile_size

    def init_state(self, batch: int):
        L, H = self.num_layers, self.kv_heads
        return dict(
            idx=(),  # per earlier layer: [batch, kv_heads, tiles, k'] int32, -1 = no key
            sim=jnp.zeros((batch, L, L, H, H), jnp.float32),  # [batch, a, b, h (of b), g (of a)]
            w=jnp.zeros((batch, L), jnp.float32),
            kv_len=jnp.zeros((batch,), jnp.int32),
        )

    def attend(self, layer, inputs, state):
        if inputs.phase != "prefill" or not inputs.chunk_at_zero:
            raise ValueError(f"CalibrationStrategy runs on one prefill chunk at position 0, got phase={inputs.phase!r}, "
                             f"chunk_at_zero={inputs.chunk_at_zero}")
        q = inputs.q  # [batch, T, q_heads, d]
        b, t = q.shape[:2]
        if inputs.k_cache.shape[2] != self.kv_heads:
            raise ValueError(f"kv_heads of the strategy ({self.kv_heads}) != the model's ({inputs.k_cache.shape[2]})")
        if state is None:
            state = self.init_state(b)
        k, v = inputs.k_cache[:, :t], inputs.v_cache[:, :t]
        out, scores, diag = dense_with_pooled(q, k, v, inputs.kv_len, self.tile_size, self.block_tiles)
        idx, sim_row = layer_similarity_row(scores, diag, state["idx"], inputs.kv_len, self.tile_size,
                                            self.num_selected, self.reduce)
        sim = state["sim"].at[:, : layer + 1, layer].set(jnp.moveaxis(sim_row, 0, 1))
        return out, dict(state, idx=state["idx"] + (idx,), sim=sim, kv_len=inputs.kv_len)

    def post_attention(self, layer, x, attn_out, state):
        w = importance(x, attn_out, state["kv_len"])
        return dict(state, w=state["w"].at[:, layer].set(w))


SCORE_BLOCK_BYTES = 512 << 20  # fp32 score bytes of one query block when block_tiles is None


def _block_tiles(n_tiles: int, tile_size: int, q_heads: int, batch: int) -> int:
    """Query tiles per block: the fewest blocks whose [batch, q_heads, rows, keys] fp32 scores stay under
    SCORE_BLOCK_BYTES (one block at 1-2K tokens, 30 at 16K for the Qwen 0.5B's 14 heads)."""
    keys = n_tiles * tile_size
    full = 4 * batch * q_heads * keys * keys
    n_blocks = min(n_tiles, max(1, -(-full // SCORE_BLOCK_BYTES)))
    return -(-n_tiles // n_blocks)


def dense_with_pooled(q, k, v, kv_len, tile_size: int, block_tiles: int | None = None, scale=None):
    """Dense causal attention of a prefill chunk at position 0 plus its tile-pooled post-softmax scores.

    q [batch, T, q_heads, d], k/v [batch, T, kv_heads, d], kv_len [batch]. Returns out [batch, T, q_heads, d]
    (q's dtype), scores [batch, kv_heads, tiles, T] fp32 (-inf on keys not strictly before the tile or not
    valid) and diag [batch, kv_heads, tiles] fp32 -- the same values as `attention_reference` and
    `pooled_scores_prefill_reference(pool="gqa")`, from one softmax.

    Query blocks of `block_tiles` tiles (None: `_block_tiles`, a bound on the block's fp32 scores) run in a
    `lax.scan`, so one block's scores are live at a time. An unrolled loop with a causal key range per block did
    half the arithmetic, but XLA kept every block's scores alive: 16.6 GiB of temporaries at 16K on the CPU (a 37.5 GiB
    allocation failed a 16K calibration on the H200), against 1.3 GiB now.
    """
    b, t, hq, d = q.shape
    kvh = k.shape[2]
    g = hq // kvh
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n_tiles = -(-t // tile_size)
    bt = block_tiles or _block_tiles(n_tiles, tile_size, hq, b)
    n_blocks = -(-n_tiles // bt)
    tp, rows = n_blocks * bt * tile_size, bt * tile_size  # query rows padded to whole blocks; keys stay t
    qf = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0))).astype(jnp.float32).reshape(b, n_blocks, rows, kvh, g, d)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    keys = jnp.arange(t)

    def block(_, i):
        start = i * rows
        logits = jnp.einsum("btkgd,bskd->bkgts", qf[:, i], kf,
                            precision=jax.lax.Precision.HIGHEST) * scale  # [batch, kv_heads, group, rows, t]
        pos = start + jnp.arange(rows)
        allowed = (keys[None, None, :] <= pos[None, :, None]) & (keys[None, None, :] < kv_len[:, None, None])
        logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)  # rows with no key stay 0
        out = jnp.einsum("bkgts,bskd->btkgd", p, vf, precision=jax.lax.Precision.HIGHEST)
        row_valid = (pos[None, :] < kv_len[:, None]).astype(jnp.float32)  # padding queries leave the pool
        pooled = jnp.einsum("bkgts,bt->bkts", p, row_valid).reshape(b, kvh, bt, tile_size, t).sum(3)
        tile_start = start + jnp.arange(bt) * tile_size  # [bt]
        in_diag = (keys[None, :] >= tile_start[:, None]) & (keys[None, :] < tile_start[:, None] + tile_size)
        diag = jnp.sum(jnp.where(in_diag[None, None], pooled, 0.0), axis=-1)
        before = (keys[None, None, :] < tile_start[None, :, None]) & (keys[None, None, :] < kv_len[:, None, None])
        return None, (out, jnp.where(before[:, None], pooled, -jnp.inf), diag)

    _, (outs, scores, diags) = jax.lax.scan(block, None, jnp.arange(n_blocks))
    out = jnp.moveaxis(outs, 0, 1).reshape(b, tp, hq, d)[:, :t].astype(q.dtype)
    scores = jnp.moveaxis(scores, 0, 2).reshape(b, kvh, n_blocks * bt, t)[:, :, :n_tiles]
    diag = jnp.moveaxis(diags, 0, 2).reshape(b, kvh, n_blocks * bt)[:, :, :n_tiles]
    return out, scores, diag


def layer_similarity_row(scores, diag, prev_idx, kv_len, tile_size: int, num_selected: int, reduce: str):
    """Top-k' sets of this layer and its similarity row against itself and every earlier layer.

    scores [batch, kv_heads, tiles, keys] (-inf = not eligible), diag [batch, kv_heads, tiles], prev_idx: tuple
    of earlier layers' [batch, kv_heads, tiles, k'] index sets. Returns (idx [batch, kv_heads, tiles, k'] int32,
    sim_row [a = len(prev_idx) + 1, batch, h (this layer), g (layer a)] fp32).
    """
    b, kvh, n_tiles, n_keys = scores.shape
    kk = min(num_selected, n_keys)
    vals, idx = jax.lax.top_k(scores, kk)  # [batch, kv_heads, tiles, k']
    chosen = jnp.isfinite(vals)
    idx = jnp.where(chosen, idx, -1).astype(jnp.int32)
    a_scores = jnp.where(jnp.isfinite(scores), scores, 0.0)
    den = jnp.sum(jnp.where(chosen, vals, 0.0), axis=-1) + diag  # [batch, h, tiles]
    all_idx = jnp.stack(prev_idx + (idx,))  # [a, batch, g, tiles, k']
    bi = jnp.arange(b)[None, :, None, None, None, None]
    hi = jnp.arange(kvh)[None, None, :, None, None, None]
    ti = jnp.arange(n_tiles)[None, None, None, None, :, None]
    got = a_scores[bi, hi, ti, jnp.maximum(all_idx, 0)[:, :, None]]  # [a, batch, h, g, tiles, k']
    num = jnp.sum(jnp.where(all_idx[:, :, None] >= 0, got, 0.0), axis=-1) + diag[None, :, :, None, :]
    r = jnp.clip(num / jnp.maximum(den, 1e-30)[None, :, :, None, :], 0.0, 1.0)  # [a, batch, h, g, tiles]
    tile_start = jnp.arange(n_tiles) * tile_size
    valid = (tile_start[None, :] > 0) & (tile_start[None, :] < kv_len[:, None])  # [batch, tiles]
    valid = valid[None, :, None, None, :]
    if reduce == "tail":  # the last TAIL_TILES valid tiles of each prompt
        last = (kv_len[:, None] - 1) // tile_size  # [batch, 1]
        valid = valid & (jnp.arange(n_tiles)[None, None, None, None, :] > (last - TAIL_TILES)[None, :, None, None])
        reduce = "mean"
    if reduce == "min":
        row = jnp.min(jnp.where(valid, r, jnp.inf), axis=-1)
        row = jnp.where(jnp.isfinite(row), row, 1.0)  # a prompt of one tile has nothing to compare
    else:
        n = jnp.sum(valid, axis=-1)
        row = jnp.where(n > 0, jnp.sum(jnp.where(valid, r, 0.0), axis=-1) / jnp.maximum(n, 1), 1.0)  # as min
    return idx, row


def importance(x, attn_out, kv_len):
    """[batch] 1 - mean over valid tokens of cos(x, x + attn_out); x, attn_out [batch, T, hidden]."""
    xf = x.astype(jnp.float32)
    yf = xf + attn_out.astype(jnp.float32)
    cos = jnp.sum(xf * yf, -1) / jnp.maximum(jnp.linalg.norm(xf, axis=-1) * jnp.linalg.norm(yf, axis=-1), 1e-30)
    valid = (jnp.arange(x.shape[1])[None, :] < kv_len[:, None]).astype(jnp.float32)
    return 1.0 - jnp.sum(cos * valid, -1) / jnp.maximum(jnp.sum(valid, -1), 1.0)


IMPORTANCE = ("paper", "sqrt", "none")


def importance_weights(w, mode: str = "paper"):
    """The per-layer weights of the DP's layer scores: the measured importance w ("paper"), sqrt(w) (a milder
    down-weighting of deep layers), or 1 ("none": every layer's similarity counts the same)."""
    if mode not in IMPORTANCE:
        raise ValueError(f"importance must be one of {IMPORTANCE}, got {mode!r}")
    w = jnp.asarray(w, jnp.float32)
    if mode == "sqrt":
        return jnp.sqrt(jnp.maximum(w, 0.0))
    if mode == "none":
        return jnp.ones_like(w)
    return w


def layer_scores(sim, w):
    """S [L, L] = w_b * mean_h max_g sim[a, b, h, g] on the upper triangle a <= b (0 below).

    sim [L, L, kv_heads, kv_heads] (prompt-averaged), w [L].
    """
    sim = jnp.asarray(sim, jnp.float32)
    L = sim.shape[0]
    s = jnp.mean(jnp.max(sim, axis=-1), axis=-1) * jnp.asarray(w, jnp.float32)[None, :]
    return jnp.where(jnp.arange(L)[:, None] <= jnp.arange(L)[None, :], s, 0.0)
