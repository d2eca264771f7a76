#!/usr/bin/env bash
# Wait until `datastore serve` answers on a Unix socket of this node:
#
#   wait-service.sh SOCKET [TIMEOUT_S [PID]]
#
# Asks `datastore status` every half second. Exit 0 once it answers; 1, naming the socket and
# this host, when TIMEOUT_S seconds (default 60) pass first, or at once when the service's
# process PID (optional, on this host) has exited. PYTHON: the interpreter (default python3).

socket=${1:?usage: wait-service.sh SOCKET [TIMEOUT_S [PID]]}
timeout=${2:-60}
pid=${3:-}
python=${PYTHON:-python3}
deadline=$((SECONDS + timeout))
while :; do
    if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then
        echo "wait-service.sh: datastore serve for $socket on $(hostname) exited before it answered" >&2
        exit 1
    fi
    if [[ -S $socket ]] && "$python" -m datastore status --socket "$socket" --timeout 2 >/dev/null 2>&1; then
        exit 0
    fi
    if ((SECONDS >= deadline)); then
        echo "wait-service.sh: no datastore serve answered on $socket on $(hostname) within ${timeout} s" >&2
        exit 1
    fi
    sleep 0.5
done
