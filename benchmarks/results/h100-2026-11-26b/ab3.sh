# Next GPU session (note of 2026-11-26, third session): the committed arena (NP_EXP=0) against the
# experiment with sync-on-busy (NP_EXP=1665 = 1 + 128 + 512 + 1024), one build of HEAD + experiment.patch
# carried as .gpu/exp_core.abi3.so, real training capped at the tight caps, 60 steps each.
# Adopt 1665 only if it fits wherever 0 fits and its calls stop (steps 6+ zero).
cp .gpu/exp_core.abi3.so npu_pool/_core.abi3.so
export PYTHONPATH=$PWD:$PYTHONPATH
for cap in 2194 2226 2162; do for m in 0 1665; do
  NP_EXP=$m timeout 60 python3 benchmarks/gpu_check.py --steps 60 --dtype bf16 --cap-mib $cap --json $OUT/ab3_${cap}_$m.json > $OUT/ab3_${cap}_$m.log 2>&1
  echo "cap $cap mode $m exit $?"
done; done
python3 - <<'P'
import json, os, statistics as S
for cap in (2162, 2194, 2226):
    for m in (0, 1665):
        f = os.environ["OUT"] + f"/ab3_{cap}_{m}.json"
        if not os.path.exists(f): print(cap, m, "no json (see its log)"); continue
        r = json.load(open(f))["runs"]
        for a in ("native", "npu_pool"):
            x = r[a]; print(cap, m, a, "calls 3+", sum(x["step_calls"][2:]), "6+", sum(x["step_calls"][5:]),
                            "ms", round(S.median(x["step_s"][2:]) * 1e3, 2), "peak", x["peak_reserved"])
P
cd $OUT && tar czf ab3.tgz ab3_* && rm -f ab3_*.json ab3_*.log
