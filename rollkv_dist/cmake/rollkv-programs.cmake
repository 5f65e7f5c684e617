# Included at the end of llama.cpp's project() (CMAKE_PROJECT_llama.cpp_INCLUDE, set by
# rollkv.cmake). At the end of the top directory, when every target exists, it defines the
# target `rollkv-programs` (the programs of ROLLKV_PROGRAMS this tree has) and writes their
# names to BUILD/rollkv-programs.txt for rollkv-install.cmake.
cmake_minimum_required(VERSION 3.19)

function(_rollkv_programs)
    set(present "")
    foreach(prog IN LISTS ROLLKV_PROGRAMS)
        if(TARGET "${prog}")
            list(APPEND present "${prog}")
        endif()
    endforeach()
    if(NOT present)
        message(FATAL_ERROR "rollkv: none of ROLLKV_PROGRAMS (${ROLLKV_PROGRAMS}) is a target "
                            "of this tree")
    endif()
    add_custom_target(rollkv-programs)
    add_dependencies(rollkv-programs ${present})
    file(WRITE "${CMAKE_BINARY_DIR}/rollkv-programs.txt" "${present}")
    message(STATUS "rollkv: programs ${present}")
endfunction()

cmake_language(DEFER CALL _rollkv_programs)
