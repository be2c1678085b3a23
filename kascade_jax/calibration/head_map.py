"""Head maps: which KV head of its anchor each KV head of a reuse layer borrows its Top-k indices from.

map[l][h] = argmax_g sim[anchor(l), l, h, g] on the UNWEIGHTED, prompt-averaged head similarity (as the
official `_find_head_mappings`); anchor rows are the identity. Many-to-one maps are allowed. Because the
artifact keeps the whole `sim` tensor, a head map can be derived for any anchor set, not just the DP's.

Also here: parsing of the `--head_map=identity|auto|<path>` flag value into a [num_layers, kv_heads] int array.
Deliberately not here: anchor selection (`dp.py`) or loading artifacts (`artifact.py`).
"""

from __future__ import annotations

import os

import numpy as np


def anchor_of_layers(anchors, num_layers: int) -> np.ndarray:
    """[num_layers] int: the largest anchor <= l for every layer l."""
    anchors = check_anchors(anchors, num_layers)
    out = np.zeros(num_layers, np.int64)
    for a in anchors:
        out[a:] = a
    return out


def check_anchors(anchors, num_layers: int) -> tuple[int, ...]:
    try:
        anchors = tuple(int(a) for a in anchors)
    except (TypeError, ValueError):
        raise ValueError(f"anchors must be a sequence of layer indices, got {anchors!r}") from None
    if not anchors or anchors[0] != 0:
        raise ValueError(f"anchors must start with layer 0, got {list(anchors)}")
    if any(b <= a for a, b in zip(anchors, anchors[1:])):
        raise ValueError(f"anchors must be strictly increasing, got {list(anchors)}")
    if anchors[-1] >= num_layers:
        raise ValueError(f"anchors must lie in [0, {num_layers - 1}], got {list(anchors)}")
    return anchors


def head_map_for(sim, anchors) -> np.ndarray:
    """sim [L, L, kv_heads, kv_heads] ([a, b, h of b, g of a]) -> head_map [L, kv_heads] int32."""
    sim = np.asarray(sim)
    L, H = sim.shape[0], sim.shape[2]
    anchor_of = anchor_of_layers(anchors, L)
    hm = np.stack([np.argmax(sim[anchor_of[l], l], axis=-1) for l in range(L)]).astype(np.int32)
    hm[list(anchors)] = np.arange(H, dtype=np.int32)
    return hm


def least_similar_layers(sim, anchors, head_map, n: int) -> tuple[int, ...]:
    """The `n` reuse layers (ascending) whose selection agrees least with what they read from their anchor: mean over
    KV heads h of sim[anchor, layer, h, head_map[layer, h]] (all reuse layers when there are fewer than n)."""
    sim, hm = np.asarray(sim), np.asarray(head_map)
    L, H = sim.shape[0], sim.shape[2]
    anchor_of = anchor_of_layers(anchors, L)
    reuse = [l for l in range(L) if l not in set(anchors)]
    score = {l: float(np.mean([sim[anchor_of[l], l, h, hm[l, h]] for h in range(H)])) for l in reuse}
    return tuple(sorted(sorted(reuse, key=lambda l: (score[l], l))[:n]))


def identity_head_map(num_layers: int, kv_heads: int) -> np.ndarray:
    return np.tile(np.arange(kv_heads, dtype=np.int32), (num_layers, 1))


def check_head_map(head_map, num_layers: int, kv_heads: int, anchors=None) -> np.ndarray:
    """Validate a [num_layers, kv_heads] head map (entries in [0, kv_heads), identity on anchors)."""
    hm = np.asarray(head_map)
    if hm.shape != (num_layers, kv_heads):
        raise ValueError(f"head_map must have shape [num_layers={num_layers}, kv_heads={kv_heads}], got {hm.shape}")
    if not np.issubdtype(hm.dtype, np.integer):
        raise ValueError(f"head_map must hold integers, got dtype {hm.dtype}")
    if hm.min() < 0 or hm.max() >= kv_heads:
        raise ValueError(f"head_map entries must lie in [0, {kv_heads - 1}], got range [{hm.min()}, {hm.max()}]")
    for a in anchors or ():
        if not np.array_equal(hm[a], np.arange(kv_heads)):
            raise ValueError(f"head_map row of anchor layer {a} must be the identity, got {hm[a].tolist()}")
    return hm.astype(np.int32)


def load_head_map_file(path: str, num_layers: int, kv_heads: int, anchors=None) -> np.ndarray:
    """A head map from `.npy` (official format: int [L, kv_heads]) or `.json` (a list of rows)."""
    if not os.path.isfile(path):
        raise ValueError(f"--head_map must be 'identity', 'auto' or an existing .npy/.json file, got {path!r}")
    if path.endswith(".npy"):
        try:
            hm = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"--head_map={path}: not a readable .npy array ({e})") from None
    elif path.endswith(".json"):
        import json

        try:
            with open(path) as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--head_map={path}: not valid JSON ({e})") from None
        if isinstance(data, dict) and "head_map" not in data:
            raise ValueError(f"--head_map={path}: a JSON object needs a 'head_map' entry (a list of rows), got keys "
                             f"{sorted(data)[:8]}")
        rows = data["head_map"] if isinstance(data, dict) else data
        if not (isinstance(rows, list) and rows and all(isinstance(r, list) and r and all(
                isinstance(h, int) and not isinstance(h, bool) for h in r) for r in rows)
                and len({len(r) for r in rows}) == 1):
            raise ValueError(f"--head_map={path}: must be a list of equal-length rows of ints "
                             f"([num_layers][kv_heads]), got {json.dumps(rows)[:80]}")
        hm = np.asarray(rows)
    else:
        raise ValueError(f"head map file must end in .npy or .json, got {path!r}")
    try:
        return check_head_map(hm, num_layers, kv_heads, anchors)
    except ValueError as e:
        raise ValueError(f"--head_map={path}: {e}") from None
