// DType names and sizes, and host conversions between float32 and the 16-bit
// float formats. The conversions round to nearest even, bit for bit what
// CUDA's __float2bfloat16_rn / __float2half_rn do, so CPU references match
// the device exactly. Written by hand (a few lines each).
#include <cmath>
#include <cstring>

#include "core/internal.h"
#include "moeflow/tensor.h"

namespace moeflow {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E5M2: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
    case DType::kBool: return 1;
    case DType::kFloat64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
    case DType::kFloat64: return "float64";
  }
  return "unknown";
}

bool dtype_is_arith_float(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

namespace detail {

static uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float bf16_to_float(uint16_t v) { return bits_float(static_cast<uint32_t>(v) << 16); }

uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  uint32_t rounding = 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t man = h & 0x3FF;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000 | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: value = man * 2^-24
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t float_to_half(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  uint32_t abs = u & 0x7FFFFFFF;
  if (abs >= 0x7F800000) return sign | (abs > 0x7F800000 ? 0x7E00 : 0x7C00);
  if (abs >= 0x477FF000) return sign | 0x7C00;  // rounds to >= 65520: inf
  if (abs < 0x38800000) {                        // below the smallest normal half
    // subnormal or zero: round abs * 2^24 to an integer, ties to even
    float a = bits_float(abs);
    float scaled = a * 16777216.0f;  // exact (power of two)
    float r = std::nearbyint(scaled);  // default rounding mode: to nearest even
    return sign | static_cast<uint16_t>(r);
  }
  // normal: rebias exponent, round mantissa from 23 to 10 bits
  uint32_t rounding = 0xFFF + ((abs >> 13) & 1);
  uint32_t v = abs + rounding - (112u << 23);
  return sign | static_cast<uint16_t>(v >> 13);
}

float load_float(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(base)[i]);
    default: MOEFLOW_CHECK(false, "load_float: unsupported dtype ", dtype_name(dtype));
  }
}

void store_float(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[i] = v; return;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); return;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = float_to_half(v); return;
    default: MOEFLOW_CHECK(false, "store_float: unsupported dtype ", dtype_name(dtype));
  }
}

}  // namespace detail
}  // namespace moeflow
