# libmorph: the one library a training program links (morph::morph), with the one header tree it
# includes (include/morph/, umbrella <morph/morph.h>). It is made of the objects of every internal
# part (morph_cc_library targets, built with hidden visibility) and exports only what the public
# headers declare with MORPH_API, through the version script runtime/api/libmorph.map: symbols
# outside namespace morph (the static Gloo's, libstdc++ instantiations) stay local.
# surface_symbols_test lists what it exports.
get_property(_morph_parts GLOBAL PROPERTY MORPH_LIBRARY_PARTS)
# The launcher and the CLI are programs' code, not a training program's.
list(REMOVE_ITEM _morph_parts morph_runtime_launcher morph_morphctl_cli)
set(MORPH_LIBRARY_PARTS ${_morph_parts} CACHE INTERNAL "the internal libraries libmorph is made of")

add_library(morph SHARED)
add_library(morph::morph ALIAS morph)
set_target_properties(morph PROPERTIES OUTPUT_NAME morph VERSION ${PROJECT_VERSION}
                      SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR} EXPORT_NAME morph)
foreach(_p IN LISTS _morph_parts)
  target_sources(morph PRIVATE $<TARGET_OBJECTS:${_p}>)
endforeach()
# The parts' own dependencies (glog, Gloo, Boost, MPI, NCCL, the CUDA runtime, ...): their objects
# are already in, so the static parts add nothing but their link lines.
target_link_libraries(morph PRIVATE ${_morph_parts})
set(_map ${PROJECT_SOURCE_DIR}/runtime/api/libmorph.map)
target_link_options(morph PRIVATE "LINKER:--version-script=${_map}" "LINKER:--no-undefined")
set_target_properties(morph PROPERTIES LINK_DEPENDS ${_map})
target_include_directories(morph INTERFACE $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                           $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
if(MORPH_SANITIZE_FLAGS)
  target_link_options(morph PRIVATE ${MORPH_SANITIZE_FLAGS})
  target_link_options(morph INTERFACE ${MORPH_SANITIZE_FLAGS})
endif()
