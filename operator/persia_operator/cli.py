"""`persia-operator`: run the operator, render a job's children, or print the CRD.

    persia-operator run [-n NAMESPACE ...] [--interval S] [--liveness URL] [--leader-elect]
    persia-operator render -f job.yaml            # children as YAML, no cluster needed
    persia-operator crd                           # the CustomResourceDefinition
    persia-operator release-finalizers [-n NS ...|-A]   # before uninstalling (Helm hook)

With no sub-command (`python -m persia_operator`), it runs the operator. A rejected
option (flag or PERSIA_OPERATOR_* variable) is one `error:` line on stderr each, naming
where it came from and its value, and exit status 2 (as argparse's usage errors).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from .spec import SpecError

if TYPE_CHECKING:
    from pydantic import ValidationError


def render_documents(text: str) -> list[dict[str, Any]]:
    """Children of every PersiaJob in a YAML stream; raises SpecError like the operator."""
    from .job import PersiaJob
    from .render import render
    from .spec import validate_job

    children: list[dict[str, Any]] = []
    jobs = [d for d in yaml.safe_load_all(text) if d]
    if not jobs:
        raise SpecError(["no PersiaJob found in the input"])
    for number, body in enumerate(jobs, 1):
        if not isinstance(body, dict):
            raise SpecError([f"document {number}: not a mapping"])
        try:
            meta, spec = validate_job(body)
        except SpecError as err:
            if len(jobs) == 1:
                raise
            name = ((body.get("metadata") or {}).get("name")) or f"document {number}"
            raise SpecError([f"{name}: {p}" for p in err.problems]) from None
        children += render(PersiaJob(metadata=meta, spec=spec))
    return children


def _render(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file) as f:
                text = f.read()
    except OSError as exc:
        print(f"error: cannot read {args.file}: {exc.strerror}", file=err)
        return 2
    try:
        if args.namespace:
            docs = [d for d in yaml.safe_load_all(text) if d]
            for d in docs:
                if isinstance(d, dict):
                    d.setdefault("metadata", {})["namespace"] = args.namespace
            text = yaml.safe_dump_all(docs)
        children = render_documents(text)
    except yaml.YAMLError as exc:
        print(f"error: {args.file} is not valid YAML: {exc}", file=err)
        return 1
    except SpecError as exc:
        print("error: invalid PersiaJob:", file=err)
        for problem in exc.problems:
            print(f"  - {problem}", file=err)
        return 1
    out.write(yaml.safe_dump_all(children, sort_keys=False, width=120))
    return 0


class ConfigError(Exception):
    """The operator's options were rejected; `problems` are the lines to show."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


FLAGS = {"namespaces": "--namespace", "reconcile_interval": "--interval", "liveness": "--liveness",
         "verbose": "--verbose", "leader_elect": "--leader-elect"}  # fmt: skip
ENV_FALLBACKS = {"namespaces": "WATCH_NAMESPACE", "lease_namespace": "POD_NAMESPACE", "identity": "HOSTNAME"}


def option_source(field: str, flags: set[str], env: Mapping[str, str]) -> str:
    """Where an option's value came from (as OperatorConfig.from_env reads them): its
    command-line flag, its PERSIA_OPERATOR_* variable, or the variable it falls back to."""
    if field in flags:
        return FLAGS.get(field, field)
    key = f"PERSIA_OPERATOR_{field.upper()}"
    return key if key in env or field not in ENV_FALLBACKS else ENV_FALLBACKS[field]


def config_problems(error: ValidationError, flags: set[str], env: Mapping[str, str]) -> list[str]:
    """One line per problem of a pydantic ValidationError from OperatorConfig, naming the
    flag or variable and the value it had (a raw pydantic report names neither)."""
    problems = []
    for item in error.errors():
        msg = str(item["msg"]).removeprefix("Value error, ")
        if not item["loc"]:  # a rule across options (lease timings): the message names them
            problems.append(f"invalid configuration: {msg}")
            continue
        problems.append(f"{option_source(str(item['loc'][0]), flags, env)}={item['input']!r}: {msg}")
    return problems


