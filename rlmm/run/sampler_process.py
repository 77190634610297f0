"""`train.overlap`: the sampler in a process of its own, which samples the next updates' rollouts while the
trainer trains (issue 26's second way; the source that drives it is rlmm/run/rollout_source.py's `Overlapped`).

What runs where. Each trainer rank r starts one sampler process (`torch.multiprocessing`, spawn) and talks to it
alone. The process builds what sampling needs from the run's config (the task and its prompt stream, the
tokenizer, the algorithm's group size and group filter, the sampler engine, with the arguments
rlmm/run/components.py gives an in-process one) and then serves the trainer's requests one at a time, in the order
they were sent:

    ("sample", j)         sample batch j (step j's prompts and refills, `SampledBatch.now`), reply the batch
    ("weights", weights)  load the trainer's weights (`Sampler.load_weights`)
    ("generate", ...)     a generate call (the greedy evaluation: the deployed policy is the one measured), reply it
    ("calls", None | n)   reply the engine's sampling-call counter, or set it (a checkpoint's)
    ("partial", s)        `train.partial_rollouts`: step s's sampling, the delay line's partial schedule run here (a
                          `DelayLine` over this engine holds the partial batches): batch s finished, replied as soon
                          as it is complete, then the later batches advanced a chunk and the new ones started
    ("in_flight", None | state)  partial rollouts: reply the batches in flight as the delay line's checkpoint state,
                          or load one (a checkpoint's, pickled)
    ("close",)            close the engine and end

One queue of requests, answered in order, is what makes the records those of the delay line: a batch is
sampled with the weights of every "weights" request sent before its "sample" request and of none after, and
the engine's call counter, and with it every request's seed (rlmm/samplers/base.py::request_seed), counts the
same calls in the same order. With partial rollouts a batch's chunks are sampled here across several "partial"
requests, each after the weights of the update before it.

The processes of the N ranks form a process group of their own (gloo; the port picked by trainer rank 0 and
broadcast over the trainers' group), with the trainers' ranks: the trainers' group never includes a sampler, so
its collectives are as without overlap, while what sampling does over ranks (DAPO's agreed refill rounds, vLLM's
`external_launcher` world) runs among the samplers, rank r's share in rank r's process.

Transport: two `torch.multiprocessing` queues per pair. Weights go as tensors in shared memory (each a copy
made on the trainer side when sent, on the CPU: the process may load them after the trainer has stepped
again; at most k + 1 versions wait in the queue, since update u needs batch u, sampled after the weights of
update u-1-k were loaded); rollouts come back pickled by value (small: token ids and log-probs, which as shared
tensors would cost a file descriptor each). On a GPU node the process runs on a GPU of its own
(`sampler_local_rank`) and the weights still go through host memory (a device-to-host and a host-to-device
copy per update; NCCL between the two devices would skip the host: not done, and not run on a GPU).

The process ignores SIGINT and SIGTERM (the trainer's `StopSignals` decide when to stop, then close it) and ends
when its trainer process has gone.
"""
from __future__ import annotations

import builtins
import os
import pickle
import queue
import signal
import socket
from dataclasses import dataclass

import torch

from rlmm.runtime.errors import MachineFault

# How often a side waiting on the other checks that it is still alive (seconds).
POLL_SECONDS = 1.0


class SamplerProcessError(RuntimeError):
    """The sampler process failed (an error it raised, or a reply out of order), as the trainer sees it."""


class SamplerProcessExited(SamplerProcessError, MachineFault):
    """The sampler process is gone (killed: by the OOM killer, a signal, a crash of its engine)."""

    def __init__(self, exitcode: int | None, doing: str):
        how = f"exited (code {exitcode})"
        if exitcode is not None and exitcode < 0:  # multiprocessing's -N: killed by signal N
            try:
                how = f"was killed by {signal.Signals(-exitcode).name}"
            except ValueError:
                pass
        super().__init__(f"train.overlap: the sampler process {how} {doing}")


@dataclass
class SamplingSide:
    """What `rlmm.run.step.sample_groups` reads of the components, built in the sampler process."""

    task: object
    tokenizer: object
    sampler: object
    algo: object
    sampling: object  # `SamplingOptions` (a partial batch reads max_new_tokens)
    prompts: object  # the bound prompt format and the episodes, as rlmm/run/components.py builds them
    episodes: object


