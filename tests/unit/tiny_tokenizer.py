"""A tiny byte-level BPE tokenizer directory shaped like SmolLM2's, built in milliseconds so the unit
tier never needs the default model.

Like SmolLM2: the same 17 special tokens first (`<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2,
...), then the 256 byte-level symbols, digits split one by one before the byte-level pre-tokenizer,
bos `<|im_start|>`, eos `<|im_end|>`, no BOS added, and SmolLM2's ChatML template (with its default
system prompt). Unlike it: ~400 tokens learned from the short corpus below.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
]
VOCAB_SIZE = 400

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A short corpus. "hello" is frequent so that "hello" and " hello" become single tokens (the
# validation tests count them), "é" so that its two bytes merge into one token, and U+FFFD (what lone
# bytes decode to) so that it encodes to one token as in SmolLM2 (the bench's exact-length prompts
# converge then).
CORPUS = [
    "hello world, hello there, hello again and hello once more",
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "The year had many days; the numbers were long and the answer was short.",
    "one two three four five six seven eight nine ten",
    "You are a helpful assistant. What is the capital of France? Paris is.",
    "def function(x):\n    return {'key': [1, 2]}  # a comment in the code\n",
    "the café served crêpes to the déjà vu club, a naïve résumé of the été",
    "café café café déjà déjà été été résumé résumé",
    "system user assistant message content role messages template",
    "request number tokens input output stream stop sequence generation",
    "long output with text and words and more words in a sentence",
    "zero width spaces, tabs and many spaces\nnew lines\n",
    "bad bytes decode to \ufffd \ufffd\ufffd \ufffd and \ufffd\ufffd",
]


def build(path: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json, config.json and generation_config.json to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    model_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "vocab_size": tok.get_vocab_size(),
    }
    (path / "config.json").write_text(json.dumps(model_config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path
