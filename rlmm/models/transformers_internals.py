"""Every place rlmm reaches past transformers' public API, one function each.

Checked against transformers 5.19.0. The attention interface (`AttentionInterface.register`) is public, but which
attention a model runs is its config's private `_attn_implementation`, its own attention function is looked up in
`transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS` (or its modeling module's `eager_attention_forward`), its
masks in `transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS`, and the rotary embedding is the modeling
module's global `apply_rotary_pos_emb`. An upgrade that moves one of these fails here in one line naming it
(`InternalsMoved`), not in a traceback deep in a forward.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from types import ModuleType

from torch import nn

WRITTEN_AGAINST = "transformers 5.19.0"


class InternalsMoved(RuntimeError):
    """A transformers internal rlmm relies on is not where it was (`WRITTEN_AGAINST`)."""


def modeling_module(module: nn.Module) -> ModuleType:
    """The modeling module (e.g. transformers.models.qwen2.modeling_qwen2) that defines `module`'s class."""
    return sys.modules[type(module).__module__]


def attention_implementation(model: nn.Module) -> str:
    """The attention a model's forward runs (its config's `_attn_implementation`: sdpa, eager, flash_attention_2...)."""
    try:
        return model.config._attn_implementation
    except AttributeError:
        raise InternalsMoved(f"{type(model).__name__}.config has no _attn_implementation ({WRITTEN_AGAINST})") from None


@contextmanager
def attention_replaced(model: nn.Module, name: str, wrap: Callable[[Callable], Callable]):
    """Inside: the model's attention is `wrap(own)`, `own` its attention function as it runs now (what
    `_attn_implementation` names, or the modeling module's `eager_attention_forward`), registered as `name` with the
    masks of its own attention; after: its own again."""
    from transformers import AttentionInterface
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as err:
        raise InternalsMoved(f"transformers' attention registries moved ({err}; {WRITTEN_AGAINST})") from None

    own = attention_implementation(model)
    if own in ALL_ATTENTION_FUNCTIONS:
        function = ALL_ATTENTION_FUNCTIONS[own]
    elif hasattr(modeling_module(model), "eager_attention_forward"):
        function = modeling_module(model).eager_attention_forward
    else:
        raise InternalsMoved(f"{type(model).__name__}'s attention '{own}' is neither registered nor its modeling "
                             f"module's eager_attention_forward ({WRITTEN_AGAINST})")
    AttentionInterface.register(name, wrap(function))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[own])  # the masks of its own
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = own


def has_rotary_function(modeling: ModuleType) -> bool:
    """Whether the modeling module applies its rotary embedding through a module-level `apply_rotary_pos_emb`."""
    return hasattr(modeling, "apply_rotary_pos_emb")


@contextmanager
def rotary_replaced(modeling: ModuleType, wrap: Callable[[Callable], Callable]):
    """Inside: the modeling module's `apply_rotary_pos_emb` is `wrap(own)`; after: its own again."""
    if not has_rotary_function(modeling):
        raise InternalsMoved(f"{modeling.__name__} has no apply_rotary_pos_emb ({WRITTEN_AGAINST})")
    own = modeling.apply_rotary_pos_emb
    modeling.apply_rotary_pos_emb = wrap(own)
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = own
