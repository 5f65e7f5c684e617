# sourced by every call: paths and the run's records
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONPATH=$PWD
W=/tmp/w; REP=$W/rep; mkdir -p $W $REP $OUT
M=$W/gates/models/qwen2-1.5b-q8_0-s0.gguf
P=$W/pfx            # the series (25 patches) built from .carry/src.tar.xz
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
wait_file() { for i in $(seq ${2:-300}); do [ -f $1 ] && break; sleep 1; done; ls -la $W/gates/models/; }
B=$P/bin/llama-bench
bench() { # dir name kv extra-args -- env...   (window at about half of the cells in the tail, depth 16384)
  local dir=$1 name=$2 kv=$3 extra=$4; shift 4
  local vt=$([ $kv = f16 ] && echo 2683 || echo 2594)
  env "$@" $B -m $M -o json -v -fa on -ngl 99 -ctk $kv -ctv $kv -d 16384 -p 512 -n 64 -r 5 -krm window -vt $vt $extra \
    > $dir/$name-$kv.json 2> $dir/$name-$kv.log
  echo "$name $kv rc=$? $(grep -m1 -o 'position window = [0-9]* / [0-9]*' $dir/$name-$kv.log) $(grep -m1 -o 'prefetch copies: .*' $dir/$name-$kv.log)"
}
