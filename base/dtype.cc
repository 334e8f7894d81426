#include "morph/dtype.h"

#include <string>

namespace morph {

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kI8: return 1;
    case DType::kU8: return 1;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kI8: return "i8";
    case DType::kU8: return "u8";
  }
  return "?";
}

StatusOr<DType> ParseDType(std::string_view t) {
  if (t == "f32" || t == "float32" || t == "float") return DType::kF32;
  if (t == "f64" || t == "float64" || t == "double") return DType::kF64;
  if (t == "f16" || t == "float16" || t == "half") return DType::kF16;
  if (t == "bf16" || t == "bfloat16") return DType::kBF16;
  if (t == "i32" || t == "int32") return DType::kI32;
  if (t == "i64" || t == "int64") return DType::kI64;
  if (t == "i8" || t == "int8") return DType::kI8;
  if (t == "u8" || t == "uint8") return DType::kU8;
  return InvalidArgumentError("unknown dtype '" + std::string(t) +
                              "' (expected f32, f64, f16, bf16, i32, i64, i8 or u8)");
}

}  // namespace morph
