"""Models: a validated pstrain.v1.ModelSpec with Keras-style construction.

    model = pstrain.Sequential([
        layers.Conv2D(32, 5, padding="same", activation="relu"), layers.MaxPool2D(2),
        layers.Flatten(), layers.Dense(10)], input_shape=(1, 28, 28))
    model.summary()                       # the table `pstrain summary` prints
    spec = model.to_spec()                # a pstrain.v1.ModelSpec
    same = pstrain.Model.from_spec(spec)  # to_spec() == spec

    x = pstrain.Input(shape=(3, 32, 32))                    # functional form
    y = layers.Conv2D(16, 3, padding="same", activation="relu")(x)
    z = layers.ReLU()(layers.Add()([layers.Conv2D(16, 3, padding="same")(y), y]))
    model = pstrain.Model(x, layers.Dense(10)(z), name="tiny-resnet")

A model ends in the softmax cross-entropy loss: when the output is not
already a SoftmaxCrossEntropy layer, one named "loss" is added after it, and
num_classes is the units of that last Dense layer. Every model is checked
when it is made (pstrain/graph.py, the twin of the server's check): an
invalid one raises InvalidModelError with the message the server would give.
"""

import json
import os

from google.protobuf import json_format

from pstrain import graph as graph_lib
from pstrain import layers as layers_lib
from pstrain._proto import job_pb2
from pstrain.errors import InvalidModelError

# Auto-naming: the prefix of each kind; names are prefix + 1, 2, ...
_PREFIX = {"conv2d": "conv", "max_pool": "pool", "avg_pool": "pool", "dense": "fc",
           "relu": "relu", "leaky_relu": "leaky_relu", "tanh": "tanh", "sigmoid": "sigmoid",
           "dropout": "dropout", "batch_norm": "bn", "flatten": "flatten", "add": "add"}


class Model:
    """A model: input shape, layers in topological order, the loss last.

    Build one from an Input tensor and an output tensor (functional form),
    with Sequential, or from a spec (from_spec, from_json, from_file).
    Immutable once made.
    """

    def __init__(self, inputs, outputs, name="functional", num_classes=None, init_seed=0):
        if not isinstance(inputs, layers_lib.Tensor) or not isinstance(
                inputs.node, layers_lib.InputNode):
            raise TypeError("Model(inputs, outputs): inputs must be the tensor of pstrain.Input")
        if not isinstance(outputs, layers_lib.Tensor) or isinstance(
                outputs.node, layers_lib.InputNode):
            raise TypeError("Model(inputs, outputs): outputs must be a layer's output tensor")
        spec = _spec_from_graph(inputs.node, outputs.node, name, num_classes, init_seed)
        self._set_spec(spec)

    def _set_spec(self, spec):
        try:
            self._graph = graph_lib.analyse(spec)
        except InvalidModelError as error:
            error.spec = spec  # What was refused, e.g. to print it as JSON.
            raise
        self._spec = spec

    # --- From and to specs ---------------------------------------------------

    @classmethod
    def from_spec(cls, spec):
        """A model from a pstrain.v1.ModelSpec, or its protobuf JSON mapping (a
        dict or a JSON string). Raises InvalidModelError for an invalid one."""
        if isinstance(spec, job_pb2.ModelSpec):
            message = job_pb2.ModelSpec()
            message.CopyFrom(spec)
        elif isinstance(spec, (dict, str)):
            text = spec if isinstance(spec, str) else json.dumps(spec)
            message = json_format.Parse(text, job_pb2.ModelSpec())
        else:
            raise TypeError(f"from_spec takes a pstrain.v1.ModelSpec, a dict or JSON text, got "
                            f"{type(spec).__name__}")
        model = cls.__new__(Model)
        model._set_spec(message)
        return model

    @classmethod
    def from_json(cls, text):
        """A model from ModelSpec JSON text (as in examples/models/)."""
        return cls.from_spec(json_format.Parse(text, job_pb2.ModelSpec()))

    @classmethod
    def from_file(cls, path):
        """The model of a job file (model or model_file, resolved like the CLI)
        or of a bare model file (examples/models/*.json)."""
        with open(path) as f:
            text = f.read()
        top = json.loads(text)
        if isinstance(top, dict) and ({"model", "model_file", "modelFile"} & top.keys()):
            job = json_format.Parse(text, job_pb2.JobSpec())
            if job.model_file:
                model_path = job.model_file
                if not os.path.isabs(model_path):
                    model_path = os.path.join(os.path.dirname(path), model_path)
                return cls.from_file(model_path)
            return cls.from_spec(job.model)
        return cls.from_json(text)

    def to_spec(self):
        """A copy of the model's pstrain.v1.ModelSpec."""
        spec = job_pb2.ModelSpec()
        spec.CopyFrom(self._spec)
        return spec

    def to_json(self):
        """The ModelSpec in the protobuf JSON mapping (field names as in job files)."""
        return json_format.MessageToJson(self._spec, preserving_proto_field_name=True)

    # --- What it is ----------------------------------------------------------

    @property
    def name(self):
        return self._spec.name

    @property
    def input_shape(self):
        return tuple(self._spec.input_shape)

    @property
    def num_classes(self):
        return self._spec.num_classes

    @property
    def layers(self):
        """The analysed layers (graph.LayerInfo: name, type, output_shape, params...)."""
        return list(self._graph.layers)

    @property
    def parameters(self):
        """[(name, shape)] of every parameter, running statistics included."""
        return graph_lib.param_shapes(self._graph)

    def count_params(self):
        return self._graph.trainable_params + self._graph.non_trainable_params

    def summary_text(self):
        """The table `pstrain summary` prints for this model."""
        return graph_lib.format_summary(self._graph)

    def summary(self, print_fn=print):
        """Prints the summary table (print_fn gets the whole table once)."""
        print_fn(self.summary_text().rstrip("\n"))

    def __eq__(self, other):
        return isinstance(other, Model) and self._spec == other._spec

    def __repr__(self):
        return (f"<pstrain.Model {self.name!r}: {len(self._spec.layers)} layers, "
                f"{self.count_params()} parameters>")