def sampler_local_rank(local_rank: int, local_world: int, cuda: bool) -> int:
    """The LOCAL_RANK of rank `local_rank`'s sampler process, on a node running `local_world` trainer ranks: the
    GPU after the trainers' (so a node runs 2 x local_world processes on as many GPUs), or the trainer's own
    number on CPUs."""
    return local_world + local_rank if cuda else local_rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samplers_port() -> int:
    """The port of the sampler processes' own group: trainer rank 0's pick, agreed over the trainers' group."""
    import torch.distributed as dist

    port = [free_port()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(port, src=0)
    return port[0]


class SamplerProcess:
    """The trainer side of rank r's sampler process: a `Sampler` (rlmm/samplers/base.py) whose calls are
    requests to the process, plus `request_batch` / `receive_batch` for the rollout source. `cfg`: the run's
    config; `engine_args`: what rlmm/run/components.py builds an in-process sampler with."""

    needs_weights = False  # the engine has a device of its own and never sleeps

    def __init__(self, cfg, engine_args: dict):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from rlmm.runtime.devices import local_rank

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if torch.cuda.is_available() and torch.cuda.device_count() < 2 * local_world:
            raise ValueError(f"train.overlap=true on GPUs: each sampler process takes a GPU beside its trainer's, so "
                             f"{local_world} rank(s) on a node need {2 * local_world} visible GPUs; this node has "
                             f"{torch.cuda.device_count()}")
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local_world),
               "LOCAL_RANK": str(sampler_local_rank(local_rank(), local_world, torch.cuda.is_available())),
               "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"), "MASTER_PORT": str(samplers_port()),
               # torchrun's ranks join its agent's store; the samplers' rank 0 serves their own
               "TORCHELASTIC_USE_AGENT_STORE": "False"}
        context = mp.get_context("spawn")
        self.requests, self.responses = context.Queue(), context.Queue()
        self.stopping = context.Event()  # set by `close`: what is still queued is not served
        # As many threads as the trainer: CPU kernels may round differently with another count.
        self.process = context.Process(target=serve, name=f"rlmm-sampler-{rank}", daemon=True,
                                       args=(cfg, engine_args, env, torch.get_num_threads(), self.requests,
                                             self.responses, self.stopping))
        self.process.start()
        self.arrived: dict[int, object] = {}  # batches received before they were asked for
        self._actual_precision = None
        self.closed = False

    @property
    def actual_precision(self) -> dict[str, str]:
        if self._actual_precision is None:
            self._actual_precision = self._receive("ready")
        return self._actual_precision

    @property
    def calls(self) -> int:
        self._send("calls", None)
        return self._receive("calls")

    @calls.setter
    def calls(self, value: int) -> None:
        self._send("calls", value)

    def request_batch(self, index: int) -> None:
        """Ask for batch `index`, sampled with the weights sent so far."""
        self._send("sample", index)

    def request_partial_step(self, step: int) -> None:
        """Partial rollouts: ask for step `step`'s sampling with the weights sent so far (batch `step` comes back:
        `receive_batch`)."""
        self._send("partial", step)

    def in_flight_state(self) -> dict:
        """Partial rollouts: the process's batches in flight, as the delay line's `state_dict`."""
        self._send("in_flight", None)
        return self._receive("in_flight")

    def load_in_flight(self, state: dict | None, first_step: int) -> None:
        """Partial rollouts: the process continues from a checkpoint's batches in flight (pickled: many small
        tensors, each of which would cost a file descriptor shared)."""
        self._send("in_flight", pickle.dumps((state, first_step)))

    def receive_batch(self, index: int):
        """Batch `index` (a `SampledBatch`), waiting for it if it has not arrived."""
        while index not in self.arrived:
            self._receive(None)
        return self.arrived.pop(index)

    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False,
                 request_ids: list[int] | None = None, max_new_tokens: int | None = None):
        self._send("generate", (prompt_ids, n, greedy, request_ids, max_new_tokens))
        return self._receive("rollouts")

    def load_weights(self, state_dict) -> None:
        """Send a copy of the weights (read in order: gathered from shards where they are, on every rank)."""
        self._send("weights", {name: torch.empty_like(tensor, device="cpu").copy_(tensor.detach())
                               for name, tensor in state_dict.items()})

    @staticmethod
    def unsupported(precision) -> str | None:
        return None  # the engine's own class answers (the CLI asks it before the run)

    def sleep(self) -> None:
        """Nothing to release: the engine is in another process, on a device of its own."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stopping.set()
        if self.process.is_alive():
            self.requests.put(("close",))
            self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)

    def _send(self, kind: str, value) -> None:
        if not self.process.is_alive():
            raise SamplerProcessExited(self.process.exitcode, "before the trainer's request")
        self.requests.put((kind, value))

    def _receive(self, kind: str | None):
        """The value of the next reply of `kind` (None: the next reply of any kind), keeping the batches that
        arrive before it; a reply of the process's error raises it here."""
        while True:
            try:
                reply = pickle.loads(self.responses.get(timeout=POLL_SECONDS))
            except queue.Empty:
                if not self.process.is_alive():
                    raise SamplerProcessExited(self.process.exitcode, "while the trainer waited for it") from None
                continue
            got, value = reply
            if got == "ready":  # the first reply, whether or not it was asked for yet
                self._actual_precision = value
                if kind == "ready":
                    return value
                continue
            if got == "error":
                name, message = value
                error = getattr(builtins, name, None)
                raise (error if isinstance(error, type) and issubclass(error, Exception) else SamplerProcessError)(
                    message if error else f"{name}: {message}")
            if got == "batch":
                index, batch = value
                self.arrived[index] = batch
                if kind is None:
                    return None
                continue
            if got != kind:
                raise SamplerProcessError(f"train.overlap: expected a '{kind}' reply from the sampler process, got "
                                          f"'{got}'")
            return value


