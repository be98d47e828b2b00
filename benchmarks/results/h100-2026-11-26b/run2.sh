# GPU session of 2026-11-26 (seventh), second call: the torch model with cudaMalloc's granules.
# (1) gpu_probe.py steady on every repeating trace and the H100 recording, both allocators, at the
# torch model's minimum capacity of this checkout (the recording's is now 2210 MiB, where the
# model says the caching allocator mallocs and frees in every step); (2) the committed arena
# training the small model at 2162 MiB, npu_pool only, four times: how often it runs out.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
S=/tmp/s5; mkdir -p $S
BUDGET=150 STEPS="steady" bash benchmarks/gpu_session.sh $S .gpu/traces
cp $S/steady.log $S/steps.txt $OUT/
echo "== steady done at $(( SECONDS - T0 )) s"
for i in 1 2 3 4; do
  timeout 45 python3 benchmarks/gpu_check.py --worker npu_pool --steps 60 --dtype bf16 --cap-mib 2162 > /tmp/w$i.log 2>&1
  rc=$?
  echo "== repeat $i exit $rc at $(( SECONDS - T0 )) s: $(grep -o 'OutOfMemoryError.\{0,300\}' /tmp/w$i.log | head -1)"
  grep '^RESULT' /tmp/w$i.log | python3 -c 'import sys, json, statistics as S
for l in sys.stdin:
    r = json.loads(l[7:]); c = r["step_calls"]
    print("   steps", len(c), "calls 3+", sum(c[2:]), "last 20", sum(c[-20:]), "peak", r["peak_reserved"], "ms", round(S.median(r["step_s"][2:]) * 1e3, 2))'
done 2>&1 | tee $OUT/repeats.txt
tar czf $OUT/workers.tgz -C /tmp w1.log w2.log w3.log w4.log 2>/dev/null
echo "== all done at $(( SECONDS - T0 )) s"
