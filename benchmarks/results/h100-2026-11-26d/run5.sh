# GPU session of 2026-11-26 (eleventh), fifth call: gpu_apis.py with the stream rows and their
# control (record_stream left out), this checkout.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
timeout 200 python3 benchmarks/gpu_apis.py --json $OUT/apis.json > $OUT/apis.log 2>&1
echo "== apis exit $? at $(( SECONDS - T0 )) s"; grep -v "^\[W" $OUT/apis.log | tail -12
