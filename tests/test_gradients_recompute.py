"""Gradients of the ops whose backward recomputes the forward under torch autograd
(``gradients.recompute``): every differentiable op of onnx's node suite without a
closed-form rule.

One-line torch references where torch has the op (``check``: torch.autograd on the same
float64 data, ``rtol=1e-7, atol=1e-9``); central finite differences of segflow's own
forward elsewhere (``check_numeric``: eps 1e-6, ``rtol=1e-6, atol=1e-8``; piecewise
linear ops are fed data away from their kinks). Ops whose onnx definition is piecewise
constant (Floor, Ceil, Round, Sign, Hardmax) get zero gradients, as torch gives.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from grad_check import check, check_numeric, ints, op, rand, uniform
from segflow.frontend.builder import GraphBuilder, Sym

T = torch.Tensor

# -- elementwise ---------------------------------------------------------------------------
UNARY = [  # op, attrs, data, torch reference
    ("Tan", {}, uniform(1, -1, 1, 3, 4), torch.tan),
    ("Asin", {}, uniform(2, -0.9, 0.9, 3, 4), torch.asin),
    ("Acos", {}, uniform(3, -0.9, 0.9, 3, 4), torch.acos),
    ("Atan", {}, rand(4, 3, 4), torch.atan),
    ("Sinh", {}, rand(5, 3, 4), torch.sinh),
    ("Cosh", {}, rand(6, 3, 4), torch.cosh),
    ("Asinh", {}, rand(7, 3, 4), torch.asinh),
    ("Acosh", {}, uniform(8, 1.1, 3, 3, 4), torch.acosh),
    ("Atanh", {}, uniform(9, -0.9, 0.9, 3, 4), torch.atanh),
    ("Softsign", {}, rand(10, 3, 4), F.softsign),
    ("Mish", {}, rand(11, 3, 4), F.mish),
    ("HardSwish", {}, uniform(12, -2.9, 2.9, 3, 4) * 1.5, F.hardswish),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, rand(13, 3, 4) * 3,
     lambda x: torch.clamp(0.3 * x + 0.4, 0, 1)),
    ("Elu", {"alpha": 0.7}, rand(14, 3, 4), lambda x: F.elu(x, 0.7)),
    ("Celu", {"alpha": 1.3}, rand(15, 3, 4).astype(np.float32),  # Celu is float32-only
     lambda x: F.celu(x, 1.3)),
    ("Selu", {}, rand(16, 3, 4), F.selu),
    ("ThresholdedRelu", {"alpha": 0.5}, rand(17, 3, 4),
     lambda x: torch.where(x > 0.5, x, torch.zeros_like(x))),
    ("Shrink", {"bias": 0.2, "lambd": 0.6}, rand(18, 3, 4),
     lambda x: torch.where(x < -0.6, x + 0.2, torch.where(x > 0.6, x - 0.2, 0 * x))),
    ("Floor", {}, rand(19, 3, 4) * 3, torch.floor),
    ("Ceil", {}, rand(20, 3, 4) * 3, torch.ceil),
    ("Round", {}, rand(21, 3, 4) * 3, torch.round),
    ("Sign", {}, rand(22, 3, 4), torch.sign),
]


@pytest.mark.parametrize(("name", "attrs", "data", "reference"), UNARY,
                         ids=[row[0] for row in UNARY])
def test_unary(name: str, attrs: dict[str, object], data: np.ndarray,
               reference: object) -> None:
    tolerance = (1e-6, 1e-6) if data.dtype == np.float32 else (1e-7, 1e-9)
    check({"x": data}, op(name, "x", **attrs), lambda x: reference(x),  # type: ignore[operator]
          tolerance=tolerance, backward="Vjp")


def test_swish_opset_24() -> None:
    check({"x": rand(23, 3, 4)}, op("Swish", "x", alpha=0.8),
          lambda x: x * torch.sigmoid(0.8 * x), opset=24)


def test_swiglu_opset_28() -> None:
    check_numeric({"a": rand(24, 2, 6), "b": rand(25, 2, 6)}, op("SwiGLU", "a", "b"), opset=28)


def test_prelu_broadcast_slope() -> None:
    check({"x": rand(26, 2, 3, 2, 2), "slope": rand(27, 3, 1, 1)}, op("PRelu", "x", "slope"),
          lambda x, slope: torch.where(x > 0, x, slope * x))


def test_mod_fmod() -> None:
    a, b = rand(28, 3, 4) * 4, uniform(29, 0.7, 1.9, 3, 4)
    check({"a": a, "b": b}, op("Mod", "a", "b", fmod=1), lambda a, b: torch.fmod(a, b))


# -- reductions and scans ------------------------------------------------------------------
REDUCE = [  # op, torch reference over axis 1 keepdims, data
    ("ReduceL1", lambda x: x.abs().sum(1, keepdim=True), rand(30, 3, 4, 2)),
    ("ReduceL2", lambda x: x.pow(2).sum(1, keepdim=True).sqrt(), rand(31, 3, 4, 2)),
    ("ReduceLogSum", lambda x: x.sum(1, keepdim=True).log(), uniform(32, 0.5, 2, 3, 4, 2)),
    ("ReduceLogSumExp", lambda x: torch.logsumexp(x, 1, keepdim=True), rand(33, 3, 4, 2)),
    ("ReduceMax", lambda x: x.amax(1, keepdim=True), rand(34, 3, 4, 2)),
    ("ReduceMin", lambda x: x.amin(1, keepdim=True), rand(35, 3, 4, 2)),
    ("ReduceProd", lambda x: x.prod(1, keepdim=True), rand(36, 3, 4, 2)),
    ("ReduceSumSquare", lambda x: x.pow(2).sum(1, keepdim=True), rand(37, 3, 4, 2)),
]


@pytest.mark.parametrize(("name", "reference", "data"), REDUCE, ids=[r[0] for r in REDUCE])
def test_reduction(name: str, reference: object, data: np.ndarray) -> None:
    check({"x": data}, op(name, "x", "axes"), lambda x, axes: reference(x),  # type: ignore[operator]
          consts={"axes": ints(1)}, backward="Vjp")


def test_reduce_max_ties_split_as_torch_amax() -> None:
    check({"x": rand(38, 3, 4, ties=True)}, op("ReduceMax", "x", "axes", keepdims=0),
          lambda x, axes: x.amax(1), consts={"axes": ints(1)})


@pytest.mark.parametrize(("exclusive", "reverse"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(exclusive: int, reverse: int) -> None:
    def reference(x: T, axis: T) -> T:
        y = x.flip(1) if reverse else x
        y = y.cumsum(1)
        if exclusive:
            y = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], 1)
        return y.flip(1) if reverse else y
    check({"x": rand(39, 3, 5)}, op("CumSum", "x", "axis", exclusive=exclusive,
                                    reverse=reverse),
          reference, consts={"axis": np.array(1, dtype=np.int64)})


def test_cumprod() -> None:
    check({"x": rand(40, 3, 5)}, op("CumProd", "x", "axis"),
          lambda x, axis: x.cumprod(-1), consts={"axis": np.array(-1, dtype=np.int64)},
          opset=26)


# -- data movement and indexing ------------------------------------------------------------
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode: str) -> None:
    check_numeric({"x": rand(41, 1, 8, 2, 3)}, op("DepthToSpace", "x", blocksize=2, mode=mode))


def test_space_to_depth() -> None:
    check_numeric({"x": rand(42, 1, 2, 4, 6)}, op("SpaceToDepth", "x", blocksize=2))


def test_tile() -> None:
    check({"x": rand(43, 2, 3)}, op("Tile", "x", "reps"), lambda x, reps: x.repeat(2, 3),
          consts={"reps": ints(2, 3)})


@pytest.mark.parametrize(("upper", "k"), [(1, 0), (0, -1), (1, 2)])
def test_trilu(upper: int, k: int) -> None:
    ref = torch.triu if upper else torch.tril
    check({"x": rand(44, 4, 5)}, op("Trilu", "x", "diagonal", upper=upper),
          lambda x, diagonal: ref(x, k), consts={"diagonal": np.array(k, dtype=np.int64)})


def test_gather_nd_repeated_indices_accumulate() -> None:
    idx = ints(0, 1, 2, 1, 0, 1).reshape(3, 2)
    check({"x": rand(45, 3, 2, 4)}, op("GatherND", "x", "idx"),
          lambda x, idx: x[idx[:, 0], idx[:, 1]], consts={"idx": idx})


def test_compress() -> None:
    cond = np.array([True, False, True, True])
    check({"x": rand(46, 3, 4)}, op("Compress", "x", "cond", axis=1),
          lambda x, cond: x[:, cond], consts={"cond": cond})


def test_topk_values() -> None:
    check({"x": rand(47, 3, 6)}, op("TopK", "x", "k", outputs=2, axis=1),
          lambda x, k: torch.topk(x, 3, dim=1).values, consts={"k": ints(3)})


def test_reverse_sequence() -> None:
    lens = ints(3, 1, 2)
    check_numeric({"x": rand(48, 4, 3, 2)},
                  op("ReverseSequence", "x", "lens", batch_axis=1, time_axis=0),
                  consts={"lens": lens})


def test_center_crop_pad() -> None:
    check_numeric({"x": rand(49, 5, 3)}, op("CenterCropPad", "x", "shape"),
                  consts={"shape": ints(3, 6)})


def test_tensor_scatter() -> None:
    check_numeric({"cache": rand(50, 2, 5, 3), "update": rand(51, 2, 2, 3)},
                  op("TensorScatter", "cache", "update", "at", axis=1),
                  consts={"at": ints(1, 3)}, opset=24)


def test_cast_like() -> None:
    check({"x": rand(52, 3, 4)}, op("CastLike", "x", "like"),
          lambda x, like: x.to(torch.float32), consts={"like": np.zeros(1, np.float32)},
          tolerance=(1e-6, 1e-6))


# -- normalization, pooling, resampling ----------------------------------------------------
def test_lrn() -> None:
    check({"x": rand(53, 1, 5, 3, 3)}, op("LRN", "x", size=3, alpha=0.2, beta=0.75, bias=1.5),
          lambda x: F.local_response_norm(x, 3, alpha=0.2, beta=0.75, k=1.5))


def test_lp_normalization() -> None:
    check({"x": rand(54, 3, 4)}, op("LpNormalization", "x", axis=1, p=2),
          lambda x: x / x.norm(dim=1, keepdim=True))


def test_lp_pool() -> None:
    check({"x": rand(55, 1, 2, 5, 5)}, op("LpPool", "x", kernel_shape=[2, 2], p=3),
          lambda x: F.lp_pool2d(x.abs(), 3, 2, stride=1))


def test_mean_variance_normalization() -> None:
    def reference(x: T) -> T:
        mean = x.mean((0, 2, 3), keepdim=True)
        var = (x * x).mean((0, 2, 3), keepdim=True) - mean * mean
        return (x - mean) / (var.sqrt() + 1e-9)
    check({"x": rand(56, 2, 3, 2, 2)}, op("MeanVarianceNormalization", "x"), reference,
          tolerance=(1e-6, 1e-8), opset=13)


def test_rms_normalization() -> None:
    def reference(x: T, scale: T) -> T:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * scale
    check({"x": rand(57, 3, 6), "scale": rand(58, 6)}, op("RMSNormalization", "x", "scale"),
          reference, opset=23)


def test_upsample_nearest() -> None:
    check({"x": rand(59, 1, 2, 2, 3)}, op("Upsample", "x", "scales", mode="nearest"),
          lambda x, scales: F.interpolate(x, scale_factor=2, mode="nearest"),
          consts={"scales": np.array([1, 1, 2, 2], dtype=np.float32)}, opset=9)


def test_grid_sample() -> None:
    grid = uniform(61, -0.9, 0.9, 1, 3, 2, 2)
    check({"x": rand(60, 1, 2, 4, 4), "grid": grid}, op("GridSample", "x", "grid"),
          lambda x, grid: F.grid_sample(x, grid, align_corners=False), opset=16)


def test_affine_grid() -> None:
    check({"theta": rand(62, 2, 2, 3)}, op("AffineGrid", "theta", "size"),
          lambda theta, size: F.affine_grid(theta, [2, 1, 3, 4], align_corners=False),
          consts={"size": ints(2, 1, 3, 4)}, opset=20)


def test_roi_align() -> None:
    rois = np.array([[0.5, 0.5, 3.2, 3.7], [1.0, 0.2, 4.5, 2.9]])
    check_numeric({"x": rand(63, 1, 2, 6, 6)},
                  op("RoiAlign", "x", "rois", "batch", output_height=2, output_width=2,
                     sampling_ratio=2),
                  consts={"rois": rois, "batch": ints(0, 0)}, opset=16)


def test_max_roi_pool() -> None:
    rois = np.array([[0, 0, 0, 3, 3], [0, 1, 1, 4, 5]], dtype=np.float64)
    check_numeric({"x": rand(64, 1, 2, 6, 6)},
                  op("MaxRoiPool", "x", "rois", pooled_shape=[2, 2]), consts={"rois": rois})


def test_max_unpool() -> None:
    idx = ints(0, 3, 6, 10).reshape(1, 1, 2, 2)
    check_numeric({"x": rand(65, 1, 1, 2, 2)},
                  op("MaxUnpool", "x", "idx", kernel_shape=[2, 2], strides=[2, 2]),
                  consts={"idx": idx})


def test_col2im() -> None:
    check({"x": rand(66, 1, 4, 9)}, op("Col2Im", "x", "image", "block"),
          lambda x, image, block: F.fold(x, (4, 4), (2, 2)),
          consts={"image": ints(4, 4), "block": ints(2, 2)})


def test_negative_log_likelihood_loss() -> None:
    target = ints(1, 0, 2)
    check({"x": rand(68, 3, 4)}, op("NegativeLogLikelihoodLoss", "x", "t", reduction="mean"),
          lambda x, t: F.nll_loss(x, t), consts={"t": target})


# -- convolution-like, attention, recurrent, linear algebra, spectral ----------------------
def test_deform_conv() -> None:
    check_numeric({"x": rand(69, 1, 2, 4, 4), "w": rand(70, 2, 2, 2, 2),
                   "offset": rand(71, 1, 8, 3, 3) * 0.3},
                  op("DeformConv", "x", "w", "offset"), opset=19)


def test_attention() -> None:
    def reference(q: T, k: T, v: T) -> T:
        return F.scaled_dot_product_attention(q, k, v)
    check({"q": rand(72, 1, 2, 3, 4), "k": rand(73, 1, 2, 5, 4), "v": rand(74, 1, 2, 5, 4)},
          op("Attention", "q", "k", "v"), reference, opset=23)


def test_rotary_embedding() -> None:
    # RotaryEmbedding is float32-only: the float32 reference, at float32 tolerance.
    def reference(x: T, cos: T, sin: T) -> T:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    f32 = np.float32
    check({"x": rand(75, 1, 2, 4, 4).astype(f32)}, op("RotaryEmbedding", "x", "cos", "sin"),
          reference, consts={"cos": uniform(76, -1, 1, 1, 4, 2).astype(f32),
                             "sin": uniform(77, -1, 1, 1, 4, 2).astype(f32)},
          opset=23, tolerance=(1e-5, 1e-6))


def test_causal_conv_with_state() -> None:
    # float32-only: the float32 reference, at float32 tolerance.
    def reference(x: T, w: T) -> T:
        return F.conv1d(F.pad(x, (w.shape[-1] - 1, 0)), w, groups=x.shape[1])
    f32 = np.float32
    check({"x": rand(78, 1, 3, 5).astype(f32), "w": rand(79, 3, 1, 3).astype(f32)},
          op("CausalConvWithState", "x", "w", outputs=2), reference, opset=27,
          tolerance=(1e-5, 1e-6))


def test_linear_attention() -> None:
    # float32-only. The "linear" rule unrolled: o_t = scale * sum_{s<=t} (q_t . k_s) v_s.
    def reference(q: T, k: T, v: T) -> T:
        b, t, _ = q.shape
        q4, k4, v4 = (a.reshape(b, t, 2, -1).transpose(1, 2) for a in (q, k, v))
        scores = torch.tril(q4 @ k4.transpose(-1, -2)) / q4.shape[-1] ** 0.5
        return (scores @ v4).transpose(1, 2).reshape(b, t, -1)
    f32 = np.float32
    check({"q": rand(80, 1, 3, 8).astype(f32), "k": rand(81, 1, 3, 8).astype(f32),
           "v": rand(82, 1, 3, 8).astype(f32)},
          op("LinearAttention", "q", "k", "v", outputs=2, q_num_heads=2, kv_num_heads=2,
             update_rule="linear"), reference, opset=27, tolerance=(1e-5, 1e-6))


@pytest.mark.parametrize("cell", ["RNN", "GRU", "LSTM"])
def test_recurrent(cell: str) -> None:
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[cell]
    hidden, size = 3, 2
    params = {"x": rand(83, 4, 1, size), "w": rand(84, 1, gates * hidden, size) * 0.5,
              "r": rand(85, 1, gates * hidden, hidden) * 0.5,
              "b": rand(86, 1, 2 * gates * hidden) * 0.5}
    check_numeric(params, op(cell, "x", "w", "r", "b", outputs=2, hidden_size=hidden),
                  opset=14)


def test_det() -> None:
    check({"x": rand(87, 2, 3, 3)}, op("Det", "x"), lambda x: torch.linalg.det(x))


def test_dft() -> None:
    def build(b: GraphBuilder, s: dict[str, Sym]) -> Sym:
        return b.op("DFT", s["x"], None, s["axis"])
    check_numeric({"x": rand(88, 1, 6, 1)}, build,
                  consts={"axis": np.array(1, dtype=np.int64)}, opset=20)


def test_stft() -> None:
    def build(b: GraphBuilder, s: dict[str, Sym]) -> Sym:
        # onesided spelled out: onnx's shape inference takes an absent one as 0.
        return b.op("STFT", s["x"], s["step"], s["window"], onesided=1)
    check_numeric({"x": rand(89, 1, 10, 1)}, build,
                  consts={"step": np.array(2, dtype=np.int64),
                          "window": np.hanning(4)}, opset=17)


def test_recomputed_forward_keeps_the_forward_output() -> None:
    # The backward reruns Tan; the forward's own output (a graph output here) must
    # still hold the first forward's values after the step.
    x = uniform(90, -1, 1, 3, 4)
    b = GraphBuilder("case", opset=18)
    y = b.op("Tan", b.param("x", x))
    b.output(b.op("ReduceSum", y, keepdims=0), "loss")
    b.output(y, "y")
    import segflow
    sess = segflow.TrainingSession(b.to_model(), loss="loss", engine="inline")
    result = sess.step({}, update=False)
    np.testing.assert_allclose(np.asarray(result.outputs["y"]), np.tan(x), rtol=1e-12)
    torch.testing.assert_close(sess.gradients()["x"], torch.from_numpy(1 / np.cos(x) ** 2))
