# The one install rule of a rollkv build (after `cmake --build BUILD --target rollkv-programs`):
#
#   cmake -DROLLKV_BUILD_DIR=BUILD [-DCMAKE_INSTALL_PREFIX=P] -P rollkv-install.cmake
#
# * upstream's own install rules for the top directory (libllama, libllama-common, llama.h,
#   lib/cmake/llama, llama.pc; not recursing into tools/, whose other programs are not built)
#   and for ggml (libggml*, ggml headers, lib/cmake/ggml);
# * the programs of BUILD/rollkv-programs.txt into bin/, and every library of the build tree
#   they load (DT_NEEDED, followed through the libraries: server, mtmd, ...) into lib/,
#   with its symlink chain.
# The list of installed files goes to BUILD/rollkv-install-manifest.txt.
# DESTDIR is honoured as upstream's rules honour it: file(INSTALL) puts it in front of the
# destination, and the manifest names the files by their place in the prefix, without it (as
# CMake's own install_manifest.txt does). `rollkv build` stages its install that way.
cmake_minimum_required(VERSION 3.19)

if(NOT ROLLKV_BUILD_DIR)
    message(FATAL_ERROR "rollkv-install: pass -DROLLKV_BUILD_DIR=<the build directory>")
endif()
get_filename_component(_build "${ROLLKV_BUILD_DIR}" ABSOLUTE)
if(NOT EXISTS "${_build}/rollkv-programs.txt")
    message(FATAL_ERROR "rollkv-install: ${_build} was not configured with rollkv.cmake "
                        "(no rollkv-programs.txt)")
endif()
if(NOT DEFINED CMAKE_INSTALL_PREFIX)
    load_cache("${_build}" READ_WITH_PREFIX _cache_ CMAKE_INSTALL_PREFIX)
    set(CMAKE_INSTALL_PREFIX "${_cache_CMAKE_INSTALL_PREFIX}")
endif()
file(READ "${_build}/rollkv-programs.txt" _programs)

set(CMAKE_INSTALL_LOCAL_ONLY ON)
include("${_build}/cmake_install.cmake")
unset(CMAKE_INSTALL_LOCAL_ONLY)
include("${_build}/ggml/cmake_install.cmake")

# not "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}": file(INSTALL) adds DESTDIR itself
set(_dest "${CMAKE_INSTALL_PREFIX}")
set(_exes "")
foreach(prog IN LISTS _programs)
    if(NOT EXISTS "${_build}/bin/${prog}")
        message(FATAL_ERROR "rollkv-install: ${_build}/bin/${prog} is missing: build the "
                            "rollkv-programs target first")
    endif()
    list(APPEND _exes "${_build}/bin/${prog}")
    file(INSTALL "${_build}/bin/${prog}" DESTINATION "${_dest}/bin" USE_SOURCE_PERMISSIONS)
    list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${_dest}/bin/${prog}")
endforeach()
file(GET_RUNTIME_DEPENDENCIES
    EXECUTABLES ${_exes}
    RESOLVED_DEPENDENCIES_VAR _resolved
    UNRESOLVED_DEPENDENCIES_VAR _unresolved  # e.g. libcuda.so.1 without a driver: not ours
    DIRECTORIES "${_build}/bin")
foreach(lib IN LISTS _resolved)
    string(FIND "${lib}" "${_build}/bin/" _at)
    if(_at EQUAL 0)
        file(INSTALL "${lib}" DESTINATION "${_dest}/lib" FOLLOW_SYMLINK_CHAIN)
        get_filename_component(_name "${lib}" NAME)
        list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${_dest}/lib/${_name}")
    endif()
endforeach()

list(REMOVE_DUPLICATES CMAKE_INSTALL_MANIFEST_FILES)
list(JOIN CMAKE_INSTALL_MANIFEST_FILES "\n" _manifest)
file(WRITE "${_build}/rollkv-install-manifest.txt" "${_manifest}\n")
