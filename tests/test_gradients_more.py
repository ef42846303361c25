"""Gradients of the indexing, routing, resampling and normalization ops against torch.autograd.

As in ``test_autodiff.py``: ``loss = ReduceSum(op(params...) * R)`` for a fixed random R,
and every parameter's gradient (parameters are fed to the step as state, the graph
inputs autodiff differentiates) compared with torch.autograd on the same float64 data,
``rtol=1e-7, atol=1e-9`` (float32 where ONNX types an output float whatever the input:
``rtol=1e-4, atol=1e-5``). Cases with ties (Max, Min, GlobalMaxPool) use integer-valued
data so that ties really occur.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

import segflow
from grad_check import TorchFn, check, ints, op, rand
from segflow.errors import UnsupportedOp
from segflow.frontend.builder import GraphBuilder, Sym

# The shared harness, under the names this module's cases use.
_rand, _op, _ints = rand, op, ints


# -- Gather, GatherElements, ScatterND, ScatterElements --------------------------------------------
def _gather(x: torch.Tensor, idx: torch.Tensor, axis: int) -> torch.Tensor:
    a = axis % x.dim()
    return x[(slice(None),) * a + (idx,)]


GATHER = [  # x shape, indices (repeats, negatives), axis
    ((4, 3), [[0, 2], [2, 1]], 0),
    ((2, 3, 4), [-1, 0, -1, 3], -1),
    ((2, 5, 3), [[1, -2, 1]], 1),
    ((3, 4), 2, 1),  # a constant scalar index: the forward selects, the gradient still adds
]


@pytest.mark.parametrize(("shape", "indices", "axis"), GATHER)
def test_gather(shape: tuple[int, ...], indices: object, axis: int) -> None:
    idx = np.array(indices, dtype=np.int64)
    check({"x": _rand(1, *shape)}, _op("Gather", "x", "idx", axis=axis),
          lambda x, idx: _gather(x, idx, axis), consts={"idx": idx}, backward="GatherGrad")


def test_gather_embedding_rows_used_twice_accumulate() -> None:
    idx = _ints(3, 1, 3, 3, 0)
    check({"table": _rand(2, 5, 4)}, _op("Gather", "table", "idx"),
          lambda table, idx: table[idx], consts={"idx": idx})


@pytest.mark.parametrize("axis", [0, -1, 1])
def test_gather_elements(axis: int) -> None:
    x = _rand(3, 3, 4)
    rng = np.random.default_rng(4)
    a = axis % 2
    size = x.shape[a]
    idx = rng.integers(-size, size, (5, 4) if a == 0 else (3, 6))

    def reference(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.gather(x, a, torch.where(idx < 0, idx + size, idx))

    check({"x": x}, _op("GatherElements", "x", "idx", axis=axis), reference,
          consts={"idx": idx}, backward="GatherElementsGrad")


SCATTER_ND = [  # data shape, indices (no duplicates), updates shape
    ((4, 3, 2), [[1], [3]], (2, 3, 2)),
    ((4, 3, 2), [[0, 1], [2, 2], [-1, 0]], (3, 2)),
    ((4, 3), [[[0, 0], [1, 2]], [[3, 1], [-3, -1]]], (2, 2)),
]


def _scatter_nd(data: torch.Tensor, idx: torch.Tensor, updates: torch.Tensor,
                add: bool = False) -> torch.Tensor:
    keys = tuple(idx[..., k] for k in range(idx.shape[-1]))
    return data.index_put(keys, updates, accumulate=add)


@pytest.mark.parametrize(("shape", "indices", "ushape"), SCATTER_ND)
@pytest.mark.parametrize("wrt", ["both", "data", "updates"])
def test_scatter_nd(shape: tuple[int, ...], indices: list[object], ushape: tuple[int, ...],
                    wrt: str) -> None:
    arrays = {"data": _rand(5, *shape), "updates": _rand(6, *ushape)}
    params = {k: v for k, v in arrays.items() if wrt in ("both", k)}
    consts = {k: v for k, v in arrays.items() if k not in params}
    consts["idx"] = np.array(indices, dtype=np.int64)
    sess = check(params, _op("ScatterND", "data", "idx", "updates"), _scatter_nd,
                 consts=consts, backward="ScatterNDGrad")
    if "data" in params:  # the scattered positions get no gradient
        keys = tuple(consts["idx"][..., k] for k in range(consts["idx"].shape[-1]))
        assert not sess.grad("data").numpy()[keys].any()


def test_scatter_nd_add_accumulates_duplicates() -> None:
    params = {"data": _rand(7, 4, 3), "updates": _rand(8, 3, 3)}
    idx = _ints(1, 1, -1).reshape(3, 1)
    check(params, _op("ScatterND", "data", "idx", "updates", reduction="add"),
          lambda data, idx, updates: _scatter_nd(data, idx, updates, add=True),
          consts={"idx": idx})


def test_scatter_nd_other_reductions_fail_in_one_line_naming_the_op() -> None:
    b = GraphBuilder(opset=18)
    data = b.param("data", np.ones((4, 3)))
    y = b.op("ScatterND", data, b.const(_ints(1).reshape(1, 1)), b.const(np.ones((1, 3))),
             reduction="mul")
    b.output(b.op("ReduceSum", y, keepdims=0), "loss")
    with pytest.raises(UnsupportedOp, match="no gradient rule for op ScatterND with "
                       "reduction 'mul'") as info:
        segflow.TrainingSession(b.to_model(), loss="loss")
    assert "\n" not in str(info.value)


SCATTER_ELEMENTS = [  # data shape, indices (no duplicates along the axis), axis
    ((4, 3), [[1, 0, 2], [3, 2, 0]], 0),
    ((3, 5), [[-1, 0], [2, 4], [1, -2]], 1),
    ((2, 4, 3), [[[0, 2, 1]], [[3, 1, 0]]], -2),
]


def _scatter_elements(data: torch.Tensor, idx: torch.Tensor, updates: torch.Tensor,
                      axis: int, add: bool = False) -> torch.Tensor:
    a = axis % data.dim()
    index = torch.where(idx < 0, idx + data.shape[a], idx)
    if add:
        return data.scatter_add(a, index, updates)
    return data.scatter(a, index, updates)


@pytest.mark.parametrize(("shape", "indices", "axis"), SCATTER_ELEMENTS)
@pytest.mark.parametrize("wrt", ["both", "data", "updates"])
@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_elements(shape: tuple[int, ...], indices: list[object], axis: int, wrt: str,
                          reduction: str) -> None:
    idx = np.array(indices, dtype=np.int64)
    arrays = {"data": _rand(8, *shape), "updates": _rand(9, *idx.shape)}
    params = {k: v for k, v in arrays.items() if wrt in ("both", k)}
    consts = {k: v for k, v in arrays.items() if k not in params}
    consts["idx"] = idx
    sess = check(params, _op("ScatterElements", "data", "idx", "updates", axis=axis,
                             reduction=reduction),
                 lambda data, idx, updates: _scatter_elements(data, idx, updates, axis,
                                                              add=reduction == "add"),
                 consts=consts, backward="ScatterElementsGrad")
    if "data" in params and reduction == "none":  # the scattered positions get no gradient
        ddata = torch.as_tensor(sess.grad("data").numpy())
        a = axis % len(shape)
        index = torch.as_tensor(np.where(idx < 0, idx + shape[a], idx))
        assert not ddata.gather(a, index).any()


def test_op_without_a_rule_fails_in_one_line_naming_it() -> None:
    b = GraphBuilder(opset=18)
    x = b.param("x", np.ones((4, 3)))
    y = b.op("FastGelu", x, domain="com.microsoft")  # a contrib op: no rule
    b.output(b.op("ReduceSum", y, keepdims=0), "loss")
    model = b.to_model()
    model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(UnsupportedOp, match="no gradient rule for op FastGelu") as info:
        segflow.TrainingSession(model, loss="loss")
    assert "\n" not in str(info.value)


# -- Split, Where, Max/Min, GlobalMaxPool --------------------------------------------------
def test_split_sizes_input_reversed_concat() -> None:
    check({"x": _rand(9, 2, 4, 3)},
          lambda b, s: b.op("Concat", *reversed(b.op("Split", s["x"], s["sizes"], outputs=2,
                                                     axis=1)), axis=1),
          lambda x, sizes: torch.cat(list(reversed(torch.split(x, [1, 3], 1))), 1),
          consts={"sizes": _ints(1, 3)})


def test_split_unused_part_gets_zero() -> None:
    check({"x": _rand(10, 5, 3)},
          lambda b, s: b.op("Split", s["x"], outputs=3, axis=-2, num_outputs=3)[1],
          lambda x: torch.split(x, 2, 0)[1], backward="SplitGrad")


def test_split_attribute_form_before_opset_13() -> None:
    check({"x": _rand(11, 3, 6)},
          lambda b, s: b.op("Mul", *b.op("Split", s["x"], outputs=2, axis=1, split=[3, 3])),
          lambda x: x[:, :3] * x[:, 3:], opset=11)


@pytest.mark.parametrize("wrt", [("a", "b"), ("a",), ("b",)])
def test_where_broadcasting(wrt: tuple[str, ...]) -> None:
    arrays = {"a": _rand(12, 2, 3, 4), "b": _rand(13, 4)}
    cond = np.array([[True], [False], [True]])
    consts: dict[str, np.ndarray] = {"cond": cond}
    consts.update({k: v for k, v in arrays.items() if k not in wrt})
    check({k: arrays[k] for k in wrt}, _op("Where", "cond", "a", "b"),
          lambda cond, a, b: torch.where(cond, a, b), consts=consts, backward="WhereGrad")


def test_where_masked_softmax_with_infinite_fill_stays_finite() -> None:
    """The attention-mask pattern: the unchosen -inf branch must not turn gradients NaN."""
    cond = np.tril(np.ones((4, 4), dtype=bool))
    fill = np.array(-np.inf)

    def build(b: GraphBuilder, s: dict[str, Sym]) -> Sym:
        return b.op("Softmax", b.op("Where", s["cond"], s["scores"], s["fill"]), axis=-1)

    sess = check({"scores": _rand(49, 2, 4, 4)}, build,
                 lambda scores, cond, fill: torch.softmax(torch.where(cond, scores, fill), -1),
                 consts={"cond": cond, "fill": fill}, backward="WhereGrad")
    assert np.isfinite(sess.grad("scores").numpy()).all()


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_extremum_two_inputs_ties_split_in_half_as_torch(op: str) -> None:
    a, b = _rand(14, 3, 4, ties=True), _rand(15, 4, ties=True)
    assert (np.broadcast_to(a, (3, 4)) == b).any()
    fn = torch.maximum if op == "Max" else torch.minimum
    check({"a": a, "b": b}, _op(op, "a", "b"), lambda a, b: fn(a, b))


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_extremum_variadic_ties_share_evenly_as_amax(op: str) -> None:
    params = {"a": _rand(16, 2, 3, ties=True), "b": _rand(17, 3, ties=True),
              "c": _rand(18, 2, 1, ties=True)}

    def reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        stacked = torch.stack(torch.broadcast_tensors(a, b, c))
        return stacked.amax(0) if op == "Max" else stacked.amin(0)

    check(params, _op(op, "a", "b", "c"), reference, backward="ExtremumGrad")


def test_extremum_single_input_is_identity() -> None:
    check({"x": _rand(19, 3, 2)}, _op("Max", "x"), lambda x: x)


def test_extremum_nan_operand_takes_the_gradient() -> None:
    b = GraphBuilder(opset=18)
    a = b.param("a", np.array([1.0, np.nan, 2.0]))
    c = b.param("c", np.array([1.0, 0.0, np.inf]))
    b.output(b.op("ReduceSum", b.op("Max", a, c), keepdims=0), "loss")
    sess = segflow.TrainingSession(b.to_model(), loss="loss", engine="inline")
    sess.step({})
    np.testing.assert_array_equal(sess.grad("a").numpy(), [0.5, 1.0, 0.0])
    np.testing.assert_array_equal(sess.grad("c").numpy(), [0.5, 0.0, 1.0])


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 2, 6)])
def test_global_max_pool_ties_share_evenly(shape: tuple[int, ...]) -> None:
    x = _rand(20, *shape, ties=True)
    dims = tuple(range(2, len(shape)))
    flat = x.reshape(*shape[:2], -1)
    assert ((flat == flat.max(axis=-1, keepdims=True)).sum(axis=-1) > 1).any()
    check({"x": x}, _op("GlobalMaxPool", "x"), lambda x: x.amax(dim=dims, keepdim=True),
          backward="GlobalMaxPoolGrad")


# -- Pad --------------------------------------------------------------------------------
def _torch_pads(pads: Sequence[int]) -> list[int]:
    """ONNX [begins..., ends...] as F.pad's (begin, end) pairs from the last axis."""
    rank = len(pads) // 2
    out: list[int] = []
    for a in reversed(range(rank)):
        out += [pads[a], pads[rank + a]]
    return out


