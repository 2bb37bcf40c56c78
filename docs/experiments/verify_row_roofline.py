"""What a verify row can cost at best on this CPU: the rate of the multiply-add instructions the
native kernels use, against what an extra row of a real projection costs.

    python docs/experiments/verify_row_roofline.py [THREADS]

1. The peak: independent 512-bit VNNI multiply-adds on registers (12 accumulators a thread, no
   memory traffic), int16 pairs (`vpdpwssd`, what `--weights native` multiplies with) and int8
   quads (`vpdpbusd`, `--weights native-int8` on VNNI), in G multiply-adds a second. Needs
   AVX-512 VNNI; compiled here with torch's C++ extension loader (a minute, once).
2. Each projection of the embedded model's first layer and its LM head, weights in cache (one
   projection repeated), at 1..8 rows: the time of the rows past the first, in multiply-adds a
   second. Where that equals the peak, a verify row costs its multiply-adds and nothing else.
3. The whole model's forward after 256 cached tokens at 1 and 6 rows (weights streamed from
   memory): the six rows' extra multiply-adds at the peak, against what they cost.

Timing on a shared machine: run it twice; the ratios hold better than the times.
"""

import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

from specfork import LLM
from specfork.bench.forward import forward_ms
from specfork.layers.quantized import QuantizedLinear

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

template <bool BYTES>
int64_t spin(int64_t iters) {
  int64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    __m512i a = _mm512_set1_epi16(3 + omp_get_thread_num()), b = _mm512_set1_epi16(5);
    __m512i c0 = _mm512_set1_epi32(1), c1 = _mm512_set1_epi32(2), c2 = _mm512_set1_epi32(3),
            c3 = _mm512_set1_epi32(4), c4 = _mm512_set1_epi32(5), c5 = _mm512_set1_epi32(6),
            c6 = _mm512_set1_epi32(7), c7 = _mm512_set1_epi32(8), c8 = _mm512_set1_epi32(9),
            c9 = _mm512_set1_epi32(10), c10 = _mm512_set1_epi32(11), c11 = _mm512_set1_epi32(12);
#define STEP(c) c = BYTES ? _mm512_dpbusd_epi32(c, a, b) : _mm512_dpwssd_epi32(c, a, b);
    for (int64_t i = 0; i < iters; ++i) {
      STEP(c0) STEP(c1) STEP(c2) STEP(c3) STEP(c4) STEP(c5) STEP(c6) STEP(c7) STEP(c8) STEP(c9) STEP(c10) STEP(c11)
      __asm__ volatile("" : "+v"(a));  // a new operand each iteration: nothing hoisted
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
    total += _mm512_reduce_add_epi32(s);
  }
  return total;
}

int64_t spin_int16(int64_t iters) { return spin<false>(iters); }
int64_t spin_int8(int64_t iters) { return spin<true>(iters); }
"""

MACS_PER_INSTRUCTION = {"int16": 32, "int8": 64}  # per 512-bit instruction: 16 lanes x 2 or x 4


def peak_rates(threads: int, iters: int = 20_000_000) -> dict[str, float]:
    """G multiply-adds a second on ``threads`` threads, best of 3, per activation width."""
    module = load_inline("verify_row_roofline_peak", cpp_sources=PEAK_SOURCE, functions=["spin_int16", "spin_int8"],
                         extra_cflags=["-O2", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    torch.set_num_threads(threads)
    rates = {}
    for width, spin in (("int16", module.spin_int16), ("int8", module.spin_int8)):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            spin(iters)
            best = min(best, time.perf_counter() - start)
        rates[width] = iters * 12 * MACS_PER_INSTRUCTION[width] * threads / best / 1e9
    return rates


def in_cache_row_rates(model, names: list[str], repeat: int = 300) -> None:
    """Per projection: microseconds at 1..8 rows and the rows past the first in G multiply-adds a second."""
    modules = dict(model.named_modules())
    print("projection (weights in cache)        rows: 1      2      4      6      8 us   extra rows G MAC/s")
    for name in names:
        layer = modules[name]
        out_features, in_features = layer.out_features, layer.in_features
        times = {}
        with torch.inference_mode():
            for rows in (1, 2, 4, 6, 8):
                x = torch.randn(rows, in_features)
                for _ in range(20):
                    layer(x)
                start = time.perf_counter()
                for _ in range(repeat):
                    layer(x)
                times[rows] = (time.perf_counter() - start) / repeat
        extra = (times[8] - times[1]) / (7 * out_features * in_features)  # seconds per multiply-add
        print(f"  {name:34s} " + " ".join(f"{times[r] * 1e6:6.1f}" for r in (1, 2, 4, 6, 8))
              + f"   {1e-9 / extra:7.1f}")


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rates = peak_rates(threads)
    print(f"peak on {threads} threads: int16 pairs (vpdpwssd) {rates['int16']:.0f} G MAC/s, "
          f"int8 quads (vpdpbusd) {rates['int8']:.0f} G MAC/s")
    llm = LLM("smollm2-135m", threads=threads, kv_cache_tokens=4096)
    model = llm.engine.loaded.model
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    first = [n for n, _ in linears if n.startswith("layers.0.")] + [n for n, _ in linears if n == "lm_head"]
    in_cache_row_rates(model, first)
    macs = sum(m.out_features * m.in_features for _, m in linears)  # per row
    one, six = forward_ms(llm, 256, 1, 41), forward_ms(llm, 256, 6, 41)
    floor = 5 * macs / (rates["int16"] * 1e9) * 1e3
    print(f"whole forward, weights streamed: 1 row {one:.2f} ms, 6 rows {six:.2f} ms = {six / one:.2f}x; "
          f"{macs / 1e6:.0f} M multiply-adds a row; the 5 extra rows at the int16 peak alone: {floor:.2f} ms "
          f"(6 rows >= {(one + floor) / one:.2f}x unless that work hides under the weights' streaming)")


if __name__ == "__main__":
    main()
