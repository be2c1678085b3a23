"""Tokenizer + chat template for Llama/Qwen-family checkpoints, on the `tokenizers` package (no transformers).

Two sources, both ending in a `tokenizers.Tokenizer`:
- an HF directory: tokenizer.json, plus tokenizer_config.json (chat template, bos/eos, add_bos_token),
  chat_template.jinja / chat_template.json (transformers v5 layout) and generation_config.json (extra eos ids);
- a GGUF file: the vocabulary embedded in its metadata, rebuilt the way transformers' GGUF loader does it:
  `gpt2` = byte-level BPE (with the pre-tokenizer split regex named by tokenizer.ggml.pre), `llama` =
  sentencepiece-style BPE with byte fallback (merges from the file, or derived from the token scores).

Chat templates are rendered with jinja2 in a sandbox, configured like transformers (trim_blocks, lstrip_blocks,
`raise_exception`, `strftime_now`, non-escaping `tojson`, `{% generation %}` accepted). When the checkpoint has
no template, a built-in one is chosen by family (models.chat_templates).

Deliberately not here: batching / padding (callers do it on ids), offsets, slow (python) tokenizers, tool-call
parsing, and sentencepiece `.model` files without a tokenizer.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from models import chat_templates, registry

# Token types in GGUF's tokenizer.ggml.token_type (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split regexes by tokenizer.ggml.pre (the ones transformers' GGUF loader knows for Llama/Qwen).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# End-of-turn tokens: generation should stop on them even when the file's eos is another token.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _token_text(tok: Any) -> str | None:
    if tok is None or isinstance(tok, str):
        return tok
    if isinstance(tok, Mapping):
        return tok.get("content")
    raise ValueError(f"special token must be a string or {{'content': ...}}, got {tok!r}")


@dataclass(frozen=True)
class _Specials:
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    add_bos: bool
    add_eos: bool


class Tokenizer:
    """encode / decode / chat template over a `tokenizers.Tokenizer`.

    add_special_tokens=True adds what the checkpoint's tokenizer adds by itself (e.g. Llama's BOS); chat
    templates write their own special tokens, so `encode_chat` encodes with add_special_tokens=False, like HF.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        specials: _Specials,
        chat_template: str | None,
        source: str,
        template_name: str = "checkpoint",
    ):
        self.backend = backend
        self.source = source
        self.chat_template = chat_template
        self.template_name = template_name
        self.bos_token_id = specials.bos_token_id
        self.eos_token_ids = specials.eos_token_ids
        self.pad_token_id = specials.pad_token_id
        self._add_bos = specials.add_bos
        self._add_eos = specials.add_eos
        self._compiled = None

    # -- ids ----------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.backend.id_to_token(int(idx))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
                ids = [self.bos_token_id] + ids
            if self._add_eos and self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id):
                ids = ids + [self.eos_token_id]
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` of every text, in the backend's threads (a 16K-token prompt takes ~35 ms on one core)."""
        bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
        if bad:
            raise ValueError(f"encode_batch expects strs, got {bad[0]}")
        if add_special_tokens:
            return [self.encode(t, add_special_tokens=True) for t in texts]
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token ids out of range [0, {n}): {bad[:5]}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------------------
    def _special_text(self, idx: int | None) -> str:
        return "" if idx is None else (self.backend.id_to_token(idx) or "")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render messages ([{"role": ..., "content": ...}]) to the prompt string; kwargs go to the template
        (e.g. enable_thinking=False for Qwen3, tools=[...])."""
        if self.chat_template is None:
            raise ValueError(
                f"tokenizer from {self.source!r} has no chat template and no built-in one fits this model; "
                f"built-ins: {sorted(chat_templates.BUILTIN)}"
            )
        if isinstance(messages, Mapping) or not isinstance(messages, Sequence) or not messages:
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
        for m in messages:
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content' keys, got {m!r}")
        if self._compiled is None:
            import jinja2

            try:
                self._compiled = _jinja_env().from_string(self.chat_template)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ValueError(f"chat template of {self.source!r} is not valid jinja: {e}") from e
        import jinja2

        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special_text(self.bos_token_id),
                eos_token=self._special_text(self.eos_token_id),
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:  # includes the template's own raise_exception(...)
            raise ValueError(
                f"chat template ({self.template_name}) of {self.source!r} rejected the messages: {e}"
            ) from e

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)  # the template already wrote the special tokens

    def __getstate__(self):  # picklable for worker processes: the compiled chat template is rebuilt on first use
        return dict(self.__dict__, _compiled=None)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.source!r}, vocab={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, template={self.template_name})"
        )


def _jinja_env():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): render the body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# ---------------------------------------------------------------------------------------------------------
# HF directory


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _select_template(template: Any, source: str) -> str | None:
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if "default" in named:
            return named["default"]
        if named:
            return next(iter(named.values()))
    raise ValueError(f"{source!r}: unreadable chat_template {str(template)[:80]!r}")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _from_directory(path: Path, model_config: Mapping[str, Any] | None) -> Tokenizer:
    tj = path / "tokenizer.json"
    if not tj.is_file():
        hint = ""
        if (path / "tokenizer.model").exists():
            hint = " (a tokenizer.model sentencepiece file alone is not supported)"
        raise ValueError(f"no tokenizer.json in {str(path)!r}{hint}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tj))
    except Exception as e:
        raise ValueError(f"{str(tj)!r} is not a readable tokenizers file: {type(e).__name__}: {e}") from e
    cfg = _read_json(path / "tokenizer_config.json")
    special_map = _read_json(path / "special_tokens_map.json")
    gen = _read_json(path / "generation_config.json")
    model_config = dict(model_config) if model_config is not None else _read_json(path / "config.json")

    template = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    elif "chat_template" in _read_json(path / "chat_template.json"):
        template = _read_json(path / "chat_template.json")["chat_template"]
    else:
        template = cfg.get("chat_template")
    template = _select_template(template, str(path))

    def tok_id(key: str) -> int | None:
        text = _token_text(cfg.get(key)) or _token_text(special_map.get(key))
        return backend.token_to_id(text) if text else None

    bos = tok_id("bos_token")
    if bos is None and model_config.get("bos_token_id") is not None:
        bos = _ids(model_config.get("bos_token_id"))[0]
    eos: list[int] = []
    for candidate in (tok_id("eos_token"), *_ids(model_config.get("eos_token_id")), *_ids(gen.get("eos_token_id"))):
        if candidate is not None and candidate not in eos:
            eos.append(candidate)
    pad = tok_id("pad_token")
    if pad is None:
        pad = _ids(model_config.get("pad_token_id"))[0] if model_config.get("pad_token_id") is not None else None

    # Honour add_bos_token when the tokenizer.json post-processor does not already add it.
    add_bos = bool(cfg.get("add_bos_token", False))
    add_eos = bool(cfg.get("add_eos_token", False))
    specials = _Specials(bos, tuple(eos), pad, add_bos, add_eos)
    return _with_template(backend, specials, template, str(path), model_config.get("model_type"))


def _with_template(backend, specials, template, source, model_type) -> Tokenizer:
    name = "checkpoint"
    if template is None:
        name = chat_templates.pick_builtin(model_type, backend.get_vocab(with_added_tokens=True))
        template = chat_templates.BUILTIN.get(name) if name else None
        name = f"builtin:{name}" if name else "none"
    eos = list(specials.eos_token_ids)
    for text in _END_OF_TURN:  # stop at the end-of-turn token the template writes, even if eos is another token
        idx = backend.token_to_id(text)
        if idx is not None and idx not in eos and template is not None and text in template:
            eos.append(idx)
    specials = _Specials(specials.bos_token_id, tuple(eos), specials.pad_token_id, specials.add_bos, specials.add_eos)
    return Tokenizer(backend, specials=specials, chat_template=template, source=source, template_name=name)


# ---------------------------------------------------------------------------------------------------------
# GGUF


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _derive_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a token into two vocab tokens, ordered
    by the merged token's score (best first), then by the pieces' ids -- as transformers' generate_merges."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for tok, score in zip(tokens, scores):
        local = [
            (tok[:i], tok[i:], score) for i in range(1, len(tok)) if tok[:i] in vocab and tok[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _from_gguf(meta: Mapping[str, Any], source: str, model_type: str | None) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ValueError(f"{source!r}: the GGUF has no embedded tokenizer (tokenizer.ggml.model / tokens missing)")
    token_types = list(meta.get("tokenizer.ggml.token_type") or [])
    merges_text = meta.get("tokenizer.ggml.merges")

    def tid(key):
        v = meta.get(f"tokenizer.ggml.{key}")
        return int(v) if v is not None else None

    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        if not merges_text:
            raise ValueError(f"{source!r}: byte-level BPE GGUF without tokenizer.ggml.merges")
        merges = [tuple(m.split(" ")) for m in merges_text]
        backend = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                       end_of_word_suffix="", fuse_unk=False)
        )
        split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        backend.decoder = decoders.ByteLevel()
        add_bos_default = False
        in_alphabet = lambda t: set(t) <= alphabet  # noqa: E731 -- mislabelled control tokens are skipped, as HF
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if merges_text:
            merges = [tuple(m.split(" ")) for m in merges_text]
        elif scores:
            merges = _derive_merges(list(tokens), list(scores))
        else:
            raise ValueError(f"{source!r}: sentencepiece GGUF vocabulary has neither merges nor scores")
        unk = tid("unknown_token_id")
        backend = tokenizers.Tokenizer(
            models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=True, byte_fallback=True,
                       dropout=None, unk_token=tokens[unk] if unk is not None else None)
        )
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
        backend.decoder = decoders.Sequence(steps)
        add_bos_default = True  # llama.cpp adds BOS to a sentencepiece vocabulary unless told otherwise
        in_alphabet = lambda t: True  # noqa: E731
    else:
        raise ValueError(
            f"{source!r}: cannot build a tokenizer from GGUF tokenizer.ggml.model={kind!r}; "
            f"supported: ['gpt2', 'llama']"
        )

    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, token_types)
        if ty == _CONTROL and in_alphabet(t)
    ]
    if control:
        backend.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, token_types) if ty == _USER_DEFINED]
    if user:
        backend.add_tokens(user)

    eos = [tid(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
    specials = _Specials(
        bos_token_id=tid("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=tid("padding_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    return _with_template(backend, specials, meta.get("tokenizer.chat_template"), source, model_type)


def load_tokenizer(name_or_path: str | os.PathLike | None = None, checkpoint=None) -> Tokenizer:
    """Tokenizer for a checkpoint directory, a .gguf file, an alias / hub id, or an already loaded Checkpoint
    (whose GGUF metadata is reused, so the file is not parsed twice)."""
    if checkpoint is not None:
        if checkpoint.format == "gguf":
            return _from_gguf(checkpoint.metadata, checkpoint.source, checkpoint.config.get("model_type"))
        path = Path(checkpoint.source)
        return _from_directory(path if path.is_dir() else path.parent, checkpoint.config)
    if name_or_path is None:
        raise ValueError("load_tokenizer needs name_or_path or checkpoint")
    path = registry.resolve(name_or_path)
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        from models import gguf as gguf_io

        meta = gguf_io.gguf_metadata(str(path))
        return _from_gguf(meta, str(path), meta.get("general.architecture"))
    if path.is_file():
        path = path.parent
    return _from_directory(path, None)
