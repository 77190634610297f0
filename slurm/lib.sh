# What slurm/cluster.sh (one node: this machine) and slurm/two_nodes.sh (two nodes emulated in network
# namespaces) share: installing SLURM, munged, starting and stopping a daemon by its pid file, the lock.
# Sourced, not run. The sourcing script sets SCRIPT (its name, for messages), MARKER (the first line of the
# files it writes), PARTITION and TIMEOUT first.
#
# A daemon is known by its pid file, not by its name: the two clusters run a slurmctld each, and the
# two-node one runs two slurmd, all with the same process name. munged is the exception: one serves both.

readonly PACKAGES=(slurmctld slurmd slurm-client munge)
readonly LOG_DIR=/var/log/slurm
readonly MUNGE_LOG=/var/log/munge/munged.log
readonly INSTALL_LOG=/var/log/slurm/rlmm-install.log
readonly MUNGE_PIDFILE=/run/munge/munged.pid
# Pids of the daemons these scripts started, one file each (named after the daemon's pid file), so `stop`
# leaves alone daemons someone else runs.
readonly STATE_DIR=/run/rlmm-slurm

log() { echo "$SCRIPT: $*" >&2; }
die() { local code="$1"; shift; echo "$SCRIPT: error: $*" >&2; exit "$code"; }
is_root() { [[ "$(id -u)" == 0 ]]; }

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
# The daemon of this pid file runs (started by these scripts or by anyone else with the same config).
runs() { pid_from_file "$1" "$2" >/dev/null; }

# Where these scripts remember the pid of the daemon of pid file $1 (slurmd.pid -> $STATE_DIR/slurmd.pid).
record_of() { local base="${1##*/}"; echo "$STATE_DIR/${base%.pid}.pid"; }

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
    echo "$pid" >"$(record_of "$pidfile")"
}

# ---- install -----------------------------------------------------------------------------------

installed() {
    local bin
    for bin in slurmctld slurmd sinfo munged; do
        command -v "$bin" >/dev/null 2>&1 || return 1
    done
}

# apt-get install the Debian packages $@ (as root; the lists may be empty in a fresh image: update first).
apt_install() {
    if [[ "${RLMM_SLURM_NO_INSTALL:-0}" == 1 ]]; then
        die 3 "$* not installed and RLMM_SLURM_NO_INSTALL=1; install: apt-get install $*"
    fi
    if ! is_root || ! command -v apt-get >/dev/null 2>&1; then
        echo "$SCRIPT: $* not installed; as root run: apt-get install -y --no-install-recommends $*" >&2
        exit 3
    fi
    log "installing $* (apt-get; output in $INSTALL_LOG)"
    export DEBIAN_FRONTEND=noninteractive
    mkdir -p "$(dirname "$INSTALL_LOG")"
    {
        apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@"
    } </dev/null >>"$INSTALL_LOG" 2>&1 || {
        tail -n 5 "$INSTALL_LOG" >&2
        die 1 "apt-get install $* failed; see $INSTALL_LOG"
    }
}

cmd_install() {
    installed && return 0
    apt_install "${PACKAGES[@]}"
    installed || die 1 "installed ${PACKAGES[*]} but slurmctld/slurmd/sinfo/munged are still not on PATH"
}

# ---- configuration -----------------------------------------------------------------------------

# 80% of physical memory (MiB, the same figure as `free -m`'s total): slurmd drains a node that
# claims more than it has, and jobs asking for --mem must fit under RealMemory.
real_memory_mb() {
    awk '/^MemTotal:/ { printf "%d\n", $2 / 1024 * 0.8 }' /proc/meminfo
}

# The host's CPUs: GNU nproc honours OMP_NUM_THREADS, and a start from a shell with OMP_NUM_THREADS=1 wrote
# CPUs=1, where a 2-task test job then pends forever (PartitionConfig).
host_cpus() { env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc; }

