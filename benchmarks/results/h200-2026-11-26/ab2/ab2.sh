# Which part of the change costs memory at the tightest cap: split in place (128), mapped-first (513), both (641)
cp .gpu/exp_core.abi3.so npu_pool/_core.abi3.so
export PYTHONPATH=$PWD:$PYTHONPATH
for cap in 2162 2178; do for m in 128 513 641; do
  NP_EXP=$m timeout 40 python3 benchmarks/gpu_check.py --steps 40 --dtype bf16 --cap-mib $cap --json $OUT/ab2_${cap}_$m.json > /tmp/ab2_${cap}_$m.log 2>&1
  echo "cap $cap mode $m exit $?"
  python3 -c "
import json, statistics as S
r = json.load(open('$OUT/ab2_${cap}_$m.json'))['runs']['npu_pool']
print('   calls 3+', sum(r['step_calls'][2:]), 'last 20', sum(r['step_calls'][-20:]), 'peak', r['peak_reserved'])" 2>/dev/null
done; done
