"""ONNX export of a checkpoint's model: the Python twin of client/onnx_export.cc.

    ckpt = pstrain.load_checkpoint("model.ckpt")
    ckpt.export_onnx("model.onnx")          # or: pstrain export model.ckpt -o model.onnx

The same graph as `pstrain export` (opset 13, IR version 7): input "input"
[batch, C, H, W] normalised as in training ((pixel / 255 - mean) / std, the
job's dataset mean and std, in metadata_props), outputs "logits" and
"probabilities". Dropout is left out; batch norm uses the running statistics;
average pooling excludes the padding from its divisor, as pstrain does.
tests/tools/onnx_export_test.py runs both exports through onnxruntime against
`pstrain-worker --evaluate --logits-out`; a change to one side must be made to
the other.

Needs the `onnx` package: the package's `onnx` extra (`pip install
'pstrain[onnx]'`) or Debian's python3-onnx.
"""

from pstrain.graph import analyse

OPSET = 13
IR_VERSION = 7
_RESERVED = ("input", "logits", "probabilities")


def _float_list(values):
    # The C++ side prints floats with absl::StrJoin (shortest form, %g-like).
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


def export_onnx_model(checkpoint):
    """Returns the onnx.ModelProto of `checkpoint` (a pstrain.Checkpoint)."""
    import numpy as np
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("ONNX export needs the onnx package: pip install 'pstrain[onnx]' "
                          "(or Debian's python3-onnx)") from e

    graph = analyse(checkpoint.spec.model)
    nodes, initializers = [], []
    for p in graph.params:
        if p.name not in checkpoint.weights:
            raise ValueError(f"the checkpoint has no tensor {p.name}")
        values = np.asarray(checkpoint.weights[p.name], dtype=np.float32)
        expected = int(np.prod(p.shape)) if p.shape else 1
        if values.size != expected:
            raise ValueError(f"the checkpoint's {p.name} has {values.size} values; the model's "
                             f"{list(p.shape)} needs {expected}")
        initializers.append(numpy_helper.from_array(values.reshape(p.shape), p.name))

    out = [None] * len(graph.layers)
    logits_layer = None

    def input_of(layer, k):
        producer = layer.inputs[k]
        return "input" if producer < 0 else out[producer]

    def param(layer, role):
        for p in layer.params:
            if p.name.endswith("/" + role):
                return p.name
        return None

    for i, layer in enumerate(graph.layers):
        name, kind, spec = layer.name, layer.type, layer.spec
        if kind == "softmax_cross_entropy":
            logits_layer = layer.inputs[0]
            continue
        x = input_of(layer, 0)
        y = out[i] = f"{name}/out" if name in _RESERVED else name
        if kind == "conv2d":
            c = spec.conv2d
            weight = next(p for p in layer.params if p.name.endswith("/weight"))
            inputs = [x, weight.name] + ([f"{name}/bias"] if param(layer, "bias") else [])
            stride = c.stride or 1
            nodes.append(helper.make_node(
                "Conv", inputs, [y], name=name, kernel_shape=list(weight.shape[2:]),
                strides=[stride, stride], pads=[c.padding] * 4))
        elif kind in ("max_pool", "avg_pool"):
            p = spec.max_pool if kind == "max_pool" else spec.avg_pool
            stride = p.stride or p.pool_size
            attrs = dict(kernel_shape=[p.pool_size] * 2, strides=[stride, stride],
                         pads=[p.padding] * 4)
            if kind == "avg_pool":
                attrs["count_include_pad"] = 0
            nodes.append(helper.make_node("MaxPool" if kind == "max_pool" else "AveragePool",
                                          [x], [y], name=name, **attrs))
        elif kind == "dense":
            a = x
            if len(layer.input_shapes[0]) != 1:  # Read as [N, features].
                a = f"{name}/flatten"
                nodes.append(helper.make_node("Flatten", [x], [a], name=a, axis=1))
            inputs = [a, param(layer, "weight")]
            if param(layer, "bias"):
                inputs.append(param(layer, "bias"))
            nodes.append(helper.make_node("Gemm", inputs, [y], name=name, transB=1))
        elif kind == "relu":
            nodes.append(helper.make_node("Relu", [x], [y], name=name))
        elif kind == "leaky_relu":
            nodes.append(helper.make_node("LeakyRelu", [x], [y], name=name,
                                          alpha=spec.leaky_relu.alpha or 0.01))
        elif kind == "tanh":
            nodes.append(helper.make_node("Tanh", [x], [y], name=name))
        elif kind == "sigmoid":
            nodes.append(helper.make_node("Sigmoid", [x], [y], name=name))
        elif kind == "dropout":
            out[i] = x  # The identity at inference.
        elif kind == "batch_norm":
            nodes.append(helper.make_node(
                "BatchNormalization",
                [x] + [param(layer, r) for r in ("gamma", "beta", "running_mean", "running_var")],
                [y], name=name, epsilon=spec.batch_norm.epsilon or 1e-5))
        elif kind == "flatten":
            nodes.append(helper.make_node("Flatten", [x], [y], name=name, axis=1))
        elif kind == "add":
            inputs = [input_of(layer, k) for k in range(len(layer.inputs))]
            nodes.append(helper.make_node("Add" if len(inputs) == 2 else "Sum", inputs, [y],
                                          name=name))
        else:  # pragma: no cover - analyse() knows no other kinds
            raise ValueError(f"layer '{name}': cannot export a {kind} layer")
    if logits_layer is None:
        raise ValueError("the model has no softmax_cross_entropy layer: no logits")
    nodes.append(helper.make_node("Identity", [out[logits_layer]], ["logits"],
                                  name="output/logits"))
    nodes.append(helper.make_node("Softmax", ["logits"], ["probabilities"],
                                  name="output/probabilities", axis=1))

    def value_info(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch"] + list(shape))

    g = helper.make_graph(nodes, graph.name or "pstrain",
                          [value_info("input", graph.input_shape)],
                          [value_info("logits", [graph.num_classes]),
                           value_info("probabilities", [graph.num_classes])],
                          initializer=initializers)
    model = helper.make_model(g, producer_name="pstrain",
                              opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    model.model_version = checkpoint.step
    data = checkpoint.spec.dataset
    model.doc_string = (
        f"pstrain model '{graph.name}' after {checkpoint.step} steps ({checkpoint.epoch} "
        f"epochs). Input: float [batch, {', '.join(map(str, graph.input_shape))}], each pixel "
        f"scaled to [0, 1] then normalised per channel as (x - mean) / std with mean "
        f"{_float_list(data.mean)} and std {_float_list(data.std)} (empty: 0 and 1). Outputs: "
        f"logits [batch, {graph.num_classes}] and their softmax, probabilities.")
    helper.set_model_props(model, {
        "pstrain.mean": _float_list(data.mean), "pstrain.std": _float_list(data.std),
        "pstrain.step": str(checkpoint.step), "pstrain.epoch": str(checkpoint.epoch),
        "pstrain.job": checkpoint.spec.name})
    onnx.checker.check_model(model)
    return model


def export_onnx(checkpoint, path):
    """Writes `checkpoint`'s model to `path` as ONNX; returns the onnx.ModelProto."""
    import os
    import tempfile
    model = export_onnx_model(checkpoint)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".tmp.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return model
