"""KascadeConfig: the frozen, validated description of one Kascade run (and its ablation variants).

What it fixes: which layers are anchors, which anchor head each reuse head reads (`head_map`), the Top-k budget
rule and the query tile used for prefill pooling. The budget itself is computed by
`kernels_pallas.reference.topk_budget`, k = min(max(floor(topk_frac * L), min_k), L) in exact integers; this
module only adds the optional rounding `k_multiple` (round k up to a multiple, then clamp to L again). We take
the *kernel* rule of the official code (no "k - tile_size" subtraction; the diagonal tile is attended on top of
the k selected keys in prefill, decode attends exactly k keys); `k_multiple=128` reproduces its "round up to
128" and `k_multiple=1` (default) is the paper's plain budget.

Variants (the paper's ablations) are fields rather than subclasses, so one strategy class serves them all:
- `pool`: "gqa" (Kascade: post-softmax probabilities summed over the GQA group), "all" (one index set per
  layer shared by every head; the head map is then all zeros), "pre_softmax" (rank keys by the logits of the
  mean query of the group / tile);
- `oracle_topk`: every layer is an anchor and selects its own keys (no reuse);
- `decode_only`: dense prefill, Kascade decode (also a recipe lever);
- no head remapping is simply `head_map=None` (identity).

Recipe levers, all off by default (the paper's method). What each measured, and why it exists:
results/accuracy/NOTES.md.
- `sink_tokens` / `recent_window`: every anchor's selection always holds the first `sink_tokens` keys and the
  `recent_window` keys just before the query (decode) or the query tile (prefill), forced into the Top-k: they
  count against the budget k (no extra keys), reuse layers inherit them through the head map, and their sum must
  not exceed `min_k`, so they always fit.
- `dense_suffix`: in prefill the last `dense_suffix` prompt tokens of every sequence attend densely in every layer
  (cost: about dense_suffix / L of a dense prefill's attention).
- `local_window` (prefill): the `local_window` keys just before every query tile are forced into each anchor's
  selection *on top of* the budget, so every reuse layer attends a dense neighbourhood plus the anchor's Top-k.
- `prefill_topk_frac` / `decode_topk_frac`: the budget fraction of one phase (None = `topk_frac`), so one phase's
  quality can be bought without slowing the other.
- `prefill_key_block` (kb in 1, 8, 16, 32, 64; a divisor of `tile_size`): prefill anchors select aligned blocks of
  kb keys (ceil(k / kb) blocks by summed pooled score) instead of single keys, so a kernel can copy whole blocks.
- `prefill_dense_anchors`: in prefill every anchor outputs dense causal attention (as layer 0) and still selects
  its Top-k for the reuse layers (one P.V product more; the full softmax is computed anyway).
- `prefill_score_fp8`: in prefill every anchor with a sparse output (not layer 0) scores keys from fp8 copies of q
  and the mean-centred k (`reference.fp8_score_operands`): the Mosaic GPU score passes run on fp8 (H200: -20% /
  -28% at the 8B shape), the Triton and reference paths on the same values widened (same selection).
- `decode_rerank` (C, 1 = off): in decode each anchor selects C x the budget as candidates, and each reuse layer
  attends its own Top-k of them by its own pooled scores (the anchor's forced keys kept): C k K rows and k V rows
  read. `decode_rerank_layers` (None = every reuse layer) limits it to those layers; the others read the first k
  of the candidates, which the anchor orders by its own scores.
- `decode_tail_stride` (S, 0 = off): in decode every sparse layer also attends the keys at multiples of S that it
  did not select, each weighted by S (a softmax term plus log S), an estimate of the unselected mass (1/S of the
  keys more). `decode_tail_cap`: a sampled key whose logit reaches the row's lightest selected key counts once.
- `decode_dense_layers` (None = off): these layers output dense attention in decode (negative entries count from
  the end); a listed anchor still selects for the layers after it, a listed reuse layer hands its anchor's state
  on; neither reranks nor takes the sampled tail.
- `decode_prefill_keys` (s, 0 = off; needs `decode_only`): at the end of the dense prefill every reuse layer keeps
  its own Top-s' of the keys the prompt's last `tile_size` queries attend (pooled as `pool` says; s' = min(max(
  floor(s L), 32), L)) in the KV cache (`KVCache.strategy_state`), and in decode attends the union of its
  anchor's Top-k and that set (s L keys more per reuse layer and step, no extra pass).
- `decode_score_fp8`: in decode every anchor with a sparse output scores keys from an fp8 copy of its K cache kept
  in the KV cache (`KVCache.strategy_state`; `reference.fp8_decode_keys` at the end of each prefill chunk, each
  decode token coded with the prompt's mean and scale): the whole-cache pass reads half the bytes (+1 byte per
  element of those layers' K in memory). q stays in its dtype; the attention reads the bf16 K and V.

It deliberately knows nothing about arrays or models; it is plain data with a JSON round trip.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kernels_pallas.reference import frac_numerator

POOLS = ("gqa", "all", "pre_softmax")
KEY_BLOCKS = (1, 8, 16, 32, 64)  # prefill_key_block


def _as_int_tuple(values, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a sequence of ints, got {values!r}") from None
    if any(o != v for o, v in zip(out, values)):
        raise ValueError(f"{what} must hold integers, got {values!r}")
    return out


@dataclasses.dataclass(frozen=True)
class KascadeConfig:
    num_layers: int
    kv_heads: int
    anchors: tuple[int, ...] = (0,)
    head_map: tuple[tuple[int, ...], ...] | None = None  # [num_layers][kv_heads]; None = identity
    topk_frac: float = 0.10  # budget fraction of the prefix length L, in (0, 1]
    min_k: int = 128  # budget floor (before clamping to L)
    k_multiple: int = 1  # round every budget up to a multiple of this, then clamp to L
    tile_size: int = 32  # prefill query tile (tokens) sharing one index set
    rolling_prefill: bool = True  # prefill budget from the tile's prefix (True) or the prompt length (False)
    layer0_dense: bool = True  # layer 0 attends densely (it still emits indices)
    pool: str = "gqa"  # "gqa" | "all" | "pre_softmax"
    oracle_topk: bool = False  # every layer is its own anchor
    decode_only: bool = False  # dense prefill
    sink_tokens: int = 0  # first keys forced into every anchor selection
    recent_window: int = 0  # keys just before the query / tile forced into every anchor selection
    dense_suffix: int = 0  # last prompt tokens that attend densely in prefill
    local_window: int = 0  # prefill: keys before each tile forced into the selection on top of the budget
    prefill_topk_frac: float | None = None  # prefill budget fraction (None: topk_frac)
    decode_topk_frac: float | None = None  # decode budget fraction (None: topk_frac)
    prefill_dense_anchors: bool = False  # prefill: anchor layers output dense attention (they still select)
    decode_rerank: int = 1  # decode: anchors select C x the budget, each reuse layer keeps its own Top-k of those
    decode_rerank_layers: tuple[int, ...] | None = None  # the reuse layers that rerank (None: all of them)
    decode_tail_stride: int = 0  # decode: sampled tail of the unselected keys, every S-th key weighted by S (0: off)
    decode_tail_cap: bool = False  # the tail: a sampled key as heavy as the lightest selected one counts once
    decode_dense_layers: tuple[int, ...] | None = None  # decode: layers that output dense attention (-1: the last)
    decode_prefill_keys: float = 0.0  # decode: each reuse layer also attends its own Top-s from the prefill's last tile
    prefill_key_block: int = 1  # prefill: anchors select aligned blocks of this many keys (1: single keys)
    prefill_score_fp8: bool = False  # prefill: sparse-output anchors score keys from fp8 copies of q and centred k
    decode_score_fp8: bool = False  # decode: sparse-output anchors score keys from an fp8 copy of K in the cache

    def __post_init__(self):
        for name in ("num_layers", "kv_heads", "min_k", "k_multiple", "tile_size", "decode_rerank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.topk_frac, bool) or not isinstance(self.topk_frac, (int, float)):
            raise ValueError(f"topk_frac must be a number in (0, 1], got {self.topk_frac!r}")
        frac_numerator(self.topk_frac)  # raises for topk_frac outside (0, 1]
        for name in ("prefill_topk_frac", "decode_topk_frac"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be None or a number in (0, 1], got {value!r}")
            try:
                frac_numerator(value)
            except ValueError:
                raise ValueError(f"{name} must be None or in (0, 1] and a multiple of 1e-4, got {value!r}") from None
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        kb = self.prefill_key_block
        if isinstance(kb, bool) or not isinstance(kb, int) or kb not in KEY_BLOCKS or self.tile_size % kb:
            raise ValueError(f"prefill_key_block must be one of {KEY_BLOCKS} and divide tile_size "
                             f"({self.tile_size}), got {kb!r}")
        if self.decode_rerank > 1 and self.pool == "all":
            raise ValueError("decode_rerank ranks candidates per KV head, and pool='all' shares one index set between "
                             "all heads: use pool 'gqa' or 'pre_softmax' with decode_rerank > 1")
        if self.decode_rerank > 1 and self.oracle_topk:
            raise ValueError("decode_rerank reranks for reuse layers, and oracle_topk has none (every layer selects "
                             "its own Top-k): use decode_rerank=1 with oracle_topk")
        tail = self.decode_tail_stride
        if isinstance(tail, bool) or not isinstance(tail, int) or tail < 0 or tail == 1:
            raise ValueError(f"decode_tail_stride must be 0 (off) or an int >= 2, got {tail!r}")
        if self.decode_tail_cap is True and not tail:
            raise ValueError("decode_tail_cap caps the sampled tail's weights: it needs decode_tail_stride >= 2")
        if tail and self.decode_rerank > 1:
            raise ValueError("decode_tail_stride and decode_rerank > 1 are not combined (a reranking layer's tail "
                             "would have to exclude its own Top-k of the candidates): use one or the other")
        self._check_prefill_keys()
        for name in ("sink_tokens", "recent_window", "dense_suffix", "local_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.sink_tokens + self.recent_window > self.min_k:
            raise ValueError(f"sink_tokens + recent_window ({self.sink_tokens} + {self.recent_window}) must not exceed "
                             f"min_k ({self.min_k}): forced keys count against the budget and must always fit")
        if self.prefill_key_block > 1:  # the forced keys' blocks (the window may straddle one more) must fit too
            kb, window = self.prefill_key_block, self.recent_window + self.local_window
            forced = -(-self.sink_tokens // kb) + (-(-window // kb) + 1 if window else 0)
            if forced > -(-(self.min_k + self.local_window) // kb):
                raise ValueError(f"prefill_key_block={kb}: the forced keys' {forced} blocks (sink_tokens, "
                                 f"recent_window + local_window) exceed the smallest budget of "
                                 f"{-(-(self.min_k + self.local_window) // kb)} blocks: raise min_k")
        for name in ("rolling_prefill", "layer0_dense", "oracle_topk", "decode_only", "prefill_dense_anchors",
                     "decode_tail_cap", "prefill_score_fp8", "decode_score_fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

        anchors = _as_int_tuple(self.anchors, "anchors")
        object.__setattr__(self, "anchors", anchors)
        if not anchors or anchors[0] != 0:
            raise ValueError(f"anchors must start with layer 0 (layer 0 seeds the indices), got {anchors}")
        if any(b <= a for a, b in zip(anchors, anchors[1:])):
            raise ValueError(f"anchors must be strictly increasing, got {anchors}")
        if anchors[-1] >= self.num_layers:
            raise ValueError(f"anchors must lie in [0, {self.num_layers - 1}] (num_layers={self.num_layers}), got {anchors}")

        if self.decode_rerank_layers is not None:
            rr = _as_int_tuple(self.decode_rerank_layers, "decode_rerank_layers")
            object.__setattr__(self, "decode_rerank_layers", rr)
            if self.decode_rerank == 1:
                raise ValueError(f"decode_rerank_layers={list(rr)} needs decode_rerank > 1 (the candidates per key of "
                                 "the budget that those layers rerank)")
            if any(b <= a for a, b in zip(rr, rr[1:])):
                raise ValueError(f"decode_rerank_layers must be strictly increasing, got {list(rr)}")
            bad = [x for x in rr if not 0 <= x < self.num_layers or x in anchors]
            if bad:
                raise ValueError(f"decode_rerank_layers must be reuse layers (in [0, {self.num_layers - 1}], not the "
                                 f"anchors {list(anchors)}), got {bad}")

        if self.decode_dense_layers is not None:
            object.__setattr__(self, "decode_dense_layers", self._dense_layers(self.decode_dense_layers))

        if self.head_map is not None:
            rows = tuple(_as_int_tuple(r, f"head_map row {i}") for i, r in enumerate(self.head_map))
            object.__setattr__(self, "head_map", rows)
            if len(rows) != self.num_layers or any(len(r) != self.kv_heads for r in rows):
                shape = (len(rows), sorted({len(r) for r in rows}))
                raise ValueError(f"head_map must have shape [num_layers={self.num_layers}, kv_heads={self.kv_heads}], "
                                 f"got {len(rows)} rows of lengths {shape[1]}")
            for i, r in enumerate(rows):
                bad = [h for h in r if not 0 <= h < self.kv_heads]
                if bad:
                    raise ValueError(f"head_map[{i}] entries must lie in [0, {self.kv_heads - 1}], got {list(r)}")
            for a in anchors:
                if rows[a] != tuple(range(self.kv_heads)):
                    raise ValueError(f"head_map row of anchor layer {a} must be the identity "
                                     f"{list(range(self.kv_heads))}, got {list(rows[a])}")
            if self.pool == "all":
                raise ValueError("pool='all' shares one index set between all heads, so head_map must be None")

    def _check_prefill_keys(self) -> None:
        s = self.decode_prefill_keys
        if s is None:  # None = off, as 0
            object.__setattr__(self, "decode_prefill_keys", 0.0)
            return
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise ValueError(f"decode_prefill_keys must be 0 (off) or a number in (0, 1], got {s!r}")
        if s == 0:
            return
        try:
            frac_numerator(s)
        except ValueError:
            raise ValueError(f"decode_prefill_keys must be 0 (off) or in (0, 1] and a multiple of 1e-4, "
                             f"got {s!r}") from None
        if not self.decode_only:
            raise ValueError("decode_prefill_keys scores the dense prefill's last tile: it needs decode_only=True")
        if self.pool not in ("gqa", "all"):
            raise ValueError(f"decode_prefill_keys pools post-softmax scores: use pool 'gqa' or 'all', not "
                             f"{self.pool!r}")
        if self.oracle_topk:
            raise ValueError("decode_prefill_keys adds keys to reuse layers, and oracle_topk has none")
        if self.decode_tail_stride:
            raise ValueError("decode_prefill_keys and decode_tail_stride are not combined: use one or the other")
        if self.decode_rerank > 1:
            raise ValueError("decode_prefill_keys and decode_rerank > 1 are not combined: use one or the other")

    def _dense_layers(self, given) -> tuple[int, ...] | None:
        """`decode_dense_layers` as absolute layers (negatives count from the end), checked; empty: None (off)."""
        what, n = "decode_dense_layers", self.num_layers
        if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
            raise ValueError(f"{what} must be a sequence of layer numbers such as (-3, -2, -1), got {given!r}")
        given = tuple(given)
        bad = [x for x in given if isinstance(x, bool) or not hasattr(x, "__index__")]
        if bad:
            raise ValueError(f"{what} must hold ints (not bools), got {list(given)}")
        layers = tuple(int(x) + n if int(x) < 0 else int(x) for x in given)
        bad = [x for x, y in zip(given, layers) if not 1 <= y < n]
        if bad:
            raise ValueError(f"{what} must lie in [1, {n - 1}] or [-{n}, -1] from the end, not layer 0 (that is "
                             f"layer0_dense's; num_layers={n}), got {bad} in {list(given)}")
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise ValueError(f"{what} must be strictly increasing (after counting negatives from the end), got "
                             f"{list(given)} = layers {list(layers)}")
        return layers or None

    @property
    def prefill_frac(self) -> float:
        """The prefill budget fraction: `prefill_topk_frac`, else `topk_frac`."""
        return self.topk_frac if self.prefill_topk_frac is None else self.prefill_topk_frac

    @property
    def decode_frac(self) -> float:
        """The decode budget fraction: `decode_topk_frac`, else `topk_frac`."""
        return self.topk_frac if self.decode_topk_frac is None else self.decode_topk_frac

    # ---- layer roles -------------------------------------------------------------------------------------------
    def is_anchor(self, layer: int) -> bool:
        return self.oracle_topk or layer in self.anchors

    def anchor_of(self, layer: int) -> int:
        """The most recent anchor at or before `layer` (whose indices `layer` uses)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must lie in [0, {self.num_layers - 1}], got {layer}")
        if self.oracle_topk:
            return layer
        return max(a for a in self.anchors if a <= layer)

    def decode_dense(self, layer: int) -> bool:
        """Whether decode at `layer` outputs dense attention (`decode_dense_layers`; layer 0: `layer0_dense`)."""
        if layer == 0:
            return self.layer0_dense
        return self.decode_dense_layers is not None and layer in self.decode_dense_layers

    def reranks(self, layer: int) -> bool:
        """Whether decode at reuse `layer` ranks its anchor's candidates itself (`decode_rerank`; a dense layer
        does not)."""
        return (self.decode_rerank > 1 and not self.is_anchor(layer) and not self.decode_dense(layer)
                and (self.decode_rerank_layers is None or layer in self.decode_rerank_layers))

    @property
    def idx_heads(self) -> int:
        """Index sets per layer: one per KV head, or one shared set for pool='all'."""
        return 1 if self.pool == "all" else self.kv_heads

    def head_map_row(self, layer: int) -> tuple[int, ...]:
        """Which index head of the anchor each KV head of `layer` reads (identity on anchors)."""
        if self.pool == "all":
            return (0,) * self.kv_heads
        if self.head_map is None or self.is_anchor(layer):
            return tuple(range(self.kv_heads))
        return self.head_map[layer]

    # ---- serialisation -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["anchors"] = list(self.anchors)
        d["head_map"] = None if self.head_map is None else [list(r) for r in self.head_map]
        d["decode_rerank_layers"] = None if self.decode_rerank_layers is None else list(self.decode_rerank_layers)
        d["decode_dense_layers"] = None if self.decode_dense_layers is None else list(self.decode_dense_layers)
        return d

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KascadeConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown KascadeConfig fields {unknown}; allowed: {sorted(known)}")
        d = dict(d)
        if "anchors" in d:
            d["anchors"] = tuple(d["anchors"])
        if d.get("head_map") is not None:
            d["head_map"] = tuple(tuple(r) for r in d["head_map"])
        if d.get("decode_rerank_layers") is not None:
            d["decode_rerank_layers"] = tuple(d["decode_rerank_layers"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "KascadeConfig":
        return cls.from_dict(json.loads(text))
