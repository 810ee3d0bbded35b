# `cmake --install build --prefix P` (or `make install PREFIX=P`): the library, its public headers,
# the `shardflow` launcher, a CMake package and a pkg-config file.
#
# Note [One library]
# libshardflow.so carries the runtime, the actors and the CPU/CUDA kernels; CAF, Gloo, spdlog,
# Boost.Asio, OpenBLAS, CUDA and NCCL are linked privately and no public header includes them. So
# a consumer writes `find_package(shardflow CONFIG REQUIRED)` and links `shardflow::shardflow`, or
# uses `pkg-config --cflags --libs shardflow`, and names nothing else. The one exception is
# shardflow/actor.hpp, for CAF applications: `shardflow::actor` adds CAF (Debian's libcaf-dev,
# found by the FindCAF.cmake installed beside the package), defined where CAF is found. The public headers are
# runtime/include/shardflow/*.hpp (installed as include/shardflow/); the build tree's own programs
# may also include the internal headers, an installed consumer cannot.
include(CMakePackageConfigHelpers)

set(SHARDFLOW_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/shardflow)
install(TARGETS shardflow EXPORT shardflowTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS shardflow_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/runtime/include/shardflow DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.hpp")
install(EXPORT shardflowTargets NAMESPACE shardflow:: DESTINATION ${SHARDFLOW_CMAKE_DIR})
# A set of its own: a consumer without CAF still finds shardflow::shardflow.
install(TARGETS shardflow_actor EXPORT shardflowActorTargets)
install(EXPORT shardflowActorTargets NAMESPACE shardflow:: DESTINATION ${SHARDFLOW_CMAKE_DIR})
install(FILES ${PROJECT_SOURCE_DIR}/cmake/FindCAF.cmake DESTINATION ${SHARDFLOW_CMAKE_DIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/shardflowConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/shardflowConfig.cmake INSTALL_DESTINATION ${SHARDFLOW_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/shardflowConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/shardflowConfig.cmake ${PROJECT_BINARY_DIR}/shardflowConfigVersion.cmake
        DESTINATION ${SHARDFLOW_CMAKE_DIR})

file(RELATIVE_PATH SHARDFLOW_PC_TO_PREFIX /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
string(REGEX REPLACE "/$" "" SHARDFLOW_PC_TO_PREFIX "${SHARDFLOW_PC_TO_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/shardflow.pc.in ${PROJECT_BINARY_DIR}/shardflow.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/shardflow.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
