"""The generated pstrain.v1 modules (python/gen_stubs.py makes them at build time).

Imported through here so that a package used from its source directory,
where nothing is generated, fails with what to do instead of a bare
ModuleNotFoundError.
"""

try:
    from pstrain.v1 import checkpoint_pb2, job_pb2, service_pb2, service_pb2_grpc, tensor_pb2
except ImportError as error:  # pragma: no cover - depends on how it was installed
    raise ImportError(
        "pstrain: the generated pstrain.v1 modules are missing "
        f"({error}). Use the package built into <build>/python by CMake "
        "(PYTHONPATH=build/python), or install it with `pip install ./python`, which "
        "generates them with protoc and grpc_python_plugin (Debian: protobuf-compiler, "
        "protobuf-compiler-grpc).") from error

__all__ = ["checkpoint_pb2", "job_pb2", "service_pb2", "service_pb2_grpc", "tensor_pb2"]
