"""Whether two runs' records agree on every metric but the timings: the check for a behaviour-preserving
change (a refactor of the step must leave the default run's every non-timing metric as it was).

    rlmm train seed=0 logger=none train.steps=6 hydra.run.dir=/tmp/before   # on the code before
    rlmm train seed=0 logger=none train.steps=6 hydra.run.dir=/tmp/after    # on the code after
    .venv/bin/python scripts/same_run.py /tmp/before /tmp/after

Compares steps.jsonl step by step, key by key, exactly (the runs are seeded: equal code gives equal bits);
keys that measure time or speed (`perf/`, and any key with `seconds` or `per_second` in its name) are left
out. Prints the first differences and exits 1 if there is any, 0 if the records agree.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlmm.run.records import read_steps  # noqa: E402


def is_timing(key: str) -> bool:
    return key.startswith("perf/") or "seconds" in key or "per_second" in key


def differences(before: list[dict], after: list[dict]) -> list[str]:
    found = []
    if len(before) != len(after):
        found.append(f"{len(before)} steps before, {len(after)} after")
    for old, new in zip(before, after):
        number = old["step"]
        for key in sorted((old.keys() | new.keys())):
            if is_timing(key):
                continue
            if key not in old or key not in new:
                found.append(f"step {number}: {key} only {'after' if key in new else 'before'}")
            elif old[key] != new[key]:
                found.append(f"step {number}: {key} {old[key]!r} -> {new[key]!r}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="a run directory (holding steps.jsonl)")
    parser.add_argument("after", type=Path, help="the same run on the changed code")
    parser.add_argument("--show", type=int, default=20, help="differences printed at most")
    args = parser.parse_args()
    before, after = read_steps(args.before), read_steps(args.after)
    if not before or not after:
        print(f"no steps in {args.before if not before else args.after}/steps.jsonl")
        return 1
    found = differences(before, after)
    if not found:
        compared = sum(len([k for k in row if not is_timing(k)]) for row in before)
        print(f"same: {len(before)} steps, {compared} non-timing values equal")
        return 0
    print(f"{len(found)} differences:")
    for line in found[: args.show]:
        print(" ", line)
    return 1


if __name__ == "__main__":
    sys.exit(main())
