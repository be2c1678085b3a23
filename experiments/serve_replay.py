"""Replay a trace of requests through the continuous-batching engine (models/engine.py), dense vs Kascade.

    python -m experiments.serve_replay --replay_out=benchmarks          # on the H200: the reduced default below
    python -m experiments.serve_replay --replay_model=random:tiny --num_requests=8 --min_prompt=64 --max_prompt=256

The trace (same for every strategy, `--replay_seed`): `--num_requests` requests with Poisson arrivals at
`--arrival_rate` req/s, prompt lengths log-uniform in [--min_prompt, --max_prompt] (random token ids), new tokens
uniform in [--min_new, --max_new] with EOS ignored (so every strategy generates the same number of tokens). Each
strategy gets a fresh engine (`--max_batch` slots, pages of `--page_size`, `--num_pages`, default: enough for every
slot at the longest request), a warm-up pass (one short request per power-of-two prompt bucket, so the prefill
shapes and the decode step are compiled before timing), then the timed replay in wall-clock time: a request is
submitted once its arrival time has passed, and `Engine.step()` runs whenever anything is queued or active.

Reports generated tokens/s over the makespan (first arrival to last token), TTFT p50/p99 (from the scheduled
arrival, so queueing counts), time per output token (TPOT: per request, mean gap between its tokens after the
first) p50/p99, decode steps and the mean number of active slots. `--replay_out=DIR` writes the "replay" section of
DIR/paged.json and DIR/paged.md (experiments/paged_report.py); without it, only the log.

Models: `random:llama3-8b` (default: random bf16 weights in the Llama-3.1-8B shape, 32/8 heads, d 128, hidden 4096,
ffn 14336, vocab 128256, with `--replay_layers` layers; Kascade anchors `registry.default_anchors(layers)`, identity
head map, or `--replay_anchors=0,4,...`), `random:tiny` (CPU smoke runs), or any `--model`-style alias/path via
`--replay_model` (then the strategy gets the model's shipped default recipe: its levers and the anchors and head
map of its shipped calibration, found at any --replay_dtype; `calibration.resolve.recipe_kascade`). A request whose
prefill fails is counted in `failed_requests` (with `first_error`) and left out of the token metrics.

Reduced default (the lead's ~5 GPU minutes): 8 layers, 24 requests, prompts 4K-16K (three prefill buckets), 32-96
new tokens, 8 req/s, max_batch 8; pass `--replay_anchors=0,4` for a paper-like anchor share (2 of 8 layers). The issue's
full setting: `--replay_layers=32 --num_requests=256 --min_prompt=2048 --max_prompt=65536 --max_batch=8` (K/V of 8 x 64K tokens x 32 layers = 68 GB plus 16 GB of weights; much longer to run).
"""

from __future__ import annotations

import datetime
import gc
import sys
import time

from absl import flags

from experiments import cli

REPLAY_MODEL = flags.DEFINE_string("replay_model", "random:llama3-8b",
                                   "random:llama3-8b | random:tiny | a model alias/path as for --model.")
REPLAY_LAYERS = flags.DEFINE_integer("replay_layers", 8, "Layers of a random:* model.", lower_bound=1)
STRATEGIES = flags.DEFINE_list("replay_strategies", ["dense", "kascade"], "Strategies to replay (dense, kascade).")
NUM_REQUESTS = flags.DEFINE_integer("num_requests", 24, "Requests in the trace.", lower_bound=1)
ARRIVAL_RATE = flags.DEFINE_float("arrival_rate", 8.0, "Poisson arrival rate, requests per second.", lower_bound=1e-6)
MIN_PROMPT = flags.DEFINE_integer("min_prompt", 4096, "Shortest prompt (tokens).", lower_bound=1)
MAX_PROMPT = flags.DEFINE_integer("max_prompt", 16384, "Longest prompt (tokens).", lower_bound=1)
MIN_NEW = flags.DEFINE_integer("min_new", 32, "Fewest new tokens per request.", lower_bound=1)
MAX_NEW = flags.DEFINE_integer("max_new", 96, "Most new tokens per request.", lower_bound=1)
MAX_BATCH = flags.DEFINE_integer("max_batch", 8, "Engine slots (the decode step's fixed batch).", lower_bound=1)
PAGE_SIZE = flags.DEFINE_integer("page_size", 64, "KV page size (a power of two in 16..256).")
NUM_PAGES = flags.DEFINE_integer("num_pages", None, "Pages in the pool (default: max_batch x the longest request).")
REPLAY_SEED = flags.DEFINE_integer("replay_seed", 0, "Trace seed.")
REPLAY_OUT = flags.DEFINE_string("replay_out", "", "Folder for paged.json/paged.md (replay section); '' = log only.")
# The Kascade knobs carry a replay_ prefix: experiments.common / experiments.eval define the unprefixed ones, and a
# process (the test session) that imports several entry points must not define a flag twice.
ANCHORS = flags.DEFINE_string("replay_anchors", "auto", "Kascade anchors: auto (random:* models: "
                              "registry.default_anchors; others: the shipped calibration) or a list like 0,4.")
