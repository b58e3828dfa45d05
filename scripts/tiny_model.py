"""Make a tiny Llama-architecture model that vLLM can serve with ``--load-format dummy``.

Nothing can be downloaded here, so the model is made from nothing: a ``config.json`` with small
sizes, a byte-level BPE tokenizer trained on text that ships with Python (a few modules of its
standard library), and a ChatML chat template that renders tools. The weights are vLLM's dummy
(random) ones, so the text is gibberish; shapes, token IDs, usage, errors and timing are real.

The vocabulary holds the marker tokens that vLLM's hermes tool parser (``<tool_call>``,
``</tool_call>``) and the ``deepseek_v3`` reasoning parser (``<think>``, ``</think>``) look up; that
parser reads the output as content unless a request asks for thinking with
``"chat_template_kwargs": {"enable_thinking": true}``.

Usage (with any Python that has the ``tokenizers`` package, e.g. vLLM's own venv)::

    python scripts/tiny_model.py DIR

Idempotent: an existing complete model in ``DIR`` is left as it is.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 2048
CONTEXT = 2048

SPECIAL_TOKENS = [
    "<|endoftext|>",  # 0: padding and unknown
    "<|im_start|>",  # 1
    "<|im_end|>",  # 2: end of a turn, the end-of-sequence token
    "<tool_call>",  # 3: hermes tool parser
    "</tool_call>",  # 4
    "<think>",  # 5: reasoning parser
    "</think>",  # 6
]

# Standard-library modules whose text trains the tokenizer: any Python 3.11+ has them, and the
# same files give the same vocabulary.
TRAINING_MODULES = [
    "textwrap.py",
    "argparse.py",
    "json/decoder.py",
    "json/encoder.py",
    "http/client.py",
    "email/message.py",
    "difflib.py",
    "calendar.py",
]

# ChatML, with the tools listed in a system turn and tool calls written the hermes way.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "You can call these functions: <tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    '</tools> Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.'
    "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% elif message.content %}"
    "{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments }}}</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": CONTEXT,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def training_text() -> list[str]:
    """The text the tokenizer learns from: a fixed list of standard-library modules."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in TRAINING_MODULES]


def train_tokenizer(target: Path) -> None:
    """A byte-level BPE tokenizer of :data:`VOCAB_SIZE` tokens, written as ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    tokenizer.save(str(target / "tokenizer.json"))


def write_model(target: Path) -> None:
    """Write every file of the model into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    train_tokenizer(target)
    (target / "config.json").write_text(json.dumps(CONFIG, indent=2))
    added = {
        str(index): {
            "content": token,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        }
        for index, token in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": CONTEXT,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python scripts/tiny_model.py DIR", file=sys.stderr)
        return 2
    target = Path(argv[1])
    if all((target / name).is_file() for name in FILES):
        print(f"tiny model already in {target}")
        return 0
    write_model(target)
    print(f"tiny model written to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
