# sourced by every call: paths and the run's records
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONPATH=$PWD
W=/tmp/w; REP=$W/rep; mkdir -p $W $REP /tmp/wh $OUT
M=$W/gates/models/qwen2-1.5b-q8_0-s0.gguf
M14=$W/gates/models/qwen2.5-14b-1m-q8_0-s0.gguf
P=$W/pfx            # the series (20 patches) built from .carry/src.tar.xz, installed by rollkv build
BD=$W/src/build-cuda
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
wait_m14() { for i in $(seq ${1:-300}); do [ -f ${M14%.gguf}.json ] && break; sleep 1; done; ls -la $W/gates/models/; tail -2 $W/m14.log; }
