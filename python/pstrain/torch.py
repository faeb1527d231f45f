"""Train your own PyTorch model through pstrain's parameter servers.

A training loop changes in a few lines (Horovod's and BytePS's conventions)::

    import pstrain.torch as pst
    pst.init()                          # joins the job named by the launcher
    model = MyNet()
    opt = pst.DistributedOptimizer(model)          # the job's server-side optimizer
    loader = DataLoader(train_set, batch_sampler=pst.DistributedSampler(train_set))
    for epoch in pst.epochs():
        for x, y in loader:
            opt.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); opt.step()
        pst.report(loss=loss.item())

What each part does:

* ``init()`` reads the launcher's environment (PSTRAIN_SERVER, PSTRAIN_JOB and
  PSTRAIN_CREDENTIALS, a JSON file of TLS and token file paths) and registers
  this process with the coordinator as a worker bound to that job.
* ``DistributedOptimizer(model)`` declares the module's named parameters (the
  trained tensors) and floating-point buffers (batch norm's running
  statistics) as the job's model, with this process's values as the initial
  ones when it declares first; waits for the job to start; and puts the
  servers' values into the module. In sync, async and ssp mode each
  gradient is pushed as soon as autograd has it (a hook per parameter) and
  ``step()`` applies the job's server-side optimizer: it waits for the
  pushes and pulls the new values. In average mode, pass your own
  ``optimizer`` (a torch optimizer): ``step()`` runs it and every K steps
  replaces the parameters with their mean over the workers. Buffers take
  the workers' mean in sync and average mode, rank 0's in async and ssp.
  Integer buffers (``num_batches_tracked``) stay local.
* ``DistributedSampler(dataset)`` is a batch sampler: this worker's batches of
  the job's epoch plan (the server's shuffle and split, the same as the C++
  workers'), and after them any samples a lost worker left. The batch size is
  the job's; every member of a sync job runs the same number of steps, the
  last one taking the remainder, which is why it is a batch sampler.
* ``epochs()`` yields the job's epochs; ``report(loss=..., accuracy=...)``
  shows in ``pstrain status``, ``watch``, the history and the report. When the
  last epoch ends the worker reports that it finished and the job, once
  every worker has, SUCCEEDED.

When server 0 restarts (kill -9, a node lost) the job resumes from its last
checkpoint as a new run, and this process follows it without a restart: the
step that failed is dropped, the DistributedSampler's iteration ends, and
``epochs()`` yields again from the checkpoint's epoch, with the module's
tensors set to the checkpoint's values; the first epoch starts at the
checkpoint's step. A local optimizer's state (average mode) is kept. While
the coordinator is away the worker waits up to ``rejoin_timeout`` seconds.

Tensors are float32 and contiguous, on the CPU or on a CUDA device. The C++
client reads and writes a CPU tensor's own memory (no copy). A CUDA tensor
goes through a pinned host buffer of its own (``_Staging``), with this stream
ordering: values are copied to the device on the current stream (so every
kernel queued after them sees them) before the forward that reads them, a
gradient is copied to the host on the current stream and that stream is
synchronised before the C++ client reads it (in the gradient's hook), and
step() synchronises the stream before the next pulls may write the host
buffers. The transport is pstrain's C++ client (pstrain._native): chunking,
codecs, exactly-once pushes, deadlines.
"""

import json
import os
import socket

import torch

try:
    from pstrain import _native
except ImportError as error:  # pragma: no cover - depends on how it was installed
    raise ImportError(
        f"pstrain.torch needs pstrain._native, pstrain's C++ worker protocol ({error}). It is "
        "built by the CMake build into <build>/python/pstrain (PYTHONPATH=build/python); a "
        "package installed with pip from python/ alone does not have it.") from error
from pstrain._proto import job_pb2, service_pb2

__all__ = ["init", "Worker", "DistributedOptimizer", "DistributedSampler", "epochs", "report",
           "rank", "world_size", "batch_size", "mode", "Error"]

Error = _native.Error

# Steps between progress reports within an epoch (the C++ workers' default).
_PROGRESS_EVERY = 20

# Errors that a restarting server 0 or a replaced run cause: the worker waits
# for the job's new run before it gives up on them.
_RESUMABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "NOT_FOUND", "ABORTED", "CANCELLED",
              "FAILED_PRECONDITION"}

