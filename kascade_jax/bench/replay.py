"""The serving replay's machinery: random models in real shapes, a Poisson trace of ragged requests,
and the wall-clock replay of a trace through the continuous-batching engine (`models.engine`) with its metrics.

`experiments.serve_replay` is the front end (flags, strategies, the report). Kept apart so that it is importable
without any entry point's flags. Deliberately not here: building strategies (the entry points' shared flags do).

Watching a long run (a replay that stalls or overruns a GPU lease must say where it is, and stop):
`Compiles` counts the XLA programs built while it is entered (jax.monitoring's backend-compile events, by phase:
"warm-up", "replay"), so a row records how many compiled before and during the timed replay (after the warm-up:
none); `replay` and `warm_up` log their progress and stop at a `deadline` (`TimeLimit`, a row marked `stopped`);
`Watchdog` is a thread that prints a status line whenever the log has been quiet for a while (the main thread may
sit in one compilation or device call for minutes; both release the GIL) and ends the process past a hard
deadline, which nothing in the main thread could enforce.
"""

from __future__ import annotations

import os
import threading
import time

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per XLA program built (or loaded from the cache)
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # the lowering just before that compile


class TimeLimit(Exception):
    """The run's deadline passed (between two warm-up buckets): nothing of this strategy is measured."""


class Compiles:
    """Counts the XLA programs built while entered (`with Compiles() as c:`), each under the current `phase`:
    `events` [(name, seconds, phase)]. `compiling()` names the program whose compilation is under way (lowered, not
    yet compiled) and for how long, for a status line. `on_compile(name, seconds, phase)` is called after each."""

    def __init__(self, on_compile=None, clock=time.perf_counter):
        self.events: list[tuple[str, float, str]] = []
        self.phase = ""
        self.on_compile = on_compile
        self._clock = clock
        self._lowered: tuple[str, float] | None = None

    def _listen(self, event, duration_secs, **kwargs):
        name = str(kwargs.get("fun_name", "?"))
        if event == LOWER_EVENT:
            self._lowered = (name, self._clock())
        elif event == COMPILE_EVENT:
            self._lowered = None
            self.events.append((name, float(duration_secs), self.phase))
            if self.on_compile is not None:
                self.on_compile(name, float(duration_secs), self.phase)

    def __enter__(self):
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        import jax

        jax.monitoring.unregister_event_duration_listener(self._listen)

    def count(self, phase: str | None = None) -> int:
        return sum(phase is None or p == phase for _, _, p in self.events)

    def seconds(self, phase: str | None = None) -> float:
        return sum(s for _, s, p in self.events if phase is None or p == phase)

    def compiling(self) -> str | None:
        if self._lowered is None:
            return None
        name, t = self._lowered
        return f"compiling {name} for {self._clock() - t:.0f} s"


class Watchdog:
    """A daemon thread for a long run: whenever `every` seconds pass without `touch()` (the run's log calls it on
    each line), it logs `status()`; once `hard_deadline` (on `clock`) passes it logs why and calls `exit(code)`
    (default `os._exit`: a compilation or device call that never returns cannot be interrupted otherwise, and a
    plan's next job must get the machine). Use as a context manager."""

    def __init__(self, status, every: float, *, hard_deadline: float | None = None, log=print, code: int = 3,
                 clock=time.perf_counter, exit=os._exit):
        self.status, self.every, self.hard_deadline, self.log, self.code = status, every, hard_deadline, log, code
        self._clock, self._exit = clock, exit
        self._last = clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replay-watchdog", daemon=True)

    def touch(self) -> None:
        self._last = self._clock()

    def _run(self) -> None:
        while not self._stop.wait(min(self.every, 1.0)):
            now = self._clock()
            if self.hard_deadline is not None and now >= self.hard_deadline:
                self.log(f"TIME LIMIT: still busy {now - self.hard_deadline:.0f} s past the hard deadline "
                         f"({self.status()}); ending the process with status {self.code}")
                self._exit(self.code)
                return
            if now - self._last >= self.every:
                self.log(f"  [watchdog] {self.status()}")
                self._last = now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

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


def row_label(name: str, strategy) -> str:
    """The replay row's strategy name: kascade with the fp8 K copy (--decode_score_fp8, or a recipe with it) is
    kascade_fp8d, so that both rows of one trace stay side by side in paged.json."""
    return name + "_fp8d" if getattr(getattr(strategy, "config", None), "decode_score_fp8", False) else name


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


