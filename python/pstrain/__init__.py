"""pstrain: define, submit, watch and download training jobs from Python.

    import pstrain
    from pstrain import layers

    model = pstrain.Sequential([
        layers.Conv2D(32, 5, padding="same", activation="relu"), layers.MaxPool2D(2),
        layers.Conv2D(64, 5, padding="same", activation="relu"), layers.MaxPool2D(2),
        layers.Flatten(), layers.Dense(1024, activation="relu"), layers.Dropout(0.4),
        layers.Dense(10)], input_shape=(1, 28, 28), name="fmnist-cnn")
    model.summary()
    client = pstrain.Client("127.0.0.1:7070", token_file="admin.token",
                            tls=pstrain.TLS(ca="ca.pem", cert="admin.pem", key="admin-key.pem"))
    job = client.submit(model, dataset=pstrain.datasets.IDX("/usr/share/datasets/fashion-mnist"),
                        optimizer=pstrain.optimizers.SGD(0.01, momentum=0.9),
                        epochs=10, workers=2, mode="sync")
    job.watch()
    print(job.metrics().confusion)
    ckpt = job.download("model.ckpt")       # ckpt.weights["conv1/weight"]
    same = pstrain.load_checkpoint("model.ckpt")

The wire and file formats are proto/pstrain/v1/*.proto; the modules generated
from them are pstrain.v1.* (made at build time, never committed).
"""

from pstrain import datasets, errors, layers, optimizers
from pstrain.checkpoint import Checkpoint, load_checkpoint
from pstrain.client import TLS, Client, Job, JobStatus, Metrics, read_token_file
from pstrain.errors import (AbortedError, DataLossError, DeadlineExceededError,
                            FailedPreconditionError, InternalError, InvalidArgumentError,
                            InvalidModelError, NotFoundError,
                            PermissionDeniedError, PstrainError, ResourceExhaustedError,
                            UnauthenticatedError, UnavailableError)
from pstrain.layers import Input
from pstrain.model import Model, Sequential

__version__ = "0.1.0"

__all__ = [
    "AbortedError", "Checkpoint", "Client", "DataLossError", "DeadlineExceededError",
    "FailedPreconditionError", "Input", "InternalError", "InvalidArgumentError",
    "InvalidModelError", "Job", "JobStatus", "Metrics", "Model",
    "NotFoundError", "PermissionDeniedError", "PstrainError", "ResourceExhaustedError",
    "Sequential", "TLS", "UnauthenticatedError", "UnavailableError", "datasets", "errors",
    "layers", "load_checkpoint", "optimizers", "read_token_file",
]
