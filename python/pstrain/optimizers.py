"""Server-side optimizers: each makes a pstrain.v1.OptimizerSpec.

    pstrain.optimizers.SGD(0.01, momentum=0.9,
                           schedule=pstrain.optimizers.Schedule(cosine_decay_steps=9380,
                                                                min_learning_rate=0.0005))
    pstrain.optimizers.AdamW(1e-3, weight_decay=0.01)

The server checks the values (ValidateOptimizerSpec) and refuses a bad one
with INVALID_ARGUMENT at submit.
"""

from pstrain._proto import job_pb2


class Schedule:
    """Learning-rate schedule, evaluated at every iteration (0-based).

    step_map: {iteration: rate} from that iteration on (DL4J's MapSchedule);
    cosine_decay_steps, min_learning_rate: cosine decay after warm-up;
    warmup_steps: linear warm-up from 0.
    """

    def __init__(self, step_map=None, cosine_decay_steps=0, min_learning_rate=0.0,
                 warmup_steps=0):
        self.step_map = {int(k): float(v) for k, v in (step_map or {}).items()}
        self.cosine_decay_steps = int(cosine_decay_steps)
        self.min_learning_rate = float(min_learning_rate)
        self.warmup_steps = int(warmup_steps)

    def to_spec(self):
        spec = job_pb2.LrSchedule(cosine_decay_steps=self.cosine_decay_steps,
                                  min_learning_rate=self.min_learning_rate,
                                  warmup_steps=self.warmup_steps)
        for k, v in self.step_map.items():
            spec.step_map[k] = v
        return spec


class Optimizer:
    type = job_pb2.OPTIMIZER_UNSPECIFIED

    def __init__(self, learning_rate, weight_decay=0.0, schedule=None):
        self.learning_rate = float(learning_rate)
        self.weight_decay = float(weight_decay)
        self.schedule = schedule

    def to_spec(self):
        spec = job_pb2.OptimizerSpec(type=self.type, learning_rate=self.learning_rate,
                                     weight_decay=self.weight_decay)
        if self.schedule is not None:
            spec.schedule.CopyFrom(self.schedule.to_spec())
        self._fill(spec)
        return spec

    def _fill(self, spec):
        """Type-specific fields."""

    def __repr__(self):
        return f"<pstrain.optimizers.{type(self).__name__} lr={self.learning_rate:g}>"


class SGD(Optimizer):
    """Plain SGD, or heavy-ball momentum (Nesterov optional); weight_decay is L2."""

    type = job_pb2.OPTIMIZER_SGD

    def __init__(self, learning_rate, momentum=0.0, nesterov=False, weight_decay=0.0,
                 schedule=None):
        super().__init__(learning_rate, weight_decay, schedule)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)

    def _fill(self, spec):
        spec.momentum = self.momentum
        spec.nesterov = self.nesterov


class Adam(Optimizer):
    """Adam; weight_decay is added to the gradient (L2). 0 betas/epsilon mean the defaults."""

    type = job_pb2.OPTIMIZER_ADAM

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-8,
                 weight_decay=0.0, schedule=None):
        super().__init__(learning_rate, weight_decay, schedule)
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)

    def _fill(self, spec):
        spec.beta1, spec.beta2, spec.epsilon = self.beta_1, self.beta_2, self.epsilon


class AdamW(Adam):
    """Adam with decoupled weight decay."""

    type = job_pb2.OPTIMIZER_ADAMW
