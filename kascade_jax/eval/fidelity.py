"""Label-free fidelity of a sparse strategy against dense attention, on long natural text.

1. Teacher forcing: the same document runs through the model with dense attention and with the strategy
   (`models.generate.prefill(..., all_logits=True)`); per token we take KL(dense || strategy) of the next-token
   distributions and whether their argmax agrees.
2. Attention mass (Kascade-family strategies only): the document's prefix is prefilled with the strategy, then
   its last chunk runs through `MassProbe`, a wrapper that calls the strategy and, per layer, measures on the
   chunk's query rows (a) the dense attention mass that lands on the keys the strategy attends (its selected set
   through the head map, plus the causal diagonal tile it always attends) and (b) the same for the oracle: the
   per-query-head Top-k of the dense probabilities over the same prefix with the same budget k. The ratio a/b
   is the "recovered mass vs oracle Top-k"; dense layers (layer 0, decode-only prefill) score 1.
   The probe reads the strategy's own state (`idx [batch, idx_heads, tiles, k_max]`, `counts [batch, tiles]`)
   and recomputes dense probabilities from q and the cache with plain jnp, so it sees exactly what ran.

3. Decode-phase mass: after a prefill with the strategy, `DECODE_STEPS` teacher-forced decode steps (the
   document's last tokens) run through the same probe in the decode phase: per layer, the dense mass on the keys
   the strategy attends (its decode indices through the head map) against each query head's own Top-count.
   Prefill and decode numbers side by side say which phase loses the mass.

Documents are stdlib prose (`tasks.prose`) from seeded offsets of the "test" split stream, or any texts passed in.
There are ~70K tokens of prose, so many 8K documents overlap; pass LongBench contexts for fully distinct ones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kascade_jax.tasks import prompt as prompt_lib
from kascade_jax.tasks import prose, synthetic

PROBE_CHUNK = 64  # query rows probed at the end of each document (a multiple of every tile size we use)
DECODE_STEPS = 8  # teacher-forced decode steps probed at the end of each document


def prose_documents(tokenizer, num_docs: int, length: int, *, seed: int = 0, split: str = "test") -> list[list[int]]:
    """`num_docs` token lists of exactly `length` tokens of prose, each from a seeded starting sentence."""
    if length < 2 * PROBE_CHUNK or length % PROBE_CHUNK:
        raise ValueError(f"length must be a multiple of {PROBE_CHUNK} and >= {2 * PROBE_CHUNK}, got {length}")
    sents = prose.prose_sentences()
    docs = []
    for i in range(num_docs):
        rng = np.random.default_rng(synthetic.sample_seed("fidelity", length, i, seed=seed, split=split))
        start, ids, n = int(rng.integers(len(sents))), [], 0
        while len(ids) < length:
            chunk = " ".join(sents[(start + n + j) % len(sents)] for j in range(64))
            n += 64
            ids += prompt_lib.encode(tokenizer, (" " if ids else "") + chunk)
            if n > 4 * len(sents):
                raise ValueError(f"length {length} is too long for the prose source")
        docs.append(ids[:length])
    return docs


# ----------------------------------------------------------------------------- teacher forcing
_LOGIT_CHUNK = 4096  # teacher-forced prefill chunk: the logits stay as per-chunk [chunk, vocab] fp32 arrays


def _logprobs(model, tokens, strategy) -> list:
    """The document's next-token logits as a list of [rows, vocab] chunks (never one [T, vocab] array: 16K x 152K
    fp32 is 10 GB, and joining the chunks would copy it)."""
    from models import generate as gen  # noqa: PLC0415
    from models.cache import KVCache  # noqa: PLC0415

    tokens = np.asarray(tokens, np.int32)[None]
    t = tokens.shape[1]
    cache = KVCache.init(model.config, 1, -(-t // 64) * 64, dtype=model.dtype)
    chunks, _ = gen.prefill(model, tokens, np.array([t], np.int32), cache, strategy, all_logits=True,
                            join_logits=False, chunk_size=min(_LOGIT_CHUNK, -(-t // 64) * 64))
    return [c[0] for c in chunks]


_KL_ROWS = 1024  # rows per block of the KL: bounds the fp32 log-softmax copies


@jax.jit
def _kl_top1_block(ld, lo):
    lp_dense = jax.nn.log_softmax(ld.astype(jnp.float32), axis=-1)
    lp_other = jax.nn.log_softmax(lo.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(lp_dense) * (lp_dense - lp_other), axis=-1)
    return kl, jnp.argmax(lp_dense, -1) == jnp.argmax(lp_other, -1)


def _kl_top1(logits_dense, logits_other):
    """KL(dense || other) and argmax agreement per token, in blocks of _KL_ROWS rows. Each argument is a [T, vocab]
    array or a list of [rows, vocab] chunks (`_logprobs`); both sides must be split alike."""
    dense = logits_dense if isinstance(logits_dense, (list, tuple)) else [logits_dense]
    other = logits_other if isinstance(logits_other, (list, tuple)) else [logits_other]
    if [c.shape for c in dense] != [c.shape for c in other]:
        raise ValueError(f"logit chunks differ: {[c.shape for c in dense]} vs {[c.shape for c in other]}")
    kls, agrees = [], []
    for ld, lo in zip(dense, other):
        for i in range(0, ld.shape[0], _KL_ROWS):
            kl, agree = _kl_top1_block(ld[i:i + _KL_ROWS], lo[i:i + _KL_ROWS])
            kls.append(kl)
            agrees.append(agree)
    return jnp.concatenate(kls), jnp.concatenate(agrees)


# ----------------------------------------------------------------------------- attention mass probe
def _layer_mass(cfg, layer: int, inputs, prev_state, new_state):
    """[2, kv_heads] fp32: (selected mass, oracle mass) per KV head, mean over batch, its query heads and the rows."""
    q, k = inputs.q, inputs.k_cache  # [b, tq, hq, d], [b, keys, kvh, d]
    b, tq, hq, d = q.shape
    keys, kvh = k.shape[1], k.shape[2]
    g, ts = hq // kvh, cfg.tile_size
    pos = inputs.q_start[:, None] + jnp.arange(tq)[None]  # [b, tq]
    key_pos = jnp.arange(keys)
    visible = (key_pos[None, None] <= pos[:, :, None]) & (key_pos[None, None] < inputs.kv_len[:, None, None])
    logits = jnp.einsum("btkgd,bskd->bkgts", q.astype(jnp.float32).reshape(b, tq, kvh, g, d),
                        k.astype(jnp.float32)) / math.sqrt(d)
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)  # [b, kvh, g, tq, keys]
    probs = jnp.where(visible[:, None, None], probs, 0.0)
    tile_start = (pos // ts) * ts  # [b, tq]
    diag = visible & (key_pos[None, None] >= tile_start[:, :, None])  # [b, tq, keys]
    diag_mass = jnp.sum(jnp.where(diag[:, None, None], probs, 0.0), axis=-1)  # [b, kvh, g, tq]
    row_ok = pos < inputs.seq_len[:, None]  # [b, tq]
    if inputs.phase == "decode":
        return _layer_mass_decode(cfg, layer, probs, prev_state, new_state)
    dense_layer = cfg.decode_only or (layer == 0 and cfg.layer0_dense)
    if dense_layer:
        return jnp.ones((2, kvh), jnp.float32)
    st = new_state if cfg.is_anchor(layer) else prev_state
    idx, counts = st["idx"], st["counts"]  # [b, idx_heads, tiles, k_max], [b, tiles]
    local_tile = (jnp.arange(tq) // ts)  # chunk starts on a tile boundary
    idx_kv = idx[:, jnp.asarray(cfg.head_map_row(layer))]  # [b, kvh, tiles, k_max]
    member = jnp.zeros((b, kvh, idx.shape[2], keys + 1), bool)
    safe = jnp.where(idx_kv >= 0, idx_kv, keys)
    bi, hi, ti = jnp.meshgrid(jnp.arange(b), jnp.arange(kvh), jnp.arange(idx.shape[2]), indexing="ij")
    member = member.at[bi[..., None], hi[..., None], ti[..., None], safe].set(True)[..., :keys]
    member_rows = member[:, :, local_tile]  # [b, kvh, tq, keys]
    prefix = visible & (key_pos[None, None] < tile_start[:, :, None])  # [b, tq, keys]
    sel = jnp.sum(jnp.where((member_rows & prefix[:, None])[:, :, None], probs, 0.0), axis=-1) + diag_mass
    # Oracle: each query head's own Top-count over the same prefix, same budget.
    k_max = idx.shape[-1]
    top = jax.lax.top_k(jnp.where(prefix[:, None, None], probs, 0.0), min(k_max, keys))[0]  # [b,kvh,g,tq,k_max]
    cnt = counts[:, local_tile]  # [b, tq]
    ranks = jnp.arange(top.shape[-1])
    oracle = jnp.sum(jnp.where(ranks < cnt[:, None, None, :, None], top, 0.0), axis=-1) + diag_mass
    return jnp.stack([_row_mean(sel, row_ok), _row_mean(oracle, row_ok)])


def _layer_mass_decode(cfg, layer, probs, prev_state, new_state):
    """Decode: probs [b, kvh, g, 1, keys]; the state's idx [b, idx_heads, k_max], counts [b]."""
    b, kvh = probs.shape[:2]
    keys = probs.shape[-1]
    if layer == 0 and cfg.layer0_dense:
        return jnp.ones((2, kvh), jnp.float32)
    st = new_state if cfg.is_anchor(layer) else prev_state
    idx, counts = st["idx"], st["counts"]
    idx_kv = idx[:, jnp.asarray(cfg.head_map_row(layer))]  # [b, kvh, k_max]
    safe = jnp.where(idx_kv >= 0, idx_kv, keys)
    bi, hi = jnp.meshgrid(jnp.arange(b), jnp.arange(kvh), indexing="ij")
    member = jnp.zeros((b, kvh, keys + 1), bool).at[bi[..., None], hi[..., None], safe].set(True)[..., :keys]
    p = probs[:, :, :, 0]  # [b, kvh, g, keys]
    sel = jnp.sum(jnp.where(member[:, :, None], p, 0.0), axis=-1)  # [b, kvh, g]
    top = jax.lax.top_k(p, min(idx.shape[-1], keys))[0]
    oracle = jnp.sum(jnp.where(jnp.arange(top.shape[-1]) < counts[:, None, None, None], top, 0.0), axis=-1)
    return jnp.stack([jnp.mean(sel, axis=(0, 2)), jnp.mean(oracle, axis=(0, 2))])


