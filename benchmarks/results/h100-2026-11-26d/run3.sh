# GPU session of 2026-11-26 (eleventh), third call: gpu_apis.py after the review of the refusal (the C
# base class patched too, torch.compile(mode="reduce-overhead") asked), this checkout.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
timeout 200 python3 benchmarks/gpu_apis.py --json $OUT/apis.json > $OUT/apis.log 2>&1
echo "== apis exit $? at $(( SECONDS - T0 )) s"; grep -v "^\[W" $OUT/apis.log | tail -12
