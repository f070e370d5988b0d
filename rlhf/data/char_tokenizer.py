"""A character-level HF tokenizer for tiny CPU models: one token per character, saveable with `save_pretrained`.

Built from a `tokenizers` WordLevel model, so `AutoTokenizer.from_pretrained(folder)` loads it back with no
rlhf code. Its chat template joins message contents and ends each assistant turn with the EOS token.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlhf.errors import ConfigError

ARITHMETIC_ALPHABET = "0123456789+-= "
PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}" + EOS + "{% endif %}{% endfor %}"
)


def build_char_tokenizer(alphabet: str = ARITHMETIC_ALPHABET) -> PreTrainedTokenizerFast:
    """Tokenizer with ids 0..3 for <pad>, <unk>, <bos>, <eos> then one id per `alphabet` character, in order."""
    if not alphabet:
        raise ConfigError("char tokenizer alphabet is empty; pass the characters the model should see")
    repeated = sorted({char for char in alphabet if alphabet.count(char) > 1})
    if repeated:
        raise ConfigError(f"char tokenizer alphabet repeats {''.join(repeated)!r}; list each character once")
    vocab = {token: token_id for token_id, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + i for i, char in enumerate(alphabet)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS,
        padding_side="left", clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


CHAT_ALPHABET = "".join(chr(code) for code in range(32, 127)) + "\n"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
# ChatML with tools: the tool list as a system turn, tool results as `tool` turns. `strip_think` variant drops
# `<think>...</think>` from earlier assistant turns (as Qwen3's template does): it rewrites history.
CHATML_TEMPLATE = (
    "{% if tools %}" + IM_START + "system\nTools:{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}Call one with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>." + IM_END + "\n{% endif %}"
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if strip_think and message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    + IM_START + "{{ message['role'] }}\n{{ content }}" + IM_END + "\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)


def build_chat_char_tokenizer(alphabet: str = CHAT_ALPHABET, *, strip_think: bool = False) -> PreTrainedTokenizerFast:
    """A char tokenizer with ChatML markers and tool-call tokens as single special tokens, EOS = `<|im_end|>`,
    and a ChatML template with tool support (multi-turn tests and the tool-use demo)."""
    tokenizer = build_char_tokenizer(alphabet)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, *TOOL_TOKENS]})
    tokenizer.eos_token = IM_END
    prefix = "{% set strip_think = true %}" if strip_think else "{% set strip_think = false %}"
    tokenizer.chat_template = prefix + CHATML_TEMPLATE
    return tokenizer
