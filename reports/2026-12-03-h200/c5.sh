#!/bin/bash
set -u
T0=$(date +%s); R=$PWD; W=/tmp/w; mkdir -p $W $OUT
rm -rf $W/src $W/x && mkdir -p $W/x && tar xf .carry/after.tar.xz -C $W/x && mv $W/x/after $W/src
(cd $W/src && patch -p1 < $R/.carry/diag.diff && patch -p1 < $R/.carry/diag2.diff) > $W/diag-apply.txt 2>&1 || { cat $W/diag-apply.txt; exit 4; }
python3 -m rollkv_dist build --source $W/src --prefix $W/prefix --build-dir $W/bld --variant cuda --cuda-arch 90-real -j 16 \
    --targets test-backend-ops --cmake-arg=-DLLAMA_BUILD_TESTS=ON > $W/build.log 2>&1
echo "build rc $? at $(( $(date +%s) - T0 )) s"
bash .carry/exp.sh $((T0+545)) keepva.1 keepva.2 control.4 keepva.3
cd $W && tar czf $OUT/c5.tgz r build.log 2>/dev/null; cat $W/r/summary.txt