PADS = [  # mode, ONNX pads over all 4 axes (negative: crop)
    ("constant", [0, 1, 2, 0, 0, 0, 1, 3]),
    ("constant", [0, 0, -1, 2, 0, 1, 1, -2]),
    ("reflect", [0, 0, 2, 1, 0, 0, 1, 3]),
    ("edge", [0, 0, 1, 2, 0, 0, 3, 0]),
    ("wrap", [0, 0, 2, 1, 0, 0, 1, 2]),
    ("edge", [0, 0, -1, 2, 0, 0, 1, -2]),
]
_TORCH_MODE = {"constant": "constant", "reflect": "reflect", "edge": "replicate",
               "wrap": "circular"}


@pytest.mark.parametrize(("mode", "pads"), PADS)
def test_pad_modes(mode: str, pads: list[int]) -> None:
    x = _rand(21, 2, 3, 4, 5)

    def reference(x: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
        tp = _torch_pads(pads.tolist())
        if mode == "constant":
            return F.pad(x, tp)
        crop = [min(0, p) for p in tp]
        grow = [max(0, p) for p in tp[:4]]  # torch pads the last two axes in these modes
        return F.pad(F.pad(x, crop), grow, mode=_TORCH_MODE[mode])

    check({"x": x}, _op("Pad", "x", "pads", mode=mode), reference,
          consts={"pads": np.array(pads, dtype=np.int64)}, backward="PadGrad",
          opset=19)  # wrap is new in 19


def test_pad_constant_value_and_axes_inputs() -> None:
    params = {"x": _rand(22, 2, 3, 4), "value": np.array(0.7)}
    consts = {"pads": _ints(2, -1, 1, 3), "axes": _ints(-1, 1)}

    def reference(x: torch.Tensor, value: torch.Tensor, pads: torch.Tensor,
                  axes: torch.Tensor) -> torch.Tensor:
        tp = [2, 1, -1, 3]  # last axis (2, 1), axis 1 (-1, 3)
        return F.pad(x, tp) + value * F.pad(torch.zeros_like(x), tp, value=1.0)

    check(params, _op("Pad", "x", "pads", "value", "axes"), reference, consts=consts)


def test_pad_attribute_form_before_opset_11() -> None:
    check({"x": _rand(23, 3, 4)}, _op("Pad", "x", pads=[1, 0, 0, 2], mode="edge"),
          lambda x: F.pad(x[None], [0, 2, 1, 0], mode="replicate")[0], opset=10)


# -- Resize, ConvTranspose --------------------------------------------------------------
def _f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


RESIZE = [  # attributes, scales or sizes, reference
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
      "nearest_mode": "floor"}, ("scales", _f32(1, 1, 2, 3)),
     lambda x: F.interpolate(x, scale_factor=(2, 3), mode="nearest")),
    ({"mode": "nearest"}, ("scales", _f32(1, 1, 2, 2)),
     lambda x: F.interpolate(x, scale_factor=2, mode="nearest-exact")),
    ({"mode": "linear"}, ("scales", _f32(1, 1, 2, 2)),
     lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"},
     ("sizes", _ints(2, 3, 7, 9)),
     lambda x: F.interpolate(x, size=(7, 9), mode="bilinear", align_corners=True)),
    ({"mode": "linear"}, ("sizes", _ints(2, 3, 2, 3)),
     lambda x: F.interpolate(x, size=(2, 3), mode="bilinear", align_corners=False)),
]


