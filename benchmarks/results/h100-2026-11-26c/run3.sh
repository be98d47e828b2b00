# GPU session of 2026-11-26 (eighth), third call: the final build (kept buffers survive empty_cache),
# the script calling empty_cache after every offload under both allocators, as verl does.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
c() {  # DIM LAYERS NAME
  timeout 150 python3 benchmarks/gpu_colocate.py --dim $1 --layers $2 --cycles 5 --json $OUT/$3.json > /tmp/$3.log 2>&1
  echo "== $3 exit $? at $(( SECONDS - T0 )) s"; grep -v "^\[W" /tmp/$3.log
}
c 1024 8 call3_final_1024_1
c 2048 8 call3_final_2048_1
c 1024 8 call3_final_1024_2
echo "== all done at $(( SECONDS - T0 )) s"
