"""The images' invariants, checked without building them (`make images-check` builds and runs them,
too slow for `make test`): the base is a build argument, the compiler stays in the builder stage,
the final stage runs as a non-root user with the entry point the operator renders, torch is always
the pinned CPU/CUDA build and never PyPI's default, Python dependencies are locked, no secret is
baked in; and the decisions of images/build.py (tool, command lines, wheel choice, lock)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from operator_testkit import REPO
from persia_operator import constants as C

IMAGES = REPO / "images"
NAMES = ("runtime-cpu", "runtime-cuda", "operator")
RUNTIMES = ("runtime-cpu", "runtime-cuda")


def load_build():
    spec = importlib.util.spec_from_file_location("images_build", IMAGES / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


build = load_build()


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (IMAGES / f"{name}.Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def stages(name: str) -> list[list[tuple[str, str]]]:
    """The build stages, each from its FROM; global ARGs before the first FROM are dropped."""
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(name):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def torch_pin() -> str:
    pins = [d for d in project()["optional-dependencies"]["runtime"] if d.replace(" ", "").startswith("torch==")]
    assert len(pins) == 1
    return pins[0].split("==")[1]


@pytest.mark.parametrize("name, base", [("runtime-cpu", "BASE_IMAGE=python:3.11-slim"),
                                        ("operator", "BASE_IMAGE=python:3.11-slim"),
                                        ("runtime-cuda", "CUDA_IMAGE=nvidia/cuda:")])
def test_base_is_a_build_argument_with_the_public_default(name, base):
    ins = instructions(name)
    assert ins[0][0] == "ARG" and ins[0][1].startswith(base)
    arg = base.split("=")[0]
    assert [s[0][1] for s in stages(name)] == [f"${{{arg}}} AS builder", f"${{{arg}}}"]


@pytest.mark.parametrize("name", NAMES)
def test_compiler_stays_in_the_builder_and_only_the_venv_leaves_it(name):
    builder, final = stages(name)
    assert any("gcc" in args and "apt-get install" in args for op, args in builder if op == "RUN")
    final_text = " ".join(args for _, args in final)
    for tool in ("gcc", "build-essential", "python3-dev", "pip install", "pip wheel"):
        assert tool not in final_text, f"{name}: {tool} in the final stage"
    copies = [args for op, args in final if op == "COPY" and args.startswith("--from=")]
    assert copies == ["--from=builder /opt/venv /opt/venv",
                      "--from=builder /opt/persia/pip-freeze.txt /opt/persia/"]


@pytest.mark.parametrize("name", NAMES)
def test_final_stage_runs_as_the_non_root_user_with_a_writable_home_in_tmp(name):
    final = stages(name)[-1]
    users = [args for op, args in final if op == "USER"]
    assert users == [f"{build.RUNTIME_UID}:{build.RUNTIME_UID}"] and build.RUNTIME_UID != 0
    text = " ".join(args for _, args in final)
    uid = build.RUNTIME_UID
    assert f"groupadd --gid {uid} persia && useradd --uid {uid} --gid {uid} " in text
    assert "--home-dir /tmp" in text
    env = " ".join(args for op, args in final if op == "ENV")
    assert "HOME=/tmp" in env and "TMPDIR=/tmp" in env
    assert ("WORKDIR", "/tmp") in final


def test_operator_chart_runs_the_image_user():
    values = yaml.safe_load((REPO / "charts/persia-operator/values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == build.RUNTIME_UID


def test_the_operators_pods_run_the_runtime_images_user():
    """Files written to a volume whose storage ignores fsGroup (NFS, many RWX classes) belong to
    the pod's uid; one other than the images' user (1000 before) left them to a stranger."""
    from persia_operator.podsecurity import pod_security_context

    context = pod_security_context()
    assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == build.RUNTIME_UID


@pytest.mark.parametrize("name, entry, cmd", [("runtime-cpu", "persia-launcher", '["--help"]'),
                                              ("runtime-cuda", "persia-launcher", '["--help"]'),
                                              ("operator", "persia-operator", '["run", "--all-namespaces"]')])
def test_entry_points(name, entry, cmd):
    final = stages(name)[-1]
    assert ("ENTRYPOINT", f'["{entry}"]') in final and ("CMD", cmd) in final
    assert entry in project()["scripts"]


def test_tags_are_the_ones_the_operator_and_chart_use():
    chart = yaml.safe_load((REPO / "charts/persia-operator/Chart.yaml").read_text())
    assert build.IMAGES["operator"].tag == f"persiaml/persia-operator:{chart['appVersion']}"
    assert build.IMAGES["runtime-cpu"].tag == C.DEFAULT_CPU_IMAGE == f"persiaml/persia-cpu-runtime:{chart['appVersion']}"
    assert build.IMAGES["runtime-cuda"].tag == C.DEFAULT_CUDA_IMAGE == f"persiaml/persia-cuda-runtime:{chart['appVersion']}"
    assert project()["version"] == chart["appVersion"]  # no image of ours is :latest (the kubelet would pull it always)


@pytest.mark.parametrize("name, label", [("runtime-cpu", "+cpu"), ("runtime-cuda", "+${TORCH_CUDA}")])
def test_torch_is_the_pinned_labelled_build_never_pypis_default(name, label):
    ins = instructions(name)
    assert ("ARG", f"TORCH_VERSION={torch_pin()}") in ins
    mentions = re.findall(r"torch==\S+", " ".join(args for op, args in ins if op == "RUN"))
    assert mentions and all(m.startswith(f'torch==${{TORCH_VERSION}}{label}"') for m in mentions)
    # the build fails unless the installed torch carries that label
    assert any(f"torch.__version__ == '${{TORCH_VERSION}}{label}'" in args for _, args in ins)


def test_operator_image_has_no_torch():
    text = " ".join(args for _, args in instructions("operator"))
    assert "torch==" not in text and "find_spec('torch') is None" in text


@pytest.mark.parametrize("name", NAMES)
def test_installs_the_projects_own_wheel_with_its_extra_under_the_lock(name):
    image = build.IMAGES[name]
    runs = [args for op, args in stages(name)[0] if op == "RUN"]
    lock = f"--constraint images/requirements/{image.lock}.txt"
    assert any("pip wheel --no-deps --wheel-dir /dist ." in r for r in runs)
    assert any(f'{lock} "$(ls /dist/persia_k8s-*.whl)[{image.extra}]"' in r for r in runs)
    assert all(lock in part for r in runs for part in r.split("&&") if "pip install" in part)
    for op, args in instructions(name):
        if op == "COPY" and not args.startswith("--from="):
            for source in shlex.split(args)[:-1]:
                assert (REPO / source.rstrip("/")).exists(), f"{name}: COPY {source} does not exist"


def test_dockerignore_sends_what_the_dockerfiles_copy():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines  # everything not named below stays out
    sent = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    for name in NAMES:
        for op, args in instructions(name):
            if op == "COPY" and not args.startswith("--from="):
                for source in shlex.split(args)[:-1]:
                    assert source.split("/")[0] in sent, f"{name}: COPY {source} is dockerignored"


@pytest.mark.parametrize("lock, extra", [("runtime", "runtime"), ("operator", "operator")])
def test_locks_pin_every_dependency_of_the_extra_except_torch(lock, extra):
    lines = [x for x in (IMAGES / "requirements" / f"{lock}.txt").read_text().splitlines()
             if x and not x.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9-]+==\S+", x) for x in lines), lines
    pinned = {x.split("==")[0] for x in lines}
    wanted = project()["dependencies"] + project()["optional-dependencies"][extra]
    names = {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ \[]", d)[0]).lower() for d in wanted}
    assert names - {"torch"} <= pinned and "torch" not in pinned


@pytest.mark.parametrize("name", NAMES)
def test_no_secret_is_baked_in(name):
    for op, args in instructions(name):
        if op in ("ARG", "ENV"):
            assert not re.search(r"(PASSWORD|TOKEN|SECRET|_KEY|CREDS)\w*=", args, flags=re.I), args
    assert ("ARG", "PIP_CERT") in instructions(name)  # a path given per build, never a default


@pytest.mark.parametrize("name", RUNTIMES)
def test_runtime_images_carry_the_example_the_manifest_uses(name):
    assert ("COPY", f"examples/adult-income/ {build.EXAMPLE}/") in stages(name)[-1]
    manifest = (REPO / "examples/adult-income/persiajob.yaml").read_text()
    assert f"{build.EXAMPLE}/train.py" in manifest


def test_image_check_runs_the_makefiles_demo():
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), flags=re.M)
    words = shlex.split(recipe.group(1).replace("\\\n", " "))
    assert words[0].endswith("/persia-launcher")
    expected = ["persia-launcher", *(w.replace("examples/adult-income", build.EXAMPLE) for w in words[1:])]
    assert build.DEMO == expected


# ---- images/build.py decisions


def test_tool_is_docker_when_its_daemon_answers_else_buildah_else_a_clear_error():
    assert build.choose_tool(True, True) == "docker"
    assert build.choose_tool(False, True) == "buildah"
    with pytest.raises(SystemExit, match="buildah"):
        build.choose_tool(False, False)


def test_plan_uses_the_local_base_offline_and_the_public_one_with_docker():
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    offline = build.make_plan("buildah", "auto", True, ca)
    assert offline.local_base and offline.build_args == {
        "BASE_IMAGE": build.LOCAL_BASE, "TORCH_INDEX_URL": build.PUBLIC_PYPI,
        "PIP_CERT": "/hostcerts/ca-certificates.crt"}
    docker = build.make_plan("docker", "auto", False, ca)
    assert not docker.local_base and docker.build_args == {} and docker.host_ca is None
    assert build.make_plan("docker", "local", False, None).build_args == {"BASE_IMAGE": build.LOCAL_BASE}
    with pytest.raises(SystemExit, match="--base must be auto, local or public, not 'remote'"):
        build.make_plan("docker", "remote", False, None)


def test_build_commands():
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    ctx = Path("/ctx")
    cmd = build.build_command(build.make_plan("buildah", "auto", True, ca), build.IMAGES["operator"], ctx)
    assert cmd[:3] == ["buildah", "--storage-driver", "vfs"] and "--isolation" in cmd
    assert cmd[cmd.index("--volume") + 1] == "/etc/ssl/certs:/hostcerts:ro"
    assert cmd[cmd.index("-f") + 1] == "/ctx/images/operator.Dockerfile" and cmd[-1] == "/ctx"
    assert f"BASE_IMAGE={build.LOCAL_BASE}" in cmd
    assert not any(a.startswith("TORCH_INDEX_URL=") for a in cmd)  # the operator has no torch
    cmd = build.build_command(build.make_plan("buildah", "auto", True, ca), build.IMAGES["runtime-cpu"], ctx)
    assert f"TORCH_INDEX_URL={build.PUBLIC_PYPI}" in cmd
    cmd = build.build_command(build.make_plan("docker", "auto", False, ca), build.IMAGES["runtime-cpu"], ctx)
    assert cmd == ["docker", "build", "-f", "/ctx/images/runtime-cpu.Dockerfile", "-t",
                   C.DEFAULT_CPU_IMAGE, "/ctx"]


def test_only_the_pinned_cpu_wheel_of_torch_is_staged():
    names = ["torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",  # PyPI's: CUDA
             "torch-2.13.0+cu128-cp311-cp311-manylinux_2_28_x86_64.whl",
             "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
             "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
             "torchvision-0.28.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]
    assert build.torch_wheels(names, "2.13.0") == ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]
    assert build.TORCH_VERSION == torch_pin()


def test_lock_lines_pin_what_pip_would_install_without_torch_or_the_project():
    report = json.loads(json.dumps({"install": [
        {"metadata": {"name": "Typing_Extensions", "version": "4.16.0"}},
        {"metadata": {"name": "torch", "version": "2.13.0+cpu"}},
        {"metadata": {"name": "persia-k8s", "version": "0.1.0"}},
        {"metadata": {"name": "grpcio", "version": "1.85.3"}},
    ]}))
    assert build.lock_lines(report) == ["grpcio==1.85.3", "typing-extensions==4.16.0"]


def test_demo_result_is_the_last_persia_result_line():
    out = 'x\n[nn] PERSIA_RESULT {"auc": 0.5}\n[nn] PERSIA_RESULT {"auc": 0.91, "accuracy": 0.86}\n'
    assert build.demo_result(out) == {"auc": 0.91, "accuracy": 0.86}
    assert build.demo_result("[local] failed") is None


def test_freeze_drift_names_the_lock_lines_not_installed():
    lock = "# header\ngrpcio==1.85.3\ntyping-extensions==4.16.0\n"
    freeze = "grpcio==1.85.3\ntyping_extensions==4.16.0\npersia-k8s @ file:///dist/x.whl\n"
    assert build.freeze_drift(freeze, lock) == []
    assert build.freeze_drift("grpcio==1.80.0\n", lock) == ["grpcio==1.85.3", "typing-extensions==4.16.0"]


def test_the_operator_image_has_what_its_nats_probe_imports_for_creds():
    """nats-py imports nkeys only when a `.creds` file or an nkey seed is used: the operator's
    probe of a job's NATS with `nats.auth` type creds failed in the image (not in the dev venv)."""
    source = (REPO / "operator/persia_operator/natswatch.py").read_text()
    assert "user_credentials" in source or "nkeys_seed" in source
    extra = {re.split(r"[<>=!~ \[]", d)[0] for d in project()["optional-dependencies"]["operator"]}
    assert "nkeys" in extra
    lock = (IMAGES / "requirements" / "operator.txt").read_text()
    assert re.search(r"^nkeys==", lock, flags=re.M) and re.search(r"^pynacl==", lock, flags=re.M)
