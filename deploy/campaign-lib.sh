# shellcheck shell=bash
# The parts every campaign script shares (sourced by campaign-local.sh, campaign.sbatch and
# campaign.flux): the jobs file, running jobs phase by phase, and shutting everything down on
# the way out, whatever the way out is (done, a failed job, SIGTERM/SIGINT/SIGUSR1).
#
# The jobs file: one job per line, `PHASE RANKS NAME CONFIG [KEY=VALUE ...]` (PHASE 0..999999,
# RANKS 1..999999); `#` starts a comment. The jobs of a phase run at once; phases run one after another, lowest first. CONFIG
# is a trainer TOML file (relative to the jobs file, or absolute), `tournament:FILE` for a
# tournament of RANKS trainers (`trainer tournament`); each KEY=VALUE becomes
# `--set KEY=VALUE` after the campaign's own `data`, `log_file` and `checkpoint_dir`, so a line
# may override those too. Values hold no spaces. NAME names the job's output directory,
# OUT/jobs/NAME (output.log: its stdout and stderr; log.jsonl; checkpoint.pt). A job that fails
# stops the campaign: the other jobs are stopped, later phases do not start.
#
# A script that sources this file sets OUT, DATA (the dataset directory the jobs train on) and
# STOP_TIMEOUT, calls campaign_traps before it starts anything, and defines:
#   job_command I   fills the array JOB_CMD with the command that runs job I in the
#                   foreground, its exit status the job's (its output goes to JOB_LOG, which
#                   it may change from OUT/jobs/NAME/output.log);
#   services_alive  status 0 while every node's service runs;
#   stop_services   stops every service (SIGTERM, harder after STOP_TIMEOUT); status 0 when
#                   each exited 0;
#   cancel_jobs     (may do nothing) stops jobs that outlive their local process (Flux).
# Every long command runs through run_child (its own session, so it is stopped as a whole,
# process group and all, and a terminal's Ctrl-C reaches only this script).

CAMPAIGN_RC=0
CHILD_PIDS=()      # process groups to stop on the way out (run_child)
SERVICES_UP=0      # set by the script once it has started services
JOB_PHASE=() JOB_RANKS=() JOB_NAME=() JOB_CONFIG=() JOB_SETS=()

