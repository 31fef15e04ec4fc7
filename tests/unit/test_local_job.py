"""Local mode's supervision with real processes and real signals (no nats-server: none needed)."""

import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from persia.local import LocalJob, RoleProcess, _Output, _pump
from persia.procs import spawn, stop_in_order
from tests.faults.localjob import alive
from tests.polling import poll_until


class _Lines(_Output):
    """An _Output that also remembers its lines and wakes whoever waits for one."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.cond = threading.Condition()

    def line(self, prefix, text):
        super().line(prefix, text)
        with self.cond:
            self.seen.append(f"[{prefix}] {text}")
            self.cond.notify_all()

    def wait_for(self, words: str, timeout_s: float = 30) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: any(words in s for s in self.seen), timeout_s)


def _role(name, kind, code):
    return RoleProcess(name, kind, [sys.executable, "-c", code], dict(os.environ))


STUBBORN_LEADER = r"""
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"],
    stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(120)
"""


def _run_stopped(job) -> list:
    """``job.run()`` with SIGTERM wired to the job as local mode wires it; every role stopped after."""
    restore = _on_sigterm(job)
    try:
        return job.run()
    finally:
        job.stop_roles(0)
        restore()


def test_the_sigkill_at_the_grace_period_takes_the_roles_process_group():
    """A role (the nn launcher) and what it started (its ranks) ignore SIGTERM: at the grace period
    the whole process group is SIGKILLed, not only the role, so no rank outlives the job."""
    leader = spawn([sys.executable, "-c", STUBBORN_LEADER], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(leader.stdout.readline())
        stop_in_order([[leader]], 0.5, kill_groups=True)
        assert leader.returncode == -9
        poll_until(lambda: not alive(grandchild), "the role's child dies with it", deadline_s=10)
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)


def _on_sigterm(job):
    old = signal.signal(signal.SIGTERM, lambda signum, _f: job.signals.append(signum))
    return lambda: signal.signal(signal.SIGTERM, old)


def test_a_sigterm_while_the_job_restarts_starts_no_new_incarnation(tmp_path):
    """The NN role is SIGKILLed (a restart); while the roles stop, SIGTERM arrives (the loader
    sends it to us on its own SIGTERM): the job stops as terminated instead of starting again."""
    marker = tmp_path / "dl-ready"
    dl = _role("dl-0", "dl", f"""
import os, pathlib, signal, sys, time
def on_term(*_):
    os.kill(os.getppid(), signal.SIGTERM)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
pathlib.Path({str(marker)!r}).write_text("")
time.sleep(120)
""")
    nn = _role("nn", "nn", f"""
