#!/usr/bin/env python3
"""Fashion-MNIST from Python: define, submit, watch, evaluate, download, export (ONNX).
Cluster, TLS, token as the CLI's: PSTRAIN_SERVER, PSTRAIN_TLS_{CA,CERT,KEY}, PSTRAIN_TOKEN_FILE.
  PYTHONPATH=build/python examples/python/fashion_mnist.py --epochs 2 --train-limit 6400
"""
import argparse

import numpy as np

import pstrain
from pstrain import layers

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--train-limit", type=int, default=0)  # 0: all 60,000
parser.add_argument("--test-limit", type=int, default=0)   # 0: all 10,000
parser.add_argument("-o", "--output", default="fashion-mnist.ckpt")
args = parser.parse_args()

model = pstrain.Sequential([  # the TensorFlow layers tutorial's CNN (examples/models/fmnist-cnn)
    layers.Conv2D(32, 5, padding="same", activation="relu"), layers.MaxPool2D(2),
    layers.Conv2D(64, 5, padding="same", activation="relu"), layers.MaxPool2D(2),
    layers.Flatten(), layers.Dense(1024, activation="relu"), layers.Dropout(0.4),
    layers.Dense(10)], input_shape=(1, 28, 28), name="fmnist-cnn")
model.summary()
job = pstrain.Client().submit(
    model, dataset=pstrain.datasets.FashionMNIST(train_limit=args.train_limit,
                                                 test_limit=args.test_limit),
    optimizer=pstrain.optimizers.SGD(0.01, momentum=0.9), epochs=args.epochs, workers=2,
    mode="sync")
if not job.watch().succeeded:  # progress bar, then the final report
    raise SystemExit(f"{job.id} did not succeed")
metrics = job.metrics()  # test set; metrics.confusion is a numpy array
errors = metrics.confusion - np.diag(np.diag(metrics.confusion))
true, predicted = np.unravel_index(errors.argmax(), errors.shape)
print(f"test accuracy {metrics.accuracy:.4f}; most confused: class {true} as {predicted}")
ckpt = job.download(args.output)
print(f"{args.output}: step {ckpt.step}, conv1/weight {ckpt.weights['conv1/weight'].shape}")
onnx_model = ckpt.export_onnx(args.output.replace(".ckpt", "") + ".onnx")  # as `pstrain export`
print(f"ONNX: inputs {[i.name for i in onnx_model.graph.input]}, outputs "
      f"{[o.name for o in onnx_model.graph.output]}")
