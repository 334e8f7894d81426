# Install and export every morph_cc_library so that find_package(morph) works from a prefix.
include(CMakePackageConfigHelpers)
get_property(_morph_targets GLOBAL PROPERTY MORPH_EXPORTED_TARGETS)
install(TARGETS ${_morph_targets} EXPORT morphTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT morphTargets NAMESPACE morph:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/morph)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/morphConfig.cmake.in
  ${PROJECT_BINARY_DIR}/morphConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/morph)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/morphConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/morphConfig.cmake ${PROJECT_BINARY_DIR}/morphConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/morph)
