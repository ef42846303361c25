"""The dense-chain kernel against torch, layer by layer, over widths and row counts.

For each (width, rows) it times one DenseChain op of ``--layers`` layers of
``width x width`` (Relu) two ways, alternating in rounds: the native kernel
(one call into ``kernels/native/dense_chain.c``) and the torch path (one ``addmm``
with Relu per layer, MKL, torch's intra-op threads). The ratio is the
median over rounds of native / torch. Where it crosses 1 is where
``NATIVE_MAX_MACS`` (multiply-adds per layer and call, ``rows x width^2``)
should sit; the last column says which path the op takes there.

    python benchmarks/dense_chain.py
    python benchmarks/dense_chain.py --widths 64,256 --rows 1,8,32 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="64,128,256,512")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="calls per timing")
    args = parser.parse_args(argv)
    import torch

    from segflow.kernels.dense_chain import NATIVE_MAX_MACS, DenseChain
    from segflow.kernels.native.build import NativeLibrary
    from segflow.ops.dense_chain import ChainLayer
    from segflow.ops.fused import ACTIVATIONS

    library, why = NativeLibrary.probe()
    if library is None:
        print(f"dense_chain: native kernels {why}", file=sys.stderr)
        return 2
    print(f"native: {why}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.layers} layers, Relu, {args.rounds} rounds of {args.calls} calls")
    print(f"{'width':>6} {'rows':>5} {'native us':>10} {'torch us':>9} {'native/torch':>13}"
          "  op runs")
    gen = torch.Generator().manual_seed(0)
    for width in (int(w) for w in args.widths.split(",")):
        layers = [ChainLayer(torch.randn(width, width, generator=gen) / width ** 0.5,
                             torch.randn(width, generator=gen) * 0.1, ACTIVATIONS["Relu"],
                             (0.0, 0.0)) for _ in range(args.layers)]
        op = DenseChain(layers, library, why)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, width, generator=gen)
            times: dict[str, list[float]] = {"native": [], "torch": []}
            paths = {"native": lambda x=x, op=op: op.native(x),
                     "torch": lambda x=x, op=op: op.through_torch(x)}
            with torch.inference_mode():
                for fn in paths.values():
                    fn()
                for r in range(args.rounds):
                    for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            paths[name]()
                        times[name].append((time.perf_counter() - start) / args.calls * 1e6)
            ratios = [n / t for n, t in zip(times["native"], times["torch"])]
            takes = "native" if rows * width * width <= NATIVE_MAX_MACS else "torch"
            print(f"{width:>6} {rows:>5} {statistics.median(times['native']):>10.1f} "
                  f"{statistics.median(times['torch']):>9.1f} "
                  f"{statistics.median(ratios):>13.2f}  {takes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
