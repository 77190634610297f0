#!/usr/bin/env bash
# The wheels the lent GPU machine lacks (issue 23), for scripts/gpu_lent_check.sh to unzip there. That machine
# (one H200, Python 3.12, x86-64) has torch 2.11, transformers 5.17 and their dependencies, but no vLLM, no
# DeepSpeed, no package index: everything else rlmm imports on the `probe`/`train` path (logger=none,
# sampler=hf, trainer=deepspeed|fsdp|torch) and benchmarks/layouts.py must travel with the call, as files.
#   bash scripts/gpu_wheels.sh        # here, where pip reaches a package index (PyPI); about 30 s
# Writes .gpu_wheels/ (ignored by git): *.whl, the packages that machine lacks (DeepSpeed's pure-Python wheel
# built from its sdist with DS_BUILD_OPS=0, pydantic and pydantic_core for cp312 manylinux, hjson, hydra-core,
# omegaconf, antlr4's runtime built from its sdist, submitit, ...), and if_missing/*.whl, packages its last
# package list showed there (DeepSpeed's other needs, rich): the check unzips those only where the machine
# lacks them. The versions are .venv's (what the tests ran here; the newest for one .venv lacks). Checks that
# every wheel's requirements (for Python 3.12 on Linux x86-64) are met by the carried wheels or by
# torch/transformers' own, and prints the folder's size beside the working tree's: together they must stay
# under the 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${GPU_WHEELS:-.gpu_wheels}
py=.venv/bin/python
[ -x "$py" ] || make setup
# Not on the lent machine (its package list, read 2026-11-17, and a trace of the modules rlmm's runs import):
always=(deepspeed hjson pydantic pydantic-core annotated-types typing-inspection hydra-core omegaconf
        antlr4-python3-runtime submitit hydra-submitit-launcher
        typing-extensions)  # the machine has one, of unknown version; pydantic 2.14 needs >= 4.16
# On that machine's list, carried in case an image lacks them (small; unzipped only where missing):
if_missing=(einops msgpack ninja psutil py-cpuinfo nvidia-ml-py cloudpickle rich markdown-it-py mdurl pygments)
# Built here from their sdists (pure Python): DeepSpeed with no ops compiled, antlr4 4.9.3 (no wheel on PyPI).
from_sdist=(deepspeed antlr4-python3-runtime)
pins() {  # NAME==VERSION of .venv's copy; a package .venv lacks (nvidia-ml-py on a CPU machine): its newest
  "$py" -c '
import importlib.metadata as m, sys
def pin(name):
    try:
        return f"{name}=={m.version(name)}"
    except m.PackageNotFoundError:
        return name
print(" ".join(map(pin, sys.argv[1:])))' "$@"
}
rm -rf "$dest"
mkdir -p "$dest/if_missing"
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }  # this machine's pip config
binary=()
for name in "${always[@]}"; do [[ " ${from_sdist[*]} " == *" $name "* ]] || binary+=("$name"); done
download=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
          --abi cp312 --abi abi3 --abi none "${platforms[@]}")
# shellcheck disable=SC2046
"$py" "${download[@]}" -d "$dest" $(pins "${binary[@]}") 2>&1 | quiet
# shellcheck disable=SC2046
"$py" "${download[@]}" -d "$dest/if_missing" $(pins "${if_missing[@]}") 2>&1 | quiet
# DS_BUILD_OPS=0: no op is compiled; in pip's isolated build env setup.py sees no torch, so the wheel records
# torch "0.0" (DeepSpeed's sentinel for detecting torch and the accelerator at run time) and no prebuilt op.
# shellcheck disable=SC2046
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-cache-dir --no-deps -w "$dest" $(pins "${from_sdist[@]}") 2>&1 | quiet
"$py" - "$dest" <<'EOF'
"""Every carried wheel's requirements met for Python 3.12 / Linux x86-64; sizes."""
import subprocess, sys, zipfile
from email.parser import Parser
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

dest = Path(sys.argv[1])
# On the lent machine: torch and transformers with their own dependencies (the ones carried wheels need).
ON_MACHINE = {"torch", "numpy", "packaging", "pyyaml", "tqdm"}
wheels = sorted(dest.glob("*.whl")) + sorted(dest.glob("if_missing/*.whl"))
carried = {}
for wheel in wheels:
    name, version, _, tags = parse_wheel_filename(wheel.name)
    if name in carried:
        sys.exit(f"gpu_wheels: two wheels of {name}")
    carried[name] = version
environment = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
unmet = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate(environment):
                continue
            name = canonicalize_name(req.name)
            if name in ON_MACHINE:
                continue
            if name not in carried or not req.specifier.contains(carried[name], prereleases=True):
                unmet.append(f"{wheel.name}: {line}")
if unmet:
    sys.exit("gpu_wheels: requirements no carried wheel meets:\n  " + "\n  ".join(unmet))
size = sum(w.stat().st_size for w in wheels)
files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, text=True, check=True).stdout.split("\0")
tree = sum(Path(f).stat().st_size for f in files if f and Path(f).is_file())
for wheel in wheels:
    print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.relative_to(dest)}")
mib = lambda n: f"{n / 2**20:.1f} MiB"
print(f"{dest}: {len(wheels)} wheels, {mib(size)}; working tree (tracked + untracked, not ignored) {mib(tree)}; "
      f"together {mib(size + tree)} of the 64 MiB a call carries")
if size + tree > 64 * 2**20:
    sys.exit("gpu_wheels: over 64 MiB with the working tree")
EOF
