"""Replay a trace of requests through the continuous-batching engine (models/engine.py), dense vs Kascade: the front
end (flags, strategies, report) of `kascade_jax.bench.replay`.

    python -m experiments.serve_replay --replay_out=benchmarks          # on the H200: the reduced default below
    python -m experiments.serve_replay --model=random:tiny --num_requests=8 --min_prompt=64 --max_prompt=256

The trace (same for every strategy, `--replay_seed`): `--num_requests` requests with Poisson arrivals at
`--arrival_rate` req/s, prompt lengths log-uniform in [--min_prompt, --max_prompt] (random token ids), new tokens
uniform in [--min_new, --max_new] with EOS ignored (so every strategy generates the same number of tokens). Each
strategy gets a fresh engine (`--max_batch` slots, pages of `--page_size`, `--num_pages`, default: enough for every
slot at the longest request), a warm-up pass (one short request per power-of-two prompt bucket, so the prefill
shapes and the decode step are compiled before timing), then the timed replay in wall-clock time: a request is
submitted once its arrival time has passed, and `Engine.step()` runs whenever anything is queued or active.

Watching it: the warm-up logs each bucket before and after (time, compilations); the replay logs a
progress line every `--replay_progress_s` seconds (arrived / finished / running / queued requests, tokens, decode
steps, compilations) and any compilation during the timed replay (there should be none); a watchdog thread logs a
status line whenever the log has been quiet that long (e.g. "compiling jit(_prefill_chunk) for 95 s"), even while the
main thread is inside one compilation or device call. `--replay_time_limit=S` bounds the whole command: at the
first step (or warm-up bucket) past S seconds from its start the replay stops, the rows so far are written (the
stopped one with its `stopped` note; later strategies are skipped) and the command exits with status 3; if the
main thread is still stuck 120 s later, the watchdog ends the process (status 3) so that a plan's next job runs.
Each row records its warm-up time and compilations and `replay_compilations` (programs built during the timed
replay).

Reports generated tokens/s over the makespan (first arrival to last token), TTFT p50/p99 (from the scheduled
arrival, so queueing counts), time per output token (TPOT: per request, mean gap between its tokens after the
first) p50/p99, decode steps and the mean number of active slots. `--replay_out=DIR` writes the "replay" section of
DIR/paged.json and DIR/paged.md (experiments/paged_report.py): rows of one trace accumulate by strategy (one
strategy per command is fine), a folder holding another trace's replay is refused before the run; without it, only
the log.

Models (`--model`, the flag of every entry point): `random:llama3-8b` (this command's default: random bf16 weights
in the Llama-3.1-8B shape, 32/8 heads, d 128, hidden 4096, ffn 14336, vocab 128256, with `--replay_layers` layers;
Kascade anchors `registry.default_anchors(layers)`, identity head map, or `--anchors=0,4,...`), `random:tiny` (CPU
smoke runs), or any alias/path (then Kascade is what every entry point builds: `--recipe`, default the model's
shipped one, with its levers and the anchors and head map of its calibration; `common.build_strategy`). A request whose
prefill fails is counted in `failed_requests` (with `first_error`) and left out of the token metrics.

Reduced default (a few GPU minutes): 8 layers, 24 requests, prompts 4K-16K (three prefill buckets), 32-96
new tokens, 8 req/s, max_batch 8; pass `--anchors=0,4` for a paper-like anchor share (2 of 8 layers). The issue's
full setting: `--replay_layers=32 --num_requests=256 --min_prompt=2048 --max_prompt=65536 --max_batch=8` (K/V of 8 x 64K tokens x 32 layers = 68 GB plus 16 GB of weights; much longer to run).
"""

from __future__ import annotations

import datetime
import gc
import sys
import time

from absl import flags

from experiments import cli, common, recipe_flags
from kascade_jax.bench.replay import (CPU_MAX_GB, RANDOM_SHAPES, Compiles, TimeLimit, Watchdog, build_model, make_trace,
                                      random_model_gb, replay, row_label, warm_up)
from kascade_jax.bench import timing

