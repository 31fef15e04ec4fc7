"""Kernel-visible thread names (persia.thread_names): the naming rule, and real threads reading
their own ``/proc`` entry in a fresh interpreter (the hook is process-wide, so not in pytest's)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from persia.thread_names import MAX_BYTES, os_thread_name

LINUX = sys.platform.startswith("linux")


@pytest.mark.parametrize("name, expected", [
    ("persia-forward_0", "forward_0"),
    ("persia-replay", "replay"),
    ("persia-sigterm-watchdog", "sigterm-watchdo"),  # 15 bytes
    ("nats-local-123456", "nats-local-1234"),  # no prefix to drop: cut
    ("bus-local_0", "bus-local_0"),
    ("persia-", "persia-"),  # nothing would be left
    ("", ""),
])
def test_name_rule(name, expected):
    assert os_thread_name(name) == expected
    assert len(os_thread_name(name).encode()) <= MAX_BYTES


def test_a_character_is_never_cut_in_two():
    name = "persia-" + "é" * 10  # 2 bytes each: 7 whole characters fit in 15 bytes
    assert os_thread_name(name) == "é" * 7


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


READ_COMM = """
    import json, threading, sys
    from concurrent.futures import ThreadPoolExecutor

    def comm():
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()
"""


@pytest.mark.skipif(not LINUX, reason="thread names are read from /proc")
def test_threads_started_after_install_carry_their_names():
    seen = _run(READ_COMM + """
    from persia.thread_names import name_os_threads
    before = {}
    t = threading.Thread(target=lambda: before.update(name=comm()), name="persia-early")
    t.start(); t.join()
    assert name_os_threads() and name_os_threads()  # idempotent
    after = {}
    t = threading.Thread(target=lambda: after.update(name=comm()), name="persia-replay")
    t.start(); t.join()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="persia-forward") as pool:
        pooled = pool.submit(comm).result()
    print(json.dumps({"before": before["name"], "after": after["name"], "pooled": pooled, "main": comm()}))
    """)
    main = seen["main"]
    assert seen["before"] == main  # a thread started before install keeps the process's name
    assert seen["after"] == "replay"
    assert seen["pooled"] == "forward_0"
    assert main not in ("replay", "forward_0")  # the main thread is not renamed


@pytest.mark.skipif(not LINUX, reason="thread names are read from /proc")
def test_a_profile_function_set_before_is_kept_in_new_threads():
    seen = _run(READ_COMM + """
    calls = []
    def mine(frame, event, arg):
        calls.append(event)
    threading.setprofile(mine)
    from persia.thread_names import name_os_threads
    name_os_threads()
    result = {}
    def work():
        result["profile_is_mine"] = sys.getprofile() is mine
        result["name"] = comm()
    t = threading.Thread(target=work, name="persia-dispatch")
    t.start(); t.join()
    print(json.dumps({**result, "mine_called": len(calls) > 0}))
    """)
    assert seen == {"profile_is_mine": True, "name": "dispatch", "mine_called": True}


@pytest.mark.skipif(not LINUX, reason="thread names are read from /proc")
def test_contexts_name_the_threads_they_start():
    seen = _run(READ_COMM + """
    from persia.context import BaseCtx
    BaseCtx()
    out = {}
    t = threading.Thread(target=lambda: out.update(name=comm()), name="persia-update-flusher")
    t.start(); t.join()
    print(json.dumps(out))
    """)
    assert seen == {"name": "update-flusher"}


@pytest.mark.skipif(not LINUX, reason="thread names are read from /proc")
def test_launcher_roles_name_their_threads():
    """``persia-launcher <role>`` installs it before the role starts anything (its ``--help``
    exits inside argument parsing, so the check patches the role's handler instead)."""
    seen = _run(READ_COMM + """
    from persia import launcher
    out = {}
    def role(args):
        t = threading.Thread(target=lambda: out.update(name=comm()), name="persia-rdzv")
        t.start(); t.join()
        return 0
    launcher.run_data_loader = role
    launcher.main(["data-loader", "loader.py"])
    print(json.dumps(out))
    """)
    assert seen == {"name": "rdzv"}
