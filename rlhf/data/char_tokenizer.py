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
