#!/bin/bash
# issue 26: patch 0102 before/after on a head-48 qwen2 (flash attention resolves off) at -c 32768, one build dir.
# before = the same tree with 0102 reversed in src/llama-context.cpp (libllama rebuilt, copied into a prefix copy).
R=$PWD; W=/tmp/w; D=$W/i26; mkdir -p $D; cd $R
P02=$(ls $W/src/patches/0102-*.patch)
if [ ! -e $D/before/lib/libllama.so ]; then
  rm -rf $D/before && cp -a $W/prefix $D/before
  (cd $W/src && patch -R -p1 < $P02) > $D/patch-R.txt 2>&1 || { echo "reverse 0102 failed"; cat $D/patch-R.txt; }
  s=$SECONDS; ninja -C $W/bld llama > $D/ninja-before.log 2>&1; echo "libllama without 0102: rc $? $((SECONDS-s)) s"
  for f in $(find $W/bld -name 'libllama.so*' -not -type d); do cp -P $f $D/before/lib/ 2>/dev/null; done
  find $W/bld -name 'libllama.so*' -type f -exec cp {} $D/before/lib/ \;
  (cd $W/src && patch -p1 < $P02) >> $D/patch-R.txt 2>&1
  s=$SECONDS; ninja -C $W/bld llama > $D/ninja-after.log 2>&1; echo "libllama with 0102 again: rc $? $((SECONDS-s)) s"
  cmp -s $(find $W/bld -name 'libllama.so*' -type f | head -1) $W/prefix/lib/$(basename $(find $W/bld -name 'libllama.so*' -type f | head -1)) && echo "after lib == installed" || echo "after lib differs from installed (timestamps/paths)"
  ls -la $D/before/lib | grep llama
fi
[ -e $D/h48.gguf ] || python3 -c "
from rollkv_dist.models import Shape, write_random_gguf
s = Shape('head48', 12, 1536, 32, 8, 4096, 32768, 1e6, 1e-6, tied_output=True)
print(write_random_gguf('$D/h48.gguf', s, qtype='q8_0', llama_tree='$W/src', progress=False))"
python3 -c "
words='the quick brown fox jumps over the lazy dog while rolling caches keep their cells on the device and the host'.split()
print(' '.join(words[i % len(words)] for i in range(400)))" > $D/prompt.txt
base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0); echo "baseline memory.used $base MiB" | tee $D/summary.txt
one() { # variant mode target
  local v=$1 m=$2 t=$3 n=$1-$2-$3
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 50 > $D/$n.smi & local sp=$!
  local s=$SECONDS
  LD_LIBRARY_PATH=$D/$v/lib timeout 90 $D/$v/bin/llama-logits-dump -m $D/h48.gguf -f $D/prompt.txt -n 4 --logits-out $D/$n \
     -c 32768 -fa auto -ngl 99 -krm $m --vram-target $t > $D/$n.log 2>&1
  local rc=$?; sleep 0.3; kill $sp; wait $sp 2>/dev/null
  local peak=$(sort -n $D/$n.smi | tail -1)
  echo "$n rc=$rc $((SECONDS-s))s peak_used=$peak MiB (process ~ $((peak-base)) MiB) target=$t" | tee -a $D/summary.txt
  grep -E "kv compute reserve|compute buffer size|position window|FULLY RESIDENT|model buffer size|KV buffer size|budget|flash_attn|Flash Attention|kv_residency|window buffer:" $D/$n.log | sed 's/^/    /' | tee -a $D/summary.txt | head -14
}
ls $D/after >/dev/null 2>&1 || ln -s $W/prefix $D/after
for v in before after; do
  for mt in window:1300 auto:3000 auto:3226 auto:3420; do one $v ${mt%:*} ${mt#*:}; done
done
one after auto 8000
one before auto 8000
