#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for running rlmm's submitit/Hydra sweeps (and
# their tests) without a site cluster. Debian/Ubuntu only (apt packages), daemons started by hand:
# no systemd is assumed, so CI and containers work the same as a workstation.
#
#   bash slurm/cluster.sh install   # apt-get install slurmctld slurmd slurm-client munge (root only)
#   bash slurm/cluster.sh start     # install if needed, write config, start munged/slurmctld/slurmd
#   bash slurm/cluster.sh status    # exit 0 if jobs can be submitted, 1 otherwise
#   bash slurm/cluster.sh stop      # stop the daemons this script started
#
# See slurm/README.md. Environment knobs:
#   RLMM_SLURM_PARTITION   partition name (default rlmm; made the default partition)
#   RLMM_SLURM_NO_INSTALL  set to 1 to never apt-get install (start then fails if SLURM is missing)
#   RLMM_SLURM_TIMEOUT     seconds `start` waits for the node to become usable (default 60)
#   SLURM_CONF             slurm.conf path, honoured by every SLURM command (default /etc/slurm/slurm.conf)
set -euo pipefail

readonly MARKER="# written by rlmm slurm/cluster.sh"
readonly PACKAGES=(slurmctld slurmd slurm-client munge)
readonly PARTITION="${RLMM_SLURM_PARTITION:-rlmm}"
readonly TIMEOUT="${RLMM_SLURM_TIMEOUT:-60}"
export SLURM_CONF="${SLURM_CONF:-/etc/slurm/slurm.conf}"
CGROUP_CONF="$(dirname "$SLURM_CONF")/cgroup.conf"  # slurmd reads it next to slurm.conf
readonly CGROUP_CONF

readonly LOG_DIR=/var/log/slurm
readonly CTLD_LOG="$LOG_DIR/slurmctld.log"
readonly SLURMD_LOG="$LOG_DIR/slurmd.log"
readonly MUNGE_LOG=/var/log/munge/munged.log
readonly INSTALL_LOG=/var/log/slurm/rlmm-install.log
readonly CTLD_PIDFILE=/run/slurmctld.pid
readonly SLURMD_PIDFILE=/run/slurmd.pid
readonly MUNGE_PIDFILE=/run/munge/munged.pid
# Pids of the daemons *this script* started, so `stop` leaves alone daemons someone else runs.
readonly STATE_DIR=/run/rlmm-slurm

# Slurm compares NodeName with the short hostname of the machine slurmd runs on.
NODE="$(hostname -s 2>/dev/null || uname -n)"
NODE="${NODE%%.*}"
readonly NODE

log() { echo "cluster.sh: $*" >&2; }
die() { local code="$1"; shift; echo "cluster.sh: error: $*" >&2; exit "$code"; }
is_root() { [[ "$(id -u)" == 0 ]]; }

