"""The probe's figure (`probe.png`) from its record: mismatch by response position, tokens per position
bucket, the trainer against itself by batch shape and layout, and mismatch by the trainer's token entropy."""
from __future__ import annotations

from pathlib import Path


def plot_probe(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = record["position_profile"]
    starts, ends = profile["bucket_start"], profile["bucket_end"]
    centers = [(s + e) / 2 for s, e in zip(starts, ends)]
    fig, axes = plt.subplots(1, 4, figsize=(20, 3.8))
    axes[0].plot(centers, profile["logprob_abs_diff_mean"], marker="o", label="mean |δ|")
    axes[0].plot(centers, profile["kl_k3"], marker="s", label="KL k3 (per token)")
    axes[0].set_xlabel("response position (tokens)")
    axes[0].set_ylabel("sampler vs trainer")
    axes[0].set_yscale("symlog", linthresh=1e-6)
    axes[0].set_title("mismatch by response position")
    axes[0].legend()
    ax = axes[1]
    ax.bar(starts, profile["num_tokens"], width=[(e - s) * 0.9 for s, e in zip(starts, ends)], align="edge", color="0.7")
    ax.set_xlabel("response position (tokens)")
    ax.set_ylabel("tokens in bucket")
    ax.set_title("tokens per position bucket")
    # What the trainer's batch shape alone does: |Δ log p| of the trainer against itself.
    itself = record["trainer_vs_itself"]
    small, large = itself["micro_batch_sizes"]
    compared = [name for name in itself["layouts"] if name != "reference"]
    names = [f"mb {large} vs {small}"] + [f"{name} vs padded" for name in compared]
    prefixes = [""] + [f"{name}/" for name in compared]
    ax = axes[2]
    at = range(len(names))
    ax.bar([x - 0.2 for x in at], [itself[f"{p}logprob_abs_diff_mean"] for p in prefixes], width=0.4, label="mean")
    ax.bar([x + 0.2 for x in at], [itself[f"{p}logprob_abs_diff_max"] for p in prefixes], width=0.4, label="max")
    ax.set_xticks(list(at), names, rotation=15, fontsize=8)
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.set_ylabel("|Δ log p| (nats)")
    ax.set_title("trainer vs itself: batch shape and layout")
    ax.legend()
    # The ratio's spread per entropy band (rlmm/mismatch/metrics.py::entropy_profile); an empty band's NaN leaves a gap.
    by_entropy = record["entropy_profile"]
    ax = axes[3]
    at = range(len(by_entropy["num_tokens"]))
    ax.plot(at, by_entropy["logprob_abs_diff_mean"], marker="o", label="mean |δ|")
    ax.plot(at, by_entropy["kl_k3"], marker="s", label="KL k3 (per token)")
    ax.plot(at, by_entropy["ratio_std"], marker="^", label="ratio std")
    ax.set_xticks(list(at), [f"[{s:g}, {'∞' if e == float('inf') else f'{e:g}'})\n{n} tok" for s, e, n in
                             zip(by_entropy["bucket_start"], by_entropy["bucket_end"], by_entropy["num_tokens"])],
                  fontsize=8)
    ax.set_xlabel("trainer's token entropy H (nats)")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylim(bottom=0)  # every figure is >= 0
    ax.set_title("mismatch by token entropy")
    ax.legend(loc="lower right")
    choices = record["choices"]
    fig.suptitle(" ".join(f"{k}={v}" for k, v in choices.items()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
