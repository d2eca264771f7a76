#!/usr/bin/env bash
# Start this node's `datastore serve`, which then is this process (exec):
#
#   serve-node.sh [datastore serve options...]
#
# srun, flux and mpiexec start it as one task per node. The variables such launchers set for
# MPI are cleared first: services that peer over gRPC (--peers) are separate processes, not one
# MPI job, and `datastore serve` refuses --peers when it finds a launcher's variables. With
# --peers and no --node, the node's index is $SLURM_NODEID (Slurm) or $FLUX_TASK_RANK (Flux,
# one task per node). PYTHON: the interpreter that has datastore installed (default python3).
# RUN_DIR (optional): a node-local directory (the socket's, the state file's) to remove once
# the service has exited; then the launcher must signal the whole step (srun, scancel do).

args=("$@")
peers=0 node=0
for a in "$@"; do
    [[ $a == --peers || $a == --peers=* ]] && peers=1
    [[ $a == --node || $a == --node=* ]] && node=1
done
if ((peers && !node)); then
    index=${SLURM_NODEID:-${FLUX_TASK_RANK:-}}
    if [[ ! $index =~ ^[0-9]+$ ]]; then
        echo "serve-node.sh: --peers without --node, and neither SLURM_NODEID nor FLUX_TASK_RANK is set" >&2
        exit 2
    fi
    args+=(--node "$index")
fi

# every launcher variable staging/cluster.py reads (LAUNCH_ENV), and PMI's, PMIx's, Open MPI's
for v in $(compgen -e); do
    case $v in
        PMI_* | PMIX_* | OMPI_* | MPI_LOCALRANKID | MPI_LOCALNRANKS | \
            SLURM_PROCID | SLURM_STEP_NUM_TASKS | SLURM_STEP_TASKS_PER_NODE | SLURM_LOCALID | \
            RANK | WORLD_SIZE | LOCAL_RANK | LOCAL_WORLD_SIZE)
            unset "$v"
            ;;
    esac
done

[[ -n ${RUN_DIR:-} ]] || exec "${PYTHON:-python3}" -m datastore serve "${args[@]}"
# the launcher signals every process of the step, the service too: bash only outlives it (a
# second SIGTERM, passed on, could reach the service after it restored the default action)
trap : TERM INT HUP
"${PYTHON:-python3}" -m datastore serve "${args[@]}" &
pid=$!
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done  # a signal cuts a wait short
wait "$pid"
rc=$?
rm -rf "$RUN_DIR"
exit "$rc"
