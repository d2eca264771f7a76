#!/usr/bin/env bash
# A whole datastore campaign on one machine, its "nodes" played by processes: stage a dataset,
# start one `datastore serve` per node, wait until each answers, export DATASTORE_ADDRESS, run
# the training jobs of a jobs file (the jobs of a phase at once, phases one after another),
# show `datastore status`, and stop every service. Everything it started is stopped, its
# sockets removed, also when a job fails or the script gets SIGTERM, SIGINT or SIGUSR1.
#
#   deploy/campaign-local.sh [--nodes N] [--jobs FILE] [--work DIR] [--src PATH]
#
# Parameters: environment variables (the flags set the first four), with their defaults:
#   NODES=1         nodes to play. Each runs a service on its own socket. With 2 or more the
#                   dataset is staged by `mpiexec -n NODES datastore stage --mode shard` into
#                   WORK/node{node} (each node holds a share of the files) and the services
#                   form one store, peering over gRPC on 127.0.0.1 with a token file; rank r of
#                   a job uses the service of node r % NODES.
#   JOBS=deploy/campaign.jobs   the jobs file (format: deploy/campaign-lib.sh).
#   WORK=./campaign-work        where everything goes: WORK/jobs/NAME/ (output.log, log.jsonl,
#                   checkpoint.pt), WORK/status-nodeK.txt, WORK/logs/, WORK/nodeK/ (staged).
#   SRC=            the dataset to stage, a directory (default: a small synthetic one,
#                   `trainer.cosmology --per-sample`, written to WORK/pfs/cosmo).
#   SOCKET_DIR=     sockets and token (default: a new private directory under TMPDIR, removed
#                   at the end; a given one is kept, its sockets removed).
#   PYTHON=python3  the interpreter with datastore installed; MPIEXEC=mpiexec (Open MPI's gets
#                   --oversubscribe: it refuses more ranks than cores; as root it also needs
#                   OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1).
#   SERVE_TIMEOUT=60  seconds a service has to answer after it starts.
#   STOP_TIMEOUT=30   seconds a job or service has to exit after SIGTERM before SIGKILL.
#   MEMORY_BUDGET=    each service's --memory-budget (default: none).
#
# Exit status: 0 every job succeeded and every service stopped cleanly; 1 staging, a job or a
# service failed (the other jobs are stopped and later phases skipped); 2 bad usage or jobs
# file; 128+N after signal N (SIGTERM 143, SIGINT 130, SIGUSR1 138), everything shut down.

# shellcheck disable=SC2329  # job_command, services_alive, ... are called by campaign-lib.sh
set -o pipefail
DEPLOY_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=deploy/campaign-lib.sh
source "$DEPLOY_DIR/campaign-lib.sh"

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
while (($#)); do
    case $1 in
        --nodes | --jobs | --work | --src)
            [[ -n ${2:-} && $2 != -* ]] || usage_error "$1 needs a value (see --help)"
            ;;&
        --nodes) NODES=$2 && shift ;;
        --jobs) JOBS=$2 && shift ;;
        --work) WORK=$2 && shift ;;
        --src) SRC=$2 && shift ;;
        -h | --help) usage && exit 0 ;;
        *) usage_error "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
NODES=${NODES:-1}
JOBS=${JOBS:-$DEPLOY_DIR/campaign.jobs}
WORK=${WORK:-campaign-work}
SRC=${SRC:-}
PYTHON=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
SERVE_TIMEOUT=${SERVE_TIMEOUT:-60}
STOP_TIMEOUT=${STOP_TIMEOUT:-30}
MEMORY_BUDGET=${MEMORY_BUDGET:-}
export PYTHON

[[ $NODES =~ ^[1-9][0-9]*$ ]] || usage_error "NODES '$NODES' is not a positive whole number"
for v in SERVE_TIMEOUT STOP_TIMEOUT; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || usage_error "$v '${!v}' is not a positive whole number of seconds"
done
[[ -z $SRC || -d $SRC ]] || usage_error "SRC $SRC: not a directory"
command -v "$PYTHON" >/dev/null || usage_error "PYTHON $PYTHON: not found"
read_jobs "$JOBS"
max_ranks=$(printf '%s\n' "${JOB_RANKS[@]}" | sort -n | tail -n 1)
if ((NODES > 1 || max_ranks > 1)); then
    command -v "$MPIEXEC" >/dev/null || usage_error "MPIEXEC $MPIEXEC: not found (needed for NODES > 1 and jobs of several ranks)"