def _config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Any:
    """The operator's options (flags over environment); raises ConfigError."""
    from pydantic import ValidationError

    from .config import OperatorConfig

    env = os.environ if env is None else env
    overrides = {
        "namespaces": args.namespace or None,
        "reconcile_interval": getattr(args, "interval", None),
        "liveness": getattr(args, "liveness", None),
        "verbose": args.verbose or None,
        "leader_elect": getattr(args, "leader_elect", False) or None,
    }
    try:
        config = OperatorConfig.from_env(dict(env), **overrides)
    except ValidationError as err:
        raise ConfigError(config_problems(err, {k for k, v in overrides.items() if v is not None}, env)) from None
    if args.all_namespaces:
        config = config.model_copy(update={"namespaces": []})
    logging.basicConfig(
        level=logging.DEBUG if config.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return config


def _standalone_api(config: Any) -> Any:
    """A KubeApi for calls made outside kopf (leader election, the uninstall hook)."""
    import kopf

    from .handlers import default_login
    from .kube import KubeApi

    logger = logging.getLogger("persia_operator")
    return KubeApi(login=lambda: default_login(logger=logger, settings=kopf.OperatorSettings()),
                   request_timeout=config.request_timeout)  # fmt: skip


async def serve_standby_liveness(url: str | None) -> None:
    """While on standby (not the leader), answer the liveness probe on kopf's endpoint."""
    import asyncio
    from urllib.parse import urlsplit

    from aiohttp import web

    if not url:
        await asyncio.Event().wait()
        return
    parts = urlsplit(url)

    async def ok(_: Any) -> Any:
        return web.json_response({"standby": True})

    app = web.Application()
    app.router.add_get(parts.path or "/", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, parts.hostname or "0.0.0.0", parts.port or 8080)
    await site.start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _run(config: Any) -> int:
    import asyncio
    import socket
    import uuid

    import kopf

    from . import opmetrics
    from .handlers import register, run_kwargs
    from .leader import LeaderElector, run_as_leader

    if config.metrics_port:
        # the runtime's bounded server (persia.metrics_server: 16 connections, 10 s a read or
        # write, 30 s a connection); prometheus_client's own waited on a silent client for ever
        from persia.metrics_server import serve_metrics

        try:
            serve_metrics("0.0.0.0", config.metrics_port)
        except OSError as err:  # the operator is more important than its metrics
            logging.getLogger("persia_operator").error(
                f"no /metrics: cannot listen on port {config.metrics_port}: {err}")
    registry = kopf.OperatorRegistry()
    register(registry, config)

    async def operate() -> None:
        opmetrics.LEADER.set(1)
        try:
            await kopf.operator(registry=registry, **run_kwargs(config))
        finally:
            opmetrics.LEADER.set(0)

    async def main() -> int:
        if not config.leader_elect:
            await operate()
            return 0
        api = _standalone_api(config)
        identity = config.identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        elector = LeaderElector(api, config.lease_namespace or "default", config.lease_name, identity,
                                config.lease_duration, config.renew_period, config.retry_period)  # fmt: skip
        try:
            return await run_as_leader(elector, operate, standby=lambda: serve_standby_liveness(config.liveness))
        finally:
            await api.close()

    return asyncio.run(main())


async def release_finalizers(api: Any, namespaces: list[str]) -> list[str]:
    """Remove the operator's finalizer from every PersiaJob (cluster-wide when
    `namespaces` is empty) so that nothing is stranded once the operator is gone. The
    jobs and their children stay; deleting a job later deletes its children (owner
    references)."""
    from . import constants as C

    released = []
    scopes = namespaces or [None]
    for namespace in scopes:
        path = (f"/apis/{C.GROUP}/{C.VERSION}/namespaces/{namespace}/{C.PLURAL}" if namespace
                else f"/apis/{C.GROUP}/{C.VERSION}/{C.PLURAL}")  # fmt: skip
        listing = await api._request("GET", path)
        for item in listing.get("items") or []:
            meta = item.get("metadata") or {}
            finalizers = meta.get("finalizers") or []
            if C.FINALIZER not in finalizers:
                continue
            keep = [f for f in finalizers if f != C.FINALIZER]
            patch = {"metadata": {"finalizers": keep or None, "resourceVersion": meta.get("resourceVersion")}}
            await api.merge_patch(C.KIND, meta["namespace"], meta["name"], patch)
            released.append(f"{meta['namespace']}/{meta['name']}")
    return released


def _release(config: Any, out: TextIO) -> int:
    import asyncio

    async def main() -> list[str]:
        api = _standalone_api(config)
        try:
            return await release_finalizers(api, config.namespaces)
        finally:
            await api.close()

    for name in asyncio.run(main()):
        print(f"released {name}", file=out)
    return 0


def _crd(out: TextIO) -> int:
    from .crdgen import crd_yaml

    out.write(crd_yaml())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="persia-operator", description="The PersiaJob operator.")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the operator (the default)")
    run.add_argument("-n", "--namespace", action="append", help="watch this namespace (repeatable)")
    run.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (default)")
    run.add_argument("--interval", type=float, help="seconds between reconcile passes of a job")
    run.add_argument("--liveness", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--leader-elect", action="store_true", help="run as one of several replicas (Lease)")
    run.add_argument("-v", "--verbose", action="store_true")
    release = sub.add_parser("release-finalizers", help="remove the operator's finalizer from every PersiaJob")
    release.add_argument("-n", "--namespace", action="append", help="only this namespace (repeatable)")
    release.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace (default)")
    release.add_argument("-v", "--verbose", action="store_true")
    render = sub.add_parser("render", help="print the children of a PersiaJob as YAML")
    render.add_argument("-f", "--file", required=True, help="PersiaJob manifest ('-' for stdin)")
    render.add_argument("-n", "--namespace", help="override metadata.namespace")
    sub.add_parser("crd", help="print the PersiaJob CustomResourceDefinition")
    return parser


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout
    err = err or sys.stderr
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    args = build_parser().parse_args(argv)
    if args.command == "render":
        return _render(args, out, err)
    if args.command == "crd":
        return _crd(out)
    try:
        config = _config(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=err)
        return 2
    if args.command == "release-finalizers":
        return _release(config, out)
    return _run(config)


if __name__ == "__main__":
    raise SystemExit(main())
