"""One rule for choosing between a Pallas kernel and its pure-JAX reference."""

from __future__ import annotations

import dataclasses

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


def replace_from_string(base, spec: str):
    """"field=value,field=value" -> dataclasses.replace(base, ...) (the kernels' tuning flags); each value is parsed
    by the type of base's field (bool: true/false/1/0, int, else str); a bad field or value raises naming it."""
    fields = {f.name for f in dataclasses.fields(base)}
    over = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, val = item.partition("=")
        name, val = name.strip(), val.strip()
        if not sep or name not in fields:
            raise ValueError(f"tuning override must be field=value with field in {sorted(fields)}, got {item!r}")
        cur = getattr(base, name)
        if isinstance(cur, bool):
            if val.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{name} takes true/false, got {val!r}")
            over[name] = val.lower() in ("true", "1")
        elif isinstance(cur, int):
            if not val.lstrip("-").isdigit():
                raise ValueError(f"{name} takes an integer, got {val!r}")
            over[name] = int(val)
        else:
            over[name] = val
    return dataclasses.replace(base, **over)
