"""Greedy held-out accuracy during `rlmm train` (rank 0, every `train.eval_every` steps): of the deployed
policy (the sampler) and, with `train.eval_trained_weights`, of the trainer's own weights. `Evaluation` holds
one engine for the second: the trainer's module where it can generate as it is (`TrainerModuleEngine`), a copy
of its weights where it cannot (`TrainedCopyEngine`), or `NoTrainedWeights`, which evaluates nothing, when the
option is off."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from omegaconf import OmegaConf

from rlmm.config.options import CONF_DIR
from rlmm.policy.quantization import NoQuantization
from rlmm.policy.rollouts import Rollouts
from rlmm.run.components import Components


class Evaluation:
    """Greedy accuracy on held-out prompts, on rank 0, of two policies:

    - `eval/accuracy`: the deployed policy, i.e. the sampler (its kernels and precision, and the noise of
      `sampler.perturb`): what the run's rollouts come from;
    - `eval/accuracy_trained` (with `train.eval_trained_weights`): the trainer's weights as they are, with
      no perturbation, greedy in the trainer side's precision through transformers (`sampler=hf`'s
      `generate`, batch size as its YAML): on the trainer's own module where it holds the full weights and
      generates as a fresh load of the checkpoint would (`trainer.generates_in_place`: one rank of ZeRO-0/1/2
      or FSDP, any rank count of `trainer=torch`; `TrainerModuleEngine`), else on a copy built on rank 0 at
      the first call and loaded with the trainer's weights at each (ZeRO-3, FSDP over several ranks,
      padding-free attention; `TrainedCopyEngine`). Both give the same tokens and log-probs, bit for bit: the
      same weights in the same dtypes (the copy is loaded in `Components.trainer_precision`, fp32 head
      included) through the same kernels
      (tests/test_train.py::test_trained_accuracy_is_the_same_on_the_trainers_module_as_on_a_copy).

    Memory of `eval/accuracy_trained` on rank 0, beyond the generation's own (the KV cache, and the fp32
    logits of every generated position, [prompts, new tokens, vocabulary], twice while they are stacked: 1.2 GB
    for 8 x 128 tokens at a 152k vocabulary; the same on both paths): in place, nothing; the copy, a second
    model in the trainer side's precision for the rest of the run (parameters x 4 bytes in fp32, x 2 in 16
    bits, plus vocabulary x hidden x 4 for an fp32 head: 2.0 GB, or 1.0 + 0.5 GB, at 494M parameters), plus
    what reading sharded weights takes while it loads (`trainer.state_dict()`'s gathers, on every rank).

    A correction that trains better but deploys through a bad sampler shows in the second, not the first.
    Every rank calls it (reading the trainer's weights for the copy is a collective when they are sharded)."""

    def __init__(self, c: Components, examples: list, trained_weights: bool, rank: int):
        self.c, self.examples, self.rank = c, examples, rank
        self.trained: TrainedWeights = (NoTrainedWeights() if not trained_weights
                                        else TrainerModuleEngine(c) if c.trainer.generates_in_place
                                        else TrainedCopyEngine(c))

    def __call__(self) -> dict[str, float]:
        """{eval/accuracy, and eval/accuracy_trained when the trained weights are evaluated}: the figures on
        rank 0, NaN on the others (they take part in reading the trainer's weights, and log nothing)."""
        self.trained.sync(self.rank)
        keys = ("eval/accuracy", *self.trained.keys)
        if self.rank != 0:
            return dict.fromkeys(keys, float("nan"))
        return {"eval/accuracy": accuracy(self.c, self.c.sampler, self.examples),
                **self.trained.accuracies(self.c, self.examples)}

    def close(self) -> None:
        self.trained.close()
        self.trained = NoTrainedWeights()


class TrainedWeights:
    """What `eval/accuracy_trained` generates with: `sync` before each evaluation (every rank), then greedy
    generation (rank 0)."""

    keys: tuple[str, ...] = ("eval/accuracy_trained",)

    def sync(self, rank: int) -> None:
        raise NotImplementedError

    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False,
                 request_ids: list[int] | None = None) -> Rollouts:
        """Greedy rollouts (`request_ids`: ignored, greedy decoding draws nothing)."""
        raise NotImplementedError

    def accuracies(self, c: Components, examples: list) -> dict[str, float]:
        return {"eval/accuracy_trained": accuracy(c, self, examples)}

    def close(self) -> None:
        raise NotImplementedError


class NoTrainedWeights(TrainedWeights):
    """`train.eval_trained_weights=false`: the trained weights are not evaluated; no key, nothing to read."""

    keys = ()

    def sync(self, rank: int) -> None:
        pass

    def accuracies(self, c: Components, examples: list) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class TrainerModuleEngine(TrainedWeights):
    """Greedy generation with the trainer's own module (`trainer.model`), for a trainer whose module holds the
    full weights and generates as loaded (`trainer.generates_in_place`): no second copy of the model. Only
    rank 0 generates, and with no collective: the module is rank-local.

    Generating leaves training as it was (`generating`): each submodule's train/eval mode and each
    parameter's `requires_grad` come back, gradient checkpointing's flag is not touched, no gradient is made;
    the `OutputHead` returns logits, as it does whenever it is not `aimed_at` (scoring); the KV cache is the
    generate call's own and goes with it
    (tests/test_train.py::test_evaluating_on_the_trainers_module_leaves_training_as_it_was)."""

    def __init__(self, c: Components):
        from rlmm.samplers.hf import HFSampler

        self.trainer = c.trainer
        self.sampler = HFSampler.on_model(c.trainer.model, c.model_path, c.sampling, seed=0,
                                          batch_size=hf_batch_size())

    def sync(self, rank: int) -> None:
        """Nothing to load: the module is the trained weights."""

    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False,
                 request_ids: list[int] | None = None) -> Rollouts:
        with generating(self.trainer.model):
            return self.sampler.generate(prompt_ids, n=n, greedy=greedy)

    def close(self) -> None:
        self.sampler.close()  # drops its reference; the model is the trainer's


