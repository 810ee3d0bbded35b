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
# (the launcher, mlp_train's and actor_trainer's mains) builds at -O0 under the sanitizers (the
# suites of tests/: shardflow_suite_code below).
# -O1 nearly doubles a doctest suite's compile time (test_plan.cpp under ASan+UBSan, 2026-11-28:
# 19.6 s at -O1 -g1, 11.5 s at -O0 -g1), and CI's 45 minutes on 2 cores are mostly compiling
# (docs/hardening.md); the suites' run time is spent in the library, which keeps -O1.
function(shardflow_sanitize_as_driver)
  if(SHARDFLOW_SANITIZE)
    shardflow_compiled_targets(targets ${ARGN})
    foreach(target IN LISTS targets)
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-O0>)
    endforeach()
  endif()
endfunction()

# shardflow_suite_code(TARGET...): the suites of tests/ are set-up and checks around calls into the
# library, so they build at -O0 in every build, Release included: their run time is spent in the
# library, the examples' libraries and the benchmarks, which keep the build's level. Release
# 2026-12-03: test_zero.cpp 7.1 CPU-s at -O3, about 4 at -O0; the suites were 377 of the build's
# 1,200 CPU-s, as much as the library (Note [CI's minutes], docs/hardening.md).
# Under AddressSanitizer + UndefinedBehaviorSanitizer they are built with AddressSanitizer alone:
# UBSan's checks at -O0 doubled a suite's compile time there (test_zero: 8.9 CPU-s against 4.1 to
# 6.4), and what they would check is the suites' own arithmetic. The library and the examples'
# libraries keep every UBSan check, and undefined behaviour in them still stops the process.
function(shardflow_suite_code)
  shardflow_compiled_targets(targets ${ARGN})
  foreach(target IN LISTS targets)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-O0>)
    if(SHARDFLOW_SANITIZE MATCHES "undefined")
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize=undefined>)
    endif()
  endforeach()
endfunction()

# The targets of ARGN that compile code (a folder's list holds custom ones too: data files, scripts).
function(shardflow_compiled_targets out)
  set(compiled)
  foreach(target IN LISTS ARGN)
    get_target_property(type ${target} TYPE)
    if(type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY)$")
      list(APPEND compiled ${target})
    endif()
  endforeach()
  set(${out} ${compiled} PARENT_SCOPE)
endfunction()
