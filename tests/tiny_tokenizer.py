"""A tiny byte-level BPE tokenizer for the tiny-model tests, built from a short text in the test tree.

It needs no model or data package, so the tests of tiny random-weight models run where the embedded
SmolLM2 package is missing. It mirrors what the engine relies on in the SmolLM2 tokenizer: the special
tokens ``<|endoftext|>`` (0), ``<|im_start|>`` (1, BOS) and ``<|im_end|>`` (2, EOS and pad) that the
tiny models' configs name, no BOS added by tokenization, a ChatML chat template with a default system
turn, and a byte-level alphabet (every string tokenizes and decodes back exactly).
"""

from __future__ import annotations

from pathlib import Path

CORPUS = Path(__file__).parent / "data" / "tiny_tokenizer_corpus.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 1024
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer():
    """A ``PreTrainedTokenizerFast`` (deterministic: the same corpus gives the same vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
