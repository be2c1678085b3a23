"""The test run's persistent compile cache, shared by both xdist workers (and the CLIs their tests start): entries
are written to a temporary name and renamed into place, so the other worker never reads half an entry (JAX's own
`LRUCache.put` writes in place, and its locking mode rescans the folder on every write). A process that is not
patched (a CLI started with Popen) may still write in place; a reader of a partial entry gets JAX's warning and
compiles (`compiler._cache_read` falls back)."""

from __future__ import annotations

import os


def install() -> None:
    from jax._src import lru_cache

    if getattr(lru_cache.LRUCache.put, "_atomic", False):
        return
    plain = lru_cache.LRUCache.put

    def put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled:  # (a size limit: JAX's locked path)
            return plain(self, key, value)
        if not key:
            raise ValueError("key cannot be empty")
        path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if path.exists():
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(value)
        os.replace(tmp, path)

    put._atomic = True
    lru_cache.LRUCache.put = put
