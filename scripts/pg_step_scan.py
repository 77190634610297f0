"""Does one policy-gradient step help, on the batch and on held-out problems? Scan step sizes.

    .venv/bin/python scripts/pg_step_scan.py <model dir> [--prompts 64] [--held-out 100]

Samples `--prompts` train prompts x 8 (transformers, fp32), computes the gradient g of the token-level
GRPO surrogate mean(A * log pi), moves the weights along several directions built from g, and prints
the exact expected reward J = mean P("answer<eos>" | prompt) (teacher-forced) on the same prompts and
on `--held-out` test prompts. Directions: g / |g| over all weights, over the LM head only, and
lr * sign(g) (Adam's first step) over all weights, over layers 2-3 + head, over the head only.

Seen on the 1500-step tiny model (issue 3), 64 prompts x 8, 100 held-out prompts (J batch / held out):
- no step: 0.352 / 0.332;
- on the batch every direction helps: sign(g) over all weights at lr 3e-5 gives 0.373;
- held out only the LM head helps: g/|g| on the head, step 0.3: 0.425 / 0.353, while every step over
  all weights makes it worse (g/|g| 0.01: 0.372 / 0.323; sign(g) lr 1e-5: 0.363 / 0.329, 1e-4:
  0.325 / 0.252): the body's gradient fits the batch's problems, not arithmetic.
"""
import argparse

from rlmm.runtime.runtime_env import set_runtime_env

set_runtime_env()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rlmm.algos import GRPO, ClippedSurrogate  # noqa: E402
from rlmm.config.options import from_yaml  # noqa: E402
from rlmm.policy.precision import SidePrecision  # noqa: E402
from rlmm.policy.rollouts import SamplingOptions  # noqa: E402
from rlmm.trainers.scoring import response_logprobs  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--prompts", type=int, default=64)
parser.add_argument("--held-out", type=int, default=100)
args = parser.parse_args()

options = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, logprobs="processed",
                          support=from_yaml("support", "sampler"))
task = from_yaml("task", "arithmetic", seed=0)
tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
algo = GRPO(group_size=8, normalize_std=True, objective=ClippedSurrogate(0.2, 0.28, None), loss_aggregation="token",
            kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, count_rejected=False, epochs=1, minibatches=1)
batch, held_out = task.examples("train", args.prompts), task.examples("test", args.held_out)

rollouts = from_yaml("sampler", "hf", model_path=args.model, precision=SidePrecision("fp32", False), sampling=options,
                     seed=0).generate(
    [tokenizer(e.prompt).input_ids for e in batch], n=8)
texts = tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
rewards = torch.tensor([task.reward(batch[i // 8], t) for i, t in enumerate(texts)])


def forward(ids, attention, keep):
    return model(input_ids=ids, attention_mask=attention, logits_to_keep=keep, use_cache=False).logits


logprobs, _ = response_logprobs(forward, rollouts, list(range(len(rollouts))), options, tokenizer.pad_token_id)
_, mask = rollouts.padded_sampler_logprobs()
surrogate = (algo.advantages(rewards)[:, None] * logprobs * mask).sum() / mask.sum()  # to maximise
model.zero_grad()
surrogate.backward()
grad = {n: p.grad.clone() for n, p in model.named_parameters()}
base = {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def expected_reward(examples) -> float:
    total = 0.0
    for e in examples:
        prompt = tokenizer(e.prompt).input_ids
        answer = tokenizer(e.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        logp = model(torch.tensor([prompt + answer])).logits.log_softmax(-1)[0, len(prompt) - 1:-1]
        total += logp.gather(1, torch.tensor(answer)[:, None]).sum().exp().item()
    return total / len(examples)


def scan(name, direction, sizes):
    rows = []
    for size in sizes:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n] + size * direction(n))
        rows.append(f"{size:g}: {expected_reward(batch):.4f} / {expected_reward(held_out):.4f}")
    print(f"{name:28s}", "   ".join(rows), flush=True)


def norm(keep) -> float:
    return torch.sqrt(sum((g ** 2).sum() for n, g in grad.items() if keep(n))).item()


def late(n: str) -> bool:
    return any(k in n for k in ("layers.2.", "layers.3.", "lm_head", "model.norm."))


print(f"reward {rewards.mean():.3f}  |g| {norm(lambda n: True):.3f}  largest: " + ", ".join(
    f"{n} {g.norm():.2f}" for n, g in sorted(grad.items(), key=lambda kv: -kv[1].norm())[:3]))
print("J on the batch / held out, by step size")
scan("none", lambda n: 0, [0])
full, head = norm(lambda n: True), norm(lambda n: n == "lm_head.weight")
scan("g/|g|, all weights", lambda n: grad[n] / full, [1e-3, 3e-3, 1e-2])
scan("g/|g|, LM head", lambda n: grad[n] / head if n == "lm_head.weight" else 0, [0.03, 0.1, 0.3, 1.0])
scan("sign(g), all weights", lambda n: grad[n].sign(), [3e-6, 1e-5, 3e-5, 1e-4])
scan("sign(g), layers 2-3 + head", lambda n: grad[n].sign() if late(n) else 0, [1e-5, 3e-5, 1e-4, 3e-4])
scan("sign(g), LM head", lambda n: grad[n].sign() if n == "lm_head.weight" else 0, [1e-4, 3e-4, 1e-3])