usage() {
    cat <<EOF
usage: bash slurm/cluster.sh {install|start|status|stop|--help}

A single-node SLURM cluster on this machine (node $NODE, partition '$PARTITION').
  install  apt-get install ${PACKAGES[*]} if slurmctld/slurmd/sinfo/munged are missing (root only;
           otherwise prints what to install and exits 3)
  start    install if needed, write $SLURM_CONF and cgroup.conf (only if absent or written by
           this script), start munged, slurmctld, slurmd, wait until the node is usable (${TIMEOUT}s).
           Idempotent: returns at once when the cluster already runs.
  status   daemons and the sinfo line; exit 0 if jobs can run, 1 otherwise
  stop     stop slurmd, slurmctld, munged started by this script
Logs: $CTLD_LOG, $SLURMD_LOG, $MUNGE_LOG
No accounting database, so the real sacct fails: for sweeps (submitit), put slurm/bin first on PATH,
whose sacct answers from scontrol (export PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/bin:\$PATH").
EOF
}

# ---- processes ---------------------------------------------------------------------------------

# A live process (a zombie, dead but not yet reaped by its parent, does not count). `read`, not
# `cat`: these run for every process in /proc, and a fork each is slow.
alive() {
    local stat
    { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
    stat="${stat##*) }"  # the fields after "pid (comm) "; the first is the state letter
    [[ "${stat:0:1}" != Z ]]
}

# Live pids whose command name is exactly $1 (reads /proc, so minimal images without procps work too).
pids_named() {
    local d comm
    for d in /proc/[0-9]*; do
        { read -r comm <"$d/comm"; } 2>/dev/null || continue
        [[ "$comm" == "$1" ]] && alive "${d#/proc/}" && echo "${d#/proc/}"
    done
    return 0
}
running() { [[ -n "$(pids_named "$1")" ]]; }

# Pid from a daemon's pid file, if that process is alive and still has the daemon's name.
pid_from_file() {
    local name="$1" file="$2" pid
    [[ -r "$file" ]] || return 1
    pid="$(tr -dc 0-9 <"$file")"
    [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]] && alive "$pid" || return 1
    echo "$pid"
}

# Remember the pid the daemon wrote to its pid file once in the background. The file, not a scan
# by name: the daemons fork twice, and a scan can catch the short-lived middle process. Retries, as
# the file appears a moment after the launching process returns.
record_started() {
    local name="$1" pidfile="$2" pid=""
    for _ in $(seq 100); do
        pid="$(pid_from_file "$name" "$pidfile")" && break
        sleep 0.1
    done
    [[ -n "$pid" ]] || return 1
    mkdir -p "$STATE_DIR"
    echo "$pid" >"$STATE_DIR/$name.pid"
}

# ---- install -----------------------------------------------------------------------------------

installed() {
    local bin
    for bin in slurmctld slurmd sinfo munged; do
        command -v "$bin" >/dev/null 2>&1 || return 1
    done
}

cmd_install() {
    if installed; then
        return 0
    fi
    if [[ "${RLMM_SLURM_NO_INSTALL:-0}" == 1 ]]; then
        die 3 "SLURM is not installed and RLMM_SLURM_NO_INSTALL=1; install: apt-get install ${PACKAGES[*]}"
    fi
    if ! is_root || ! command -v apt-get >/dev/null 2>&1; then
        echo "cluster.sh: SLURM is not installed; as root run: apt-get install -y --no-install-recommends ${PACKAGES[*]}" >&2
        exit 3
    fi
    log "installing ${PACKAGES[*]} (apt-get; output in $INSTALL_LOG)"
    # The package lists may be empty (fresh container images): update once, then install.
    export DEBIAN_FRONTEND=noninteractive
    mkdir -p "$(dirname "$INSTALL_LOG")"
    {
        apt-get update -qq && apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
    } </dev/null >"$INSTALL_LOG" 2>&1 || {
        tail -n 5 "$INSTALL_LOG" >&2
        die 1 "apt-get install ${PACKAGES[*]} failed; see $INSTALL_LOG"
    }
    installed || die 1 "installed ${PACKAGES[*]} but slurmctld/slurmd/sinfo/munged are still not on PATH"
}

# ---- configuration -----------------------------------------------------------------------------

# 80% of physical memory (MiB, the same figure as `free -m`'s total): slurmd drains a node that
# claims more than it has, and jobs asking for --mem must fit under RealMemory.
real_memory_mb() {
    awk '/^MemTotal:/ { printf "%d\n", $2 / 1024 * 0.8 }' /proc/meminfo
}

slurm_conf_text() {
    local cpus memory
    # the host's CPUs: GNU nproc honours OMP_NUM_THREADS, and a start from a shell with OMP_NUM_THREADS=1 wrote
    # CPUs=1, where a 2-task test job then pends forever (PartitionConfig)
    cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
    memory="$(real_memory_mb)"
    cat <<EOF
$MARKER
# Single-node cluster for rlmm; regenerated by \`bash slurm/cluster.sh start\` while this header stays.
# Delete the header line to keep hand edits (the script then never touches this file).
ClusterName=rlmm
# NodeAddr/the controller address are loopback: the cluster only talks to itself, so no DNS is needed.
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$CTLD_PIDFILE
SlurmdPidFile=$SLURMD_PIDFILE
SlurmctldLogFile=$CTLD_LOG
SlurmdLogFile=$SLURMD_LOG
# No systemd and maybe no writable cgroups (containers): track processes by /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
# Cores and memory are consumable, so several small jobs (one per sweep point) share the node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# No accounting database (slurmdbd needs MySQL/MariaDB), so sacct fails; slurm/bin/sacct answers
# submitit's job-state queries from the controller's memory instead (slurm/README.md).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# No mail server here; the default /bin/mail is absent and slurmctld logs an error for it.
MailProg=/bin/true
# A node that went down (e.g. slurmd restarted) comes back by itself once it registers again.
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=30
# The controller remembers a finished job (its state: CANCELLED, TIMEOUT, ...) this long. An hour, not
# the default 5 min: submitit polls job states at most every 10 min, through slurm/bin/sacct, which can
# only report what the controller still remembers.
MinJobAge=3600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
# Without a default, a job that gives no --mem (submitit's default) takes the whole node's memory
# and jobs run one at a time: give each CPU its share instead.
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP DefMemPerCPU=$((memory / cpus))
EOF
}

cgroup_conf_text() {
    cat <<EOF
$MARKER
# slurmd 22.05 loads a cgroup plugin even with proctrack/linuxproc; "disabled" is not accepted,
# and IgnoreSystemd lets it run without a systemd-managed cgroup tree.
CgroupPlugin=cgroup/v1
IgnoreSystemd=yes
EOF
}

# Write $2 to $1 if the file is absent or carries our header; leave a site's own file alone.
# Returns 0 when the file changed (daemons must then be restarted to read it).
write_conf() {
    local path="$1" text="$2"
    if [[ -e "$path" ]]; then
        if [[ "$(head -n1 "$path")" != "$MARKER" ]]; then
            return 1
        fi
        [[ "$(cat "$path")" == "$text" ]] && return 1
    fi
    mkdir -p "$(dirname "$path")"
    printf '%s\n' "$text" >"$path"
    chmod 644 "$path"
    log "wrote $path"
    return 0
}

ours() { [[ -r "$1" && "$(head -n1 "$1")" == "$MARKER" ]]; }

# ---- directories and keys ----------------------------------------------------------------------

# Create a directory owned by $2 if missing; an existing one keeps its mode (the packages chose it)
# but gets the owner the daemon needs.
ensure_dir() {
    local mode="$1" owner="$2" dir="$3"
    if [[ -d "$dir" ]]; then
        chown "$owner:$owner" "$dir"
    else
        install -d -m "$mode" -o "$owner" -g "$owner" "$dir"
    fi
}

prepare_dirs() {
    # Debian's packages create the users (slurm, munge) and /var/log/slurm, /etc/munge, /var/lib/munge,
    # /var/log/munge, but leave the spool and /run dirs to systemd's tmpfiles, absent without systemd.
    id slurm >/dev/null 2>&1 || die 1 "user 'slurm' is missing (the slurm packages create it); reinstall ${PACKAGES[*]}"
    id munge >/dev/null 2>&1 || die 1 "user 'munge' is missing (the munge package creates it); reinstall munge"
    ensure_dir 755 slurm /var/spool/slurmctld   # slurmctld drops to SlurmUser=slurm and saves state here
    ensure_dir 755 slurm "$LOG_DIR"
    ensure_dir 755 root /var/spool/slurmd       # slurmd stays root
    ensure_dir 755 munge /run/munge             # munged's socket: clients (any user) must reach it
    ensure_dir 711 munge /var/lib/munge
    ensure_dir 700 munge /var/log/munge
    ensure_dir 700 munge /etc/munge
    # The munge package creates a key at install time; make one if an image stripped it.
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null 2>&1; then
            runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
        chown munge:munge /etc/munge/munge.key
        chmod 600 /etc/munge/munge.key
    fi
}

# ---- daemons -----------------------------------------------------------------------------------

# Run a daemon that forks into the background. Its stdio goes to $STATE_DIR/<name>.out (errors
# before it opens its own log land there) and never to our caller's stdout, so a caller that captures
# output (pytest, CI) is not held open by the daemon.
launch() {
    local name="$1" pidfile="$2" logfile="$3" out="$STATE_DIR/$1.out"
    shift 3
    mkdir -p "$STATE_DIR"
    # Not running (checked by the caller), so a pid file left by a killed daemon is stale: drop it
    # so that record_started reads the new one.
    rm -f "$pidfile" "$STATE_DIR/$name.pid"
    log "starting $name"
    # 9>&-: a daemon must not inherit one_at_a_time's lock, or it holds it for its whole life.
    if ! "$@" </dev/null >"$out" 2>&1 9>&-; then
        tail -n 5 "$out" >&2
        die 1 "$name failed to start; see $out and $logfile"
    fi
    record_started "$name" "$pidfile" || die 1 "$name did not come up (no live pid in $pidfile after 10 s); see $out and $logfile"
}

start_munged() {
    running munged && return 0
    # As the munge user, like Debian's init script (munged insists on owning its key and log);
    # --force gets past a stale socket left by a killed munged.
    launch munged "$MUNGE_PIDFILE" "$MUNGE_LOG" runuser -u munge -- munged --force
    # slurmctld/slurmd authenticate every message through munge: check it answers first.
    munge -n </dev/null | unmunge >/dev/null 2>&1 || die 1 "munge does not answer (munge -n | unmunge); see $MUNGE_LOG"
}

start_slurm_daemon() {
    local name="$1" pidfile="$2" logfile="$3"
    running "$name" && return 0
    # Started as root; slurmctld then drops to SlurmUser itself, slurmd stays root.
    launch "$name" "$pidfile" "$logfile" "$name"
}

# Stop one daemon, but only the process this script started (pid recorded at start, name checked).
# Returns 1 when a daemon of that name runs that this script did not start (left alone).
stop_daemon() {
    local name="$1" pidfile="${2:-}" pid
    pid="$(pid_from_file "$name" "$STATE_DIR/$name.pid")" || {
        rm -f "$STATE_DIR/$name.pid" 2>/dev/null || true
        if running "$name"; then
            log "$name (pid $(pids_named "$name" | paste -sd,)) was not started by this script; left alone"
            return 1
        fi
        [[ -z "$pidfile" ]] || rm -f "$pidfile" 2>/dev/null || true  # stale: its daemon is gone
        return 0
    }
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || die 1 "cannot signal $name (pid $pid): run as root"
    for _ in $(seq 100); do
        alive "$pid" || break
        sleep 0.1
    done
    if alive "$pid"; then
        log "$name did not exit in 10 s; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$STATE_DIR/$name.pid" 2>/dev/null || true
    # slurmctld, running as SlurmUser, cannot delete its pid file in /run; a stale one makes the
    # Debian package's prerm call scancel and fail, so apt could not remove or upgrade slurmctld.
    [[ -z "$pidfile" ]] || rm -f "$pidfile" 2>/dev/null || true
    return 0
}

# ---- cluster state -----------------------------------------------------------------------------

# The node's state as sinfo prints it (idle, mix, alloc, down*, drain, unk*, ...), empty if the
# controller does not answer.
node_state() {
    command -v sinfo >/dev/null 2>&1 || return 0
    timeout 10 sinfo -h -N -n "$NODE" -o %t 2>/dev/null | awk 'NR == 1' || true
}

usable_state() { [[ "$1" =~ ^(idle|mix|mixed|alloc|allocated|comp|completing)$ ]]; }

# Jobs can run: on our local cluster, the three daemons run and the node is usable; on a site's
# cluster (a slurm.conf not written here), sinfo shows some node that can take jobs.
cluster_usable() {
    if ours "$SLURM_CONF"; then
        running munged && running slurmctld && running slurmd && usable_state "$(node_state)"
    else
        command -v sinfo >/dev/null 2>&1 || return 1
        timeout 10 sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)$'
    fi
}

