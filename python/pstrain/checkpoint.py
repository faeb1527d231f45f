"""Checkpoint files, read without any server: what `pstrain download` and
`job.download()` write, and what the server and `pstrain-worker --standalone`
save.

    ckpt = pstrain.load_checkpoint("model.ckpt")
    ckpt.weights["conv1/weight"].shape     # (32, 1, 5, 5), numpy float32
    ckpt.step, ckpt.epoch, ckpt.spec.model.name

Both formats of common/checkpoint.cc are read, with the same checks:
format 2 ("PSTCKPT2" and CRC-checked parts: a manifest, tensor slices, an
end part) and format 1 (one CheckpointFile envelope with a CRC-32).
A corrupt, truncated or foreign file raises DataLossError naming the file;
a format-1 envelope of an unknown version FailedPreconditionError.
"""

import struct
import warnings
import zlib

import numpy as np

from pstrain.errors import DataLossError, FailedPreconditionError
from pstrain._proto import checkpoint_pb2, tensor_pb2

PARTS_MAGIC = b"PSTCKPT2"
_FORMAT_1 = 1
_PART_MANIFEST, _PART_TENSOR, _PART_END = 1, 2, 3
_PART_HEADER = struct.Struct("<IQ")  # fixed32 kind, fixed64 length.
_MAX_PART_PAYLOAD = (64 << 20) + (1 << 20)

# DType -> (numpy dtype, element width). BF16 is widened to float32.
_DTYPES = {
    tensor_pb2.DTYPE_F32: (np.dtype("<f4"), 4),
    tensor_pb2.DTYPE_F16: (np.dtype("<f2"), 2),
    tensor_pb2.DTYPE_BF16: (np.dtype("<u2"), 2),
    tensor_pb2.DTYPE_I32: (np.dtype("<i4"), 4),
    tensor_pb2.DTYPE_U8: (np.dtype("u1"), 1),
}


def tensor_to_numpy(t):
    """A TensorProto as a numpy array of its shape (a copy; bf16 becomes float32)."""
    dtype, _ = _DTYPES[t.dtype]
    array = np.frombuffer(t.data, dtype=dtype).reshape(tuple(t.shape))
    if t.dtype == tensor_pb2.DTYPE_BF16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(dtype.newbyteorder("="), copy=True)


def _check_tensor(t):
    """ValidateTensorProto: known dtype, no negative dimension, exact byte count."""
    if t.dtype not in _DTYPES:
        return f"tensor '{t.name}': unknown dtype {t.dtype}"
    count = 1
    for axis, d in enumerate(t.shape):
        if d < 0:
            return f"tensor '{t.name}': negative dimension {d} at axis {axis}"
        count *= d
    width = _DTYPES[t.dtype][1]
    if count * width != len(t.data):
        return (f"tensor '{t.name}': data has {len(t.data)} bytes, shape and "
                f"{tensor_pb2.DType.Name(t.dtype)} need {count} x {width}")
    return None


