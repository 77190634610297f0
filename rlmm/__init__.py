"""rlmm: study and correct the training-inference mismatch in RL for LLMs."""
