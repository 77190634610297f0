"""The training run: the loop (train.py) and its step, where rollouts come from, evaluation, the critic, the monitor, checkpoints, resume and the run's own record."""
