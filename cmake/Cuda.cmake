# SHARDFLOW_CUDA = AUTO | ON | OFF.
# AUTO enables CUDA when nvcc exists (on PATH or under /usr/local/cuda), so the .cu sources always
# compile where the toolkit is installed, GPU or not. Nothing links the driver stub (libcuda): a
# binary linked to it would not even start on a machine without a driver.
set(SHARDFLOW_CUDA "AUTO" CACHE STRING "Build CUDA kernels: AUTO, ON or OFF")
set_property(CACHE SHARDFLOW_CUDA PROPERTY STRINGS AUTO ON OFF)

set(SHARDFLOW_HAVE_CUDA OFF)
if(NOT SHARDFLOW_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER)
    find_program(SHARDFLOW_NVCC nvcc HINTS /usr/local/cuda/bin)
    if(SHARDFLOW_NVCC)
      set(CMAKE_CUDA_COMPILER "${SHARDFLOW_NVCC}")
    endif()
  endif()
  if(CMAKE_CUDA_COMPILER)
    # `native` fails without a GPU and CUDA 13 rejects sm_70 and older: name Ampere and Hopper.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "80;90")
    endif()
    set(CMAKE_CUDA_STANDARD 17)          # 20 is a configure error with CUDA 13 + CMake 3.25
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared) # one cudart in the process
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(SHARDFLOW_HAVE_CUDA ON)
  elseif(SHARDFLOW_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SHARDFLOW_CUDA=ON but no nvcc was found (PATH, /usr/local/cuda/bin)")
  endif()
endif()

# NCCL ships beside the toolkit here (/usr/local/cuda/{include,lib64}); NCCL_ROOT points elsewhere.
set(SHARDFLOW_HAVE_NCCL OFF)
if(SHARDFLOW_HAVE_CUDA)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY nccl HINTS $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(SHARDFLOW_HAVE_NCCL ON)
  endif()
endif()
message(STATUS "shardflow: CUDA kernels ${SHARDFLOW_HAVE_CUDA}, NCCL ${SHARDFLOW_HAVE_NCCL}")
