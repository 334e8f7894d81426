// Element types: of registered tensors (reshard) and of collectives (one enum for both).
#ifndef MORPH_DTYPE_H_
#define MORPH_DTYPE_H_

#include "morph/api.h"

#include <cstdint>
#include <string_view>

#include "morph/status.h"

namespace morph {

enum class DType : uint8_t { kF32, kF64, kF16, kBF16, kI32, kI64, kI8, kU8 };

// Bytes per element: 4, 8, 2, 2, 4, 8, 1, 1.
MORPH_API int DTypeSize(DType dtype);
// "f32", "f64", "f16", "bf16", "i32", "i64", "i8", "u8".
MORPH_API std::string_view DTypeName(DType dtype);
// Inverse of DTypeName; also accepts "float32", "float", "bfloat16", "half", "int32"...
// kInvalidArgument naming the text otherwise.
MORPH_API StatusOr<DType> ParseDType(std::string_view text);

}  // namespace morph

#endif  // MORPH_DTYPE_H_
