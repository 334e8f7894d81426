// What the files of morph._torch_backend share (torch_backend.cc: the backend "morph";
// torch_store.cc: the c10d store over the job's store).
#ifndef MORPH_PYTHON_TORCH_EXT_H_
#define MORPH_PYTHON_TORCH_EXT_H_

#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <memory>
#include <string>

// The package records the torch found at configure (<build>/python/morph/_torch_build.py) and refuses any other
// major.minor at import: these headers must be that torch's (python/CMakeLists.txt).
static_assert(TORCH_VERSION_MAJOR == MORPH_TORCH_MAJOR && TORCH_VERSION_MINOR == MORPH_TORCH_MINOR,
              "torch's headers are not those of the torch that python/CMakeLists.txt found");

namespace morph_torch {

// The shared owner a capsule of morph._morph holds (runtime_ext.cc SharedCapsule), checked by
// the capsule's name: a wrong object raises TypeError instead of being read as an address.
template <typename T>
std::shared_ptr<T> SharedFromCapsule(const py::capsule& c, const char* name) {
  void* p = PyCapsule_GetPointer(c.ptr(), name);
  if (p == nullptr) {
    PyErr_Clear();
    throw py::type_error(std::string("morph: expected a capsule named '") + name + "'");
  }
  return *static_cast<std::shared_ptr<T>*>(p);
}

void BindStore(py::module_& m);  // torch_store.cc

}  // namespace morph_torch

#endif  // MORPH_PYTHON_TORCH_EXT_H_
