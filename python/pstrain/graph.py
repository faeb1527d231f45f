"""Static analysis of a ModelSpec: validation, shape inference, parameters, summary.

The Python twin of common/model_graph.cc (BuildModelGraph and
FormatModelSummary): the same checks in the same order with the same
messages, so that a model refused here is refused by the server with this
very message, and `Model.summary()` prints the table `pstrain summary`
prints. tests/python/test_model.py checks both against the C++ binary; a
change to one side must be made to the other.

    graph = analyse(spec)            # raises InvalidModelError
    print(format_summary(graph))
"""

import math
import re
from dataclasses import dataclass, field
from typing import List, Tuple

from pstrain.errors import InvalidModelError

# common/model_graph.h: kMaxGraphElements.
MAX_GRAPH_ELEMENTS = 1 << 40

# The LayerSpec `kind` oneof field -> the type name printed in summaries and
# messages (LayerTypeName in common/model_graph.cc).
LAYER_TYPES = ("conv2d", "max_pool", "avg_pool", "dense", "relu", "leaky_relu", "tanh",
               "sigmoid", "dropout", "batch_norm", "flatten", "add", "softmax_cross_entropy")

_VALID_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


@dataclass
class ParamInfo:
    name: str                 # "<layer>/<role>", e.g. "conv1/weight".
    shape: Tuple[int, ...]
    trainable: bool = True    # Running statistics are not trained.


@dataclass
class LayerInfo:
    name: str
    type: str                        # One of LAYER_TYPES.
    spec: object                     # The v1.LayerSpec.
    inputs: List[int]                # Producer layer indices; -1 is the model input.
    input_shapes: List[Tuple[int, ...]]
    output_shape: Tuple[int, ...] = ()  # () for the loss.
    params: List[ParamInfo] = field(default_factory=list)
    param_count: int = 0
    consumers: List[int] = field(default_factory=list)


@dataclass
class ModelGraph:
    name: str
    input_shape: Tuple[int, ...]
    num_classes: int
    layers: List[LayerInfo] = field(default_factory=list)
    trainable_params: int = 0
    non_trainable_params: int = 0

    @property
    def params(self) -> List[ParamInfo]:
        return [p for layer in self.layers for p in layer.params]


