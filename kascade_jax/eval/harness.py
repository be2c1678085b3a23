"""Run samples through `models.generate.generate` with one strategy and score every example.

A sample is a task dict (see `kascade_jax.tasks`): `input` (exact prompt text), `answers`, `metric`,
`max_new_tokens`, optional `temperature`/`top_p`/`sample_seed`/`stop`/`first_line`/`all_classes`.

Failure accounting (the official harness silently drops failing queries): an exception in a batch retries each
of its examples alone; an example that still fails becomes an `ExampleResult` with `error` set and score 0. It is
counted in `failures` and in the score (as 0), never dropped.

Batching (one compilation per shape, as little waste as possible): samples are grouped by sampling settings only
(temperature, top_p, seed, stop strings), so tasks with different answer lengths share batches; each row gets its
own generation limit and the decode loop stops once every row has ended. A group is sorted by (answer length,
prompt length) and cut into ceil(n / batch_size) batches of one balanced size, so only the last batch is padded,
by fewer rows than there are batches (copies of its last prompt with a 1-token limit, results discarded). The cache
length is the group's context length rounded up to 64 (every task at that length shares one decode-loop compile).
`run_samples_shared` runs several dense-prefill strategies over the same batches with one prefill per batch.
`run_samples(..., stats=d)` fills `d` with the prompts, padding, batch size, prompts/s, and the first batch's
seconds (it compiles) with the prompts/s of the batches after it (`warm_prompts_per_s`).
"""

from __future__ import annotations

import dataclasses
import time
import traceback

from tqdm.auto import tqdm

from kascade_jax.tasks import metrics
from kascade_jax.tasks import prompt as prompt_lib

CACHE_MULTIPLE = 64


@dataclasses.dataclass
class ExampleResult:
    task: str
    index: int
    context_length: int
    score: float  # in [0, 1]; 0 for a failed example
    prediction: str
    answers: list
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    finish_reason: str = ""
    error: str | None = None  # "ExceptionType: message" for a failed example
    run: int = 0  # sampling run (AIME seeds)

    @property
    def failed(self) -> bool:
        return self.error is not None


def score_prediction(sample: dict, prediction: str) -> float:
    """One example's score in [0, 1] with its task's metric (first line only where the task says so)."""
    if sample.get("first_line"):
        prediction = prediction.lstrip("\n").split("\n")[0]
    return metrics.score(sample["metric"], prediction, list(sample["answers"]), all_classes=sample.get("all_classes"))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _group_key(s: dict):
    return (float(s.get("temperature", 0.0)), float(s.get("top_p", 1.0)), int(s.get("sample_seed", 0)),
            tuple(s.get("stop") or ()))


def _generate(model, tokenizer, prompts, strategy, key, max_len, limits, chunk_size=None, timings=None):
    from models import generate as gen  # noqa: PLC0415  (models is heavy; tasks-only users never import it)

    temperature, top_p, seed, stop = key
    return gen.generate(model, tokenizer, prompts, strategy, max_new_tokens=list(limits), temperature=temperature,
                        top_p=top_p, seed=seed, stop=stop, chat=False, max_len=max_len, chunk_size=chunk_size,
                        timings=timings)


def _generate_shared(model, tokenizer, prompts, strategies, key, max_len, limits, chunk_size=None, timings=None):
    from models import generate as gen  # noqa: PLC0415

    temperature, top_p, seed, stop = key
    return gen.generate_shared_prefill(model, tokenizer, prompts, strategies, max_new_tokens=list(limits),
                                       temperature=temperature, top_p=top_p, seed=seed, stop=stop, chat=False,
                                       max_len=max_len, chunk_size=chunk_size, timings=timings)


