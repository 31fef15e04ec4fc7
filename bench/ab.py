"""Interleaved A/B runs of our system's configurations: what a change buys, against the spread
of this shared machine.

A ratio from two runs taken minutes apart here moves by 10-20 % with the host alone
(docs/benchmarks.md, issue 15), so every comparison in that file is interleaved: each round runs
every variant once, the order reversed every other round, seed = round. The summary gives, per
variant, the median samples/s with its range, the median over rounds of its ratio to the first
variant's run of the same round (a pair close in time), and the mean AUC.

    python -m bench.ab --variant base --variant one=nn-threads=1 --rounds 5
    python -m bench.ab --batch-size 1024 --rows 400000 \\
        --variant one --variant two-ranks=nn-workers=2,batch-size=512,nn-threads=1
    python -m bench.ab --mlp ffnn --rows 20000 --variant base --variant spin=env:OMP_WAIT_POLICY=ACTIVE

A variant is ``NAME`` or ``NAME=SETTING,SETTING...`` with settings ``nn-threads=N|auto``,
``nn-workers=N``, ``batch-size=N``, ``staleness=N``, ``sync``, ``colocate-ps``, ``no-replay``,
``placement=off`` and ``env:KEY=VALUE`` (an environment variable for every role).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._paths import RESULTS_DIR, write_results
from bench.persia_local import find_launcher, launcher_unavailable_reason, with_role_env
from bench.spec import DEFAULT_HYBRID_STALENESS, RunSpec

_INT_SETTINGS = {"nn-workers": "num_nn_workers", "batch-size": "batch_size", "staleness": "staleness"}
_FLAGS = {"sync": ("system", "persia-sync"), "colocate-ps": ("colocate_ps", True), "no-replay": ("replay", False)}


@dataclass(frozen=True)
class Variant:
    name: str
    spec: dict[str, Any] = field(default_factory=dict)  # RunSpec fields that differ from the base run
    env: dict[str, str] = field(default_factory=dict)  # for every role, through persia-launcher local --env


def parse_variant(text: str) -> Variant:
    """``NAME[=SETTING,...]`` (pure); an error names the setting and the value it cannot take."""
    name, _, rest = text.partition("=")
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"variant {text!r}: a name of letters, digits, '-', '_' or '.' comes first")
    spec: dict[str, Any] = {}
    env: dict[str, str] = {}
    for setting in filter(None, rest.split(",")):
        key, eq, value = setting.partition("=")
        if key.startswith("env:"):
            if not eq or not key[4:]:
                raise ValueError(f"variant {name!r}: {setting!r} must be env:KEY=VALUE")
            env[key[4:]] = value
        elif key in _INT_SETTINGS:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"variant {name!r}: {key} must be a whole number >= 1, got {value!r}")
            spec[_INT_SETTINGS[key]] = int(value)
        elif key == "nn-threads":
            if value != "auto" and (not value.isdigit() or int(value) < 1):
                raise ValueError(f"variant {name!r}: nn-threads must be 'auto' or a whole number >= 1, got {value!r}")
            spec["nn_threads"] = value if value == "auto" else int(value)
        elif key == "placement":
            if value not in ("auto", "off"):
                raise ValueError(f"variant {name!r}: placement must be 'auto' or 'off', got {value!r}")
            spec["cpu_placement"] = value
        elif key in _FLAGS and not eq:
            spec[_FLAGS[key][0]] = _FLAGS[key][1]
        else:
            raise ValueError(f"variant {name!r}: unknown setting {setting!r} (known: env:KEY=VALUE, nn-threads=, "
                             f"{'=, '.join(_INT_SETTINGS)}=, placement=, {', '.join(_FLAGS)})")
    return Variant(name, spec, env)


def round_order(variants: list[Variant], round_index: int) -> list[Variant]:
    """Every variant once a round, the order reversed every other round (pure)."""
    return list(variants) if round_index % 2 == 0 else list(reversed(variants))


def summarize(variants: list[Variant], results: dict[str, list[dict | None]]) -> list[dict[str, Any]]:
    """Per variant (pure): ok runs, median and range of samples/s, the median of the per-round
    ratios to the first variant (rounds where both ran), and the mean AUC. ``results[name][r]`` is
    round r's result line, None for a failed run."""
    base = results[variants[0].name]
    out = []
    for v in variants:
        runs = results[v.name]
        sps = [r["samples_per_sec"] for r in runs if r]
        ratios = [r["samples_per_sec"] / b["samples_per_sec"] for r, b in zip(runs, base) if r and b]
        aucs = [r["auc"] for r in runs if r and r.get("auc") is not None]
        out.append({
            "variant": v.name, "ok": len(sps), "runs": len(runs),
            "samples_per_sec": [round(r["samples_per_sec"]) if r else None for r in runs],
            "median": statistics.median(sps) if sps else None,
            "min": min(sps) if sps else None, "max": max(sps) if sps else None,
            "ratio_to_first": statistics.median(ratios) if ratios else None,
            "auc": statistics.fmean(aucs) if aucs else None,
        })
    return out