cmd_status() {
    local name
    for name in munged slurmctld slurmd; do
        if running "$name"; then
            echo "$name: running (pid $(pids_named "$name" | paste -sd,))"
        else
            echo "$name: not running"
        fi
    done
    if ! command -v sinfo >/dev/null 2>&1; then
        echo "sinfo: not installed"
    elif ours "$SLURM_CONF" && ! running slurmctld; then
        echo "sinfo: skipped (no local slurmctld; sinfo would retry for 10 s)"
    else
        echo "sinfo: $(timeout 10 sinfo -h -o '%P %a %D %t %N' 2>&1 | paste -sd';' || true)"
    fi
    if cluster_usable; then
        echo "cluster: usable (config $SLURM_CONF)"
        return 0
    fi
    echo "cluster: not usable (config $SLURM_CONF; logs $CTLD_LOG, $SLURMD_LOG)"
    return 1
}

wait_until_usable() {
    local deadline=$((SECONDS + TIMEOUT)) state="" resumed=0 name
    while ((SECONDS < deadline)); do
        state="$(node_state)"
        if usable_state "$state"; then
            log "node $NODE is $state; partition '$PARTITION' ready"
            return 0
        fi
        # A node that was down/drained (saved state from an earlier run, or a config change) is put
        # back once slurmd answers; "*" means slurmd has not registered yet, so keep waiting then.
        if [[ "$state" =~ ^(down|drain|drng|drained|draining|fail)$ ]] && ((resumed < 3)); then
            log "node $NODE is $state; resuming it"
            scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
            resumed=$((resumed + 1))
        fi
        for name in slurmctld slurmd munged; do
            running "$name" || die 1 "$name died while waiting for the node; see its log ($CTLD_LOG, $SLURMD_LOG, $MUNGE_LOG)"
        done
        sleep 1
    done
    local reason
    reason="$(timeout 10 sinfo -h -N -n "$NODE" -o '%E' 2>/dev/null || true)"
    die 1 "node $NODE not usable after ${TIMEOUT}s (state '${state:-no answer}'${reason:+, reason: $reason}); see $CTLD_LOG and $SLURMD_LOG"
}

