#!/bin/bash
# flux: -N2
# flux: -t 1h
# flux: --signal=SIGUSR1@2m
# flux: --output=campaign-{{id}}.out
# flux: --job-name=datastore-campaign
# A whole datastore campaign in one Flux allocation (the batch script is the initial program
# of its own Flux instance, which it owns): stage the dataset to every node's local disk (one
# task per node), start one `datastore serve` per node (one background `flux submit`; on
# several nodes they form one store, peering over gRPC), wait until every node's socket
# answers, export DATASTORE_ADDRESS, run the training jobs of a jobs file with `flux submit`
# and `flux job wait` (the jobs of a phase at once, phases one after another), write
# `datastore status` of every node, and stop every service. Everything is shut down, sockets
# removed, also when a job fails, on SIGTERM/SIGINT, and 2 minutes before the time limit
# (SIGUSR1, from --signal above).
#
#   flux batch --env=SRC=/p/lustre/proj/cosmo deploy/campaign.flux
#   flux batch -N8 --env=SRC=/p/lustre/proj/cosmo --env=JOBS=my.jobs deploy/campaign.flux
#
# Submit from the repository root (Flux runs a copy of this file, so deploy/ is found from the
# working directory), or set DEPLOY_DIR.
#
# Parameters: environment variables (flux batch --env=NAME=VALUE), with their defaults:
#   SRC             the dataset on the shared filesystem (required): a directory or archive.
#   JOBS=$DEPLOY_DIR/campaign.jobs   the jobs file (format: deploy/campaign-lib.sh).
#   DEPLOY_DIR=$PWD/deploy
#   OUT=$PWD/campaign-$FLUX_JOB_ID (or campaign-$$)   on a shared filesystem: OUT/jobs/NAME/
#                   (output.log: the job's output), OUT/status.txt, OUT/logs/, the token.
#   LOCAL_DIR=/tmp/$USER/datastore-campaign-$$   node-local: LOCAL_DIR/data (staged),
#                   LOCAL_DIR/run (socket, state; removed at the end).
#   DATA=$LOCAL_DIR/data/$(basename $SRC)   the dataset directory the jobs train on.
#   STAGE_MODE=shard  `datastore stage --mode`: shard or replicate.
#   FLUX_PMI=       `-o pmi=` of staging and jobs, when the default (simple PMI, which MPICH
#                   uses) is not what the site's MPI needs (see the site's documentation).
#   FLUX_JOB_FLAGS= more `flux submit` options of every job, e.g. "-c 8 -g 1".
#   PORT=7433       the services' TCP port on every node (peering; nodes > 1).
#   PYTHON=python3  the interpreter with datastore installed (the same path on every node).
#   SERVE_TIMEOUT=120, STOP_TIMEOUT=60 (seconds), MEMORY_BUDGET= : as in campaign.sbatch.
#
# Exit status: 0 every job succeeded; 1 staging, a job or a service failed; 2 bad parameters
# or jobs file; 128+N after signal N (SIGTERM 143, SIGUSR1 138), everything shut down.

# shellcheck disable=SC2329  # job_command, services_alive, ... are called by campaign-lib.sh
set -o pipefail
DEPLOY_DIR=${DEPLOY_DIR:-$PWD/deploy}
if [[ ! -f $DEPLOY_DIR/campaign-lib.sh ]]; then
    echo "campaign.flux: $DEPLOY_DIR/campaign-lib.sh not found: submit from the repository root or set DEPLOY_DIR" >&2
    exit 2
fi
# shellcheck source=deploy/campaign-lib.sh
source "$DEPLOY_DIR/campaign-lib.sh"

command -v flux >/dev/null || usage_error "flux not found: run this with flux batch (or inside flux alloc)"
[[ -n ${SRC:-} ]] || usage_error "SRC is not set: flux batch --env=SRC=/path/to/dataset ..."
[[ -e $SRC ]] || usage_error "SRC $SRC: no such file or directory"
JOBS=${JOBS:-$DEPLOY_DIR/campaign.jobs}
OUT=${OUT:-$PWD/campaign-${FLUX_JOB_ID:-$$}}
LOCAL_DIR=${LOCAL_DIR:-/tmp/${USER:-$(id -un)}/datastore-campaign-$$}
DATA=${DATA:-$LOCAL_DIR/data/$(basename "$SRC")}
STAGE_MODE=${STAGE_MODE:-shard}
FLUX_PMI=${FLUX_PMI:-}
FLUX_JOB_FLAGS=${FLUX_JOB_FLAGS:-}
PORT=${PORT:-7433}
PYTHON=${PYTHON:-python3}
SERVE_TIMEOUT=${SERVE_TIMEOUT:-120}
STOP_TIMEOUT=${STOP_TIMEOUT:-60}
MEMORY_BUDGET=${MEMORY_BUDGET:-}
export PYTHON
[[ $STAGE_MODE == shard || $STAGE_MODE == replicate ]] || usage_error "STAGE_MODE '$STAGE_MODE' is not shard or replicate"
read -r -a job_flags <<<"$FLUX_JOB_FLAGS"
read_jobs "$JOBS"

NNODES=$(flux resource list -no '{nnodes}') || usage_error "flux resource list failed: not inside a Flux instance?"
mapfile -t HOSTS < <(flux hostlist --expand --delimiter=$'\n' instance)
SOCKET=$LOCAL_DIR/run/datastore.sock
mkdir -p "$OUT/logs" || usage_error "OUT $OUT: cannot create it"
pmi=()
[[ -n $FLUX_PMI ]] && pmi=(-o "pmi=$FLUX_PMI")
# one task on every node, its output labelled by task (= node) rank
on_nodes=(flux run -N "$NNODES" --tasks-per-node=1 --label-io)
SERVE_ID='' SERVE_WAIT=''

