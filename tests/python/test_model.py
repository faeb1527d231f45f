"""Models: the summary table, spec round trips and validation messages, each
checked against the C++ code (`pstrain summary` runs BuildModelGraph and
FormatModelSummary, the functions the server validates submitted jobs with)."""

import glob
import json
import os
import subprocess

import pytest
from google.protobuf import json_format

import pstrain
from pstrain import layers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_FILES = sorted(glob.glob(os.path.join(REPO, "examples", "*.json")) +
                       glob.glob(os.path.join(REPO, "examples", "models", "*.json")))


def cli_summary(bin_dir, path):
    """(exit code, stdout, stderr) of `pstrain summary PATH`."""
    result = subprocess.run([os.path.join(bin_dir, "pstrain"), "summary", path],
                            capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout, result.stderr


def write_model(tmp_path, spec, name="model.json"):
    path = str(tmp_path / name)
    with open(path, "w") as f:
        f.write(json_format.MessageToJson(spec, preserving_proto_field_name=True))
    return path


def tiny_resnet():
    """A functional model with a residual block (layers.Add)."""
    x = pstrain.Input(shape=(3, 16, 16))
    stem = layers.Conv2D(8, 3, padding="same", use_bias=False, name="stem")(x)
    stem = layers.ReLU(name="stem_relu")(layers.BatchNormalization(name="stem_bn")(stem))
    y = layers.Conv2D(8, 3, padding="same", activation="relu", name="block_conv1")(stem)
    y = layers.Conv2D(8, 3, padding="same", name="block_conv2")(y)
    y = layers.ReLU()(layers.Add(name="block_add")([y, stem]))
    y = layers.AveragePooling2D(2)(y)
    return pstrain.Model(x, layers.Dense(10, name="logits")(y), name="tiny-resnet", init_seed=3)


def test_examples_exist():
    assert len(EXAMPLE_FILES) >= 4, EXAMPLE_FILES


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=os.path.basename)
def test_summary_is_the_clis(bin_dir, path):
    code, table, err = cli_summary(bin_dir, path)
    assert code == 0, err
    assert pstrain.Model.from_file(path).summary_text() == table


def test_summary_prints_the_table(capsys):
    model = pstrain.Model.from_file(os.path.join(REPO, "examples/models/fmnist-cnn.json"))
    model.summary()
    assert capsys.readouterr().out == model.summary_text()


def test_functional_residual_model_summary_is_the_clis(bin_dir, tmp_path):
    model = tiny_resnet()
    code, table, err = cli_summary(bin_dir, write_model(tmp_path, model.to_spec()))
    assert code == 0, err
    assert model.summary_text() == table
    spec = model.to_spec()
    add = next(layer for layer in spec.layers if layer.name == "block_add")
    assert list(add.inputs) == ["block_conv2", "stem_relu"]
    assert spec.layers[-1].WhichOneof("kind") == "softmax_cross_entropy"
    assert spec.num_classes == 10
    # Batch norm: gamma and beta trained, running statistics not.
    assert ("stem_bn/running_var", (8,)) in model.parameters


def test_sequential_builds_the_zoo_model():
    zoo = pstrain.Model.from_file(os.path.join(REPO, "examples/models/fmnist-cnn.json"))
    model = pstrain.Sequential([
        layers.Conv2D(32, 5, padding="same", name="conv1"), layers.ReLU(name="relu1"),
        layers.MaxPool2D(2, name="pool1"),
        layers.Conv2D(64, 5, padding="same", name="conv2"), layers.ReLU(name="relu2"),
        layers.MaxPool2D(2, name="pool2"),
        layers.Flatten(name="flatten"), layers.Dense(1024, name="fc1"), layers.ReLU(name="relu3"),
        layers.Dropout(0.4, name="dropout"), layers.Dense(10, name="logits"),
    ], input_shape=(1, 28, 28), name="fmnist-cnn", init_seed=42)
    assert model.to_spec() == zoo.to_spec()
    assert model == zoo


def test_activation_argument_adds_a_layer():
    model = pstrain.Sequential([layers.Dense(16, activation="tanh"), layers.Dense(3)],
                               input_shape=(5,))
    kinds = [(layer.name, layer.WhichOneof("kind")) for layer in model.to_spec().layers]
    assert kinds == [("fc1", "dense"), ("tanh1", "tanh"), ("fc2", "dense"),
                     ("loss", "softmax_cross_entropy")]
    assert model.count_params() == 5 * 16 + 16 + 16 * 3 + 3


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=os.path.basename)
def test_spec_round_trip(path):
    model = pstrain.Model.from_file(path)
    spec = model.to_spec()
    assert pstrain.Model.from_spec(spec).to_spec() == spec
    assert pstrain.Model.from_json(model.to_json()).to_spec() == spec
    assert pstrain.Model.from_spec(json.loads(model.to_json())).to_spec() == spec


def test_built_model_round_trips():
    model = tiny_resnet()
    spec = model.to_spec()
    again = pstrain.Model.from_spec(spec)
    assert again.to_spec() == spec
    assert again == model
    assert tiny_resnet().to_spec() == spec  # Names do not depend on what was built before.


def _mismatched_add():
    x = pstrain.Input(shape=(3, 32, 32))
    a = layers.Conv2D(32, 3, padding="same", name="conv1")(x)
    pool1 = layers.MaxPool2D(2, name="pool1")(a)
    conv3 = layers.Conv2D(64, 3, padding="same", name="conv3")(pool1)
    return pstrain.Model(x, layers.Dense(10)(layers.Add(name="add1")([pool1, conv3])))