def summary_table(rows: list[dict[str, Any]], first: str) -> str:
    """The printed summary (pure)."""
    lines = [f"| variant | ok runs | samples/s (median) | min - max | median ratio to {first} | AUC |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["median"] is None:
            lines.append(f"| {r['variant']} | 0/{r['runs']} | - | - | - | - |")
            continue
        ratio = "-" if r["ratio_to_first"] is None else f"{r['ratio_to_first']:.3f}"
        auc = "-" if r["auc"] is None else f"{r['auc']:.4f}"
        lines.append(f"| {r['variant']} | {r['ok']}/{r['runs']} | {r['median']:,.0f} | {r['min']:,.0f} - "
                     f"{r['max']:,.0f} | {ratio} | {auc} |")
    return "\n".join(lines)


def run(base: RunSpec, variants: list[Variant], rounds: int, logs_dir: Path, log=print) -> dict[str, Any]:
    from bench.e2e_bench import command_for, execute  # late: the module imports the whole plan

    launcher = find_launcher()
    results: dict[str, list[dict | None]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in round_order(variants, r):
            fields = {**base.model_dump(), **v.spec, "seed": r}
            if fields["system"] == "persia-sync":
                fields["staleness"] = None  # the synchronous reference's bound is 1
            spec = RunSpec.model_validate(fields)  # the variant's fields checked as a spec
            argv, env = command_for(spec, launcher)
            argv = with_role_env(argv, v.env)
            rec = execute(argv, env, spec.timeout_s, logs_dir / f"ab-{r}-{v.name}.log")
            result = rec["result"] if rec["status"] == "ok" else None
            results[v.name].append(result)
            sps = f"{result['samples_per_sec']:,.0f} samples/s" if result else f"failed ({rec.get('reason', rec['returncode'])})"
            log(f"round {r} {v.name}: {sps}, load {rec['loadavg_start']:.1f}")
    rows = summarize(variants, results)
    return {"base": base.model_dump(), "variants": [v.__dict__ for v in variants], "rounds": rounds, "summary": rows}


def main(argv: list[str] | None = None) -> int:
    from bench.e2e_bench import profile_data

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, help="NAME[=SETTING,...]; the first is the reference")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mlp", default="mlp400", help="the synthetic-CTR model (mlp400, ffnn or 'a,b,c')")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rows", type=int, default=200_000, help="training rows per run")
    p.add_argument("--test-rows", type=int, default=20_000)
    p.add_argument("--staleness", type=int, default=DEFAULT_HYBRID_STALENESS)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--output", type=Path, help="JSON file (default: <results>/ab.json)")
    a = p.parse_args(argv)
    try:
        variants = [parse_variant(t) for t in a.variant]
    except ValueError as exc:
        p.error(str(exc))
    if len({v.name for v in variants}) != len(variants):
        p.error(f"variant names must differ, got {[v.name for v in variants]}")
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    reason = launcher_unavailable_reason()
    if reason:
        raise SystemExit(f"cannot run our system: {reason}")
    base = RunSpec(system="persia-hybrid", data_dir=str(profile_data(a.results_dir)), mlp=a.mlp, batch_size=a.batch_size,
                   train_rows=a.rows, test_rows=a.test_rows, eval_points=1, curve_eval_rows=1_000,
                   staleness=a.staleness, nn_threads="auto")
    doc = run(base, variants, a.rounds, a.results_dir / "logs")
    print()
    print(summary_table(doc["summary"], variants[0].name))
    print(f"\nwritten {write_results(doc, a.output or a.results_dir / 'ab.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
