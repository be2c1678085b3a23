"""models.tokenizer: SmolLM2 GGUF tokenizer vs transformers (tests/golden/smollm2_tokenizer.json), the HF-directory
path, built-in chat templates, a sentencepiece-style GGUF vocabulary, and every error path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models import chat_templates
from models.tokenizer import Tokenizer, _from_gguf, load_tokenizer

GOLDEN = Path(__file__).resolve().parents[1] / "golden"

# The token ids transformers 5.24 gives for the same GGUF and chat (recorded once, offline; the parity goldens in
# tests/golden/ are made the same way).
CHAT_FRANCE_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
                   8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
FOX = "The quick brown fox jumps over the lazy dog."
FOX_IDS = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]


@pytest.fixture(scope="module")
def smol_ckpt():
    from models.checkpoint import load_checkpoint

    try:
        return load_checkpoint("smollm2-135m")  # parses the GGUF once for this module (~3 s)
    except ValueError as e:
        if "not installed" in str(e):
            pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
        raise


@pytest.fixture(scope="module")
def smol(smol_ckpt) -> Tokenizer:
    return load_tokenizer(checkpoint=smol_ckpt)


@pytest.fixture(scope="module")
def hf_golden() -> dict:
    return json.loads((GOLDEN / "smollm2_tokenizer.json").read_text())


def test_smollm2_golden_ids(smol):
    assert smol.encode_chat([{"role": "user", "content": "What is the capital of France?"}]) == CHAT_FRANCE_IDS
    assert smol.encode(FOX) == FOX_IDS
    assert smol.encode(FOX, add_special_tokens=True) == FOX_IDS  # SmolLM2 GGUF: add_bos_token = false
    assert (smol.bos_token_id, smol.eos_token_ids, smol.pad_token_id) == (1, (2,), 2)
    assert smol.vocab_size == 49152 and smol.template_name == "checkpoint"


def test_smollm2_matches_transformers(smol, hf_golden):
    assert hf_golden["special"]["eos_token_id"] == smol.eos_token_id
    for case in hf_golden["encode"]:
        assert smol.encode(case["text"]) == case["ids"], case["text"]
        assert smol.encode(case["text"], add_special_tokens=True) == case["ids_with_special"], case["text"]
    for case in hf_golden["decode"]:
        assert smol.decode(case["ids"]) == case["skip_special"]
        assert smol.decode(case["ids"], skip_special_tokens=False) == case["keep_special"]
    for case in hf_golden["chat"]:
        assert smol.apply_chat_template(case["messages"], case["add_generation_prompt"]) == case["text"]


def test_smollm2_generation_goldens_roundtrip(smol):
    gen = json.loads((GOLDEN / "smollm2_generate.json").read_text())
    for g in gen["generations"]:
        assert smol.encode_chat([{"role": "user", "content": g["prompt"]}]) == g["input_ids"]
        assert smol.decode(g["output_ids"], skip_special_tokens=False) == g["output_text"]
    assert smol.encode(gen["fox"]["text"]) == gen["fox"]["input_ids"] == FOX_IDS


def test_random_text_roundtrip(smol, request):
    seed = abs(hash(request.node.nodeid)) % 2**31
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"\n\t-_()[]{}éüß日本😀")
    for _ in range(20):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 80))))
        assert smol.decode(smol.encode(text)) == text


def test_encode_batch_equals_encode(smol):
    from kascade_jax.tasks import prompt as prompt_lib

    texts = ["Hello world", "<|im_start|>user\nhi<|im_end|>", "", "日本😀 " * 50]
    assert smol.encode_batch(texts) == [smol.encode(t) for t in texts]
    assert smol.encode_batch(texts, add_special_tokens=True) == [smol.encode(t, add_special_tokens=True) for t in texts]
    assert prompt_lib.encode_many(smol, texts) == [prompt_lib.encode(smol, t) for t in texts]
    with pytest.raises(ValueError, match="expects strs"):
        smol.encode_batch(["a", 3])


# ---------------------------------------------------------------------------------------------------------
# HF directory layout (tokenizer.json + tokenizer_config.json + generation_config.json)


def _write_dir(tmp_path: Path, smol: Tokenizer, *, template=None, jinja=None, gen_eos=None, add_bos=False) -> Path:
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "pad_token": "<|im_end|>",
           "add_bos_token": add_bos}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    if gen_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    return tmp_path


def test_directory_tokenizer(tmp_path, smol):
    d = _write_dir(tmp_path, smol, template=smol.chat_template, gen_eos=[2, 0])
    tok = load_tokenizer(d)
    assert tok.encode(FOX) == FOX_IDS
    assert tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]) == CHAT_FRANCE_IDS
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0) and tok.pad_token_id == 2
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_directory_add_bos_and_template_variants(tmp_path, smol):
    d = _write_dir(tmp_path, smol, template=[{"name": "tool_use", "template": "T"},
                                            {"name": "default", "template": "D{{ messages[0]['content'] }}"}],
                   add_bos=True)
    tok = load_tokenizer(d)
    assert tok.encode("hi", add_special_tokens=True) == [1] + tok.encode("hi")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    (d / "chat_template.jinja").write_text("J{{ bos_token }}{{ eos_token }}")  # v5 layout wins over the config
    assert load_tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}]) == "J<|im_start|><|im_end|>"


def test_directory_builtin_fallback(tmp_path, smol):
    d = _write_dir(tmp_path, smol)  # no template anywhere; vocab has <|im_start|> -> ChatML
    tok = load_tokenizer(d)
    assert tok.template_name == "builtin:chatml"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_from_checkpoint_dir_without_tokenizer():
    from models.checkpoint import load_checkpoint

    ckpt = load_checkpoint(GOLDEN / "tiny_qwen2")
    with pytest.raises(ValueError, match=r"no tokenizer\.json in .*tiny_qwen2"):
        load_tokenizer(checkpoint=ckpt)


def test_missing_and_corrupt_tokenizer(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"no tokenizer\.json.*tokenizer\.model.*not supported"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"tokenizer\.json.*not a readable tokenizers file"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="needs name_or_path or checkpoint"):
        load_tokenizer()


# ---------------------------------------------------------------------------------------------------------
# Built-in templates


def _render(name, messages, **kw):
    return _builtin_tok(name).apply_chat_template(messages, **kw)


def _builtin_tok(name) -> Tokenizer:
    meta = _spm_meta(extra_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
                                   "<|im_end|>", "[INST]"])
    tok = _from_gguf(meta, "builtin-test", "llama")
    tok.chat_template, tok.template_name, tok._compiled = chat_templates.BUILTIN[name], name, None
    return tok


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


def test_builtin_llama3():
    assert _render("llama3", CONV) == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_builtin_llama2():
    assert _render("llama2", CONV) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] Bye [/INST]"
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        _render("llama2", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_builtin_qwen3_thinking():
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello."},
            {"role": "user", "content": "Bye"}]
    base = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    assert _render("qwen3", msgs) == base
    assert _render("qwen3", msgs, enable_thinking=True) == base
    assert _render("qwen3", msgs, enable_thinking=False) == base + "<think>\n\n</think>\n\n"
    assert _render("qwen3", msgs[:1], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_pick_builtin():
    assert chat_templates.pick_builtin("qwen3", {}) == "qwen3"
    assert chat_templates.pick_builtin("llama", {"<|start_header_id|>": 1}) == "llama3"
    assert chat_templates.pick_builtin("qwen2", {}) == "chatml"
    assert chat_templates.pick_builtin("llama", {"<s>": 1}) == "llama2"
    assert chat_templates.pick_builtin("mystery", {}) is None


def test_template_helpers_and_errors(smol):
    tok = _builtin_tok("chatml")
    tok.chat_template, tok._compiled = (
        "{{ messages | tojson }}{% generation %}G{% endgeneration %}{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.role }}{% endfor %}", None)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]G4'
    tok.chat_template, tok._compiled = "{% if %}", None
    with pytest.raises(ValueError, match="not valid jinja"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template, tok._compiled = "{{ ''.__class__.__mro__ }}", None  # the sandbox blocks dunder access
    with pytest.raises(ValueError, match="rejected the messages"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    for bad in ([], {"role": "user", "content": "x"}, [{"content": "x"}], ["hi"]):
        with pytest.raises(ValueError, match="messages|'role' and 'content'"):
            smol.apply_chat_template(bad)
    with pytest.raises(ValueError, match=r"token ids out of range \[0, 49152\)"):
        smol.decode([5, 49152])
    with pytest.raises(ValueError, match="encode expects a str"):
        smol.encode(["a"])


def test_no_template_available():
    tok = _from_gguf(_spm_meta(), "bare", "mystery")
    assert tok.template_name == "none"
    with pytest.raises(ValueError, match="no chat template and no built-in"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------------------
# GGUF vocabularies other than SmolLM2's


def _spm_meta(extra_tokens=()) -> dict:
    """A tiny sentencepiece-style (tokenizer.ggml.model = llama) vocabulary with scores and byte tokens."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello", "▁w", "or", "▁wor",
              "▁world", "ld"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + list(extra_tokens)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3] * len(extra_tokens)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * len(extra_tokens)
    # sentencepiece BPE scores: longer/later merges have lower scores; make the full words win
    scores[tokens.index("▁hello")] = -2.5
    scores[tokens.index("▁world")] = -3.5
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


