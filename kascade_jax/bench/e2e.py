"""The end-to-end speed of Kascade inside the model: time to first token and decode ms/step, dense vs Kascade, with
the attention / rest split of every row, on one GPU or a (data, model) mesh; resumable (kascade_jax/bench/store.py).

What is timed is the product's own jitted code, traced inside one outer jit and compiled ahead of time:
- TTFT (batch 1): `models.generate._prefill_chunk` over the whole prompt plus the first greedy `sample`; the KV cache
  is created inside the measured program, so the donated cache never needs a fresh copy per call. Wall clock is the
  mean of the two blocked calls inside the CUPTI measurement.
- Decode step: `models.generate._decode_loop` for N1 and N2 steps (one compilation, the count is traced), the cache
  filled with random K/V inside the program; everything run once per call (the fill included) cancels in
  (t(N2) - t(N1)) / (N2 - N1), per kernel for CUPTI and for the wall clock (min over repeated calls). A step lost in
  noise (t(N2) <= t(N1)) fails with its numbers instead of reporting a negative time.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import json
import os
import sys
import time

from kascade_jax.bench import tables
from kascade_jax.bench.e2e_models import (GB, ModelSpec, build_model, byte_floor_s, check_decode_batches,
                                          device_budget_bytes, device_weight_bytes, kv_bytes_per_token, largest_batch,
                                          make_strategies, mesh_name, mesh_sizes, weight_bytes)
from kascade_jax.bench.store import (STRATEGY_NAMES, add_run, atomic_write, e2e_stem, has_run, load_e2e, mark_skipped,
                                     run_settings, write_outputs)
from kascade_jax.bench.timing import categories, kernel_table, per_step, split, top_kernels, xla_flags_record


def estimate_s(metric: str, layers: int, context: int, batch: int, strategy: str, *, weight_bytes: float,
               kv_per_token: float, calls: int = 10, steps: int = 24) -> float:
    """Crude wall-time prediction of one measurement (compile + runs), only to decide what still fits a deadline:
    ~45 s compile per 32 layers; TTFT from the issue's 8B probe (dense 1.28 s at 32K, ~x^1.59; Kascade 0.98 s,
    ~x^1.35), two runs; decode `calls` calls of `steps` steps at 3.5 TB/s (dense) plus the cache fill."""
    scale = layers / 32
    compile_s = 45 * scale
    x = context / 32768
    if metric == "ttft":
        run = (1.28 * x ** 1.59 if strategy != "kascade" else 0.98 * x ** 1.35) * scale
        return compile_s + 2 * run
    kv = batch * context * kv_per_token
    step = (weight_bytes + (kv if strategy != "kascade" else 0.25 * kv)) / 3.5e12
    fill = kv / 1e12
    return compile_s + calls * (steps * step + fill)


@dataclasses.dataclass
class Prepared:
    """A compiled measurement: the AOT-compiled program, its arguments and how long it took to compile."""

    metric: str
    compiled: object
    args: tuple
    compile_s: float
    steps: tuple[int, int] | None = None


def prepare_ttft(model, strategy, context: int, seed: int) -> Prepared:
    """Compile the TTFT program: `_prefill_chunk` over the whole prompt (cache created inside) + the first sample."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import generate as gen
    from models.cache import KVCache
    from models.sharding import cache_shardings, check_batch, model_mesh

    cfg = model.config
    if model_mesh(model) is not None:
        check_batch(1, model_mesh(model))
    graphdef, params = nnx.split(model)

    mesh = model_mesh(model)

    def run(params, tokens):
        cache = KVCache.init(cfg, 1, context, dtype=model.dtype)
        if mesh is not None:  # the mesh's KV layout ([batch -> data, kv_heads -> model]), as sharding.init_cache
            cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cfg, mesh))
        plens = jnp.full((1,), context, jnp.int32)
        logits, cache, _ = gen._prefill_chunk(graphdef, params, tokens, cache, plens, 0, strategy, True, False)
        return gen.sample(logits, jax.random.key(0), 0.0, 1.0, 0), cache

    tokens = jax.random.randint(jax.random.key(seed), (1, context), 0, cfg.vocab, jnp.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(run).lower(params, tokens).compile()
    return Prepared("ttft", compiled, (params, tokens), time.perf_counter() - t0)


def with_prompt_state(strategy, cache, cfg):
    """The cache with the strategy's cache state as a prefill of its rows would leave it (decode rows start from a
    filled cache, not a prefill): decode_score_fp8's fp8 K copies (`reference.fp8_decode_keys`); a state of any
    other kind is refused by name."""
    import dataclasses as dc

    from kernels_pallas.reference import fp8_decode_keys
    from models.attention import init_cache_state

    state = init_cache_state(strategy, cfg.num_layers, cache.batch, cache.max_len, cfg.kv_heads, cfg.head_dim)
    if state is None:
        return cache
    out = []
    for i, entry in enumerate(state):
        if entry is not None and "k8" not in entry:
            raise ValueError(f"the e2e decode rows build no {strategy.cache_state_lever} state (layer {i}): only "
                             "decode_score_fp8's fp8 K copies")
        out.append(None if entry is None else dict(zip(("k8", "mean", "mult"),
                                                        fp8_decode_keys(cache.k[i], cache.lengths))))
    return dc.replace(cache, strategy_state=tuple(out))


def prepare_decode(model, strategy, context: int, batch: int, steps: tuple[int, int], seed: int) -> Prepared:
    """Compile the decode program: random K/V cache filled inside, then `_decode_loop` for a traced step count."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from models import generate as gen
    from models.cache import KVCache
    from models.sharding import CACHE_SPEC, DATA, model_mesh

    cfg = model.config
    mesh = model_mesh(model)
    if mesh is not None:
        from models.sharding import check_batch

        check_batch(batch, mesh)
    n1, n2 = steps
    if n2 >= context:
        raise ValueError(f"decode context {context} must exceed the step count {n2}")
    graphdef, params = nnx.split(model)
    out_w = -(-n2 // gen.OUT_MULTIPLE) * gen.OUT_MULTIPLE
    start = context - n2  # the last step of the longer call writes row context - 1

    def run(params, seed, n):
        key = jax.random.key(seed)
        shape = (batch, context, cfg.kv_heads, cfg.head_dim)
        kv = [jax.random.normal(jax.random.fold_in(key, i), shape, model.dtype) for i in range(2 * cfg.num_layers)]
        lengths = jnp.full((batch,), start, jnp.int32)
        if mesh is not None:  # each device fills only its block of the cache (partitionable RNG)
            kv = [jax.lax.with_sharding_constraint(x, NamedSharding(mesh, CACHE_SPEC)) for x in kv]
            lengths = jax.lax.with_sharding_constraint(lengths, NamedSharding(mesh, P(DATA)))
        cache = KVCache(k=tuple(kv[0::2]), v=tuple(kv[1::2]), lengths=lengths)
        cache = with_prompt_state(strategy, cache, cfg)
        tok = jax.random.randint(jax.random.fold_in(key, 2 * cfg.num_layers), (batch,), 0, cfg.vocab, jnp.int32)
        carry = (cache, tok, jnp.zeros((batch,), bool), jnp.asarray(0, jnp.int32),
                 jnp.full((batch, out_w), -1, jnp.int32))
        carry = gen._decode_loop(graphdef, params, carry, seed, strategy, n, n, 0.0, 1.0, 0, ())
        return carry[4], carry[3]

    s = jnp.int32(seed)
    t0 = time.perf_counter()
    compiled = jax.jit(run).lower(params, s, jnp.int32(n1)).compile()
    return Prepared("decode_step", compiled, (params, s), time.perf_counter() - t0, steps=(n1, n2))


def measure_ttft(prep: Prepared) -> dict:
    """CUPTI over one call of a prepared TTFT program; wall clock = the mean of the measurement's two blocked calls
    (its warm-up and its profiled call)."""
    from jax.experimental.mosaic.gpu import profiler

    t0 = time.perf_counter()
    _, timings = profiler.measure(prep.compiled, aggregate=False, iterations=1)(*prep.args)
    wall = (time.perf_counter() - t0) / 2
    kernels = kernel_table(timings, 1)
    return dict(wall_s=wall, compile_s=prep.compile_s,
                wall_method="mean of the 2 blocked calls inside the CUPTI measurement",
                top=top_kernels(kernels), categories=categories(kernels), **split(kernels))


def measure_decode(prep: Prepared, iterations: int, wall_repeats: int) -> dict:
    """Per-step decode times from calls of N1 and N2 steps (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import profiler

    n1, n2 = prep.steps
    tables, walls = {}, {}
    for n in (n1, n2):
        out, timings = profiler.measure(prep.compiled, aggregate=False, iterations=iterations)(*prep.args,
                                                                                             jnp.int32(n))
        if int(out[1]) != n:
            raise RuntimeError(f"the decode loop ran {int(out[1])} steps, expected {n}")
        tables[n] = kernel_table(timings, iterations)
    for n in (n1, n2):
        ts = []
        for _ in range(wall_repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(prep.compiled(*prep.args, jnp.int32(n)))
            ts.append(time.perf_counter() - t0)
        walls[n] = min(ts)
    kernels = per_step(tables[n1], tables[n2], n1, n2)
    return dict(wall_s=decode_step_s(walls, kernels, n1, n2), compile_s=prep.compile_s, steps=[n1, n2],
                wall_method=f"(min of {wall_repeats} calls of N2 - of N1) / (N2 - N1)",
                top=top_kernels(kernels), categories=categories(kernels), **split(kernels))


def decode_step_s(walls: dict, kernels: dict, n1: int, n2: int) -> float:
    """Wall seconds per step (t(N2) - t(N1)) / (N2 - N1). When noise exceeds the difference (t(N2) <= t(N1), or no
    positive kernel time per step) this raises a RuntimeError with the numbers: the run is then recorded as failed
    ('<strategy>: RuntimeError: ...' in the row) instead of a negative or zero time; use more steps (--e2e_steps)."""
    step = (walls[n2] - walls[n1]) / (n2 - n1)
    kernel_s = sum(kernels.values())
    if step <= 0 or kernel_s <= 0:
        raise RuntimeError(f"decode per step is not positive: wall t({n2}) = {walls[n2]:.6f} s, t({n1}) = "
                           f"{walls[n1]:.6f} s, per step {step:.3e} s, kernels per step {kernel_s:.3e} s (noise exceeds "
                           f"the N2 - N1 difference: use more steps, --e2e_steps)")
    return step


def prepare_all(jobs: list, threads: int, log=print) -> dict:
    """{job key: Prepared | Exception} for jobs [(key, zero-argument prepare function)], `threads` at a time (XLA
    compiles outside the GIL; autotuning then shares the GPU, so threads > 1 may pick slightly different GEMMs)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job):
        key, fn = job
        try:
            return key, fn()
        except Exception as e:  # reported per job by the caller
            return key, e

    if threads <= 1:
        return dict(one(j) for j in jobs)
    log(f"compiling {len(jobs)} programs on {threads} threads")
    with ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(one, jobs))


def check_strategies(names) -> None:
    """Unknown strategy names are a ValueError naming --e2e_strategies."""
    for s in names:
        if s not in STRATEGY_NAMES:
            raise ValueError(f"--e2e_strategies: unknown strategy {s!r}; choose from {list(STRATEGY_NAMES)}")


def require_gpu():
    import jax

    if jax.default_backend() != "gpu":
        raise ValueError(f"bench --phase=e2e needs a GPU, found backend {jax.default_backend()!r}")


def save(out_dir: str, stem: str, meta: dict, rows: list, with_plot: bool = True, log=print) -> None:
    """<stem>.json (meta + rows), <stem>.md and <stem>.png, each written atomically (a failing plot is logged)."""
    write_outputs(out_dir, stem, dict(meta=meta, rows=rows), tables.e2e_markdown(meta, rows),
                  (lambda path: tables.e2e_plot(rows, path)) if with_plot else None, log=log)


def plan(metrics, contexts, decode_specs):
    """[(metric, context, batch | 'max')] in the order measured: metrics in the order given, rows in flag order."""
    out = []
    for m in metrics:
        if m == "ttft":
            out += [("ttft", int(c), 1) for c in contexts]
        elif m == "decode":
            out += [("decode_step", c, b) for c, b in decode_specs]
        else:
            raise ValueError(f"--e2e_metrics must be ttft and/or decode, got {m!r}")
    return out


def run(specs, *, metrics, contexts, decode_specs, strategies, steps=(8, 40), iterations=2, wall_repeats=2,
        topk_frac=0.1, min_k=128, headroom_gb=10.0, hbm_tbps=4.3, out_dir="benchmarks", tag="", resume=True,
        deadline_s=0.0, compile_threads=1, seed=0, mesh=None, recipe="default", levers=None, log=print):
    """Measure every planned (model, row, strategy) not yet in <out_dir>/<e2e_stem(tag, mesh)>.json with these
    settings (all planned ones without `resume`), on `mesh` (a models.sharding Mesh) or one device (None); returns
    the rows. The file is saved after every measurement; a row that cannot run (too large for the device, beyond
    the model's positions, batch 1 on data > 1) is recorded as skipped with its reason, a failure as a note on its
    row, and no measurement starts that `estimate_s` predicts to end past `deadline_s` (rerun to resume).
    `levers`: KascadeConfig fields set on Kascade on top of the recipe (e.g. decode_score_fp8=True)."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    t_start = time.monotonic()
    mname, (n_data, n_model) = mesh_name(mesh), mesh_sizes(mesh)
    stem = e2e_stem(tag, mname)
    # bad input first, before the GPU is needed
    check_decode_batches(decode_specs, mesh)
    check_strategies(strategies)
    todo = plan(metrics, contexts, decode_specs)
    require_gpu()
    # always the existing file: without resume only the planned (row, strategy) runs are measured again
    meta, rows = load_e2e(out_dir, stem)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = jax.devices()[0].device_kind
    meta["runs"].append(dict(date=date, gpu=gpu, jax=jax.__version__, command=" ".join(sys.argv), **xla_flags_record(),
                             devices=n_data * n_model, mesh=mname, topk_frac=topk_frac, min_k=min_k,
                             steps=list(steps), seed=seed, recipe=recipe, **({"levers": levers} if levers else {})))
    dtype = jnp.bfloat16
    budget = device_budget_bytes(mesh)
    bar = tqdm(total=len(specs) * len(todo) * len(strategies), desc="e2e", mininterval=1.0, disable=None)
    for spec in specs:
        max_ctx = max([c for m, c, _ in todo] or [0])
        try:
            model, notes, kascade_kw, model_max, orig_max = build_model(spec, max_ctx, dtype, seed, log=log,
                                                                        mesh=mesh, recipe=recipe)
            kascade_kw = {**kascade_kw, **(levers or {})}
        except ValueError as e:
            msg = f"{spec.name}: not measured: {e}"
            log(msg)
            if msg not in meta["notes"]:
                meta["notes"].append(msg)
            bar.update(len(todo) * len(strategies))
            continue
        cfg = model.config
        wbytes, kvpt = weight_bytes(model), kv_bytes_per_token(cfg, jnp.dtype(dtype).itemsize)
        wdev = wbytes if mesh is None else device_weight_bytes(cfg, mesh, jnp.dtype(dtype).itemsize)
        shards = n_data * n_model
        log(f"{spec.name}: {wbytes / GB:.2f} GB of weights ({wdev / GB:.2f} GB per device), {kvpt} KV bytes/token, "
            f"device budget {budget / GB:.1f} GB, {mname or 'one device'}")
        strats = make_strategies(strategies, cfg, kascade_kw, topk_frac, min_k)
        settings = {s: run_settings(s, gpu=gpu, jax_version=jax.__version__, topk_frac=topk_frac, min_k=min_k,
                                    steps=steps, seed=seed, kascade_kw=kascade_kw, date=date) for s in strategies}
        jobs = []  # (key, strategy, base row, row notes, predicted seconds) still to measure
        for metric, ctx, b in todo:
            if b == "max":
                b = largest_batch(budget, wdev, ctx * kvpt, headroom_gb * GB, n_data, n_model)
            kv_dev = int(b) * ctx * kvpt / shards  # every device: batch / data sequences, kv_heads / model heads
            base = dict(model=spec.name, metric=metric, context=ctx, batch=int(b), mesh=mname, devices=shards,
                        weight_bytes=wbytes, kv_bytes=int(b) * ctx * kvpt)
            if mesh is not None:
                base["device_weight_bytes"] = wdev
            row_notes = notes if (not spec.random or ctx > orig_max) else []
            if metric == "decode_step":
                base["floor_s"] = byte_floor_s(wdev, kv_dev, hbm_tbps)  # per device: they all read in parallel
            need = wdev + kv_dev + headroom_gb * GB
            reason = None
            if ctx > model_max:
                reason = f"context {ctx} beyond the model's {model_max} max positions"
            elif int(b) % n_data:  # only TTFT's batch 1 (explicit decode batches were checked above)
                reason = f"batch {b} does not split over the mesh's data:{n_data} (use data:1 for TTFT)"
            elif b == 0 or need > budget:
                reason = (f"does not fit {'one device' if mesh is None else 'the devices of ' + mname}: weights "
                          f"{wdev / GB:.1f} GB + KV {kv_dev / GB:.1f} GB + headroom {headroom_gb:.0f} GB > "
                          f"{budget / GB:.1f} GB per device")
            for sname in strategies:
                bar.update(1)
                if metric == "ttft" and sname == "dense_pallas":
                    continue  # prefill never uses the decode kernel
                key = (spec.name, metric, ctx, int(b), mname)
                if reason:
                    mark_skipped(rows, base, reason)
                elif not (resume and has_run(rows, key, sname, settings[sname])):
                    est = estimate_s(metric, cfg.num_layers, ctx, int(b) // shards or 1, sname, weight_bytes=wdev,
                                     kv_per_token=kvpt)
                    jobs.append((key, sname, base, row_notes, est))
        save(out_dir, stem, meta, rows, log=log)

        def prepare(job):
            (_, metric, ctx, b, _), sname = job[0], job[1]
            if metric == "ttft":
                return prepare_ttft(model, strats[sname], ctx, seed)
            return prepare_decode(model, strats[sname], ctx, b, steps, seed)

        prepared = {}
        threads = max(1, compile_threads)
        for i, job in enumerate(jobs):
            if threads > 1 and i % threads == 0:
                # compile the next `threads` jobs together (those the deadline leaves room for), then measure them
                # one by one: compiles (and their GEMM autotuning) never overlap a measurement
                used, batch = time.monotonic() - t_start, []
                for j in jobs[i:i + threads]:
                    used += j[4] / threads
                    if not deadline_s or used <= deadline_s:
                        batch.append(j)
                prepared = prepare_all([((j[0], j[1]), functools.partial(prepare, j)) for j in batch], threads,
                                       log=log)
            key, sname, base, row_notes, est = job
            metric = key[1]
            elapsed = time.monotonic() - t_start
            if (key, sname) in prepared:
                est = max(1.0, est - 45 * cfg.num_layers / 32)  # compiled already
            if deadline_s and elapsed + est > deadline_s:
                log(f"deferred {key} {sname}: predicted {est:.0f} s, {elapsed:.0f} s used of {deadline_s:.0f} s "
                    f"(rerun to resume)")
                prepared.pop((key, sname), None)
                continue
            t0 = time.monotonic()
            try:
                prep = prepared.pop((key, sname), None) or prepare(job)
                if isinstance(prep, Exception):
                    raise prep
                res = measure_ttft(prep) if metric == "ttft" else measure_decode(prep, iterations, wall_repeats)
                del prep
            except Exception as e:  # keep the sweep going; the failure is reported and saved
                msg = f"{type(e).__name__}: {str(e)[:500]}"
                if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
                    msg = "out of memory: " + msg
                log(f"FAILED {key} {sname}: {msg}")
                gc.collect()
                mark_skipped(rows, base, f"{sname}: {msg}")
                save(out_dir, stem, meta, rows, log=log)
                continue
            res["measure_s"] = time.monotonic() - t0
            res["settings"] = settings[sname]
            row = add_run(rows, dict(base, notes=row_notes), sname, res)
            unit, u = (1e3, "ms") if metric == "decode_step" else (1.0, "s")
            log(f"{spec.name} {metric} ctx={key[2]} b={key[3]} {sname}: wall {res['wall_s'] * unit:.3f} {u}, kernels "
                f"{res['kernel_s'] * unit:.3f} (attention {res['attention_s'] * unit:.3f}, rest "
                f"{res['rest_s'] * unit:.3f}), compile {res['compile_s']:.0f} s, took {res['measure_s']:.0f} s"
                + (f"; speedup {row['speedup']:.2f}x" if row.get("speedup") else ""))
            save(out_dir, stem, meta, rows, log=log)
        prepared.clear()
        model = strats = None  # frees the weights before the next model
        gc.collect()
        jax.clear_caches()
    bar.close()
    save(out_dir, stem, meta, rows, log=log)
    log(f"done in {time.monotonic() - t_start:.0f} s; wrote {os.path.join(out_dir, stem)}.json/.md/.png")
    return rows


def profile(spec: ModelSpec, context: int, batch, strategies, *, steps=(8, 40), iterations=2, topk_frac=0.1,
            min_k=128, headroom_gb=10.0, hbm_tbps=4.3, out_dir="benchmarks", seed=0, mesh=None, recipe="default",
            levers=None, log=print) -> dict:
    """Top kernels of one decode step per strategy, printed and saved as e2e_profile_<model>_<ctx>_b<batch>.json."""
    import jax
    import jax.numpy as jnp

    require_gpu()
    mname, (n_data, n_model) = mesh_name(mesh), mesh_sizes(mesh)
    if batch != "max":
        check_decode_batches([(context, batch)], mesh)
    model, notes, kascade_kw, _, _ = build_model(spec, context, jnp.bfloat16, seed, log=log, mesh=mesh, recipe=recipe)
    kascade_kw = {**kascade_kw, **(levers or {})}
    cfg = model.config
    wbytes, kvpt = weight_bytes(model), kv_bytes_per_token(cfg)
    wdev = wbytes if mesh is None else device_weight_bytes(cfg, mesh)
    if batch == "max":
        batch = largest_batch(device_budget_bytes(mesh), wdev, context * kvpt, headroom_gb * GB, n_data, n_model)
    floor = byte_floor_s(wdev, batch * context * kvpt / (n_data * n_model), hbm_tbps)
    log(f"{spec.name} decode ctx={context} b={batch}: byte floor {1e3 * floor:.2f} ms (weights {wbytes / GB:.2f} GB, "
        f"KV {batch * context * kvpt / GB:.2f} GB at {hbm_tbps} TB/s)")
    result = dict(model=spec.name, context=context, batch=batch, mesh=mname, devices=n_data * n_model, floor_s=floor,
                  notes=notes, strategies={},
                  gpu=jax.devices()[0].device_kind, jax=jax.__version__)
    for sname, strategy in make_strategies(strategies, cfg, kascade_kw, topk_frac, min_k).items():
        res = measure_decode(prepare_decode(model, strategy, context, batch, steps, seed), iterations, 1)
        result["strategies"][sname] = res
        log(f"\n{sname}: wall {1e3 * res['wall_s']:.3f} ms/step, kernels {1e3 * res['kernel_s']:.3f} "
            f"(attention {1e3 * res['attention_s']:.3f}, rest {1e3 * res['rest_s']:.3f}); by category: "
            + ", ".join(f"{c} {1e3 * t:.3f}" for c, t in sorted(res["categories"].items(), key=lambda kv: -kv[1])))
        for name, t, cat in res["top"]:
            log(f"  {1e3 * t:8.4f} ms  {cat:11s} {name[:110]}")
    os.makedirs(out_dir, exist_ok=True)
    suffix = "" if mname is None else "_" + e2e_stem("", mname)[len("e2e_"):]
    path = os.path.join(out_dir, f"e2e_profile_{spec.name}_{context}_b{batch}{suffix}.json")
    atomic_write(path, json.dumps(result, indent=1))
    log(f"wrote {path}")
    return result
