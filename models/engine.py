"""Continuous batching over a paged KV cache: a request queue, fixed slots, one compiled decode step.

    engine = Engine(model, tokenizer, strategy, max_batch=8, page_size=64, num_pages=4096)
    h = engine.submit("Summarise: ...", SamplingParams(max_new_tokens=128))
    for tok in h:            # streams: drives engine.step() until this request is done
        ...
    engine.run()             # or: step until every submitted request has finished

Design:
- `max_batch` slots share one `PagedKVCache` (models/paged.py). A free slot's page-table row is all -1, so it rides
  along in the batched decode step: its writes are dropped, its output is discarded (the active mask).
- `step()` first admits queued requests (FIFO) while a slot is free and the free list can cover the request's worst
  case, `pages_for(prompt + max_new_tokens)`, minus what running requests still have reserved. The reservation is a
  count only: pages are taken from the free list as the sequence grows (the prompt's pages at admission, one more
  page whenever decode crosses a page boundary), so a running sequence never runs out, and a request that does not
  fit now waits in the queue (one that could never fit is refused at `submit`). Each admitted request is prefilled
  alone into its slot's pages (`models.generate.prefill`'s chunks on the pools seen through that slot's page-table row;
  prompts are padded to a power of two >= 64 tokens so a trace of ragged prompts compiles a handful of shapes), and
  its first token is sampled from the prefill logits (time to first token). Then one decode step runs over all
  `max_batch` slots. The step is one jitted function of fixed shapes (tokens [max_batch], the page table, lengths,
  the active mask, per-slot temperature/seed/step), so requests join and leave without recompiling
  (`Engine.decode_compilations`).
- A request leaves on EOS (unless `ignore_eos`) or after `max_new_tokens`; its pages go back to the free list and
  its slot's row to -1.
- Strategy state: Kascade's anchor indices are recomputed by every anchor layer in every decode step and threaded
  only through the layers of that step (`state` is None at the start of every forward). A strategy's cache state
  (models.attention.init_cache_state with pages=..., e.g. decode_score_fp8's fp8 K copy) lives in the cache: its
  page pools beside K and V, its per-sequence entries one row per slot; a prefill runs on the slot's view
  (`PagedKVCache.slot_view`) and writes that row back (`merge_slot`), and re-makes it from the prompt, so a reused
  slot starts clean. Otherwise the per-slot data are the cache pages and the page-table row.
  On release the row is reset to -1 and the pages go back to the free list as they are; every page is zeroed
  when it is handed out (`models.paged.zero_pages`: the prompt's pages at admission, a decode step's new pages in
  one call before the step), because the paged kernels read a sequence's rows past its kv_len unmasked, so even a
  stale inf/NaN cannot leak (tested: a request in a reused slot gives the same tokens as alone, also when its
  pages were poisoned with NaN after the previous owner left).
- Errors: a request whose admission (prefill) raises is finished with finish_reason "error", its slot and pages
  given back, the exception kept on the handle (`error`, re-raised by `result()` and iteration) and re-raised by
  `step()`. A failing decode step does the same for every active request. The engine then stays usable when the
  failure came before the pools were donated (a trace-time refusal, the usual case: prefill traces every chunk's
  program before the first runs); if a compiled program failed after taking the donated pools, the engine is
  marked unusable and every later `submit` / `step` raises a RuntimeError naming the original error. Iterating
  an unfinished handle of an idle engine (never queued on it) raises a RuntimeError instead of spinning.
- Construction refuses a strategy without `supports_paged` or with a cache state that has no paged form
  (`paged_cache_state_lever`, e.g. decode_prefill_keys), a model
  placed on a mesh, a chunk_size that is not a positive multiple of 64, and a max_len that is not a whole number of
  pages (max_len=None: the model's context, rounded down to whole pages).

Tokens follow `models.generate.generate`'s rules (greedy is bit-for-bit the same rule; temperature sampling uses one
key per slot and step, so it is reproducible per request but not the same stream as `generate`'s batched draw).
top-p / top-k filter each slot's logits with its own values, as `generate.sample` does for a batch; the decode step
has two compiled forms, without and with the filter (its sort over the vocabulary), chosen per step by whether an
active slot filters. Stop strings end a request once its decoded text contains one (finish_reason "stop"; `text`
is cut before it, `tokens` keep what was streamed).
Chunked prefill between decode steps (`max_prefill_tokens_per_step=B`): an admitted request's prefill runs in the
chunks of `models.generate.prefill_plan` (width `chunk_size`, else B), at most B prompt tokens a step (at least
one chunk), FIFO, with one decode step of the running requests after them, so a 64K admission does not stall
every running request for its whole prefill. A prefilling slot sits out the decode step (its page-table row is
hidden, so the step cannot write into its pages). The chunks are the ones `prefill` runs, so the tokens are the
same; B=None (default) prefills each admission whole.
Not here: preemption or swapping, prefix sharing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import check_no_cache_state, check_supports_paged, init_cache_state
from models.generate import (CHUNK_MULTIPLE, _check_pages as check_pages, _check_room as check_room,
                             _first_stop, _meta, check_sampling, prefill_chunk,
                             prefill_plan, trace_prefill_chunks)
from models.paged import PageAllocator, PagedKVCache, check_page_size, pages_for, zero_pages

_FIRST_STEP = 1 << 30  # sampling-key step index of the token sampled from the prefill logits (as generate)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)
    top_p: float = 1.0  # nucleus sampling (1 = off); with temperature > 0
    top_k: int = 0  # keep the k most likely tokens (0 = off); with temperature > 0
    stop: tuple[str, ...] = ()  # end the request once its text contains one of these

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 31:
            raise ValueError(f"seed must be an int in [0, 2**31), got {self.seed!r}")
        check_sampling(self.temperature, self.top_p, self.top_k)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(x, str) or not x for x in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def filters(self) -> bool:
        """Whether sampling filters the logits (top-p / top-k with temperature > 0)."""
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0)


class RequestHandle:
    """One submitted request. Iterate it to stream its tokens (EOS excluded); `result()` waits for all of them."""

    def __init__(self, engine: "Engine", rid: int, prompt_ids: list[int], params: SamplingParams,
                 on_token: Callable[[int], None] | None, arrival: float):
        self.id = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokens: list[int] = []  # generated token ids, EOS excluded
        self.new_tokens = 0  # generated tokens, counting the EOS if one was emitted
        self.finished = False
        self.finish_reason: str | None = None  # "eos" | "length" | "stop" | "error"
        self.error: BaseException | None = None  # the exception that ended it (finish_reason "error")
        self.slot: int | None = None
        self.arrival = arrival
        self.token_times: list[float] = []  # perf_counter time of every generated token (EOS included)
        self.finish_time: float | None = None
        self._engine = engine
        self._on_token = on_token
        self._pages: list[int] = []
        self._reserve = 0  # pages still reserved for this request's growth
        self._plan: list[tuple[int, int]] = []  # prefill chunks not yet run; [] once decoding
        self._toks: np.ndarray | None = None  # the padded prompt [1, width] while prefilling

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def text(self) -> str:
        """The generated text; with finish_reason "stop", cut before the stop string."""
        text = self._engine.tokenizer.decode(self.tokens)
        cut = _first_stop(text, self.params.stop)
        return text if cut is None else text[:cut]

    def __iter__(self) -> Iterator[int]:
        i = 0
        while True:
            while i < len(self.tokens):
                yield self.tokens[i]
                i += 1
            if self.error is not None:
                raise self.error
            if self.finished:
                return
            if self._engine.idle:
                raise RuntimeError(f"request {self.id} is unfinished but its engine is idle (nothing queued or "
                                   "running): it can never finish")
            self._engine.step()

    def result(self) -> list[int]:
        for _ in self:
            pass
        return self.tokens

    def _fail(self, err: BaseException) -> None:
        self.finished, self.finish_reason, self.error = True, "error", err

    def _emit(self, tok: int, now: float, eos: tuple[int, ...]) -> None:
        self.new_tokens += 1
        self.token_times.append(now)
        if tok in eos and not self.params.ignore_eos:
            self.finished, self.finish_reason = True, "eos"
            return
        self.tokens.append(tok)
        if self._on_token is not None:
            self._on_token(tok)
        if self.params.stop and _first_stop(self._engine.tokenizer.decode(self.tokens), self.params.stop) is not None:
            self.finished, self.finish_reason = True, "stop"
        elif self.new_tokens >= self.params.max_new_tokens:
            self.finished, self.finish_reason = True, "length"


def _filter_slots(scaled, top_ps, top_ks):
    """Temperature-scaled logits [batch, vocab] with each row's top-k then top-p filter (-inf outside), as
    `generate.sample` filters a batch with one (top_p, top_k): ties with the k-th value stay, and the nucleus is
    taken over the top-k survivors."""
    vocab = scaled.shape[-1]
    srt = jnp.sort(scaled, axis=-1)[:, ::-1]
    kth = jnp.take_along_axis(srt, jnp.clip(top_ks - 1, 0, vocab - 1)[:, None], axis=1)
    scaled = jnp.where((top_ks[:, None] > 0) & (scaled < kth), -jnp.inf, scaled)
    srt = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(srt, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_ps[:, None]
    cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_ps[:, None] < 1.0) & (scaled < cutoff), -jnp.inf, scaled)


def _sample_slots(logits, temps, seeds, steps, top_ps=None, top_ks=None):
    """logits [batch, vocab] -> tokens [batch]: greedy where temps == 0, else one categorical draw per slot (after
    its top-p / top-k filter when those are given)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)
    scaled = logits / jnp.where(temps > 0, temps, 1.0)[:, None]
    if top_ps is not None:
        scaled = _filter_slots(scaled, top_ps, top_ks)
    drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, scaled).astype(jnp.int32)
    return jnp.where(temps > 0, drawn, greedy)


