"""The CPU cost of each `token_path=`'s per-turn bookkeeping as a conversation's turns grow: rlmm's analogue of TRL
PR #6250's figure (re-tokenizing the whole conversation every turn cost 4% of generation time at 8 turns, 56% at 128).

    .venv/bin/python -m benchmarks.retokenize_cost [--turns 1,2,4,8,16,32,64,128] [--repeats 5] [--corpus 4096]
        [--contexts 64,512,1024,1536,2048] [--new-tokens 64] [--threads 1] [--paths tokens,retokenize,realign]
        [--dry] [--out FILE.json]

The tokenizer is the built-in BPE model's, built as `TinyBpeModel` builds it (`build_bpe_tokenizer(bpe_corpus(task,
N), 320)`, rlmm/models/tiny_bpe.py) on `task=calculator` (conf/task/calculator.yaml), with N = --corpus training
problems (the shipped model's N is 1500 x 64 = 96,000; a few thousand give nearly the same merges), bound to the
task by `TemplatePrompts` (rlmm/conversation/chat.py). The token paths are conf/token_path's (`from_yaml`):
`tokens`, `retokenize`, `realign` (fork threshold 1024).

The conversation of T policy turns: the user's prompt of a training problem, then T - 1 calculator calls, each
answered by the task's own environment (`task.reply`: the calculator's result as a tool message), then an answer.
The calls are those of the task's demonstrations (`calc(53+45)`, `calc(98+86)`, ...: two per problem) of
consecutive training problems, so each turn has the task's lengths (~8 sampled tokens a turn with its <|end|>, ~14
tokens of conversation a turn). Each turn is what `MultiTurn._take` (rlmm/run/episodes.py) makes of a
sampled turn: a `Turn` whose `prompt_ids` are the ids the path gave the sampler (`prompts.ids(example)` for the
first turn, then the path's `next_prompt` after each tool reply) and whose `output_ids` are the canonical encoding
of the assistant's text and the eos id (no drift: the bookkeeping's cost does not depend on it), then the assistant
message and the tool's message. What is timed, per path, is rlmm's own code as a rollout runs it:

- `next_prompt` after each of the first T - 1 turns: `tokens` cuts the environment's ids from a render of a fixed
  dummy exchange (two renders and encodes of a few messages: `environment_ids`), `retokenize` and `realign` render
  and encode the whole conversation so far;
- `trained` at the end: `tokens` checks and copies its ids, `realign` runs TRL's reconciler (`reconcile`, no render),
  `retokenize` renders the whole conversation once and locates each assistant turn with two renders of the
  conversation up to it (`assistant_spans`: O(T^2) tokens encoded);
- `turn_drift` at the end, which every path runs (`MultiTurn._rollouts`): two renders up to each assistant turn,
  also O(T^2).

The first prompt (the same for every path) and the decode of each sampled turn to text are not timed. "tokens":
the trained row's length (`retokenize`'s has one more, the template's newline after the last <|end|>). Each
conversation is first run once with `render` and `encode` counted (how many calls, characters rendered, tokens
encoded per stage: what the figures are made of, exact and timing-free), then --repeats times timed (wall and this
process's CPU seconds); the table gives medians.

The generation reference, to relate the bookkeeping to generation as TRL did: rlmm's `HFSampler`
(rlmm/samplers/hf.py, transformers `generate`, greedy, one prompt) on a random-init Qwen2 of the built-in size
(hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 704, vocabulary 320: 3.1M parameters, fp32) saved with the BPE
tokenizer, its eos made unreachable so that every call generates exactly what it asks. At each --contexts length:
one call generating 1 token (the prefill) and one generating --new-tokens, --repeats times (medians); the decode
time per token is their difference over new tokens - 1. One torch thread by default (--threads): the bookkeeping
runs on one core, and two threads on this machine's two cores, shared with other jobs, ran 5-10x slower. A
conversation's generation time is then its sampled tokens at the decode time of the context each turn sampled at
(interpolated linearly between the measured lengths), without the prefills (recorded apart: vLLM's prefix cache
makes most of them free, transformers' generate recomputes them every turn). The ratio bookkeeping / generation is
for this 3M-parameter model on this CPU: a larger model, or a GPU, makes a sampled token dearer or cheaper, while the
bookkeeping stays the same CPU work (it depends on the tokenizer and the template only), so the ratio scales
inversely with the generation time per token.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time

from benchmarks.common import git_commit, machine_info, package_versions, set_runtime_env, write_record

PATHS = ("tokens", "retokenize", "realign")
STAGES = ("next_prompt", "trained", "turn_drift")
ARCH = {"vocab_size": 320, "hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
        "intermediate_size": 704, "max_position": 8192}  # conf/model/tiny_bpe.yaml's sizes, a longer context
DRY = {"turns": "1,2,4,8", "repeats": 1, "corpus": 256, "contexts": "16,64", "new_tokens": 8}


def build_chat(corpus_examples: int):
    """(task, tokenizer, TemplatePrompts): the built-in BPE tokenizer as `TinyBpeModel._new_tokenizer` builds it."""
    from rlmm.config.options import from_yaml
    from rlmm.conversation.chat import TemplatePrompts
    from rlmm.models.tiny_bpe import bpe_corpus, build_bpe_tokenizer

    task = from_yaml("task", "calculator")
    tokenizer = build_bpe_tokenizer(bpe_corpus(task, corpus_examples), ARCH["vocab_size"])
    return task, tokenizer, TemplatePrompts(tokenizer, task)


def script(task, turns: int) -> tuple[object, list[dict]]:
    """(the first problem, the whole conversation's messages): its first messages, `turns` - 1 calculator calls of
    the task's demonstrations of consecutive training problems each with the environment's reply, then the answer
    (the last call's result)."""
    from rlmm.tasks.environment import ToolCall

    need = turns - 1
    examples = task.examples("train", max(1, -(-need // (task.operands - 1))))  # two calls a problem
    calls = [expression for e in examples for expression, _ in task._steps(e.prompt)][:need]
    first = examples[0]
    messages = task.first_messages(first)
    for expression in calls:
        messages.append({"role": "assistant", "content": task.environment.calls.write(ToolCall("calc", expression))})
        reply = task.reply(first, messages)
        assert reply.message is not None and reply.message["role"] == "tool", reply
        messages.append(reply.message)
    messages.append({"role": "assistant", "content": messages[-1]["content"] if calls else first.answer})
    return first, messages


class Counted:
    """`TemplatePrompts` whose `render` and `encode` count their calls, characters and tokens under `stage`."""

    def __init__(self, chat):
        self.chat, self.stage = chat, None
        self.counts = {s: {"renders": 0, "rendered_chars": 0, "encodes": 0, "encoded_tokens": 0} for s in STAGES}
        render, encode = chat.render, chat.encode

        def counted_render(messages, generation_prompt):
            text = render(messages, generation_prompt)
            if self.stage is not None:
                self.counts[self.stage]["renders"] += 1
                self.counts[self.stage]["rendered_chars"] += len(text)
            return text

        def counted_encode(text):
            ids = encode(text)
            if self.stage is not None:
                self.counts[self.stage]["encodes"] += 1
                self.counts[self.stage]["encoded_tokens"] += len(ids)
            return ids

        chat.render, chat.encode = counted_render, counted_encode  # on the instance only

    def close(self) -> None:
        del self.chat.render, self.chat.encode


def run_conversation(chat, path, first, messages: list[dict], counter: Counted | None = None) -> dict:
    """One conversation through `path` as `MultiTurn` runs it (module docstring): per stage wall and CPU seconds,
    and what the conversation and its trained row hold."""
    import torch

    from rlmm.conversation.token_path import Conversation, Turn, turn_drift

    eos = chat.tokenizer.eos_token_id
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    conversation = Conversation(copy.deepcopy(messages[:assistant[0]]))
    prompt = chat.ids(first)
    wall = dict.fromkeys(STAGES, 0.0)
    cpu = dict.fromkeys(STAGES, 0.0)

    def timed(stage, call):
        if counter is not None:
            counter.stage = stage
        start, start_cpu = time.perf_counter(), time.process_time()
        out = call()
        wall[stage] += time.perf_counter() - start
        cpu[stage] += time.process_time() - start_cpu
        if counter is not None:
            counter.stage = None
        return out

    for k, i in enumerate(assistant):
        text = messages[i]["content"]
        output = chat.encode(text) + [eos]
        assert chat.decode(output) == text.strip(), (chat.decode(output), text)  # the message MultiTurn would append
        conversation.turns.append(Turn(prompt, output, torch.zeros(len(output)), "stop"))
        conversation.messages.append(copy.deepcopy(messages[i]))
        if k + 1 < len(assistant):
            conversation.messages += copy.deepcopy(messages[i + 1:assistant[k + 1]])
            prompt = timed("next_prompt", lambda: path.next_prompt(chat, conversation))
            conversation.next_prompt = prompt
        else:
            conversation.finish = "stop"
    row = timed("trained", lambda: path.trained(chat, conversation))
    drift = timed("turn_drift", lambda: turn_drift(chat, conversation))
    turns = conversation.turns
    return {"wall": wall, "cpu": cpu, "ids": row.prompt_ids + row.response_ids,
            "sampled_in_row": sum(row.sampled), "kinds": row.kinds,
            "sampled_tokens": sum(len(t.output_ids) for t in turns),
            # what each turn's sampler read, and sampled
            "contexts": [(len(t.prompt_ids), len(t.output_ids)) for t in turns],
            "drifted_turns": sum(d.drifted for d in drift)}


def bookkeeping(chat, paths: dict, turns: list[int], repeats: int, task) -> dict:
    """{path: {T: figures}}: each conversation counted once, then timed `repeats` times (paths in rotating order)."""
    scripts = {t: script(task, t) for t in turns}
    out: dict = {name: {} for name in paths}
    for t in turns:
        first, messages = scripts[t]
        for name, path in paths.items():
            counter = Counted(chat)
            try:
                counted = run_conversation(chat, path, first, messages, counter)
            finally:
                counter.close()
            out[name][t] = {"counted": counted, "counts": counter.counts, "wall": [], "cpu": []}
        names = list(paths)
        for repeat in range(repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                run = run_conversation(chat, paths[name], first, messages)
                out[name][t]["wall"].append(run["wall"])
                out[name][t]["cpu"].append(run["cpu"])
    return out


def generation_reference(tokenizer, contexts: list[int], new_tokens: int, repeats: int, threads: int) -> dict:
    """Decode and prefill seconds per context length on rlmm's HFSampler with a random model of the built-in size
    (module docstring)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlmm.config.options import from_yaml
    from rlmm.policy.precision import SidePrecision
    from rlmm.policy.rollouts import SamplingOptions
    from rlmm.samplers.hf import HFSampler

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    vocab = ARCH["vocab_size"]
    config = Qwen2Config(vocab_size=vocab, hidden_size=ARCH["hidden_size"], intermediate_size=ARCH["intermediate_size"],
                         num_hidden_layers=ARCH["num_layers"], num_attention_heads=ARCH["num_heads"],
                         num_key_value_heads=ARCH["num_kv_heads"], max_position_embeddings=ARCH["max_position"],
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    # an eos one past the LM head's last row: every call generates exactly the tokens it asks (benchmarks/models.py)
    model.generation_config.eos_token_id = vocab
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    options = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens, logprobs="processed",
                              support=from_yaml("support", "sampler"))
    draw = torch.Generator().manual_seed(0)
    specials = len(tokenizer.all_special_ids)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlmm-retokenize-cost-") as path:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        sampler = HFSampler(path, SidePrecision("fp32", False), options, seed=0, batch_size=1, perturb=0.0)
        sampler.generate([[specials] * 8], greedy=True)  # warm-up
        for context in contexts:
            prompt = torch.randint(specials, vocab, (context,), generator=draw).tolist()
            one, full, made = [], [], set()
            for _ in range(max(1, repeats)):
                start = time.perf_counter()
                sampler.generate([prompt], greedy=True, max_new_tokens=1)
                one.append(time.perf_counter() - start)
                start = time.perf_counter()
                out = sampler.generate([prompt], greedy=True, max_new_tokens=new_tokens)
                full.append(time.perf_counter() - start)
                made.add(len(out.response_ids[0]))
            prefill, whole = statistics.median(one), statistics.median(full)
            rows.append({"context": context, "new_tokens": sorted(made), "prefill_seconds": prefill,
                         "call_seconds": whole,
                         "decode_seconds_per_token": max(whole - prefill, 0.0) / (new_tokens - 1)})
    return {"reference": f"rlmm.samplers.hf.HFSampler (transformers generate, greedy, batch 1, fp32, {threads} torch "
                         f"thread{'s' if threads > 1 else ''}) on a random-init Qwen2 of the built-in size "
                         f"({parameters / 1e6:.1f}M parameters) on this CPU",
            "num_parameters": parameters, "torch_threads": threads, "arch": ARCH, "new_tokens": new_tokens,
            "rows": rows}


def interpolate(rows: list[dict], key: str, context: float) -> float:
    """`key` at `context` tokens, linear between the measured lengths, carried on by the last two beyond them."""
    points = sorted((r["context"], r[key]) for r in rows)
    if len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if context <= x1 or (x1, y1) == points[-1]:
            return max(0.0, y0 + (y1 - y0) * (context - x0) / (x1 - x0))
    raise AssertionError


def summarize(raw: dict, reference: dict) -> dict:
    summary: dict = {}
    for name, per_turns in raw.items():
        summary[name] = {}
        for t, r in per_turns.items():
            c = r["counted"]
            wall = {s: statistics.median(w[s] for w in r["wall"]) for s in STAGES}
            cpu = {s: statistics.median(w[s] for w in r["cpu"]) for s in STAGES}
            total = statistics.median(sum(w.values()) for w in r["wall"])
            total_cpu = statistics.median(sum(w.values()) for w in r["cpu"])
            decode = sum(n * interpolate(reference["rows"], "decode_seconds_per_token", p + n / 2)
                         for p, n in c["contexts"])
            prefill = sum(interpolate(reference["rows"], "prefill_seconds", p) for p, _ in c["contexts"])
            summary[name][t] = {
                "turns": t, "tokens": len(c["ids"]), "sampled_tokens": c["sampled_tokens"],
                "sampled_in_row": c["sampled_in_row"], "prompt_tokens_read": sum(p for p, _ in c["contexts"]),
                "drifted_turns": c["drifted_turns"], "kinds": sorted(set(c["kinds"])),
                "seconds": wall, "cpu_seconds": cpu, "total_seconds": total, "total_cpu_seconds": total_cpu,
                "seconds_per_turn": total / t, "total_without_drift_seconds":
                    statistics.median(sum(w[s] for s in STAGES if s != "turn_drift") for w in r["wall"]),
                "counts": r["counts"],
                "renders": sum(v["renders"] for v in r["counts"].values()),
                "encoded_tokens": sum(v["encoded_tokens"] for v in r["counts"].values()),
                "generation_decode_seconds": decode, "generation_prefill_seconds": prefill,
                "ratio_to_generation": total / decode if decode else None,
                "ratio_to_generation_with_prefill": total / (decode + prefill) if decode + prefill else None}
    return summary


def table(summary: dict, reference: dict) -> str:
    lines = ["| path | turns | tokens | sampled | renders | tokens encoded | next_prompt s | trained s | turn_drift s "
             "| total s | ms / turn | generation s | bookkeeping / generation | without turn_drift |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, per_turns in summary.items():
        for t, s in per_turns.items():
            decode = s["generation_decode_seconds"]
            ratio = "-" if not decode else f"{100 * s['total_seconds'] / decode:.1f}%"
            no_drift = "-" if not decode else f"{100 * s['total_without_drift_seconds'] / decode:.1f}%"
            lines.append(f"| {name} | {t} | {s['tokens']} | {s['sampled_tokens']} | {s['renders']} | "
                         f"{s['encoded_tokens']} | {s['seconds']['next_prompt']:.4f} | {s['seconds']['trained']:.4f} | "
                         f"{s['seconds']['turn_drift']:.4f} | {s['total_seconds']:.4f} | "
                         f"{1000 * s['seconds_per_turn']:.2f} | {s['generation_decode_seconds']:.3f} | "
                         f"{ratio} | {no_drift} |")
    ref = ["", "Generation reference: " + reference["reference"] + ".",
           "| context | prefill s | decode ms / token |", "|---:|---:|---:|"]
    ref += [f"| {r['context']} | {r['prefill_seconds']:.4f} | {1000 * r['decode_seconds_per_token']:.2f} |"
            for r in reference["rows"]]
    ref.append("Generation s: the conversation's sampled tokens at the decode time per token of the context each turn "
               "sampled at (prefills not counted). The ratio is for this 3M-parameter model on this CPU: a bigger "
               "model or a GPU changes the generation time per token, not the bookkeeping (the same CPU work).")
    return "\n".join(lines + ref)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.retokenize_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", default="1,2,4,8,16,32,64,128", help="policy turns per conversation (a list)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each conversation (medians reported)")
    parser.add_argument("--corpus", type=int, default=4096, help="training problems the BPE tokenizer is trained on")
    parser.add_argument("--contexts", default="64,512,1024,1536,2048",
                        help="context lengths of the generation reference")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per reference call")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the generation reference (1: the bookkeeping's one core; 2 threads on "
                             "2 shared cores ran 5-10x slower here)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--dry", action="store_true", help=f"tiny sizes, a few seconds ({DRY}; given flags ignored)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.dry:
        for key, value in DRY.items():
            setattr(args, key, value)
    set_runtime_env()
    from rlmm.config.options import from_yaml

    turns = [int(t) for t in args.turns.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if min(turns) < 1 or args.repeats < 1 or args.new_tokens < 2 or not contexts:
        raise SystemExit("--turns >= 1, --repeats >= 1, --new-tokens >= 2 and one context at least")
    started = time.perf_counter()
    task, tokenizer, chat = build_chat(args.corpus)
    paths = {name: from_yaml("token_path", name) for name in args.paths.split(",")}
    raw = bookkeeping(chat, paths, turns, args.repeats, task)
    bookkeeping_wall = time.perf_counter() - started
    reference = generation_reference(tokenizer, contexts, args.new_tokens, args.repeats, args.threads)
    summary = summarize(raw, reference)
    text = table(summary, reference)
    print(text)
    record = {"args": vars(args), "machine": machine_info(), "versions": package_versions(sys.executable),
              "commit": git_commit(), "corpus_examples": args.corpus, "tokenizer_vocab": len(tokenizer),
              "summary": {name: {str(t): s for t, s in v.items()} for name, v in summary.items()},
              "generation": reference, "raw_seconds": {name: {str(t): {"wall": r["wall"], "cpu": r["cpu"]}
                                                              for t, r in v.items()} for name, v in raw.items()},
              "bookkeeping_wall_seconds": bookkeeping_wall, "wall_seconds": time.perf_counter() - started,
              "table": text,
              "command": "python -m benchmarks.retokenize_cost " + " ".join(sys.argv[1:] if argv is None else argv)}
    print("record:", write_record("retokenize_cost", record, args.out))
    return record


if __name__ == "__main__":
    main()
