"""The MLP chain against Apache MXNet 1.9.1, the classic graph executor segflow learns from.

MXNet 1.9.1 needs numpy < 1.24, and segflow's environment has numpy 2, so
MXNet runs in its own environment, in a child process that stays up and
times runs on request; the rounds alternate between the two processes (the
order rotates per round, with a pause between runtimes so one's spinning
OpenMP threads do not slow the other), and a ratio is the median over rounds
of the per-round median ratio, as in ``cpu_targets.py``. MXNet runs the same
weights two ways: a Gluon ``HybridSequential`` of ``Dense(activation="relu")``
layers, hybridized with ``static_alloc`` and ``static_shape`` (one cached
graph, memory planned once), and that graph's symbol bound by the classic
executor (``simple_bind``, ``grad_req="null"``); the peer in each round is the
faster of the two. Each run copies the output to numpy, as
``InferenceSession.run`` does. Outputs are compared first.

    python3 -m venv .venv-mxnet
    .venv-mxnet/bin/pip install mxnet==1.9.1 "numpy<1.24"
    python benchmarks/mxnet_peer.py                     # 200 layers, width 64, batch 1
    python benchmarks/mxnet_peer.py --mxnet-python /path/to/python --rounds 30
    python benchmarks/mxnet_peer.py --compile inductor  # compiles once (~75 s), then cached
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_CHILD = r"""
import json, statistics, sys, time
import numpy as np
import mxnet as mx
from mxnet.gluon import nn

data = np.load(sys.argv[1])
layers = int(data["layers"])
width = int(data["x"].shape[1])
net = nn.HybridSequential()
for i in range(layers):
    net.add(nn.Dense(width, activation="relu", in_units=width))
net.initialize(ctx=mx.cpu())
for i, layer in enumerate(net):
    layer.weight.set_data(mx.nd.array(data[f"w{i}"]))
    layer.bias.set_data(mx.nd.array(data[f"b{i}"]))
net.hybridize(static_alloc=True, static_shape=True)
x = mx.nd.array(data["x"])
np.save(sys.argv[2], net(x).asnumpy())
# The symbolic executor (simple_bind), MXNet's classic graph executor, on the same graph.
symbol = net(mx.sym.var("data"))
executor = symbol.simple_bind(mx.cpu(), data=x.shape, grad_req="null")
for name, param in net.collect_params().items():
    executor.arg_dict[name][:] = param.data()
executor.arg_dict["data"][:] = x
executor.forward(is_train=False)
np.testing.assert_allclose(executor.outputs[0].asnumpy(), np.load(sys.argv[2]), atol=1e-5)


def gluon():
    return net(x).asnumpy()


def symbolic():
    executor.forward(is_train=False)
    return executor.outputs[0].asnumpy()


print(json.dumps({"ready": mx.__version__}), flush=True)
for line in sys.stdin:
    mode, runs = line.split()
    run = gluon if mode == "gluon" else symbolic
    times = []
    for _ in range(int(runs)):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"ms": statistics.median(times)}), flush=True)
"""


def _weights(layers: int, width: int, batch: int) -> tuple[Any, dict[str, Any]]:
    from onnx import numpy_helper

    from segflow import models

    model = models.build("mlp_chain", layers=layers, width=width)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    arrays: dict[str, Any] = {"layers": layers}
    for i in range(layers):
        arrays[f"w{i}"] = inits[f"layers.{i}.linear.weight"]
        arrays[f"b{i}"] = inits[f"layers.{i}.linear.bias"]
    arrays["x"] = models.example_inputs("mlp_chain", batch_size=batch, layers=layers,
                                        width=width)["x"]
    return model, arrays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mxnet-python", default=".venv-mxnet/bin/python",
                        help="a Python with mxnet==1.9.1 (default .venv-mxnet/bin/python)")
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=20)
    parser.add_argument("--pause", type=float, default=0.2,
                        help="seconds between runtimes within a round")
    parser.add_argument("--compile", default=None,
                        help="segflow's compile backend (default: the session default, auto)")
    args = parser.parse_args(argv)
    if not Path(args.mxnet_python).exists():
        print(f"mxnet_peer: {args.mxnet_python} does not exist; create it as the module "
              "docstring says", file=sys.stderr)
        return 2
    import numpy as np
    import torch

    import segflow
    from segflow import models

    model, arrays = _weights(args.layers, args.width, args.batch)
    feeds = {"x": arrays["x"]}
    sess = segflow.InferenceSession(model, compile=args.compile)
    module = models.torch_module("mlp_chain", layers=args.layers, width=args.width)
    tensor = torch.from_numpy(feeds["x"])
    with tempfile.TemporaryDirectory() as tmp:
        weights, mx_out = Path(tmp) / "weights.npz", Path(tmp) / "mxnet_out.npy"
        np.savez(weights, **arrays)
        child = subprocess.Popen([args.mxnet_python, "-c", _CHILD, str(weights), str(mx_out)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=dict(os.environ))
        assert child.stdin is not None and child.stdout is not None
        ready = json.loads(child.stdout.readline())
        reference = np.load(mx_out)
        ours = sess.run(None, feeds)[0]
        error = float(np.abs(ours - reference).max())
        np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=1e-3)

        def mxnet_ms(mode: str) -> float:
            child.stdin.write(f"{mode} {args.per_round}\n")   # type: ignore[union-attr]
            child.stdin.flush()                                  # type: ignore[union-attr]
            return float(json.loads(child.stdout.readline())["ms"])  # type: ignore[union-attr]

        def local_ms(run: Any) -> float:
            times = []
            for _ in range(args.per_round):
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)

        def eager() -> object:
            with torch.inference_mode():
                return module(tensor)

        runners = {"segflow": lambda: local_ms(lambda: sess.run(None, feeds)),
                   "torch": lambda: local_ms(eager),
                   "mxnet-gluon": lambda: mxnet_ms("gluon"),
                   "mxnet-executor": lambda: mxnet_ms("executor")}
        names = list(runners)
        for name in names:                              # warm-up round
            runners[name]()
        rounds: list[dict[str, float]] = []
        for r in range(args.rounds):
            result = {}
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                result[name] = runners[name]()
                time.sleep(args.pause)
            result["mxnet"] = min(result["mxnet-gluon"], result["mxnet-executor"])
            rounds.append(result)
        child.stdin.close()
        child.wait(timeout=60)
    print(f"segflow: {sess.compile_report.describe()}")
    print(f"mlp_chain: {args.layers} layers, width {args.width}, batch {args.batch}; "
          f"mxnet {ready['ready']}; {args.rounds} rounds of {args.per_round} runs; "
          f"outputs agree (max |diff| {error:.1e}); mxnet = the faster of its two APIs "
          "in each round")
    for name in names:
        print(f"  {name:<15} {statistics.median(r[name] for r in rounds):8.3f} ms")
    for name in ("segflow", "torch"):
        ratios = sorted(r[name] / r["mxnet"] for r in rounds)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"  {name} / mxnet {statistics.median(ratios):.2f} [{q[0]:.2f}-{q[2]:.2f}]"
              + ("  (target <= 0.50)" if name == "segflow" else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
