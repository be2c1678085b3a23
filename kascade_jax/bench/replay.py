"""The serving replay's machinery (issue 23): random models in real shapes, a Poisson trace of ragged requests,
and the wall-clock replay of a trace through the continuous-batching engine (`models.engine`) with its metrics.

`experiments.serve_replay` is the front end (flags, strategies, the report). Kept apart so that it is importable
without any entry point's flags. Deliberately not here: building strategies (the entry points' shared flags do).
"""

from __future__ import annotations

import time

RANDOM_SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072,
                      tie_word_embeddings=False),
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True),
}


class IdTokenizer:
    """Random-weight models have no tokenizer: prompts are token ids, text is the ids."""

    eos_token_ids = ()

    def decode(self, ids):
        return " ".join(map(str, ids))


CPU_MAX_GB = 8.0  # a CPU replay is a functional check: refuse one whose weights and KV pool would exceed this


def random_model_gb(shape: str, layers: int, dtype: str, num_pages: int, page_size: int) -> float:
    """GB of a random:<shape> model's weights plus its engine's paged KV pool (K and V, every layer)."""
    c = RANDOM_SHAPES[shape]
    h, ffn, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * ffn
    params = layers * per_layer + vocab * h * (1 if c["tie_word_embeddings"] else 2)
    pool = 2 * layers * num_pages * page_size * kv
    return (params + pool) * (4 if dtype == "float32" else 2) / 1e9


def build_model(spec: str, layers: int, dtype: str):
    import jax.numpy as jnp

    from models.config import ModelConfig
    from models.params import random_model

    if spec.startswith("random:"):
        shape = spec.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise ValueError(f"unknown random model shape {shape!r}; known: {sorted(RANDOM_SHAPES)}")
        cfg = ModelConfig.from_hf(dict(model_type="llama", num_hidden_layers=layers, rms_norm_eps=1e-5,
                                       **RANDOM_SHAPES[shape]), name=spec)
        return random_model(cfg, seed=0, dtype=jnp.dtype(dtype)), IdTokenizer(), f"{spec} ({layers} layers, random {dtype})"
    from models import load_model

    model, tok = load_model(spec, dtype)
    return model, tok, f"{spec} ({dtype})"


def make_trace(n, rate, min_prompt, max_prompt, min_new, max_new, vocab, seed):
    """[(arrival_s, prompt_ids, max_new_tokens)] sorted by arrival."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    arrivals -= arrivals[0]
    lens = np.exp(rng.uniform(np.log(min_prompt), np.log(max_prompt), n)).round().astype(int)
    lens = np.clip(lens, min_prompt, max_prompt)
    news = rng.integers(min_new, max_new + 1, n)
    return [(float(a), rng.integers(0, vocab, int(p)).tolist(), int(m)) for a, p, m in zip(arrivals, lens, news)]


def _pct(xs, q):
    import numpy as np

    return float(np.percentile(np.asarray(xs, float), q)) if xs else float("nan")


def replay(engine, trace, *, clock=time.perf_counter, log=print):
    """Run the trace in wall-clock time. Returns the metrics row (without the strategy name).

    A request that never produced a token (its prefill raised; the engine releases it and stays consistent) is
    counted in `failed_requests`, with the first error in `first_error`, and left out of the token metrics; it is
    never dropped silently. An engine step that keeps raising (more errors than requests) is re-raised."""
    from models.engine import SamplingParams

    pending = list(trace)
    handles, active_sum, steps, errors = [], 0, 0, []
    t0 = clock()
    while pending or not engine.idle:
        now = clock() - t0
        while pending and pending[0][0] <= now:
            arr, ids, new = pending.pop(0)
            handles.append(engine.submit(ids, SamplingParams(max_new_tokens=new, ignore_eos=True), arrival=t0 + arr))
        if engine.idle:
            time.sleep(max(0.0, pending[0][0] - (clock() - t0)))
            continue
        try:
            engine.step()
        except Exception as e:  # noqa: BLE001  (recorded in the row, re-raised if it persists)
            errors.append(f"{type(e).__name__}: {str(e)[:300]}")
            log(f"engine step failed ({errors[-1]}); the request is counted as failed")
            if len(errors) > len(trace):
                raise
            continue
        active_sum += engine.active
        steps += 1
    done = [h for h in handles if h.token_times]
    failed = len(handles) - len(done)
    end = max((h.token_times[-1] for h in done), default=float("nan"))
    generated = sum(h.new_tokens for h in done)
    ttft = [h.ttft for h in done]
    tpot = [h.tpot for h in done if h.tpot is not None]
    makespan = end - t0
    row = dict(requests=len(handles), failed_requests=failed, generated_tokens=generated, makespan_s=makespan,
               tokens_per_s=generated / makespan if done else float("nan"), ttft_p50_s=_pct(ttft, 50),
               ttft_p99_s=_pct(ttft, 99), tpot_p50_ms=1e3 * _pct(tpot, 50), tpot_p99_ms=1e3 * _pct(tpot, 99),
               decode_steps=engine.decode_steps, mean_active=active_sum / max(steps, 1),
               decode_compilations=engine.decode_compilations)
    if errors:
        row["first_error"] = errors[0]
    return row


def warm_up(engine, min_prompt, max_prompt, vocab, *, log=None):
    """One 2-token request per power-of-two prompt bucket (the engine pads prompts to these widths); `log` gets one
    line per bucket with its time (a long compilation shows where it is)."""
    from models.engine import SamplingParams, _prefill_width

    widths = sorted({_prefill_width(n, engine.max_len) for n in (min_prompt, max_prompt)} |
                    {w for w in (1 << i for i in range(6, 20)) if min_prompt < w < max_prompt})
    for w in widths:
        n = min(w, max_prompt)
        t = time.perf_counter()
        engine.submit([i % vocab for i in range(n)], SamplingParams(max_new_tokens=2, ignore_eos=True))
        engine.run()
        if log is not None:
            log(f"  warm-up prompt {n}: {time.perf_counter() - t:.1f} s")