import os, pathlib, signal, time
end = time.monotonic() + 30
while not pathlib.Path({str(marker)!r}).exists() and time.monotonic() < end:
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
""")
    job = LocalJob([nn, dl], None, _Lines(), {}, max_restarts=3, grace_s=5)
    assert _run_stopped(job) == ["terminated"]
    assert job.generation == 1 and job.restarts == 0


def test_a_sigterm_while_waiting_for_the_loaders_stops_the_job(tmp_path):
    """Training finished, a loader is still running: SIGTERM then stops the job as terminated at
    once (before: ignored for up to 30 s, then reported done)."""
    out = _Lines()
    dl = _role("dl-0", "dl", "import time; time.sleep(120)")
    nn = _role("nn", "nn", "pass")
    job = LocalJob([nn, dl], None, out, {}, max_restarts=0, grace_s=2)

    def terminate_when_waiting():
        if out.wait_for("waiting up to"):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_waiting, daemon=True).start()
    t0 = time.monotonic()
    assert _run_stopped(job) == ["terminated"]
    assert time.monotonic() - t0 < 20
    assert job.procs["dl-0"].returncode is not None


def test_a_result_line_that_does_not_parse_is_named_in_a_warning(capsys):
    out = _Output()
    out.line("nn", 'PERSIA_RESULT {"auc": 0.7')
    assert out.results == []
    text = capsys.readouterr().out
    assert "[local] WARNING: nn printed a PERSIA_RESULT line that does not parse" in text


def test_report_result_writes_the_line_and_its_newline_at_once(monkeypatch):
    from persia import utils

    writes = []

    class Recorder(io.StringIO):
        def write(self, s):
            writes.append(s)
            return len(s)

    monkeypatch.setattr(sys, "stdout", Recorder())
    utils.report_result(auc=0.75)
    assert len(writes) == 1 and writes[0].startswith(utils.RESULT_PREFIX) and writes[0].endswith("}\n")


def test_the_pump_keeps_draining_when_our_stdout_is_a_broken_pipe(monkeypatch):
    """Our stdout gone (the reader of `persia-launcher local | head` exited): the role's output is
    still read to its end, so the role does not block on a full pipe; its result is still seen."""

    class Broken(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Broken())
    out = _Output()
    chatty = subprocess.Popen([sys.executable, "-c",
                               "import sys\nfor i in range(20000): sys.stdout.write('x' * 100 + '\\n')\n"
                               "print('PERSIA_RESULT {\"auc\": 0.5}', flush=True)"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pump = threading.Thread(target=_pump, args=(chatty, "nn", out), daemon=True)
    pump.start()
    try:
        assert chatty.wait(30) == 0
    finally:
        if chatty.poll() is None:
            chatty.kill()
    pump.join(10)
    assert not pump.is_alive()
    assert out.results == [{"auc": 0.5}] and out.write_errors > 0


class _DyingNats:
    """A nats-server stand-in whose every (re)start is a process that exits at once."""

    url = "nats://127.0.0.1:1"

    def __init__(self):
        self.starts = 0
        self.restart()

    def restart(self):
        self.starts += 1
        self.process = subprocess.Popen([sys.executable, "-c", "print('[FTL] bad'); raise SystemExit(1)"],
                                        stdout=subprocess.DEVNULL)
        return self.url

    def last_output(self):
        return "[FTL] bad"


def test_a_nats_server_that_keeps_dying_fails_the_job_after_max_restarts():
    nats = _DyingNats()
    job = LocalJob([_role("dl-0", "dl", "import time; time.sleep(120)")], nats, _Lines(), {},
                   max_restarts=2, grace_s=1)
    result = []
    runner = threading.Thread(target=lambda: result.append(job.run()), daemon=True)
    runner.start()
    runner.join(60)
    job.stop_roles(0)
    assert not runner.is_alive(), "restarted the nats-server for ever"
    (failed,) = result
    assert len(failed) == 1 and "no restarts left (2 of --max-restarts 2 used on nats-server)" in failed[0]
    assert "[FTL] bad" in failed[0] and nats.starts == 3


def test_a_nats_server_that_cannot_start_says_why():
    from persia.nats_server import NatsServer

    server = NatsServer(extra_config="this is { not a valid config\n")
    with pytest.raises(RuntimeError, match=r"exited with code \d+ at start; its last output:\n(.|\n)*\S"):
        server.start()


def test_loaders_ending_after_training_are_named_but_do_not_decide_the_job():
    """A loader whose trainer finished with batches left fails with TrainerGone about when local
    mode stops the loaders still running: which came first made the job pass or fail at random."""
    from persia.local import loaders_after_training

    lines = loaders_after_training({"dl-0": 0, "dl-1": None, "dl-2": 1, "dl-3": -9})
    assert lines == [
        "dl-1 still running after training finished: stopping it",
        "WARNING: dl-2 exit code 1 after training finished (the NN workers decide the job: not a failure of it; "
        "its output above says why)",
        "WARNING: dl-3 killed by SIGKILL after training finished (the NN workers decide the job: not a failure of "
        "it; its output above says why)",
    ]



def test_the_untrained_note_reads_the_trainers_counts():
    from persia.local import untrained_note

    assert untrained_note({"batches_trained": 0, "batches_evaluated": 0}).startswith("WARNING: the NN workers trained no batch")
    assert untrained_note({"batches_trained": 0, "batches_evaluated": 3}) is None  # an evaluation-only job
    assert untrained_note({"batches_trained": 5}) is None
    assert untrained_note({}) is None  # a trainer that reports no counts: nothing known