say() { printf '%s campaign: %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { printf '%s campaign: error: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
usage_error() { fail "$*"; exit 2; }

# read_jobs FILE: fill the JOB_* arrays; a malformed line exits 2 naming FILE:LINE.
read_jobs() {
    local file=$1 dir n=0 line phase ranks name config rest kv k sets kind
    [[ -f $file && -r $file ]] || usage_error "jobs file $file: not a readable file"
    dir=$(cd "$(dirname "$file")" && pwd)
    while IFS= read -r line || [[ -n $line ]]; do
        n=$((n + 1))
        line=${line%$'\r'}  # CRLF line endings and a byte order mark (a file written on Windows)
        ((n > 1)) || line=${line#$'\xef\xbb\xbf'}
        line=${line%%#*}
        [[ $line =~ ^[[:space:]]*$ ]] && continue
        read -r phase ranks name config rest <<<"$line"
        [[ $phase =~ ^[0-9]+$ ]] || usage_error "$file:$n: PHASE '$phase' is not a whole number"
        [[ $ranks =~ ^[1-9][0-9]*$ ]] || usage_error "$file:$n: RANKS '$ranks' is not a positive whole number"
        # at most 6 digits: bash arithmetic wraps past 2^63 (a PHASE of 20 nines sorted as
        # 7766279631452241919, and could run before a smaller phase)
        [[ $phase =~ ^0*[0-9]{1,6}$ ]] || usage_error "$file:$n: PHASE '$phase' is over 999999"
        ((${#ranks} <= 6)) || usage_error "$file:$n: RANKS '$ranks' is over 999999"
        [[ $name =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] ||
            usage_error "$file:$n: NAME '$name' must be letters, digits, '_', '.', '-'"
        for k in "${!JOB_NAME[@]}"; do
            [[ ${JOB_NAME[$k]} != "$name" ]] || usage_error "$file:$n: job name '$name' is used twice"
        done
        [[ -n $config ]] || usage_error "$file:$n: CONFIG is missing (PHASE RANKS NAME CONFIG [KEY=VALUE ...])"
        kind=
        [[ $config != tournament:* ]] || kind=tournament: config=${config#tournament:}
        [[ $config == /* ]] || config=$dir/$config
        [[ -f $config && -r $config ]] || usage_error "$file:$n: config $config: not a readable file"
        config=$kind$config
        read -r -a sets <<<"$rest"  # split on spaces, never globbed ([2,1,1] is a pattern)
        for kv in "${sets[@]}"; do
            [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_.]*=.+ ]] || usage_error "$file:$n: '$kv' is not KEY=VALUE"
        done
        JOB_PHASE+=("$((10#$phase))") JOB_RANKS+=("$ranks") JOB_NAME+=("$name")
        JOB_CONFIG+=("$config") JOB_SETS+=("$rest")
    done <"$file"
    ((${#JOB_NAME[@]})) || usage_error "jobs file $file: no jobs in it"
}

# trainer_args I: fill TRAINER_ARGS with the arguments of `python -m trainer` for job I.
# CONFIG written `tournament:FILE` runs `trainer tournament` (one process per trainer, no
# checkpoint: a checkpoint_dir of FILE is emptied) instead of `trainer train`.
trainer_args() {
    local i=$1 kv sets dir=$OUT/jobs/${JOB_NAME[$1]} config=${JOB_CONFIG[$1]}
    if [[ $config == tournament:* ]]; then
        TRAINER_ARGS=(tournament --config "${config#tournament:}" --set "data=$DATA"
            --set "log_file=$dir/log.jsonl" --set checkpoint_dir= --set checkpoint_interval=0)
    else
        TRAINER_ARGS=(train --config "$config" --set "data=$DATA"
            --set "log_file=$dir/log.jsonl" --set "checkpoint_dir=$dir")
    fi
    read -r -a sets <<<"${JOB_SETS[$i]}"
    for kv in "${sets[@]}"; do TRAINER_ARGS+=(--set "$kv"); done
}

# run_child LOG CMD...: start CMD in its own session, output to LOG ('-': ours); sets CHILD.
# It is stopped on the way out (stop_children) unless forgotten (forget_child): services are,
# as stop_services stops them after the jobs.
run_child() {
    local log=$1
    shift
    if [[ $log == - ]]; then
        setsid "$@" </dev/null &
    else
        setsid "$@" </dev/null >"$log" 2>&1 &
    fi
    CHILD=$!
    CHILD_PIDS+=("$CHILD")
}

# forget_child PID: it has ended (and was waited for).
forget_child() {
    local k
    for k in "${!CHILD_PIDS[@]}"; do
        [[ ${CHILD_PIDS[$k]} != "$1" ]] || unset 'CHILD_PIDS[k]'
    done
}

# run_step LOG CMD...: run CMD in the foreground (a signal still reaches this script at once);
# its exit status.
run_step() {
    local rc
    run_child "$@"
    wait "$CHILD"
    rc=$?
    forget_child "$CHILD"
    return "$rc"
}

# stop_children: SIGTERM to the process group of every child still running; SIGKILL to those
# still there STOP_TIMEOUT seconds later.
stop_children() {
    local pid alive waited=0
    ((${#CHILD_PIDS[@]})) || return 0
    for pid in "${CHILD_PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    while :; do
        alive=0
        for pid in "${CHILD_PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
        ((alive && waited < STOP_TIMEOUT * 10)) || break
        sleep 0.1
        waited=$((waited + 1))
    done
    for pid in "${CHILD_PIDS[@]}"; do
        if kill -0 -- "-$pid" 2>/dev/null; then
            fail "process group $pid still runs ${STOP_TIMEOUT} s after SIGTERM: SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
    done
    CHILD_PIDS=()
}

# remove_service_files SOCKET PID: what the `datastore serve` of pid PID on SOCKET leaves when
# it is killed: the socket, its lock file (SOCKET.lock: the socket's directory was left) and
# its /dev/shm segments.
remove_service_files() {
    rm -f "$1" "$1.lock" "/dev/shm/datastore.$(id -u).$2."*
}

# remove_mpich_segments DIR BEFORE...: remove the MPICH shared-memory segments in DIR
# (mpich_shm_*, 2 MiB each) of this user that are not among BEFORE (those there when the
# campaign began) and that no live process maps: the ranks of an MPICH job stopped by a
# signal leave theirs for good.
remove_mpich_segments() {
    local dir=$1 f mapped
    local -A before=()
    shift
    for f in "$@"; do before[$f]=1; done
    mapped=$(grep -hF -- "$dir/mpich_shm_" /proc/[0-9]*/maps 2>/dev/null | awk '{print $6}')
    for f in "$dir"/mpich_shm_*; do
        [[ -O $f && -z ${before[$f]:-} ]] || continue
        grep -qxF -- "$f" <<<"$mapped" || rm -f -- "$f"
    done
}

# run_phases: every phase of the jobs file; status 1 as soon as a job fails or a service dies.
run_phases() {
    local phase i names
    for phase in $(printf '%s\n' "${JOB_PHASE[@]}" | sort -n -u); do
        names=()
        for i in "${!JOB_NAME[@]}"; do
            [[ ${JOB_PHASE[$i]} == "$phase" ]] && names+=("${JOB_NAME[$i]}")
        done
        say "phase $phase: ${names[*]}"
        RUNNING=()
        for i in "${!JOB_NAME[@]}"; do
            [[ ${JOB_PHASE[$i]} == "$phase" ]] && start_job "$i"
        done
        supervise_jobs || return 1
    done
}

# start_job I: job I in the background; RUNNING maps its pid to I.
start_job() {
    local i=$1 dir=$OUT/jobs/${JOB_NAME[$1]}
    mkdir -p "$dir"
    JOB_LOG=$dir/output.log
    job_command "$i"
    run_child "$JOB_LOG" "${JOB_CMD[@]}"
    RUNNING[CHILD]=$i
    say "job ${JOB_NAME[$i]} started: ${JOB_RANKS[$i]} rank(s), pid $CHILD, output $dir/output.log"
}

# supervise_jobs: until every job of RUNNING ended; status 1 at once when one fails or a
# service is gone (the remaining jobs are left for the exit trap to stop).
supervise_jobs() {
    local pid i rc
    while ((${#RUNNING[@]})); do
        for pid in "${!RUNNING[@]}"; do
            kill -0 "$pid" 2>/dev/null && continue
            wait "$pid"
            rc=$?
            forget_child "$pid"
            i=${RUNNING[$pid]}
            unset 'RUNNING[pid]'
            if ((rc != 0)); then
                fail "job ${JOB_NAME[$i]} failed (exit $rc); its last lines:"
                tail -n 15 "$OUT/jobs/${JOB_NAME[$i]}/output.log" >&2
                return 1
            fi
            say "job ${JOB_NAME[$i]} done"
        done
        if ! services_alive; then
            fail "a datastore service stopped while jobs ran (logs: $OUT/logs)"
            return 1
        fi
        sleep 0.5 &
        NAP=$!
        wait "$NAP"
    done
}

# on_exit: the EXIT trap: stop jobs, then services, then the script's own clean-up.
on_exit() {
    local rc=$?
    trap '' TERM INT USR1 HUP
    ((CAMPAIGN_RC != 0)) && rc=$CAMPAIGN_RC
    [[ -n ${NAP:-} ]] && kill "$NAP" 2>/dev/null
    cancel_jobs
    stop_children
    if ((SERVICES_UP)); then
        if ! stop_services && ((rc == 0)); then
            fail "a datastore service did not stop cleanly (logs: $OUT/logs)"
            rc=1
        fi
    fi
    declare -F cleanup_run >/dev/null && cleanup_run
    if ((rc == 0)); then
        say "campaign finished: every job succeeded"
    else
        fail "campaign stopped (exit $rc); everything it started is shut down"
    fi
    exit "$rc"
}

# campaign_traps: shut down on exit and on SIGTERM, SIGINT, SIGUSR1 (Slurm's warning before
# the time limit) and SIGHUP, exiting 128 + the signal's number.
campaign_traps() {
    trap on_exit EXIT
    trap 'say "SIGTERM: shutting down"; CAMPAIGN_RC=143; exit 143' TERM
    trap 'say "SIGINT: shutting down"; CAMPAIGN_RC=130; exit 130' INT
    trap 'say "SIGUSR1 (time limit near): shutting down"; CAMPAIGN_RC=138; exit 138' USR1
    trap 'say "SIGHUP: shutting down"; CAMPAIGN_RC=129; exit 129' HUP
}