TOPK_FRAC = flags.DEFINE_float("replay_topk_frac", 0.1, "Kascade Top-k fraction (KascadeConfig.topk_frac).")
MIN_K = flags.DEFINE_integer("replay_min_k", 128, "Kascade minimum budget (KascadeConfig.min_k).", lower_bound=1)
TILE_SIZE = flags.DEFINE_integer("replay_tile_size", 32, "Kascade prefill query tile (KascadeConfig.tile_size).")
DTYPE = flags.DEFINE_enum("replay_dtype", None, ["float32", "bfloat16", "float16"],
                          "Weights and KV dtype (default: bfloat16 on a GPU, float32 elsewhere).")
CHUNK = flags.DEFINE_integer("replay_chunk_size", None, "Prefill chunk (multiple of 64; default: the whole prompt "
                             "on a GPU).")
PREFILL_BUDGET = flags.DEFINE_integer("max_prefill_tokens_per_step", None, "Engine: prefill tokens per step between "
                                      "decode steps (multiple of 64; default: each admission's prefill runs whole)")

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


def build_strategy(name: str, model, tok, spec: str, dtype: str = "float32"):
    """dense, or kascade: on a random:* model the registry's default anchors (identity head map, no levers); on a
    real model the shipped default recipe (`calibration.resolve.recipe_kascade`: its levers and the anchors and
    head map of its calibration, found at any `dtype`), with --replay_anchors=<list> replacing only the anchors."""
    import jax

    from kascade_jax.registry import default_anchors, make_strategy
    from models.attention import DenseStrategy

    if name == "dense":
        return DenseStrategy()
    if name != "kascade":
        raise ValueError(f"--replay_strategies takes dense and kascade (the strategies with paged decode), got {name!r}")
    cfg = model.config
    if spec.startswith("random:"):
        kw = dict(anchors=default_anchors(cfg.num_layers) if ANCHORS.value == "auto" else ANCHORS.value)
    else:
        from kascade_jax.calibration.resolve import recipe_kascade

        kw, desc = recipe_kascade(spec, cfg.num_layers, cfg.kv_heads, dtype=dtype, tile_size=TILE_SIZE.value,
                                  model=model, tokenizer=tok)
        if ANCHORS.value != "auto":
            kw = dict(kw, anchors=ANCHORS.value, head_map=None)
        print(f"kascade: {desc}" + (f"; anchors {ANCHORS.value} (--replay_anchors), identity head map"
                                    if ANCHORS.value != "auto" else ""), flush=True)
    kw = dict(dict(tile_size=TILE_SIZE.value), **kw)  # a recipe that sets its own tile keeps it
    return make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=TOPK_FRAC.value, min_k=MIN_K.value,
                         kernels="pallas" if jax.default_backend() == "gpu" else "reference", **kw)


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


def warm_up(engine, min_prompt, max_prompt, vocab):
    """One 2-token request per power-of-two prompt bucket (the engine pads prompts to these widths)."""
    from models.engine import SamplingParams, _prefill_width

    widths = sorted({_prefill_width(n, engine.max_len) for n in (min_prompt, max_prompt)} |
                    {w for w in (1 << i for i in range(6, 20)) if min_prompt < w < max_prompt})
    for w in widths:
        n = min(w, max_prompt)
        engine.submit([i % vocab for i in range(n)], SamplingParams(max_new_tokens=2, ignore_eos=True))
        engine.run()


