"""A miniature "llama.cpp" CMake project (seconds to build) shaped like the pinned tree where
rollkv's build definition touches it: project("llama.cpp"), upstream-style install rules for
the top directory and ggml, tools with helper libraries in bin/, `--help` from common/arg.c.
Used by the recipe, build-definition and `rollkv build` tests."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

from _rollkv_tool_helpers import git

from rollkv_dist.series import file_state, make_manifest

MINI_LLAMA_FILES = {
    "CMakeLists.txt": """\
        cmake_minimum_required(VERSION 3.14)
        project("llama.cpp" C)
        include(GNUInstallDirs)
        set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
        set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
        add_subdirectory(ggml)
        add_library(llama src/llama.c)
        target_include_directories(llama PUBLIC include)
        target_link_libraries(llama PUBLIC ggml)
        set_target_properties(llama PROPERTIES PUBLIC_HEADER include/llama.h)
        install(TARGETS llama LIBRARY PUBLIC_HEADER)
        add_library(llama-common common/arg.c)
        target_link_libraries(llama-common PUBLIC llama)
        install(TARGETS llama-common LIBRARY)
        configure_file(llama.pc.in llama.pc @ONLY)
        install(FILES ${CMAKE_CURRENT_BINARY_DIR}/llama.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
        add_subdirectory(tools)
        """,
    "llama.pc.in": "prefix=@CMAKE_INSTALL_PREFIX@\nlibdir=${prefix}/lib\nName: llama\n",
    "ggml/CMakeLists.txt": """\
        add_library(ggml ggml.c)
        install(TARGETS ggml LIBRARY)
        """,
    "ggml/ggml.c": "int ggml_threads(void) { return 4; }\n",
    "include/llama.h": "int llama_threads(void);\nvoid common_print_help(void);\n",
    "src/llama.c": "int ggml_threads(void);\nint llama_threads(void) { return ggml_threads(); }\n",
    "common/arg.c": """\
        #include <stdio.h>
        #include "llama.h"

        void common_print_help(void) {
            printf("  -c,   --ctx-size N          size of the prompt context\\n");
            printf("  -fa,  --flash-attn on|off   flash attention\\n");
            printf("  -t,   --threads N           threads (default: %d)\\n", llama_threads());
        }
        """,
    "tools/CMakeLists.txt": """\
        add_library(server-context server_context.c)
        target_link_libraries(server-context PUBLIC llama-common)
        foreach(prog server cli bench quantize)
            add_executable(llama-${prog} main.c)
            target_compile_definitions(llama-${prog} PRIVATE PROG="llama-${prog}")
            target_link_libraries(llama-${prog} PRIVATE llama-common)
            install(TARGETS llama-${prog} RUNTIME)
        endforeach()
        target_link_libraries(llama-server PRIVATE server-context)
        target_compile_definitions(llama-server PRIVATE WITH_SERVER_CONTEXT)
        add_library(quantize-impl quantize_impl.c)
        target_link_libraries(llama-quantize PRIVATE quantize-impl)
        target_compile_definitions(llama-quantize PRIVATE WITH_QUANTIZE_IMPL)
        """,
    "tools/quantize_impl.c": "int quantize_types(void) { return 30; }\n",
    "tools/server_context.c": "int server_slots(void) { return 1; }\n",
    "tools/main.c": """\
        #include <stdio.h>
        #include <string.h>
        #include "llama.h"

        #ifdef WITH_SERVER_CONTEXT
        int server_slots(void);
        #define EXTRA() printf("  -np,  --parallel N          slots (default: %d)\\n", server_slots())
        #elif defined(WITH_QUANTIZE_IMPL)
        int quantize_types(void);
        #define EXTRA() printf("  %d types\\n", quantize_types())
        #else
        #define EXTRA() ((void) 0)
        #endif

        int main(int argc, char ** argv) {
            if (argc > 1 && strcmp(argv[1], "--help") == 0) {
                printf("usage: %s [options]\\n  -h,   --help                print usage and exit\\n", PROG);
                EXTRA();
                common_print_help();
                return 0;
            }
            fprintf(stderr, "%s: try --help\\n", PROG);
            return 1;
        }
        """,
}

# (name, old line, new lines) edits of common/arg.c; each patch's context needs the one before it
FLAGS_EDIT = (
    '    printf("  -fa,  --flash-attn on|off   flash attention\\n");\n',
    '    printf("  -fa,  --flash-attn on|off   flash attention\\n");\n'
    '    printf("  -krm, %s {resident,window}\\n", "--kv-residency-mode");\n'
    '    printf("        %s MiB\\n", "--vram-target");\n',
)
RESERVE_EDIT = (
    '    printf("        %s MiB\\n", "--vram-target");\n',
    '    printf("        %s MiB\\n", "--vram-target");\n'
    '    printf("        %s MiB\\n", "--kv-compute-reserve");\n',
)


def make_mini_llama_sdist(root: Path, edits: list[tuple[str, tuple[str, str]]]) -> tuple[Path, Path]:
    """An sdist-shaped tree (llama.cpp in vendor/llama.cpp) and a patch queue from `edits`.

    Patches are `git diff` output relative to the llama.cpp tree, as the real
    series is; the manifest is written by rollkv's own series module.
    """
    sdist = root / "sdist-root"
    tree = write_mini_tree(sdist / "vendor" / "llama.cpp")
    (sdist / "CMakeLists.txt").write_text("# the python package's build, not llama.cpp's\n")

    work = root / "patch-work"
    shutil.copytree(tree, work)
    git(work, "init", "-q")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "upstream")
    queue = root / "patches"
    queue.mkdir()
    names = []
    for name, (old, new) in edits:
        arg = work / "common" / "arg.c"
        text = arg.read_text()
        assert old in text, (name, old)
        arg.write_text(text.replace(old, new, 1))
        (queue / name).write_text(git(work, "diff"))
        git(work, "commit", "-q", "-am", name)
        names.append(name)
    (queue / "series").write_text("# test series\n" + "".join(n + "\n" for n in names))
    if names:
        manifest = make_manifest([(n, (queue / n).read_bytes()) for n in names],
                                 lambda paths: {p: file_state(work, p) for p in paths})
        (queue / "manifest.json").write_text(manifest.to_json())
    return sdist, queue


def write_mini_tree(tree: Path) -> Path:
    for rel, text in MINI_LLAMA_FILES.items():
        p = tree / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tree
