"""Conversations: prompts through a model's chat template (`chat_template=`), multi-turn rollouts with an
environment (rlmm/tasks/environment.py), and the token path from the sampler's tokens to the trainer's
(`token_path=`)."""