fi
# Open MPI's mpiexec refuses more ranks than cores ("not enough slots"); MPICH's Hydra does not
mpiexec=("$MPIEXEC")
if ((NODES > 1 || max_ranks > 1)) && "$MPIEXEC" --version 2>/dev/null | grep -q -e "Open MPI" -e OpenRTE; then
    mpiexec+=(--oversubscribe)
fi

# the sockets' directory before WORK: a bad one leaves no WORK behind
if [[ -n ${SOCKET_DIR:-} ]]; then
    OWN_SOCKET_DIR=0
    mkdir -p "$SOCKET_DIR" || usage_error "SOCKET_DIR $SOCKET_DIR: cannot create it"
else
    OWN_SOCKET_DIR=1
    SOCKET_DIR=$(mktemp -d "${TMPDIR:-/tmp}/datastore-campaign.XXXXXX") ||
        usage_error "TMPDIR ${TMPDIR:-/tmp}: cannot make the sockets' directory in it (or set SOCKET_DIR)"
fi
SOCKET_DIR=$(cd "$SOCKET_DIR" && pwd)
# refuse MESSAGE: usage_error, removing the sockets' directory made for the run
refuse() {
    ((OWN_SOCKET_DIR)) && rmdir "$SOCKET_DIR"
    usage_error "$*"
}
socket_of() { echo "$SOCKET_DIR/node$1.sock"; }
bytes=$(socket_of $((NODES - 1)) | tr -d '\n' | wc -c)
((bytes <= 105)) || refuse "socket path $(socket_of $((NODES - 1))) is $bytes bytes, over the 105-byte limit of a Unix socket (set a shorter SOCKET_DIR or TMPDIR)"
mkdir -p "$WORK" || refuse "WORK $WORK: cannot create it"
if [[ ! -w $WORK ]] || ! mkdir -p "$WORK/logs" "$WORK/state"; then
    refuse "WORK $WORK: cannot write in it"
fi
WORK=$(cd "$WORK" && pwd)
OUT=$WORK
SERVE_PIDS=()

