"""The training thread's own CPU (``PERSIA_TRAINING_CPUS``) and the launcher's CPU split.

The decisions are pure. The thread mechanics run in a fresh process (affinity is per thread and
outlives a test), which reads every thread's CPUs back from ``/proc/self/task/*/status``: helper
threads started before and after placement, torch's OpenMP team on two threads, and the restore."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from persia.errors import PersiaValidationError
from persia.local import CpuSplit, cpu_split, plan
from persia.nn_worker.cpu_placement import (ENV, CpuPlan, TrainingPlacement, cgroup_cpu_quota, cpu_plan, format_cpus,
                                           parse_cfs, parse_cpu_max, sweep_due, thread_masks)

from tests.unit.test_local_plan import args as local_args


def test_unset_places_nothing():
    for value in (None, "", "  "):
        placed, why = cpu_plan(value, 0, {0, 1})
        assert placed is None and "unset" in why


def test_one_rank_gets_its_cpu_and_the_rest_share_the_others():
    placed, why = cpu_plan("0", 0, {0, 1, 2, 3})
    assert placed == CpuPlan(own=0, rest=frozenset({1, 2, 3}), shared=frozenset({0, 1, 2, 3}))
    assert why == "training thread on CPU 0, other threads on CPUs 1-3"


def test_a_process_started_without_its_training_cpu_still_gets_it():
    # persia-launcher local starts every role on the other CPUs; the training thread moves out
    placed, _ = cpu_plan("0", 0, {1})
    assert placed == CpuPlan(own=0, rest=frozenset({1}), shared=frozenset({0, 1}))


def test_each_local_rank_takes_its_own_entry_and_none_runs_on_another_ranks_cpu():
    placed, _ = cpu_plan("0, 1", 1, {0, 1, 2, 3})
    assert placed == CpuPlan(own=1, rest=frozenset({2, 3}), shared=frozenset({1, 2, 3}))


def test_no_cpu_left_for_the_others_places_nothing_and_says_so():
    placed, why = cpu_plan("0,1", 0, {0, 1})
    assert placed is None and "no CPU would be left" in why and "0-1" in why


@pytest.mark.parametrize("value", ["x", "-1", "0;1", "1.5", "0,"])
def test_a_bad_setting_is_refused_naming_it(value):
    with pytest.raises(PersiaValidationError, match=rf"{ENV} must be .auto. or list CPU numbers .*got {value!r}"):
        cpu_plan(value, 0, {0, 1})


def test_a_cpu_named_twice_or_a_missing_rank_is_refused():
    with pytest.raises(PersiaValidationError, match="names a CPU twice"):
        cpu_plan("1,1", 0, {0, 1, 2})
    with pytest.raises(PersiaValidationError, match="names 1 CPU.*local rank 1"):
        cpu_plan("0", 1, {0, 1, 2})


def test_auto_gives_each_local_rank_one_of_the_lowest_cpus_the_container_owns():
    placed, why = cpu_plan("auto", 0, {4, 5, 6, 7}, local_world_size=1, cpu_quota=4.0)
    assert placed == CpuPlan(own=4, rest=frozenset({5, 6, 7}), shared=frozenset({4, 5, 6, 7}))
    assert why == "training thread on CPU 4, other threads on CPUs 5-7"
    placed, _ = cpu_plan(" AUTO ", 1, {4, 5, 6, 7}, local_world_size=2, cpu_quota=None)  # no quota: its own
    assert placed == CpuPlan(own=5, rest=frozenset({6, 7}), shared=frozenset({5, 6, 7}))


def test_auto_places_nothing_on_shared_cpus_or_without_a_spare_one():
    placed, why = cpu_plan("auto", 0, set(range(16)), local_world_size=1, cpu_quota=2.5)  # a Burstable pod
    assert placed is None and "16 CPUs (0-15) but its CPU quota is 2.5" in why and "static CPU manager" in why
    placed, why = cpu_plan("auto", 0, {2, 3}, local_world_size=2, cpu_quota=2.0)
    assert placed is None and "2 CPU(s) (2-3) for 2 local NN rank(s) leave none" in why
    placed, why = cpu_plan("auto", 0, {3}, cpu_quota=None)
    assert placed is None and "1 CPU(s) (3) for 1 local NN rank(s)" in why
    with pytest.raises(PersiaValidationError, match="LOCAL_WORLD_SIZE must be >= 1, got 0"):
        cpu_plan("auto", 0, {0, 1}, local_world_size=0)


def test_cgroup_quotas_read_in_cpus_from_either_cgroup_version(tmp_path):
    assert parse_cpu_max("max 100000\n") is None and parse_cpu_max("250000 100000") == 2.5
    assert parse_cfs("-1", "100000") is None and parse_cfs("200000\n", "100000\n") == 2.0
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("300000 100000\n")
    assert cgroup_cpu_quota(str(v2)) == 3.0
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(v1)) == 1.5
    assert cgroup_cpu_quota(str(tmp_path / "none")) is None  # nothing readable: no quota known
    (v2 / "cpu.max").write_text("garbage")
    assert cgroup_cpu_quota(str(v2)) is None


def test_auto_from_the_environment_uses_this_processes_cpus(monkeypatch, caplog):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2})
    monkeypatch.setattr("persia.nn_worker.cpu_placement.cgroup_cpu_quota", lambda: 3.0)
    placement = TrainingPlacement.from_env({ENV: "auto", "LOCAL_WORLD_SIZE": "2"}, local_rank=1)
    assert placement is not None and placement.plan == CpuPlan(own=1, rest=frozenset({2}), shared=frozenset({1, 2}))
    monkeypatch.setattr("persia.nn_worker.cpu_placement.cgroup_cpu_quota", lambda: 1.0)
    with caplog.at_level("INFO", logger="persia.nn_worker.cpu_placement"):
        assert TrainingPlacement.from_env({ENV: "auto"}) is None
    assert "CPU quota is 1" in caplog.text and all(r.levelname == "INFO" for r in caplog.records)
    with pytest.raises(PersiaValidationError, match="LOCAL_WORLD_SIZE must be a count, got 'two'"):
        TrainingPlacement.from_env({ENV: "auto", "LOCAL_WORLD_SIZE": "two"})


def test_masks_follow_the_thread_count():
    placed = CpuPlan(own=0, rest=frozenset({1}), shared=frozenset({0, 1}))
    tids = [10, 11, 12, 13]
    one = thread_masks(placed, 1, tids, training=10, team=frozenset({10, 12}))
    assert one == {10: {0}, 11: {1}, 12: {1}, 13: {1}}  # a sleeping team thread goes with the rest
    two = thread_masks(placed, 2, tids, training=10, team=frozenset({10, 12}))
    assert two == {10: {0, 1}, 11: {1}, 12: {0, 1}, 13: {1}}


def test_sweeps_come_early_then_rarely():
    assert [s for s in range(0, 70) if sweep_due(s)] == [1, 2, 4, 8, 16, 32, 64]
    assert sweep_due(3000) and not sweep_due(3001)


def test_cpu_lists_read_like_the_kernels():
    assert format_cpus([3, 0, 1, 2, 6, 8, 9]) == "0-3,6,8-9"
    assert format_cpus({5}) == "5" and format_cpus([]) == ""


def test_the_launcher_gives_each_nn_rank_a_cpu_when_one_is_left():
    split, why = cpu_split({0, 1}, 1)
    assert split == CpuSplit(training=(0,), rest=frozenset({1}))
    assert "rank 0 on CPU 0" in why and "every other thread on CPUs 1" in why
    split, _ = cpu_split([7, 4, 5, 6], 2)
    assert split == CpuSplit(training=(4, 5), rest=frozenset({6, 7}))


def test_the_launcher_places_nothing_without_a_spare_cpu_or_when_off():
    split, why = cpu_split({0, 1}, 2)
    assert split is None and "2 CPU(s) for 2 NN rank(s)" in why
    split, why = cpu_split({0, 1, 2, 3}, 1, "off")
    assert split is None and "--cpu-placement off" in why
    with pytest.raises(ValueError, match="--cpu-placement must be auto or off, got 'on'"):
        cpu_split({0, 1}, 1, "on")


def test_only_nn_ranks_are_told_their_cpus(tmp_path):
    roles = plan(local_args(tmp_path), python="py", split=CpuSplit((0,), frozenset({1})))
    assert [r.name for r in roles if ENV in r.env] == ["nn"]
    assert next(r for r in roles if r.name == "nn").env[ENV] == "0"
    assert all(ENV not in r.env for r in plan(local_args(tmp_path), python="py"))


CHILD = r"""
import json, os, threading
os.sched_setaffinity(0, {0, 1})  # the CPUs the process starts on (here, not in a preexec_fn: no fork with threads)
import torch
from persia.nn_worker.cpu_placement import TrainingPlacement