def shape_str(shape):
    """Shape::ToString: "[64, 1, 28, 28]"."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _num(value):
    """A float as absl::StrCat prints one (six significant digits)."""
    return "%.6g" % value


def _elements(shape):
    return math.prod(shape)


class _LayerError:
    """Builds "layer 'conv1' (conv2d): <message>" errors."""

    def __init__(self, name, layer_type):
        self.prefix = f"layer '{name}' ({layer_type}): "

    def __call__(self, *parts):
        return InvalidModelError(self.prefix + "".join(str(p) for p in parts))


def _check_tensor_size(error, what, shape):
    if _elements(shape) > MAX_GRAPH_ELEMENTS:
        raise error(what, " ", shape_str(shape), " has more than ", MAX_GRAPH_ELEMENTS,
                    " elements")


def _window_output(size, window, stride, pad):
    span = size + 2 * pad - window
    if span < 0:
        return -1
    return span // stride + 1


def _add_param(graph, layer, role, shape, trainable=True):
    layer.params.append(ParamInfo(f"{layer.name}/{role}", tuple(shape), trainable))
    count = _elements(shape)
    layer.param_count += count
    if trainable:
        graph.trainable_params += count
    else:
        graph.non_trainable_params += count


def _analyse_layer(graph, index):
    """Output shape and parameters of graph.layers[index] (AnalyseLayer)."""
    layer = graph.layers[index]
    spec = layer.spec
    error = _LayerError(layer.name, layer.type)
    shape_in = layer.input_shapes[0]
    if layer.type != "add" and len(layer.inputs) != 1:
        raise error("takes exactly one input, got ", len(layer.inputs))
    t = layer.type
    if t == "conv2d":
        c = spec.conv2d
        if len(shape_in) != 3:
            raise error("needs a [C, H, W] input, got ", shape_str(shape_in))
        kh = c.kernel_h if c.kernel_h > 0 else c.kernel_size
        kw = c.kernel_w if c.kernel_w > 0 else c.kernel_size
        stride = 1 if c.stride == 0 else c.stride
        if c.filters <= 0:
            raise error("filters must be > 0, got ", c.filters)
        if kh <= 0 or kw <= 0:
            raise error("kernel_size must be > 0, got ", kh, "x", kw)
        if c.kernel_h < 0 or c.kernel_w < 0:
            raise error("kernel_h/kernel_w must be >= 0")
        if stride < 0:
            raise error("stride must be >= 1, got ", c.stride)
        if c.padding < 0:
            raise error("padding must be >= 0, got ", c.padding)
        oh = _window_output(shape_in[1], kh, stride, c.padding)
        ow = _window_output(shape_in[2], kw, stride, c.padding)
        if oh <= 0 or ow <= 0:
            raise error("kernel ", kh, "x", kw, " with padding ", c.padding,
                        " does not fit input ", shape_str(shape_in))
        layer.output_shape = (c.filters, oh, ow)
        weight = (c.filters, shape_in[0], kh, kw)
        _check_tensor_size(error, "weight", weight)
        _add_param(graph, layer, "weight", weight)
        if not c.no_bias:
            _add_param(graph, layer, "bias", (c.filters,))
    elif t in ("max_pool", "avg_pool"):
        p = spec.max_pool if t == "max_pool" else spec.avg_pool
        if len(shape_in) != 3:
            raise error("needs a [C, H, W] input, got ", shape_str(shape_in))
        if p.pool_size <= 0:
            raise error("pool_size must be > 0, got ", p.pool_size)
        stride = p.pool_size if p.stride == 0 else p.stride
        if stride < 0:
            raise error("stride must be >= 1, got ", p.stride)
        if p.padding < 0 or p.padding >= p.pool_size:
            raise error("padding must be in [0, pool_size), got ", p.padding)
        oh = _window_output(shape_in[1], p.pool_size, stride, p.padding)
        ow = _window_output(shape_in[2], p.pool_size, stride, p.padding)
        if oh <= 0 or ow <= 0:
            raise error("window ", p.pool_size, " does not fit input ", shape_str(shape_in))
        layer.output_shape = (shape_in[0], oh, ow)
    elif t == "dense":
        d = spec.dense
        if d.units <= 0:
            raise error("units must be > 0, got ", d.units)
        features = _elements(shape_in)
        layer.output_shape = (d.units,)
        _check_tensor_size(error, "weight", (d.units, features))
        _add_param(graph, layer, "weight", (d.units, features))
        if not d.no_bias:
            _add_param(graph, layer, "bias", (d.units,))
    elif t == "leaky_relu":
        alpha = spec.leaky_relu.alpha
        if alpha < 0 or not math.isfinite(alpha):
            raise error("alpha must be finite and >= 0, got ", _num(alpha))
        layer.output_shape = shape_in
    elif t in ("relu", "tanh", "sigmoid"):
        layer.output_shape = shape_in
    elif t == "dropout":
        rate = spec.dropout.rate
        if not (0.0 <= rate < 1.0):
            raise error("rate must be in [0, 1), got ", _num(rate))
        layer.output_shape = shape_in
    elif t == "batch_norm":
        b = spec.batch_norm
        if len(shape_in) not in (1, 3):
            raise error("needs a [C, H, W] or [F] input, got ", shape_str(shape_in))
        if b.momentum < 0 or b.momentum >= 1:
            raise error("momentum must be in (0, 1) (0 means 0.1), got ", _num(b.momentum))
        if b.epsilon < 0:
            raise error("epsilon must be > 0 (0 means 1e-5), got ", _num(b.epsilon))
        layer.output_shape = shape_in
        channels = (shape_in[0],)
        _add_param(graph, layer, "gamma", channels)
        _add_param(graph, layer, "beta", channels)
        _add_param(graph, layer, "running_mean", channels, trainable=False)
        _add_param(graph, layer, "running_var", channels, trainable=False)
    elif t == "flatten":
        layer.output_shape = (_elements(shape_in),)
    elif t == "add":
        if len(layer.inputs) < 2:
            raise error("needs at least two inputs, got ", len(layer.inputs))
        for i in range(1, len(layer.input_shapes)):
            if layer.input_shapes[i] != shape_in:
                raise error("input '", spec.inputs[i], "' has shape ",
                            shape_str(layer.input_shapes[i]), " but input '", spec.inputs[0],
                            "' has shape ", shape_str(shape_in))
        layer.output_shape = shape_in
    elif t == "softmax_cross_entropy":
        if len(shape_in) != 1 or shape_in[0] != graph.num_classes:
            producer = "input" if layer.inputs[0] < 0 else graph.layers[layer.inputs[0]].name
            raise error("input '", producer, "' has shape ", shape_str(shape_in),
                        " but num_classes is ", graph.num_classes, " (expected [",
                        graph.num_classes, "])")
        layer.output_shape = ()
    else:  # pragma: no cover - LAYER_TYPES is exhaustive
        raise error("unknown layer type")


def analyse(spec) -> ModelGraph:
    """Validates a v1.ModelSpec and infers every shape (BuildModelGraph).

    Raises InvalidModelError with the message the server gives for it.
    """
    if len(spec.input_shape) not in (1, 3):
        raise InvalidModelError(
            f"model.input_shape must be [C, H, W] or [F], got {len(spec.input_shape)} dims")
    for d in spec.input_shape:
        if d <= 0:
            raise InvalidModelError(f"model.input_shape entries must be > 0, got {d}")
    input_shape = tuple(spec.input_shape)
    if _elements(input_shape) > MAX_GRAPH_ELEMENTS:
        raise InvalidModelError(f"model.input_shape {shape_str(input_shape)} has more than "
                                f"{MAX_GRAPH_ELEMENTS} elements")
    if spec.num_classes < 2:
        raise InvalidModelError(f"model.num_classes must be >= 2, got {spec.num_classes}")
    if len(spec.layers) == 0:
        raise InvalidModelError("model has no layers")
    graph = ModelGraph(spec.name, input_shape, spec.num_classes)
    index_of = {}
    loss_layer = logits_layer = -1
    for i, layer_spec in enumerate(spec.layers):
        name = layer_spec.name
        if not _VALID_NAME.fullmatch(name):
            raise InvalidModelError(f"layer #{i} has invalid name '{name}' (1-128 characters of "
                                    "[A-Za-z0-9_.-])")
        if name == "input":
            raise InvalidModelError("layer name 'input' is reserved for the model input")
        if name in index_of:
            raise InvalidModelError(f"duplicate layer name '{name}'")
        layer_type = layer_spec.WhichOneof("kind")
        if layer_type is None:
            raise InvalidModelError(
                f"layer '{name}': no layer type set (expected one of conv2d, max_pool, "
                "avg_pool, dense, relu, leaky_relu, tanh, sigmoid, dropout, batch_norm, "
                "flatten, add, softmax_cross_entropy)")
        error = _LayerError(name, layer_type)
        inputs = []
        if len(layer_spec.inputs) == 0:
            inputs.append(i - 1)  # -1 for the first layer: the model input.
        else:
            for source in layer_spec.inputs:
                if source == "input":
                    inputs.append(-1)
                elif source in index_of:
                    inputs.append(index_of[source])
                else:
                    raise error("input '", source, "' is not an earlier layer (layers must be "
                                "listed in order; use 'input' for the model input)")
        input_shapes = []
        for producer in inputs:
            if inputs.count(producer) > 2:
                raise error("reads input '",
                            "input" if producer < 0 else graph.layers[producer].name,
                            "' more than twice (add it in two steps)")
            if producer >= 0 and graph.layers[producer].type == "softmax_cross_entropy":
                raise error("cannot read the output of the loss layer")
            input_shapes.append(input_shape if producer < 0
                                else graph.layers[producer].output_shape)
        index_of[name] = i
        graph.layers.append(LayerInfo(name, layer_type, layer_spec, inputs, input_shapes))
        _analyse_layer(graph, i)
        _check_tensor_size(error, "output shape", graph.layers[i].output_shape)
        if graph.trainable_params + graph.non_trainable_params > MAX_GRAPH_ELEMENTS:
            raise error("the model has more than ", MAX_GRAPH_ELEMENTS, " parameters")
        for producer in inputs:
            if producer >= 0:
                graph.layers[producer].consumers.append(i)
        if layer_type == "softmax_cross_entropy":
            if loss_layer >= 0:
                raise error("a model has exactly one loss layer")
            loss_layer = i
            logits_layer = inputs[0]
    if loss_layer != len(graph.layers) - 1:
        raise InvalidModelError(
            "the last layer must be softmax_cross_entropy (the loss), and only the last")
    if logits_layer < 0:
        raise InvalidModelError("softmax_cross_entropy cannot read the model input directly")
    for layer in graph.layers[:-1]:
        if not layer.consumers:
            raise InvalidModelError(f"layer '{layer.name}' ({layer.type}): its output is never "
                                    "used; every layer must lead to the loss")
    return graph


def format_summary(graph: ModelGraph) -> str:
    """The Keras-style table of `pstrain summary` (FormatModelSummary)."""
    rows = [("input (input)", "(None, " + ", ".join(map(str, graph.input_shape)) + ")", "0", "")]
    for layer in graph.layers:
        shape = ("()" if len(layer.output_shape) == 0
                 else "(None, " + ", ".join(map(str, layer.output_shape)) + ")")
        inputs = ", ".join("input" if i < 0 else graph.layers[i].name for i in layer.inputs)
        rows.append((f"{layer.name} ({layer.type})", shape, str(layer.param_count), inputs))
    w0, w1, w2 = 18, 18, 10
    for r in rows:
        w0 = max(w0, len(r[0]) + 2)
        w1 = max(w1, len(r[1]) + 2)
        w2 = max(w2, len(r[2]) + 2)

    def line(c):
        return c * (w0 + w1 + w2 + 20) + "\n"

    def row(a, b, c, d):
        return f"{a:<{w0}}{b:<{w1}}{c:<{w2}}{d}\n"

    out = f'Model: "{graph.name}"\n' + line("_")
    out += row("Layer (type)", "Output Shape", "Param #", "Inputs") + line("=")
    for i, r in enumerate(rows):
        out += row(*r) + line("=" if i + 1 == len(rows) else "_")
    out += f"Total params: {graph.trainable_params + graph.non_trainable_params}\n"
    out += f"Trainable params: {graph.trainable_params}\n"
    out += f"Non-trainable params: {graph.non_trainable_params}\n"
    return out


def param_shapes(graph: ModelGraph) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of every parameter in the order the worker keeps them."""
    return [(p.name, p.shape) for p in graph.params]

