"""Conversations: prompts through a model's chat template (`chat_template=`), and the token path from a multi-turn
conversation's sampled tokens to the trainer's (`token_path=`). The conversations themselves, turn by turn with a
task's environment (rlmm/tasks/environment.py), are run by rlmm/run/episodes.py."""
