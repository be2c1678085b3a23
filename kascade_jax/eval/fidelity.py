"""Label-free fidelity of a sparse strategy against dense attention, on long natural text.

A document is P prefill tokens (P a multiple of PROBE_CHUNK) and DECODE_STEPS more. It runs once through dense
attention and every strategy in lockstep, chunk by chunk (`_document_pass`):
1. Teacher forcing: per prefill token, KL(dense || strategy) of the next-token distributions and whether their
   argmax agrees.
2. Prefill attention mass (Kascade-family strategies only): the last prefill chunk (PROBE_CHUNK rows) runs through
   `MassProbe`, a wrapper that calls the strategy and, per layer, measures on those rows (a) the dense attention
   mass that lands on the keys the strategy attends (its selected set through the head map, plus the causal
   diagonal tile it always attends) and (b) the same for the oracle: each query head's own Top-k of the dense
   probabilities over the same prefix with the same budget k. a/b is the "recovered mass vs oracle Top-k"; dense
   layers (layer 0, decode-only prefill) score 1. The probe reads the strategy's own state and recomputes dense
   probabilities from q and the cache with plain jnp, so it sees exactly what ran.
3. Decode-phase mass: the DECODE_STEPS tokens then run as teacher-forced decode steps on the same cache through
   the same probe: per layer, the dense mass on the keys the strategy attends against each query head's own
   Top-count. Prefill and decode numbers side by side say which phase loses the mass.

`evaluate_answers` (the eval's task "answers") measures the decode where the answers are instead: on RULER prompts,
dense answers greedily and each strategy is teacher-forced along that answer, so every step compares next tokens
given the same prefix; a prompt whose every step agrees is one whose greedy answer equals dense's.

Each strategy prefills a document once, and at most one [chunk, vocab] logits array per strategy exists at a time
(the first version held every chunk's logits of dense and the strategy, 2 x 10 GB at 16K x 152K, and ran three
prefills per strategy). Documents are stdlib prose (`tasks.prose`) from seeded offsets of the "test" split
stream, or any token lists passed in. There are ~70K tokens of prose, so many 8K documents overlap.
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
    """`num_docs` token lists of prose, each from a seeded starting sentence: `length` prefill tokens (a multiple of
    PROBE_CHUNK) and DECODE_STEPS more for the decode-phase probe."""
    if length < 2 * PROBE_CHUNK or length % PROBE_CHUNK:
        raise ValueError(f"length must be a multiple of {PROBE_CHUNK} and >= {2 * PROBE_CHUNK}, got {length}")
    sents = prose.prose_sentences()
    docs = []
    for i in range(num_docs):
        rng = np.random.default_rng(synthetic.sample_seed("fidelity", length, i, seed=seed, split=split))
        start, ids, n = int(rng.integers(len(sents))), [], 0
        while len(ids) < length + DECODE_STEPS:
            chunk = " ".join(sents[(start + n + j) % len(sents)] for j in range(64))
            n += 64
            ids += prompt_lib.encode(tokenizer, (" " if ids else "") + chunk)
            if n > 4 * len(sents):
                raise ValueError(f"length {length} is too long for the prose source")
        docs.append(ids[:length + DECODE_STEPS])
    return docs


# ----------------------------------------------------------------------------- teacher forcing
_LOGIT_CHUNK = 2048  # teacher-forced prefill chunk: one [chunk, vocab] fp32 logits array per strategy at a time
_KL_ROWS = 1024  # rows per block of the KL: bounds the fp32 log-softmax copies


@jax.jit
def _kl_top1_block(ld, lo):
    lp_dense = jax.nn.log_softmax(ld.astype(jnp.float32), axis=-1)
    lp_other = jax.nn.log_softmax(lo.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(lp_dense) * (lp_dense - lp_other), axis=-1)
    return kl, jnp.argmax(lp_dense, -1) == jnp.argmax(lp_other, -1)


def _kl_top1(logits_dense, logits_other) -> tuple[np.ndarray, np.ndarray]:
    """KL(dense || other) and argmax agreement per row of two [rows, vocab] arrays, in blocks of _KL_ROWS rows."""
    if logits_dense.shape != logits_other.shape:
        raise ValueError(f"logits differ in shape: {logits_dense.shape} vs {logits_other.shape}")
    kls, agrees = [], []
    for i in range(0, logits_dense.shape[0], _KL_ROWS):
        kl, agree = _kl_top1_block(logits_dense[i:i + _KL_ROWS], logits_other[i:i + _KL_ROWS])
        kls.append(np.asarray(kl))
        agrees.append(np.asarray(agree))
    return np.concatenate(kls), np.concatenate(agrees)


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
    dense_layer = cfg.decode_only or (cfg.is_anchor(layer) and (
        (layer == 0 and cfg.layer0_dense) or getattr(cfg, "prefill_dense_anchors", False)))
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
    st = new_state if cfg.is_anchor(layer) else prev_state
    if (layer == 0 and cfg.layer0_dense) or st is None:  # a dense layer (an unread dense anchor returns no state)
        return jnp.ones((2, kvh), jnp.float32)
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


def _document_pass(model, doc, dense, strategies: dict[str, Any], *, mass: bool) -> dict[str, Any]:
    """One document through dense and every strategy in lockstep, chunk by chunk, so that at most one chunk's
    [rows, vocab] logits per strategy exist at once (never a [T, vocab] array per strategy: 16K x 152K fp32 is
    10 GB). The first P tokens (P = a multiple of PROBE_CHUNK) are teacher-forced as prefill; the last prefill chunk
    is the PROBE_CHUNK rows that the mass probe measures, so the probe sees exactly the prefix the strategy built;
    then the next DECODE_STEPS tokens run as probed decode steps on the same cache. One prefill per strategy.

    Returns {name: dict(kl [P], agree [P], mass [layers, 2, kv_heads] | None, dmass | None) or the exception}."""
    from models import generate as gen  # noqa: PLC0415
    from models.cache import KVCache  # noqa: PLC0415

    p = (len(doc) - DECODE_STEPS) // PROBE_CHUNK * PROBE_CHUNK
    if p < 2 * PROBE_CHUNK:
        raise ValueError(f"a fidelity document needs >= {2 * PROBE_CHUNK + DECODE_STEPS} tokens, got {len(doc)}")
    tokens = np.asarray(doc, np.int32)[None]
    plens = np.array([p], np.int32)
    max_len = -(-len(doc) // gen.CHUNK_MULTIPLE) * gen.CHUNK_MULTIPLE
    plan = gen.prefill_plan(p - PROBE_CHUNK, max_len, _LOGIT_CHUNK) + [(p - PROBE_CHUNK, PROBE_CHUNK)]
    new_cache = lambda: KVCache.init(model.config, 1, max_len, dtype=model.dtype)  # noqa: E731
    dense_cache = new_cache()
    live = {name: dict(cache=new_cache(), kl=[], agree=[], mass=None, dmass=None) for name in strategies}
    out: dict[str, Any] = {}
    for i, (off, width) in enumerate(plan):
        chunk = tokens[:, off:off + width]
        probe = mass and i == len(plan) - 1
        ld, dense_cache = gen.prefill_chunk(model, chunk, plens, dense_cache, dense, off, all_logits=True)
        for name in list(live):
            st, a = strategies[name], live[name]
            try:
                if probe and supports_mass(st):
                    lo, a["cache"], state = gen.forward(model, chunk, a["cache"], MassProbe(st), q_start=off,
                                                        seq_len=plens)
                    a["mass"] = np.asarray(jnp.stack(state["mass"]))
                else:
                    lo, a["cache"] = gen.prefill_chunk(model, chunk, plens, a["cache"], st, off, all_logits=True)
                kl, agree = _kl_top1(ld[0], lo[0])
                a["kl"].append(kl)
                a["agree"].append(agree)
            except Exception as e:  # noqa: BLE001 - the caller counts it
                out[name] = e
                del live[name]
        del ld
    for name, a in live.items():
        st = strategies[name]
        try:
            if mass and supports_mass(st):
                cache, steps, probe = dataclasses.replace(a["cache"], lengths=jnp.asarray(plens)), [], MassProbe(st)
                for j in range(p, p + DECODE_STEPS):
                    _, cache, state = gen.decode_step(model, tokens[:, j], cache, probe, with_state=True)
                    steps.append(jnp.stack(state["mass"]))
                a["dmass"] = np.asarray(jnp.mean(jnp.stack(steps), axis=0))
            out[name] = dict(kl=np.concatenate(a["kl"]), agree=np.concatenate(a["agree"]).astype(np.float64),
                             mass=a["mass"], dmass=a["dmass"])
        except Exception as e:  # noqa: BLE001
            out[name] = e
    return out


# ----------------------------------------------------------------------------- decode along dense's answers
ANSWER_STEPS = 64  # teacher-forced decode steps along dense's greedy answer (RULER's longest answers are 128)


def _answer_pass(model, prompts: list[list[int]], dense, strategies: dict[str, Any], *, steps: int, eos,
                 chunk_size: int | None = None, mass: bool = True) -> dict[str, Any]:
    """One batch of prompts: dense prefills and answers greedily for `steps` tokens; every strategy prefills the
    same prompts and is teacher-forced along dense's answer. Per strategy: agree / kl [batch, steps] (its next
    token against dense's at each step; step 0 is the prefill's last logits), dmass [layers, 2, kv_heads] (the
    decode steps' attention mass against each query head's own Top-k, `MassProbe`) or the exception. Also
    "_valid" [batch, steps]: the steps up to and including dense's first end-of-sequence token."""
    from models import generate as gen  # noqa: PLC0415
    from models.cache import KVCache  # noqa: PLC0415

    b = len(prompts)
    plens = np.array([len(x) for x in prompts], np.int32)
    tokens = np.zeros((b, int(plens.max())), np.int32)
    for i, x in enumerate(prompts):
        tokens[i, :len(x)] = x
    max_len = -(-(int(plens.max()) + steps) // gen.CHUNK_MULTIPLE) * gen.CHUNK_MULTIPLE
    new_cache = lambda: KVCache.init(model.config, b, max_len, dtype=model.dtype)  # noqa: E731
    logits, cache = gen.prefill(model, tokens, plens, new_cache(), dense, chunk_size=chunk_size)
    dense_logits, answer = [], []
    for j in range(steps):
        dense_logits.append(logits)
        answer.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        if j + 1 < steps:
            logits, cache = gen.decode_step(model, answer[-1], cache, dense)
    del cache
    ans = np.stack([np.asarray(t) for t in answer], axis=1)  # [batch, steps]
    is_eos = np.isin(ans, np.asarray(list(eos), np.int64))
    out: dict[str, Any] = {"_valid": (np.cumsum(is_eos, axis=1) - is_eos) == 0, "_answer": ans}
    for name, st in strategies.items():
        try:
            logits, cache = gen.prefill(model, tokens, plens, new_cache(), st, chunk_size=chunk_size)
            probe = MassProbe(st) if mass and supports_mass(st) else None
            kls, agrees, masses = [], [], []
            for j in range(steps):
                kl, agree = _kl_top1_block(dense_logits[j], logits)
                kls.append(kl)  # on the device: one transfer after the steps, not a sync per step
                agrees.append(agree)
                if j + 1 < steps:
                    if probe is not None:
                        logits, cache, state = gen.decode_step(model, answer[j], cache, probe, with_state=True)
                        masses.append(jnp.stack(state["mass"]))
                    else:
                        logits, cache = gen.decode_step(model, answer[j], cache, st)
            del cache
            out[name] = dict(kl=np.asarray(jnp.stack(kls, axis=1)), agree=np.asarray(jnp.stack(agrees, axis=1)),
                             dmass=np.asarray(jnp.mean(jnp.stack(masses), axis=0)) if masses else None)
        except Exception as e:  # noqa: BLE001 - the caller counts it
            out[name] = e
    return out


_ANSWER_LISTS = ("agree", "first", "reproduced", "kl", "task", "dmass", "dmass_n", "pid", "first_diff")


def evaluate_answers(model, prompts: list[list[int]], strategies: dict[str, Any], *, eos, steps: int = ANSWER_STEPS,
                     batch: int = 8, tasks: list[str] | None = None, dense=None, mass: bool = True,
                     chunk_size: int | None = None, progress: bool = True, log=None, prior: dict | None = None,
                     on_batch=None) -> dict[str, dict]:
    """Decode fidelity where the answers are: teacher-forced along dense's own greedy answer to each prompt.

    Per strategy name: `agree` (share of answer steps whose next token equals dense's; the steps after dense's first
    end-of-sequence token do not count), `first_agree` (step 0 only: the prefill's last logits), `reproduced`
    (share of prompts whose every answer step agrees: exactly the prompts where its greedy decode would write
    dense's answer), `kl` (mean over answer steps), `per_task` (the same per task when `tasks` names each prompt's
    task), the per-layer decode mass (`decode_mass_*`, over every probed step), failures and their first errors,
    and `per_prompt` (in the order of `prompts`: `reproduced` 0/1 and `first_diff`, the first answer step that
    disagrees, -1 if none; None where the batch failed), to pair with free-running answers. Prompts run in
    batches of `batch` in length order, each batch's dense pass shared by every strategy.

    Resumable like `evaluate_fidelity`: until the last prompt every result carries `prompts_done` and `state`;
    `on_batch(results)` gets them after each batch, and `prior` (name -> such a result, all at one `prompts_done`
    of the same prompts) goes on from there, at any batch size, to an uninterrupted run's numbers."""
    import time  # noqa: PLC0415

    from tqdm.auto import tqdm  # noqa: PLC0415

    if steps < 1 or batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got steps={steps}, batch={batch}")
    if tasks is not None and len(tasks) != len(prompts):
        raise ValueError(f"tasks names {len(tasks)} prompts, got {len(prompts)} prompts")
    if dense is None:
        from models.attention import DenseStrategy  # noqa: PLC0415
        dense = DenseStrategy()
    tasks = tasks or ["all"] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # stable: the same order on a resume
    acc = {name: dict({k: [] for k in _ANSWER_LISTS}, failures=0, errors=[]) for name in strategies}
    start = 0
    if prior:
        start = answers_resume_point(prior, list(strategies), len(prompts), steps)
        if start is None:
            raise ValueError(f"an answers prior must hold every strategy at one prompts_done of {len(prompts)} prompts "
                             f"and {steps} steps, got { {n: (prior.get(n) or {}).get('prompts_done') for n in strategies} }")
        for name in strategies:
            st = prior[name]["state"]
            acc[name].update({k: [np.asarray(x) for x in st[k]] if k == "dmass" else list(st.get(k, []))
                              for k in _ANSWER_LISTS},
                             failures=int(st["failures"]), errors=list(st["errors"]))
    t_all = time.perf_counter()
    batches = [order[i:i + batch] for i in range(start, len(order), batch)]
    done = start
    for n, idx in enumerate(tqdm(batches, desc="answer fidelity", disable=not progress, leave=False)):
        t0 = time.perf_counter()
        try:
            res = _answer_pass(model, [prompts[i] for i in idx], dense, strategies, steps=steps, eos=eos,
                               chunk_size=chunk_size, mass=mass)
        except Exception as e:  # noqa: BLE001 - the dense pass failed: every strategy fails this batch
            res = {name: e for name in strategies}
        valid = res.get("_valid")
        for name in strategies:
            r, a = res[name], acc[name]
            if isinstance(r, Exception):
                a["failures"] += len(idx)
                a["errors"].append(f"{type(r).__name__}: {r}")
                continue
            for row in range(len(idx)):
                v = valid[row]
                a["agree"].append(float(r["agree"][row][v].mean()))
                a["first"].append(float(r["agree"][row][0]))
                a["reproduced"].append(float(r["agree"][row][v].all()))
                a["kl"].append(float(r["kl"][row][v].mean()))
                a["task"].append(tasks[idx[row]])
                a["pid"].append(int(idx[row]))
                miss = np.flatnonzero(~r["agree"][row][v].astype(bool))
                a["first_diff"].append(int(miss[0]) if miss.size else -1)
            if r["dmass"] is not None:
                a["dmass"].append(r["dmass"])
                a["dmass_n"].append(len(idx))  # batches differ in size: the mass is weighted by prompts
        done += len(idx)
        if log is not None:
            log(f"answer fidelity: batch {n + 1}/{len(batches)} ({len(idx)} prompts, {done}/{len(prompts)} done) in "
                f"{time.perf_counter() - t0:.1f} s ({time.perf_counter() - t_all:.0f} s in all)")
        if on_batch is not None and done < len(prompts):
            on_batch({name: _answer_summary(a, len(prompts), steps, done) for name, a in acc.items()})
    return {name: _answer_summary(a, len(prompts), steps, len(prompts)) for name, a in acc.items()}


def answers_resume_point(prior: dict, names, prompts: int, steps: int) -> int | None:
    """Prompts that `prior` (name -> a cut answers result) has done for every one of `names`, over the same prompt
    count and steps, or None when it cannot be resumed."""
    done = {prior[n]["prompts_done"] if "state" in prior.get(n, {}) and prior[n]["prompts"] == prompts
            and prior[n]["steps"] == steps else None for n in names}
    return None if len(done) != 1 or None in done else int(done.pop())


def _answer_summary(a: dict, prompts: int, steps: int, done: int) -> dict:
    def mean(x):
        return float(np.mean(x)) if len(x) else float("nan")

    dh = None  # [layers, 2, kv_heads], weighted by each batch's prompts
    if a["dmass"]:
        dh = np.tensordot(np.asarray(a["dmass_n"], np.float64), np.stack(a["dmass"]), axes=1) / sum(a["dmass_n"])
    dm = None if dh is None else dh.mean(axis=-1)
    per_task = {}
    for t in dict.fromkeys(a["task"]):
        sel = [i for i, x in enumerate(a["task"]) if x == t]
        per_task[t] = dict(n=len(sel), agree=mean([a["agree"][i] for i in sel]),
                           reproduced=mean([a["reproduced"][i] for i in sel]))
    out = dict(task="answers", prompts=prompts, prompts_done=done, steps=steps, failures=a["failures"],
               errors=a["errors"][:5], agree=mean(a["agree"]), first_agree=mean(a["first"]),
               reproduced=mean(a["reproduced"]), kl=mean(a["kl"]), per_task=per_task,
               decode_mass_selected=None if dm is None else dm[:, 0].tolist(),
               decode_mass_oracle=None if dm is None else dm[:, 1].tolist(),
               decode_mass_ratio=None if dm is None else (dm[:, 0] / np.maximum(dm[:, 1], 1e-12)).tolist(),
               decode_mass_ratio_heads=None if dh is None else (dh[:, 0] / np.maximum(dh[:, 1], 1e-12)).tolist())
    if done == prompts and len(a["pid"]) == len(a["agree"]):  # a prior from before per_prompt existed has none
        rep, diff = [None] * prompts, [None] * prompts  # None: the prompt's batch failed
        for pid, r, f in zip(a["pid"], a["reproduced"], a["first_diff"]):
            rep[pid], diff[pid] = int(r), int(f)
        out["per_prompt"] = dict(reproduced=rep, first_diff=diff)
    if done < prompts:
        out["state"] = dict({k: [np.asarray(x).tolist() for x in a[k]] if k == "dmass" else list(a[k])
                             for k in _ANSWER_LISTS}, failures=a["failures"], errors=list(a["errors"]))
    return out


# ----------------------------------------------------------------------------- driver
_PER_DOC = ("kl", "top1", "kl_late", "top1_late", "mass", "dmass")


def evaluate_fidelity(model, documents: list[list[int]], strategies: dict[str, Any], *, dense=None,
                      mass: bool = True, progress: bool = True, log=None, prior: dict[str, dict] | None = None,
                      on_document=None) -> dict[str, dict]:
    """Per strategy name: mean KL, top-1 agreement (all prefill tokens and their second half), per-layer prefill
    and decode mass; failures counted with their first errors. `log(str)`: one line per document (its time).

    Resumable: every result carries `documents_done` and, until the last document, `state` (the per-document
    numbers, JSON-able). `on_document(results)` is called after each document with the results so far; `prior`
    (name -> such a partial result, all at the same `documents_done`) continues from there, and the final
    numbers equal one uninterrupted run's."""
    import time  # noqa: PLC0415

    from tqdm.auto import tqdm  # noqa: PLC0415

    if dense is None:
        from models.attention import DenseStrategy  # noqa: PLC0415
        dense = DenseStrategy()
    start = 0
    if prior:
        start = resume_point(prior, list(strategies), len(documents))
        if start is None:
            raise ValueError(f"a fidelity prior must hold every strategy at one documents_done of {len(documents)} "
                             f"documents, got { {n: (prior.get(n) or {}).get('documents_done') for n in strategies} }")
    acc = {name: dict(kl=[], top1=[], kl_late=[], top1_late=[], mass=[], dmass=[], failures=0, errors=[])
           for name in strategies}
    if start:
        for name in strategies:
            st = prior[name]["state"]
            acc[name].update({k: [np.asarray(x) for x in st[k]] if k in ("mass", "dmass") else list(st[k])
                              for k in _PER_DOC}, failures=int(st["failures"]), errors=list(st["errors"]))
    t_all = time.perf_counter()
    for n in tqdm(range(start, len(documents)), desc="fidelity", disable=not progress, leave=False):
        doc, t0 = documents[n], time.perf_counter()
        try:
            res = _document_pass(model, doc, dense, strategies, mass=mass)
        except Exception as e:  # noqa: BLE001 - the dense pass (or the document) failed: every strategy fails it
            res = {name: e for name in strategies}
        for name, r in res.items():
            a = acc[name]
            if isinstance(r, Exception):
                a["failures"] += 1
                a["errors"].append(f"{type(r).__name__}: {r}")
                continue
            half = len(r["kl"]) // 2
            a["kl"].append(float(r["kl"].mean()))
            a["top1"].append(float(r["agree"].mean()))
            a["kl_late"].append(float(r["kl"][half:].mean()))
            a["top1_late"].append(float(r["agree"][half:].mean()))
            if r["mass"] is not None:
                a["mass"].append(r["mass"])
            if r["dmass"] is not None:
                a["dmass"].append(r["dmass"])
        if log is not None:
            failed = sum(isinstance(r, Exception) for r in res.values())
            log(f"fidelity: document {n + 1}/{len(documents)} ({len(doc)} tokens) in {time.perf_counter() - t0:.1f} s"
                f" ({time.perf_counter() - t_all:.0f} s in all), {failed} of {len(res)} strategies failed")
        if on_document is not None and n + 1 < len(documents):
            on_document({name: _summary(a, len(documents), n + 1) for name, a in acc.items()})
    return {name: _summary(a, len(documents), len(documents)) for name, a in acc.items()}


def resume_point(prior: dict[str, dict], names, documents: int) -> int | None:
    """Documents that `prior` (name -> a cut run's partial result) has done for every one of `names` over the same
    `documents`, or None when it cannot be resumed (a name missing or finished, counts that differ)."""
    done = {prior[n]["documents_done"] if "state" in prior.get(n, {}) and prior[n]["documents"] == documents
            else None for n in names}
    return None if len(done) != 1 or None in done else int(done.pop())


def _summary(a: dict, documents: int, done: int) -> dict:
    mh = np.mean(a["mass"], axis=0) if a["mass"] else None  # [layers, 2, kv_heads]
    m = None if mh is None else mh.mean(axis=-1)  # [layers, 2]
    dh = np.mean(a["dmass"], axis=0) if a["dmass"] else None  # [layers, 2, kv_heads]
    dm = None if dh is None else dh.mean(axis=-1)
    out = dict(documents=documents, documents_done=done, failures=a["failures"], errors=a["errors"][:5],
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
    if done < documents:
        out["state"] = dict({k: [np.asarray(x).tolist() for x in a[k]] if k in ("mass", "dmass") else list(a[k])
                             for k in _PER_DOC}, failures=a["failures"], errors=list(a["errors"]))
    return out
