"""A multi-turn RL step against a single-turn one of the same token count (issue 60, item 8): what a conversation's
turns cost rlmm's step beyond the tokens they hold.

    .venv/bin/python -m benchmarks.multi_turn [--turns 4] [--tokens-per-turn 16] [--prompts 8] [--group-size 4]
        [--steps 3] [--warmup 1] [--repeats 2] [--sampler vllm|hf] [--trainer deepspeed|torch]
        [--override KEY=VALUE ...] [--tool-reply 1776] [--corpus 4096] [--max-position 1024] [--dry]
        [--out FILE.json]

`--dry`: T 2, L 4, 2 prompts x 2 samples, 1 warm-up + 1 measured step, one run of each arm, a tokenizer trained on
256 problems, and (unless given) `sampler=hf trainer=torch precision=fp32`: the code path in about a minute
(tests/test_benchmarks.py).

The model: a random-init Qwen2 of the built-in BPE model's size (conf/model/tiny_bpe.yaml: hidden 256, 4 layers,
4 heads / 2 KV heads, MLP 704, vocabulary 320: 3.1M parameters) with the built-in BPE model's tokenizer and chat
template (`build_bpe_tokenizer(bpe_corpus(task=calculator, --corpus problems), 320)`, as benchmarks/retokenize_cost.py
builds it) and `--max-position` positions (1024, or more when a conversation needs them), saved to a temporary
folder and run as `model=hf`. Its special tokens cannot be sampled, so every turn generates exactly L tokens: the
end-of-turn token `<|end|>` is the eos, and it lies inside the vocabulary (the template writes it into every prompt,
so it must embed), which rules out benchmarks/models.py's eos one past the LM head; and setting the generation
config's eos to an unreachable id (benchmarks/retokenize_cost.py, for transformers' generate alone) does not stop
vLLM, which stops on the tokenizer's eos too (rlmm/samplers/vllm_internals.py::eos_ids). So the weights do it
(`build_model`): the residual stream carries a constant on its dimension 0 (every embedding row has `ANCHOR` there,
no layer writes it, no layer reads it), so the final norm's output has a large, nearly constant entry there, and the
LM head's rows of the 7 special tokens are `SPECIAL_WEIGHT` on it and 0 elsewhere: their log-probs lie near -27
(measured: -26 to -28), about 1e-12 a token, against the other 313 tokens' near-uniform -5 to -6. Nothing is patched
in either engine and log-probs keep their usual definition.

The two arms, built and run one after another in this process, each as `rlmm train` builds its components
(`build_components` on conf/train.yaml composed with the arm's overrides: `model=hf` on that folder, `logger=none`,
`algo.group_size`, `train.prompts_per_step`, `sampler=`, `trainer=` and any `--override`; the task node replaced by
the arm's benchmark task below and the config validated again, as `rlmm train task._target_=...` would be), then
`rl_update(c, SampledBatch.now(c, prompts, None), train.ratio_cap, train.reuse_training_forward)`, --warmup steps
thrown away and --steps measured, each step on the next --prompts training problems (the same problems for both
arms), over --repeats runs of each arm in ABBA order (multi, single, single, multi, ...: a drift of the machine's
load falls on both arms alike):

- `multi-turn` (`ToolTurnsTask`, rlmm/tasks/environment.py's MultiTurnTask, so rlmm's `MultiTurn` driver runs it with
  `token_path=tokens`, the default): the calculator task's prompts as the first user message; every policy turn is
  answered by a tool message (`--tool-reply`, "1776"), and `max_turns` = T, so each conversation is T policy turns
  of L sampled tokens with T - 1 tool replies between them, ending by `turns`. Its `max_context_tokens` is the
  longest first prompt plus the single-turn response length below (the single-turn arm's vLLM context, so both
  engines are sized alike; no conversation reaches it). `sampling.max_new_tokens` = L.
- `single-turn` (`OneResponseTask`, a plain task: rlmm's `SingleTurn`): the same first prompts (one user message,
  the same template), one response per row of R = T (L + 1) + (T - 1) E tokens (`sampling.max_new_tokens` = R), E
  the environment's ids between two turns under `token_path=tokens` (`environment_ids`: the newline after `<|end|>`,
  `<|tool|>`, the reply, `<|end|>`, a newline, `<|assistant|>`: 7 ids for "1776"), so that every trainer row (prompt
  + response) is as long as the multi-turn row of the same prompt.

The multi-turn sampler adapter (`TurnEnds`, benchmark-local): rlmm's driver ends a conversation whose turn stops
by length (no end-of-turn token: `finish = "length"`, its text the answer, rlmm/run/episodes.py), and this model
never samples its end-of-turn token. So the adapter wraps the built sampler's `generate` and, for every sampled
(not greedy) row it returns, appends the tokenizer's eos id (`<|end|>`) to `response_ids`, a log-prob of 0 (what
the sampler would report for a token drawn with certainty) to `sampler_logprobs`, and reports the turn as finished
(`"stop"`). What that changes: each turn holds L + 1 tokens (L drawn by the engine, 1 added, never computed by the
engine's forward: the next turn's prefill reads it, as it reads a sampled `<|end|>`), the conversation goes on to
the environment instead of ending after its first turn, and the added token is a trained, sampled position (in the
row's `sampled` mask) whose sampler log-prob 0 is not the engine's (the trainer's is about -27, so the mismatch
metrics of those positions are meaningless; no time depends on them). The single-turn arm's sampler is wrapped
only to time its `generate` (`end_turns=False`: nothing changed). Rewards are 0 (random text), so GRPO's advantages
and the loss are 0, and every forward, backward and optimizer step still runs in full (benchmarks/README.md's
random models).

Reported per arm (medians over the measured steps of every run): the step's own timers (`perf/generate_seconds`,
`perf/reward_seconds`, `perf/train_seconds`, `perf/weight_sync_seconds`, `perf/trainer_logprobs_seconds` where a
scoring pass ran), the step's wall time (`SampledBatch.now` + `rl_update`) and this process's CPU time over it,
and inside generation: the sampler's `generate` calls (`sampler`: the engine and rlmm's sampler code around it) and
the multi-turn token path's bookkeeping (`token_path`: `TokenInTokenOut.next_prompt` after each tool reply,
`.trained` at the end, and `turn_drift`, which `MultiTurn` runs on every conversation; timed by wrapping the
episodes' token path instance and `rlmm.run.episodes.turn_drift`, restored afterwards); the rest of `generate` is
the driver's own (decoding each turn to text, the environment's reply, the rollouts' assembly). Token counts per
row, checked on every step (a step whose rows break them raises): sampled tokens (the positions trained: the
multi-turn arm's T (L + 1) of which T added eos, the single-turn arm's R), engine tokens (what the engine drew:
T L and R), and row tokens (prompt + response, equal in both arms). The token path's cost as turns grow, per path
and against generation: benchmarks/retokenize_cost.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import git_commit, machine_info, package_versions, set_runtime_env, write_record

ARMS = ("multi-turn", "single-turn")
# conf/model/tiny_bpe.yaml's sizes
ARCH = {"vocab_size": 320, "hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
        "intermediate_size": 704}
ANCHOR, SPECIAL_WEIGHT = 2.0, -1.5  # the residual stream's constant, and the special tokens' LM head weight on it
STAGES = ("generate", "reward", "trainer_logprobs", "train", "weight_sync")
DRY = {"turns": 2, "tokens_per_turn": 4, "prompts": 2, "group_size": 2, "steps": 1, "warmup": 1, "repeats": 1,
       "corpus": 256}


class ToolTurnsTask:
    """A multi-turn task (rlmm/tasks/environment.py's MultiTurnTask) whose environment answers every policy turn with
    the same tool message, for `max_turns` turns: each conversation takes exactly `max_turns` policy turns. Its
    prompts are the calculator task's (conf/task/calculator.yaml, `seed`); its reward is 0."""

    tools = None
    environment_keys = ("max_turns", "max_context_tokens")

    def __init__(self, seed: int, max_turns: int, max_context_tokens: int, tool_reply: str):
        self.problems = OneResponseTask(seed)
        self.max_turns, self.max_context_tokens, self.tool_reply = max_turns, max_context_tokens, tool_reply

    def examples(self, split: str, n: int) -> list:
        return self.problems.examples(split, n)

    def reward(self, example, completion: str) -> float:
        return 0.0

    def first_messages(self, example) -> list[dict]:
        return [{"role": "user", "content": example.prompt}]

    def reply(self, example, messages: list[dict]):
        from rlmm.tasks.environment import Reply

        return Reply({"role": "tool", "content": self.tool_reply})

    def demonstration(self, example) -> list[dict]:
        return self.first_messages(example) + [{"role": "assistant", "content": example.answer}]


class OneResponseTask:
    """A single-turn task: the calculator task's prompts (conf/task/calculator.yaml, `seed`), one response each,
    reward 0."""

    def __init__(self, seed: int):
        from rlmm.config.options import from_yaml

        self.calculator = from_yaml("task", "calculator", seed=seed)

    def examples(self, split: str, n: int) -> list:
        return self.calculator.examples(split, n)

    def reward(self, example, completion: str) -> float:
        return 0.0

    def target(self, example) -> str:
        return example.answer


class TurnEnds:
    """The built sampler, its `generate` timed; with `end_turns`, every sampled row it returns gets the eos id
    appended (log-prob 0) and the finish reason "stop" (module docstring: what this changes and why). Everything
    else is the sampler's own."""

    def __init__(self, sampler, eos_id: int, end_turns: bool):
        self.wrapped, self.eos_id, self.end_turns = sampler, eos_id, end_turns
        self.bench = {"sampler_seconds": 0.0, "sampler_calls": 0, "engine_tokens": 0, "added_eos": 0}

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    def generate(self, prompt_ids, **kwargs):
        import torch

        start = time.perf_counter()
        out = self.wrapped.generate(prompt_ids, **kwargs)
        self.bench["sampler_seconds"] += time.perf_counter() - start
        self.bench["sampler_calls"] += 1
        self.bench["engine_tokens"] += sum(len(r) for r in out.response_ids)
        if not self.end_turns or kwargs.get("greedy"):
            return out
        if out.kept_tokens is not None or out.routed_experts is not None:
            raise RuntimeError("TurnEnds: a truncating or routing-capturing sampler (kept sets, experts per position) "
                               "is not supported: its appended eos would need them too")
        for i, ids in enumerate(out.response_ids):
            if out.finish_reasons[i] != "length" or self.eos_id in ids:
                raise RuntimeError(f"TurnEnds: row {i} stopped by itself ({out.finish_reasons[i]}, {len(ids)} tokens): "
                                   f"the benchmark model's eos was sampled")
            out.response_ids[i] = ids + [self.eos_id]
            out.sampler_logprobs[i] = torch.cat([out.sampler_logprobs[i], torch.zeros(1)])
            out.finish_reasons[i] = "stop"
            self.bench["added_eos"] += 1
        return out


def build_model(path: str, tokenizer, max_position: int, seed: int = 0) -> dict:
    """Save a random-init Qwen2 of ARCH's sizes with `tokenizer` into `path`, its special tokens unsampleable (module
    docstring); its description."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=ARCH["vocab_size"], hidden_size=ARCH["hidden_size"],
                         intermediate_size=ARCH["intermediate_size"], num_hidden_layers=ARCH["num_layers"],
                         num_attention_heads=ARCH["num_heads"], num_key_value_heads=ARCH["num_kv_heads"],
                         max_position_embeddings=max_position, tie_word_embeddings=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    specials = sorted(tokenizer.all_special_ids)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = ANCHOR  # a constant on dimension 0 of the residual stream
        for layer in model.model.layers:  # which no layer writes (its output projections' row 0) nor reads
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
            layer.input_layernorm.weight[0] = 0
            layer.post_attention_layernorm.weight[0] = 0
        model.lm_head.weight[:, 0] = 0
        model.lm_head.weight[specials] = 0
        model.lm_head.weight[specials, 0] = SPECIAL_WEIGHT
        probe = torch.randint(len(specials), ARCH["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(0))
        logprobs = model(probe).logits.log_softmax(-1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    info = {"num_parameters": sum(p.numel() for p in model.parameters()), **ARCH, "max_position": max_position,
            "special_ids": specials, "eos_token_id": tokenizer.eos_token_id,
            "special_logprob_max": logprobs[..., specials].max().item(),
            "other_logprob_range": [logprobs[..., len(specials):].min().item(),
                                    logprobs[..., len(specials):].max().item()]}
    # rlmm's mark of a model it built: its tokenizer is read as tokenizer.json says (rlmm/models/loading.py's
    # load_tokenizer), not as transformers' Qwen2Tokenizer, which re-splits the BPE model's text into other ids
    (Path(path) / "rlmm_model.json").write_text(json.dumps({"benchmark": "benchmarks/multi_turn.py", **info}))
    return info


def compose(overrides: list[str], task: dict):
    """conf/train.yaml as `rlmm train` composes it with `overrides`, its task node replaced by `task`, validated."""
    from omegaconf import OmegaConf, open_dict

    from benchmarks.rlmm_step import compose_train_config
    from rlmm.config.options import validate

    cfg, choices = compose_train_config(overrides)
    with open_dict(cfg):
        cfg.task = OmegaConf.create(task)
    choices["task"] = task["_target_"]
    validate(cfg, choices)
    return cfg, choices


class Bookkeeping:
    """Times the multi-turn token path's calls (its instance's `next_prompt`, `trained`) and `turn_drift` (the name
    rlmm.run.episodes calls) while inside; restores them on leaving."""

    def __init__(self, episodes):
        self.episodes = episodes
        self.seconds = {"next_prompt": 0.0, "trained": 0.0, "turn_drift": 0.0}

    def _timed(self, name, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed

    def __enter__(self):
        import rlmm.run.episodes as episodes_module

        self.module = episodes_module
        path = getattr(self.episodes, "path", None)
        if path is not None:
            path.next_prompt = self._timed("next_prompt", path.next_prompt)
            path.trained = self._timed("trained", path.trained)
        self.turn_drift = episodes_module.turn_drift
        episodes_module.turn_drift = self._timed("turn_drift", self.turn_drift)
        return self

    def __exit__(self, *exc):
        self.module.turn_drift = self.turn_drift
        path = getattr(self.episodes, "path", None)
        if path is not None:
            del path.next_prompt, path.trained

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return out


def run_arm(arm: str, cfg, examples: list, shape: dict, args) -> tuple[list[dict], float]:
    """Build the arm's components, run --warmup + --steps steps, check each step's rows, close: the measured steps
    and the build's seconds."""
    import torch

    from rlmm.run.components import build_components
    from rlmm.run.step import SampledBatch, rl_update

    multi = arm == "multi-turn"
    P, T, L, R = args.prompts, args.turns, args.tokens_per_turn, shape["response_tokens"]
    torch.manual_seed(cfg.seed)
    built = time.perf_counter()
    c = build_components(cfg, lambda task: examples, max_rows=P * args.group_size)
    build_seconds = time.perf_counter() - built
    sampler = TurnEnds(c.sampler, c.tokenizer.eos_token_id, end_turns=multi)
    c.sampler = sampler
    if multi != c.episodes.multi_turn:
        raise RuntimeError(f"{arm}: rlmm built {type(c.episodes).__name__} episodes")
    steps = []
    try:
        with Bookkeeping(c.episodes) as bookkeeping:
            for step in range(args.warmup + args.steps):
                prompts = examples[step * P:(step + 1) * P]
                first = [c.prompts.ids(e) for e in prompts]
                before = dict(sampler.bench)
                bookkeeping.take()
                start, cpu = time.perf_counter(), time.process_time()
                batch = SampledBatch.now(c, prompts, None)
                metrics = rl_update(c, batch, cfg.train.ratio_cap, cfg.train.reuse_training_forward)
                wall, cpu = time.perf_counter() - start, time.process_time() - cpu
                counts = {k: sampler.bench[k] - before[k] for k in before}
                rows = row_counts(batch.rollouts, first, args.group_size)
                check_rows(arm, rows, counts, T, L, R)
                perf = {k: metrics[f"perf/{k}_seconds"] for k in STAGES if f"perf/{k}_seconds" in metrics}
                book = bookkeeping.take()
                record = {"step": step, "measured": step >= args.warmup, "wall": wall, "cpu": cpu, **perf,
                          "sampler": counts["sampler_seconds"], "token_path": sum(book.values()), "bookkeeping": book,
                          "sampler_calls": counts["sampler_calls"], "engine_tokens": counts["engine_tokens"],
                          "added_eos": counts["added_eos"], "rows": rows,
                          "turns_mean": metrics.get("conversation/turns_mean"),
                          "frac_turns": metrics.get("conversation/frac_turns"),
                          "response_length_mean": metrics["rollout/response_length_mean"],
                          "train_skipped": metrics["train/skipped"]}
                record["other"] = wall - sum(perf.values())
                steps.append(record)
                print(f"{arm} step {step + 1}/{args.warmup + args.steps}: {wall:.3f} s (generate "
                      f"{perf['generate']:.3f}, train {perf['train']:.3f}) "
                      f"{'measured' if record['measured'] else 'warm-up'}", flush=True)
    finally:
        c.close()
    return [s for s in steps if s["measured"]], build_seconds