def main(argv):
    del argv
    import jax

    from models.engine import Engine
    from models.paged import check_page_size, pages_for

    check_page_size(PAGE_SIZE.value)
    if MIN_PROMPT.value > MAX_PROMPT.value or MIN_NEW.value > MAX_NEW.value:
        raise ValueError("--min_prompt/--min_new must not exceed --max_prompt/--max_new")
    for s in STRATEGIES.value:
        if s not in ("dense", "kascade"):
            raise ValueError(f"--replay_strategies takes dense and kascade, got {s!r}")
    on_gpu = jax.default_backend() == "gpu"
    if REPLAY_OUT.value and not on_gpu:
        raise ValueError("--replay_out writes benchmark files: run on a GPU (CPU timings would mean nothing)")
    dtype = DTYPE.value or ("bfloat16" if on_gpu else "float32")
    spec = REPLAY_MODEL.value
    ps = PAGE_SIZE.value
    max_len = MAX_PROMPT.value + MAX_NEW.value
    num_pages = NUM_PAGES.value or MAX_BATCH.value * pages_for(max_len, ps)
    if not on_gpu and spec.startswith("random:") and spec.split(":", 1)[1] in RANDOM_SHAPES:
        gb = random_model_gb(spec.split(":", 1)[1], REPLAY_LAYERS.value, dtype, num_pages, ps)
        if gb > CPU_MAX_GB:
            raise ValueError(f"serve_replay on a CPU: --replay_model={spec} with {REPLAY_LAYERS.value} layers and "
                             f"{num_pages} KV pages of {ps} needs about {gb:.0f} GB; run it on a GPU, or check the "
                             "loop on CPU with --replay_model=random:tiny")
    model, tok, desc = build_model(spec, REPLAY_LAYERS.value, dtype)
    cfg = model.config
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"--max_prompt + --max_new = {max_len} exceeds the model's context {cfg.max_position_embeddings}")
    max_len = pages_for(max_len, ps) * ps
    trace = make_trace(NUM_REQUESTS.value, ARRIVAL_RATE.value, MIN_PROMPT.value, MAX_PROMPT.value, MIN_NEW.value,
                       MAX_NEW.value, cfg.vocab, REPLAY_SEED.value)
    print(f"{desc}; {len(trace)} requests over {trace[-1][0]:.1f} s, prompts {MIN_PROMPT.value}-{MAX_PROMPT.value}, "
          f"max_batch {MAX_BATCH.value}, {num_pages} pages of {ps}", flush=True)
    rows = []
    for name in STRATEGIES.value:
        strategy = build_strategy(name, model, tok, REPLAY_MODEL.value, dtype)
        engine = Engine(model, tok, strategy, max_batch=MAX_BATCH.value, page_size=ps, num_pages=num_pages,
                        max_len=max_len, chunk_size=CHUNK.value,
                        max_prefill_tokens_per_step=PREFILL_BUDGET.value)
        t = time.perf_counter()
        warm_up(engine, MIN_PROMPT.value, MAX_PROMPT.value, cfg.vocab)
        print(f"{name}: warm-up (compilation) {time.perf_counter() - t:.1f} s", flush=True)
        steps0 = engine.decode_steps
        row = dict(strategy=name, max_prefill_tokens_per_step=PREFILL_BUDGET.value, **replay(engine, trace))
        row["decode_steps"] -= steps0
        rows.append(row)
        print(f"{name}: {row['tokens_per_s']:.1f} generated tok/s, makespan {row['makespan_s']:.2f} s, TTFT p50 "
              f"{row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s, TPOT p50 {row['tpot_p50_ms']:.2f} ms p99 "
              f"{row['tpot_p99_ms']:.2f} ms, {row['decode_steps']} decode steps, mean active {row['mean_active']:.2f}, "
              f"decode compilations {row['decode_compilations']}" +
              (f", FAILED requests {row['failed_requests']} ({row['first_error']})" if row["failed_requests"] else ""),
              flush=True)
        del engine
        gc.collect()
    if REPLAY_OUT.value:
        from experiments import paged_report

        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    gpu=jax.devices()[0].device_kind, jax=jax.__version__, command=" ".join(sys.argv), model=desc,
                    num_requests=NUM_REQUESTS.value, arrival_rate=ARRIVAL_RATE.value, min_prompt=MIN_PROMPT.value,
                    max_prompt=MAX_PROMPT.value, min_new=MIN_NEW.value, max_new=MAX_NEW.value,
                    max_batch=MAX_BATCH.value, page_size=ps, num_pages=num_pages, seed=REPLAY_SEED.value,
                    topk_frac=TOPK_FRAC.value, min_k=MIN_K.value, anchors=ANCHORS.value,
                    max_prefill_tokens_per_step=PREFILL_BUDGET.value)
        print("wrote", paged_report.update(REPLAY_OUT.value, "replay", dict(meta=meta, rows=rows)))


if __name__ == "__main__":
    cli.run(main)
