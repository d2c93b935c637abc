# Install rules: headers, the exported INTERFACE targets, weftConfig.cmake, its version file and
# FindNCCL.cmake (the config needs it to re-find NCCL for consumers of weft::nccl).
include(CMakePackageConfigHelpers)
set(WEFT_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/weft" CACHE STRING "Where weftConfig.cmake is installed")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/weft" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(TARGETS ${weft_export_targets} EXPORT weftTargets)
install(EXPORT weftTargets NAMESPACE weft:: DESTINATION "${WEFT_INSTALL_CMAKEDIR}")
export(EXPORT weftTargets NAMESPACE weft:: FILE "${PROJECT_BINARY_DIR}/weftTargets.cmake")

configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/weftConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/weftConfig.cmake"
  INSTALL_DESTINATION "${WEFT_INSTALL_CMAKEDIR}")
# Header-only: the installed package works for any architecture.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/weftConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES
  "${PROJECT_BINARY_DIR}/weftConfig.cmake"
  "${PROJECT_BINARY_DIR}/weftConfigVersion.cmake"
  "${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake"
  DESTINATION "${WEFT_INSTALL_CMAKEDIR}")
