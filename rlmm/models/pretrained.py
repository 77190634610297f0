"""`model=hf`: any Hugging Face causal LM, by local path or hub id."""
from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PretrainedModel:
    """Args:
        path: a checkpoint directory (with config.json) or a hub id such as Qwen/Qwen2.5-0.5B-Instruct.
    """

    def __init__(self, path: str):
        self.path = os.path.expanduser(path)
        local = Path(self.path)
        if local.exists():
            if not (local / "config.json").is_file():
                raise ValueError(f"model.path: '{path}' has no config.json (expected a Hugging Face checkpoint directory)")
        elif not HUB_ID.match(path) or path.startswith(("/", ".", "~")):
            raise ValueError(f"model.path: '{path}' does not exist and is not a Hugging Face hub id (owner/name)")

    def known_vocab_size(self) -> int | None:
        """The checkpoint's vocabulary where config.json is on disk (a hub id not fetched yet: None)."""
        if not (Path(self.path) / "config.json").is_file():
            return None
        from rlmm.models.loading import checkpoint_vocab_size

        return checkpoint_vocab_size(self.path)

    def known_config(self) -> dict | None:
        """config.json's values where it is on disk (a hub id not fetched yet: None, checked when the engines start)."""
        if not (Path(self.path) / "config.json").is_file():
            return None
        from rlmm.policy.quantization import text_config

        return text_config(self.path)

    def resolve(self, task=None, task_config: dict | None = None) -> str:
        """The path or hub id to load; a hub id must be downloadable or already cached."""
        if not Path(self.path).exists():
            from huggingface_hub import snapshot_download

            try:
                return snapshot_download(self.path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
            except Exception as err:  # offline, unknown repo, gated: say which, in one line
                hint = ""
                if type(err).__name__ == "LocalEntryNotFoundError":  # offline (HF_HUB_OFFLINE=1) and not cached
                    hint = f"; where there is internet, run: rlmm prefetch model=hf model.path={self.path}"
                raise ValueError(f"model.path: cannot fetch hub model '{self.path}' "
                                 f"({type(err).__name__}: {str(err).splitlines()[0][:200]}){hint}") from None
        return self.path
