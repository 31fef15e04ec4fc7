"""bench/ab.py's decisions: the variant grammar, the interleaving, the paired summary."""

from __future__ import annotations

import pytest

from bench.ab import Variant, parse_variant, round_order, summarize, summary_table
from bench.persia_local import synthetic_command, with_role_env
from bench.spec import RunSpec


def test_a_bare_name_is_the_base_run():
    assert parse_variant("base") == Variant("base", {}, {})


def test_every_setting():
    v = parse_variant("two=nn-workers=2,batch-size=512,nn-threads=1,staleness=4,placement=off,colocate-ps,"
                      "no-replay,env:OMP_WAIT_POLICY=ACTIVE,env:EMPTY=")
    assert v.name == "two"
    assert v.spec == {"num_nn_workers": 2, "batch_size": 512, "nn_threads": 1, "staleness": 4, "cpu_placement": "off",
                      "colocate_ps": True, "replay": False}
    assert v.env == {"OMP_WAIT_POLICY": "ACTIVE", "EMPTY": ""}
    assert parse_variant("s=sync,nn-threads=auto").spec == {"system": "persia-sync", "nn_threads": "auto"}


@pytest.mark.parametrize("text, names", [
    ("=nn-threads=1", "name"),
    ("a b", "name"),
    ("x=nn-threads=0", "nn-threads must be 'auto' or a whole number >= 1, got '0'"),
    ("x=batch-size=big", "batch-size must be a whole number >= 1, got 'big'"),
    ("x=placement=on", "placement must be 'auto' or 'off', got 'on'"),
    ("x=env:=1", "env:KEY=VALUE"),
    ("x=colocate-ps=yes", "unknown setting 'colocate-ps=yes'"),
    ("x=threads=2", "unknown setting 'threads=2'"),
])
def test_bad_variants_are_refused_naming_the_setting(text, names):
    with pytest.raises(ValueError, match="variant") as err:
        parse_variant(text)
    assert names in str(err.value)


def test_rounds_alternate_the_order():
    vs = [Variant("a"), Variant("b"), Variant("c")]
    assert [v.name for v in round_order(vs, 0)] == ["a", "b", "c"]
    assert [v.name for v in round_order(vs, 1)] == ["c", "b", "a"]
    assert [v.name for v in round_order(vs, 2)] == ["a", "b", "c"]


def _r(sps, auc=0.83):
    return {"samples_per_sec": sps, "auc": auc}


def test_summary_pairs_each_round_with_the_first_variant():
    vs = [Variant("base"), Variant("new")]
    results = {"base": [_r(20_000), _r(30_000), None, _r(10_000)],
               "new": [_r(22_000), _r(30_000), _r(99_000), _r(12_000, auc=0.81)]}
    base, new = summarize(vs, results)
    assert base["ok"] == 3 and base["median"] == 20_000 and base["ratio_to_first"] == 1.0
    # round 2 has no base run: its 99k counts in the median, not in the paired ratios (1.1, 1.0, 1.2)
    assert new["ok"] == 4 and new["median"] == pytest.approx(26_000) and new["max"] == 99_000
    assert new["ratio_to_first"] == pytest.approx(1.1)
    assert new["auc"] == pytest.approx((0.83 * 3 + 0.81) / 4)
    text = summary_table([base, new], "base")
    assert "| new | 4/4 | 26,000 | 12,000 - 99,000 | 1.100 | 0.8250 |" in text


def test_a_variant_that_never_ran_is_shown_as_such():
    vs = [Variant("base"), Variant("broken")]
    rows = summarize(vs, {"base": [_r(1.0)], "broken": [None]})
    assert rows[1]["median"] is None and rows[1]["ratio_to_first"] is None
    assert "| broken | 0/1 | - |" in summary_table(rows, "base")


def test_nn_workers_reach_the_launcher_and_the_label(tmp_path):
    spec = RunSpec(system="persia-hybrid", data_dir=str(tmp_path), staleness=10, num_nn_workers=2)
    argv, _ = synthetic_command(spec, "persia-launcher")
    assert argv[argv.index("--num-nn-workers") + 1] == "2"
    assert " nn=2 " in spec.label + " "
    assert " nn=" not in RunSpec(system="persia-hybrid", data_dir=str(tmp_path), staleness=10).label


def test_role_env_goes_right_after_local():
    argv = ["persia-launcher", "local", "--nn-worker", "train.py"]
    out = with_role_env(argv, {"A": "1", "B": "x=y"})
    assert out == ["persia-launcher", "local", "--env", "A=1", "--env", "B=x=y", "--nn-worker", "train.py"]
    assert argv == ["persia-launcher", "local", "--nn-worker", "train.py"]  # the caller's list is left alone
    assert with_role_env(argv, {}) == argv