class Checkpoint:
    """A checkpoint: weights, optimizer state and where training was.

    weights: {name: numpy array} of the model's parameters and batch-norm
      running statistics ("conv1/weight", "bn1/running_mean", ...), in the
      order the server keeps them.
    optimizer_state: {name: numpy array} ("fc1/weight/momentum", ...).
    spec: the pstrain.v1.JobSpec the model was trained with (spec.model is
      the ModelSpec; `model` is it as a pstrain.Model).
    step: optimizer steps taken; epoch: epochs completed.
    """

    def __init__(self, proto):
        self.proto = proto
        self.spec = proto.job
        self.step = proto.step
        self.epoch = proto.epoch
        self.created_unix_ms = proto.created_unix_ms
        self.chunk_versions = list(proto.chunk_versions)
        self.weights = {t.name: tensor_to_numpy(t) for t in proto.parameters}
        self.optimizer_state = {t.name: tensor_to_numpy(t) for t in proto.optimizer_state}

    @property
    def model(self):
        """The checkpoint's model as a pstrain.Model."""
        from pstrain.model import Model  # pstrain.model imports nothing from here.
        return Model.from_spec(self.spec.model)

    def export_onnx(self, path):
        """Writes the trained inference graph to `path` as ONNX (what `pstrain export`
        writes: input "input" normalised as in training, outputs "logits" and
        "probabilities"); returns the onnx.ModelProto. Needs Debian's python3-onnx."""
        from pstrain.onnx_export import export_onnx
        return export_onnx(self, path)

    def load_into(self, module, strict=True):
        """Copies the weights into a PyTorch module trained through
        pstrain.torch: each tensor to the parameter or buffer of its name.
        strict: every float tensor of the module must be in the checkpoint
        with its shape (KeyError / ValueError name the first that is not).
        Returns the module."""
        import torch
        state = module.state_dict()
        loaded = {}
        for name, tensor in state.items():
            if not tensor.is_floating_point():
                continue  # num_batches_tracked and the like stay the module's own.
            if name not in self.weights:
                if strict:
                    raise KeyError(f"the checkpoint has no tensor '{name}' (its tensors: "
                                   f"{', '.join(list(self.weights)[:8])}...)")
                continue
            value = self.weights[name]
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(f"'{name}' is {tuple(value.shape)} in the checkpoint and "
                                 f"{tuple(tensor.shape)} in the module")
            loaded[name] = torch.from_numpy(value.copy()).to(tensor.dtype)
        module.load_state_dict(loaded, strict=False)
        return module

    @classmethod
    def from_bytes(cls, data, source="<bytes>"):
        """Parses a checkpoint file's bytes (either format); `source` names it in errors."""
        return cls(_parse(bytes(data), source))

    def __repr__(self):
        return (f"<pstrain.Checkpoint {self.spec.model.name!r} step {self.step} epoch "
                f"{self.epoch}: {len(self.weights)} tensors>")


def load_checkpoint(path):
    """Reads and verifies a checkpoint file (format 1 or 2). No server needed."""
    with open(path, "rb") as f:
        data = f.read()
    return Checkpoint(_parse(data, str(path)))


def _parse(data, source):
    if data[:len(PARTS_MAGIC)] == PARTS_MAGIC:
        ckpt = _parse_parts(data, source)
    else:
        ckpt = _parse_envelope(data, source)
    names = set()
    for t in list(ckpt.parameters) + list(ckpt.optimizer_state):
        problem = _check_tensor(t)
        if problem is None and t.name in names:
            problem = f"duplicate tensor name '{t.name}'"
        if problem:
            raise DataLossError(f"checkpoint {source}: {problem}")
        names.add(t.name)
    return ckpt


def _parse_envelope(data, source):
    """Format 1: one CheckpointFile."""
    envelope = checkpoint_pb2.CheckpointFile()
    try:
        with warnings.catch_warnings():  # Some parsers also warn about garbage.
            warnings.simplefilter("ignore")
            envelope.ParseFromString(data)
    except Exception:  # google.protobuf.message.DecodeError and friends.
        raise DataLossError(f"checkpoint {source}: cannot parse the file envelope (truncated, "
                            "corrupt or not a pstrain checkpoint)") from None
    if envelope.format_version == 0:
        raise DataLossError(f"checkpoint {source}: no format_version (empty file or not a "
                            "pstrain checkpoint)")
    if envelope.format_version != _FORMAT_1:
        raise FailedPreconditionError(
            f"checkpoint {source}: unsupported format_version {envelope.format_version} (this "
            "build reads format-1 envelopes and format-2 parts)")
    if not envelope.checkpoint:
        raise DataLossError(f"checkpoint {source}: no checkpoint payload (truncated file?)")
    if zlib.crc32(envelope.checkpoint) != envelope.crc32:
        raise DataLossError(f"checkpoint {source}: checksum mismatch: file is corrupt")
    ckpt = checkpoint_pb2.Checkpoint()
    try:
        ckpt.ParseFromString(envelope.checkpoint)
    except Exception:
        raise DataLossError(f"checkpoint {source}: cannot parse the checkpoint payload") from None
    return ckpt