# Models the server refuses, built the ways users build them.
INVALID_BUILDS = {
    "add_shapes": _mismatched_add,
    "dense_units": lambda: pstrain.Sequential([layers.Dense(0), layers.Dense(10)], (4,)),
    "kernel_too_big": lambda: pstrain.Sequential([layers.Conv2D(8, 7), layers.Dense(10)],
                                                 (1, 5, 5)),
    "dropout_rate": lambda: pstrain.Sequential([layers.Dropout(1.5), layers.Dense(10)], (4,)),
    "num_classes": lambda: pstrain.Sequential([layers.Dense(10)], (4,), num_classes=5),
    "duplicate_names": lambda: pstrain.Sequential(
        [layers.Dense(8, name="a"), layers.Dense(10, name="a")], (4,)),
    "bad_name": lambda: pstrain.Sequential([layers.Dense(10, name="my layer")], (4,)),
    "pool_padding": lambda: pstrain.Sequential(
        [layers.MaxPool2D(2, padding=2), layers.Dense(10)], (1, 8, 8)),
    "batch_norm_momentum": lambda: pstrain.Sequential(
        [layers.BatchNormalization(momentum=1.5), layers.Dense(10)], (4,)),
    "leaky_alpha": lambda: pstrain.Sequential([layers.LeakyReLU(-1), layers.Dense(10)], (4,)),
    "input_rank": lambda: pstrain.Sequential([layers.Dense(10)], (28, 28)),
    "conv_on_features": lambda: pstrain.Sequential([layers.Conv2D(4, 3), layers.Dense(10)],
                                                   (16,)),
}

# Specs no Python layer makes, as JSON files might hold them.
INVALID_SPECS = {
    "no_kind": {"name": "m", "input_shape": [4], "num_classes": 2,
                "layers": [{"name": "a"}, {"name": "loss", "softmax_cross_entropy": {}}]},
    "loss_not_last": {"name": "m", "input_shape": [4], "num_classes": 2,
                      "layers": [{"name": "fc", "dense": {"units": 2}},
                                 {"name": "loss", "softmax_cross_entropy": {}},
                                 {"name": "relu", "relu": {}}]},
    "unused_output": {"name": "m", "input_shape": [4], "num_classes": 2,
                      "layers": [{"name": "dead", "dense": {"units": 3}},
                                 {"name": "fc", "dense": {"units": 2}, "inputs": ["input"]},
                                 {"name": "loss", "softmax_cross_entropy": {}}]},
    "unknown_input": {"name": "m", "input_shape": [4], "num_classes": 2,
                      "layers": [{"name": "fc", "dense": {"units": 2}, "inputs": ["nowhere"]},
                                 {"name": "loss", "softmax_cross_entropy": {}}]},
    "no_layers": {"name": "m", "input_shape": [4], "num_classes": 2},
    "one_class": {"name": "m", "input_shape": [4], "num_classes": 1,
                  "layers": [{"name": "loss", "softmax_cross_entropy": {}}]},
}


def expect_clis_message(bin_dir, tmp_path, spec, message):
    path = write_model(tmp_path, spec)
    code, _, err = cli_summary(bin_dir, path)
    assert code == 2
    assert err == f"pstrain summary: error: {path}: model: {message}\n"


@pytest.mark.parametrize("case", sorted(INVALID_BUILDS))
def test_invalid_model_raises_the_servers_message(bin_dir, tmp_path, case):
    with pytest.raises(pstrain.InvalidModelError) as raised:
        INVALID_BUILDS[case]()
    assert isinstance(raised.value, ValueError)
    expect_clis_message(bin_dir, tmp_path, raised.value.spec, raised.value.message)


@pytest.mark.parametrize("case", sorted(INVALID_SPECS))
def test_invalid_spec_raises_the_servers_message(bin_dir, tmp_path, case):
    with pytest.raises(pstrain.InvalidModelError) as raised:
        pstrain.Model.from_spec(INVALID_SPECS[case])
    expect_clis_message(bin_dir, tmp_path, raised.value.spec, raised.value.message)


def test_readme_example_message():
    with pytest.raises(pstrain.InvalidModelError, match=r"^layer 'add1' \(add\): input 'conv3' "
                       r"has shape \[64, 16, 16\] but input 'pool1' has shape \[32, 16, 16\]$"):
        _mismatched_add()


def test_python_only_mistakes_are_value_errors():
    with pytest.raises(ValueError, match="odd size"):
        layers.Conv2D(8, 4, padding="same")
    with pytest.raises(ValueError, match="loss layer"):
        layers.Dense(10, activation="softmax")
    layer = layers.Dense(4)
    layer(pstrain.Input((3,)))
    with pytest.raises(ValueError, match="already called"):
        layer(pstrain.Input((3,)))
    with pytest.raises(ValueError, match="num_classes is needed"):
        pstrain.Sequential([layers.Dense(4), layers.ReLU()], (3,))


def test_bson_dataset_spec_names_the_dumps_fields():
    """pstrain.datasets.BSON fills the DatasetSpec fields a BSON job needs."""
    from pstrain import datasets
    from pstrain._proto import job_pb2
    spec = datasets.BSON("/data/cdiscount", image_size=(90, 90), channels=3,
                         max_bad_records=100).to_spec()
    assert spec.format == job_pb2.DATASET_FORMAT_BSON
    assert (spec.image_height, spec.image_width, spec.image_channels) == (90, 90, 3)
    assert spec.max_bad_records == 100
