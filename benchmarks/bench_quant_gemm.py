"""The quantised GEMM alone (issue 18): one decoder layer's projections of the embedded model's
shapes (576 -> 1536 and 1536 -> 576 Q4, 576 -> 576 Q4) and a 4096 x 576 Q8 block of its LM head,
random weights that stay in cache, for 1..8 rows (a decode step and verification windows), with
int16 and int8 activations, on each named instruction set; every setting is timed in every
repeat (interleaved). In cache, the time is the kernel's arithmetic, not the memory it reads.

    python benchmarks/bench_quant_gemm.py --isas avx2,avx512-vnni --threads 1
"""

from __future__ import annotations

import argparse

import torch

from specfork.bench.machine import native_kernels_or_exit
from specfork.bench.timing import median, timed

SHAPES = [(1536, 576, 4), (576, 1536, 4), (576, 576, 4), (4096, 576, 8)]  # (outputs, inputs, bits)
INT8_INPUTS = 16  # the kernel's format flag (layers/quantized.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isas", default=None, help="comma list of instruction sets (default: the one in use)")
    parser.add_argument("--inputs", default="int16,int8", help="comma list of int16, int8 (default: both)")
    parser.add_argument("--rows", default="1,2,3,4,6,8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    k = native_kernels_or_exit()
    torch.set_num_threads(args.threads)
    isas = args.isas.split(",") if args.isas else [k.kernel_isa()]
    inputs = args.inputs.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    packed = {}
    for name in inputs:
        flag = INT8_INPUTS if name == "int8" else 0
        packed[name] = []
        for n, kk, bits in SHAPES:
            q = torch.randint(0, 16, (n, kk), dtype=torch.uint8, generator=gen) if bits == 4 else \
                torch.randint(-128, 128, (n, kk), dtype=torch.int8, generator=gen)
            # GGUF stores fp16 scales and offsets, and the packer takes nothing else
            scale = (torch.rand(n, kk // 32, generator=gen) * 0.01).half().float()
            offset = (torch.randn(n, kk // 32, generator=gen) * 0.01).half().float()
            packed[name].append((kk, n, bits | flag, k.pack_quantized(q, scale, offset, bits | flag)))

    def layer(isa: str, name: str, x: list[torch.Tensor], times: int = 10) -> None:
        for _ in range(times):
            for xi, (_, n, fmt, (units, scales, offsets)) in zip(x, packed[name], strict=True):
                k.quant_linear_isa(xi, units, scales, offsets, n, fmt, None, isa)

    cells = [(isa, name, m) for isa in isas for name in inputs for m in rows]
    times: dict[tuple, list[float]] = {c: [] for c in cells}
    for i in range(args.repeat + 1):  # the first round warms up
        for cell in cells:
            isa, name, m = cell
            x = [torch.randn(m, kk, generator=gen) for kk, *_ in packed[name]]
            seconds = timed(layer, isa, name, x)[1] / 10
            if i:
                times[cell].append(seconds)
    ms = {c: median(v) * 1e3 for c, v in times.items()}
    print(f"quantised GEMM, {len(SHAPES)} projections in cache, {args.threads} thread(s); median of {args.repeat}")
    print("set           inputs  " + "  ".join(f"{m} rows" + " " * 9 for m in rows))
    for isa in isas:
        for name in inputs:
            line = "  ".join(f"{ms[(isa, name, m)]:.3f} ms {ms[(isa, name, m)] / ms[(isa, name, rows[0])]:4.2f}x"
                             for m in rows)
            print(f"{isa:12s}  {name:6s}  {line}")


if __name__ == "__main__":
    main()