def serve(cfg, engine_args: dict, env: dict, threads: int, requests, responses, stopping) -> None:
    """The sampler process: build, then serve requests in order until "close" or `stopping` (module docstring)."""
    import multiprocessing

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.update(env)
    torch.set_num_threads(threads)

    def reply(kind: str, value) -> None:
        responses.put(pickle.dumps((kind, value)))

    def reply_error(err: BaseException) -> None:
        reply("error", (type(err).__name__, str(err)))

    try:
        side, prompts_of = build_sampling_side(cfg, engine_args)
    except Exception as err:
        reply_error(err)
        return
    reply("ready", side.sampler.actual_precision)
    parent = multiprocessing.parent_process()
    from rlmm.run.rollout_source import DelayLine, finished
    from rlmm.run.step import SampledBatch

    options = cfg.train
    line = (DelayLine(side, prompts_of, options.staleness, False, options.steps, chunk=options.rollout_chunk)
            if options.partial_rollouts else None)  # partial rollouts: the batches in flight, held here

    try:
        while True:
            try:
                kind, *value = requests.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return
                continue
            if kind == "close" or stopping.is_set():  # batches asked for but no longer wanted are not sampled
                return
            value = value[0]
            try:
                if kind == "sample":
                    reply("batch", (value, SampledBatch.now(side, *prompts_of(value))))
                elif kind == "weights":
                    side.sampler.load_weights(value)
                elif kind == "generate":
                    prompt_ids, n, greedy, request_ids, max_new_tokens = value
                    reply("rollouts", side.sampler.generate(prompt_ids, n=n, greedy=greedy, request_ids=request_ids,
                                                            max_new_tokens=max_new_tokens))
                elif kind == "partial":  # the delay line's calls at step `value`, the due batch handed over first
                    seconds = {}
                    line.sample_due(value, seconds)
                    due = line.pop_due(value)
                    reply("batch", (value, finished(side, due.partial, line.prompts_share(value), seconds)))
                    line.sample_ahead(value, seconds)
                elif kind == "in_flight":
                    if value is None:
                        reply("in_flight", line.state_dict())
                    else:
                        line.load_state_dict(*pickle.loads(value))
                elif kind == "calls":
                    if value is None:
                        reply("calls", side.sampler.calls)
                    else:
                        side.sampler.calls = value
                else:
                    raise ValueError(f"train.overlap: unknown request '{kind}' to the sampler process")
            except Exception as err:
                reply_error(err)
    finally:
        side.sampler.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def build_sampling_side(cfg, engine_args: dict):
    """The sampler process's task, tokenizer, algorithm and engine, and its prompt stream (rlmm/run/rollout_source.py's `prompt_stream`),
    from the run's config; its own process group first (the sampler processes', module docstring)."""
    from hydra.utils import instantiate
    from rlmm.config.options import build
    from rlmm.models.loading import load_tokenizer
    from rlmm.run.rollout_source import prompt_stream
    from rlmm.runtime.devices import init_process_group, select_device

    select_device()
    init_process_group()
    precision = instantiate(cfg.precision)
    precision.apply()
    task = instantiate(cfg.task)
    from rlmm.run.components import conversation_parts

    options = cfg.train
    tokenizer = load_tokenizer(engine_args["model_path"])
    prompts, episodes = conversation_parts(cfg, tokenizer, engine_args["model_path"], task, engine_args["sampling"])
    side = SamplingSide(task=task, tokenizer=tokenizer, sampler=build(cfg.sampler, **engine_args),
                        algo=instantiate(cfg.algo), sampling=engine_args["sampling"], prompts=prompts,
                        episodes=episodes)
    examples = task.examples("train", options.steps * options.prompts_per_step)
    return side, prompt_stream(examples, cfg.seed, options.prompts_per_step)
