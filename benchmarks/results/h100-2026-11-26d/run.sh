# GPU session of 2026-11-26 (eleventh): one call, this checkout's build (npu_pool/_core.abi3.so
# carried, cffi from .whl, the nine shared traces and the H100 recording in .gpu/traces).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
S=/tmp/s; mkdir -p $S
pack() { tar czf $OUT/session.tgz -C $S . ; }
timeout 90 python3 benchmarks/gpu_apis.py --json $S/apis.json > $S/apis.log 2>&1
echo "== apis exit $? at $(( SECONDS - T0 )) s"; grep -v "^\[W" $S/apis.log | tail -30; pack
BUDGET=150 STEPS="smoke live" bash benchmarks/gpu_session.sh $S .gpu/traces; pack
echo "== live done at $(( SECONDS - T0 )) s"
for i in 1 2 3; do
  timeout 100 python3 benchmarks/gpu_check.py --steps 60 --dtype bf16 --dim 1024 --layers 12 --heads 16 \
    --vocab 32000 --batch 16 --seq 1024 --pairs 2000 --json $S/mid_$i.json > $S/mid_$i.log 2>&1
  echo "== mid_$i exit $? at $(( SECONDS - T0 )) s"; grep -E "median step|identical|peak reserved \|" $S/mid_$i.log; pack
done
STEADY='for t in "$@"; do for a in native npu_pool; do timeout 60 python3 benchmarks/gpu_probe.py steady "$t" $a; done; done'
timeout 130 bash -c "$STEADY" _ .gpu/traces/cnn-adam-train.pickle .gpu/traces/cs336-forward-fp32.pickle \
  .gpu/traces/cs336-medium-ctx1024-infer.pickle .gpu/traces/h100-gpt-bf16-train.pickle > $S/steady.log 2>&1
echo "== steady exit $? at $(( SECONDS - T0 )) s"; pack
cat $S/steps.txt
echo "== all done at $(( SECONDS - T0 )) s"
