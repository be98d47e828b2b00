#!/usr/bin/env bash
# Every GPU measurement of docs/gpu.md in one run, on a machine with one NVIDIA GPU and a CUDA
# build of torch (npu_pool's C core built, or carried as npu_pool/_core.abi3.so):
#
#   benchmarks/gpu_session.sh OUTDIR TRACES_DIR [MEGATRON_LM_DIR]
#
# TRACES_DIR holds the traces to replay live (.npt or .pickle); MEGATRON_LM_DIR a Megatron-LM
# checkout (default ../shared/clients/megatron-lm). Each step has a time limit and its own log in
# OUTDIR, and a failing step does not stop the others; BUDGET (seconds, default 420) skips steps
# that would start too late; STEPS="smoke live ..." runs only the steps named (default: all of
# smoke apis costs compact threads live steady gpt_small full record gpt_large mcore); PACK=FILE.tgz packs OUTDIR into FILE.tgz after each step (what a time
# limit cuts short still leaves the steps before it).
set -u
OUT=${1:?usage: gpu_session.sh OUTDIR TRACES_DIR [MEGATRON_LM_DIR]}
TRACES=${2:?usage: gpu_session.sh OUTDIR TRACES_DIR [MEGATRON_LM_DIR]}
HERE=$(cd "$(dirname "$0")/.." && pwd)
MEGATRON=${3:-$HERE/../shared/clients/megatron-lm}
BUDGET=${BUDGET:-420}
PY=${PYTHON:-python3}
export PYTHONPATH=$HERE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
START=$SECONDS

step() {  # step NAME LIMIT_S NEED_S COMMAND...: run when NEED_S seconds of the budget are left
  local name=$1 limit=$2 need=$3
  shift 3
  [[ -z ${STEPS:-} || " $STEPS " == *" ${name%%[0-9-]*} "* ]] || return 0
  if (( SECONDS - START + need > BUDGET )); then
    echo "== $name: skipped ($(( SECONDS - START )) s of $BUDGET used)" | tee -a "$OUT/steps.txt"
    return
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $(( SECONDS - t0 )) s" | tee -a "$OUT/steps.txt"
  [ -n "${PACK:-}" ] && tar czf "$PACK.$BASHPID" -C "$OUT" . 2>/dev/null && mv -f "$PACK.$BASHPID" "$PACK"
}

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} >"$OUT/machine.txt" 2>&1

step smoke 60 10 $PY -c 'import npu_pool, torch
pools = npu_pool.install("cuda")
x = torch.empty(100 << 20, dtype=torch.uint8, device="cuda")
print("allocated", torch.cuda.memory_allocated(), "reserved", torch.cuda.memory_reserved())
print("calls", {k: v for k, v in pools[0].stats()["calls"].items() if v})
try:
    torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
    print("1 TiB request: not raised")
except torch.OutOfMemoryError as e:
    print("1 TiB request: torch.OutOfMemoryError:", str(e).splitlines()[0][:400])
y = torch.ones(1 << 20, device="cuda")
print("after it: allocated", torch.cuda.memory_allocated(), "sum", float(y.sum()))'
step apis 120 60 $PY "$HERE/benchmarks/gpu_apis.py" --json "$OUT/apis.json"
step costs 60 20 $PY "$HERE/benchmarks/cuda_call_costs.py" --sizes 2,20,512 --repeat 5 --count 32 \
  --json "$OUT/costs.json"

# npu_pool.compact() on the device: what it gives back, its copies' time, every tensor's contents
# (and empty_cache alone under the caching allocator); then four threads on their own streams, the
# two allocators alternating.
for a in native npu_pool; do
  step "compact-$a" 100 40 $PY "$HERE/benchmarks/gpu_probe.py" compact $a --gib 8 --rounds 3 --json "$OUT/compact_$a.json"
done
for i in 1 2; do for a in native npu_pool; do
  step "threads-$a-$i" 90 30 $PY "$HERE/benchmarks/gpu_probe.py" threads $a --threads 4 --rounds 3 \
    --json "$OUT/threads_${a}_$i.json"
done; done

LANE='for t in "$@"; do n=$(basename "$t"); $PY -m npu_pool.cli replay "$t" --live --validate --device cuda \
  --json "$OUT/live_${n%%.*}.json"; done'
mapfile -t ALL < <(ls -S "$TRACES"/*.npt "$TRACES"/*.pickle 2>/dev/null)
LANES=(); for i in "${!ALL[@]}"; do LANES[i % 3]+="${ALL[i]} "; done  # the largest three apart
export PY OUT HERE
for lane in 0 1 2; do
  # shellcheck disable=SC2086
  [ -n "${LANES[lane]:-}" ] && step "live$lane" 150 40 bash -c "$LANE" _ ${LANES[lane]} &
done
wait

# Each trace that repeats, capped at the torch model's minimum capacity: calls and time per iteration
# (npu_pool with and without compaction).
STEADY='for t in "$@"; do for a in native npu_pool "npu_pool --compact"; do $PY "$HERE/benchmarks/gpu_probe.py" steady "$t" $a; done; done'
step steady 180 40 bash -c "$STEADY" _ "${ALL[@]}" "$HERE/benchmarks/traces/h100-gpt-bf16-train.pickle"

step gpt_small 120 60 $PY "$HERE/benchmarks/gpu_check.py" --steps 200 --dtype bf16 --json "$OUT/gpt_small.json"
# The small model on a full device: both allocators capped at what the native one reserves (the
# recording's 2226 MiB, below: h100-gpt-bf16-train) and at the torch model's minimum capacity of it.
for cap in 2226 2162; do
  step "full$cap" 90 40 $PY "$HERE/benchmarks/gpu_check.py" --steps 60 --dtype bf16 --cap-mib $cap \
    --json "$OUT/full_$cap.json"
done
step record 90 40 $PY "$HERE/benchmarks/gpu_check.py" --steps 10 --dtype bf16 --record "$OUT/gpt_small_native.pickle" \
  --json "$OUT/record.json"
step gpt_large 170 120 $PY "$HERE/benchmarks/gpu_check.py" --steps 40 --dtype bf16 --dim 2048 --layers 16 \
  --heads 16 --vocab 32000 --batch 16 --seq 1024 --max-batch --json "$OUT/gpt_large.json"
step mcore 150 90 $PY "$HERE/benchmarks/gpu_check.py" --model mcore --megatron "$MEGATRON" --steps 30 --dtype bf16 \
  --dim 1536 --layers 12 --heads 16 --vocab 32000 --batch 8 --seq 1024 --max-batch --json "$OUT/mcore.json"
echo "== total $(( SECONDS - START )) s" | tee -a "$OUT/steps.txt"
