"""The gateway tests' tokenizer: a small word-level one with a chat template, in a temp
directory as a model's would be."""

from __future__ import annotations

import pytest

WORDS = [f"w{i}" for i in range(2000)]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tokenizer of the words w0..w1999 (and the roles, hold, die), whitespace-split, with
    a chat template, saved as a model directory's tokenizer files."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(
        ["<unk>", "system", "user", "assistant", "hold", "die", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return str(path)
