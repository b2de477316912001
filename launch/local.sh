#!/usr/bin/env bash
# N processes of meshtrain.train on this machine, joined like the nodes of a cluster.
#
#   launch/local.sh N CONFIG [--workdir=DIR] [--config.key=value ...]
#   launch/local.sh 2 gpt2_tiny_dp2_tp4 --workdir=runs/two --config.mesh.dcn=data:2
#
# Rehearses a multi-node run before it costs cluster hours: the same trainer, the same
# rendezvous, collectives between processes (gloo on CPU, NCCL on GPUs), checkpoints
# written by every process.
#   - Devices: on a CPU-only machine each process simulates its share of the mesh
#     (mesh size / N). With GPUs, each process gets GPUs/N of them via CUDA_VISIBLE_DEVICES.
#   - Logs: one file per process, DIR/logs/process_I.log (./meshtrain-logs/ without
#     --workdir), appended, each launch headed by a line; process 0's is also shown here.
#   - Failure: when a process exits non-zero the others stop on their own (they are told
#     which one was lost); any still running after $GRACE s (default 30) are killed.
#   - Ctrl-C: SIGTERM to every process, which saves a checkpoint at the next step and
#     exits 0 (rerun the same command to resume). A second Ctrl-C kills them.
#   - Exit status: the worst of the processes' (0 only if all exited 0).
# Environment: PYTHON (default: python), PORT (first of two free ports; default: found
# here), GRACE.
set -uo pipefail

usage() {
  echo "usage: launch/local.sh N CONFIG [--workdir=DIR] [--config.key=value ...]" >&2
  echo "       runs N processes of 'python -m meshtrain.train --config=CONFIG ...' on this machine" >&2
  exit 2
}
[[ $# -ge 2 && $1 =~ ^[1-9][0-9]*$ ]] || usage
N=$1 CONFIG=$2
shift 2
PYTHON=${PYTHON:-python}
GRACE=${GRACE:-30}
cd "$(dirname "$0")/.." || exit 2

workdir=""
args=("$@")
for ((k = 0; k < ${#args[@]}; k++)); do
  case ${args[k]} in
    --workdir=*) workdir=${args[k]#--workdir=} ;;
    --workdir) workdir=${args[k + 1]:-} ;;
  esac
done
logs=${workdir:+$workdir/logs}
logs=${logs:-meshtrain-logs}
mkdir -p "$logs" || exit 2

# Two consecutive free ports: JAX's coordination service, and meshtrain's rendezvous.
PORT=${PORT:-$("$PYTHON" - <<'EOF'
import socket
for _ in range(200):
    with socket.socket() as a:
        a.bind(("127.0.0.1", 0))
        port = a.getsockname()[1]
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
    print(port)
    break
EOF
)}
[[ -n $PORT ]] || { echo "local.sh: found no two free ports; set PORT" >&2; exit 2; }

# GPUs, if any: an equal share for each process.
gpus=0
if [[ -z ${CUDA_VISIBLE_DEVICES+x} ]] && command -v nvidia-smi >/dev/null; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
if ((gpus > 0 && gpus % N)); then
  echo "local.sh: $gpus GPUs do not split evenly between $N processes; use N dividing $gpus" >&2
  exit 2
fi

set -m  # each process in its own process group: Ctrl-C reaches this script, not them
pids=() done=() statuses=()
stamp="--- local.sh $(date -Is): $N processes, --config=$CONFIG $*"
for ((i = 0; i < N; i++)); do
  echo "$stamp" >>"$logs/process_$i.log"
done
tail -n 0 -f "$logs/process_0.log" &
tailer=$!
for ((i = 0; i < N; i++)); do
  env=()
  if ((gpus > 0)); then
    per=$((gpus / N))
    env=("CUDA_VISIBLE_DEVICES=$(seq -s, $((i * per)) $((i * per + per - 1)))")
  fi
  env "${env[@]}" "$PYTHON" -m meshtrain.train --config="$CONFIG" --coordinator="127.0.0.1:$PORT" \
    --num_processes="$N" --process_id="$i" "$@" >>"$logs/process_$i.log" 2>&1 &
  pids+=($!) done+=(0) statuses+=("")
done
echo "local.sh: $N processes (pids ${pids[*]}), coordinator 127.0.0.1:$PORT, logs in $logs/process_I.log" >&2

interrupts=0
on_interrupt() {
  interrupts=$((interrupts + 1))
  if ((interrupts == 1)); then
    echo "local.sh: SIGTERM to every process: each saves at the next step and exits 0 (Ctrl-C again to kill)" >&2
    signal=TERM
  else
    echo "local.sh: killing every process" >&2
    signal=KILL
  fi
  for ((i = 0; i < N; i++)); do
    ((done[i])) || kill -s "$signal" "${pids[i]}" 2>/dev/null
  done
}
trap on_interrupt INT TERM

deadline=0 worst=0 left=$N
while ((left > 0)); do
  for ((i = 0; i < N; i++)); do
    ((done[i])) && continue
    kill -0 "${pids[i]}" 2>/dev/null && continue
    wait "${pids[i]}"
    rc=$?
    done[i]=1 statuses[i]=$rc left=$((left - 1))
    ((rc > worst)) && worst=$rc
    if ((rc != 0 && deadline == 0 && left > 0)); then
      echo "local.sh: process $i exited with status $rc (see $logs/process_$i.log); the others stop too" >&2
      deadline=$((SECONDS + GRACE))
    fi
  done
  if ((deadline > 0 && SECONDS >= deadline && left > 0)); then
    echo "local.sh: processes still running $GRACE s after the first failure; killing them" >&2
    for ((i = 0; i < N; i++)); do
      ((done[i])) || kill -KILL "${pids[i]}" 2>/dev/null
    done
    deadline=$((SECONDS + 3600))
  fi
  ((left > 0)) && sleep 0.2
done
sleep 0.3  # let tail show process 0's last lines
kill "$tailer" 2>/dev/null
wait "$tailer" 2>/dev/null
echo "local.sh: exit statuses by process: ${statuses[*]}; logs in $logs/" >&2
exit "$worst"
