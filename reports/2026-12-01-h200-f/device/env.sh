# sourced by every call: paths and the run's records
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONPATH=$PWD
W=/tmp/w; REP=$W/rep; mkdir -p $W $REP $OUT
M=$W/gates/models/qwen2-1.5b-q8_0-s0.gguf
P=$W/pfx            # the series (23 patches) built from .carry/src.tar.xz
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
wait_file() { for i in $(seq ${2:-300}); do [ -f $1 ] && break; sleep 1; done; ls -la $W/gates/models/; }
