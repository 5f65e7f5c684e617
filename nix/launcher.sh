# Launcher of `nix run` (bash, sourced into a writeShellApplication by nix/launcher.nix with
# ROLLKV_PROGRAM and ROLLKV_CUDA set). Two jobs:
# * no model given: say what to pass instead of starting a server that has nothing to serve;
# * a CUDA build outside NixOS: autoAddDriverRunpath points the binaries at
#   /run/opengl-driver/lib, which only NixOS fills. Find the host driver's libcuda.so.1
#   (ROLLKV_LIBCUDA, ldconfig's cache, the usual distribution paths) and put a directory with
#   links to just the driver's libraries (libcuda*, libnvidia-*) on LD_LIBRARY_PATH, the way
#   nixGL does, so no other host library shadows the Nix ones.
prog_name="$(basename "${ROLLKV_PROGRAM}")"
has_model=""
for arg in "$@"; do
    case "${arg}" in
        -m | --model | --model=* | -hf | -hfr | --hf-repo | --hf-repo=* | -mu | --model-url | \
            --model-url=* | -h | --help | --version | --list-devices | --usage)
            has_model=1 ;;
    esac
done
if [[ -n "${LLAMA_ARG_MODEL:-}${LLAMA_ARG_HF_REPO:-}${LLAMA_ARG_MODEL_URL:-}" ]]; then
    has_model=1
fi
if [[ -z "${has_model}" && "${prog_name}" == "llama-server" ]]; then
    cat >&2 <<USAGE
rollkv: llama-server needs a model; pass it after "--", e.g.
  nix run . -- -m /path/to/model.gguf -c 131072 -fa on --kv-unified --kv-residency-mode window
  nix run . -- -m /path/to/model.gguf --vram-target 80000 ...   (MiB of GPU memory to use)
  nix run . -- --help                                            (every option)
(or set LLAMA_ARG_MODEL). The CPU build: nix run .#cpu -- -m ...
USAGE
    exit 2
fi

if [[ "${ROLLKV_CUDA}" == 1 && ! -e /run/opengl-driver/lib/libcuda.so.1 ]]; then
    driver=""
    candidates=("${ROLLKV_LIBCUDA:-}")
    for ldconfig in ldconfig /sbin/ldconfig /usr/sbin/ldconfig; do
        if command -v "${ldconfig}" >/dev/null 2>&1; then
            while IFS= read -r path; do candidates+=("${path}"); done < <(
                "${ldconfig}" -p 2>/dev/null | sed -n 's/^[[:space:]]*libcuda\.so\.1 (.*) => //p')
            break
        fi
    done
    candidates+=(/usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib/aarch64-linux-gnu/libcuda.so.1
                 /usr/lib64/libcuda.so.1 /usr/lib/libcuda.so.1 /usr/lib/wsl/lib/libcuda.so.1
                 /usr/local/nvidia/lib64/libcuda.so.1)
    for cand in "${candidates[@]}"; do
        if [[ -n "${cand}" && -e "${cand}" ]]; then driver="${cand}"; break; fi
    done
    if [[ -n "${driver}" ]]; then
        dir="$(dirname "$(readlink -f "${driver}")")"
        links="${XDG_RUNTIME_DIR:-${TMPDIR:-/tmp}}/rollkv-host-driver-$(id -u)"
        rm -rf "${links}"
        mkdir -p "${links}"
        ln -s "$(readlink -f "${driver}")" "${links}/libcuda.so.1"
        for lib in "${dir}"/libcuda.so* "${dir}"/libnvidia-*.so*; do
            [[ -e "${lib}" && ! -e "${links}/$(basename "${lib}")" ]] && ln -s "${lib}" "${links}/"
        done
        export LD_LIBRARY_PATH="${links}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
    else
        echo "rollkv: no libcuda.so.1 found (not NixOS, nothing in ldconfig's cache or the" \
             "usual paths): CUDA will see no GPU; set ROLLKV_LIBCUDA=/path/to/libcuda.so.1" >&2
    fi
fi
exec "${ROLLKV_PROGRAM}" "$@"
