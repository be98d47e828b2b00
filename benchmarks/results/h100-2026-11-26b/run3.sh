# GPU session of 2026-11-26 (seventh), third call: the committed arena with one change, a device
# synchronisation where a trim or unpin under cap pressure finds its memory's stream busy
# (NP_EXP=1024 of experiment.patch, the build carried as .gpu/exp_core.abi3.so; NP_EXP=0 is the
# committed arena). The small model trained 60 steps: does 1024 fit at 2162 MiB every time
# (the committed arena ran out in 3 of 7), and what does it cost (2226 MiB beside 0 and native).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
cp .gpu/exp_core.abi3.so npu_pool/_core.abi3.so
T0=$SECONDS
w() {  # NP_EXP ALLOCATOR CAP_MIB NAME
  NP_EXP=$1 timeout 45 python3 benchmarks/gpu_check.py --worker $2 --steps 60 --dtype bf16 --cap-mib $3 > /tmp/w_$4.log 2>&1
  echo "$4 exit $? at $(( SECONDS - T0 )) s"
  (cd /tmp && tar czf $OUT/w6.tgz w_*.log)  # what a time limit cuts short still comes back
}
for i in 1 2 3; do w 1024 npu_pool 2162 e1024_2162_$i; w 0 native 2162 native_2162_$i; w 1024 npu_pool 2162 e1024_2162_${i}b; done
for i in 1 2; do w 0 npu_pool 2226 e0_2226_$i; w 1024 npu_pool 2226 e1024_2226_$i; w 0 native 2226 native_2226_$i; done
cd /tmp && python3 - <<'P' | tee $OUT/summary.txt
import glob, json, re, statistics as S
for f in sorted(glob.glob("/tmp/w_*.log")):
    text = open(f).read(); name = f[7:-4]
    m = re.search(r"^RESULT (.*)$", text, re.M)
    if not m:
        oom = re.search(r"OutOfMemoryError: (.{0,400})", text)
        print(name, "FAILED", oom.group(1) if oom else text[-300:].replace("\n", " | ")); continue
    r = json.loads(m.group(1)); c = r["step_calls"]
    print(name, "steps", len(c), "calls3+", sum(c[2:]), "steps3+with", sum(1 for x in c[2:] if x), "last20", sum(c[-20:]),
          "sync", r.get("calls", {}).get("sync_device", "-"), "ms", round(S.median(r["step_s"][2:]) * 1e3, 2),
          "peak", r["peak_reserved"])
P
echo "== all done at $(( SECONDS - T0 )) s"
