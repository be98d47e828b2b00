# GPU session of 2026-11-27 (fifteenth), second call (the first, the same without packing, lost its files):
# this checkout's build (npu_pool/_core.abi3.so carried, cffi from .whl, the traces in .gpu/traces).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
S=/tmp/s; mkdir -p $S
pack() { tar czf $OUT/session.tgz.tmp -C $S . && mv $OUT/session.tgz.tmp $OUT/session.tgz; }
BUDGET=150 STEPS="smoke live" bash benchmarks/gpu_session.sh $S .gpu/traces
pack; echo "== live done at $(( SECONDS - T0 )) s"; cat $S/steps.txt; grep -h "1 TiB\|calls" $S/smoke.log | head -3
for i in 1 2; do for a in native npu_pool; do
  timeout 90 python3 benchmarks/gpu_probe.py threads $a --threads 4 --rounds 3 > $S/threads_${a}_$i.json 2> $S/threads_${a}_$i.log
  pack; echo "== threads $a $i exit $? at $(( SECONDS - T0 )) s"; cat $S/threads_${a}_$i.json; tail -3 $S/threads_${a}_$i.log | grep -v "^\[W"
done; done
STEADY='for t in "$@"; do for a in native npu_pool; do timeout 60 python3 benchmarks/gpu_probe.py steady "$t" $a; done; done'
timeout 140 bash -c "$STEADY" _ .gpu/traces/cnn-adam-train.pickle .gpu/traces/cs336-forward-fp32.pickle \
  .gpu/traces/cs336-medium-ctx1024-infer.pickle .gpu/traces/h100-gpt-bf16-train.pickle > $S/steady.log 2>&1
pack; echo "== steady exit $? at $(( SECONDS - T0 )) s"; grep -c '"same": true' $S/steady.log
for i in 1 2 3; do
  timeout 100 python3 benchmarks/gpu_check.py --steps 60 --dtype bf16 --dim 1024 --layers 12 --heads 16 \
    --vocab 32000 --batch 16 --seq 1024 --pairs 2000 --json $S/repeat_mid_$i.json > $S/repeat_mid_$i.log 2>&1
  pack; echo "== mid_$i exit $? at $(( SECONDS - T0 )) s"; grep -E "median step|identical" $S/repeat_mid_$i.log | head -4
done
echo "== all done at $(( SECONDS - T0 )) s"
