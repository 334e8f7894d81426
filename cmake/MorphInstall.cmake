# What `cmake --install` puts in a prefix: libmorph (exported as morph::morph for
# find_package(morph)), the public headers (include/morph/, nothing else), and the programs
# (morphrun, morphctl, morphd, morph-plan). install_consumer_test checks the prefix.
include(CMakePackageConfigHelpers)
install(TARGETS morph EXPORT morphTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/morph DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
install(EXPORT morphTargets NAMESPACE morph:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/morph)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/morphConfig.cmake.in
  ${PROJECT_BINARY_DIR}/morphConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/morph)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/morphConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/morphConfig.cmake ${PROJECT_BINARY_DIR}/morphConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/morph)

# `cmake --build build --target morph_installables`: everything `cmake --install` copies, and
# nothing else (no tests, no benchmarks): what make demo builds before it installs.
get_property(_morph_bins GLOBAL PROPERTY MORPH_INSTALLED_BINARIES)
add_custom_target(morph_installables)
add_dependencies(morph_installables morph ${_morph_bins})
