"""Offline, deterministic natural-language text: haystack prose and a word list.

RULER's essay haystacks (Paul Graham essays) and word lists (wonderwords) need downloads or extra
packages. We substitute text that ships with the interpreter: the docstrings of a fixed list of pure-Python
stdlib modules, split into sentences. The text is the same on every machine running the same Python minor
version (the project pins 3.12), so the prompts are reproducible.

Sentences that look like code (doctest prompts, braces, `=`/`()` heavy lines) are dropped: SmolLM2 started
writing Python when the filler was code-like. This module does not tokenize.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re

# Fixed, sorted list: adding a module changes every prose prompt, so treat this list as versioned data.
_MODULES = (
    "argparse", "ast", "asyncio.base_events", "asyncio.events", "asyncio.locks", "asyncio.queues", "asyncio.streams",
    "asyncio.tasks", "base64", "bdb", "bisect", "calendar", "cmd", "codecs", "collections", "concurrent.futures._base",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "doctest",
    "email.message", "email.parser", "email.utils", "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client",
    "http.cookiejar", "http.server", "imaplib", "inspect", "io", "ipaddress", "json", "json.decoder", "json.encoder",
    "locale", "logging", "logging.handlers", "mailbox", "mimetypes", "multiprocessing.connection",
    "multiprocessing.managers", "multiprocessing.pool", "numbers", "operator", "optparse", "os", "pathlib", "pdb",
    "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint", "pydoc", "queue", "quopri",
    "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket",
    "socketserver", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "trace", "traceback", "turtle", "typing", "unittest.case", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "webbrowser", "xml.dom.minidom", "xml.etree.ElementTree",
    "zipfile", "zipimport",
)

_CODE_LIKE = re.compile(r">>>|\.\.\.|[{}\[\]<>|\\`@#$%^*~_]|=|\(\)|::|https?:|\w\.\w+\(")
_SENTENCE_END = re.compile(r"(?<=[a-z0-9][.!?])\s+(?=[A-Z])")


def _docstrings(module_name: str):
    try:
        module = importlib.import_module(module_name)
    except Exception:  # a module missing on this platform (e.g. turtle without tkinter) just contributes nothing
        return
    yield inspect.getdoc(module) or ""
    for name in sorted(vars(module)):
        obj = getattr(module, name, None)
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield inspect.getdoc(obj) or ""
            if inspect.isclass(obj):
                for attr in sorted(vars(obj)):
                    member = vars(obj)[attr]
                    if inspect.isfunction(member):
                        yield inspect.getdoc(member) or ""


@functools.cache
def prose_sentences() -> tuple[str, ...]:
    """Natural-language sentences from stdlib docstrings, in a fixed order, without duplicates."""
    seen, out = set(), []
    for module_name in _MODULES:
        for doc in _docstrings(module_name):
            for paragraph in re.split(r"\n\s*\n", doc):
                text = " ".join(paragraph.split())
                for sentence in _SENTENCE_END.split(text):
                    if not (40 <= len(sentence) <= 300) or sentence in seen:
                        continue
                    if _CODE_LIKE.search(sentence) or not sentence[0].isupper() or sentence[-1] not in ".!?":
                        continue
                    if sum(c.isalpha() or c == " " for c in sentence) < 0.9 * len(sentence):
                        continue
                    seen.add(sentence)
                    out.append(sentence)
    return tuple(out)


@functools.cache
def word_list() -> tuple[str, ...]:
    """Distinct lowercase English-looking words (4-10 letters) from the prose, sorted: RULER's wonderwords stand-in."""
    words = set()
    for sentence in prose_sentences():
        for w in re.findall(r"[A-Za-z]+", sentence):
            if 4 <= len(w) <= 10 and w.islower():
                words.add(w)
    return tuple(sorted(words))