@pytest.mark.parametrize(("attrs", "target", "reference"), RESIZE)
def test_resize(attrs: dict[str, object], target: tuple[str, np.ndarray],
                reference: TorchFn) -> None:
    kind, data = target

    def build(b: GraphBuilder, s: dict[str, Sym]) -> Sym:
        given = b.const(data)
        inputs = (s["x"], None, given) if kind == "scales" else (s["x"], None, None, given)
        return b.op("Resize", *inputs, **attrs)

    check({"x": _rand(24, 2, 3, 4, 5)}, build, lambda x: reference(x), backward="Vjp")


CONV_T = [  # ONNX attributes, torch keywords (None: cropped by hand), the backward emitted
    ({"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
     {"stride": 2, "padding": 1, "output_padding": 1}, "ConvGrad"),
    ({"group": 2, "dilations": [2, 1]}, {"groups": 2, "dilation": (2, 1)}, "ConvGrad"),
    ({"strides": [2, 1], "pads": [0, 1, 1, 0]}, None, "ConvGrad"),
    ({"strides": [2, 1], "auto_pad": "SAME_UPPER"}, None, "Vjp"),  # pads from the output
]


@pytest.mark.parametrize(("attrs", "torch_kw", "emitted"), CONV_T)
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose(attrs: dict[str, object], torch_kw: dict[str, object] | None,
                        emitted: str, bias: bool) -> None:
    groups = int(attrs.get("group", 1))  # type: ignore[call-overload]
    params = {"x": _rand(25, 2, 4, 3, 4), "w": _rand(26, 4, 6 // groups, 3, 2)}
    if bias:
        params["b"] = _rand(27, 6)

    def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                  ) -> torch.Tensor:
        if torch_kw is not None:
            return F.conv_transpose2d(x, w, b, **torch_kw)  # type: ignore[arg-type]
        full = F.conv_transpose2d(x, w, b, stride=(2, 1))  # 7 x 5
        if "auto_pad" in attrs:  # to 6 x 4: SAME_UPPER drops the extra row and column last
            return full[:, :, :-1, :-1]
        return full[:, :, 0:full.shape[2] - 1, 1:]

    names = ("x", "w", "b") if bias else ("x", "w")
    sess = check(params, _op("ConvTranspose", *names, **attrs), reference, backward=emitted)
    if emitted == "ConvGrad":  # dx is a Conv of dy: the adjoint needs no recomputation
        assert "Vjp" not in {n.op_type for n in sess.differentiated.backward_nodes}


@pytest.mark.parametrize("opset", [11, 18])  # ReduceSum takes its axes as an attribute at 11
def test_conv_transpose_1d_frozen_input(opset: int) -> None:
    check({"w": _rand(28, 3, 2, 3), "b": _rand(30, 2)},
          _op("ConvTranspose", "x", "w", "b", strides=[2]),
          lambda w, b, x: F.conv_transpose1d(x, w, b, stride=2),
          consts={"x": _rand(29, 2, 3, 5)}, opset=opset, backward="ConvGrad")


# -- normalization ----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 7)])
def test_instance_normalization(shape: tuple[int, ...]) -> None:
    params = {"x": _rand(30, *shape), "s": _rand(31, 3), "b": _rand(32, 3)}
    check(params, _op("InstanceNormalization", "x", "s", "b", epsilon=1e-3),
          lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=1e-3), backward="GroupNormGrad")


@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization(opset: int) -> None:
    per_group = opset < 21  # opset 18 declares one scale and bias per group
    n = 2 if per_group else 4
    params = {"x": _rand(33, 2, 4, 3, 2), "s": _rand(34, n), "b": _rand(35, n)}

    def reference(x: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if per_group:
            s, b = s.repeat_interleave(2), b.repeat_interleave(2)
        return F.group_norm(x, 2, s, b, 1e-4)

    check(params, _op("GroupNormalization", "x", "s", "b", num_groups=2, epsilon=1e-4),
          reference, opset=opset, backward="GroupNormGrad")


def _layer_norm_parts(x: torch.Tensor, axis: int, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dims = tuple(range(axis % x.dim(), x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    inv = torch.rsqrt(((x - mean) ** 2).mean(dim=dims, keepdim=True) + eps)
    return (x - mean) * inv, mean, inv


def test_layer_norm_negative_axis_without_bias() -> None:
    params = {"x": _rand(36, 2, 3, 4), "s": _rand(37, 3, 4)}
    check(params, _op("LayerNormalization", "x", "s", axis=-2, epsilon=1e-4),
          lambda x, s: _layer_norm_parts(x, -2, 1e-4)[0] * s)


def test_instance_normalization_frozen_input_and_bias() -> None:
    params = {"s": _rand(46, 3)}
    consts = {"x": _rand(47, 2, 3, 5), "b": _rand(48, 3)}
    check(params, _op("InstanceNormalization", "x", "s", "b"),
          lambda s, x, b: F.instance_norm(x, weight=s, bias=b, eps=1e-5), consts=consts,
          backward="GroupNormGrad")


def test_layer_norm_frozen_scale() -> None:
    consts = {"s": _rand(38, 4), "b": _rand(39, 4)}
    check({"x": _rand(40, 3, 4)}, _op("LayerNormalization", "x", "s", "b", epsilon=1e-4),
          lambda x, s, b: F.layer_norm(x, (4,), s, b, 1e-4), consts=consts)


def test_layer_norm_mean_and_inv_std_outputs_are_differentiated() -> None:
    """In float32: ONNX types Mean and InvStdDev as float (stash_type) for any input."""
    params = {k: v.astype(np.float32) for k, v in
              {"x": _rand(41, 2, 3, 4), "s": _rand(42, 4), "b": _rand(43, 4)}.items()}

    def build(b: GraphBuilder, s: dict[str, Sym]) -> Sym:
        y, mean, inv = b.op("LayerNormalization", s["x"], s["s"], s["b"], outputs=3,
                            epsilon=1e-4)
        return b.op("Add", b.op("Add", y, mean), b.op("Mul", inv, inv))

    def reference(x: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        normed, mean, inv = _layer_norm_parts(x, -1, 1e-4)
        return normed * s + b + mean + inv * inv

    check(params, build, reference, tolerance=(1e-4, 1e-5), backward="Vjp")


# -- Softmax / LogSoftmax over every opset's axis semantics -----------------------------
def _softmax_ref(log: bool, axis: int, flatten: bool) -> TorchFn:
    fn = torch.log_softmax if log else torch.softmax

    def reference(x: torch.Tensor) -> torch.Tensor:
        if not flatten:
            return fn(x, axis)
        a = axis % x.dim()
        rows = int(np.prod(x.shape[:a]))
        return fn(x.reshape(rows, -1), 1).reshape(x.shape)
    return reference


SOFTMAX = [  # opset, axis attribute (None: the opset's default), effective axis, flattened
    (11, None, 1, True), (11, 0, 0, True), (11, -1, -1, True), (11, 2, 2, True),
    (13, None, -1, False), (13, 0, 0, False), (13, -2, -2, False),
]


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize(("opset", "attr", "axis", "flatten"), SOFTMAX)
def test_softmax_axis_semantics(op: str, opset: int, attr: int | None, axis: int,
                                flatten: bool) -> None:
    attrs = {} if attr is None else {"axis": attr}
    check({"x": _rand(44, 2, 3, 4)}, _op(op, "x", **attrs),
          _softmax_ref(op == "LogSoftmax", axis, flatten), opset=opset, backward="SoftmaxGrad")


# -- Einsum -----------------------------------------------------------------------------
EINSUM = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("...ij,jk->...ik", [(2, 3, 4), (4, 2)]),
    ("ii->i", [(4, 4)]),
    ("ij->", [(3, 4)]),
    ("i,j", [(3,), (4,)]),
    ("ij,ij,j->i", [(2, 3), (2, 3), (3,)]),
]


@pytest.mark.parametrize(("equation", "shapes"), EINSUM, ids=[c[0] for c in EINSUM])
def test_einsum(equation: str, shapes: list[tuple[int, ...]]) -> None:
    names = [f"x{i}" for i in range(len(shapes))]
    params = {n: _rand(45 + i, *s) for i, (n, s) in enumerate(zip(names, shapes))}
    check(params, _op("Einsum", *names, equation=equation),
          lambda **xs: torch.einsum(equation, *(xs[n] for n in names)), backward="Vjp")
