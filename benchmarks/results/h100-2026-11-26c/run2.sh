# GPU session of 2026-11-26 (eighth), second call: the kept pinned backup buffer (this checkout's
# build) against the build before it (.gpu/old_core.abi3.so, commit f51ec9c), same machine.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
cp npu_pool/_core.abi3.so /tmp/new_core.abi3.so
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch; print(torch.__version__)"; nproc) > $OUT/machine.txt 2>&1
c() {  # BUILD DIM LAYERS NAME
  cp $1 npu_pool/_core.abi3.so
  timeout 170 python3 benchmarks/gpu_colocate.py --dim $2 --layers $3 --cycles 5 --json $OUT/$4.json > $OUT/$4.log 2>&1
  echo "== $4 exit $? at $(( SECONDS - T0 )) s"; cat $OUT/$4.log | grep -v "^\[W"
}
c /tmp/new_core.abi3.so 1024 8 kept_1024_1
c .gpu/old_core.abi3.so 1024 8 old_1024_1
c /tmp/new_core.abi3.so 2048 8 kept_2048_1
c /tmp/new_core.abi3.so 1024 8 kept_1024_2
echo "== all done at $(( SECONDS - T0 )) s"