# Ids that transformers 5.24's own GGUF converter (convert_gguf_tokenizer("llama", ...)) gives for _spm_meta().
# Leading spaces follow HF's Metaspace(prepend_scheme="first") quirk: "  hello" decodes to " hello".
SPM_HF = {
    "  hello": ([259, 271], " hello"),
    " hello": ([271], "hello"),
    "hello  world": ([271, 259, 275], "hello  world"),
    "hé wo": ([259, 260, 198, 172, 272, 263], "hé wo"),  # é -> byte fallback <0xC3><0xA9>
    "hello world": ([271, 275], "hello world"),
}


def test_sentencepiece_gguf_vocab():
    tok = _from_gguf(_spm_meta(), "spm", "llama")
    for text, (ids, decoded) in SPM_HF.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == decoded, text
    assert tok.encode("hello world", add_special_tokens=True) == [1, 271, 275]  # llama.cpp default: add BOS
    assert tok.decode([1, 271, 275], skip_special_tokens=False) == "<s> hello world"


def test_gguf_byte_level_pre_tokenizer_variants(smol, smol_ckpt):
    """Qwen2 / Llama-3 style pre-tokenizers split digits differently; SmolLM2's vocab reused to check the wiring."""
    base = dict(smol_ckpt.metadata)
    q = _from_gguf({**base, "tokenizer.ggml.pre": "qwen2"}, "q", "qwen2")
    l3 = _from_gguf({**base, "tokenizer.ggml.pre": "llama-bpe"}, "l", "llama")
    # smollm: GPT-2 regex, " 2024" -> "Ġ" + digits; qwen2: one digit per chunk; llama3: up to 3 digits per chunk
    assert smol.decode(smol.encode(" 2024 x")) == q.decode(q.encode(" 2024 x")) == l3.decode(l3.encode(" 2024 x"))
    assert q.encode("hello world") == smol.encode("hello world") == l3.encode("hello world")