cmd_start() {
    cmd_install
    local changed=0
    if [[ -e "$SLURM_CONF" ]] && ! ours "$SLURM_CONF"; then
        # A site's own cluster: never rewrite its config or start daemons for it; just report.
        log "$SLURM_CONF was not written by this script; using the cluster it describes"
        cluster_usable && { log "cluster usable"; return 0; }
        die 1 "$SLURM_CONF (the site's own) describes a cluster that is not usable from here; start its daemons, or point SLURM_CONF at another path for a local cluster"
    fi
    if ! is_root; then
        # Already running (started by root earlier) is fine; anything else needs root.
        cluster_usable && return 0
        die 3 "starting the SLURM daemons needs root (sudo bash slurm/cluster.sh start)"
    fi
    write_conf "$SLURM_CONF" "$(slurm_conf_text)" && changed=1
    if [[ -e "$CGROUP_CONF" ]] && ! ours "$CGROUP_CONF"; then
        log "$CGROUP_CONF was not written by this script; left as is"
    else
        write_conf "$CGROUP_CONF" "$(cgroup_conf_text)" && changed=1
    fi
    if ((changed)) && { running slurmctld || running slurmd; }; then
        # New node size or partition: daemons read slurm.conf only at start.
        log "configuration changed; restarting slurmd and slurmctld"
        if ! { stop_daemon slurmd "$SLURMD_PIDFILE" && stop_daemon slurmctld "$CTLD_PIDFILE"; }; then
            die 1 "cannot restart SLURM for the new $SLURM_CONF: stop the daemons listed above, then start again"
        fi
    fi
    if cluster_usable; then
        log "already running; node $NODE usable"
        return 0
    fi
    prepare_dirs
    start_munged
    start_slurm_daemon slurmctld "$CTLD_PIDFILE" "$CTLD_LOG"
    start_slurm_daemon slurmd "$SLURMD_PIDFILE" "$SLURMD_LOG"
    wait_until_usable
}