def cpus(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(l for l in f if l.startswith("Cpus_allowed_list:"))
    return line.split(":", 1)[1].strip()

def all_cpus():
    return {int(t): cpus(t) for t in os.listdir("/proc/self/task")}

stop, started = threading.Event(), threading.Event()
def helper(out):
    out.append(threading.get_native_id()); started.set(); stop.wait()

before, after = [], []
threading.Thread(target=helper, args=(before,), daemon=True).start()
assert started.wait(30)
torch.set_num_threads(1)
placement = TrainingPlacement.from_env({"PERSIA_TRAINING_CPUS": os.environ["PLACEMENT_SETTING"]})
me = threading.get_native_id()
placement.start(1)
report = {"one": all_cpus()}
started.clear()
threading.Thread(target=helper, args=(after,), daemon=True).start()  # inherits CPU 0 ...
assert started.wait(30)
report["made_after"] = cpus(after[0])
placement.step_done()  # ... until the sweep after step 1
report["swept"] = all_cpus()
torch.set_num_threads(2)
placement.threads_changed(2)
(torch.ones(1 << 20) * 2.0).sum()
report["two"] = all_cpus()
report["team"] = sorted(placement.team)
torch.set_num_threads(1)
placement.threads_changed(1)
report["back_to_one"] = all_cpus()
placement.stop()
report["stopped"] = all_cpus()
report.update(me=me, before=before[0], after=after[0])
print(json.dumps(report))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1")
@pytest.mark.parametrize("setting", ["0", "auto"])
def test_threads_run_where_the_plan_says_and_go_back_after(setting):
    if setting == "auto" and (cgroup_cpu_quota() or 2.0) < 2.0:
        pytest.skip("this container's CPU quota is under 2 CPUs: auto rightly places nothing here")
    env = dict(os.environ, PLACEMENT_SETTING=setting)
    env.pop(ENV, None)
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    me, before, after = str(r["me"]), str(r["before"]), str(r["after"])
    assert r["one"][me] == "0"
    assert set(t for t, c in r["one"].items() if t != me and c != "1") == set()  # the helper, gRPC's, ...
    assert r["made_after"] == "0"  # a thread the training thread starts inherits its CPU
    assert r["swept"][after] == "1" and r["swept"][me] == "0"
    team = [str(t) for t in r["team"]]
    assert len(team) == 2 and me in team  # the caller is thread 0 of its team
    assert all(r["two"][t] == "0-1" for t in team) and r["two"][before] == "1"
    assert r["back_to_one"][me] == "0" and all(r["back_to_one"][t] == "1" for t in team if t != me)
    assert set(r["stopped"].values()) == {"0-1"}
