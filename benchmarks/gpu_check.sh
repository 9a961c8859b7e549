#!/usr/bin/env bash
# One lease of a GPU machine, in one command: what the project checks on CUDA.
#
#   bash benchmarks/gpu_check.sh OUT_DIR [SECONDS]
#
# Run from the repository root on a machine with CUDA and torch (no package index needed: the
# project installs with --no-deps, its runtime dependencies are common).  In order, each phase
# bounded by `timeout` so that the whole stays inside SECONDS (default 540):
#   1. the machine (GPU, driver, torch, triton) -> env.txt
#   2. the CUDA tests (every optimizer path against the CPU reference loop, towers, the CLI on
#      CUDA) -> cuda-tests.log
#   3. the optimizer speed benchmark on the GPU set (transformer-134m), one optimizer per
#      process so a cut-off run keeps the rows done, each on the default path (what a user gets
#      without flags), foreach and fused, each in a fresh inductor cache; then Adam's default
#      path in two processes sharing one cache, the second loading the kernel from it (its
#      compile time with the cache warm) -> speed.log, speed.tar.gz (the JSONs)
#   4. with GPU_CHECK_CLUSTER=1, the emulated cluster on this machine's cores (uniform links;
#      where `ip` and `tc` are missing, iproute2's .deb files in GPU_CHECK_IPROUTE, default
#      .ipr/, are unpacked under /tmp and used from there; on a Debian or Ubuntu machine with a
#      package index: `mkdir .ipr && cd .ipr && apt-get download iproute2 libbpf1 libelf1
#      libmnl0 libcap2 libxtables12 libbsd0 libmd0`) -> cluster.log, cluster.tar.gz
#   5. the test suite's fast part (-m "not slow"; without the TensorFlow and RETURNN
#      conformance suites where those are not installed) in the time left -> suite.log
#      (verbose: a cut-off run still says which tests passed)
# Logs go straight to OUT_DIR, so what a killed run had written still comes back.
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [SECONDS]}
budget=${2:-540}
device=${GPU_CHECK_DEVICE:-cuda}
preset=${GPU_CHECK_PRESET:-transformer-134m}
# "nocombo": Adam's fused path again with a launch per parameter (combo_kernels, several
# parameters a launch, is the default on CUDA from torch 2.11)
optimizers=${GPU_CHECK_OPTIMIZERS:-AdamOptimizer nocombo RMSPropOptimizer AMSGradOptimizer \
FtrlOptimizer NormalizedSGD AdadeltaOptimizer GradientDescentOptimizer \
ProximalGradientDescentOptimizer}
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
mkdir -p "$out"
scratch=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
    echo "cores: $(nproc)"
    # the console script `gradfleet` for the CLI tests; PYTHONPATH covers the package itself
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

echo "== CUDA tests ($(left) s left)"
timeout 230 python3 -m pytest -q -n 8 -p no:cacheprovider --timeout 200 -rfEs \
    tests/kernels/test_cuda.py tests/kernels/test_fast_paths.py tests/cli/test_device.py \
    tests/distributed/wrappers/test_towers_cuda.py tests/distributed/transport/test_transport.py \
    -k "cuda or device or towers or default_path" \
    >"$out/cuda-tests.log" 2>&1
echo "rc $?"
tail -15 "$out/cuda-tests.log"

echo "== optimizer speed, $preset on $device ($(left) s left)"
for name in $optimizers; do
    [ "$(left)" -gt 130 ] || { echo "skipped $name: time"; continue; }
    if [ "$name" = nocombo ]; then
        what=(--paths fused --only AdamOptimizer --fused-option combo_kernels=0)
    else
        what=(--paths default foreach fused --only "$name")
    fi
    timeout 120 python3 -m benchmarks.optimizers.optimizer_speed --device "$device" --preset "$preset" \
        "${what[@]}" --out "$scratch/speed/$name" >>"$out/speed.log" 2>&1
    echo "$name rc $?"
    tar -czf "$out/speed.tar.gz" -C "$scratch" speed
done
# Adam's default path in two processes sharing one inductor cache directory (the rows above
# each compile in a fresh one): the second loads the kernel from the FX graph cache, as every
# run of a user's job after the first does
if [ "$(left)" -gt 200 ]; then
    for run in cold warm; do
        echo "== $run compile (shared cache)" >>"$out/speed.log"
        TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" timeout 100 python3 -m benchmarks.optimizers.optimizer_speed \
            --device "$device" --preset "$preset" --paths default --only AdamOptimizer \
            --out "$scratch/speed/$run" >>"$out/speed.log" 2>&1
    done
    tar -czf "$out/speed.tar.gz" -C "$scratch" speed
fi
grep -E "^[A-Z][A-Za-z0-9]+ +(default|foreach|fused) |^torch Adam|^ceiling|start-up|^== (cold|warm)|FX graph" \
    "$out/speed.log" 2>/dev/null

if [ "${GPU_CHECK_CLUSTER:-0}" = 1 ]; then
    echo "== emulated cluster ($(left) s left)"
    if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
        mkdir -p /tmp/iproute2
        for f in "${GPU_CHECK_IPROUTE:-.ipr}"/*.deb; do dpkg -x "$f" /tmp/iproute2; done
        export PATH="/tmp/iproute2/bin:/tmp/iproute2/sbin:/tmp/iproute2/usr/sbin:$PATH"
        export LD_LIBRARY_PATH=/tmp/iproute2/usr/lib/x86_64-linux-gnu:/tmp/iproute2/lib/x86_64-linux-gnu
    fi
    mkdir -p "$scratch/cluster"
    timeout 240 python3 benchmarks/cluster/cluster.py --only ddp,sr-shard-order4-ovs,sr-ded-order4-ovs \
        --scenarios uniform --updates 10 --out "$scratch/cluster" --name cluster-gpu-host \
        >"$out/cluster.log" 2>&1
    echo "rc $?"
    tail -8 "$out/cluster.log"
    tar -czf "$out/cluster.tar.gz" -C "$scratch" cluster
fi

echo "== tests, -m 'not slow' ($(left) s left)"
# the live references (TensorFlow, RETURNN) are test dependencies a GPU image may lack
skip=()
python3 -c "import tensorflow" 2>/dev/null || skip+=(--ignore=tests/conformance)
python3 -c "import returnn" 2>/dev/null || skip+=(--ignore=tests/returnn_engine)
# torch's own OptimizerInfo tests need expecttest (the test extra), which a GPU image may lack
python3 -c "import expecttest" 2>/dev/null || skip+=(--ignore=tests/test_torch_optim_conformance.py)
echo "without: ${skip[*]:-nothing}"
suite=$(($(left) - 15))
if [ "$suite" -gt 30 ]; then
    timeout "$suite" python3 -m pytest -v -n 8 --dist worksteal -p no:cacheprovider \
        -rfE -m "not slow" "${skip[@]}" >"$out/suite.log" 2>&1
    echo "rc $?"
    grep -cE " PASSED" "$out/suite.log" | sed 's/^/passed: /'
    grep -E " (FAILED|ERROR) |^(FAILED|ERROR) " "$out/suite.log" | tail -30
    tail -3 "$out/suite.log"
fi
rm -rf "$scratch"
