#!/usr/bin/env bash
# benchmarks/cluster's default rows, the code before issue 52's restructure (.old, 91a5d51) and
# after it, one run each, on this machine, one after the other
set -u
out=$1
export PYTHONUNBUFFERED=1
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    mkdir -p /tmp/iproute2
    for f in .ipr/*.deb; do dpkg -x "$f" /tmp/iproute2; done
    export PATH="/tmp/iproute2/bin:/tmp/iproute2/sbin:/tmp/iproute2/usr/sbin:$PATH"
    export LD_LIBRARY_PATH=/tmp/iproute2/usr/lib/x86_64-linux-gnu:/tmp/iproute2/lib/x86_64-linux-gnu
fi
rows=ddp,sr-default,sr-shard-order4-ovs
(cd .old && PYTHONPATH=$PWD/src timeout 200 python3 benchmarks/cluster.py --only $rows \
    --scenarios uniform --updates 8 --out "$out" --name before) > "$out/before.log" 2>&1
echo "before rc $?"; tail -6 "$out/before.log"
PYTHONPATH=$PWD/src timeout 200 python3 benchmarks/cluster/cluster.py --only $rows \
    --scenarios uniform --updates 8 --out "$out" --name after > "$out/after.log" 2>&1
echo "after rc $?"; tail -6 "$out/after.log"
