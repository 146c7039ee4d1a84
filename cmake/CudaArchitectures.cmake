# The CUDA targets of the build: sets CMAKE_CUDA_ARCHITECTURES before enable_language(CUDA), from
# ATTNRNN_CUDA_ARCHITECTURES (setup.py passes the environment variable of that name):
#   ""      (default) the GPUs present, each as its own cubin, compute capability 9.0 as sm_90a (the
#           wgmma kernels), plus compute_80 PTX; with no GPU visible (CI, a build box), sm_90a plus
#           compute_80 PTX
#   native  the GPUs present as above; an error when none is visible
#   all     a fat build: sm_80, sm_86, sm_89, sm_90a and sm_100 cubins plus compute_80 PTX
#   a list  used as CMAKE_CUDA_ARCHITECTURES, as given ("80;90a", "90a-real;100a-real", ...)
# With ATTNRNN_CUDA_ARCHITECTURES empty, an explicit CMAKE_CUDA_ARCHITECTURES (or CMake's CUDAARCHS
# environment variable) is used as given.
#
# The kernels need sm_80 (mma.sync, cp.async, ldmatrix). Every cubin runs the mma.sync tensor-core
# kernels except sm_90a's, which adds the wgmma ones. The compute_80 PTX is what a GPU without a
# cubin in the build JIT-compiles (once; the driver caches it): a newer GPU, or an sm_8x the build
# has no cubin for. It has to be plain PTX: sm_90a's runs on compute capability 9.0 only.
# sm_100 rather than sm_100a: no kernel uses Blackwell-only instructions, and an sm_100 cubin also
# runs on the other 10.x GPUs.

set(ATTNRNN_CUDA_ARCHITECTURES "" CACHE STRING
    "CUDA targets: empty = the GPUs present (none: 90a + compute_80 PTX), native, all, or a CMAKE_CUDA_ARCHITECTURES list")

set(ATTNRNN_CUDA_FALLBACK 90a-real 80-virtual)
set(ATTNRNN_CUDA_ALL 80 86-real 89-real 90a-real 100-real)  # 80: the sm_80 cubin and compute_80 PTX

# Adds the compute_80 PTX to the list in `var` (80-real becomes 80, both).
function(attnrnn_add_ptx var)
  set(archs ${${var}})
  if("80-real" IN_LIST archs)
    list(TRANSFORM archs REPLACE "^80-real$" "80")
  else()
    list(APPEND archs 80-virtual)
  endif()
  set(${var} "${archs}" PARENT_SCOPE)
endfunction()