cmd_stop() {
    stop_daemon slurmd "$SLURMD_PIDFILE" || true
    stop_daemon slurmctld "$CTLD_PIDFILE" || true
    stop_daemon munged "$MUNGE_PIDFILE" || true
    log "stopped"
}

# One install, start or stop at a time on this machine: two sweeps (or two test workers) starting the cluster at once
# would both apt-get install and both start daemons. A later caller waits for the first, then finds it done.
one_at_a_time() {
    local lock="${TMPDIR:-/tmp}/rlmm-slurm-cluster.lock"
    { command -v flock >/dev/null && exec 9>>"$lock"; } 2>/dev/null || return 0
    flock -n 9 && return 0
    log "waiting for another cluster.sh to finish (it holds $lock)"
    flock -w 1800 9 || die 1 "another cluster.sh has held $lock for 30 min (fuser $lock names it)"
}

main() {
    # Debian puts the daemons in /usr/sbin, which a non-login root shell (CI) may not have on PATH.
    PATH="$PATH:/usr/sbin:/sbin"
    case "${1:-}" in
        install) one_at_a_time; cmd_install ;;
        start) one_at_a_time; cmd_start ;;
        status) cmd_status ;;
        stop) one_at_a_time; cmd_stop ;;
        -h | --help | help) usage ;;
        "") usage >&2; exit 2 ;;
        *) echo "cluster.sh: error: unknown command '$1' (allowed: install, start, status, stop, --help)" >&2; exit 2 ;;
    esac
}

main "$@"
