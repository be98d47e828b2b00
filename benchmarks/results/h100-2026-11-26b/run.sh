# GPU session of 2026-11-26 (seventh): one call. Committed build first (smoke, live on the 9 shared
# traces + the H100 recording), then the real caching allocator recorded replaying the recording at
# the torch model's minimum capacity (the gap of docs/gpu.md), then .gpu/ab3.sh (NP_EXP 0 vs 1665).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
S=/tmp/s; mkdir -p $S
BUDGET=200 STEPS="smoke live" bash benchmarks/gpu_session.sh $S .gpu/traces
tar czf $OUT/session.tgz -C $S .
echo "== session done at $(( SECONDS - T0 )) s"
timeout 60 python3 benchmarks/gpu_probe.py record .gpu/traces/h100-gpt-bf16-train.pickle 2162 /tmp/rec2162.pickle > $OUT/rec.log 2>&1
echo "== record exit $? at $(( SECONDS - T0 )) s"; cat $OUT/rec.log | tail -3
[ -f /tmp/rec2162.pickle ] && gzip -c /tmp/rec2162.pickle > $OUT/rec2162.pickle.gz
for f in $S/live_*.json; do python3 - "$f" <<'P'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[1].split("/")[-1], json.dumps(r)[:600])
P
done
bash .gpu/ab3.sh
echo "== all done at $(( SECONDS - T0 )) s"