def _row_mean(x, row_ok):
    """[kvh]: mean of x [b, kvh, g, tq] over batch, group and the valid query rows (padding rows excluded)."""
    w = jnp.broadcast_to(row_ok[:, None, None, :], x.shape).astype(jnp.float32)
    return jnp.sum(x * w, axis=(0, 2, 3)) / jnp.maximum(jnp.sum(w, axis=(0, 2, 3)), 1.0)


@dataclasses.dataclass(frozen=True)
class MassProbe:
    """Wraps a Kascade-family strategy; its state also carries per-layer (selected, oracle) attention mass."""

    inner: Any
    name: str = "mass_probe"

    def attend(self, layer, inputs, state):
        prev = None if state is None else state["inner"]
        masses = () if state is None else state["mass"]
        out, new = self.inner.attend(layer, inputs, prev)
        return out, {"inner": new, "mass": masses + (_layer_mass(self.inner.config, layer, inputs, prev, new),)}

    def post_attention(self, layer, x, attn_out, state):
        return {"inner": self.inner.post_attention(layer, x, attn_out, state["inner"]), "mass": state["mass"]}


def supports_mass(strategy) -> bool:
    cfg = getattr(strategy, "config", None)
    return cfg is not None and hasattr(cfg, "head_map_row") and hasattr(cfg, "tile_size")


