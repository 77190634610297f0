"""One `rl_step` on replayed rollouts, each rank on its share of the prompts (`rank_share`), on every trainer
backend (token-level TIS, GRPO), and on the torch backend with the corrections that act on the whole batch or inside
the update and with PPO (`CASES`); rank 0 writes the new weights. Run under torchrun by test_update (2 ranks) and
called in-process by it (1 rank): the two must give the same update and log the same mismatch, correction and loss
metrics.

    torchrun --nproc_per_node 2 tests/ranks_step.py MODEL_PATH ROLLOUTS_JSON OUT_DIR [TRAINER_VALUES_JSON [ROUTING]]

ROUTING (none, r2, r3): an MoE model's routing replay (rlmm/mismatch/routing.py), the recorded rollouts carrying the
sampler's experts; r2 takes two epochs, so that its second update replays π_old's routing.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from rlmm.config.options import from_yaml
from rlmm.runtime.runtime_env import set_runtime_env

set_runtime_env()

import torch  # noqa: E402

from rlmm.policy.rollouts import Rollouts  # noqa: E402

BACKENDS = ("torch", "deepspeed", "fsdp")
# (name, correction, algo) beyond BACKENDS' TIS + GRPO, on the torch backend: each would differ on 2 ranks if it
# were computed on a rank's share alone (the 2026 methods of issue 34; PPO's advantage whitening)
CASES = (("opsm", "opsm", "grpo"), ("tv_trust", "tv_trust", "grpo"), ("m2po", "m2po+tis+normalize", "grpo"),
         ("ppo", "tis", "ppo"))


class ReplaySampler:
    """Hands out recorded rollouts: for each prompt asked for, the next recorded group drawn for it."""

    calls = 0
    needs_weights = False

    def __init__(self, recorded: dict):
        self.groups: list[tuple[list[int], list[int]]] = []  # (prompt ids, rows)
        for row, prompt in enumerate(recorded["prompt_ids"]):
            if self.groups and self.groups[-1][0] == prompt and len(self.groups[-1][1]) < recorded["group_size"]:
                self.groups[-1][1].append(row)
            else:
                self.groups.append((prompt, [row]))
        self.recorded = recorded

    def generate(self, prompt_ids, *, n=1, greedy=False, request_ids=None) -> Rollouts:
        routed = self.recorded.get("routed_experts")
        out = Rollouts([], [], [], [], routed_experts=None if routed is None else [])
        for prompt in prompt_ids:
            index = next(i for i, (ids, _) in enumerate(self.groups) if ids == prompt)
            for row in self.groups.pop(index)[1]:
                out.prompt_ids.append(self.recorded["prompt_ids"][row])
                out.response_ids.append(self.recorded["response_ids"][row])
                out.sampler_logprobs.append(torch.tensor(self.recorded["sampler_logprobs"][row]))
                out.finish_reasons.append("stop")
                if routed is not None:
                    out.routed_experts.append(torch.tensor(routed[row], dtype=torch.int16))
        return out

    def load_weights(self, state_dict) -> None:
        pass

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass


def step_on_share(model_path: str, recorded: dict, backend: str, scratch: Path, routing: str | None = None,
                  metrics: dict | None = None, correction: str = "tis", algorithm: str = "grpo",
                  **values) -> dict[str, torch.Tensor]:
    """This rank's trainer after one step on its share of the recorded prompts (SGD, token-level TIS, GRPO);
    `routing`: an MoE model's routing replay (none, r2 with two epochs, r3; None: rlmm's default, none without
    measuring); `metrics`: a dict that receives the step's metrics as `rlmm train` logs them (averaged over the
    ranks); `correction`: another option of conf/correction/ (test_update's settings for it), a stack too;
    `algorithm`: grpo or ppo (with an SGD critic, no warm-up); `values`: other trainer YAML values (e.g. a token
    budget, the micro-batch size)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rlmm.run.components import Components
    from rlmm.run.critic import NoCritic, ValueCritic
    from rlmm.run.step import rl_step
    from rlmm.runtime.collectives import mean_over_ranks
    from tests.test_update import GROUP, OPTIONS, OddLengthReward, algo, sgd_trainer, stacked_correction

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    task = from_yaml("task", "arithmetic", seed=0, careless_demos=0.0)
    examples = {e.prompt: e for e in task.examples("train", 64)}
    prompts = [examples[p] for p in recorded["prompts"]]
    trainer = sgd_trainer(backend, model_path, scratch, **values)
    replay = from_yaml("routing", routing or "none", measure=routing is not None, compare=False).bind(trainer.model)
    if algorithm == "ppo":
        rl = from_yaml("algo", "ppo", group_size=GROUP, critic_warmup_steps=0)
        torch.manual_seed(0)  # the value head is new: the same draw on every rank and in the 1-rank run
        critic = ValueCritic(sgd_trainer(backend, model_path, scratch, value_head=True, **values), warmup_steps=0)
    else:
        rl, critic = algo(epochs=2) if routing == "r2" else algo(), NoCritic()
    c = Components(task=OddLengthReward(task), tokenizer=AutoTokenizer.from_pretrained(model_path),
                   sampler=ReplaySampler(recorded), trainer=trainer, correction=stacked_correction(correction),
                   algo=rl, sampling=OPTIONS, routing=replay, critic=critic)
    try:
        logged = mean_over_ranks(rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=True))  # as rlmm.run.train
        assert logged["train/skipped"] == 0
        if metrics is not None:
            metrics.update(logged)
        return {k: v.detach().clone().contiguous() for k, v in trainer.state_dict().items()}
    finally:
        trainer.close()
        critic.close()


def main() -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from rlmm.runtime.devices import init_process_group

    model_path, replay, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    init_process_group()
    recorded = json.loads(replay.read_text())
    values = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    routing = sys.argv[5] if len(sys.argv) > 5 else None
    runs = [(backend, backend, "tis", "grpo") for backend in BACKENDS]
    if routing is None and not values:  # the routing and token-budget tests take BACKENDS' runs only
        runs += [(f"torch-{name}", "torch", correction, algorithm) for name, correction, algorithm in CASES]
    for name, backend, correction, algorithm in runs:
        metrics = {}
        weights = step_on_share(model_path, recorded, backend, out_dir, routing=routing, metrics=metrics,
                                correction=correction, algorithm=algorithm, **values)
        if dist.get_rank() == 0:
            save_file(weights, out_dir / f"{name}-{dist.get_world_size()}.safetensors")
            (out_dir / f"{name}-{dist.get_world_size()}.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
