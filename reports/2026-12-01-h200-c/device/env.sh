# sourced by every call: paths and the run's records
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONPATH=$PWD
W=/tmp/w; REP=$W/rep; mkdir -p $W $REP /tmp/wh $OUT
M=$W/gates/models/qwen2-1.5b-q8_0-s0.gguf
C=$W/conda            # the conda artifact: the channel's CUDA package installed into a fresh prefix
B13=$W/before13       # the same prefix with libllama built without 0013 (K-shift failure fails the decode)
UP=$W/upfx            # upstream pin, no patch (llama-bench only)
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
