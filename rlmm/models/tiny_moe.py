"""The built-in mixture-of-experts model: `model=tiny`'s twin with a sparse MLP (transformers' Qwen3-MoE).

Routing replay (issue 25) needs a policy whose routing is not trivial: each token's top-k experts, chosen by
a router that the sampler and the trainer compute in their own precision, can differ between the two and
change the token's log-prob by more than any rounding of the dense path. This is the same builder as
`TinyModel` (character tokenizer, warm start on the task, cache by a hash of every value, the default
configuration shipped in rlmm/models/builtin/ and checked against SHA256SUMS), with every MLP replaced by
`num_experts` SwiGLU experts of which `num_experts_per_tok` run per token.

The warm start adds a load-balancing loss per layer (`balance_loss`): with none the router may collapse
onto one or two experts, and routing would be trivial. It is computed only there (`output_router_logits=True`
in the warm start's forward); the saved config keeps `output_router_logits: false`, so inference does not
compute it. The build records each layer's expert load on held-out problems in rlmm_model.json
(`expert_load`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from rlmm.models.tiny import TinyModel, _sft_batch, build_char_tokenizer

# Problems of the task's test split whose routing `expert_load` counts.
EXPERT_LOAD_EXAMPLES = 500


class TinyMoeModel(TinyModel):
    """Build (once) and cache the built-in tiny Qwen3-MoE model, warm-started on the run's task.

    Args:
        hidden_size, num_layers, num_heads, num_kv_heads, max_position: as `TinyModel`.
        intermediate_size: the dense MLP of the layers in `mlp_only_layers` (none by default: then unused).
        num_experts: experts per sparse layer.
        num_experts_per_tok: experts each token runs (top-k of the router's softmax).
        moe_intermediate_size: each expert's SwiGLU width.
        norm_topk_prob: renormalise the top-k routing weights to sum to 1.
        router_aux_loss_coef: weight of the per-layer load-balancing loss (`balance_loss`) in the warm start
            (saved in the config too, where transformers would weight its own, pooled, loss with it).
        decoder_sparse_step: every this-many-th layer is sparse (1: all of them).
        mlp_only_layers: layer indices kept dense whatever `decoder_sparse_step` says.
        seed, warm_start_steps, warm_start_lr, warm_start_batch_size, cache_dir, rebuild: as `TinyModel`.
    """

    prefix = "tiny_moe"

    def __init__(self, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int, max_position: int, num_experts: int, num_experts_per_tok: int,
                 moe_intermediate_size: int, norm_topk_prob: bool, router_aux_loss_coef: float,
                 decoder_sparse_step: int, mlp_only_layers: list[int], seed: int, warm_start_steps: int,
                 warm_start_lr: float, warm_start_batch_size: int, cache_dir: str | None, rebuild: bool):
        super().__init__(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, max_position=max_position,
                         seed=seed, warm_start_steps=warm_start_steps, warm_start_lr=warm_start_lr,
                         warm_start_batch_size=warm_start_batch_size, cache_dir=cache_dir, rebuild=rebuild)
        mlp_only_layers = [int(layer) for layer in mlp_only_layers]  # a ListConfig from Hydra
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"model: num_experts_per_tok={num_experts_per_tok} must be between 1 and "
                             f"num_experts={num_experts}")
        if decoder_sparse_step < 1 or any(not 0 <= layer < num_layers for layer in mlp_only_layers):
            raise ValueError(f"model: decoder_sparse_step={decoder_sparse_step} must be >= 1 and mlp_only_layers="
                             f"{mlp_only_layers} layer indices below num_layers={num_layers}")
        # In the cache key with the dense keys: a MoE build never shares a name or a key with a dense one.
        self.arch.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         moe_intermediate_size=moe_intermediate_size, norm_topk_prob=norm_topk_prob,
                         router_aux_loss_coef=router_aux_loss_coef, decoder_sparse_step=decoder_sparse_step,
                         mlp_only_layers=mlp_only_layers)

    def _new_model(self, tokenizer):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        arch = self.arch
        config = Qwen3MoeConfig(
            **self._config_values(tokenizer), num_experts=arch["num_experts"],
            num_experts_per_tok=arch["num_experts_per_tok"], moe_intermediate_size=arch["moe_intermediate_size"],
            norm_topk_prob=arch["norm_topk_prob"], router_aux_loss_coef=arch["router_aux_loss_coef"],
            decoder_sparse_step=arch["decoder_sparse_step"], mlp_only_layers=arch["mlp_only_layers"],
            output_router_logits=False,
            # The experts loop: on CPU ~10x faster to train than transformers' default grouped_mm (0.29 s vs
            # 2.7 s a step at 64 x 14 tokens, same losses). Not saved: a loader picks its own.
            experts_implementation="eager")
        return Qwen3MoeForCausalLM(config)

    def _warm_start_objective(self):
        return BalancedLMObjective(self.arch["router_aux_loss_coef"], self.arch["num_experts_per_tok"])

    def _build(self, task, out: Path) -> dict:
        report = super()._build(task, out)
        report["expert_load"] = expert_load(out, task)
        return report


class BalancedLMObjective:
    """The warm start's objective: LM loss + router_aux_loss_coef x `balance_loss`.

    The LM loss is the one transformers computes from `labels` (`model.loss_function`); labels are not passed
    to the forward, because transformers would then add its own balance loss (below) to it."""

    def __init__(self, coef: float, top_k: int):
        self.coef, self.top_k = coef, top_k

    def __call__(self, model, input_ids, attention_mask, labels):
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
        lm_loss = model.loss_function(out.logits, labels, model.config.vocab_size)
        balance = balance_loss(out.router_logits, attention_mask, self.top_k)
        return lm_loss + self.coef * balance, {"lm_loss": lm_loss.item(), "router_aux_loss": balance.item()}


def balance_loss(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eqs. 4-6) in each sparse layer, averaged:

        L_bal = (1/L) sum_l E sum_e f_le P_le

    over the L sparse layers' router logits ([tokens, E] each, padding left out by `attention_mask`):
    f_le is the share of layer l's top-k assignments that go to expert e (sum_e f_le = 1; not differentiable),
    P_le expert e's mean router probability. 1 when the load is balanced (f = P = 1/E), up to E when one
    expert takes every token.

    Departs from transformers' `load_balancing_loss_func` (5.19), which pools the counts and probabilities of
    all layers before the product, so that layers favouring different experts cancel out (a warm start with it
    at coefficient 0.01 left experts with 0.2% of a layer's assignments and others with 35%, at a pooled loss
    of 2.012 against its minimum of 2; QwenLM/Qwen3 issue 1418), and counts assignments (sum_e f = k, so its
    minimum is k). With top-1 routing this is the paper's loss per layer."""
    keep = attention_mask.reshape(-1).bool()
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits[keep].float(), dim=-1)
        num_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices.reshape(-1)
        share = torch.bincount(chosen, minlength=num_experts).float() / chosen.numel()
        losses.append(num_experts * (share * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


@torch.no_grad()
def expert_load(path: Path, task, num_examples: int = EXPERT_LOAD_EXAMPLES) -> list[list[float]]:
    """Per sparse layer, the share of top-k assignments each expert gets over the target and prompt tokens
    of `num_examples` held-out problems (each row sums to 1; balanced: 1/num_experts each)."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    model.eval()
    config = model.config
    counts = None
    examples = task.examples("test", num_examples)
    for start in range(0, len(examples), 100):
        input_ids, _ = _sft_batch(tokenizer, task, examples[start:start + 100])
        mask = input_ids != tokenizer.pad_token_id
        router_logits = model(input_ids=input_ids, attention_mask=mask.long(), output_router_logits=True).router_logits
        chosen = [logits.topk(config.num_experts_per_tok, dim=-1).indices[mask.reshape(-1)] for logits in router_logits]
        batch = torch.stack([torch.bincount(c.reshape(-1), minlength=config.num_experts) for c in chosen])
        counts = batch if counts is None else counts + batch
    shares = counts.double() / counts.sum(dim=1, keepdim=True)
    return [[round(share, 4) for share in layer] for layer in shares.tolist()]
