# sourced by every call: paths and the run's records
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONPATH=$PWD
W=/tmp/w; REP=$W/rep; mkdir -p $W $REP $OUT
M=$W/gates/models/qwen2-1.5b-q8_0-s0.gguf
M14=$W/gates/models/qwen2.5-14b-1m-q8_0-s0.gguf
P=$W/pfx            # the series (22 patches) built from .carry/src.tar.xz
U=$W/upfx           # the pin with no patch (.carry/up.tar.xz), llama-bench only: resident-ab's upstream
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
wait_file() { for i in $(seq ${2:-300}); do [ -f $1 ] && break; sleep 1; done; ls -la $W/gates/models/; }
