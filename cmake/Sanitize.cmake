# SHARDFLOW_SANITIZE=address,undefined or thread: every C++ target of this build is instrumented
# (nvcc takes no -fsanitize, and `make sanitize` configures without CUDA). Undefined behaviour stops
# the process (-fno-sanitize-recover), so a test that meets it fails instead of logging and passing.
if(SHARDFLOW_SANITIZE)
  if(NOT SHARDFLOW_SANITIZE MATCHES "^(address,undefined|undefined,address|address|undefined|thread)$")
    message(FATAL_ERROR "SHARDFLOW_SANITIZE='${SHARDFLOW_SANITIZE}': expected address,undefined or thread")
  endif()
  # -O1 -g1 (line tables): stack traces with lines, at a fraction of -O2 -g's compile time on the
  # template-heavy CAF translation units; asserts stay on (`make sanitize` builds Debug).
  set(shardflow_san_flags -fsanitize=${SHARDFLOW_SANITIZE} -fno-omit-frame-pointer -O1 -g1)
  if(SHARDFLOW_SANITIZE MATCHES "undefined")
    list(APPEND shardflow_san_flags -fno-sanitize-recover=undefined)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${shardflow_san_flags}>")
  # Unity builds (8 files a translation unit): the CAF, JSON and fmt templates the library's files
  # share are instantiated and instrumented once a batch, not once a file. The library's Release
  # build at -O3, 2026-12-03: 327 CPU-s for 64 files alone, 187 in 8 batches. Only here: the Release
  # build (`make build`, what users build) compiles every file on its own, so a file that leans on a
  # header another file of its batch included fails there, and an edit recompiles one file.
  # A name two files of one batch both define at namespace scope is a compile error here: give it
  # a name of its own (Note [Unity batches], docs/hardening.md).
  set(CMAKE_UNITY_BUILD ON)
  set(CMAKE_UNITY_BUILD_BATCH_SIZE 8)
  add_link_options(-fsanitize=${SHARDFLOW_SANITIZE})
  message(STATUS "shardflow: sanitizers ${SHARDFLOW_SANITIZE}")
endif()

# shardflow_sanitize_as_driver(TARGET...): code that drives the library rather than does its work
# (the suites of tests/, the launcher, mlp_train's and actor_trainer's mains) builds at -O0 under
# the sanitizers.
# -O1 nearly doubles a doctest suite's compile time (test_plan.cpp under ASan+UBSan, 2026-11-28:
# 19.6 s at -O1 -g1, 11.5 s at -O0 -g1), and CI's 45 minutes on 2 cores are mostly compiling
# (docs/hardening.md); the suites' run time is spent in the library, which keeps -O1.
function(shardflow_sanitize_as_driver)
  if(SHARDFLOW_SANITIZE)
    foreach(target IN LISTS ARGN)
      # tests/ passes every target of its folder: custom ones (data files, scripts) compile nothing.
      get_target_property(type ${target} TYPE)
      if(NOT type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY)$")
        continue()
      endif()
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-O0>)
    endforeach()
  endif()
endfunction()