@contextmanager
def generating(model: torch.nn.Module):
    """`model` in eval mode, its parameters not requiring grad and autograd off, for the inside; then each
    submodule's train/eval mode and each parameter's `requires_grad` as they were. Gradient checkpointing's
    flag is left on or off: transformers reads it only in train mode (where it would also drop the KV cache).

    Why `requires_grad` too, when autograd is off anyway: torch's matmul lays out a non-contiguous input by
    whether an operand requires grad (aten's `should_fold`: folded into one matrix for a backward that will
    not come), and generate's first step projects such an input (the last position, sliced), so in fp32 the
    first token's log-probs would round differently from the copy's (1e-7 on the default's fp32 trainer).
    It comes back by name, on the parameters registered before and on those registered after: FSDP2 swaps
    in gathered copies for a forward and leaves its root unit's registered after it (resharded after a
    backward), so a flag restored on the sharded parameters alone would leave the embeddings and the head
    frozen in the next step
    (tests/test_train.py::test_evaluating_on_the_trainers_module_leaves_training_as_it_was)."""
    modes = [(module, module.training) for module in model.modules()]
    before = list(model.named_parameters())
    trainable = {name: parameter.requires_grad for name, parameter in before}
    model.eval()
    model.requires_grad_(False)
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training
        for name, parameter in [*before, *model.named_parameters()]:
            parameter.requires_grad_(trainable[name])


class TrainedCopyEngine(TrainedWeights):
    """Greedy generation with a copy of the trainer's weights (`sampler=hf`'s class, built here with its YAML's
    batch size, no perturbation, no quantization, in the trainer side's precision `Components.trainer_precision`),
    for a trainer whose module cannot generate as it is: its weights sharded over ranks (ZeRO-3, FSDP over several
    ranks) or its attention set for packed rows (`padding_free`). The copy is built on rank 0 at the first
    evaluation and loaded at each; every rank reads the weights (a collective when they are gathered from shards)."""

    def __init__(self, c: Components):
        self.c, self.sampler = c, None

    def sync(self, rank: int) -> None:
        weights = self.c.trainer.state_dict()
        if rank != 0:
            for _ in weights.values():  # take part in each tensor's gather
                pass
            return
        if self.sampler is None:
            from rlmm.samplers.hf import HFSampler

            self.sampler = HFSampler(self.c.model_path, self.c.trainer_precision, self.c.sampling, seed=0,
                                     batch_size=hf_batch_size(), perturb=0.0, quantization=NoQuantization())
        self.sampler.load_weights(weights)

    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False,
                 request_ids: list[int] | None = None) -> Rollouts:
        return self.sampler.generate(prompt_ids, n=n, greedy=greedy)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None


def hf_batch_size() -> int:
    """`sampler=hf`'s own batch size (its YAML, the one place it is written): both engines of
    `eval/accuracy_trained` generate in its batches, so they generate the same batches."""
    return OmegaConf.load(CONF_DIR / "sampler" / "hf.yaml").batch_size


def accuracy(c: Components, sampler, examples: list) -> float:
    """Greedy accuracy of `sampler` on `examples` (the task's reward of each greedy response, or of each greedy
    conversation's answer: rlmm/run/episodes.py)."""
    return c.episodes.accuracy(examples, c.episodes.sample(sampler, examples, greedy=True))
