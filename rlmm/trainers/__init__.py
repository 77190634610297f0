"""Trainer backends (the `trainer=` group), each satisfying `rlmm.run.interfaces.Trainer`:

- `deepspeed_backend.DeepSpeedTrainer`: a DeepSpeed engine (ZeRO 0-3); its concerns in `deepspeed_config`,
  `deepspeed_groups`, `deepspeed_head`, `deepspeed_checkpoint`, `deepspeed_skip`, and every reach into
  DeepSpeed's internals in `deepspeed_internals` (checked against DeepSpeed 0.19.8).
- `fsdp_backend.FSDPTrainer`: PyTorch FSDP2 (`fully_shard` per decoder layer and at the root).
- `torch_backend.TorchTrainer`: plain PyTorch, a replica per rank.

Shared: `scoring` (log-probs of rollouts in micro-batches), `update` (`MicroBatchedUpdate`, the part of a
minibatch update every backend shares, and `minibatch_step`), `packing` (micro-batches and their layout),
`memory` (the per-update activation budget), `optim` (the learning-rate schedule).
"""