def replay(engine, trace, *, clock=time.perf_counter, log=print, progress_s: float | None = 30.0,
           deadline: float | None = None, compiles: Compiles | None = None):
    """Run the trace in wall-clock time. Returns the metrics row (without the strategy name).

    A request that never produced a token (its prefill raised; the engine releases it and stays consistent) is
    counted in `failed_requests`, with the first error in `first_error`, and left out of the token metrics; it is
    never dropped silently. An engine step that keeps raising (more errors than requests) is re-raised.

    Progress: a line to `log` every `progress_s` seconds (None: none). `deadline` (a `clock` time): the replay stops
    at the first step boundary past it; the row then carries `stopped` (why, and what was left: requests running,
    queued, not yet arrived) and its metrics cover what was generated until then. `compiles`: the row gets
    `replay_compilations`, the programs built during the replay (after a complete warm-up: 0)."""
    from models.engine import SamplingParams

    pending = list(trace)
    handles, active_sum, steps, errors = [], 0, 0, []
    stopped = None
    t0 = clock()
    last_progress = t0
    if compiles is not None:
        compiles.phase = "replay"
    while pending or not engine.idle:
        now = clock() - t0
        if deadline is not None and t0 + now >= deadline:
            stopped = (f"stopped at the deadline after {now:.1f} s: {sum(h.finished for h in handles)} of "
                       f"{len(trace)} requests finished, {engine.active} running, {engine.queued} queued, "
                       f"{len(pending)} not yet arrived")
            log(f"  replay {stopped}")
            break
        if progress_s is not None and t0 + now - last_progress >= progress_s:
            last_progress = t0 + now
            log(f"  replay {now:.0f} s: {len(handles)}/{len(trace)} arrived, {sum(h.finished for h in handles)} "
                f"finished, {engine.active} running ({engine.prefilling} prefilling), {engine.queued} queued; "
                f"{sum(h.new_tokens for h in handles)} tokens, {engine.decode_steps} decode steps" +
                (f", {compiles.count('replay')} compilations" if compiles is not None else ""))
        while pending and pending[0][0] <= now:
            arr, ids, new = pending.pop(0)
            handles.append(engine.submit(ids, SamplingParams(max_new_tokens=new, ignore_eos=True), arrival=t0 + arr))
        if engine.idle:
            wait = pending[0][0] - (clock() - t0)
            if deadline is not None:
                wait = min(wait, deadline - clock())
            time.sleep(max(0.0, min(wait, progress_s or wait)))
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
    failed = sum(h.finished and not h.token_times for h in handles)
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
    if compiles is not None:
        row["replay_compilations"] = compiles.count("replay")
    if errors:
        row["first_error"] = errors[0]
    if stopped:
        row["stopped"] = stopped
    return row


def warm_up(engine, min_prompt, max_prompt, vocab, *, log=None, deadline=None, clock=time.perf_counter,
            compiles: Compiles | None = None):
    """Build every program the replay of prompts in [min_prompt, max_prompt] runs, before it is timed: one 2-token
    request per power-of-two prompt bucket (the engine pads prompts to these widths, and the bucket's full-length
    request runs every prefill chunk shape of that width, at position 0 and after it, the decode step and the
    sampling of the first token), then `models.paged.zero_pages` at every padded size a decode step can hand out
    (up to max_batch new pages in one step). `log` gets a line before and after each bucket (with its time and
    compilations), so a long compilation shows where it is. Raises `TimeLimit` if `deadline` (a `clock` time)
    passes before a bucket."""
    from models.engine import SamplingParams, _prefill_width
    from models.paged import warm_zero_pages

    say = log if log is not None else (lambda _msg: None)
    if compiles is not None:
        compiles.phase = "warm-up"
    widths = sorted({_prefill_width(n, engine.max_len) for n in (min_prompt, max_prompt)} |
                    {w for w in (1 << i for i in range(6, 20)) if min_prompt < w < max_prompt})
    for w in widths:
        n = min(w, max_prompt)
        if deadline is not None and clock() >= deadline:
            raise TimeLimit(f"the deadline passed during the warm-up, before the prompt-{n} bucket")
        t, c = time.perf_counter(), compiles.count() if compiles is not None else 0
        say(f"  warm-up prompt {n} ...")
        engine.submit([i % vocab for i in range(n)], SamplingParams(max_new_tokens=2, ignore_eos=True))
        engine.run()
        say(f"  warm-up prompt {n}: {time.perf_counter() - t:.1f} s" +
            (f", {compiles.count() - c} compilations" if compiles is not None else ""))
    # a decode step zeroes the new pages of every slot that crossed a page boundary at once
    engine.cache = warm_zero_pages(engine.cache, engine.max_batch)
