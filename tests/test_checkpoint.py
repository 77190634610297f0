"""Checkpoints: a trainer restored from a checkpoint continues exactly as the one that wrote it."""
import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import Rollouts
from rlmm.run import checkpoint
from rlmm.trainers.update import minibatch_step
from tests.conftest import sampling


class RecordingSampler:
    """Stands in for the sampler: keeps the request counter and the weights it was sent."""

    def __init__(self):
        self.calls = 7
        self.weights = None

    def load_weights(self, weights):
        self.weights = {k: v.clone() for k, v in weights.items()}


def fixed_rollouts(model_path, task, rows=8):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    generator = torch.Generator().manual_seed(0)
    prompts = [tokenizer(e.prompt).input_ids for e in task.examples("train", rows)]
    responses = [torch.randint(3, len(tokenizer), (4,), generator=generator).tolist() for _ in prompts]
    return Rollouts(prompt_ids=prompts, response_ids=responses, sampler_logprobs=[torch.zeros(4) for _ in prompts],
                    finish_reasons=["length"] * rows)


def loss_fn(chunk, logprobs, entropy):
    advantages = torch.linspace(-1, 1, 8)[chunk].unsqueeze(1)
    loss = -(advantages * logprobs).sum() / logprobs.numel()
    return loss, {"loss": loss.item()}


def make_trainer(backend, model_path, dtype, stage):
    options = sampling(max_new_tokens=6)
    precision = SidePrecision(dtype, False)
    if backend in ("torch", "fsdp"):
        return from_yaml("trainer", backend, model_path=model_path, precision=precision, sampling=options,
                         micro_batch_size=4, lr=1e-3, warmup_steps=3)
    return from_yaml("trainer", "deepspeed", model_path=model_path, precision=precision, sampling=options,
                     micro_batch_size=4, zero_stage=stage, lr=1e-3, warmup_steps=3)


@pytest.mark.parametrize("backend,dtype,stage", [("deepspeed", "fp32", 0), ("deepspeed", "bf16", 0),
                                                 ("deepspeed", "fp32", 2), ("deepspeed", "fp32", 3),
                                                 ("torch", "fp32", 0), ("torch", "bf16", 0), ("torch", "fp16", 0),
                                                 ("fsdp", "fp32", 0), ("fsdp", "bf16", 0)])
def test_resumed_trainer_matches_uninterrupted(small_model_path, arithmetic_task, tmp_path, backend, dtype, stage):
    rollouts = fixed_rollouts(small_model_path, arithmetic_task)
    rows = list(range(len(rollouts)))
    trainer = make_trainer(backend, small_model_path, dtype, stage)
    sampler = RecordingSampler()
    try:
        for _ in range(2):
            minibatch_step(trainer, rollouts, rows, loss_fn)
        torch.manual_seed(123)
        path = checkpoint.save(tmp_path, step=2, trainer=trainer, sampler=sampler)
        after_save = torch.rand(3)
        lrs = [minibatch_step(trainer, rollouts, rows, loss_fn)["lr"] for _ in range(2)]
        uninterrupted = {k: v.clone() for k, v in trainer.state_dict().items()}
    finally:
        trainer.close()
    assert checkpoint.latest(tmp_path) == path
    assert lrs == pytest.approx([1e-3, 1e-3])  # the warm-up (3 steps) is over: the schedule was saved

    trainer = make_trainer(backend, small_model_path, dtype, stage)
    sampler = RecordingSampler()
    sampler.calls = 0
    try:
        state = checkpoint.load(path, trainer, sampler)
        assert torch.equal(torch.rand(3), after_save)  # torch's RNG continues where it was
        assert state["step"] == 2 and sampler.calls == 7
        assert sampler.weights is not None  # the sampler was sent the restored weights
        for _ in range(2):
            minibatch_step(trainer, rollouts, rows, loss_fn)
        resumed = trainer.state_dict()
        moved = max((resumed[k].float() - sampler.weights[k].float()).abs().max().item() for k in resumed)
        assert moved > 0  # the two updates after the resume really changed the weights
        for key, value in uninterrupted.items():
            assert torch.equal(resumed[key], value), key
    finally:
        trainer.close()


def test_only_the_newest_checkpoints_are_kept(small_model_path, arithmetic_task, tmp_path):
    trainer = make_trainer("torch", small_model_path, "fp32", 0)
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, step=step, trainer=trainer, sampler=RecordingSampler(), keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-000004", "step-000006"]
    assert checkpoint.latest(tmp_path).name == "step-000006"


def test_checkpoint_files_load_without_pickled_code(small_model_path, tmp_path):
    """Trainer state loads with torch.load(weights_only=True); the weights are safetensors."""
    trainer = make_trainer("deepspeed", small_model_path, "bf16", 0)
    try:
        path = checkpoint.save(tmp_path, step=1, trainer=trainer, sampler=RecordingSampler())
    finally:
        trainer.close()
    from safetensors.torch import load_file

    assert load_file(path / "model.safetensors")
    state = torch.load(path / "rank0.pt", weights_only=True)  # bf16's optimizer state needs no allow-list
    assert set(state) == {"trainer", "torch_rng"}


def test_two_fsdp_ranks_resume_from_their_own_shards(small_model_path, tmp_path):
    """torchrun, 2 gloo ranks, bf16 compute on fp32 shards: the run restored from a checkpoint takes the
    same steps as the one that wrote it, and each rank's file holds only its half of AdamW's moments."""
    import json

    from tests.conftest import torchrun

    torchrun(["tests/fsdp_resume.py", small_model_path, str(tmp_path)], timeout=600)
    outcome = json.loads((tmp_path / "result.json").read_text())
    assert outcome["keys"] > 0 and outcome["differing"] == []
    saved = checkpoint.latest(tmp_path)
    # The moments are in shards/ (torch.distributed.checkpoint), each chunk written by the rank that holds it.
    from torch.distributed.checkpoint import FileSystemReader

    layout = FileSystemReader(saved / checkpoint.SHARDS).read_metadata()
    moments = {key: meta for key, meta in layout.state_dict_metadata.items() if key.endswith("/exp_avg")}
    parameters = sum(t.numel() for t in load_weights(saved).values())
    assert sum(meta.size.numel() for meta in moments.values()) == parameters
    per_rank = [0, 0]
    for key, item in layout.storage_data.items():
        if key.fqn.endswith("/exp_avg"):
            per_rank[int(item.relative_path.split("_")[2])] += item.length  # files are __<rank>_0.distcp
    assert min(per_rank) > 0.4 * sum(per_rank)
    rank_file = torch.load(saved / "rank0.pt", weights_only=True)["trainer"]["optimizer"]["state"]
    assert all(entry["exp_avg"] == checkpoint.IN_SHARDS for entry in rank_file.values())


def load_weights(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")
