# One helper per target kind so that each folder's CMakeLists.txt is a short list.
#
#   morph_cc_library(NAME foo SRCS a.cc [CUDA_SRCS k.cu] DEPS morph::base [PUBLIC_DEPS ...])
#     -> static target morph_foo, alias morph::foo: a part of libmorph (cmake/MorphLibrary.cmake),
#        linked directly by tests, tools and benchmarks. Not installed.
#   morph_cc_test(NAME foo_test SRCS foo_test.cc DEPS morph::foo [LABELS unit] [TIMEOUT 60]
#                 [ARGS ...] [ENV K=V ...] [NO_GTEST_MAIN] [NO_LEAK_CHECK])
#     -> gtest binary registered with ctest (label defaults to unit; exit 77 = skipped).
#   morph_cc_binary(NAME morph-plan SRCS main.cc DEPS morph::reshard [INSTALL])
#   morph_cc_test_library(NAME morph_foo_testing SRCS h.cc DEPS morph::foo)
#     -> a static library for tests and benchmarks: not installed, same warnings and sanitizers.

# GCC 12 warns on designated initializers that omit members with default initializers.
set(MORPH_WARNINGS -Wall -Wextra -Werror -Wno-missing-field-initializers)

function(_morph_common_flags target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${MORPH_WARNINGS}>)
  if(MORPH_SANITIZE_FLAGS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${MORPH_SANITIZE_FLAGS}>)
    target_link_options(${target} PRIVATE ${MORPH_SANITIZE_FLAGS})
  endif()
endfunction()

function(morph_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;CUDA_SRCS;DEPS;PUBLIC_DEPS" ${ARGN})
  set(_srcs ${A_SRCS})
  if(MORPH_WITH_CUDA AND A_CUDA_SRCS)
    list(APPEND _srcs ${A_CUDA_SRCS})
  endif()
  add_library(morph_${A_NAME} ${_srcs})
  add_library(morph::${A_NAME} ALIAS morph_${A_NAME})
  set_target_properties(morph_${A_NAME} PROPERTIES EXPORT_NAME ${A_NAME} OUTPUT_NAME morph_${A_NAME})
  if(MORPH_WITH_CUDA AND A_CUDA_SRCS)
    set_target_properties(morph_${A_NAME} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
    target_compile_definitions(morph_${A_NAME} PUBLIC MORPH_WITH_CUDA=1)
  endif()
  # Internal code includes "base/...", "reshard/...", ... (the tree's root) and the public
  # surface as "morph/..." (include/).
  target_include_directories(morph_${A_NAME} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
                             $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>)
  target_link_libraries(morph_${A_NAME} PUBLIC ${A_PUBLIC_DEPS} PRIVATE ${A_DEPS})
  _morph_common_flags(morph_${A_NAME})
  if(MORPH_SANITIZE_FLAGS)
    target_link_options(morph_${A_NAME} INTERFACE ${MORPH_SANITIZE_FLAGS})
  endif()
  set_property(GLOBAL APPEND PROPERTY MORPH_LIBRARY_PARTS morph_${A_NAME})
endfunction()

function(morph_cc_test)
  cmake_parse_arguments(A "NO_GTEST_MAIN;NO_LEAK_CHECK" "NAME;TIMEOUT" "SRCS;DEPS;LABELS;ARGS;ENV" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  if(A_NO_GTEST_MAIN)
    target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gmock)
  else()
    target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} morph_test_main GTest::gtest GTest::gmock)
  endif()
  _morph_common_flags(${A_NAME})
  add_test(NAME ${A_NAME} COMMAND ${A_NAME} ${A_ARGS})
  set(_labels unit)
  if(A_LABELS)
    set(_labels ${A_LABELS})
  endif()
  set(_timeout 120)
  if(A_TIMEOUT)
    set(_timeout ${A_TIMEOUT})
  endif()
  set_tests_properties(${A_NAME} PROPERTIES LABELS "${_labels}" TIMEOUT ${_timeout}
                       SKIP_RETURN_CODE 77)
  if("gpu" IN_LIST _labels)
    # Without a GPU the gtest cases skip (GTEST_SKIP with the reason); ctest then says Skipped.
    set_tests_properties(${A_NAME} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
  endif()
  set(_env ${A_ENV})
  if(MORPH_SANITIZE_FLAGS)
    list(APPEND _env UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1)
    # NO_LEAK_CHECK: for tests of libraries that leak by design (Open MPI's init).
    if(A_NO_LEAK_CHECK)
      list(APPEND _env ASAN_OPTIONS=detect_leaks=0)
    endif()
  endif()
  if(_env)
    set_tests_properties(${A_NAME} PROPERTIES ENVIRONMENT "${_env}")
  endif()
endfunction()

function(morph_cc_binary)
  cmake_parse_arguments(A "INSTALL" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS})
  _morph_common_flags(${A_NAME})
  if(A_INSTALL)
    install(TARGETS ${A_NAME} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
    set_property(GLOBAL APPEND PROPERTY MORPH_INSTALLED_BINARIES ${A_NAME})
  endif()
endfunction()

function(morph_cc_test_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  add_library(${A_NAME} STATIC ${A_SRCS})
  target_link_libraries(${A_NAME} PUBLIC ${A_DEPS})
  _morph_common_flags(${A_NAME})
endfunction()
