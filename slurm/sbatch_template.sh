#!/usr/bin/env bash
# Run one rlmm command as a SLURM batch job, for launching without Hydra's submitit launcher.
# Submit from the repository root (the job finds .venv from there):
#
#   sbatch slurm/sbatch_template.sh probe precision=fp16
#   sbatch -c 4 --mem=16G -t 2:00:00 slurm/sbatch_template.sh probe sampler=vllm
#
# Everything after the script name is passed to `rlmm` unchanged. Options given to sbatch on the
# command line override the #SBATCH defaults below. Change the partition (-p) on a site cluster;
# `rlmm` is the partition of the local cluster that slurm/cluster.sh starts.
#
#SBATCH --job-name=rlmm
#SBATCH --partition=rlmm
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --mem=4G
#SBATCH --time=04:00:00
# %j is the job id. Relative to the directory sbatch was run from.
#SBATCH --output=slurm-%j.out
# Pre-emption/time-limit warning: SIGUSR1 90 s before the job is killed. "B:" sends it to this
# batch shell only, which logs it (see on_usr1). Without "B:" SLURM would signal rlmm itself, and a
# Python process with no USR1 handler dies of it at once, losing the last 90 s of work and logs.
#SBATCH --signal=B:USR1@90
set -euo pipefail

# sbatch runs a copy of this file from its spool directory, so locate the repository from the
# submission directory (override with RLMM_ROOT=/path/to/rlmm).
ROOT="${RLMM_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
VENV="${RLMM_VENV:-$ROOT/.venv}"
if [[ ! -x "$VENV/bin/rlmm" ]]; then
    echo "sbatch_template.sh: error: no $VENV/bin/rlmm; submit from the rlmm checkout (after make setup) or set RLMM_ROOT/RLMM_VENV" >&2
    exit 2
fi
cd "$ROOT"
# shellcheck disable=SC1091  # the venv is created by scripts/setup.sh
source "$VENV/bin/activate"

# One CPU thread pool per allocated CPU rather than per machine CPU (shared nodes).
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-${OMP_NUM_THREADS:-1}}"

echo "job ${SLURM_JOB_ID:-?} on $(hostname -s) at $(date -Is): rlmm $*"

# shellcheck disable=SC2317  # called by the trap below
on_usr1() {
    # rlmm has no checkpoint/resume hook yet: record that the end is near, so a job cut at its
    # time limit is recognisable in slurm-<id>.out. To have it start over instead, requeue it:
    #   scontrol requeue "$SLURM_JOB_ID"
    echo "job ${SLURM_JOB_ID:-?}: SIGUSR1 at $(date -Is): time limit or pre-emption in about 90 s" >&2
}
trap on_usr1 USR1

# rlmm runs in the background and the shell waits on it: bash runs a trap only between commands,
# so a foreground rlmm would delay on_usr1 until it exited. `wait` returns early (status > 128) when
# a trapped signal arrives; then keep waiting for rlmm itself.
rlmm "$@" &
pid=$!
status=0
while :; do
    wait "$pid" && status=0 || status=$?
    kill -0 "$pid" 2>/dev/null || break
done
echo "job ${SLURM_JOB_ID:-?}: rlmm exited with status $status at $(date -Is)"
exit "$status"
