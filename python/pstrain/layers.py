"""Keras-style layers that build a pstrain.v1.ModelSpec.

Each layer is one node of the model (one LayerSpec; two when it has an
`activation`, which becomes its own relu/tanh/sigmoid/leaky_relu layer).
Layers hold no weights: the parameter servers do. A layer instance is
called once; pstrain models do not share weights between nodes.

    x = pstrain.Input(shape=(3, 32, 32))
    y = layers.Conv2D(16, 3, padding="same", activation="relu")(x)
    z = layers.Conv2D(16, 3, padding="same")(y)
    out = layers.ReLU()(layers.Add()([z, y]))

Recipe for one more layer type: add the message to proto/pstrain/v1/job.proto
and the C++ side first (common/model_graph.cc, worker/layers), then a
subclass here with `kind` (the LayerSpec oneof field) and `_fields()`, and
its checks in pstrain/graph.py.
"""

import itertools

_sequence = itertools.count()

ACTIVATIONS = ("relu", "tanh", "sigmoid", "leaky_relu")


class Node:
    """One LayerSpec to be: its kind, the fields of its message, its inputs
    (Nodes or the InputNode) and the name the user gave (None: named by the
    model). Nodes are numbered in creation order, which is a topological
    order (a node is made after its inputs)."""

    def __init__(self, kind, fields, inputs, name):
        self.kind = kind
        self.fields = fields
        self.inputs = inputs
        self.name = name
        self.sequence = next(_sequence)


class InputNode:
    """The model input ("input" in a spec)."""

    def __init__(self, shape):
        self.shape = tuple(int(d) for d in shape)
        self.sequence = next(_sequence)


class Tensor:
    """The symbolic output of a layer (or of Input): what layers are called on."""

    def __init__(self, node):
        self.node = node

    def __repr__(self):
        if isinstance(self.node, InputNode):
            return f"<pstrain.Tensor input shape={self.node.shape}>"
        return f"<pstrain.Tensor of {self.node.kind} {self.node.name or '(unnamed)'}>"


def Input(shape):
    """The model input: per-sample shape (C, H, W) for images or (F,) for features."""
    return Tensor(InputNode(shape))


def _pair(value, what):
    """(h, w) from an int or a pair of ints."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{what} must be an int or a pair, got {value!r}")
        return int(value[0]), int(value[1])
    return int(value), int(value)


def _padding(padding, kernel_h, kernel_w, what):
    """Pixels of zero padding on every side for "valid", "same" or an int."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0
        if padding == "same":
            if kernel_h != kernel_w or kernel_h % 2 == 0:
                raise ValueError(f"{what}: padding='same' needs a square kernel of odd size "
                                 f"(the padding is the same on every side), got "
                                 f"{kernel_h}x{kernel_w}; give the padding in pixels")
            return (kernel_h - 1) // 2
        raise ValueError(f"{what}: padding must be 'valid', 'same' or pixels, got {padding!r}")
    return int(padding)


class Layer:
    """Base of every layer. `kind` is the LayerSpec oneof field it fills."""

    kind = None

    def __init__(self, name=None, activation=None):
        if activation in (None, "linear"):
            activation = None
        elif activation == "softmax":
            raise ValueError("activation='softmax': the model's loss layer (softmax cross-"
                             "entropy) applies the softmax; leave the last layer linear")
        elif activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)} or None, "
                             f"got {activation!r}")
        self.name = name
        self.activation = activation
        self._called = False

    def _fields(self):
        """The fields of this layer's message (e.g. {"filters": 32})."""
        return {}

    def __call__(self, inputs):
        if self._called:
            raise ValueError(f"{self!r} was already called: a pstrain layer is one node of the "
                             "model (no weight sharing); make another instance")
        tensors = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"{type(self).__name__} takes pstrain tensors (from "
                                f"pstrain.Input or another layer), got {type(t).__name__}")
        if self.kind != "add" and len(tensors) != 1:
            raise ValueError(f"{type(self).__name__} takes one input, got {len(tensors)}")
        self._called = True
        node = Node(self.kind, self._fields(), [t.node for t in tensors], self.name)
        if self.activation:
            name = f"{self.name}_{self.activation}" if self.name else None
            node = Node(self.activation, {}, [node], name)
        return Tensor(node)

    def __repr__(self):
        return f"<pstrain.layers.{type(self).__name__} {self.name or '(unnamed)'}>"


