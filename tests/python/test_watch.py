"""Job.watch without a server: the progress bar on a terminal and elsewhere,
and a WatchJob stream cut by a server restart reopened until the job ends.
(test_journey.py watches a real job.)"""

import io

import pytest

import pstrain
from pstrain.v1 import service_pb2


def status(state, step=0, total=100, reason=""):
    s = service_pb2.JobStatus(job_id="job-7", state=state, step=step, total_steps=total,
                              reason=reason, epoch=step * 2 // max(total, 1), loss=0.5,
                              train_accuracy=0.8, samples_per_sec=1000)
    s.spec.epochs = 2
    return s


class FakeClient:
    """Serves WatchJob from a script: each entry is one stream, a list of
    statuses, optionally ending in an exception."""

    address = "127.0.0.1:7070"

    def __init__(self, streams):
        self.streams = list(streams)
        self.calls = 0

    def _stream(self, method, request, timeout_s):
        assert method == "WatchJob" and request.job_id == "job-7" and timeout_s > 0
        self.calls += 1
        for item in self.streams.pop(0):
            if isinstance(item, Exception):
                raise item
            yield item


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_and_reconnect():
    client = FakeClient([
        [status(service_pb2.JOB_STATE_QUEUED, reason="waiting for 2 idle workers"),
         status(service_pb2.JOB_STATE_RUNNING, 10),
         pstrain.UnavailableError("connection reset")],
        [status(service_pb2.JOB_STATE_RUNNING, 60),
         status(service_pb2.JOB_STATE_SUCCEEDED, 100, reason="finished 2 epochs")],
    ])
    out = Tty()
    final = pstrain.Job(client, "job-7").watch(file=out, timeout=30)
    assert final.state == "SUCCEEDED" and client.calls == 2
    text = out.getvalue()
    assert "\rjob-7 QUEUED: waiting for 2 idle workers\033[K" in text
    assert "\rjob-7 RUNNING  epoch 1/2  step 10/100 [##------------------]  10%" in text
    assert "step 60/100 [############--------]  60%" in text
    assert "ETA " in text  # The rate is known once two RUNNING statuses were seen.
    assert "\njob-7 SUCCEEDED: finished 2 epochs\n  epochs 2, steps 100" in text


def test_one_line_per_change_elsewhere():
    same = status(service_pb2.JOB_STATE_RUNNING, 10)
    client = FakeClient([[same, same, status(service_pb2.JOB_STATE_CANCELLED, 10,
                                             reason="cancelled by user")]])
    out = io.StringIO()
    final = pstrain.Job(client, "job-7").watch(file=out)
    assert final.state == "CANCELLED"
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("job-7 RUNNING  epoch 1/2  step 10/100")
    assert lines[1] == "job-7 CANCELLED: cancelled by user"
    assert "\r" not in out.getvalue()


def test_gives_up_reconnecting():
    client = FakeClient([[pstrain.UnavailableError("refused")]] * 50)
    with pytest.raises(pstrain.UnavailableError, match="gave up reconnecting"):
        pstrain.Job(client, "job-7").watch(progress=False, reconnect_limit_s=0.5)


def test_not_found_is_not_retried():
    client = FakeClient([[pstrain.NotFoundError("unknown job 'job-7'")]])
    with pytest.raises(pstrain.NotFoundError):
        pstrain.Job(client, "job-7").watch(progress=False)
    assert client.calls == 1
