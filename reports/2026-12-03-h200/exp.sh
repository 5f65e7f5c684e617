#!/bin/bash
# issue 30 experiments: test-backend-ops, 8 ops, -j 14, one run per NAME unless its result exists.
# usage: exp.sh DEADLINE_EPOCH NAME... ; names: see case below; no run starts within 80 s of the deadline.
W=/tmp/w; mkdir -p $W/r $W/core
TBO=$W/bld/bin/test-backend-ops
OPS=CPY,DUP,CONT,GET_ROWS,SET_ROWS,FLASH_ATTN_EXT,MUL_MAT,ROPE
deadline=$1; shift
for n in "$@"; do
  base=${n%%.*}   # NAME.k repeats
  [ -e $W/r/$n.rc ] && continue
  if [ $(( $(date +%s) + 80 )) -gt $deadline ]; then echo "$n: skipped (deadline)"; continue; fi
  case $base in
    control)  e=(GGML_TEST_WINDOW=dst:odd) ;;
    core)     e=(GGML_TEST_WINDOW=dst:odd CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION=0
                 "CUDA_COREDUMP_FILE=$W/core/core.%p"
                 CUDA_COREDUMP_GENERATION_FLAGS=skip_global_memory,skip_shared_memory,skip_local_memory) ;;
    plain)    e=(GGML_TEST_WINDOW_UNUSED=1) ;;
    keep)     e=(GGML_TEST_WINDOW=dst:odd GGML_TEST_WINDOW_KEEP=1) ;;
    serial)   e=(GGML_TEST_WINDOW=dst:odd GGML_CUDA_WINDOW_DIAG_SERIAL=1) ;;
    devonly)  e=(GGML_TEST_WINDOW=dst:odd GGML_CUDA_WINDOW_DIAG_DEVICE_ONLY=1) ;;
    eager)    e=(GGML_TEST_WINDOW=dst:odd CUDA_MODULE_LOADING=EAGER) ;;
    keepva)   e=(GGML_TEST_WINDOW=dst:odd GGML_CUDA_WINDOW_DIAG_KEEP_VA=1) ;;
    half)     e=(GGML_TEST_WINDOW=dst:half) ;;
    srcodd)   e=(GGML_TEST_WINDOW=src:odd) ;;
    *) echo "unknown $n"; continue ;;
  esac
  s=$SECONDS
  env "${e[@]}" timeout 75 $TBO -b CUDA0 -o $OPS -j 14 > $W/r/$n.out 2> $W/r/$n.err
  rc=$?; echo $rc > $W/r/$n.rc
  echo "$n rc=$rc $((SECONDS-s))s env=[${e[*]}] illegal=$(grep -c 'illegal memory' $W/r/$n.err) $(grep 'tests passed' $W/r/$n.out | tr -d '\n') | $(grep -o 'GGML_TEST_WINDOW=[a-z:]*: [0-9]* tensors placed' $W/r/$n.out)" | tee -a $W/r/summary.txt
  if [ $base = core ]; then
    ls -la $W/core | tee -a $W/r/summary.txt
    G=$(command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null)
    for f in $W/core/core.*; do
      [ -e "$f" ] || continue
      if [ -n "$G" ]; then
        timeout 60 $G -batch -ex "target cudacore $f" -ex "info cuda kernels" -ex "bt 8" -ex "x/4i \$pc" -ex "info cuda warps" > $W/r/cudacore.txt 2>&1
        echo "cuda-gdb rc=$?" >> $W/r/cudacore.txt
      else echo "no cuda-gdb" > $W/r/cudacore.txt; fi
      break
    done
  fi
done