class Conv2D(Layer):
    """2-D convolution over NCHW input (conv2d). `padding`: "valid" (0),
    "same" (odd square kernels) or pixels on every side."""

    kind = "conv2d"

    def __init__(self, filters, kernel_size, strides=1, padding="valid", activation=None,
                 use_bias=True, name=None):
        super().__init__(name, activation)
        self.filters = int(filters)
        self.kernel_h, self.kernel_w = _pair(kernel_size, "kernel_size")
        stride_h, stride_w = _pair(strides, "strides")
        if stride_h != stride_w:
            raise ValueError(f"strides must be the same in both directions, got {strides!r}")
        self.strides = stride_h
        self.padding = _padding(padding, self.kernel_h, self.kernel_w, "Conv2D")
        self.use_bias = bool(use_bias)

    def _fields(self):
        # stride 1 is the spec's default (0), written as the zoo's files write it.
        fields = {"filters": self.filters, "stride": 0 if self.strides == 1 else self.strides,
                  "padding": self.padding, "no_bias": not self.use_bias}
        if self.kernel_h == self.kernel_w:
            fields["kernel_size"] = self.kernel_h
        else:
            fields.update(kernel_h=self.kernel_h, kernel_w=self.kernel_w)
        return fields


class _Pool2D(Layer):
    def __init__(self, pool_size=2, strides=None, padding="valid", name=None):
        super().__init__(name)
        self.pool_size = int(pool_size)
        self.strides = 0 if strides is None else int(strides)
        self.padding = _padding(padding, self.pool_size, self.pool_size, type(self).__name__)

    def _fields(self):
        return {"pool_size": self.pool_size, "stride": self.strides, "padding": self.padding}


class MaxPool2D(_Pool2D):
    """Max pooling (max_pool); `strides` defaults to pool_size."""

    kind = "max_pool"


class AveragePooling2D(_Pool2D):
    """Average pooling (avg_pool); `strides` defaults to pool_size."""

    kind = "avg_pool"


MaxPooling2D = MaxPool2D
AvgPool2D = AveragePooling2D


class Dense(Layer):
    """Fully connected (dense); any input shape is read as features."""

    kind = "dense"

    def __init__(self, units, activation=None, use_bias=True, name=None):
        super().__init__(name, activation)
        self.units = int(units)
        self.use_bias = bool(use_bias)

    def _fields(self):
        return {"units": self.units, "no_bias": not self.use_bias}


class ReLU(Layer):
    kind = "relu"


class Tanh(Layer):
    kind = "tanh"


class Sigmoid(Layer):
    kind = "sigmoid"


class LeakyReLU(Layer):
    """alpha: the slope below 0 (the spec's 0 means 0.01)."""

    kind = "leaky_relu"

    def __init__(self, alpha=0.01, name=None):
        super().__init__(name)
        self.alpha = float(alpha)

    def _fields(self):
        return {"alpha": self.alpha}


def Activation(activation, name=None):
    """The activation layer named by `activation` ("relu", "tanh", "sigmoid", "leaky_relu")."""
    classes = {"relu": ReLU, "tanh": Tanh, "sigmoid": Sigmoid, "leaky_relu": LeakyReLU}
    if activation not in classes:
        raise ValueError(f"activation must be one of {', '.join(classes)}, got {activation!r}")
    return classes[activation](name=name)


class Dropout(Layer):
    """Inverted dropout with probability `rate` during training."""

    kind = "dropout"

    def __init__(self, rate, name=None):
        super().__init__(name)
        self.rate = float(rate)

    def _fields(self):
        return {"rate": self.rate}


class BatchNormalization(Layer):
    """Batch normalisation over the channels. `momentum` is the running-average
    factor of the spec (PyTorch's convention: 0.1 means new = 0.9 old + 0.1
    batch; None = 0.1), not Keras's."""

    kind = "batch_norm"

    def __init__(self, momentum=None, epsilon=None, name=None):
        super().__init__(name)
        self.momentum = 0.0 if momentum is None else float(momentum)
        self.epsilon = 0.0 if epsilon is None else float(epsilon)

    def _fields(self):
        return {"momentum": self.momentum, "epsilon": self.epsilon}


BatchNorm = BatchNormalization


class Flatten(Layer):
    kind = "flatten"


class Add(Layer):
    """Element-wise sum of two or more inputs of the same shape (residuals)."""

    kind = "add"


class SoftmaxCrossEntropy(Layer):
    """The loss. Models add it after their output themselves; give it only to
    name it or to place it explicitly."""

    kind = "softmax_cross_entropy"