def balanced_batch(n: int, batch_size: int) -> int:
    """The batch size that cuts n prompts into ceil(n / batch_size) batches with the least padding."""
    if n <= 0:
        return batch_size
    batches = -(-n // batch_size)
    return -(-n // batches)


def run_samples(model, tokenizer, samples: list[dict], strategy, *, batch_size: int = 1, progress: bool = True,
                desc: str = "", generate_fn=None, prefill_chunk: int | None = None,
                stats: dict | None = None) -> list[ExampleResult]:
    """Generate and score every sample; results come back in the order of `samples`. `prefill_chunk` bounds the
    prefill's working set (None: the generator's default, the whole prompt on GPU). `generate_fn(model, tokenizer,
    prompts, strategy, key, max_len, limits)` replaces the generator (tests)."""
    return run_samples_shared(model, tokenizer, samples, [strategy], batch_size=batch_size, progress=progress,
                              desc=desc, generate_fn=generate_fn, prefill_chunk=prefill_chunk,
                              stats=None if stats is None else [stats])[0]


def run_samples_shared(model, tokenizer, samples: list[dict], strategies, *, batch_size: int = 1,
                       progress: bool = True, desc: str = "", generate_fn=None, prefill_chunk: int | None = None,
                       stats: list[dict] | None = None) -> list[list[ExampleResult]]:
    """`run_samples` for several strategies with a dense prefill (`models.generate.prefill_is_dense`) over the same
    samples: each batch is prefilled once and every strategy decodes from it (`generate_shared_prefill`), so the
    results equal separate `run_samples` calls. One result list per strategy. `stats`: one dict per strategy; the
    shared time (prefill, batching) is split evenly between them and each adds its own decode (`prompts_per_s` of a
    cell is then what it costs inside the group; `shared_prefill` says by how many). A custom `generate_fn` (the
    single-strategy signature) runs the strategies one after the other on each batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    strategies = list(strategies)
    if not strategies:
        raise ValueError("run_samples_shared needs at least one strategy")
    n_st = len(strategies)
    timings = [{} for _ in strategies]  # per strategy: prefill / decode seconds and decode steps (models.generate)
    if generate_fn is None:
        def group_fn(model, tokenizer, prompts, sts, key, max_len, limits, idx):
            if len(sts) == 1:
                return [_generate(model, tokenizer, prompts, sts[0], key, max_len, limits, chunk_size=prefill_chunk,
                                  timings=timings[idx[0]])]
            return _generate_shared(model, tokenizer, prompts, sts, key, max_len, limits, chunk_size=prefill_chunk,
                                    timings=[timings[i] for i in idx])
    else:
        def group_fn(model, tokenizer, prompts, sts, key, max_len, limits, idx):
            return [generate_fn(model, tokenizer, prompts, st, key, max_len, limits) for st in sts]
    t_start = time.perf_counter()
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    ids = prompt_lib.encode_many(tokenizer, (s["input"] for s in samples))
    groups: dict = {}
    for i, s in enumerate(samples):
        groups.setdefault(_group_key(s), []).append(i)
    results: list[list[ExampleResult | None]] = [[None] * len(samples) for _ in strategies]
    padded, sizes, first = 0, set(), None  # first: (prompts, seconds) of the first batch, which compiles
    label = desc or "+".join(getattr(st, "name", "eval") for st in strategies)
    bar = tqdm(total=len(samples), desc=label, disable=not progress, leave=False)
    for key, members in groups.items():
        members.sort(key=lambda i: (int(samples[i]["max_new_tokens"]), len(ids[i])))
        max_len = _round_up(max(len(ids[i]) + int(samples[i]["max_new_tokens"]) for i in members), CACHE_MULTIPLE)
        # One cache length per context length (not per task) lets tasks share the compiled decode loop.
        ctx = max(int(samples[i].get("context_length") or 0) for i in members)
        if ctx >= max_len:
            max_len = _round_up(ctx, CACHE_MULTIPLE)
        if max_pos is not None:
            max_len = min(max_len, max(max_pos, 1))
        size = balanced_batch(len(members), batch_size)
        sizes.add(size)
        for b0 in range(0, len(members), size):
            batch = members[b0:b0 + size]
            padded += size - len(batch)
            t_batch = time.perf_counter()
            per = _run_batch(model, tokenizer, samples, ids, batch, strategies, list(range(n_st)), key, max_len, size,
                             group_fn)
            for n in range(n_st):
                for i, res in zip(batch, per[n]):
                    results[n][i] = res
            if first is None:
                first = (len(batch), time.perf_counter() - t_batch)
            bar.update(len(batch))
    bar.close()
    if stats is not None:
        wall = time.perf_counter() - t_start
        own = [t.get("decode_s", 0.0) for t in timings]
        shared = max(0.0, wall - sum(own)) / n_st
        rest_n, rest_s = (len(samples) - first[0], wall - first[1]) if first else (0, 0.0)
        for n, st in enumerate(stats):
            mine = shared + own[n]  # this strategy's share of the group's wall time
            frac = mine / wall if wall > 0 else 0.0
            st.update(prompts=len(samples), padded_rows=padded, batch_sizes=sorted(sizes), wall_s=round(mine, 3),
                      prompts_per_s=round(len(samples) / mine, 3) if mine > 0 else float("nan"),
                      first_batch_s=round(first[1] * frac, 3) if first else 0.0,
                      warm_prompts_per_s=(round(rest_n / (rest_s * frac), 3) if rest_n and rest_s * frac > 0
                                          else float("nan")),
                      **{k: round(v, 3) for k, v in timings[n].items()})
            if n_st > 1:
                st["shared_prefill"] = n_st
    return results


def _failed(s, ids_i, t0, err) -> ExampleResult:
    return ExampleResult(task=s["task"], index=int(s.get("index", 0)), context_length=int(s.get("context_length", 0)),
                         score=0.0, prediction="", answers=list(s["answers"]), prompt_tokens=len(ids_i), new_tokens=0,
                         wall_s=time.perf_counter() - t0, error=err, run=int(s.get("run", 0)))


def _run_batch(model, tokenizer, samples, ids, batch, strategies, idx, key, max_len, batch_size, group_fn):
    """[per strategy: results of `batch`]. A failing batch retries each example alone; a failing example of a
    group retries each strategy alone, so one strategy's failure never costs another its result."""
    prompts = [ids[i] for i in batch]
    limits = [int(samples[i]["max_new_tokens"]) for i in batch]
    pad = batch_size - len(prompts)  # fixed batch shape: no recompile for the last batch
    prompts, limits = prompts + [prompts[-1]] * pad, limits + [1] * pad
    t0 = time.perf_counter()
    try:
        outs = [o[:len(batch)] for o in group_fn(model, tokenizer, prompts, strategies, key, max_len, limits, idx)]
        if len(outs) != len(strategies) or any(len(o) != len(batch) for o in outs):
            raise RuntimeError(f"generate returned {[len(o) for o in outs]} results for {len(batch)} prompts and "
                               f"{len(strategies)} strategies")
    except Exception:  # noqa: BLE001 - any failure is recorded per example below
        if len(batch) > 1 or batch_size > 1:
            singles = [_run_batch(model, tokenizer, samples, ids, [i], strategies, idx, key, max_len, 1, group_fn)
                       for i in batch]
            return [[r for one in singles for r in one[n]] for n in range(len(strategies))]
        if len(strategies) > 1:
            return [_run_batch(model, tokenizer, samples, ids, batch, [st], [j], key, max_len, 1, group_fn)[0]
                    for st, j in zip(strategies, idx)]
        err = traceback.format_exc(limit=2).strip().splitlines()[-1]
        return [[_failed(samples[batch[0]], ids[batch[0]], t0, err)]]
    wall = (time.perf_counter() - t0) / len(batch) / len(strategies)
    per = []
    for gens in outs:
        out = []
        for i, g in zip(batch, gens):
            s = samples[i]
            try:
                score, err = score_prediction(s, g.text), None
            except Exception as e:  # noqa: BLE001 - a metric failure (e.g. jieba missing) is a failure, not a crash
                score, err = 0.0, f"{type(e).__name__}: {e}"
            out.append(ExampleResult(task=s["task"], index=int(s.get("index", 0)),
                                     context_length=int(s.get("context_length", 0)), score=float(score),
                                     prediction=g.text, answers=list(s["answers"]),
                                     prompt_tokens=int(g.prompt_tokens), new_tokens=int(g.new_tokens), wall_s=wall,
                                     finish_reason=g.finish_reason, error=err, run=int(s.get("run", 0))))
        per.append(out)
    return per
