# A/B on one machine: HEAD's arena (NP_EXP=0) and the change (NP_EXP=641), one build (/tmp/exp)
cp .gpu/exp_core.abi3.so npu_pool/_core.abi3.so
export PYTHONPATH=$PWD:$PYTHONPATH
for cap in 2162 2226 2194; do for m in 0 641; do
  NP_EXP=$m timeout 80 python3 benchmarks/gpu_check.py --steps 60 --dtype bf16 --cap-mib $cap --json $OUT/ab_${cap}_$m.json > $OUT/ab_${cap}_$m.log 2>&1
  echo "cap $cap mode $m exit $?"
done; done
python3 - <<'P'
import json, os, statistics as S
for cap in (2162, 2226, 2194):
    for m in (0, 641):
        f = os.environ["OUT"] + f"/ab_{cap}_{m}.json"
        if not os.path.exists(f): print(cap, m, "no json"); continue
        r = json.load(open(f))["runs"]
        for a in ("native", "npu_pool"):
            x = r[a]; print(cap, m, a, "calls 3+", sum(x["step_calls"][2:]), "ms", round(S.median(x["step_s"][2:]) * 1e3, 2), "peak", x["peak_reserved"])
P