class Sequential(Model):
    """A stack of layers, each reading the previous one's output.

        model = pstrain.Sequential([layers.Dense(64, activation="relu"), layers.Dense(10)],
                                   input_shape=(784,))
    """

    def __init__(self, layers, input_shape, name="sequential", num_classes=None, init_seed=0):
        if not layers:
            raise ValueError("Sequential needs at least one layer")
        x = inputs = layers_lib.Input(input_shape)
        for layer in layers:
            if not isinstance(layer, layers_lib.Layer):
                raise TypeError(f"Sequential takes pstrain layers, got {type(layer).__name__}")
            x = layer(x)
        super().__init__(inputs, x, name=name, num_classes=num_classes, init_seed=init_seed)


def _reachable(output):
    """Every Node the output depends on (and the InputNodes), in creation order."""
    seen, stack = {}, [output]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(getattr(node, "inputs", []))
    return sorted(seen.values(), key=lambda n: n.sequence)


def _spec_from_graph(input_node, output_node, name, num_classes, init_seed):
    nodes = _reachable(output_node)
    inputs = [n for n in nodes if isinstance(n, layers_lib.InputNode)]
    if inputs != [input_node]:
        raise ValueError("the model's output does not depend on its input alone: every layer "
                         "must lead back to the pstrain.Input given as `inputs`")
    nodes = [n for n in nodes if not isinstance(n, layers_lib.InputNode)]
    if output_node.kind != "softmax_cross_entropy":
        if num_classes is None and output_node.kind == "dense":
            num_classes = output_node.fields["units"]
        loss = layers_lib.Node("softmax_cross_entropy", {}, [output_node], None)
        nodes.append(loss)
    elif num_classes is None and output_node.inputs[0].kind == "dense":
        num_classes = output_node.inputs[0].fields["units"]
    if num_classes is None:
        raise ValueError("num_classes is needed: the model's output is not a Dense layer whose "
                         "units give it")

    # Names: the user's, then prefix + counter for the rest ("loss" for the loss).
    names = {}
    taken = {n.name for n in nodes if n.name}
    counters = {}
    for node in nodes:
        if node.name:
            names[id(node)] = node.name
            continue
        if node.kind == "softmax_cross_entropy" and "loss" not in taken:
            candidate = "loss"
        else:
            prefix = _PREFIX.get(node.kind, node.kind)
            while True:
                counters[prefix] = counters.get(prefix, 0) + 1
                candidate = f"{prefix}{counters[prefix]}"
                if candidate not in taken:
                    break
        taken.add(candidate)
        names[id(node)] = candidate

    spec = job_pb2.ModelSpec(name=name, input_shape=input_node.shape, num_classes=num_classes,
                             init_seed=init_seed)
    previous = input_node
    for node in nodes:
        layer = spec.layers.add(name=names[id(node)])
        # Leave `inputs` empty when the layer reads the one listed before it,
        # as the zoo's files do.
        if len(node.inputs) != 1 or node.inputs[0] is not previous:
            layer.inputs.extend("input" if isinstance(i, layers_lib.InputNode) else names[id(i)]
                                for i in node.inputs)
        getattr(layer, node.kind).SetInParent()
        for key, value in node.fields.items():
            setattr(getattr(layer, node.kind), key, value)
        previous = node
    return spec
