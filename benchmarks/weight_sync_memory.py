"""Peak memory of one weight sync from `trainer=fsdp` to the sampler: the full state dict gathered on every
rank at once, against `GatheredWeights` (one tensor gathered at a time, what rlmm does).

    torchrun --standalone --nproc_per_node 2 benchmarks/weight_sync_memory.py MODEL_DIR [OUT.json]

Each rank builds the FSDP trainer (fp32 shards) and an hf sampler (bf16) on MODEL_DIR, then syncs both
ways, several times, in alternating order. Memory: on CUDA the allocator's peak above what was allocated
before the sync; on the CPU the resident set's peak above its level before the sync, sampled every
millisecond by a thread (glibc may keep freed pages, so each way runs in a fresh order and the figure is
the median). Rank 0 prints one JSON line and writes it to OUT.json.
"""
from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

from rlmm.runtime.runtime_env import set_runtime_env

set_runtime_env()

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlmm.config.options import from_yaml  # noqa: E402
from rlmm.policy.precision import SidePrecision  # noqa: E402
from rlmm.policy.rollouts import SamplingOptions  # noqa: E402
from rlmm.runtime.devices import init_process_group  # noqa: E402
from rlmm.trainers.weight_sync import send_weights  # noqa: E402


class PeakRSS:
    """The resident set's peak above its level at entry, sampled every millisecond."""

    def __enter__(self):
        self.process, self.stop = psutil.Process(), threading.Event()
        self.start = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.mib = (self.peak - self.start) / 2 ** 20


def full_state_dict(trainer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))


def measure(sync, cuda: bool) -> tuple[float, float]:
    """(extra peak MiB, seconds) of one sync."""
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        sync()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2 ** 20, time.perf_counter() - started
    with PeakRSS() as peak:
        started = time.perf_counter()
        sync()
        seconds = time.perf_counter() - started
    return peak.mib, seconds


def main() -> None:
    model_dir = sys.argv[1]
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    init_process_group()
    cuda = torch.cuda.is_available()
    options = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, logprobs="processed",
                              support=from_yaml("support", "sampler"))
    trainer = from_yaml("trainer", "fsdp", model_path=model_dir, precision=SidePrecision("bf16", False),
                        sampling=options)
    sampler = from_yaml("sampler", "hf", model_path=model_dir, precision=SidePrecision("bf16", False),
                        sampling=options, seed=0)
    ways = {"full_state_dict": lambda: send_weights(full_state_dict(trainer), sampler),
            "per_tensor": lambda: send_weights(trainer.state_dict(), sampler)}
    figures = {way: [] for way in ways}
    for repeat in range(3):
        for way in (sorted(ways) if repeat % 2 == 0 else sorted(ways, reverse=True)):
            figures[way].append(measure(ways[way], cuda))
    peaks = torch.tensor([[statistics.median(m for m, _ in figures[way]) for way in sorted(ways)]])
    gathered = [torch.zeros_like(peaks) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, peaks)
    if dist.get_rank() == 0:
        tensors = list(trainer.state_dict().sharded.values())
        largest = max(t.numel() * 4 for t in tensors) / 2 ** 20
        result = {"device": "cuda" if cuda else "cpu", "ranks": dist.get_world_size(), "model": model_dir,
                  "parameters": sum(t.numel() for t in tensors), "largest_tensor_fp32_mib": round(largest, 1),
                  "model_fp32_mib": round(sum(t.numel() * 4 for t in tensors) / 2 ** 20, 1),
                  "memory": "cuda max_memory_allocated" if cuda else "resident set (psutil), sampled every 1 ms"}
        for i, way in enumerate(sorted(ways)):
            result[way] = {"extra_peak_mib_per_rank": [round(g[0, i].item(), 1) for g in gathered],
                           "seconds_median": round(statistics.median(s for _, s in figures[way]), 3)}
        print(json.dumps(result))
        if out:
            out.write_text(json.dumps(result, indent=2) + "\n")
    sampler.close()
    trainer.close()


if __name__ == "__main__":
    main()