REPLAY_LAYERS = flags.DEFINE_integer("replay_layers", 8, "Layers of a random:* model.", lower_bound=1)
STRATEGIES = flags.DEFINE_list("strategies", ["dense", "kascade"], "Strategies to replay (dense, kascade).")
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
# The model and Kascade flags are the shared ones of every entry point (experiments.common, recipe_flags): --model
# (default here: random:llama3-8b), --dtype (default here: bfloat16 on a GPU, float32 elsewhere), --anchors,
# --recipe, --topk_frac, --min_k, --tile_size, --chunk_size; --strategies as in experiments.eval. The old --replay_*
# spellings of these flags still work, with a warning.
for _old, _new in (("replay_strategies", "strategies"), ("replay_model", "model"), ("replay_anchors", "anchors"),
                   ("replay_topk_frac", "topk_frac"),
                   ("replay_min_k", "min_k"), ("replay_tile_size", "tile_size"), ("replay_dtype", "dtype"),
                   ("replay_chunk_size", "chunk_size")):
    cli.deprecated_alias(_old, _new)
DEFAULT_MODEL = "random:llama3-8b"
TIME_LIMIT = flags.DEFINE_float("replay_time_limit", 0.0, "Seconds from the start after which the replay stops, writes "
                                "what it has (the stopped row marked) and exits with status 3; 0 = no limit.",
                                lower_bound=0.0)
PROGRESS_S = flags.DEFINE_float("replay_progress_s", 30.0, "Seconds between progress lines (and the watchdog's "
                                "status line when the log is quiet that long).", lower_bound=1.0)
HARD_GRACE_S = 120.0  # past the time limit, the watchdog ends a process whose main thread is stuck this long
EXIT_STOPPED = 3
PREFILL_BUDGET = flags.DEFINE_integer("max_prefill_tokens_per_step", None, "Engine: prefill tokens per step between "
                                      "decode steps (multiple of 64; default: each admission's prefill runs whole)")

def model_spec() -> str:
    """--model, or this command's default (a random model in the Llama-3.1-8B shape) when not given."""
    return common.MODEL.value if flags.FLAGS["model"].present else DEFAULT_MODEL


def build_strategy(name: str, model, tok, spec: str):
    """dense, or kascade: on a random:* model the registry's default anchors or --anchors (identity head map, no
    recipe: there is no calibration of random weights; --decode_score_fp8 is the one lever taken); on a real model
    exactly what every entry point builds (`common.build_strategy`: --recipe's levers, --anchors / --head_map, its
    calibration)."""
    import jax

    from kascade_jax.registry import default_anchors, make_strategy
    from models.attention import DenseStrategy

    if name == "dense":
        return DenseStrategy()
    if name != "kascade":
        raise ValueError(f"--strategies takes dense and kascade (the strategies with paged decode), got {name!r}")
    if not spec.startswith("random:"):
        st = common.build_strategy("kascade", model, tok)
        common.print_strategy(st)
        return st
    cfg = model.config
    anchors = recipe_flags.ANCHORS.value
    return make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=common.TOPK_FRAC.value,
                         min_k=common.MIN_K.value, tile_size=common.TILE_SIZE.value,
                         anchors=default_anchors(cfg.num_layers) if anchors == "auto" else anchors,
                         decode_score_fp8=recipe_flags.DECODE_FP8.value,
                         kernels="pallas" if jax.default_backend() == "gpu" else "reference")


