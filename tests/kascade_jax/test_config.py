"""KascadeConfig validation, layer roles and the JSON round trip."""

import pytest

from kascade_jax.config import KascadeConfig


def _map(num_layers, kv_heads, rows=None):
    hm = [list(range(kv_heads)) for _ in range(num_layers)]
    for layer, row in (rows or {}).items():
        hm[layer] = row
    return hm


def test_defaults_and_roles():
    cfg = KascadeConfig(num_layers=6, kv_heads=3, anchors=(0, 3), head_map=_map(6, 3, {1: [2, 2, 0], 4: [1, 0, 0]}))
    assert (cfg.topk_frac, cfg.min_k, cfg.tile_size, cfg.rolling_prefill, cfg.layer0_dense) == (0.10, 128, 32, True, True)
    assert [cfg.is_anchor(i) for i in range(6)] == [True, False, False, True, False, False]
    assert [cfg.anchor_of(i) for i in range(6)] == [0, 0, 0, 3, 3, 3]
    assert cfg.head_map_row(1) == (2, 2, 0) and cfg.head_map_row(3) == (0, 1, 2)
    assert cfg.idx_heads == 3
    hash(cfg)  # a static jit argument must be hashable
    pooled = KascadeConfig(num_layers=6, kv_heads=3, pool="all")
    assert pooled.idx_heads == 1 and pooled.head_map_row(2) == (0, 0, 0)
    oracle = KascadeConfig(num_layers=6, kv_heads=3, oracle_topk=True)
    assert all(oracle.is_anchor(i) and oracle.anchor_of(i) == i for i in range(6))


def test_json_round_trip():
    cfg = KascadeConfig(num_layers=5, kv_heads=2, anchors=(0, 2), head_map=_map(5, 2, {1: [1, 1], 4: [0, 0]}),
                        topk_frac=0.2, min_k=16, k_multiple=8, tile_size=16, rolling_prefill=False, layer0_dense=False,
                        pool="pre_softmax", decode_only=True)
    again = KascadeConfig.from_json(cfg.to_json())
    assert again == cfg and hash(again) == hash(cfg)
    assert KascadeConfig.from_json(KascadeConfig(num_layers=3, kv_heads=1).to_json()).head_map is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(anchors=(1, 2)), "start with layer 0"),
    (dict(anchors=()), "start with layer 0"),
    (dict(anchors=(0, 3, 2)), "strictly increasing"),
    (dict(anchors=(0, 2, 2)), "strictly increasing"),
    (dict(anchors=(0, 4)), r"\[0, 3\]"),
    (dict(anchors=(0, 1.5)), "integers"),
    (dict(head_map=[[0, 1]] * 3), "shape"),
    (dict(head_map=[[0, 1, 0]] * 4), "shape"),
    (dict(head_map=_map(4, 2, {1: [0, 2]})), r"head_map\[1\].*\[0, 1\]"),
    (dict(head_map=_map(4, 2, {2: [0, -1]})), r"head_map\[2\]"),
    (dict(head_map=_map(4, 2, {0: [1, 0]})), "anchor layer 0 must be the identity"),
    (dict(pool="all", head_map=_map(4, 2)), "head_map must be None"),
    (dict(topk_frac=0.0), "topk_frac"),
    (dict(topk_frac=1.5), "topk_frac"),
    (dict(topk_frac=-0.1), "topk_frac"),
    (dict(topk_frac="0.1"), "topk_frac"),
    (dict(tile_size=0), "tile_size"),
    (dict(tile_size=-32), "tile_size"),
    (dict(min_k=0), "min_k"),
    (dict(k_multiple=0), "k_multiple"),
    (dict(pool="mean"), "pool"),
    (dict(oracle_topk=1), "oracle_topk"),
    (dict(num_layers=0, anchors=(0,)), "num_layers"),
    (dict(kv_heads=0), "kv_heads"),
])
def test_bad_configs_raise(kwargs, match):
    base = dict(num_layers=4, kv_heads=2)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KascadeConfig(**base)


def test_prefill_key_block_checks():
    """prefill_key_block: one of 1, 8, 16, 32, 64 dividing tile_size (one-line errors naming it); JSON round trip."""
    for kb in (1, 8, 16, 32):
        assert KascadeConfig(num_layers=2, kv_heads=1, prefill_key_block=kb).prefill_key_block == kb
    cfg = KascadeConfig(num_layers=2, kv_heads=1, tile_size=64, prefill_key_block=64)
    assert KascadeConfig.from_json(cfg.to_json()) == cfg
    assert KascadeConfig(num_layers=2, kv_heads=1).prefill_key_block == 1
    for bad in (dict(prefill_key_block=4), dict(prefill_key_block=0), dict(prefill_key_block=64),
                dict(tile_size=16, prefill_key_block=32), dict(tile_size=24, prefill_key_block=16),
                dict(prefill_key_block=16.0), dict(prefill_key_block=True)):
        with pytest.raises(ValueError, match=r"^prefill_key_block must be one of \(1, 8, 16, 32, 64\) and divide "
                                             r"tile_size \(\d+\), got \S+$"):
            KascadeConfig(num_layers=2, kv_heads=1, **bad)
    # Forced keys in blocks: sinks 2 and a 4-key window need up to 1 + 2 blocks of 16; min_k 32 gives 2, 48 gives 3.
    with pytest.raises(ValueError, match=r"^prefill_key_block=16: the forced keys' 3 blocks .* raise min_k$"):
        KascadeConfig(num_layers=2, kv_heads=1, prefill_key_block=16, sink_tokens=2, recent_window=4, min_k=32)
    KascadeConfig(num_layers=2, kv_heads=1, prefill_key_block=16, sink_tokens=2, recent_window=4, min_k=48)
    KascadeConfig(num_layers=2, kv_heads=1, prefill_key_block=1, sink_tokens=2, recent_window=4, min_k=6)


def test_bad_json_and_layer():
    with pytest.raises(ValueError, match="unknown KascadeConfig fields"):
        KascadeConfig.from_dict({"num_layers": 2, "kv_heads": 1, "anchorz": [0]})
    with pytest.raises(ValueError, match=r"layer must lie in \[0, 1\]"):
        KascadeConfig(num_layers=2, kv_heads=1).anchor_of(2)
