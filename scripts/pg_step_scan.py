"""Does one policy-gradient step help? Scan the step size along the GRPO surrogate's gradient.

    .venv/bin/python scripts/pg_step_scan.py <model dir>

Samples 16 train prompts x 8 (transformers, fp32), computes the gradient g of the token-level GRPO
surrogate mean(A * log pi), moves the weights by eps * g / |g| and prints the exact expected reward
J = mean P("answer<eos>" | prompt) (teacher-forced) on the same prompts for several eps. Seen on the
1500-step tiny model: J 0.386 -> 0.387 (1e-4), 0.394 (1e-3), 0.409 (3e-3), 0.383 (1e-2): the gradient
points uphill, and the best step has norm ~0.003 (Adam at lr 1e-4 steps ~0.17).
"""
import os, sys
from rlmm.cli import set_runtime_env; set_runtime_env()
import torch
from transformers import AutoTokenizer, AutoModelForCausalLM
from rlmm.precision import SidePrecision
from rlmm.samplers.base import SamplingOptions
from rlmm.samplers.hf import HFSampler
from rlmm.trainers.scoring import response_logprobs
from rlmm.algos import GRPO
from rlmm.tasks import ArithmeticTask
M = sys.argv[1]
fp32 = SidePrecision("fp32", False)
opts = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, logprobs="processed")
task = ArithmeticTask(seed=0); tok = AutoTokenizer.from_pretrained(M)
model = AutoModelForCausalLM.from_pretrained(M, dtype=torch.float32); model.eval()
algo = GRPO(group_size=8, normalize_std=True, clip_low=0.2, clip_high=0.28, loss_aggregation="token", kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, epochs=1, minibatches=1)
sampler = HFSampler(M, fp32, opts, seed=0)
train = task.examples("train", 16)
r = sampler.generate([tok(e.prompt).input_ids for e in train], n=8)
texts = tok.batch_decode(r.response_ids, skip_special_tokens=True)
rewards = torch.tensor([task.reward(train[i // 8], t) for i, t in enumerate(texts)])
adv = algo.advantages(rewards)
print("reward", rewards.mean().item())
fwd = lambda ids, att, keep: model(input_ids=ids, attention_mask=att, logits_to_keep=keep, use_cache=False).logits
rows = list(range(len(r)))
def J():
    with torch.no_grad():
        tot = 0.0
        for e in train:
            p = tok(e.prompt).input_ids; a = tok(e.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
            lp = model(torch.tensor([p + a])).logits.log_softmax(-1)[0, len(p)-1:-1]
            tot += lp.gather(1, torch.tensor(a)[:, None]).sum().exp().item()
        return tot / len(train)
lp, _ = response_logprobs(fwd, r, rows, opts, tok.pad_token_id)
_, mask = r.padded_sampler_logprobs()
surrogate = (adv[:, None] * lp * mask).sum() / mask.sum()   # to maximise
model.zero_grad(); surrogate.backward()
g = {n: p.grad.clone() for n, p in model.named_parameters()}
gn = torch.sqrt(sum((v ** 2).sum() for v in g.values())).item()
print("grad norm", gn, "J0", J())
base = {n: p.detach().clone() for n, p in model.named_parameters()}
top = sorted(((v.norm().item(), n) for n, v in g.items()), reverse=True)[:5]
print("largest grads", top)
for eps in [1e-4, 1e-3, 3e-3, 1e-2]:
    with torch.no_grad():
        for n, p in model.named_parameters(): p.copy_(base[n] + eps * g[n] / gn)
    print("step norm", eps, "J", J())
