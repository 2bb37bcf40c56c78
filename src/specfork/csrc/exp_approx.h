// exp(x) for x <= 0 from plain float operations (a Cody-Waite reduction and a degree-6 polynomial,
// within 2 ulp of std::exp; below kExpFloor the result is 0), so that every instruction set and
// every vector width computes the same value: paged attention's softmax (its vector forms are in
// paged_attention_items.inc, lane for lane the same operations) and the SiLU of activation.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

constexpr float kExpFloor = -87.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// One lane of the vector exp: the same operations, one rounding each. Written so that GCC can
// vectorize a loop over it (activation.cpp): n is x log2(e) rounded to the nearest integer, ties to
// even, by adding and subtracting 1.5 * 2^23 (exact for |x log2(e)| < 2^22; what nearbyint and
// the vector round instructions give), and the polynomial's loop is unrolled.
inline float exp_nonpositive_scalar(float x) {
  constexpr float kRound = 12582912.0f;
  const bool tiny = x < kExpFloor;
  x = x > kExpFloor ? x : kExpFloor;
  const float n = (x * kLog2e + kRound) - kRound;
  float r = __builtin_fmaf(-n, kLn2Hi, x);
  r = __builtin_fmaf(-n, kLn2Lo, r);
  float p = kExpPoly[0];
#pragma GCC unroll 6
  for (int i = 1; i < 6; ++i) p = __builtin_fmaf(p, r, kExpPoly[i]);
  p = __builtin_fmaf(p, r * r, r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return tiny ? 0.0f : p * two_n;
}