def test_gguf_tokenizer_errors():
    with pytest.raises(ValueError, match="no embedded tokenizer"):
        _from_gguf({"general.architecture": "llama"}, "x.gguf", "llama")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='bert'.*supported"):
        _from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "x.gguf", "llama")
    with pytest.raises(ValueError, match="without tokenizer.ggml.merges"):
        _from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}, "x.gguf", "llama")
    meta = _spm_meta()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ValueError, match="neither merges nor scores"):
        _from_gguf(meta, "x.gguf", "llama")


def test_load_tokenizer_from_gguf_checkpoint_reuses_metadata(tmp_path):
    """A GGUF without a vocabulary: clear error naming the file (via load_tokenizer on the path)."""
    import gguf as gg

    path = tmp_path / "novocab.gguf"
    w = gg.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"novocab\.gguf.*no embedded tokenizer"):
        load_tokenizer(path)


def test_tokenizer_pickles_after_chat_use():
    """Worker processes (the eval's sample builders) receive the tokenizer by pickle, also after it rendered chat."""
    import pickle

    from models.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer("smollm2-135m")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
    msgs = [{"role": "user", "content": "hi"}]
    before = tok.encode_chat(msgs)
    back = pickle.loads(pickle.dumps(tok))
    assert back.encode_chat(msgs) == before and back.encode("hello world") == tok.encode("hello world")
