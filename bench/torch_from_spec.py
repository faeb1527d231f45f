"""Builds a PyTorch module from a pstrain ModelSpec JSON file, so that the
reference side of every benchmark trains exactly the model pstrain trains.

    model = SpecModel(json.load(open("examples/models/fmnist-cnn.json")))
    logits = model(images)          # [N, num_classes]
"""
import torch
import torch.nn as nn


def _kind(layer):
    for k in ("conv2d", "max_pool", "avg_pool", "dense", "relu", "leaky_relu", "tanh", "sigmoid",
              "dropout", "batch_norm", "flatten", "add", "softmax_cross_entropy"):
        if k in layer:
            return k
    raise ValueError(f"layer {layer.get('name')}: unknown type")


class SpecModel(nn.Module):
    """Forward returns the logits (the input of softmax_cross_entropy)."""

    def __init__(self, spec):
        super().__init__()
        self.order = []
        self.mods = nn.ModuleDict()
        shapes = {"input": list(spec["input_shape"])}
        prev = "input"
        for layer in spec["layers"]:
            name, kind = layer["name"], _kind(layer)
            inputs = layer.get("inputs") or [prev]
            shape = shapes[inputs[0]]
            cfg = layer[kind]
            key = name.replace(".", "_")
            if kind == "conv2d":
                kh = cfg.get("kernel_h") or cfg["kernel_size"]
                kw = cfg.get("kernel_w") or cfg["kernel_size"]
                stride, pad = cfg.get("stride") or 1, cfg.get("padding", 0)
                self.mods[key] = nn.Conv2d(shape[0], cfg["filters"], (kh, kw), stride, pad,
                                           bias=not cfg.get("no_bias", False))
                out = [cfg["filters"], (shape[1] + 2 * pad - kh) // stride + 1,
                       (shape[2] + 2 * pad - kw) // stride + 1]
            elif kind in ("max_pool", "avg_pool"):
                k, s, p = cfg["pool_size"], cfg.get("stride") or cfg["pool_size"], cfg.get("padding", 0)
                self.mods[key] = (nn.MaxPool2d(k, s, p) if kind == "max_pool"
                                  else nn.AvgPool2d(k, s, p, count_include_pad=False))
                out = [shape[0], (shape[1] + 2 * p - k) // s + 1, (shape[2] + 2 * p - k) // s + 1]
            elif kind == "dense":
                features = 1
                for d in shape:
                    features *= d
                self.mods[key] = nn.Sequential(nn.Flatten(), nn.Linear(features, cfg["units"],
                                                                      bias=not cfg.get("no_bias", False)))
                out = [cfg["units"]]
            elif kind == "relu":
                self.mods[key], out = nn.ReLU(), shape
            elif kind == "leaky_relu":
                self.mods[key], out = nn.LeakyReLU(cfg.get("alpha") or 0.01), shape
            elif kind == "tanh":
                self.mods[key], out = nn.Tanh(), shape
            elif kind == "sigmoid":
                self.mods[key], out = nn.Sigmoid(), shape
            elif kind == "dropout":
                self.mods[key], out = nn.Dropout(cfg.get("rate", 0.0)), shape
            elif kind == "batch_norm":
                bn = nn.BatchNorm2d if len(shape) == 3 else nn.BatchNorm1d
                self.mods[key] = bn(shape[0], eps=cfg.get("epsilon") or 1e-5,
                                    momentum=cfg.get("momentum") or 0.1)
                out = shape
            elif kind == "flatten":
                self.mods[key] = nn.Flatten()
                features = 1
                for d in shape:
                    features *= d
                out = [features]
            elif kind == "add":
                out = shape
            else:  # softmax_cross_entropy: the logits are its input.
                self.logits_name = inputs[0]
                break
            self.order.append((name, key, kind, inputs))
            shapes[name] = out
            prev = name

    def forward(self, x):
        values = {"input": x}
        for name, key, kind, inputs in self.order:
            if kind == "add":
                y = values[inputs[0]]
                for other in inputs[1:]:
                    y = y + values[other]
            else:
                y = self.mods[key](values[inputs[0]])
            values[name] = y
        return values[self.logits_name]
