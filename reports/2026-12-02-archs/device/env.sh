# sourced by every call: paths and the run's records
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONPATH=$PWD
W=/tmp/w; mkdir -p $W $OUT
PB=$W/pfx-before   # the series of cea3c79 (25 patches)
PA=$W/pfx-after    # the series with 0090 + 0091 (27 patches)
TARGETS=llama-server,llama-cli,llama-bench,llama-logits-dump,llama-window-test,test-llama-archs
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
