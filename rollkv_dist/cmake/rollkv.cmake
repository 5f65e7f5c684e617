# The one build definition of rollkv's llama.cpp: a CMake initial-cache file.
#
#   cmake -C rollkv_dist/cmake/rollkv.cmake -S TREE -B BUILD -G Ninja [-D...]
#   cmake --build BUILD --target rollkv-programs
#   cmake -DROLLKV_BUILD_DIR=BUILD [-DCMAKE_INSTALL_PREFIX=P] -P rollkv_dist/cmake/rollkv-install.cmake
#
# `rollkv build` (rollkv_dist/build.py), recipe/build.sh (conda) and flake.nix (cmakeFlags,
# buildPhase, installPhase) all run exactly these three steps; tests/test_build_definition.py
# derives their configure lines and checks that they agree. A consumer adds only what its
# ecosystem owns (install prefix, toolchain, CUDA architectures it computes, the build id);
# -D on the command line wins over the values here.

set(CMAKE_BUILD_TYPE Release CACHE STRING "")
set(CMAKE_INSTALL_LIBDIR lib CACHE PATH "")
set(BUILD_SHARED_LIBS ON CACHE BOOL "")
# relocatable: programs and libraries find each other through $ORIGIN, in the install tree
# and in the build tree (the install step follows the programs' DT_NEEDED through $ORIGIN)
set(CMAKE_INSTALL_RPATH "$ORIGIN/../lib;$ORIGIN" CACHE STRING "")
set(CMAKE_BUILD_WITH_INSTALL_RPATH ON CACHE BOOL "")

set(LLAMA_BUILD_TESTS OFF CACHE BOOL "")
set(LLAMA_BUILD_EXAMPLES OFF CACHE BOOL "")
set(LLAMA_BUILD_APP OFF CACHE BOOL "")
set(LLAMA_BUILD_TOOLS ON CACHE BOOL "")
set(LLAMA_BUILD_SERVER ON CACHE BOOL "")
set(LLAMA_TOOLS_INSTALL ON CACHE BOOL "")
# offline-safe and reproducible: no web UI download or npm, no HTTPS client, no NCCL, no
# ccache, code for a baseline CPU (x86: AVX2/FMA/F16C) rather than the build machine's
set(LLAMA_BUILD_UI OFF CACHE BOOL "")
set(LLAMA_USE_PREBUILT_UI OFF CACHE BOOL "")
set(LLAMA_OPENSSL OFF CACHE BOOL "")
set(GGML_NATIVE OFF CACHE BOOL "")
set(GGML_CCACHE OFF CACHE BOOL "")
set(GGML_CUDA OFF CACHE BOOL "")
set(GGML_CUDA_NCCL OFF CACHE BOOL "")
# llama.cpp's RPC backend (--rpc HOST:PORT) and its server: an RPC device runs resident, or a window where the
# whole KV fits its budget (it cannot hold a host tail); ggml-rpc-server binds 127.0.0.1 unless told otherwise
set(GGML_RPC ON CACHE BOOL "")
# rolling KV: the programs' default --kv-residency-mode (patch "auto mode"; ignored by a tree without it):
# auto keeps the KV resident when it fits the GPU and gives it a host tail when it does not
set(LLAMA_KV_RESIDENCY_DEFAULT auto CACHE STRING "")
# the tarball has no .git; consumers pass LLAMA_BUILD_COMMIT=<commit>+rollkv.<patches>
set(LLAMA_BUILD_NUMBER 0 CACHE STRING "")

# CUDA architectures of a CUDA build that names none: SASS for each, PTX for the newest so
# later GPUs JIT-compile. `rollkv build` passes the GPUs' own (NVML) or --cuda-arch, the
# recipe ROLLKV_CUDA_ARCHITECTURES when set, nixpkgs its config.cudaCapabilities.
set(CMAKE_CUDA_ARCHITECTURES "75-real;80-real;86-real;89-real;90-real;100-real;120-real;120-virtual"
    CACHE STRING "")

# The programs a rollkv build ships (those the tree defines: llama-logits-dump and
# llama-window-test come with the series; ggml-rpc-server with GGML_RPC). `cmake --build BUILD --target rollkv-programs` builds them and what they link;
# rollkv-install.cmake installs them with the libraries they load.
set(ROLLKV_PROGRAMS "llama-server;llama-cli;llama-bench;llama-logits-dump;llama-window-test;ggml-rpc-server"
    CACHE STRING "")
set(CMAKE_PROJECT_llama.cpp_INCLUDE "${CMAKE_CURRENT_LIST_DIR}/rollkv-programs.cmake"
    CACHE FILEPATH "")