def _parse_parts(data, source):
    """Format 2: the magic, then [kind][length][payload][crc] parts."""

    def loss(*what):
        return DataLossError(f"checkpoint {source}: " + "".join(str(w) for w in what))

    position = len(PARTS_MAGIC)
    ckpt = None
    want_parameters = want_optimizer_state = -1
    current, current_bytes, current_data = None, 0, []
    current_size = 0

    def finish_current():
        if current is not None:
            if current_size != current_bytes:
                raise loss("tensor '", current.name, "' is incomplete")
            current.data = b"".join(current_data)

    part = 0
    while True:
        if position + _PART_HEADER.size > len(data):
            raise loss("incomplete (no end part; the write did not finish or the file was cut)")
        header = data[position:position + _PART_HEADER.size]
        kind, length = _PART_HEADER.unpack(header)
        if length > _MAX_PART_PAYLOAD:
            raise loss("part ", part, " claims ", length, " bytes (corrupt file)")
        start = position + _PART_HEADER.size
        end = start + length
        if end + 4 > len(data):
            raise loss("part ", part, " is cut short (truncated file)")
        payload = data[start:end]
        (stored_crc,) = struct.unpack("<I", data[end:end + 4])
        if zlib.crc32(payload, zlib.crc32(header)) != stored_crc:
            raise loss("checksum mismatch: file is corrupt (part ", part, ")")
        position = end + 4
        if part == 0:
            manifest = checkpoint_pb2.CheckpointManifest()
            try:
                manifest.ParseFromString(payload)
                ok = kind == _PART_MANIFEST
            except Exception:
                ok = False
            if not ok:
                raise loss("the first part is not a manifest")
            if (manifest.meta.parameters or manifest.meta.optimizer_state
                    or manifest.parameters < 0 or manifest.optimizer_state < 0):
                raise loss("malformed manifest")
            ckpt = checkpoint_pb2.Checkpoint()
            ckpt.CopyFrom(manifest.meta)
            want_parameters, want_optimizer_state = manifest.parameters, manifest.optimizer_state
            part += 1
            continue
        if kind == _PART_END:
            if length != 8 or struct.unpack("<Q", payload)[0] != part:
                raise loss("malformed end part")
            finish_current()
            if (len(ckpt.parameters) != want_parameters
                    or len(ckpt.optimizer_state) != want_optimizer_state):
                raise loss("has ", len(ckpt.parameters), " + ", len(ckpt.optimizer_state),
                           " tensors; its manifest says ", want_parameters, " + ",
                           want_optimizer_state)
            if position != len(data):
                raise loss("bytes after the end part")
            return ckpt
        piece = checkpoint_pb2.TensorPart()
        try:
            piece.ParseFromString(payload)
            ok = kind == _PART_TENSOR
        except Exception:
            ok = False
        if not ok:
            raise loss("part ", part, " is not a tensor part")
        t = piece.tensor
        if piece.offset == 0:  # A new tensor.
            finish_current()
            if len(ckpt.parameters) < want_parameters:
                current = ckpt.parameters.add()
            elif len(ckpt.optimizer_state) < want_optimizer_state:
                current = ckpt.optimizer_state.add()
            else:
                raise loss("more tensors than its manifest says")
            shape_only = tensor_pb2.TensorProto(name=t.name, dtype=t.dtype, shape=t.shape)
            if t.dtype not in _DTYPES or any(d < 0 for d in t.shape):
                raise loss(_check_tensor(shape_only))
            current_bytes = int(np.prod(t.shape, dtype=object)) * _DTYPES[t.dtype][1]
            current.name, current.dtype = t.name, t.dtype
            current.shape.extend(t.shape)
            current_data, current_size = [], 0
        elif current is None or t.name != current.name or piece.offset != current_size:
            raise loss("part ", part, " does not continue the tensor before it")
        if len(t.data) > current_bytes - current_size:
            raise loss("tensor '", current.name, "' has more data than its shape")
        current_data.append(t.data)
        current_size += len(t.data)
        part += 1
