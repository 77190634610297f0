"""Worker: make the benchmark's checkpoints (not timed).

"tiny": rlmm's built-in model as conf/train.yaml resolves it (built and warm-started once, then cached
under $RLMM_CACHE). Any other name: a random-init model of benchmarks.models.SIZES, built once under
$RLMM_CACHE/benchmarks/. For each precision, a copy whose config and weights are in that dtype, for TRL
(which, like vLLM with dtype=auto, takes the dtype from config.json); rlmm and the standalone parts load
the fp32 checkpoint and cast, as rlmm always does.
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import read_job, set_runtime_env, write_result

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def main() -> None:
    job = read_job()
    set_runtime_env(job.get("device", "cpu"))
    from hydra.utils import instantiate

    from benchmarks.models import sized_model, with_dtype
    from rlmm.config.options import to_container
    from rlmm.models.tiny import default_cache_dir

    work = default_cache_dir() / "benchmarks"
    work.mkdir(parents=True, exist_ok=True)
    name = job["model"]
    if job.get("model_path"):
        path = job["model_path"]
        info = {"source": "given"}
    elif name == "tiny":
        from benchmarks.rlmm_step import compose_train_config

        cfg, _ = compose_train_config([])
        path = instantiate(cfg.model).resolve(instantiate(cfg.task), to_container(cfg.task))
        info = json.loads((Path(path) / "rlmm_model.json").read_text())
    else:
        path, info = sized_model(name, work)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if "num_parameters" not in info:
        from transformers import AutoModelForCausalLM

        with __import__("torch").device("meta"):
            info["num_parameters"] = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    paths = {p: with_dtype(path, DTYPES[p], work) for p in job["precisions"]}
    write_result({"model": name, "model_path": path, "paths": paths, "info": info,
                  "architecture": {k: getattr(config, k, None) for k in (
                      "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size", "vocab_size", "tie_word_embeddings")}})


if __name__ == "__main__":
    main()
