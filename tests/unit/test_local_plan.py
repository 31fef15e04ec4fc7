import argparse

import pytest

from persia.local import nn_thread_env, plan, server_roles


def args(tmp_path, **kw):
    for name in ("train.py", "dl.py", "emb.yml", "glob.yml"):
        (tmp_path / name).write_text("")
    base = dict(nn_worker=str(tmp_path / "train.py"), data_loader=str(tmp_path / "dl.py"),
                embedding_config=str(tmp_path / "emb.yml"), global_config=str(tmp_path / "glob.yml"),
                num_ps=2, num_embedding_workers=3, nproc_per_node=1, num_data_loaders=2, job_name="j",
                cores=2, nn_threads=None, env=["EXTRA=1"])
    base.update(kw)
    return argparse.Namespace(**base)


def test_plan_starts_every_role_with_its_replica_env(tmp_path):
    roles = plan(args(tmp_path), python="py")
    names = [r.name for r in roles]
    assert names == ["ps-0", "ps-1", "ew-0", "ew-1", "ew-2", "nn", "dl-0", "dl-1"]
    ps1 = roles[1]
    assert ps1.argv[:4] == ["py", "-m", "persia.launcher", "embedding-parameter-server"]
    assert ps1.argv[ps1.argv.index("--replica-index") + 1] == "1"
    assert ps1.env["REPLICA_SIZE"] == "2" and ps1.env["PERSIA_JOB_NAME"] == "j"
    assert all(r.env["EXTRA"] == "1" for r in roles)
    dl1 = roles[-1]
    assert dl1.argv[dl1.argv.index("--replica-size") + 1] == "2"


@pytest.mark.parametrize("colocate", [False, True])
def test_servers_started_from_a_ranked_process_take_no_rank_of_it(colocate):
    """persia.helper starts servers from the user's process, which may be a torchrun rank."""
    ranked = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "REPLICA_INDEX": "7", "KEEP": "x"}
    roles = server_roles(["py"], ranked, 2, 2, colocate_ps=colocate)
    assert [r.env["REPLICA_INDEX"] for r in roles] == (["0", "1"] if colocate else ["0", "1", "0", "1"])
    assert all(r.env["KEEP"] == "x" and not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} & r.env.keys() for r in roles)
    assert ranked["RANK"] == "3"  # the caller's mapping is left as it was


def test_nn_threads_default_to_measuring_from_the_share_of_the_cores():
    assert nn_thread_env(None, cores=2, nn_procs=1) == {"PERSIA_TORCH_THREADS": "auto:2", "OMP_NUM_THREADS": "2"}
    assert nn_thread_env("auto", cores=16, nn_procs=4) == {"PERSIA_TORCH_THREADS": "auto:4", "OMP_NUM_THREADS": "4"}
    assert nn_thread_env(None, cores=2, nn_procs=4)["PERSIA_TORCH_THREADS"] == "auto:1"  # never 0
    assert nn_thread_env(3, cores=2, nn_procs=1) == {"PERSIA_TORCH_THREADS": "3", "OMP_NUM_THREADS": "3"}
    assert nn_thread_env("auto:3", cores=2, nn_procs=1) == {"PERSIA_TORCH_THREADS": "auto:3", "OMP_NUM_THREADS": "3"}


def test_plan_rejects_bad_counts_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="--num-ps must be >= 1, got 0"):
        plan(args(tmp_path, num_ps=0))
    with pytest.raises(FileNotFoundError, match="--nn-worker"):
        plan(args(tmp_path, nn_worker=str(tmp_path / "missing.py")))


def test_colocated_ps_runs_inside_each_embedding_worker(tmp_path):
    roles = plan(args(tmp_path, num_ps=2, num_embedding_workers=2, colocate_ps=True), python="py")
    assert [r.name for r in roles] == ["ew-ps-0", "ew-ps-1", "nn", "dl-0", "dl-1"]
    ew1 = roles[1]
    assert ew1.kind == "ew" and ew1.is_server  # its death restarts the job like any server's
    assert ew1.argv[3] == "embedding-worker" and "--with-ps" in ew1.argv
    assert ew1.argv[ew1.argv.index("--replica-index") + 1] == "1"
    assert ew1.argv[ew1.argv.index("--ps-replica-size") + 1] == "2"
    assert ew1.argv[ew1.argv.index("--ps-port") + 1] == "0"


def test_colocated_ps_needs_one_replica_per_embedding_worker(tmp_path):
    with pytest.raises(ValueError, match=r"--num-ps \(2\) must equal --num-embedding-workers \(3\)"):
        plan(args(tmp_path, num_ps=2, num_embedding_workers=3, colocate_ps=True))


def test_the_nn_worker_gets_its_thread_setting_and_the_others_one_thread(tmp_path):
    roles = {r.name: r for r in plan(args(tmp_path, cores=2, nn_threads=None), python="py")}
    assert roles["nn"].env["PERSIA_TORCH_THREADS"] == "auto:2" and roles["nn"].env["OMP_NUM_THREADS"] == "2"
    assert roles["dl-0"].env["PERSIA_TORCH_THREADS"] == "1" and roles["ps-0"].env["OMP_NUM_THREADS"] == "1"
    assert all(r.env["OMP_WAIT_POLICY"] == "PASSIVE" for r in roles.values())
    nn = next(r for r in plan(args(tmp_path, nn_threads=2), python="py") if r.name == "nn")
    assert nn.env["PERSIA_TORCH_THREADS"] == "2"


def test_nn_threads_argument_takes_a_count_or_auto():
    from persia.local import _nn_threads_arg

    assert _nn_threads_arg("auto") == "auto" and _nn_threads_arg("AUTO") == "auto" and _nn_threads_arg("3") == 3
    assert _nn_threads_arg("auto:3") == "auto:3"
    for bad, msg in (("0", "--nn-threads must be >= 1, got '0'"), ("many", "a count, 'auto' or 'auto:<count>', got 'many'"),
                     ("auto:0", ">= 1, got 'auto:0'")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            _nn_threads_arg(bad)


def test_the_grace_period_flag_reaches_every_role(tmp_path):
    """--grace-period sets PERSIA_GRACE_PERIOD_SECONDS for the roles: the NN rank's SIGTERM
    watchdog and the nn launcher's stop of its ranks use it, not their default 30 s."""
    roles = plan(args(tmp_path, grace_period=2.5), python="py", base_env={"PERSIA_GRACE_PERIOD_SECONDS": "30"})
    assert {r.env["PERSIA_GRACE_PERIOD_SECONDS"] for r in roles} == {"2.5"}
