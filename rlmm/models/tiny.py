"""The built-in model: a tiny Qwen2 causal LM with a character-level tokenizer, warm-started on a task.

A random-init model samples near-uniform tokens, whose mismatch statistics look nothing like a real
policy's. A short supervised warm start on the task's training split makes the distributions peaked
(partially competent, not perfect), so that RL has something to improve and the mismatch is
measured where it matters: on confident tokens. The result is a normal Hugging Face checkpoint
directory that vLLM and transformers both load, cached under a hash of everything that determines it.

The default configuration's model ships with rlmm (rlmm/models/builtin/tiny-<key>/, and the MoE twin's,
rlmm/models/tiny_moe.py, in tiny_moe-<key>/; their files' SHA-256 in rlmm/models/builtin/SHA256SUMS)
and is used in place instead of being built: the warm start's bytes depend on the CPU's kernels (AVX2
and AVX-512 machines give different models, with different start accuracies), so a model built on
each machine would make every measured figure machine-specific.
`rebuild: true` builds it on this machine anyway, compares the bytes with the shipped ones, and uses
this machine's build.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import socket
import string
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Printable ASCII covers the arithmetic task and English word problems alike.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
# Bump when the builder's code changes what it produces, so stale caches are not reused (and rebuild the
# shipped model: see rlmm/models/builtin/README.md).
BUILDER_VERSION = 1
# Models shipped with rlmm, one directory per cache key, and the SHA-256 of each of their files.
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BUILTIN_SUMS = BUILTIN_DIR / "SHA256SUMS"
# The built-in tokenizers' chat templates (rlmm/conversation/chat.py renders prompts and conversations with them).
TEMPLATES = Path(__file__).resolve().parent / "templates"
# A warm start whose loss over its last tenth of steps is not below this fraction of its first step's did not
# learn: an error naming the model, not a useless model cached for every later run.
LOSS_CAME_DOWN = 0.95
# A model is built in models/.building-<host>-<pid>-<random> and renamed into place; a build whose builder
# was killed leaves that directory behind. One whose builder may still be running (on another host sharing
# the cache, or whose pid was reused here) is removed only once it is this old: no tiny model takes a day.
BUILDING = ".building-"
ABANDONED_AFTER_S = 24 * 3600


def default_cache_dir() -> Path:
    """$RLMM_CACHE (unset or empty: ~/.cache/rlmm); a one-line ValueError naming it where it cannot be a directory."""
    named = os.environ.get("RLMM_CACHE")
    if not named:
        return checked_cache_dir(Path.home() / ".cache" / "rlmm", "RLMM_CACHE (unset: ~/.cache/rlmm)",
                                 "remove that file, or point RLMM_CACHE at a directory")
    return checked_cache_dir(Path(named), "RLMM_CACHE", "point RLMM_CACHE at a directory, or unset it for ~/.cache/rlmm")


def checked_cache_dir(path: Path, named_by: str, instead: str) -> Path:
    """`path`, unless it or the nearest of its parents that exists is not a directory (a file): then a one-line
    ValueError naming `named_by` and saying what to do `instead` (mkdir would raise NotADirectoryError later, a
    traceback). A parent it may not look into is left to the write that needs it (a fault of the disk)."""
    for existing in (path, *path.parents):
        try:
            if existing.exists():
                break
        except OSError:
            return path
    if existing.is_dir():
        return path
    where = "is a file" if existing == path else f"is below {existing}, a file"
    raise ValueError(f"{named_by}: {path} {where}, not a directory ({instead})")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def shipped_digests() -> dict[str, dict[str, str]]:
    """{directory name: {file name: sha256}} from SHA256SUMS (`sha256sum` format, so that
    `cd rlmm/models/builtin && sha256sum -c SHA256SUMS` checks them too)."""
    shipped: dict[str, dict[str, str]] = {}
    if BUILTIN_SUMS.exists():
        for line in BUILTIN_SUMS.read_text().splitlines():
            digest, name = line.split(maxsplit=1)
            folder, _, file = name.lstrip("*").partition("/")
            shipped.setdefault(folder, {})[file] = digest
    return shipped


def verify(path: Path, digests: dict[str, str]) -> None:
    """Raise a one-line ValueError naming the first file of `path` whose SHA-256 is not the expected one."""
    for file, expected in digests.items():
        actual = sha256_of(path / file) if (path / file).exists() else "missing"
        if actual != expected:
            raise ValueError(f"{path / file}: sha256 {actual}, expected {expected} ({BUILTIN_SUMS}); "
                             "the file is corrupted: restore it (git checkout or reinstall rlmm)")


def building_prefix() -> str:
    """`.building-<host>-<pid>-`: the build directory names its builder, so a later build can tell when it is gone."""
    return f"{BUILDING}{socket.gethostname()}-{os.getpid()}-"


def builder_of(directory: Path) -> tuple[str, int] | None:
    """(host, pid) of a `.building-<host>-<pid>-<random>` directory (the host may hold dashes, the random part
    does not); None for a name without them, such as an older rlmm's `.building-<random>`."""
    parts = directory.name[len(BUILDING):].rsplit("-", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:  # not a pid any process can have
        return False
    return True


def is_abandoned(directory: Path, now: float) -> bool:
    """Whether the build in `directory` is dead: its builder, on this host, is gone; or whoever built it
    (another host's process, which this host cannot see) has not touched it for ABANDONED_AFTER_S."""
    builder = builder_of(directory)
    if builder is not None and builder[0] == socket.gethostname() and not is_alive(builder[1]):
        return True
    try:
        return now - directory.stat().st_mtime > ABANDONED_AFTER_S
    except FileNotFoundError:  # renamed into place, or removed, meanwhile
        return False


def remove_abandoned_builds(models: Path) -> None:
    """Remove the `.building-*` directories in `models` that no running build will finish."""
    now = time.time()
    for directory in models.glob(f"{BUILDING}*"):
        if is_abandoned(directory, now):
            log.info("removing %s: a model build whose builder is gone", directory)
            shutil.rmtree(directory, ignore_errors=True)


def build_char_tokenizer():
    """Character-level tokenizer in Hugging Face format (one token per character), with its chat template
    (rlmm/models/templates/char.jinja, saved beside it as chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    # <bos> is added by the tokenizer itself, so vLLM, transformers and rlmm encode prompts alike.
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>", padding_side="left")
    # A user turn renders as its text: a single-turn prompt is the same ids with the template as without it.
    tokenizer.chat_template = (TEMPLATES / "char.jinja").read_text()
    return tokenizer


class TinyModel:
    """Build (once) and cache the built-in tiny Qwen2 model, warm-started on the run's task.

    `TinyMoeModel` (rlmm/models/tiny_moe.py) builds its mixture-of-experts twin with this machinery: it
    replaces `prefix`, `_new_model` and `_warm_start_objective`.

    Args:
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position: the
            Qwen2 architecture (conf/model/tiny.yaml's values give about 3M parameters).
        seed: initialisation and data-order seed.
        warm_start_steps: supervised steps on the task's train split (0: random init).
        warm_start_lr: peak AdamW learning rate (linear warm-up, cosine decay).
        warm_start_batch_size: examples per supervised step.
        cache_dir: where built models live; null means $RLMM_CACHE or ~/.cache/rlmm.
        rebuild: for a configuration whose model ships with rlmm (rlmm/models/builtin/), build it on
            this machine (cached like any other) and use that build instead of the shipped one; a
            build whose weights differ from the shipped ones is reported with both digests. Other
            configurations are always built.
    """

    def __init__(self, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int, max_position: int, seed: int, warm_start_steps: int,
                 warm_start_lr: float, warm_start_batch_size: int, cache_dir: str | None, rebuild: bool):
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"model: hidden_size={hidden_size} must divide by num_heads={num_heads}, "
                             f"and num_heads by num_kv_heads={num_kv_heads}")
        self.arch = dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                         max_position=max_position)
        self.seed = seed
        self.warm_start = dict(steps=warm_start_steps, lr=warm_start_lr, batch_size=warm_start_batch_size)
        self.cache_dir = checked_cache_dir(Path(cache_dir), "model.cache_dir", "give a directory, or null for "
                                           "$RLMM_CACHE or ~/.cache/rlmm") if cache_dir else default_cache_dir()
        self.rebuild = rebuild

    # Builds are named <prefix>-<cache_key>, in the cache and in rlmm/models/builtin/.
    prefix = "tiny"

    @staticmethod
    def known_vocab_size() -> int:
        """The character tokenizer's vocabulary, the LM head's rows (`build_char_tokenizer`)."""
        return len(SPECIAL_TOKENS + CHARACTERS)

    def known_config(self) -> dict:
        """The config.json values the checks before a run read (rlmm/models/hybrid.py: which layers are recurrent),
        known before the model is built: a dense decoder's, none of them."""
        return {}

    def cache_key(self, task_config: dict) -> str:
        blob = json.dumps({"arch": self.arch, "seed": self.seed, "warm_start": self.warm_start,
                           "task": task_config, "version": BUILDER_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def resolve(self, task, task_config: dict) -> str:
        """Return the checkpoint directory: the shipped one (checked against its SHA-256) when this
        configuration's model ships with rlmm, else the cached build, building it if there is none. A multi-turn
        task's environment limits (`task.environment_keys`: its turn and context limits, its tools' timeout) change
        no demonstration, so they are not part of the model's name: `task.max_turns=2` trains the same model."""
        task_config = model_task_config(task, task_config)
        name = f"{self.prefix}-{self.cache_key(task_config)}"
        shipped = shipped_digests().get(name)
        if shipped is not None and not self.rebuild:
            verify(BUILTIN_DIR / name, shipped)
            return str(BUILTIN_DIR / name)
        path = self._cached_build(task, task_config, self.cache_dir / "models" / name)
        if shipped is not None:
            built = sha256_of(Path(path) / "model.safetensors")
            if built == shipped["model.safetensors"]:
                log.info("model.rebuild: this machine's build of %s has the shipped weights (sha256 %s)", name, built)
            else:
                log.warning("model.rebuild: this machine's build of %s differs from the shipped model "
                            "(model.safetensors sha256 %s here, %s shipped; CPU kernels differ); this run uses "
                            "this machine's build, the shipped one is used unless model.rebuild=true",
                            name, built, shipped["model.safetensors"])
        return path

    def _cached_build(self, task, task_config: dict, path: Path) -> str:
        """Build and warm-start the model into `path` unless it is already there."""
        remove_abandoned_builds(path.parent)
        if (path / "rlmm_model.json").exists():
            check_warm_start(json.loads((path / "rlmm_model.json").read_text()), path)  # one cached before the check
            return str(path)
        log.info("building the %s model in %s (cached for later runs)", self.prefix, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Build in a temporary directory and rename, so concurrent runs never see half a model, and one
        # killed half-way leaves only a directory that names its builder (removed by a later build).
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=building_prefix()))
        try:
            report = self._build(task, tmp)
            check_warm_start(report, path)  # before it is cached
            (tmp / "rlmm_model.json").write_text(json.dumps(
                {"arch": self.arch, "seed": self.seed, "warm_start": self.warm_start,
                 "task": task_config, **report}, indent=2))
            try:
                tmp.rename(path)
            except OSError:  # another process finished first; use theirs
                shutil.rmtree(tmp, ignore_errors=True)
                if not (path / "rlmm_model.json").exists():  # no: the rename itself failed
                    raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return str(path)

    def _build(self, task, out: Path) -> dict:
        tokenizer = self._new_tokenizer(task)
        torch.manual_seed(self.seed)
        model = self._new_model(tokenizer)
        report = warm_start(model, tokenizer, task, seed=self.seed, objective=self._warm_start_objective(),
                            **self.warm_start)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        report["num_parameters"] = sum(p.numel() for p in model.parameters())
        return report

    def _new_tokenizer(self, task):
        """The model's tokenizer (the character one; `TinyBpeModel`'s is trained on the task's text)."""
        return build_char_tokenizer()

    def _config_values(self, tokenizer) -> dict:
        """The Hugging Face config's values every built-in architecture shares."""
        return dict(
            vocab_size=len(tokenizer), hidden_size=self.arch["hidden_size"],
            intermediate_size=self.arch["intermediate_size"], num_hidden_layers=self.arch["num_layers"],
            num_attention_heads=self.arch["num_heads"], num_key_value_heads=self.arch["num_kv_heads"],
            max_position_embeddings=self.arch["max_position"], tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")

    def _new_model(self, tokenizer):
        """The randomly initialised model (under the seed `_build` set)."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(**self._config_values(tokenizer)))

    def _warm_start_objective(self):
        """What the warm start minimises (`warm_start`'s `objective`): the dense model's is the LM loss."""
        return lm_objective


def model_task_config(task, task_config: dict) -> dict:
    """The task's values that decide a warm-started model: all of them but its `environment_keys` (a multi-turn
    task's limits, which change no demonstration)."""
    return {k: v for k, v in task_config.items() if k not in getattr(task, "environment_keys", ())}


def check_warm_start(report: dict, path: Path) -> None:
    """Raise a one-line ValueError naming the model when its warm start's loss did not come down (its last
    tenth of steps not below LOSS_CAME_DOWN x the first step's loss, or not finite)."""
    first, last = report.get("initial_loss"), report.get("final_loss", report.get("warm_start_loss"))
    if first is None or last is None:  # no warm start (warm_start_steps: 0)
        return
    if not (math.isfinite(last) and last < LOSS_CAME_DOWN * first):
        raise ValueError(f"model: the warm start of {path.name} did not bring its loss down ({first:.3f} at the first "
                         f"step, {last:.3f} at the end; {path}): change model.warm_start_lr or "
                         "model.warm_start_steps, or the task")


def lm_objective(model, input_ids, attention_mask, labels):
    """The causal LM loss (mean cross-entropy over the labelled tokens), and no other term to report."""
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss, {}


def warm_start(model, tokenizer, task, *, steps: int, lr: float, batch_size: int, seed: int, objective) -> dict:
    """Supervised fine-tuning on `prompt + target + <eos>`, loss on the target tokens only.

    `objective(model, input_ids, attention_mask, labels)` returns the loss to minimise and a dict of other
    terms, whose moving averages the report adds (`lm_objective`; the MoE model's adds its balance loss)."""
    from tqdm.auto import tqdm

    if steps <= 0:
        return {"warm_start_loss": None}
    examples = task.examples("train", steps * batch_size)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(examples), generator=generator).tolist()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    model.train()
    loss_ema, initial_loss, last_losses, terms_ema = None, None, [], {}
    bar = tqdm(range(steps), desc="warm start", leave=False, disable=None)
    for step in bar:
        batch = [examples[i] for i in order[step * batch_size:(step + 1) * batch_size]]
        input_ids, labels = _sft_batch(tokenizer, task, batch)
        loss, terms = objective(model, input_ids, (input_ids != tokenizer.pad_token_id).long(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        initial_loss = loss.item() if initial_loss is None else initial_loss
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        for name, value in terms.items():
            terms_ema[name] = value if name not in terms_ema else 0.95 * terms_ema[name] + 0.05 * value
        if step >= steps - max(1, steps // 10):
            last_losses.append(loss.item())
        bar.set_postfix(loss=f"{loss_ema:.3f}")
    model.eval()
    return {"initial_loss": initial_loss, "warm_start_loss": loss_ema, "final_loss": sum(last_losses) / len(last_losses),
            **terms_ema}


def _sft_batch(tokenizer, task, batch):
    """Right-padded ids with labels -100 on the prompt and padding (no loss there): a single-turn task's prompt as
    the runs give it (through the chat template: the character model's renders it as its own text), its target and
    the end-of-sequence token; a multi-turn task's demonstration rendered whole, the loss on its assistant turns
    (each one's text and end-of-turn token, tokenized as the template renders them)."""
    from rlmm.conversation.chat import ChatTemplate
    from rlmm.conversation.token_path import assistant_spans
    from rlmm.tasks.environment import is_multi_turn

    chat = ChatTemplate(required=False).bind(tokenizer, "the built-in model", task)
    rows, labels = [], []
    for example in batch:
        if is_multi_turn(task):
            messages = task.demonstration(example)
            ids = chat.encode(chat.render(messages, generation_prompt=False))
            label = [-100] * len(ids)
            for start, end in assistant_spans(chat, messages, ids):
                label[start:end] = ids[start:end]
            rows.append(ids)
            labels.append(label)
            continue
        prompt = chat.ids(example)
        target = tokenizer.encode(task.target(example), add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    return ids, lab