def _decode_step(graphdef, strategy, params, cache: PagedKVCache, tokens, active, temps, seeds, steps, top_ps=None,
                 top_ks=None):
    """One decode step over every slot: tokens [max_batch] at each slot's length -> (next tokens, cache)."""
    model = nnx.merge(graphdef, params)
    q_start = cache.lengths
    kv_len = q_start + 1
    meta = _meta("decode", None, q_start, kv_len, kv_len, jnp.where(active, kv_len, q_start))
    logits, cache, _ = model(tokens[:, None], cache, strategy, meta, last_only=jnp.zeros_like(q_start))
    return _sample_slots(logits, temps, seeds, steps, top_ps, top_ks), cache


_sample_one = jax.jit(_sample_slots)


def _prefill_width(n: int, max_len: int) -> int:
    """Prompt padding: the next power of two >= max(n, 64), capped at max_len (few prefill compilations)."""
    return min(max(64, 1 << (n - 1).bit_length()), max_len)


class Engine:
    def __init__(self, model, tokenizer, strategy, *, max_batch: int = 8, page_size: int = 64,
                 num_pages: int | None = None, max_len: int | None = None, chunk_size: int | None = None,
                 chat: bool = False, clock: Callable[[], float] = time.perf_counter,
                 max_prefill_tokens_per_step: int | None = None):
        cfg = model.config
        page_size = check_page_size(page_size)
        if getattr(model, "mesh", None) is not None:
            raise ValueError("the engine runs on one device: a paged KV cache on a device mesh is not supported "
                             "(this model was placed by models.sharding.shard_model); use generate() with --mesh")
        check_supports_paged(strategy)
        check_no_cache_state(strategy, "the engine", paged=True)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size <= 0 or chunk_size % CHUNK_MULTIPLE):
            raise ValueError(f"chunk_size must be a positive multiple of {CHUNK_MULTIPLE}, got {chunk_size!r}")
        budget = max_prefill_tokens_per_step
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0
                                   or budget % CHUNK_MULTIPLE):
            raise ValueError(f"max_prefill_tokens_per_step must be a positive multiple of {CHUNK_MULTIPLE}, "
                             f"got {budget!r}")
        if budget is not None and chunk_size is not None and chunk_size > budget:
            raise ValueError(f"chunk_size ({chunk_size}) must not exceed max_prefill_tokens_per_step ({budget}): a "
                             "step runs whole chunks")
        if max_len is None:  # the model's context, in whole pages (rounded down)
            max_len = max(page_size, cfg.max_position_embeddings // page_size * page_size)
        if (isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer))
                or not 1 <= max_len <= cfg.max_position_embeddings):
            raise ValueError(f"max_len must be an int in [1, {cfg.max_position_embeddings}] (the model's maximum "
                             f"context), got {max_len!r}")
        if max_len % page_size:
            raise ValueError(f"max_len ({max_len}) must be a multiple of page_size ({page_size}), e.g. "
                             f"{max(page_size, max_len // page_size * page_size)}")
        if num_pages is None:
            num_pages = max_batch * (max_len // page_size)
        self.model, self.tokenizer, self.strategy = model, tokenizer, strategy
        self.max_batch, self.page_size, self.chunk_size, self.chat = max_batch, page_size, chunk_size, chat
        self.max_prefill_tokens_per_step = budget
        self.cache = PagedKVCache.init(cfg, max_batch, num_pages, page_size, max_len, dtype=model.dtype)
        cstate = init_cache_state(strategy, cfg.num_layers, max_batch, self.cache.max_len, cfg.kv_heads,
                                  cfg.head_dim, pages=(num_pages, page_size))
        if cstate is not None:  # per slot entries and page pools (models/paged.py), re-made by each prefill
            self.cache = dataclasses.replace(self.cache, strategy_state=cstate)
        self.max_len = self.cache.max_len
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages)
        self._table = np.full((max_batch, self.cache.max_pages), -1, np.int32)
        self._lengths = np.zeros(max_batch, np.int32)
        self._next = np.zeros(max_batch, np.int32)  # the token each slot feeds at the next decode step
        self._slots: list[RequestHandle | None] = [None] * max_batch
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._reserved = 0
        self._ids = 0
        self._clock = clock
        tok_eos = getattr(tokenizer, "eos_token_ids", None)
        self.eos = tuple(sorted(set(cfg.eos_token_ids if tok_eos is None else tok_eos)))
        self._graphdef, self._params = nnx.split(model)
        self._traced_widths: set[int] = set()  # later-chunk widths whose prefill program traced without refusal
        # One jit object per engine, so its compilation count is this engine's (donates the cache).
        self._decode = jax.jit(functools.partial(_decode_step, self._graphdef, strategy), donate_argnums=(1,))
        self.decode_steps = 0
        self._broken: BaseException | None = None  # set when a failure consumed the donated pools

    # public API ---------------------------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, *, on_token: Callable[[int], None] | None = None,
               arrival: float | None = None) -> RequestHandle:
        """Queue a request (a string, or token ids used as they are). Refuses one that could never fit."""
        self._check_usable()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            ids = (self.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if self.chat
                   else self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        vocab = self.model.config.vocab
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}), got min {min(ids)} max {max(ids)}")
        if params.top_k > vocab:
            raise ValueError(f"top_k={params.top_k} is larger than the vocabulary ({vocab} tokens)")
        window = self.model.config.max_position_embeddings
        if len(ids) >= window:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's context window of {window} "
                             "tokens (with room for one generated token)")
        need = len(ids) + params.max_new_tokens
        if need > self.max_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {need} exceeds "
                             f"the engine's max_len {self.max_len}")
        pages = pages_for(need, self.page_size)
        if pages > self.num_pages:
            raise ValueError(f"request needs {pages} pages of {self.page_size} tokens, more than the whole pool "
                             f"(num_pages={self.num_pages}); it could never run")
        h = RequestHandle(self, self._ids, ids, params, on_token, self._clock() if arrival is None else arrival)
        self._ids += 1
        self._queue.append(h)
        return h

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def prefilling(self) -> int:
        """Admitted requests whose prefill has chunks left (they join decode after their last chunk)."""
        return sum(s is not None and bool(s._plan) for s in self._slots)

    @property
    def idle(self) -> bool:
        return not self._queue and not self.active

    @property
    def decode_compilations(self) -> int:
        return self._decode._cache_size()

    def step(self) -> list[tuple[RequestHandle, int]]:
        """Admit what fits, run prefill chunks (all of each admission's, or up to max_prefill_tokens_per_step; a
        finished prefill samples its first token), then one decode step over the decoding slots.
        Returns the (request, token) pairs generated in this step (EOS included)."""
        self._check_usable()
        events: list[tuple[RequestHandle, int]] = []
        self._admit(events)
        self._prefill_work(events)
        if any(h is not None and not h._plan for h in self._slots):
            self._decode_all(events)
        return events

    def run(self) -> None:
        while not self.idle:
            self.step()

    # internals ----------------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"this engine is unusable: a failed step consumed its donated KV pools "
                               f"({type(self._broken).__name__}: {self._broken}); build a new Engine")

    def _after_failure(self, err: BaseException) -> None:
        """Mark the engine unusable if the failed call had already taken (donated) the pools."""
        if any(x.is_deleted() for x in self.cache.k + self.cache.v):
            self._broken = err
            for h in self._queue:
                h._fail(err)
            self._queue.clear()
            for b, h in enumerate(self._slots):  # e.g. requests still prefilling: their pages are gone too
                if h is not None:
                    h._fail(err)
                    self._release(b)

    def _admit(self, events) -> None:
        while self._queue and None in self._slots:
            h = self._queue[0]
            need = pages_for(len(h.prompt_ids) + h.params.max_new_tokens, self.page_size)
            if need > self.allocator.free - self._reserved:
                return  # waits (FIFO) until running requests give pages back
            self._queue.popleft()
            slot = self._slots.index(None)
            plen = len(h.prompt_ids)
            n = pages_for(plen, self.page_size)
            h._pages = self.allocator.allocate(n)
            h._reserve = need - n
            self._reserved += h._reserve
            h.slot = slot
            self._slots[slot] = h
            self._table[slot] = -1
            self._table[slot, :n] = h._pages
            width = _prefill_width(plen, self.max_len)
            h._toks = np.zeros((1, width), np.int32)
            h._toks[0, :plen] = h.prompt_ids
            # prefill's chunks of the padded width (few compiled shapes), less those of padding only: the last one
            # left holds the last prompt token and gives the logits of the first token
            h._plan = [(o, w) for o, w in prefill_plan(width, self.max_len,
                                                       self.chunk_size or self.max_prefill_tokens_per_step) if o < plen]
            view = self.cache.slot_view(slot, self._table[slot], 0)
            try:  # trace-time refusals of a later chunk surface now, before any pool is donated
                check_room(view, plen, "the prompt", self.model.config.max_position_embeddings)
                check_pages(view, np.array([plen]), "prefill")
                # each later chunk width once per engine (its program is the same for every request)
                later = [c for c in h._plan[1:] if c[1] not in self._traced_widths]
                if later:
                    trace_prefill_chunks(self.model, 1, h._plan[:1] + later, view, np.array([plen], np.int32),
                                         self.strategy)
                    self._traced_widths.update(w for _, w in later)
                self.cache = zero_pages(self.cache, h._pages)  # after the refusals: the first call to donate
            except Exception as err:
                h._fail(err)
                self._release(slot)
                self._after_failure(err)
                raise
            if self.max_prefill_tokens_per_step is None:  # the whole prefill now, as one admission
                while h._plan:
                    self._prefill_chunk(slot, events)

    def _prefill_work(self, events) -> None:
        """Chunks of the prefilling requests (FIFO by admission), at most max_prefill_tokens_per_step tokens."""
        budget, spent = self.max_prefill_tokens_per_step, 0
        if budget is None:
            return
        for slot in sorted((b for b, h in enumerate(self._slots) if h is not None and h._plan),
                           key=lambda b: self._slots[b].id):
            h = self._slots[slot]
            while h._plan and (spent == 0 or spent + h._plan[0][1] <= budget):
                spent += h._plan[0][1]
                self._prefill_chunk(slot, events)
            if spent >= budget:
                return

    def _prefill_chunk(self, slot: int, events) -> None:
        """Run the next prefill chunk of the request in `slot`; after its last, sample the first token."""
        h = self._slots[slot]
        offset, width = h._plan[0]
        plen = len(h.prompt_ids)
        view = self.cache.slot_view(slot, self._table[slot], 0)
        try:
            logits, view = prefill_chunk(self.model, h._toks[:, offset:offset + width], np.array([plen], np.int32),
                                         view, self.strategy, offset, split=(self._graphdef, self._params))
        except Exception as err:  # e.g. a kernel bundle without paged decode: leave the engine consistent
            h._fail(err)
            self._release(slot)
            self._after_failure(err)
            raise
        self.cache = self.cache.merge_slot(slot, view)
        h._plan = h._plan[1:]
        if h._plan:
            return
        h._toks = None
        p = h.params
        filt = (jnp.asarray([p.top_p], jnp.float32), jnp.asarray([p.top_k], jnp.int32)) if p.filters else ()
        tok = int(_sample_one(logits, jnp.asarray([p.temperature], jnp.float32), jnp.asarray([p.seed], jnp.int32),
                              jnp.asarray([_FIRST_STEP], jnp.int32), *filt)[0])
        self._lengths[slot] = plen
        self._next[slot] = tok
        h._emit(tok, self._clock(), self.eos)
        events.append((h, tok))
        if h.finished:
            self._release(slot)

    def _grow(self, slot: int) -> list[int]:
        """The page of the slot's next position, allocated if missing -> [the new page] (to be zeroed) or []."""
        pos = int(self._lengths[slot])
        j = pos // self.page_size
        if self._table[slot, j] >= 0:
            return []
        h = self._slots[slot]
        page = self.allocator.allocate(1)[0]  # covered by the request's reservation
        h._pages.append(page)
        h._reserve -= 1
        self._reserved -= 1
        self._table[slot, j] = page
        return [page]

    def _decode_all(self, events) -> None:
        active = np.array([s is not None and not s._plan for s in self._slots])
        temps = np.zeros(self.max_batch, np.float32)
        seeds = np.zeros(self.max_batch, np.int32)
        steps = np.zeros(self.max_batch, np.int32)
        top_ps = np.ones(self.max_batch, np.float32)
        top_ks = np.zeros(self.max_batch, np.int32)
        new_pages = []
        for b, h in enumerate(self._slots):
            if h is not None and not h._plan:
                new_pages += self._grow(b)
                temps[b], seeds[b], steps[b] = h.params.temperature, h.params.seed, h.new_tokens - 1
                if h.params.filters:
                    top_ps[b], top_ks[b] = h.params.top_p, h.params.top_k
        filt = (jnp.asarray(top_ps), jnp.asarray(top_ks)) if (top_ps < 1).any() or (top_ks > 0).any() else ()
        table = np.where(active[:, None], self._table, -1)  # a prefilling slot's pages stay out of the step
        try:
            self.cache = zero_pages(self.cache, new_pages)
            cache = self.cache.with_table(table, np.where(active, self._lengths, 0))
            nxt, cache = self._decode(self._params, cache, jnp.asarray(self._next), jnp.asarray(active),
                                      jnp.asarray(temps), jnp.asarray(seeds), jnp.asarray(steps), *filt)
            nxt = np.asarray(nxt)
        except Exception as err:  # fail the running requests, give their slots and pages back, stay usable
            for b, h in enumerate(self._slots):
                if h is not None and not h._plan:
                    h._fail(err)
                    self._release(b)
            self._after_failure(err)
            raise
        self.cache = cache
        self.decode_steps += 1
        now = self._clock()
        for b, h in enumerate(self._slots):
            if h is None or h._plan:
                continue
            self._lengths[b] += 1
            tok = int(nxt[b])
            self._next[b] = tok
            h._emit(tok, now, self.eos)
            events.append((h, tok))
            if h.finished:
                self._release(b)

    def _release(self, slot: int) -> None:
        h = self._slots[slot]
        h.finish_time = self._clock()
        self.allocator.release(h._pages)
        self._reserved -= h._reserve
        h._pages, h._reserve = [], 0
        self._table[slot] = -1
        self._lengths[slot] = 0
        self._next[slot] = 0
        self._slots[slot] = None
        h._plan, h._toks = [], None