def row_counts(rollouts, first_prompts: list[list[int]], group_size: int) -> dict:
    """Per row of a step's rollouts: the first prompt's tokens, the response's, the sampled ones, the row's."""
    prompt = [len(p) for p in rollouts.prompt_ids]
    response = [len(r) for r in rollouts.response_ids]
    sampled = response if rollouts.sampled is None else [int(s.sum()) for s in rollouts.sampled]
    return {"rows": len(response), "prompt": prompt, "response": response, "sampled": sampled,
            "row": [p + r for p, r in zip(prompt, response)],
            "first_prompt": [len(first_prompts[i // group_size]) for i in range(len(response))],
            "finish": sorted(set(rollouts.finish_reasons)),
            "turns": None if rollouts.conversations is None else sorted({c["turns"] for c in rollouts.conversations})}


def check_rows(arm: str, rows: dict, counts: dict, T: int, L: int, R: int) -> None:
    """Raise where a step's rows are not what the arm must give (module docstring)."""
    n = rows["rows"]
    want = {"prompt": rows["first_prompt"], "response": [R] * n, "row": [p + R for p in rows["first_prompt"]]}
    if arm == "multi-turn":
        want.update(sampled=[T * (L + 1)] * n, finish=["turns"], turns=[T])
        want_counts = {"sampler_calls": T, "engine_tokens": n * T * L, "added_eos": n * T}
    else:
        want.update(sampled=[R] * n, finish=["length"], turns=None)
        want_counts = {"sampler_calls": 1, "engine_tokens": n * R, "added_eos": 0}
    wrong = {k: (rows[k], v) for k, v in want.items() if rows[k] != v}
    wrong.update({k: (counts[k], v) for k, v in want_counts.items() if counts[k] != v})
    if wrong:
        raise RuntimeError(f"{arm}: the step's rows are not the benchmark's shape (got, wanted): {wrong}")


def summarize(arm_steps: list[dict]) -> dict:
    """Medians over an arm's measured steps (every run), and its per-row token counts."""
    keys = ["wall", "cpu", *STAGES, "sampler", "token_path", "other"]
    out = {k: statistics.median(s[k] for s in arm_steps) for k in keys if all(k in s for s in arm_steps)}
    out.update({f"bookkeeping_{k}": statistics.median(s["bookkeeping"][k] for s in arm_steps)
                for k in arm_steps[0]["bookkeeping"]})
    out["driver"] = statistics.median(s["generate"] - s["sampler"] - s["token_path"] for s in arm_steps)
    out["wall_min"], out["wall_max"] = min(s["wall"] for s in arm_steps), max(s["wall"] for s in arm_steps)
    rows = arm_steps[0]["rows"]
    out.update(rows=rows["rows"], sampler_calls=arm_steps[0]["sampler_calls"],
               sampled_tokens_per_row=statistics.mean(rows["sampled"]),
               engine_tokens_per_row=arm_steps[0]["engine_tokens"] / rows["rows"],
               added_eos_per_row=arm_steps[0]["added_eos"] / rows["rows"],
               row_tokens_per_row=statistics.mean(rows["row"]), prompt_tokens_per_row=statistics.mean(rows["prompt"]),
               response_tokens_per_row=statistics.mean(rows["response"]),
               sampled_tokens_per_step=sum(rows["sampled"]), row_tokens_per_step=sum(rows["row"]),
               steps_measured=len(arm_steps))
    return out


def table(summary: dict) -> str:
    base = summary.get("single-turn", {}).get("wall")
    lines = ["| arm | rows | generate calls | sampled tokens / row (drawn + added eos) | row tokens / row | "
             "generate s | of which sampler s | of which token path s | reward s | train s | weight sync s | "
             "step s | step CPU s | step / single-turn |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, s in summary.items():
        sampled = f"{s['sampled_tokens_per_row']:g} ({s['engine_tokens_per_row']:g} + {s['added_eos_per_row']:g})"
        ratio = f"{s['wall'] / base:.2f}" if base else "-"
        lines.append(f"| {arm} | {s['rows']} | {s['sampler_calls']} | {sampled} | {s['row_tokens_per_row']:g} | "
                     f"{s['generate']:.3f} | {s['sampler']:.3f} | {s['token_path']:.4f} | {s['reward']:.4f} | "
                     f"{s['train']:.3f} | {s['weight_sync']:.3f} | {s['wall']:.3f} | {s['cpu']:.3f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multi_turn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4, help="T: policy turns per conversation")
    parser.add_argument("--tokens-per-turn", type=int, default=16, help="L: tokens the engine draws per turn")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (train.prompts_per_step)")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt (algo.group_size)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run of an arm")
    parser.add_argument("--warmup", type=int, default=1, help="steps run and thrown away first, per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, in ABBA order")
    parser.add_argument("--sampler", default=None, help="sampler= (default vllm; hf with --dry)")
    parser.add_argument("--trainer", default=None, help="trainer= (default deepspeed; torch with --dry)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for both arms (e.g. precision=fp32)")
    parser.add_argument("--tool-reply", default="1776", help="the environment's tool message after every turn")
    parser.add_argument("--corpus", type=int, default=4096, help="training problems the BPE tokenizer is trained on")
    parser.add_argument("--max-position", type=int, default=1024, help="the model's positions (raised when needed)")
    parser.add_argument("--dry", action="store_true",
                        help=f"tiny sizes, about a minute ({DRY}; given flags ignored), sampler=hf trainer=torch "
                             f"precision=fp32 unless given")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.dry:
        for key, value in DRY.items():
            setattr(args, key, value)
    args.sampler = args.sampler or ("hf" if args.dry else "vllm")
    args.trainer = args.trainer or ("torch" if args.dry else "deepspeed")
    if args.dry and not any(o.startswith("precision=") for o in args.override):
        args.override = ["precision=fp32", *args.override]  # transformers' bf16 generate crawls on an AVX2 CPU
    if min(args.turns, args.tokens_per_turn, args.prompts, args.group_size, args.steps, args.repeats) < 1 \
            or args.warmup < 0:
        parser.error("--turns, --tokens-per-turn, --prompts, --group-size, --steps, --repeats >= 1; --warmup >= 0")
    set_runtime_env()
    from benchmarks.retokenize_cost import build_chat
    from rlmm.conversation.token_path import environment_ids

    started = time.perf_counter()
    T, L = args.turns, args.tokens_per_turn
    task, tokenizer, chat = build_chat(args.corpus)
    examples = task.examples("train", (args.warmup + args.steps) * args.prompts)
    exchange = [{"role": "user", "content": examples[0].prompt}, {"role": "assistant", "content": "x"},
                {"role": "tool", "content": args.tool_reply}]
    between = len(environment_ids(chat, exchange))  # E: the environment's ids between two turns
    response = T * (L + 1) + (T - 1) * between  # R
    longest = max(len(chat.ids(e)) for e in examples)
    context = longest + response
    max_position = max(args.max_position, context + 1)
    shape = {"turns": T, "tokens_per_turn": L, "environment_tokens": between, "response_tokens": response,
             "longest_first_prompt": longest, "max_context_tokens": context}
    common = ["logger=none", f"train.prompts_per_step={args.prompts}", f"algo.group_size={args.group_size}",
              f"sampler={args.sampler}", f"trainer={args.trainer}", f"train.steps={args.warmup + args.steps}",
              *args.override]
    tasks = {"multi-turn": {"_target_": "benchmarks.multi_turn.ToolTurnsTask", "seed": task.seed, "max_turns": T,
                            "max_context_tokens": context, "tool_reply": args.tool_reply},
             "single-turn": {"_target_": "benchmarks.multi_turn.OneResponseTask", "seed": task.seed}}
    new_tokens = {"multi-turn": L, "single-turn": response}
    overrides = {arm: common + ["model=hf", f"sampling.max_new_tokens={new_tokens[arm]}"] for arm in ARMS}
    order = []
    for repeat in range(args.repeats):
        order += list(ARMS) if repeat % 2 == 0 else list(ARMS)[::-1]
    runs = []
    with tempfile.TemporaryDirectory(prefix="rlmm-multi-turn-") as folder:
        model = build_model(folder, tokenizer, max_position)
        configs = {arm: compose(overrides[arm] + [f"model.path={folder}"], tasks[arm]) for arm in ARMS}
        for index, arm in enumerate(order):
            load = os.getloadavg()[0]
            cfg, choices = configs[arm]
            steps, build_seconds = run_arm(arm, cfg, examples, shape, args)
            runs.append({"arm": arm, "run": index, "steps": steps, "build_seconds": build_seconds, "load_before": load,
                         "load_after": os.getloadavg()[0], "choices": choices})
    summary = {arm: summarize([s for r in runs if r["arm"] == arm for s in r["steps"]]) for arm in ARMS}
    for arm in ARMS:
        summary[arm]["vs_single_turn"] = summary[arm]["wall"] / summary["single-turn"]["wall"]
        summary[arm]["token_path_share_of_step"] = summary[arm]["token_path"] / summary[arm]["wall"]
    text = table(summary)
    print(text)
    record = {"args": vars(args), "machine": machine_info(), "versions": package_versions(sys.executable),
              "commit": git_commit(), "model": model, "shape": shape, "tokenizer_vocab": len(tokenizer),
              "overrides": overrides,
              "tasks": tasks,
              "order": order, "summary": summary, "runs": runs, "table": text,
              "wall_seconds": time.perf_counter() - started,
              "command": "python -m benchmarks.multi_turn " + " ".join(sys.argv[1:] if argv is None else argv)}
    print("record:", write_record("multi_turn", record, args.out))
    return record


if __name__ == "__main__":
    main()
