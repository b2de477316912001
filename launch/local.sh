#!/usr/bin/env bash
# N processes of meshtrain.train on this machine, joined like the nodes of a cluster.
#
#   launch/local.sh N CONFIG [--workdir=DIR] [--config.key=value ...]
#   launch/local.sh 2 gpt2_tiny_dp2_tp4 --workdir=runs/two --config.mesh.dcn=data:2
#
# Rehearses a multi-node run before it costs cluster hours: the same trainer, the same
# start through JAX's coordination service (on 127.0.0.1 only), collectives between processes (gloo on CPU, NCCL on GPUs), checkpoints
# written by every process.
#   - Devices: on a CPU-only machine each process simulates its share of the mesh
#     (mesh size / N). With GPUs, each process gets GPUs/N of them via CUDA_VISIBLE_DEVICES.
#   - Paths: relative ones (--workdir, data.path, checkpoint.dir) are relative to the
#     directory you run this from, as with python -m meshtrain.train. The processes import
#     the installed meshtrain (pip install, editable or not), else this checkout's.
#   - Logs: one file per process, DIR/logs/process_I.log (./meshtrain-logs/ without
#     --workdir), appended, each launch headed by a line; process 0's is also shown here.
#     Lines no one can act on are left out: gloo's "[Gloo] Rank R is connected to K peer
#     ranks" (a connection gloo cannot make fails the run with an error of its own), XLA's
#     "SIGTERM caught" after a Ctrl-C, and JAX's warning that its recoverable-task feature
#     (which lets meshtrain name a lost process) is experimental.
#   - Failure: when a process exits non-zero the others stop on their own (they are told
#     which one was lost); any still running after $GRACE s (default 30) are killed.
#   - Ctrl-C: SIGTERM to every process, which saves a checkpoint at the next step and
#     exits 0 (rerun the same command to resume). A second Ctrl-C kills them.
#   - Exit status: the worst of the processes' (0 only if all exited 0).
# Environment: PYTHON (default: python), PORT (JAX's coordination service; default: a free
# port found here), GRACE.
set -uo pipefail

usage() {
  echo "usage: launch/local.sh N CONFIG [--workdir=DIR] [--config.key=value ...]" >&2
  echo "       (CONFIG or --config=CONFIG, as every meshtrain command takes it)" >&2
  echo "       runs N processes of 'python -m meshtrain.train --config=CONFIG ...' on this machine" >&2
  exit 2
}
[[ $# -ge 2 && $1 =~ ^[1-9][0-9]*$ ]] || usage
N=$1 CONFIG=${2#--config=}  # NAME or --config=NAME; `--config NAME` (two words) gets the usage
[[ -n $CONFIG && $CONFIG != -* ]] || usage
shift 2
PYTHON=${PYTHON:-python}
GRACE=${GRACE:-30}
exec 3>&2  # local.sh's own messages (the wait loop below closes stderr)
say() { echo "local.sh: $*" >&3; }

command -v "$PYTHON" >/dev/null || { say "no Python at PYTHON=$PYTHON"; exit 2; }
# The processes run here, so relative paths mean what they do to the user. meshtrain is the
# installed package if there is one, else the checkout this script belongs to.
if ! "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("meshtrain") is None)' 2>/dev/null; then
  checkout=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [[ ! -f $checkout/meshtrain/__init__.py ]]; then
    say "$PYTHON cannot import meshtrain: install it (pip install -e $checkout) or set PYTHON"
    exit 2
  fi
  export PYTHONPATH=$checkout${PYTHONPATH:+:$PYTHONPATH}
fi

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

# One free port, JAX's coordination service: the only one the job opens for itself.
PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
[[ -n $PORT ]] || { say "found no free port; set PORT"; exit 2; }

# GPUs, if any: an equal share for each process.
gpus=0
if [[ -z ${CUDA_VISIBLE_DEVICES+x} ]] && command -v nvidia-smi >/dev/null; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
if ((gpus > 0 && gpus % N)); then
  say "$gpus GPUs do not split evenly between $N processes; use N dividing $gpus"
  exit 2
fi

# What no one can act on (see the top). Gloo writes its line in pieces to std::cout from
# several threads at once, so one line may hold pieces of several, and a count may end up
# on a line of its own: lines made of those pieces go, and a bare number right after one.
# A line of the process's own that landed between the pieces keeps its text: the pieces
# before and after it are cut off.
quiet() {
  awk -v gloo='[[]Gloo] Rank | is connected to | peer ranks[.] ?|Expected number of connected peer ranks is : ' '
    $0 ~ "^(" gloo "|[0-9]+)*(" gloo ")(" gloo "|[0-9]+)*$" { gloo_line = 1; next }
    gloo_line && /^[0-9]+$/ { next }
    { gloo_line = 0 }
    { sub("^(" gloo "|[0-9]+)*(" gloo ")", ""); sub("(" gloo ")(" gloo "|[0-9]+)*$", "") }
    /^W[0-9][0-9][0-9][0-9] [0-9:.]+ +[0-9]+ preemption_notifier[.]cc:[0-9]+] SIGTERM caught at / { next }
    /^W[0-9][0-9][0-9][0-9] [0-9:.]+ +[0-9]+ coordination_service[.]cc:[0-9]+] .*Using experimental recoverable task feature/ { next }
    { print; fflush() }'
}

set -m  # each process in its own process group: Ctrl-C reaches this script, not them
pids=() done=() statuses=()
# The trap before the first process starts: a Ctrl-C at any moment after reaches them.
interrupts=0
on_interrupt() {
  interrupts=$((interrupts + 1))
  if ((interrupts == 1)); then
    say "SIGTERM to every process: each saves at the next step and exits 0 (Ctrl-C again to kill)"
    signal=TERM
  else
    say "killing every process"
    signal=KILL
  fi
  for i in "${!pids[@]}"; do  # the processes started so far
    ((done[i])) || kill -s "$signal" "${pids[i]}" 2>/dev/null
  done
}
trap on_interrupt INT TERM
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
    --num_processes="$N" --process_id="$i" "$@" \
    > >(quiet >>"$logs/process_$i.log") 2>&1 &
  pids+=($!) done+=(0) statuses+=("")
done
say "$N processes (pids ${pids[*]}), coordinator 127.0.0.1:$PORT, logs in $logs/process_I.log"
# Job control was needed only to start them in groups of their own. Left on, bash prints
# "[1]+ Terminated tail ..." or "[2]- Done ..." whenever it next notices a job ended, which
# may be after the loop below has given its stderr back.
set +m


# bash reports a child killed by a signal on its own stderr ("local.sh: line 140: 4242 Killed
# env ... >> ..."), whenever its next command ends; the loop runs with that stderr closed,
# and says itself which process ended how.
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
      ((rc > 128)) && how="killed by SIG$(kill -l $((rc - 128))); " || how=""
      say "process $i exited with status $rc (${how}see $logs/process_$i.log); the others stop too"
      deadline=$((SECONDS + GRACE))
    fi
  done
  if ((deadline > 0 && SECONDS >= deadline && left > 0)); then
    say "processes still running $GRACE s after the first failure; killing them"
    for ((i = 0; i < N; i++)); do
      ((done[i])) || kill -KILL "${pids[i]}" 2>/dev/null
    done
    deadline=$((SECONDS + 3600))
  fi
  ((left > 0)) && sleep 0.2
done 2>/dev/null
sleep 0.3  # let tail show process 0's last lines
{ kill "$tailer"; wait "$tailer"; } 2>/dev/null
say "exit statuses by process: ${statuses[*]}; logs in $logs/"
exit "$worst"