job_command() {
    local i=$1
    trainer_args "$i"
    if ((JOB_RANKS[i] == 1)); then  # on node 0: DATASTORE_ADDRESS
        JOB_CMD=("$PYTHON" -m trainer "${TRAINER_ARGS[@]}")
        return
    fi
    # each rank talks to the service of its node: the one of rank % NODES
    # shellcheck disable=SC2016  # expanded by each rank's bash
    JOB_CMD=("${mpiexec[@]}" -n "${JOB_RANKS[$i]}" env "CAMPAIGN_NODES=$NODES" "CAMPAIGN_SOCKETS=$SOCKET_DIR"
        bash -c 'r=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}
export DATASTORE_ADDRESS=$CAMPAIGN_SOCKETS/node$((r % CAMPAIGN_NODES)).sock
exec "$@"' rank "$PYTHON" -m mpi4py -m trainer "${TRAINER_ARGS[@]}")
}

services_alive() {
    local pid
    for pid in "${SERVE_PIDS[@]}"; do
        kill -0 "$pid" 2>/dev/null || return 1
    done
}

cancel_jobs() { :; }

# stop_services: SIGTERM to each service, SIGKILL after STOP_TIMEOUT; then nothing of theirs
# is left: their sockets, lock files and /dev/shm segments are removed even after a SIGKILL.
stop_services() {
    local k pid rc ok=0 waited
    for k in "${!SERVE_PIDS[@]}"; do kill -TERM "${SERVE_PIDS[$k]}" 2>/dev/null; done
    for k in "${!SERVE_PIDS[@]}"; do
        pid=${SERVE_PIDS[$k]}
        waited=0
        while kill -0 "$pid" 2>/dev/null && ((waited < STOP_TIMEOUT * 10)); do
            sleep 0.1
            waited=$((waited + 1))
        done
        if kill -0 "$pid" 2>/dev/null; then
            fail "datastore serve of node $k (pid $pid) still runs ${STOP_TIMEOUT} s after SIGTERM: SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null
        fi
        wait "$pid"
        rc=$?
        say "datastore serve of node $k stopped (exit $rc)"
        ((rc == 0)) || ok=1
        remove_service_files "$(socket_of "$k")" "$pid"
    done
    SERVE_PIDS=()
    return "$ok"
}

cleanup_run() {
    remove_mpich_segments /dev/shm "${MPICH_SEGMENTS[@]}"
    rm -f "$SOCKET_DIR/token"
    ((OWN_SOCKET_DIR)) && rmdir "$SOCKET_DIR" 2>/dev/null
}

MPICH_SEGMENTS=(/dev/shm/mpich_shm_*) # there before the campaign: not its own
campaign_traps
say "$NODES node(s), jobs from $JOBS, work in $WORK, sockets in $SOCKET_DIR"

# 1. the dataset: staged to every node's "local disk" (sharded over several)
if [[ -z $SRC ]]; then
    SRC=$WORK/pfs/cosmo
    say "generating a small synthetic dataset in $SRC"
    run_step "$OUT/logs/generate.log" "$PYTHON" -m trainer.cosmology "$SRC" --samples 16 \
        --val-samples 8 --size 8 --noise 0.3 --per-sample ||
        { fail "generating the dataset failed (log: $OUT/logs/generate.log)"; exit 1; }
fi
SRC=$(cd "$SRC" && pwd)
if ((NODES == 1)); then
    DATA=$WORK/node0/$(basename "$SRC")
    say "staging $SRC to $WORK/node0"
    run_step - "$PYTHON" -m datastore stage "$SRC" --to "$WORK/node0" ||
        { fail "staging failed"; exit 1; }
else
    DATA="$WORK/node{node}/$(basename "$SRC")"
    say "staging $SRC to $WORK/node{node}, sharded over $NODES nodes"
    run_step - "${mpiexec[@]}" -n "$NODES" "$PYTHON" -m datastore stage "$SRC" --to "$WORK/node{node}" \
        --mode shard --ranks-per-node 1 || { fail "staging failed"; exit 1; }
fi

# 2. one service per node; several form one store over gRPC
serve=(bash "$DEPLOY_DIR/serve-node.sh")
peers=()
if ((NODES > 1)); then
    (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' >"$SOCKET_DIR/token") ||
        { fail "cannot write $SOCKET_DIR/token"; exit 1; }
    mapfile -t ports < <("$PYTHON" -c '
import socket, sys
held = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in held:
    s.bind(("127.0.0.1", 0))
print("\n".join(str(s.getsockname()[1]) for s in held))' "$NODES")
    for ((k = 0; k < NODES; k++)); do peers+=("127.0.0.1:${ports[$k]}"); done
fi
SERVICES_UP=1
for ((k = 0; k < NODES; k++)); do
    args=(--socket "$(socket_of "$k")" --state-file "$OUT/state/node$k.json" --allow "$WORK")
    [[ -n $MEMORY_BUDGET ]] && args+=(--memory-budget "$MEMORY_BUDGET")
    if ((NODES > 1)); then
        args+=(--tcp "${peers[$k]}" --token-file "$SOCKET_DIR/token" --node "$k"
            --peers "$(IFS=,; echo "${peers[*]}")")
    fi
    run_child "$OUT/logs/serve-node$k.log" "${serve[@]}" "${args[@]}"
    SERVE_PIDS+=("$CHILD") # listed before it is forgotten: a signal between cannot lose it
    forget_child "$CHILD"
    say "node $k: datastore serve pid $CHILD on $(socket_of "$k") (log: $OUT/logs/serve-node$k.log)"
done
for k in "${!SERVE_PIDS[@]}"; do
    run_step - bash "$DEPLOY_DIR/wait-service.sh" "$(socket_of "$k")" "$SERVE_TIMEOUT" "${SERVE_PIDS[$k]}" ||
        { fail "node $k's service never answered (log: $OUT/logs/serve-node$k.log)"; exit 1; }
done
export DATASTORE_ADDRESS
DATASTORE_ADDRESS=$(socket_of 0)
say "every service answers; DATASTORE_ADDRESS=$DATASTORE_ADDRESS"

# 3. the jobs, phase by phase
run_phases || { CAMPAIGN_RC=1; exit 1; }

# 4. what the services hold and served
for ((k = 0; k < NODES; k++)); do
    say "datastore status of node $k:"
    "$PYTHON" -m datastore status --socket "$(socket_of "$k")" | tee "$OUT/status-node$k.txt" ||
        { fail "datastore status of node $k failed"; exit 1; }
done
exit 0
