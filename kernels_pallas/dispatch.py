"""One rule for choosing between a Pallas kernel and its pure-JAX reference."""

from __future__ import annotations

import jax

IMPLS = ("auto", "pallas", "reference")


def use_pallas(impl: str, interpret: bool, supported: bool = True) -> bool:
    """impl="pallas" (or interpret mode) always takes the kernel, so unsupported shapes raise there; "auto" takes it
    on a GPU when the shape is `supported` and the reference otherwise; "reference" never."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    if impl == "pallas" or interpret:
        return True
    return jax.default_backend() == "gpu" and supported
