"""Benchmark checkpoints: random-init Qwen2 models with a character tokenizer whose eos cannot be sampled.

Why: the benchmark wants responses of exactly `max_new_tokens` tokens, and rlmm's samplers have no
`min_tokens` / `ignore_eos` option (rlmm/samplers/vllm.py builds its own SamplingParams,
rlmm/samplers/hf.py its own GenerationConfig). So the checkpoint itself never stops: the tokenizer's
`<eos>` has the id `vocab_size`, one past the model's last output row, and every engine (vLLM,
transformers generate, TRL) runs every response to the length cap, with nothing patched and log-probs
under their usual definition. Everything else is rlmm's character tokenizer (rlmm.models.tiny):
`<pad>`, `<bos>` (added to every prompt), `<unk>`, then the printable characters.

A checkpoint with no eos at all would do for rlmm, but TRL's GRPOTrainer needs an eos id
(`torch.isin(completion_ids, [eos])`), so the eos exists; it is just unreachable.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

# name -> Qwen2 architecture (parameters counted with the 99-token character vocabulary unless padded).
# head_dim must be one vLLM's CPU attention supports (32, 64, 80, 96, ...).
SIZES: dict[str, dict] = {
    # a few seconds per step on 2 cores; only for checking that the suite runs
    "smoke": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128),
    # the dry run of benchmarks/gpu.sh: tied embeddings and a vocabulary padded past the tokenizer, as below
    "smoke-qwen": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                       vocab_size=1024, tie_word_embeddings=True),
    # ~25M parameters: "a larger model" of the CPU benchmark
    "large": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536),
    # Qwen2.5-0.5B's architecture (494M parameters with its 151936-token vocabulary, tied embeddings)
    "qwen2.5-0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                         vocab_size=151936, tie_word_embeddings=True),
}


def build_char_tokenizer_unreachable_eos(eos_id: int, fill: bool = False):
    """rlmm's character tokenizer (same pre-tokenizer, decoder and <bos> template) with <eos> at `eos_id`;
    with `fill`, every id below `eos_id` that is not a character is a token of its own (`<t123>`), so that
    every output row of the model decodes to text, as with a real tokenizer of that size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rlmm.models.tiny import CHARACTERS

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<bos>", "<unk>"] + CHARACTERS)}
    if eos_id < len(vocab):
        raise ValueError(f"eos id {eos_id} collides with the {len(vocab)} regular tokens")
    if fill:
        vocab.update({f"<t{i}>": i for i in range(len(vocab), eos_id)})
    vocab["<eos>"] = eos_id
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def build_bench_model(out: Path, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                       intermediate_size: int, vocab_size: int | None = None, tie_word_embeddings: bool = False,
                       max_position: int = 1024, dtype: str = "float32", seed: int = 0,
                       fill_vocab: bool = False) -> dict:
    """Save a random-init Qwen2 + char tokenizer with an unreachable eos into `out` (skipped when already
    there). `vocab_size`: model output rows (default: the 99 regular tokens; larger pads the vocabulary
    with ids no token string decodes to, like a real tokenizer's unused rows; `fill_vocab` gives each of them
    a token string instead). Returns the model's description (also written to out/bench_model.json)."""
    out = Path(out)
    marker = out / "bench_model.json"
    if marker.exists():
        return json.loads(marker.read_text())
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlmm.models.tiny import CHARACTERS

    vocab = max(vocab_size or 0, 3 + len(CHARACTERS))
    tokenizer = build_char_tokenizer_unreachable_eos(eos_id=vocab, fill=fill_vocab)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {"num_parameters": sum(p.numel() for p in model.parameters()), "vocab_size": vocab, "dtype": dtype,
            "tokenizer_vocab": len(tokenizer), "hidden_size": hidden_size, "num_layers": num_layers,
            "num_heads": num_heads, "num_kv_heads": num_kv_heads, "intermediate_size": intermediate_size,
            "tie_word_embeddings": tie_word_embeddings, "eos_token_id": tokenizer.eos_token_id,
            "eos_reachable": False, "seed": seed, "max_position": max_position}
    (tmp / "bench_model.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return info


def with_dtype(path: str | Path, dtype: str, work: Path) -> str:
    """A copy of checkpoint `path` whose weights and config are in `dtype` (vLLM with dtype=auto, as TRL
    starts it, and TRL's model loading both follow config.json). Returns `path` itself when it already is."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    current = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", "float32")).removeprefix("torch.")
    if current == dtype:
        return str(path)
    out = Path(work) / f"{Path(path).name}-{dtype}"
    if (out / "config.json").exists():
        return str(out)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
    for extra in ("bench_model.json", "rlmm_model.json"):
        if (Path(path) / extra).exists():
            shutil.copy(Path(path) / extra, tmp / extra)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return str(out)


def sized_model(name: str, work: Path) -> tuple[str, dict]:
    """The random-init model of SIZES[name] under `work` (built once) and its description: the folder name carries a
    hash of the architecture, so an edited SIZES entry is rebuilt."""
    key = hashlib.sha256(json.dumps(SIZES[name], sort_keys=True).encode()).hexdigest()[:8]
    path = Path(work) / f"{name}-{key}"
    return str(path), build_bench_model(path, **SIZES[name])
