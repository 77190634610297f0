"""The three token paths (rlmm/conversation/token_path.py) against the anchors' own code on fixed conversations.

tests/data/token_path_anchors.json holds what TRL's message-mode reconciler, verl's Qwen Continuous Token builder and
NeMo-RL's prefix replacement returned, run outside rlmm on the same turns (its `provenance` names the commits):
- TRL `_chain_to_sequences` on nine id-list cases (clean appends, a re-rendered tail, a shrinking turn, a prompt that
  is a prefix of the row, ChatML's newline after the end-of-turn token, a turn without one, divergences before the
  last response that TRL forks on);
- one three-turn conversation on a toy BPE tokenizer whose template trims assistant text and drops earlier
  reasoning (Qwen3's), with a non-canonical split ("a", "b" for "ab") and a trailing space in the first turn.
"""
import json
from pathlib import Path

import pytest
import torch

from rlmm.conversation.chat import TemplatePrompts
from rlmm.conversation.token_path import (CLEAN, FORK, REALIGN, Conversation, Realign, Retokenize, TokenInTokenOut,
                                          Turn, common_prefix, environment_ids, reconcile, turn_drift)

ANCHORS = json.loads((Path(__file__).parent / "data" / "token_path_anchors.json").read_text())

# The toy tokenizer the anchors were run with: ChatML specials, two non-special reasoning tags, printable ASCII and
# newline, and two merges (a b -> ab, ab c -> abc); its template trims assistant text and drops <think>...</think>
# from assistant turns before the last user message.
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TAGS = ["<think>", "</think>"]
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set c = m.content -%}"
    "{%- if loop.index0 < ns.last_user and '</think>' in c -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<|im_start|>assistant\\n' + (c | trim) + '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def toy_tokenizer(template: str = QWEN3_LIKE):
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {}
    for token in SPECIALS + TAGS + [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab.setdefault(token, len(vocab))
    merges = [("a", "b"), ("ab", "c")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = template
    return tokenizer


def turns_of(case: dict) -> list[Turn]:
    return [Turn(t["prompt_ids"], t["output_ids"], torch.tensor(t["logprobs"]), "stop") for t in case["turns"]]


@pytest.mark.parametrize("name", sorted(ANCHORS["reconciler_cases"]))
def test_realign_builds_trls_row(name):
    """`reconcile` gives TRL's row (ids, loss mask, log-probs) and its class of each turn; where TRL forks, rlmm's one
    row is TRL's last (the prompt that forked as context, then the turn), and the earlier row's tokens are not
    trained (the documented departure)."""
    case = ANCHORS["reconciler_cases"][name]
    ids, sampled, logprobs, _, kinds = reconcile(turns_of(case), case["fork_threshold_tokens"])
    trl_kinds = [k for k in case["trl_kinds"][1:]]
    assert kinds == trl_kinds
    row = case["trl_rows"][-1]
    assert ids == row["input_ids"]
    assert [int(s) for s in sampled] == row["mask"]
    assert logprobs == pytest.approx(row["logp"])
    if FORK in kinds:
        assert len(case["trl_rows"]) == 2
    else:
        assert len(case["trl_rows"]) == 1


def conversation_of(path, chat) -> Conversation:
    """The anchors' end-to-end conversation, each turn's prompt as `path` gives it."""
    e2e = ANCHORS["e2e"]
    tokenizer = chat.tokenizer
    conversation = Conversation([dict(m) for m in e2e["first"]])
    prompt = chat.encode(chat.render(conversation.messages, generation_prompt=True))
    for sampled, after in zip(e2e["sampled"], e2e["after"]):
        output = tokenizer.convert_tokens_to_ids(sampled["pieces"])
        conversation.turns.append(Turn(prompt, output, torch.tensor(sampled["logprobs"]), "stop"))
        conversation.messages.append({"role": "assistant", "content": chat.decode(output)})
        if after:
            conversation.messages += after
            prompt = path.next_prompt(chat, conversation)
    return conversation


def test_tokens_is_verls_continuous_token_and_nemo_rls_splice():
    """Token-in/token-out on the conversation: the ids verl's Qwen Continuous Token builder and NeMo-RL's prefix
    replacement build (the sampled ids kept, ChatML's newline after each end-of-turn token the environment's), the
    loss mask and log-probs verl's returns."""
    chat = TemplatePrompts(toy_tokenizer(), None)
    conversation = conversation_of(TokenInTokenOut(), chat)
    row = TokenInTokenOut().trained(chat, conversation)
    verl = ANCHORS["e2e"]["verl_qwen_continuous_token"]
    assert row.prompt_ids + row.response_ids == verl["ids"] == ANCHORS["e2e"]["nemo"]["ids"]
    assert len(row.prompt_ids) == verl["prompt_len"]
    assert [int(s) for s in row.sampled] == verl["response_mask"]
    assert row.logprobs == pytest.approx(verl["response_logprobs"])
    assert row.kinds == [CLEAN, CLEAN]


def test_realign_on_the_conversation_is_trls_last_row():
    """The conversation under `realign`: TRL realigns turn 2 (the first turn's "a", "b", " " re-render as "ab") and
    forks at turn 3 (the template drops the first turn's reasoning once a user turn follows); rlmm's one row is
    TRL's last."""
    chat = TemplatePrompts(toy_tokenizer(), None)
    conversation = conversation_of(Realign(1024), chat)
    row = Realign(1024).trained(chat, conversation)
    last = ANCHORS["e2e"]["trl_rows"][-1]
    assert row.prompt_ids + row.response_ids == last["input_ids"]
    assert [0] * len(row.prompt_ids) + [int(s) for s in row.sampled] == last["mask"]
    assert row.kinds == [REALIGN, FORK]


def test_retokenize_refuses_a_template_that_is_not_prefix_stable():
    chat = TemplatePrompts(toy_tokenizer(), None)
    conversation = conversation_of(Retokenize(), chat)
    with pytest.raises(ValueError, match="^token_path=retokenize: .*not prefix-stable"):
        Retokenize().trained(chat, conversation)


STABLE = QWEN3_LIKE.replace("loop.index0 < ns.last_user and ", "false and ")  # keeps earlier reasoning


def test_retokenize_scores_the_rerendered_conversation():
    """With a template that keeps earlier turns as they were, `retokenize`'s row is the whole conversation rendered
    and tokenized from text (the first turn's "a", "b" as "ab", its trailing space trimmed), the loss on each
    assistant turn's text and end-of-turn token, not on the newline the template writes after it."""
    tokenizer = toy_tokenizer(STABLE)
    chat = TemplatePrompts(tokenizer, None)
    conversation = conversation_of(Retokenize(), chat)
    row = Retokenize().trained(chat, conversation)
    ids = row.prompt_ids + row.response_ids
    assert ids == chat.encode(chat.render(conversation.messages, generation_prompt=False))
    trained = [tokenizer.convert_ids_to_tokens(i) for i, s in zip(row.response_ids, row.sampled) if s]
    assert trained == ["<think>", "x", "</think>", "ab", "<|im_end|>", "abc", "<|im_end|>", "ab", "<|im_end|>"]
    assert ids[-1] == tokenizer.convert_tokens_to_ids("\n") and not row.sampled[-1]


def test_environment_ids_start_after_the_end_of_turn_token():
    """The environment's ids begin with what the template writes after the policy's end-of-turn token (ChatML's
    newline), and end with the generation prompt (TRL's `_get_tool_suffix_ids`)."""
    tokenizer = toy_tokenizer()
    chat = TemplatePrompts(tokenizer, None)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"},
                {"role": "tool", "content": "r"}]
    text = "".join(tokenizer.convert_ids_to_tokens(environment_ids(chat, messages)))
    assert text == "\n<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\n"


def test_turn_drift_counts_the_sampled_tokens_after_the_first_difference():
    chat = TemplatePrompts(toy_tokenizer(STABLE), None)
    conversation = conversation_of(TokenInTokenOut(), chat)
    first, second, third = turn_drift(chat, conversation)
    # turn 1 sampled <think> x </think> a b ' ' <eos>; it re-renders as <think> x </think> ab <eos>
    assert (first.sampled, first.rendered, first.common, first.changed) == (7, 5, 3, 4) and first.drifted
    assert not second.drifted and not third.drifted
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [1]) == 0