def main(argv):
    del argv
    t_start = time.perf_counter()
    import jax

    from models.engine import Engine
    from models.paged import check_page_size, pages_for

    check_page_size(PAGE_SIZE.value)
    if MIN_PROMPT.value > MAX_PROMPT.value or MIN_NEW.value > MAX_NEW.value:
        raise ValueError("--min_prompt/--min_new must not exceed --max_prompt/--max_new")
    spec = model_spec()
    for s in STRATEGIES.value:
        if s not in ("dense", "kascade"):
            raise ValueError(f"--strategies takes dense and kascade, got {s!r}")
    on_gpu = jax.default_backend() == "gpu"
    if REPLAY_OUT.value and not on_gpu:
        raise ValueError("--replay_out writes benchmark files: run on a GPU (CPU timings would mean nothing)")
    flags_record = timing.xla_flags_record() if on_gpu else {}  # warns now, before the long run, if GEMMs are untuned
    dtype = common.DTYPE.value if flags.FLAGS["dtype"].present else ("bfloat16" if on_gpu else "float32")
    if "kascade" in STRATEGIES.value:  # --anchors and --recipe, before any model is built
        from kascade_jax.calibration.resolve import parse_anchors

        # a random model's depth is --replay_layers: its anchors are checked against it here
        parse_anchors(recipe_flags.ANCHORS.value, REPLAY_LAYERS.value if spec.startswith("random:") else 1 << 20)
        from kascade_jax.registry import make_strategy

        make_strategy("kascade", 2, 1, anchors=(0,), topk_frac=common.TOPK_FRAC.value, min_k=common.MIN_K.value,
                      tile_size=common.TILE_SIZE.value)  # the budget flags (a dense pass would run first otherwise)
        if not spec.startswith("random:"):
            common.check_strategy_flags("kascade")
            recipe_flags.check_levers_fit([common.recipe()], MIN_PROMPT.value,
                                          f"of --min_prompt={MIN_PROMPT.value} tokens")
    ps = PAGE_SIZE.value
    max_len = MAX_PROMPT.value + MAX_NEW.value
    num_pages = NUM_PAGES.value or MAX_BATCH.value * pages_for(max_len, ps)
    if not on_gpu and spec.startswith("random:") and spec.split(":", 1)[1] in RANDOM_SHAPES:
        gb = random_model_gb(spec.split(":", 1)[1], REPLAY_LAYERS.value, dtype, num_pages, ps)
        if gb > CPU_MAX_GB:
            raise ValueError(f"serve_replay on a CPU: --model={spec} with {REPLAY_LAYERS.value} layers and "
                             f"{num_pages} KV pages of {ps} needs about {gb:.0f} GB; run it on a GPU, or check the "
                             "loop on CPU with --model=random:tiny")
    limit = TIME_LIMIT.value or None
    deadline = None if limit is None else t_start + limit
    phase = ["building the model"]
    engine = None
    compiles = Compiles()

    def status() -> str:
        parts = [f"{time.perf_counter() - t_start:.0f} s: {phase[0]}"]
        if compiles.compiling():
            parts.append(compiles.compiling())
        if engine is not None:
            parts.append(f"{engine.active} running ({engine.prefilling} prefilling), {engine.queued} queued, "
                         f"{engine.decode_steps} decode steps")
        return "; ".join(parts) + f"; {compiles.count()} compilations so far"

    watchdog = Watchdog(status, PROGRESS_S.value, log=lambda m: print(m, flush=True),
                        hard_deadline=None if deadline is None else deadline + HARD_GRACE_S, code=EXIT_STOPPED)

    def say(msg: str) -> None:
        print(msg, flush=True)
        watchdog.touch()

    def on_compile(name: str, seconds: float, ph: str) -> None:
        if ph == "replay":  # after a complete warm-up there is none: each one stalls every running request
            say(f"  compiled {name} in {seconds:.1f} s during the timed replay")

    compiles.on_compile = on_compile
    rows, stopped, skipped = [], None, []
    with watchdog, compiles:
        model, tok, desc = build_model(spec, REPLAY_LAYERS.value, dtype)
        cfg = model.config
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"--max_prompt + --max_new = {max_len} exceeds the model's context "
                             f"{cfg.max_position_embeddings}")
        max_len = pages_for(max_len, ps) * ps
        trace = make_trace(NUM_REQUESTS.value, ARRIVAL_RATE.value, MIN_PROMPT.value, MAX_PROMPT.value, MIN_NEW.value,
                           MAX_NEW.value, cfg.vocab, REPLAY_SEED.value)
        trace_meta = dict(model=desc, num_requests=NUM_REQUESTS.value, arrival_rate=ARRIVAL_RATE.value,
                          min_prompt=MIN_PROMPT.value, max_prompt=MAX_PROMPT.value, min_new=MIN_NEW.value,
                          max_new=MAX_NEW.value, max_batch=MAX_BATCH.value, page_size=ps, num_pages=num_pages,
                          seed=REPLAY_SEED.value)
        if REPLAY_OUT.value:  # its rows join a stored replay of the same trace; another trace: refused now
            from kascade_jax.bench.paged import check_replay_target

            check_replay_target(REPLAY_OUT.value, trace_meta)
        say(f"{desc}; {len(trace)} requests over {trace[-1][0]:.1f} s, prompts {MIN_PROMPT.value}-{MAX_PROMPT.value}, "
            f"max_batch {MAX_BATCH.value}, {num_pages} pages of {ps}; {sum(len(t[1]) for t in trace)} prompt tokens, "
            f"{sum(t[2] for t in trace)} new tokens" + (f"; time limit {limit:.0f} s" if limit else ""))
        # Every strategy before any replay: a real model's may calibrate, or refuse --anchors for its depth, and a
        # refusal must not come after a whole dense replay.
        phase[0] = "building the strategies"
        strategies = {name: build_strategy(name, model, tok, spec) for name in STRATEGIES.value}
        for name in STRATEGIES.value:
            phase[0] = f"{name}: building the engine"
            strategy = strategies[name]
            engine = Engine(model, tok, strategy, max_batch=MAX_BATCH.value, page_size=ps, num_pages=num_pages,
                            max_len=max_len, chunk_size=common.CHUNK.value,
                            max_prefill_tokens_per_step=PREFILL_BUDGET.value)
            phase[0] = f"{name}: warm-up"
            t, c0 = time.perf_counter(), compiles.count()
            try:
                warm_up(engine, MIN_PROMPT.value, MAX_PROMPT.value, cfg.vocab, log=say, deadline=deadline,
                        compiles=compiles)
            except TimeLimit as e:
                stopped = f"{name}: {e} ({limit:.0f} s); nothing of {name} measured"
                skipped = STRATEGIES.value[STRATEGIES.value.index(name) + 1:]
                break
            warm = dict(warmup_s=time.perf_counter() - t, warmup_compilations=compiles.count() - c0,
                        warmup_compile_s=sum(s for _, s, _ in compiles.events[c0:]))
            say(f"{name}: warm-up (compilation) {warm['warmup_s']:.1f} s, {warm['warmup_compilations']} programs "
                f"built in {warm['warmup_compile_s']:.1f} s")
            phase[0] = f"{name}: timed replay"
            steps0 = engine.decode_steps
            row = dict(strategy=row_label(name, strategy), max_prefill_tokens_per_step=PREFILL_BUDGET.value, **warm,
                       **replay(engine, trace, log=say, progress_s=PROGRESS_S.value, deadline=deadline,
                                compiles=compiles))
            row["decode_steps"] -= steps0
            rows.append(row)
            say(f"{row['strategy']}: {row['tokens_per_s']:.1f} generated tok/s, makespan {row['makespan_s']:.2f} s, "
                f"TTFT p50 {row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s, TPOT p50 {row['tpot_p50_ms']:.2f} "
                f"ms p99 {row['tpot_p99_ms']:.2f} ms, {row['decode_steps']} decode steps, mean active "
                f"{row['mean_active']:.2f}, decode compilations {row['decode_compilations']}, compilations during the "
                f"replay {row['replay_compilations']}" +
                (f", FAILED requests {row['failed_requests']} ({row.get('first_error')})"
                 if row["failed_requests"] else ""))
            engine = None
            gc.collect()
            if "stopped" in row:
                stopped = f"{name}: replay {row['stopped']} (time limit {limit:.0f} s)"
                skipped = STRATEGIES.value[STRATEGIES.value.index(name) + 1:]
                break
        phase[0] = "writing the report"
        if REPLAY_OUT.value and rows:
            from experiments import paged_report

            meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                        gpu=jax.devices()[0].device_kind, jax=jax.__version__, command=" ".join(sys.argv),
                        **flags_record, **trace_meta,
                        topk_frac=common.TOPK_FRAC.value, min_k=common.MIN_K.value,
                        anchors=recipe_flags.ANCHORS.value,
                        recipe=recipe_flags.RECIPE.value, max_prefill_tokens_per_step=PREFILL_BUDGET.value,
                        time_limit_s=limit)
            if stopped:
                meta["stopped"] = stopped
            payload = dict(meta=meta, rows=rows)
            try:
                say(f"wrote {paged_report.update(REPLAY_OUT.value, 'replay', payload)}")
            except ValueError as e:  # e.g. the file changed during the run: the measurement is kept beside it
                import json
                import os

                path = os.path.join(REPLAY_OUT.value, f"replay_unmerged_{int(time.time())}.json")
                with open(path, "w") as fh:
                    json.dump(payload, fh, indent=1, default=str)
                raise ValueError(f"{e}; this run's rows are in {path}") from None
    if stopped:
        print(f"STOPPED by --replay_time_limit: {stopped}" + (f"; not run: {', '.join(skipped)}" if skipped else ""),
              flush=True)
        return EXIT_STOPPED
    return 0


if __name__ == "__main__":
    cli.run(main)