_MODES = {"sync": job_pb2.CONSISTENCY_SYNC, "async": job_pb2.CONSISTENCY_ASYNC,
          "ssp": job_pb2.CONSISTENCY_SSP, "average": job_pb2.CONSISTENCY_AVERAGE}


def _read_credentials(path):
    """The launcher's credentials file: {"tls_ca", "tls_cert", "tls_key",
    "tls_server_name", "token_file"}, every entry optional."""
    if not path:
        return {}
    with open(path, encoding="utf-8") as f:
        creds = json.load(f)
    if not isinstance(creds, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return {"tls_ca": creds.get("tls_ca", ""), "tls_cert": creds.get("tls_cert", ""),
            "tls_key": creds.get("tls_key", ""),
            "tls_server_name": creds.get("tls_server_name", ""),
            "token_file": creds.get("token_file", "")}



class _Staging:
    """The host memory the C++ client reads and writes for each declared
    tensor, in order: a contiguous float32 CPU tensor's own, or for a tensor
    on another device (CUDA) a pinned host buffer of its shape (see the
    module's doc for the stream ordering). PSTRAIN_TORCH_STAGING=always stages
    CPU tensors too (the CUDA path's copies, testable on a CPU)."""

    def __init__(self, tensors):
        self.tensors = [t for _, t, _ in tensors]
        always = os.environ.get("PSTRAIN_TORCH_STAGING", "") == "always"
        self.staged = [always or t.device.type != "cpu" for t in self.tensors]
        self.cuda = any(t.device.type == "cuda" for t in self.tensors)
        self.host = [self._buffer(t) if staged else t
                     for t, staged in zip(self.tensors, self.staged)]
        self.grads = {}  # index -> the host buffer of its gradient
        self.any = any(self.staged)

    def _buffer(self, t):
        return torch.empty(tuple(t.shape), dtype=torch.float32,
                           pin_memory=t.device.type == "cuda")

    def pointers(self):
        return [h.data_ptr() for h in self.host]

    def wait(self):
        """Every copy queued on the current stream has run."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def _copy(self, indices, to_host):
        """Queues the staged tensors' copies (all, or `indices`) on the current
        stream; False when nothing is staged."""
        if not self.any:
            return False
        with torch.no_grad():
            for i in range(len(self.tensors)) if indices is None else indices:
                if self.staged[i]:
                    pair = (self.host[i], self.tensors[i]) if to_host else (self.tensors[i],
                                                                           self.host[i])
                    pair[0].copy_(pair[1], non_blocking=True)
        return True

    def to_host(self, indices=None):
        """The tensors' values into their host memory; returns when copied."""
        if self._copy(indices, to_host=True):
            self.wait()

    def to_device(self, indices=None):
        """The host values into the tensors, queued on the current stream."""
        self._copy(indices, to_host=False)

    def gradient(self, index, grad):
        """The address of `grad`'s values in host memory, once they are there."""
        if not self.staged[index]:
            return grad.data_ptr()
        buffer = self.grads.get(index)
        if buffer is None:
            buffer = self.grads[index] = self._buffer(grad)
        buffer.copy_(grad, non_blocking=True)
        self.wait()
        return buffer.data_ptr()


class Worker:
    """This process as a worker of one job: the context every other call uses.

    server, job: the coordinator's "host:port" and the job id (default:
    PSTRAIN_SERVER and PSTRAIN_JOB); credentials: the launcher's credentials
    file (default PSTRAIN_CREDENTIALS; none: plaintext, no token).
    start_timeout: seconds to wait for the job to start once the model is
    declared (its other workers must join). rejoin_timeout: seconds to wait
    for the job's new run after the coordinator or a shard went away.
    """

    def __init__(self, server=None, job=None, credentials=None, start_timeout=600.0,
                 rejoin_timeout=300.0):
        server = server or os.environ.get("PSTRAIN_SERVER")
        job = job or os.environ.get("PSTRAIN_JOB")
        if not server or not job:
            raise RuntimeError("pstrain.torch: no job to join: start this script with "
                               "`pstrain run -n N -- python3 script.py`, or set PSTRAIN_SERVER "
                               "and PSTRAIN_JOB")
        creds = _read_credentials(credentials or os.environ.get("PSTRAIN_CREDENTIALS"))
        self.job_id = job
        self.start_timeout = float(start_timeout)
        self.rejoin_timeout = float(rejoin_timeout)
        self._native = _native.JobWorker(
            server, job, hostname=socket.gethostname(),
            device_info=f"torch {torch.__version__} (CPU)",
            launched_by=os.environ.get("PSTRAIN_LAUNCHER", ""), **creds)
        self.assignment = None
        self.spec = None
        self.epoch = 0
        self.step = 0
        self._trained = {}  # epoch -> samples trained in this run
        self._batch_samples = 0  # The sampler's latest batch.
        self._updater = None
        self._last = {}
        self._staging = None  # The declared tensors' host memory (_Staging).
        self._run_number = 0  # The run this process trains (JobWorker.run_number).
        self._run_steps = 0
        self._global_step = 0  # The job's: epoch * steps per epoch + steps into it.
        self._steps_per_epoch = 0
        self._resume_pending = False  # The run's first epoch starts at its start_step.
        self._rejoining = False  # The job resumed as a new run: the loop rewinds.
        self._overlap_pulls = False  # Sync: the next version's pulls overlap the forward.
        self._failure = None  # An error a forward pre-hook met, for the next step.

    # --- The job, once started ---

    @property
    def rank(self):
        return self.assignment.rank if self.assignment else 0

    @property
    def world_size(self):
        return self.assignment.world_size if self.assignment else 1

    @property
    def batch_size(self):
        self._require_start()
        return self.spec.batch_size

    def _require_start(self):
        if self.assignment is None:
            raise RuntimeError("pstrain.torch: the job has not started: make the "
                               "DistributedOptimizer first")

    def _start(self, tensors, framework, overlap_pulls=False):
        self._overlap_pulls = overlap_pulls
        model = job_pb2.ExternalModel(framework=framework)
        for name, tensor, trainable in tensors:
            model.tensors.add(name=name, shape=list(tensor.shape), trainable=trainable)
        self._staging = _Staging(tensors)
        self._staging.to_host()
        self._native.declare_model(model.SerializeToString(), self._staging.pointers())
        self._native.await_start(self.start_timeout)
        self._join_run()

    def _join_run(self):
        """Takes the job's current run: its assignment, and the servers'
        values in the module's tensors."""
        while True:
            self._run_number = self._native.run_number
            self.assignment = service_pb2.Assignment.FromString(self._native.assignment())
            self.spec = self.assignment.spec
            self.epoch = self.assignment.start_epoch
            self._trained = {}
            self._run_steps = 0
            self._native.set_run_steps(0)
            self._resume_pending = self.assignment.start_step > 0
            self._rejoining = False
            self._failure = None
            if self._updater is not None:
                self._updater.cancel()
            self._updater = None
            try:
                updater = _native.Updater(self._native, self._overlap_pulls)
                updater.start(self._staging.pointers())
            except Error as error:
                self._await_rejoin(error)
                continue
            self._updater = updater
            self._staging.to_device()
            return

    def _settle(self):
        """Waits for the overlapped pulls: every tensor holds the new values."""
        if self._updater is None or self._rejoining:
            return
        try:
            self._updater.settle()
        except Error as error:
            self._await_rejoin(error)
            return
        self._staging.to_device()

    def _await_rejoin(self, error=None):
        """After `error` (or a stop answer when None): waits for the job's
        new run and marks the loop for rewinding; raises when none comes."""
        if error is not None and getattr(error, "code", "") not in _RESUMABLE:
            raise error
        if self._native.await_new_run(self._run_number, self.rejoin_timeout):
            self._rejoining = True
            return
        if self._native.stopped:
            raise Error(f"pstrain.torch: the job was stopped: {self._native.stop_reason}")
        if error is not None:
            raise error
        raise Error(f"pstrain.torch: the coordinator said stop, and {self.job_id} did not "
                    f"resume within {self.rejoin_timeout:g} s")

    # --- Epochs and reports ---

    def epochs(self):
        """The job's epochs, from where the run starts; reports each one's end
        and, after the last, that this worker finished. After the job resumed
        as a new run it yields again from that run's first epoch."""
        self._require_start()
        epoch = self.assignment.start_epoch
        while True:
            if self._rejoining:
                self._join_run()
                epoch = self.assignment.start_epoch
            if epoch < self.spec.epochs:
                self.epoch = epoch
                yield epoch
                self._settle()
                if not self._rejoining:
                    self._send(epoch=epoch + 1)
                epoch += 1
                continue
            try:
                self._staging.to_host()
                self._updater.finish()
            except Error as error:
                self._await_rejoin(error)
                continue
            self._staging.to_device()
            if self._send(epoch=self.spec.epochs, finished=True):
                break
        self._native.shutdown()

    def report(self, loss=None, accuracy=None, samples_per_sec=None):
        """Figures for status, watch, the history and the report."""
        if loss is not None:
            self._last["loss"] = float(loss)
        if accuracy is not None:
            self._last["train_accuracy"] = float(accuracy)
        if samples_per_sec is not None:
            self._last["samples_per_sec"] = float(samples_per_sec)
        if not self._rejoining:
            self._send(epoch=self.epoch)

    def _send(self, epoch, finished=False):
        """Reports; False when the job resumed as a new run instead."""
        request = service_pb2.ReportProgressRequest(epoch=epoch, step=self._global_step,
                                                    steps_per_epoch=self._steps_per_epoch,
                                                    finished=finished,
                                                    run_id=self.assignment.run_id, **self._last)
        try:
            stop = self._native.report_progress(request.SerializeToString())
        except Error as error:
            self._await_rejoin(error)
            return False
        if not stop:
            return True
        if finished:
            # The job ended (this report may have ended it), or this run was
            # replaced: the heartbeats say which.
            if self._native.await_new_run(self._run_number, self.rejoin_timeout):
                self._rejoining = True
                return False
            return True
        self._await_rejoin()
        return False

    def _plan(self, epoch, length, share_done, tails_done):
        """This worker's plan, or None when the job resumed as a new run."""
        request = service_pb2.EpochPlanRequest(epoch=epoch, epoch_length=length,
                                               share_done=share_done, tails_done=tails_done,
                                               batch_size=self.spec.batch_size,
                                               run_id=self.assignment.run_id)
        for e, samples in sorted(self._trained.items()):
            request.trained.add(epoch=e, samples=samples)
        try:
            return service_pb2.EpochPlanResponse.FromString(
                self._native.epoch_plan(request.SerializeToString()))
        except Error as error:
            self._await_rejoin(error)
            return None

    def _epoch_started(self, epoch, base_steps):
        """The steps of `epoch` to skip: those the run already holds (a
        resume mid-epoch)."""
        into = 0
        if self._resume_pending:
            self._resume_pending = False
            into = self.assignment.start_step - epoch * base_steps
            if epoch != self.assignment.start_epoch or not 0 < into < base_steps:
                into = 0
        self._steps_per_epoch = base_steps
        self._global_step = epoch * base_steps + into
        return into

    def _stepped(self, samples, epoch):
        self.step += 1
        self._run_steps += 1
        self._global_step += 1
        self._trained[epoch] = self._trained.get(epoch, 0) + samples
        self._native.set_run_steps(self._run_steps)
        if self._run_steps % _PROGRESS_EVERY == 0:
            self._send(epoch=self.epoch)  # Status and watch move within an epoch.

    def close(self):
        if self._updater is not None:
            self._updater.cancel()
        self._native.shutdown()


_default = None


def init(server=None, job=None, credentials=None, start_timeout=600.0, rejoin_timeout=300.0):
    """Joins the job (see Worker) and makes it the module's default context."""
    global _default
    _default = Worker(server, job, credentials, start_timeout, rejoin_timeout)
    return _default


def _worker(worker):
    if worker is not None:
        return worker
    if _default is None:
        raise RuntimeError("pstrain.torch: call pst.init() first")
    return _default


def epochs(worker=None):
    return _worker(worker).epochs()


def report(loss=None, accuracy=None, samples_per_sec=None, worker=None):
    _worker(worker).report(loss=loss, accuracy=accuracy, samples_per_sec=samples_per_sec)


def rank(worker=None):
    return _worker(worker).rank


def world_size(worker=None):
    return _worker(worker).world_size


def batch_size(worker=None):
    return _worker(worker).batch_size


def mode(worker=None):
    """The job's mode ("sync", "async", "ssp" or "average"), known before the
    job starts from the launcher's PSTRAIN_MODE, else from the job once
    started: a script picks its own optimizer for average mode with it."""
    w = _worker(worker)
    if w.spec is not None:
        names = {v: k for k, v in _MODES.items()}
        return names.get(w.spec.mode, "sync")
    launched = os.environ.get("PSTRAIN_MODE", "")
    if launched not in _MODES:
        raise RuntimeError("pstrain.torch: the job's mode is known once it started (make the "
                           "DistributedOptimizer first), or from PSTRAIN_MODE (pstrain run)")
    return launched


def _model_tensors(module):
    """(name, tensor, trainable): the parameters, then the float buffers."""
    tensors = []
    for name, p in module.named_parameters():
        tensors.append((name, p, p.requires_grad))
    for name, b in module.named_buffers():
        if b.is_floating_point():
            tensors.append((name, b, False))
    for name, t, _ in tensors:
        if (t.device.type not in ("cpu", "cuda") or t.dtype != torch.float32 or
                not t.is_contiguous()):
            raise TypeError(f"pstrain.torch: '{name}' is {t.dtype} on {t.device}"
                            f"{'' if t.is_contiguous() else ', not contiguous'}; this version "
                            "trains contiguous float32 tensors on the CPU or a CUDA device")
    return tensors


class DistributedOptimizer:
    """The job's optimizer over `model`'s parameters (see the module's doc).

    optimizer: average mode only, a torch optimizer over the model's
    parameters that runs every step between the averagings. In sync, async
    and ssp mode the servers' optimizer (the job's) applies the gradients and
    `optimizer` must be None.

    overlap_pulls (sync mode): step() returns once the gradients are pushed
    and the next version's pulls are issued; each module's forward waits
    (a forward pre-hook) only for its own parameters and buffers, so the
    first layers compute while the later ones arrive. Code that reads
    parameters outside a forward before the next step (a regulariser over
    every parameter, a print) calls synchronize() first; the sampler's end,
    each epoch's end and the run's end do so themselves.
    """

    def __init__(self, model, optimizer=None, worker=None, overlap_pulls=True):
        self.worker = _worker(worker)
        self.model = model
        self._tensors = _model_tensors(model)
        # The updater overlaps only in sync mode (known once the job started).
        self._overlap = overlap_pulls and optimizer is None
        self.worker._start(self._tensors, f"torch {torch.__version__}",
                           overlap_pulls=self._overlap)
        self.mode = self.worker.spec.mode
        average = self.mode == job_pb2.CONSISTENCY_AVERAGE
        if average and optimizer is None:
            raise ValueError("pstrain.torch: an average-mode job runs your optimizer between "
                             "averagings: pass optimizer=torch.optim.SGD(...) (or another)")
        if not average and optimizer is not None:
            raise ValueError("pstrain.torch: in sync, async and ssp mode the servers apply the "
                             "job's optimizer; pass no optimizer (it is the job's)")
        self.optimizer = optimizer
        self._buffer_indices = [i for i, (_, _, trainable) in enumerate(self._tensors)
                                if not trainable]
        self._hooks = []
        if not average:
            self._hook_gradients()
        if self._overlap and self.mode == job_pb2.CONSISTENCY_SYNC:
            self._hook_forwards()

    def _hook_forwards(self):
        # A forward pre-hook on every module waits for the tensors it holds
        # itself and for every tensor under a child whose own forward has
        # never run: a module that reads a child's weight without calling
        # it (MultiheadAttention's out_proj) waits for that weight. Until a
        # module has run, its parent waits for it all, so the first step
        # waits for everything at the root. Tied weights are found by
        # identity.
        self._index = {id(t): i for i, (_, t, _) in enumerate(self._tensors)}
        self._called = set()  # ids of the modules whose forward ran
        self._wait_sets = {}  # module id -> indices, valid for this _called
        for module in self.model.modules():
            self._hooks.append(module.register_forward_pre_hook(self._wait_before_forward))

    def _tensor_indices(self, tensors):
        return {self._index[id(t)] for t in tensors if t is not None and id(t) in self._index}

    def _wait_set(self, module):
        indices = self._tensor_indices(list(module._parameters.values()) +
                                       list(module._buffers.values()))
        for child in module.children():
            if id(child) not in self._called:
                indices |= self._tensor_indices(list(child.parameters()) + list(child.buffers()))
        return sorted(indices)

    def _wait_before_forward(self, module, _inputs):
        w = self.worker
        if id(module) not in self._called:
            self._called.add(id(module))
            self._wait_sets.clear()  # A module ran for the first time: its parent waits less.
        if w._rejoining or w._failure is not None:
            return
        indices = self._wait_sets.get(id(module))
        if indices is None:
            indices = self._wait_sets[id(module)] = self._wait_set(module)
        if not indices:
            return
        try:
            self._updater.wait_params(indices)
        except Error as error:
            w._failure = error  # The next step() handles it, out of the forward.
            return
        w._staging.to_device(indices)

    def synchronize(self):
        """Waits until every parameter holds the latest pulled values (see
        overlap_pulls)."""
        self.worker._settle()

    def _hook_gradients(self):
        # A hook on each parameter's gradient accumulator fires once autograd
        # has accumulated its .grad (Horovod's way, from torch 1.x on).
        for index, (name, p, trainable) in enumerate(self._tensors):
            if not trainable:
                continue
            accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
            accumulator.register_hook(self._make_hook(index, p))
            self._hooks.append(accumulator)  # Keeps the accumulator (and its hook) alive.

    @property
    def _updater(self):
        return self.worker._updater  # The current run's.

    def _make_hook(self, index, p):
        def hook(*_):
            grad = p.grad
            if self.worker._rejoining or grad is None:
                return
            staging = self.worker._staging
            if staging.staged[index] or (grad.is_contiguous() and grad.dtype == torch.float32):
                self._updater.gradient_ready(index, staging.gradient(index, grad))
        return hook

    def zero_grad(self, set_to_none=True):
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self.model.zero_grad(set_to_none=set_to_none)

    def step(self, samples=None):
        """Ends the step: the job's update (see the class doc). `samples`: the
        batch's size, for the job's counts (default: the DistributedSampler's
        latest batch, else the job's batch size)."""
        if self.worker._rejoining:
            return  # The job resumed as a new run: the loop rewinds.
        if self.worker._failure is not None:
            error, self.worker._failure = self.worker._failure, None
            self.worker._await_rejoin(error)
            return
        if self.optimizer is not None:
            self.optimizer.step()
        staging = self.worker._staging
        try:
            # The values the step sends (the buffers; average mode: all), and
            # the stream done before the next pulls may write host memory.
            staging.to_host(None if self.optimizer is not None else self._buffer_indices)
            with torch.no_grad():
                self._updater.step()
        except Error as error:
            self.worker._await_rejoin(error)
            return  # This step's contribution is dropped.
        if not (self._overlap and self.mode == job_pb2.CONSISTENCY_SYNC):
            staging.to_device()
        epoch = self.worker.epoch
        if samples is None:
            samples = self.worker._batch_samples or self.worker.batch_size
        self.worker._stepped(int(samples), epoch)

    @property
    def version(self):
        """The model version the parameters hold."""
        return self._updater.version


class DistributedSampler(torch.utils.data.Sampler):
    """This worker's batches of the job's current epoch (see the module's
    doc): pass it as a DataLoader's batch_sampler."""

    def __init__(self, dataset, worker=None):
        self.worker = _worker(worker)
        self.length = len(dataset)

    def __iter__(self):
        w = self.worker
        w._require_start()
        epoch, batch = w.epoch, w.spec.batch_size
        plan = w._plan(epoch, self.length, share_done=False, tails_done=0)
        if plan is None:
            return
        skip = w._epoch_started(epoch, plan.base_steps)
        yield from self._batches(epoch, *_native.base_range(self.length, epoch, plan.rank,
                                                            plan.world_size), plan.base_steps,
                                 batch, skip)
        tails_done = 0
        while not w._rejoining:  # The samples lost workers left, until none is handed out.
            plan = w._plan(epoch, self.length, share_done=True, tails_done=tails_done)
            if plan is None or len(plan.tails) <= tails_done:
                return
            for tail in plan.tails[tails_done:]:
                yield from self._batches(tail.epoch, tail.begin, tail.end, tail.steps, batch)
                tails_done += 1

    def _batches(self, epoch, begin, end, steps, batch, skip=0):
        """The batches of positions [begin, end) of `epoch`'s order, from
        batch `skip` on; ends early when the job resumed as a new run."""
        if end <= begin or steps <= 0:
            return
        order = _native.epoch_order(self.length, self.worker.spec.seed, epoch)
        ends = _native.batch_ends(end - begin, steps, batch)
        start = ends[skip - 1] if skip > 0 else 0
        if start:  # The resumed run holds them: they count as trained.
            trained = self.worker._trained
            trained[epoch] = trained.get(epoch, 0) + start
        for stop in ends[skip:]:
            if self.worker._rejoining:
                return
            self.worker._batch_samples = stop - start
            yield order[begin + start:begin + stop]
            start = stop
        self.worker._settle()

    def __len__(self):
        w = self.worker
        w._require_start()
        return max(1, self.length // max(1, w.world_size) // w.spec.batch_size)
