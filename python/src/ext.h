// What the files of the binding morph._morph share (morph_ext.cc: the module and the values;
// runtime_ext.cc: the runtime and its objects; host_blocks.cc: host tensor storage): a non-OK
// Status on its way to Python, and the checks that raise it.
#ifndef MORPH_PYTHON_EXT_H_
#define MORPH_PYTHON_EXT_H_

#include <nanobind/nanobind.h>
#include <morph/morph.h>

#include <exception>
#include <string>
#include <utility>

namespace morph_py {

namespace nb = nanobind;

// A non-OK Status on its way to Python: the module's translator raises morph.<Code>Error
// (morph._errors) with its failed peers.
struct StatusError : std::exception {
  explicit StatusError(morph::Status s) : status(std::move(s)), text(status.ToString()) {}
  const char* what() const noexcept override { return text.c_str(); }
  morph::Status status;
  std::string text;
};

inline void Check(const morph::Status& s) {
  if (!s.ok()) throw StatusError(s);
}
template <typename T>
T Value(morph::StatusOr<T>&& s) {
  if (!s.ok()) throw StatusError(std::move(s).status());
  return std::move(s).value();
}
[[noreturn]] inline void Fail(morph::Status s) { throw StatusError(std::move(s)); }

inline morph::DType ParseDTypeOrThrow(const std::string& name) {
  return Value(morph::ParseDType(name));
}

void BindHostStorage(nb::module_& m);  // host_blocks.cc
void BindRuntime(nb::module_& m);      // runtime_ext.cc

// TensorAllocator of host tensors whose shards are host blocks (host_blocks.cc).
morph::TensorAllocator HostTensorAllocator(const std::string& tensor);

}  // namespace morph_py

#endif  // MORPH_PYTHON_EXT_H_