# The slurm.conf lines both clusters share; $1: SlurmdTimeout (seconds before a silent node is down).
shared_conf_text() {
    cat <<EOF
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
SlurmdTimeout=$1
InactiveLimit=0
KillWait=30
# The controller remembers a finished job (its state: CANCELLED, TIMEOUT, ...) this long. An hour, not
# the default 5 min: submitit polls job states at most every 10 min, through slurm/bin/sacct, which can
# only report what the controller still remembers.
MinJobAge=3600
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

# Debian's packages create the users (slurm, munge) and /var/log/slurm, /etc/munge, /var/lib/munge,
# /var/log/munge, but leave the spool and /run dirs to systemd's tmpfiles, absent without systemd.
# $1: slurmctld's state directory; the rest: slurmd spool directories.
prepare_dirs() {
    local ctld_state="$1" spool
    shift
    id slurm >/dev/null 2>&1 || die 1 "user 'slurm' is missing (the slurm packages create it); reinstall ${PACKAGES[*]}"
    id munge >/dev/null 2>&1 || die 1 "user 'munge' is missing (the munge package creates it); reinstall munge"
    ensure_dir 755 slurm "$ctld_state"          # slurmctld drops to SlurmUser=slurm and saves state here
    ensure_dir 755 slurm "$LOG_DIR"
    for spool in "$@"; do
        ensure_dir 755 root "$spool"            # slurmd stays root
    done
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

# Run a daemon that forks into the background: `launch NAME PIDFILE LOGFILE COMMAND...`. Its stdio goes to
# $STATE_DIR/<pid file's name>.out (errors before it opens its own log land there) and never to our caller's
# stdout, so a caller that captures output (pytest, CI) is not held open by the daemon.
launch() {
    local name="$1" pidfile="$2" logfile="$3" record out
    shift 3
    record="$(record_of "$pidfile")"
    out="${record%.pid}.out"
    mkdir -p "$STATE_DIR"
    # Not running (checked by the caller), so a pid file left by a killed daemon is stale: drop it
    # so that record_started reads the new one.
    rm -f "$pidfile" "$record"
    log "starting $name"
    # 9>&-: a daemon must not inherit one_at_a_time's lock, or it holds it for its whole life.
    if ! "$@" </dev/null >"$out" 2>&1 9>&-; then
        tail -n 5 "$out" >&2
        die 1 "$name failed to start; see $out and $logfile"
    fi
    record_started "$name" "$pidfile" || die 1 "$name did not come up (no live pid in $pidfile after 10 s); see $out and $logfile"
}

# One munged serves every cluster of this machine (its socket is a file, reached from any network namespace).
start_munged() {
    running munged && return 0
    # As the munge user, like Debian's init script (munged insists on owning its key and log);
    # --force gets past a stale socket left by a killed munged.
    launch munged "$MUNGE_PIDFILE" "$MUNGE_LOG" runuser -u munge -- munged --force
    # slurmctld/slurmd authenticate every message through munge: check it answers first.
    munge -n </dev/null | unmunge >/dev/null 2>&1 || die 1 "munge does not answer (munge -n | unmunge); see $MUNGE_LOG"
}

# Stop munged once no SLURM daemon is left to use it (the other cluster's may still run).
stop_munged_if_unused() {
    if running slurmctld || running slurmd; then
        log "munged left running: slurmctld/slurmd of another cluster use it"
        return 0
    fi
    stop_daemon munged "$MUNGE_PIDFILE" || true
}

# `start_daemon NAME PIDFILE LOGFILE COMMAND...`: start unless the daemon of this pid file runs.
start_daemon() {
    runs "$1" "$2" && return 0
    launch "$@"
}

# Stop the daemon of a pid file, but only the process these scripts started (pid recorded at start, name
# checked). Returns 1 when the pid file names a live daemon they did not start (left alone).
stop_daemon() {
    local name="$1" pidfile="$2" record pid
    record="$(record_of "$pidfile")"
    pid="$(pid_from_file "$name" "$record")" || {
        rm -f "$record" 2>/dev/null || true
        if pid="$(pid_from_file "$name" "$pidfile")"; then
            log "$name (pid $pid, $pidfile) was not started by this script; left alone"
            return 1
        fi
        rm -f "$pidfile" 2>/dev/null || true  # stale: its daemon is gone
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
    rm -f "$record" 2>/dev/null || true
    # slurmctld, running as SlurmUser, cannot delete its pid file in /run; a stale one makes the
    # Debian package's prerm call scancel and fail, so apt could not remove or upgrade slurmctld.
    rm -f "$pidfile" 2>/dev/null || true
    return 0
}

# ---- cluster state -----------------------------------------------------------------------------

# `LABEL: running (pid N)` or `LABEL: not running` for the daemon NAME of a pid file (LABEL: NAME by default).
daemon_line() {
    local pid
    if pid="$(pid_from_file "$1" "$2")"; then
        echo "${3:-$1}: running (pid $pid)"
    else
        echo "${3:-$1}: not running"
    fi
}

usable_state() { [[ "$1" =~ ^(idle|mix|mixed|alloc|allocated|comp|completing)$ ]]; }

# The state of node $1 as sinfo prints it (idle, mix, alloc, down*, drain, unk*, ...), empty if the
# controller does not answer.
node_state() {
    command -v sinfo >/dev/null 2>&1 || return 0
    timeout 10 sinfo -h -N -n "$1" -o %t 2>/dev/null | awk 'NR == 1' || true
}

# Wait up to $TIMEOUT s until every node named is usable; a node left down or drained by an earlier run is
# resumed. `wait_until_usable "NAME:PIDFILE ..." NODE...`: the daemons that must stay alive meanwhile.
wait_until_usable() {
    local daemons="$1" deadline=$((SECONDS + TIMEOUT)) node state="" daemon
    shift
    declare -A resumed=()
    while ((SECONDS < deadline)); do
        local waiting=()
        for node in "$@"; do
            state="$(node_state "$node")"
            usable_state "$state" && continue
            waiting+=("$node")
            # "*" means slurmd has not registered yet: keep waiting then.
            if [[ "$state" =~ ^(down|drain|drng|drained|draining|fail)$ ]] && ((${resumed[$node]:-0} < 3)); then
                log "node $node is $state; resuming it"
                scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
                resumed[$node]=$((${resumed[$node]:-0} + 1))
            fi
        done
        if ((${#waiting[@]} == 0)); then
            log "node$( (($# > 1)) && echo s) $* usable ($state); partition '$PARTITION' ready"
            return 0
        fi
        for daemon in $daemons; do
            runs "${daemon%%:*}" "${daemon#*:}" || die 1 "${daemon%%:*} (${daemon#*:}) died while waiting for the nodes; see its log in $LOG_DIR or $MUNGE_LOG"
        done
        running munged || die 1 "munged died while waiting for the nodes; see $MUNGE_LOG"
        sleep 1
    done
    local reason
    reason="$(timeout 10 sinfo -h -N -n "${waiting[0]}" -o '%E' 2>/dev/null || true)"
    die 1 "node ${waiting[0]} not usable after ${TIMEOUT}s (state '${state:-no answer}'${reason:+, reason: $reason}); see the logs in $LOG_DIR"
}

# ---- one at a time ----------------------------------------------------------------------------

# One install, start or stop at a time on this machine, for either cluster: two sweeps (or two test workers)
# starting a cluster at once would both apt-get install and both start daemons. A later caller waits for the
# first, then finds it done.
one_at_a_time() {
    local lock="${TMPDIR:-/tmp}/rlmm-slurm-cluster.lock"
    { command -v flock >/dev/null && exec 9>>"$lock"; } 2>/dev/null || return 0
    flock -n 9 && return 0
    log "waiting for another cluster script to finish (it holds $lock)"
    flock -w 1800 9 || die 1 "another cluster script has held $lock for 30 min (fuser $lock names it)"
}
