"""Trainer backends (`trainer=` group). For now they score rollouts; training builds on them."""
