"""`chat_template=`: how a task's prompt becomes the ids the sampler is given.

- `auto` (the default): through the model's chat template where it has one (an instruct checkpoint, the built-in
  models), as TRL and verl do for a conversational dataset; the task's text as it is where it has none (a base
  checkpoint);
- `model`: through the model's chat template, refused before any engine starts where the model has none;
- `none`: the task's text as it is, with the tokenizer's own special tokens (a <bos> where it adds one), never a
  template (a single-turn task only).

A single-turn task's prompt is one user message, `{"role": "user", "content": example.prompt}`; a multi-turn task
gives its own first messages (rlmm/tasks/environment.py). The built-in character model's template renders a user
turn as its text (rlmm/models/templates/char.jinja), so its prompts are the same ids with the template or
without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rlmm.tasks.environment import is_multi_turn

# What a tokenizer's encoding of a rendered conversation must not add: the template writes every special token
# itself (a <bos> included), as transformers' apply_chat_template encodes it.
NO_SPECIAL = {"add_special_tokens": False}


@runtime_checkable
class PromptFormat(Protocol):
    """A `chat_template=` option (rlmm/run/interfaces.py re-exports it): bound to the run's tokenizer and task before
    any engine starts, refusing what it cannot render."""

    def bind(self, tokenizer, model_path: str, task) -> Prompts:
        ...


class ChatTemplate:
    """The model's chat template (`required`: refused where the model has none; else the raw text there).

    Args:
        required: a model without a chat template is an error (true), or gets the task's text as it is (false).
    """

    def __init__(self, required: bool):
        self.required = required

    def bind(self, tokenizer, model_path: str, task) -> Prompts:
        if tokenizer.chat_template:
            return TemplatePrompts(tokenizer, task)
        if self.required or is_multi_turn(task):
            why = "chat_template=model asks for one" if self.required else "a multi-turn task renders its turns with it"
            raise ValueError(f"chat_template: the model at '{model_path}' has no chat template and {why} (give a "
                             f"model that has one, or chat_template=none for a single-turn task's text as it is)")
        return RawPrompts(tokenizer, task)


class NoChatTemplate:
    """The task's text as it is, whatever the model has."""

    def bind(self, tokenizer, model_path: str, task) -> Prompts:
        if is_multi_turn(task):
            raise ValueError("chat_template=none: a multi-turn task renders its turns with the model's chat template "
                             "(allowed: chat_template=auto or model)")
        return RawPrompts(tokenizer, task)


class Prompts:
    """A bound prompt format: `ids(example)` the first prompt of `example` as token ids."""

    uses_template: bool

    def ids(self, example) -> list[int]:
        raise NotImplementedError


@dataclass
class RawPrompts(Prompts):
    tokenizer: object
    task: object
    uses_template = False

    def ids(self, example) -> list[int]:
        return self.tokenizer(example.prompt).input_ids


@dataclass
class TemplatePrompts(Prompts):
    """Messages rendered by the tokenizer's chat template (`render`) and encoded as transformers'
    `apply_chat_template(tokenize=True)` encodes them (`encode`: no special tokens added)."""

    tokenizer: object
    task: object
    uses_template = True

    def first_messages(self, example) -> list[dict]:
        """The conversation before the policy's first turn: a multi-turn task's own, else the prompt as a user turn."""
        if is_multi_turn(self.task):
            return self.task.first_messages(example)
        return [{"role": "user", "content": example.prompt}]

    def ids(self, example) -> list[int]:
        return self.encode(self.render(self.first_messages(example), generation_prompt=True))

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=getattr(self.task, "tools", None),
                                                  add_generation_prompt=generation_prompt, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, **NO_SPECIAL).input_ids

    def decode(self, ids: list[int]) -> str:
        """A turn's text as the environment and the template see it (special tokens, its end-of-turn one
        included, dropped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)
