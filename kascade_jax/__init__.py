"""Kascade on JAX: `kascade_jax.load(model, recipe=...)` and `kascade_jax.strategy_for(model, ...)` (kascade_jax.api)
are the public way in; the rest of the package is what they are built from."""


def load(*args, **kwargs):
    from kascade_jax.api import load as _load  # noqa: PLC0415  (importing the package stays light)

    return _load(*args, **kwargs)


def strategy_for(*args, **kwargs):
    from kascade_jax.api import strategy_for as _strategy_for  # noqa: PLC0415

    return _strategy_for(*args, **kwargs)


load.__doc__ = "(model, tokenizer, strategy) for a model alias or path; see kascade_jax.api.load."
strategy_for.__doc__ = "The strategy for a loaded model, as the CLIs build it; see kascade_jax.api.strategy_for."