def attention_mass(model, tokens, strategy) -> np.ndarray:
    """[num_layers, 2, kv_heads] (selected mass, oracle mass) on the last PROBE_CHUNK rows of one document."""
    from models import generate as gen  # noqa: PLC0415
    from models.cache import KVCache  # noqa: PLC0415

    tokens = np.asarray(tokens, np.int32)[None]
    t = tokens.shape[1]
    if t % PROBE_CHUNK or t < 2 * PROBE_CHUNK:
        raise ValueError(f"document length must be a multiple of {PROBE_CHUNK} and >= {2 * PROBE_CHUNK}, got {t}")
    cut = t - PROBE_CHUNK
    cache = KVCache.init(model.config, 1, t, dtype=model.dtype)
    seq = np.array([t], np.int32)
    _, cache = gen.prefill(model, tokens[:, :cut], np.array([cut], np.int32), cache, strategy)
    _, _, state = gen.forward(model, tokens[:, cut:], cache, MassProbe(strategy), q_start=cut, seq_len=seq)
    return np.asarray(jnp.stack(state["mass"]))


def decode_attention_mass(model, tokens, strategy, steps: int = DECODE_STEPS) -> np.ndarray:
    """[num_layers, 2, kv_heads] (selected, oracle) decode mass, mean over `steps` teacher-forced decode steps that
    feed the document's last `steps` tokens after a prefill of the rest with the strategy."""
    from models import generate as gen  # noqa: PLC0415
    from models.cache import KVCache  # noqa: PLC0415

    tokens = np.asarray(tokens, np.int32)[None]
    t = tokens.shape[1]
    if steps < 1 or t <= steps:
        raise ValueError(f"decode mass needs 1 <= steps < document length, got steps={steps}, length {t}")
    cut = t - steps
    cache = KVCache.init(model.config, 1, -(-t // 64) * 64, dtype=model.dtype)
    _, cache = gen.prefill(model, tokens[:, :cut], np.array([cut], np.int32), cache, strategy)
    probe, out = MassProbe(strategy), []
    for j in range(cut, t):
        _, cache, state = gen.decode_step(model, tokens[:, j], cache, probe, with_state=True)
        out.append(jnp.stack(state["mass"]))
    return np.asarray(jnp.mean(jnp.stack(out), axis=0))


# ----------------------------------------------------------------------------- driver
def evaluate_fidelity(model, documents: list[list[int]], strategies: dict[str, Any], *, dense=None,
                      mass: bool = True, progress: bool = True) -> dict[str, dict]:
    """Per strategy name: mean KL, top-1 agreement (all tokens and the second half), per-layer mass; failures."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    if dense is None:
        from models.attention import DenseStrategy  # noqa: PLC0415
        dense = DenseStrategy()
    acc = {name: dict(kl=[], top1=[], kl_late=[], top1_late=[], mass=[], dmass=[], failures=0, errors=[])
           for name in strategies}
    for doc in tqdm(documents, desc="fidelity", disable=not progress, leave=False):
        lp_dense = _logprobs(model, doc, dense)
        half = len(doc) // 2
        for name, strategy in strategies.items():
            a = acc[name]
            try:
                kl, agree = _kl_top1(lp_dense, _logprobs(model, doc, strategy))
                kl, agree = np.asarray(kl), np.asarray(agree, np.float64)
                a["kl"].append(kl.mean())
                a["top1"].append(agree.mean())
                a["kl_late"].append(kl[half:].mean())
                a["top1_late"].append(agree[half:].mean())
                if mass and supports_mass(strategy):
                    a["mass"].append(attention_mass(model, doc, strategy))
                    a["dmass"].append(decode_attention_mass(model, doc, strategy))
            except Exception as e:  # noqa: BLE001 - counted, reported, not dropped silently
                a["failures"] += 1
                a["errors"].append(f"{type(e).__name__}: {e}")
    out = {}
    for name, a in acc.items():
        mh = np.mean(a["mass"], axis=0) if a["mass"] else None  # [layers, 2, kv_heads]
        m = None if mh is None else mh.mean(axis=-1)  # [layers, 2]
        dh = np.mean(a["dmass"], axis=0) if a["dmass"] else None  # [layers, 2, kv_heads]
        dm = None if dh is None else dh.mean(axis=-1)
        out[name] = dict(documents=len(documents), failures=a["failures"], errors=a["errors"][:5],
                         kl=float(np.mean(a["kl"])) if a["kl"] else float("nan"),
                         top1=float(np.mean(a["top1"])) if a["top1"] else float("nan"),
                         kl_late=float(np.mean(a["kl_late"])) if a["kl_late"] else float("nan"),
                         top1_late=float(np.mean(a["top1_late"])) if a["top1_late"] else float("nan"),
                         top1_per_doc=[float(x) for x in a["top1"]], kl_per_doc=[float(x) for x in a["kl"]],
                         mass_selected=None if m is None else m[:, 0].tolist(),
                         mass_oracle=None if m is None else m[:, 1].tolist(),
                         mass_ratio=None if m is None else (m[:, 0] / np.maximum(m[:, 1], 1e-12)).tolist(),
                         mass_ratio_heads=None if mh is None else
                         (mh[:, 0] / np.maximum(mh[:, 1], 1e-12)).tolist(),  # [layers][kv_heads]
                         decode_mass_selected=None if dm is None else dm[:, 0].tolist(),
                         decode_mass_oracle=None if dm is None else dm[:, 1].tolist(),
                         decode_mass_ratio=None if dm is None else (dm[:, 0] / np.maximum(dm[:, 1], 1e-12)).tolist(),
                         decode_mass_ratio_heads=None if dh is None else
                         (dh[:, 0] / np.maximum(dh[:, 1], 1e-12)).tolist())
    return out
