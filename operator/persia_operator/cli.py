"""`persia-operator`: run the operator, render a job's children, or print the CRD.

    persia-operator run [-n NAMESPACE ...] [--interval S] [--liveness URL]
    persia-operator render -f job.yaml            # children as YAML, no cluster needed
    persia-operator crd                           # the CustomResourceDefinition

With no sub-command (`python -m persia_operator`), it runs the operator.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, TextIO

import yaml

from .spec import SpecError


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


def _run(args: argparse.Namespace) -> int:
    import asyncio

    import kopf

    from .config import OperatorConfig
    from .handlers import register, run_kwargs

    config = OperatorConfig.from_env(
        namespaces=args.namespace or None,
        reconcile_interval=args.interval,
        liveness=args.liveness,
        verbose=args.verbose or None,
    )
    if args.all_namespaces:
        config = config.model_copy(update={"namespaces": []})
    logging.basicConfig(
        level=logging.DEBUG if config.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    registry = kopf.OperatorRegistry()
    register(registry, config)
    asyncio.run(kopf.operator(registry=registry, **run_kwargs(config)))
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
    run.add_argument("-v", "--verbose", action="store_true")
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
    return _run(args)


if __name__ == "__main__":
    raise SystemExit(main())