# The compute capabilities (80, 90, ...) of the GPUs the driver shows this process (so
# CUDA_VISIBLE_DEVICES applies), from the toolkit's __nvcc_device_query beside nvcc, or from
# nvidia-smi where the toolkit has none.
function(attnrnn_visible_gpus nvcc out)
  set(caps "")
  set(hints "")
  if(nvcc)
    get_filename_component(dir "${nvcc}" DIRECTORY)
    get_filename_component(real "${nvcc}" REALPATH)
    get_filename_component(real_dir "${real}" DIRECTORY)
    set(hints "${dir}" "${real_dir}")
  endif()
  find_program(query __nvcc_device_query HINTS ${hints} NO_CACHE)
  if(query)
    execute_process(COMMAND "${query}" RESULT_VARIABLE rc OUTPUT_VARIABLE text ERROR_QUIET
                    OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0)
      string(REGEX MATCHALL "[0-9]+" caps "${text}")  # "90" or "80,86"
    endif()
  else()
    find_program(smi nvidia-smi NO_CACHE)
    if(smi)
      execute_process(COMMAND "${smi}" --query-gpu=compute_cap --format=csv,noheader RESULT_VARIABLE rc
                      OUTPUT_VARIABLE text ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(rc EQUAL 0)
        string(REGEX MATCHALL "[0-9]+\\.[0-9]+" caps "${text}")  # "9.0" per line
        list(TRANSFORM caps REPLACE "\\." "")
      endif()
    endif()
  endif()
  if(caps)
    list(REMOVE_DUPLICATES caps)
  endif()
  set(${out} "${caps}" PARENT_SCOPE)
endfunction()

# The sm_XY cubins nvcc can make (sm_90 standing for sm_90a too).
function(attnrnn_nvcc_codes nvcc out)
  set(codes "")
  if(nvcc)
    execute_process(COMMAND "${nvcc}" --list-gpu-code RESULT_VARIABLE rc OUTPUT_VARIABLE text ERROR_QUIET)
    if(rc EQUAL 0)
      string(REGEX MATCHALL "sm_[0-9]+" codes "${text}")
      list(TRANSFORM codes REPLACE "^sm_" "")
    endif()
  endif()
  set(${out} "${codes}" PARENT_SCOPE)
endfunction()

# Drops from the list in `var` the cubins this nvcc cannot make (when it can list them).
function(attnrnn_supported_only nvcc var)
  attnrnn_nvcc_codes("${nvcc}" codes)
  if(NOT codes)
    return()
  endif()
  set(kept "")
  foreach(arch IN LISTS ${var})
    string(REGEX MATCH "^[0-9]+" number "${arch}")
    if(number IN_LIST codes)
      list(APPEND kept ${arch})
    else()
      message(WARNING "attnrnn: this nvcc cannot build ${arch}; left out (such a GPU runs the compute_80 PTX)")
    endif()
  endforeach()
  set(${var} "${kept}" PARENT_SCOPE)
endfunction()

# The cubins of the GPUs present (9.0 as 90a) and the PTX; empty when no usable GPU is visible.
function(attnrnn_native_architectures nvcc out)
  attnrnn_visible_gpus("${nvcc}" caps)
  set(archs "")
  foreach(cap IN LISTS caps)
    if(cap LESS 80)
      message(WARNING "attnrnn: a GPU of compute capability ${cap} is visible; the CUDA kernels need 8.0 or newer")
    elseif(cap EQUAL 90)
      list(APPEND archs 90a-real)
    else()
      list(APPEND archs ${cap}-real)
    endif()
  endforeach()
  if(archs)  # (a GPU newer than this nvcc leaves only the PTX)
    attnrnn_supported_only("${nvcc}" archs)
    attnrnn_add_ptx(archs)
  endif()
  set(${out} "${archs}" PARENT_SCOPE)
  set(ATTNRNN_CUDA_VISIBLE_GPUS "${caps}" PARENT_SCOPE)
endfunction()

# Sets CMAKE_CUDA_ARCHITECTURES (unless the user set it) and ATTNRNN_CUDA_ARCHITECTURES_REASON.
macro(attnrnn_choose_cuda_architectures nvcc)
  set(ATTNRNN_CUDA_VISIBLE_GPUS "")
  if(ATTNRNN_CUDA_ARCHITECTURES STREQUAL "all")
    set(CMAKE_CUDA_ARCHITECTURES ${ATTNRNN_CUDA_ALL})
    attnrnn_supported_only("${nvcc}" CMAKE_CUDA_ARCHITECTURES)
    set(ATTNRNN_CUDA_ARCHITECTURES_REASON "ATTNRNN_CUDA_ARCHITECTURES=all")
  elseif(ATTNRNN_CUDA_ARCHITECTURES STREQUAL "native")
    attnrnn_native_architectures("${nvcc}" CMAKE_CUDA_ARCHITECTURES)
    if(NOT CMAKE_CUDA_ARCHITECTURES)
      message(FATAL_ERROR "attnrnn: ATTNRNN_CUDA_ARCHITECTURES=native, but no GPU of compute capability 8.0 "
                          "or newer is visible; leave it empty for the default without a GPU")
    endif()
    set(ATTNRNN_CUDA_ARCHITECTURES_REASON "the GPUs present (${ATTNRNN_CUDA_VISIBLE_GPUS})")
  elseif(NOT ATTNRNN_CUDA_ARCHITECTURES STREQUAL "")
    set(CMAKE_CUDA_ARCHITECTURES "${ATTNRNN_CUDA_ARCHITECTURES}")
    set(ATTNRNN_CUDA_ARCHITECTURES_REASON "ATTNRNN_CUDA_ARCHITECTURES")
  elseif(DEFINED CMAKE_CUDA_ARCHITECTURES OR NOT "$ENV{CUDAARCHS}" STREQUAL "")
    set(ATTNRNN_CUDA_ARCHITECTURES_REASON "set by the user")
  else()
    attnrnn_native_architectures("${nvcc}" CMAKE_CUDA_ARCHITECTURES)
    if(CMAKE_CUDA_ARCHITECTURES)
      set(ATTNRNN_CUDA_ARCHITECTURES_REASON "the GPUs present (${ATTNRNN_CUDA_VISIBLE_GPUS})")
    else()
      set(CMAKE_CUDA_ARCHITECTURES ${ATTNRNN_CUDA_FALLBACK})
      set(ATTNRNN_CUDA_ARCHITECTURES_REASON "no GPU of compute capability 8.0 or newer visible: sm_90a and compute_80 PTX")
    endif()
  endif()
endmacro()
