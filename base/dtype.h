// Element types: of registered tensors (reshard) and of collectives (one enum for both).
#ifndef MORPH_BASE_DTYPE_H_
#define MORPH_BASE_DTYPE_H_

#include <cstdint>
#include <string_view>

#include "base/status.h"

namespace morph {

enum class DType : uint8_t { kF32, kF64, kF16, kBF16, kI32, kI64, kI8, kU8 };

// Bytes per element: 4, 8, 2, 2, 4, 8, 1, 1.
int DTypeSize(DType dtype);
// "f32", "f64", "f16", "bf16", "i32", "i64", "i8", "u8".
std::string_view DTypeName(DType dtype);
// Inverse of DTypeName; also accepts "float32", "float", "bfloat16", "half", "int32"...
// kInvalidArgument naming the text otherwise.
StatusOr<DType> ParseDType(std::string_view text);

}  // namespace morph

#endif  // MORPH_BASE_DTYPE_H_
