"""Paged KV cache: fixed-size pages in per-layer pools, a page table per sequence, a host-side free list.

Layout (see models/README.md for the contiguous one):
- pools, one K and one V per layer: `[num_pages, page_size, kv_heads, head_dim]`; page_size a power of two in
  16..256 (`check_page_size`);
- page_table `[batch, max_pages]` int32: logical token position p of sequence b lives at row `p % page_size` of page
  `page_table[b, p // page_size]`; -1 = no page (never read as data, and writes to it are dropped);
- lengths `[batch]` int32, as in `KVCache`. The logical capacity of a sequence is `max_len = max_pages * page_size`.

`PagedKVCache` is a drop-in for `KVCache` in `models.generate.prefill` / `decode_step` / `forward` (it has `k`, `v`,
`lengths`, `max_len`), with two requirements:
- the strategy must opt in with a class attribute `supports_paged = True` (DenseStrategy and KascadeStrategy do;
  the baselines do not): others are refused with a ValueError (`models.attention.check_supports_paged`), since they
  would take the pools for a contiguous [batch, max_len, ...] cache;
- every page holding a position a call writes or reads (sequence b: positions [0, kv_len[b]), i.e.
  page_table[b, :pages_for(kv_len[b])]) must be allocated, in [0, num_pages). prefill / decode_step / forward check
  this on the host and raise a ValueError naming the sequence and position: a write to a -1 page is dropped, and
  the Pallas kernels read a -1 entry as the sequence's first page where the reference reads zeros, so a missing
  page would otherwise give silently wrong logits. The serving engine grows its pages itself (and skips the check
  in its own jitted decode step).
The transformer sees `page_table` on the cache and writes through it (`write_paged`), and hands it to the
strategy in `AttentionInputs.page_table`, with `k_cache` / `v_cache` then being this layer's pools. Writes to an
unallocated page (-1) are dropped by the scatter (mode="drop"), so a slot whose page-table row is all -1 (a free
slot of the serving engine) can ride along in a batched decode step without touching anyone's pages.
The paged decode kernels read the rows of a sequence's pages past its kv_len as they are (with probability 0, and
0 x inf = NaN), so those rows must be finite: a page handed to a new owner is zeroed first (`zero_pages`; the
engine does it whenever it allocates), and a page table built by hand must point at pages holding finite values
(fresh pools are zeros). The references zero those rows themselves.

`PageAllocator` is the host-side free list: pages are handed out as sequences grow and returned when a slot is
released; asking for more than are free raises `OutOfPagesError` (a ValueError naming the numbers), never hands out
a page twice. The serving engine (models/engine.py) reserves a request's worst case before admitting it, so a running
sequence never meets that error; a request that does not fit waits in the queue.

Deliberately not here: page sharing between sequences (prefix caching, copy-on-write) and swapping pages to host.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

PAGE_SIZES = (16, 32, 64, 128, 256)


def check_page_size(page_size) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or int(page_size) not in PAGE_SIZES:
        raise ValueError(f"page_size must be a power of two in 16..256 ({', '.join(map(str, PAGE_SIZES))}), "
                         f"got {page_size!r}")
    return int(page_size)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold `tokens` positions."""
    return -(-int(tokens) // page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k: tuple  # per layer [num_pages, page_size, kv_heads, head_dim]
    v: tuple  # per layer [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array  # [batch, max_pages] int32, -1 = no page
    lengths: jax.Array  # [batch] int32
    # The strategy's cache state, as models.cache.KVCache's, made with init_cache_state(..., pages=(num_pages,
    # page_size)): a leaf [num_pages, page_size, ...] is a page pool (read and written through the page table,
    # zeroed with its pages); every other leaf is per sequence, [batch, ...] (see `slot_view`).
    strategy_state: Any = None

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    @property
    def max_len(self) -> int:
        return self.max_pages * self.page_size

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @classmethod
    def init(cls, config: ModelConfig, batch: int, num_pages: int, page_size: int, max_len: int,
             dtype=jnp.bfloat16) -> "PagedKVCache":
        """Empty pools of `num_pages` pages and an all -1 page table for `batch` sequences of up to `max_len`
        positions (rounded up to whole pages)."""
        page_size = check_page_size(page_size)
        if batch <= 0 or num_pages <= 0 or max_len <= 0:
            raise ValueError(f"paged cache batch, num_pages and max_len must be positive, got batch={batch}, "
                             f"num_pages={num_pages}, max_len={max_len}")
        max_pages = pages_for(max_len, page_size)
        if max_pages * page_size > config.max_position_embeddings:
            raise ValueError(f"paged cache max_len {max_pages * page_size} (max_len {max_len} rounded up to pages of "
                             f"{page_size}) exceeds the model's maximum context {config.max_position_embeddings}")
        shape = (num_pages, page_size, config.kv_heads, config.head_dim)
        zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
        return cls(k=tuple(zeros() for _ in range(config.num_layers)),
                   v=tuple(zeros() for _ in range(config.num_layers)),
                   page_table=jnp.full((batch, max_pages), -1, jnp.int32),
                   lengths=jnp.zeros((batch,), jnp.int32))

    def with_table(self, page_table, lengths) -> "PagedKVCache":
        """The same pools seen through another page table of the same batch (e.g. a decode step's masked rows)."""
        page_table = jnp.asarray(page_table, jnp.int32)
        if page_table.ndim != 2 or page_table.shape[1] != self.max_pages:
            raise ValueError(f"page_table must be [batch, {self.max_pages}], got shape {page_table.shape}")
        if self.strategy_state is not None and page_table.shape[0] != self.batch:
            raise ValueError(f"a cache with a strategy state keeps its batch of {self.batch} (its per-sequence "
                             f"entries); got a page table of batch {page_table.shape[0]}: use slot_view")
        return dataclasses.replace(self, page_table=page_table, lengths=jnp.asarray(lengths, jnp.int32))

    def _is_pool(self, x) -> bool:
        return x.ndim >= 2 and tuple(x.shape[:2]) == (self.num_pages, self.page_size)

    def slot_view(self, slot: int, row, length) -> "PagedKVCache":
        """Sequence `slot` alone, as a batch-1 cache: page_table row [max_pages], its length, the shared pools and
        the slot's per-sequence state entries (a single-request prefill; `merge_slot` puts the result back)."""
        state = jax.tree.map(lambda x: x if self._is_pool(x) else x[slot:slot + 1], self.strategy_state)
        row = jnp.asarray(row, jnp.int32).reshape(1, self.max_pages)
        return dataclasses.replace(self, page_table=row, lengths=jnp.asarray(length, jnp.int32).reshape(1),
                                   strategy_state=state)

    def merge_slot(self, slot: int, view: "PagedKVCache") -> "PagedKVCache":
        """This cache with `view`'s (a `slot_view` after a prefill) pools and slot `slot`'s state entries; the
        page table and lengths stay this cache's."""
        state = jax.tree.map(lambda x, y: y if self._is_pool(x) else x.at[slot].set(y[0]), self.strategy_state,
                             view.strategy_state)
        return dataclasses.replace(self, k=view.k, v=view.v, strategy_state=state)


def physical_rows(page_table, positions, page_size: int, num_pages: int):
    """Logical positions [batch, T] -> rows of the flattened pool [num_pages * page_size]; positions on no page
    (-1, or past the table) map to num_pages * page_size, one past the end."""
    max_pages = page_table.shape[1]
    slot = positions // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(slot, 0, max_pages - 1), axis=1)
    ok = (page >= 0) & (page < num_pages) & (slot >= 0) & (slot < max_pages)
    return jnp.where(ok, page * page_size + positions % page_size, num_pages * page_size)


def write_paged(pool, new, page_table, positions):
    """Write new [batch, T, kv_heads, d] at logical positions [batch, T] through the page table (prefill chunks and
    decode tokens alike). Rows on no page are dropped."""
    n, ps, kvh, d = pool.shape
    rows = physical_rows(page_table, positions, ps, n).reshape(-1)
    flat = pool.reshape(n * ps, kvh, d).at[rows].set(new.reshape(-1, kvh, d).astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


class OutOfPagesError(ValueError):
    """More pages were asked for than the free list holds."""


class PageAllocator:
    """Host-side free list of page ids 0..num_pages-1 (LIFO: a released page is the next one handed out)."""

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = int(num_pages)
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPagesError(f"out of KV pages: {n} requested, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def release(self, pages) -> None:
        for p in pages:
            p = int(p)
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated (double free or foreign page)")
            self._used.remove(p)
            self._free.append(p)


def zero_pages(cache: PagedKVCache, pages) -> PagedKVCache:
    """`cache` with `pages` (page ids) zeroed in every layer's K and V pool, for their new owner (module docstring).
    The pools are donated; the ids are padded to a power of two (>= 8) so that a few shapes compile."""
    pages = [int(p) for p in pages]
    if not pages:
        return cache
    ids = np.full(_zero_width(len(pages)), cache.num_pages, np.int32)  # padding: dropped
    ids[:len(pages)] = pages
    k, v, state = _zero_pages(cache.k, cache.v, _state_pools(cache), jnp.asarray(ids))
    return _with_state_pools(dataclasses.replace(cache, k=k, v=v), state)


def _state_pools(cache: PagedKVCache) -> tuple:
    """The page pools among the strategy state's leaves (PagedKVCache.strategy_state)."""
    return tuple(x for x in jax.tree.leaves(cache.strategy_state) if cache._is_pool(x))


def _with_state_pools(cache: PagedKVCache, pools: tuple) -> PagedKVCache:
    it = iter(pools)
    state = jax.tree.map(lambda x: next(it) if cache._is_pool(x) else x, cache.strategy_state)
    return dataclasses.replace(cache, strategy_state=state)


def _zero_width(n: int) -> int:
    return max(8, 1 << (n - 1).bit_length())


def warm_zero_pages(cache: PagedKVCache, max_pages: int) -> PagedKVCache:
    """Compile `zero_pages` for every padded width of up to `max_pages` pages (all ids padding: nothing changes), so
    that a step handing out that many pages at once builds no program."""
    for w in sorted({_zero_width(n) for n in range(1, max(max_pages, 1) + 1)}):
        k, v, state = _zero_pages(cache.k, cache.v, _state_pools(cache), jnp.full((w,), cache.num_pages, jnp.int32))
        cache = _with_state_pools(dataclasses.replace(cache, k=k, v=v), state)
    return cache


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _zero_pages(k, v, state_pools, ids):
    zero = lambda pool: pool.at[ids].set(jnp.zeros((), pool.dtype), mode="drop")  # noqa: E731
    return tuple(map(zero, k)), tuple(map(zero, v)), tuple(map(zero, state_pools))
