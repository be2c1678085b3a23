"""`jitted(module)`: the module's functions under jax.jit, for the pure-JAX references that kernel tests compare
against. Eagerly, a reference compiles one small program per op and shape; jitted, one per call signature.

Array arguments (jax or numpy) are traced, every other argument is static (hashable: ints, floats, tuples, None).
A call with no array argument, an unhashable static one (a list) or one that needs an array's value on the host
runs the function as it is (host-side helpers such as `max_budget` return ints).
The compiled functions are cached per (function, static arguments); jax.jit caches per shape under that.
"""

from __future__ import annotations

import functools
import types

import jax
import numpy as np


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


@functools.cache
def _compiled(fn, static_pos: tuple, static_args: tuple, static_kw: tuple, array_kw: tuple):
    def call(*arrays):
        args = list(arrays[:len(arrays) - len(array_kw)])
        for pos, val in zip(static_pos, static_args):
            args.insert(pos, val)
        kw = dict(static_kw, **dict(zip(array_kw, arrays[len(arrays) - len(array_kw):])))
        return fn(*args, **kw)

    return jax.jit(call)


def _wrap(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        arrays = [a for a in args if _is_array(a)]
        array_kw = tuple(sorted(k for k, v in kwargs.items() if _is_array(v)))
        if not arrays and not array_kw:
            return fn(*args, **kwargs)
        static_pos = tuple(i for i, a in enumerate(args) if not _is_array(a))
        static_args = tuple(args[i] for i in static_pos)
        static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k not in array_kw))
        try:
            compiled = _compiled(fn, static_pos, static_args, static_kw, array_kw)
        except TypeError:  # an unhashable static argument (a list): as it is
            return fn(*args, **kwargs)
        try:
            return compiled(*arrays, *(kwargs[k] for k in array_kw))
        except jax.errors.ConcretizationTypeError:  # reads an array's value on the host: as it is
            return fn(*args, **kwargs)

    return wrapper


@functools.cache
def jitted(module: types.ModuleType) -> types.SimpleNamespace:
    """A namespace with the module's public and private names; its functions wrapped as described above."""
    return types.SimpleNamespace(**{name: _wrap(val) if isinstance(val, types.FunctionType) else val
                                    for name, val in vars(module).items() if not name.startswith("__")})
