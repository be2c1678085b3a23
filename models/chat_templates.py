"""Built-in chat templates (jinja2, HF conventions) for checkpoints that ship none, and the pick among them.

A checkpoint's own template (tokenizer_config.json / chat_template.jinja / GGUF tokenizer.chat_template) always
wins; these are fallbacks only. They follow the published formats of Llama 2 ([INST]), Llama 3 (header ids),
ChatML (Qwen2 / SmolLM) and Qwen3 (ChatML plus `<think>` handling, `enable_thinking`), without tool calling.
"""

from __future__ import annotations

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = none %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen3: earlier assistant turns lose their <think> block; with enable_thinking=false the generation prompt
# carries an empty think block, which is how Qwen3 is told not to think.
QWEN3 = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

BUILTIN = {"llama2": LLAMA2, "llama3": LLAMA3, "chatml": CHATML, "qwen3": QWEN3}


def pick_builtin(model_type: str | None, vocab: set[str] | dict) -> str | None:
    """Name of the built-in template for a model family, judged by model_type and its special tokens."""
    if model_type == "qwen3":
        return "qwen3"
    if "<|start_header_id|>" in vocab:
        return "llama3"
    if "<|im_start|>" in vocab or model_type == "qwen2":
        return "chatml"
    if model_type == "llama" and "<s>" in vocab:
        return "llama2"
    return None