job_command() {
    local i=$1 dir=$OUT/jobs/${JOB_NAME[$1]}
    trainer_args "$i"
    # flux writes the job's output to output.log; `flux job wait` says only how it ended
    JOB_LOG=$dir/flux-wait.log
    # shellcheck disable=SC2016  # expanded by that bash
    JOB_CMD=(bash -c 'id=$(flux submit --flags=waitable "${@:2}") || exit 1
echo "$id" >"$1"
exec flux job wait "$id"' submit "$dir/flux-id" -n "${JOB_RANKS[$i]}" --job-name="${JOB_NAME[$i]}"
        --output="$dir/output.log" "${pmi[@]}" "${job_flags[@]}"
        "$PYTHON" -m mpi4py -m trainer "${TRAINER_ARGS[@]}")
}

# the service job runs while `flux job wait` on it does
services_alive() { kill -0 "$SERVE_WAIT" 2>/dev/null; }

# cancel_jobs: Flux jobs outlive the `flux job wait` that watches them
cancel_jobs() {
    local f ids=()
    for f in "$OUT"/jobs/*/flux-id; do [[ -f $f ]] && ids+=("$(<"$f")"); done
    ((${#ids[@]})) && flux job cancel "${ids[@]}" 2>/dev/null
    return 0
}

# stop_services: SIGTERM to every node's service, which drains and exits 0
stop_services() {
    local rc waited=0
    [[ -n $SERVE_ID ]] || return 0
    flux job kill --signal=SIGTERM "$SERVE_ID" 2>/dev/null
    while kill -0 "$SERVE_WAIT" 2>/dev/null && ((waited < STOP_TIMEOUT * 10)); do
        sleep 0.1
        waited=$((waited + 1))
    done
    if kill -0 "$SERVE_WAIT" 2>/dev/null; then
        fail "the services still run ${STOP_TIMEOUT} s after SIGTERM: flux job cancel"
        flux job cancel "$SERVE_ID"
    fi
    wait "$SERVE_WAIT"
    rc=$?
    say "datastore serve stopped on every node (flux job wait: exit $rc)"
    SERVE_ID=''
    return "$rc"
}

# cleanup_run: the node-local run directory (socket, state) and the token
cleanup_run() {
    "${on_nodes[@]}" rm -rf "$LOCAL_DIR/run" || fail "could not remove $LOCAL_DIR/run on every node"
    rm -f "$OUT/token"
}

campaign_traps
say "$NNODES node(s) (${HOSTS[*]}), jobs from $JOBS, output in $OUT"

# 1. stage on every node (one task per node, over MPI: node k of K gets its share with shard)
say "staging $SRC to $LOCAL_DIR/data on every node (--mode $STAGE_MODE)"
run_step - flux run -N "$NNODES" --tasks-per-node=1 "${pmi[@]}" \
    "$PYTHON" -m datastore stage "$SRC" --to "$LOCAL_DIR/data" --mode "$STAGE_MODE" ||
    { fail "staging failed"; exit 1; }

# 2. one service per node, as one background job; on several nodes they peer over gRPC
args=(--socket "$SOCKET" --state-file "$LOCAL_DIR/run/state.json" --allow "$LOCAL_DIR/data")
[[ -n $MEMORY_BUDGET ]] && args+=(--memory-budget "$MEMORY_BUDGET")
if ((NNODES > 1)); then
    (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' >"$OUT/token") ||
        { fail "cannot write $OUT/token"; exit 1; }
    peers=$(printf "%s:$PORT," "${HOSTS[@]}")
    # serve-node.sh takes --node from FLUX_TASK_RANK: one task per node, in the instance's
    # host order (the block task map)
    args+=(--tcp "0.0.0.0:$PORT" --token-file "$OUT/token" --peers "${peers%,}")
fi
SERVICES_UP=1
SERVE_ID=$(flux submit --flags=waitable -N "$NNODES" --tasks-per-node=1 -o pmi=off \
    --job-name=datastore-serve --output="$OUT/logs/serve.log" --label-io \
    bash "$DEPLOY_DIR/serve-node.sh" "${args[@]}") || { fail "flux submit of the services failed"; exit 1; }
run_child "$OUT/logs/serve.wait.log" flux job wait "$SERVE_ID"
forget_child "$CHILD"
SERVE_WAIT=$CHILD
say "datastore serve started on every node (flux job $SERVE_ID, log: $OUT/logs/serve.log)"
run_step - "${on_nodes[@]}" bash "$DEPLOY_DIR/wait-service.sh" "$SOCKET" "$SERVE_TIMEOUT" ||
    { fail "a node's service never answered (log: $OUT/logs/serve.log)"; exit 1; }
export DATASTORE_ADDRESS=$SOCKET  # the same node-local path on every node
say "every node's service answers; DATASTORE_ADDRESS=$DATASTORE_ADDRESS"

# 3. the jobs, phase by phase
run_phases || { CAMPAIGN_RC=1; exit 1; }

# 4. what every node's service holds and served
say "datastore status of every node (labelled by node):"
run_step "$OUT/status.txt" "${on_nodes[@]}" "$PYTHON" -m datastore status --socket "$SOCKET" ||
    { fail "datastore status failed"; exit 1; }
cat "$OUT/status.txt"
exit 0
