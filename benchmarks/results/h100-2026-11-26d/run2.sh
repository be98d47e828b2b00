# GPU session of 2026-11-26 (eleventh), second call: torch.cuda's memory APIs with graph capture and
# a private pool, under this checkout (graph capture refused) and under commit cea9572 (.gpu/old: its
# npu_pool package with the same C core, and this gpu_apis.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
timeout 120 python3 benchmarks/gpu_apis.py --json $OUT/apis.json > $OUT/apis.log 2>&1
echo "== apis exit $? at $(( SECONDS - T0 )) s"; grep -v "^\[W" $OUT/apis.log | tail -32
timeout 120 python3 .gpu/old/benchmarks/gpu_apis.py --json $OUT/apis_before.json > $OUT/apis_before.log 2>&1
echo "== apis_before exit $? at $(( SECONDS - T0 )) s"; grep -v "^\[W" $OUT/apis_before.log | tail -8
echo "== all done at $(( SECONDS - T0 )) s"
