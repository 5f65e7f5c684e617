#!/usr/bin/env bash
# call 1: conda artifact (channel CUDA package through the offline packer, installed with py-rattler), upstream build
# in the background, the random 1.5B model, engine + version gates on the artifact, host-memory checks (issue 15)
source .carry/env.sh
exec > >(tee $OUT/c1.log) 2>&1
stamp start; nproc; free -m | head -2; python3 --version; cat .carry/COMMIT
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current --format=csv
ls /sys/bus/virtio/drivers/ 2>&1 | head; ulimit -l; id -u; which setpriv capsh patch git | cat
cp .wh3/*.whl /tmp/wh/
python3 -m pip install -q --no-index --find-links /tmp/wh jinja2 pyyaml conda-package-handling py-rattler 2>&1 | tail -2
tar xJf .carry/src.tar.xz -C $W; tar xJf .carry/up.tar.xz -C $W; ls $W
# upstream, niced, in its own session so it outlives this call
setsid nice -n 19 python3 -m rollkv_dist build --source $W/up --prefix $UP --variant cuda --cuda-arch 90-real --targets llama-bench -j 16 > $W/up-build.log 2>&1 < /dev/null &
LBL=$(python3 -c "from rollkv_dist.channel import machine_variants, variant_label; print(variant_label(machine_variants()[-1]))")
stamp "channel $LBL"
t0=$(date +%s)
ROLLKV_CUDA_ARCHITECTURES=90-real timeout 480 python3 -m rollkv_dist channel $PWD/.work/channel --variant $LBL --builder offline --tree $W/src -j 16 --install $C 2>&1 | grep -v "^\[" | tail -25
echo "channel+install: $(( $(date +%s) - t0 )) s"; ls $C/bin; ls .work/channel/linux-64; cat $C/share/rollkv-llamafile/build-info.txt 2>/dev/null | head -20
cp .work/channel.work/$LBL/build.log $REP/channel-build.log 2>/dev/null
stamp model
mkdir -p $W/gates/models; python3 -m rollkv_dist model random -o $M --shape qwen2-1.5b --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m15.json && mv $W/m15.json ${M%.gguf}.json; cat ${M%.gguf}.json | head -5
stamp gates
timeout 120 python3 -m rollkv_dist gates --build $C --gates version,engine --gpu 0 --work $W/gates --reports $REP/c1-gates --llama-tree $W/src 2>&1 | tail -8
stamp host-memory
S=$C/bin/llama-server
free -m | head -2
python3 .carry/server_checks.py $S $REP/hostmem-8m.json auto-1.5b-8M-past-host-RAM 60 -m $M -c 8388608
python3 .carry/server_checks.py $S $REP/hostmem-8m-q8.json auto-1.5b-8M-q8_0-KV 60 -m $M -c 8388608 -ctk q8_0 -ctv q8_0
python3 .carry/server_checks.py $S $REP/hostmem-fits.json auto-1.5b-1M-fits 90 -m $M -c 1048576 --vram-target 6000
# RLIMIT_MEMLOCK for an unprivileged user (root's CAP_IPC_LOCK ignores it): does pinning the tail count against it?
if command -v setpriv >/dev/null; then
  chmod -R a+rX $C $W/gates; chmod a+rx $W /tmp
  setpriv --reuid 65534 --regid 65534 --clear-groups --inh-caps=-all bash -c "ulimit -l 1024; ulimit -l; python3 .carry/server_checks.py $S /tmp/memlock.json memlock-1MiB-nonroot 90 -m $M -c 1048576 --vram-target 6000" ; cp /tmp/memlock.json /tmp/memlock.log $REP/ 2>/dev/null
fi
stamp end; tail -3 $W/up-build.log
tar czf $OUT/c1.tar.gz -C $W rep
