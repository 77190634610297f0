"""The built-in BPE model: `model=tiny`'s Qwen2 with a byte-pair-encoding tokenizer trained on the task's text.

A character tokenizer can never re-tokenize differently: one text has one tokenization. A BPE tokenizer has many
token sequences for one text (``"1776"`` is ``17|76`` canonically, and also ``1|7|76`` or ``1|776``), and a model
sampling one token at a time can emit a non-canonical one, which the text round trip of a multi-turn conversation
then replaces by the canonical one (rlmm/conversation/token_path.py): the mismatch real tokenizers show. Its text is
split as GPT-2's is before merging (words, numbers, runs of symbols): unlike Qwen's, which splits every digit, the
digits of a number merge, so a number has several splits.

The tokenizer: `tokenizers`' BPE trainer, `vocab_size` tokens, over every message text of the task's demonstrations
(`warm_start_steps x warm_start_batch_size` training examples: a multi-turn task's whole conversations, a single-turn
task's prompts and targets), split as GPT-2 splits text, its alphabet the character model's printable ASCII (so any text encodes), and the
special tokens of its chat template (rlmm/models/templates/bpe.jinja, ChatML's shape): `<|end|>` ends every turn and
is the end-of-sequence token; no beginning-of-sequence token, as Qwen's. Deterministic for a given corpus (the
trainer breaks ties by the merge's text), so the cache key (the task's values and these) names it.
"""
from __future__ import annotations

import copy

from rlmm.models.tiny import CHARACTERS, TEMPLATES, TinyModel
from rlmm.tasks.environment import is_multi_turn

# GPT-2's pre-tokenizer pattern (openai/gpt-2 encoder.py): words, numbers (digits merge within one, never across
# letters or symbols), runs of other symbols, whitespace. Qwen's splits every digit on its own; GPT-2's lets
# "1776" be one token or several, which is where a sampled number can leave its canonical split.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]


def bpe_corpus(task, examples: int) -> list[str]:
    """Every text a warm start on `examples` of the task's training problems shows the model, drawn from a copy of
    the task (the teacher's coins the warm start then draws are those of a task no corpus was drawn from)."""
    task = copy.deepcopy(task)
    texts = []
    for example in task.examples("train", examples):
        if is_multi_turn(task):
            texts += [m["content"] for m in task.demonstration(example)]
        else:
            texts += [example.prompt, task.target(example)]
    return texts


def build_bpe_tokenizer(corpus: list[str], vocab_size: int):
    """A BPE tokenizer of `vocab_size` tokens trained on `corpus`, in Hugging Face format, with its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(GPT2_SPLIT), "isolated")
    core.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=CHARACTERS,
                                  limit_alphabet=len(CHARACTERS), show_progress=False)
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|end|>",
                                        unk_token="<unk>", padding_side="left",
                                        additional_special_tokens=SPECIAL_TOKENS[3:])
    tokenizer.chat_template = (TEMPLATES / "bpe.jinja").read_text()
    return tokenizer


class TinyBpeModel(TinyModel):
    """`TinyModel` with a BPE tokenizer trained on the task's text (module docstring).

    Args:
        vocab_size: the BPE vocabulary, special tokens and alphabet included (the LM head's rows).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position, seed, warm_start_steps,
            warm_start_lr, warm_start_batch_size, cache_dir, rebuild: as `TinyModel`.
    """

    prefix = "tiny_bpe"

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int, max_position: int, seed: int, warm_start_steps: int, warm_start_lr: float,
                 warm_start_batch_size: int, cache_dir: str | None, rebuild: bool):
        super().__init__(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, max_position=max_position,
                         seed=seed, warm_start_steps=warm_start_steps, warm_start_lr=warm_start_lr,
                         warm_start_batch_size=warm_start_batch_size, cache_dir=cache_dir, rebuild=rebuild)
        least = len(SPECIAL_TOKENS) + len(CHARACTERS)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < least:
            raise ValueError(f"model.vocab_size: {vocab_size!r} is below the special tokens and the alphabet "
                             f"({least}; allowed: >= {least})")
        self.arch["vocab_size"] = vocab_size  # in the cache key: a BPE build never shares a name with another

    def known_vocab_size(self) -> int:
        return self.arch["vocab_size"]

    def _new_tokenizer(self, task):
        corpus = bpe_corpus(task, max(1, self.warm_start["steps"]) * self.warm_start["batch_size"])
        tokenizer = build_bpe_tokenizer(corpus, self.arch["vocab_size"])
        if len(tokenizer) != self.arch["vocab_size"]:
            raise ValueError(f"model.vocab_size: the task's text gives only {len(tokenizer)} BPE tokens, not "
                             f"{self.arch['vocab_size']} (allowed: <= {len(tokenizer)} for this task)")
        return tokenizer
