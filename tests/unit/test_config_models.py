"""persia.config: both YAML files as typed models, with clear errors and PERSIA's legacy spellings."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persia.config import (
    ConfigDeprecationWarning,
    ConfigError,
    EmbeddingSchema,
    GlobalConfig,
    JobType,
    UnknownSlotError,
    load_embedding_config,
    load_embedding_config_from_dict,
    load_global_config,
    load_global_config_from_dict,
)

FIXTURES = Path(__file__).parent / "fixtures" / "persia_adult_income"
ADULT_SLOTS = [
    "workclass", "education", "marital_status", "occupation",
    "relationship", "race", "gender", "native_country",
]


def embedding(**overrides) -> dict:
    raw = {"slots_config": {"a": {"dim": 4}, "b": {"dim": 8}, "c": {"dim": 2}}}
    raw.update(overrides)
    return raw


def error_of(loader, raw) -> str:
    with pytest.raises(ConfigError) as err:
        loader(raw)
    return str(err.value)


# --- PERSIA's own example configs ----------------------------------------------------------------


def test_persia_adult_income_embedding_config_loads():
    schema = load_embedding_config(FIXTURES / "embedding_config.yml")
    assert schema.feature_index_prefix_bit == 12
    assert list(schema.slots_config) == ADULT_SLOTS
    assert schema.feature_groups == {}
    # No explicit groups: each slot is its own group, in slot order.
    assert [g.name for g in schema.groups] == ADULT_SLOTS
    for index, name in enumerate(ADULT_SLOTS):
        slot = schema.slot(name)
        assert (slot.dim, slot.sample_fixed_size, slot.embedding_summation, slot.sqrt_scaling) == (8, 10, True, False)
        assert (slot.hash_stack_rounds, slot.hash_stack_embedding_size) == (0, 0)
        assert slot.group_index == index
        assert slot.index_prefix == (index + 1) << 52


def test_persia_adult_income_global_config_loads_with_legacy_warnings():
    with pytest.warns(ConfigDeprecationWarning) as record:
        config = load_global_config(FIXTURES / "global_config.yml")
    messages = [str(w.message) for w in record]
    assert any("push_interval_sec is a legacy spelling; use common_config.metrics_config.push_interval_seconds" in m for m in messages)
    assert any("incremental_channel_capacity is deprecated" in m for m in messages)
    assert all(m.startswith(str(FIXTURES / "global_config.yml")) for m in messages)
    common, ps = config.common_config, config.embedding_parameter_server_config
    assert common.job_type is JobType.Train
    assert common.metrics_config.enable_metrics is False
    assert common.metrics_config.push_interval_seconds == 10
    assert common.checkpointing_config.num_workers == 8
    assert (ps.capacity, ps.num_hashmap_internal_shards, ps.enable_incremental_update) == (1_000_000, 1, False)
    assert ps.incremental_buffer_size == 5_000_000
    assert ps.incremental_channel_capacity == 1000  # kept, not dropped
    assert config.embedding_worker_config.forward_buffer_size == 1000
    assert config.embedding_worker_config.buffered_data_expired_sec == 1000


def test_persia_adult_income_infer_config_loads():
    with pytest.warns(ConfigDeprecationWarning):
        config = load_global_config(FIXTURES / "global_config_infer.yml")
    infer = config.common_config.infer_config
    assert config.common_config.job_type is JobType.Infer
    assert infer.servers == ["embedding_parameter_server:8888"]
    assert infer.embedding_checkpoint == "/cache/adult_income_ckpt/"


# --- defaults --------------------------------------------------------------------------------------


def test_empty_global_config_file_is_all_defaults(tmp_path):
    path = tmp_path / "global_config.yml"
    path.write_text("")
    config = load_global_config(path)
    assert config == GlobalConfig()
    common = config.common_config
    assert common.job_type is JobType.Train
    assert common.metrics_config.enable_metrics is False  # PERSIA: true (and warned on every push)
    assert common.metrics_config.job_name == "persia_default_jobname"
    assert common.metrics_config.push_interval_seconds == 10
    assert common.checkpointing_config.num_workers == 4
    assert common.infer_config.servers == [] and common.infer_config.embedding_checkpoint is None
    ps = config.embedding_parameter_server_config
    assert ps.capacity == 1_000_000_000 and ps.num_hashmap_internal_shards == 100
    assert ps.enable_incremental_update is False and ps.incremental_buffer_size == 1_000_000
    assert ps.incremental_dir == "/workspace/incremental_dir/" and ps.incremental_channel_capacity is None
    assert config.embedding_worker_config.forward_buffer_size == 1000
    assert config.embedding_worker_config.buffered_data_expired_sec == 1000


def test_empty_sections_mean_defaults_but_empty_scalars_are_errors():
    config = load_global_config_from_dict({"common_config": None, "embedding_worker_config": {}})
    assert config == GlobalConfig()
    message = error_of(load_global_config_from_dict, {"embedding_parameter_server_config": {"capacity": None}})
    assert "embedding_parameter_server_config.capacity: Input should be a valid integer (got None)" in message


def test_slot_defaults_and_required_dim():
    schema = load_embedding_config_from_dict(embedding())
    assert schema.feature_index_prefix_bit == 8
    slot = schema.slots_config["a"]
    assert (slot.sample_fixed_size, slot.embedding_summation, slot.sqrt_scaling) == (10, True, False)
    assert (slot.hash_stack_config.hash_stack_rounds, slot.hash_stack_config.embedding_size) == (0, 0)
    message = error_of(load_embedding_config_from_dict, {"slots_config": {"a": {"sqrt_scaling": True}}})
    assert message == "embedding_config.yml: missing required key 'dim' in slots_config.a"


# --- unknown keys ----------------------------------------------------------------------------------


def test_misspelled_top_level_key_names_file_key_and_closest():
    message = error_of(load_embedding_config_from_dict, {"slot_config": {"a": {"dim": 1}}})
    # Only the useful line: no separate "missing 'slots_config'" noise.
    assert message == "embedding_config.yml: unknown key 'slot_config' at top level; did you mean 'slots_config'?"


def test_unknown_nested_keys_name_the_path(tmp_path):
    path = tmp_path / "my_global.yml"
    path.write_text("embedding_parameter_server_config:\n  capcity: 10\ncommon_config:\n  metrics_config:\n    enable_metric: true\n")
    with pytest.raises(ConfigError) as err:
        load_global_config(path)
    lines = str(err.value).splitlines()
    assert f"{path}: unknown key 'capcity' in embedding_parameter_server_config; did you mean 'capacity'?" in lines
    assert f"{path}: unknown key 'enable_metric' in common_config.metrics_config; did you mean 'enable_metrics'?" in lines
    assert err.value.source == str(path) and len(err.value.problems) == 2


def test_unknown_key_in_slot_and_hash_stack():
    message = error_of(load_embedding_config_from_dict, {"slots_config": {"age": {"dim": 2, "dimm": 3, "hash_stack_config": {
        "hash_stack_rounds": 1, "embedding_size": 5, "round": 2}}}})
    assert "unknown key 'dimm' in slots_config.age; did you mean 'dim'?" in message
    assert "unknown key 'round' in slots_config.age.hash_stack_config; did you mean 'hash_stack_rounds'?" in message


def test_unknown_key_without_close_match_lists_valid_keys():
    message = error_of(load_global_config_from_dict, {"embedding_worker_config": {"zzz": 1}})
    assert message == (
        "global_config.yml: unknown key 'zzz' in embedding_worker_config; "
        "valid keys: forward_buffer_size, buffered_data_expired_sec, lookup_wait_sec"
    )


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({"shard_server_config": {}}, "unknown key 'shard_server_config' at top level; PERSIA renamed it to 'embedding_parameter_server_config'"),
        ({"middleware_config": {}}, "unknown key 'middleware_config' at top level; PERSIA renamed it to 'embedding_worker_config'"),
        ({"common_config": {"intent": "Train"}}, "unknown key 'intent' in common_config; PERSIA renamed it to 'job_type'"),
    ],
)
def test_older_persia_names_get_a_rename_hint(raw, expected):
    assert expected in error_of(load_global_config_from_dict, raw)


# --- wrong types and values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        (embedding(feature_index_prefix_bit=0), "feature_index_prefix_bit: Input should be greater than or equal to 1 (got 0)"),
        (embedding(feature_index_prefix_bit=64), "feature_index_prefix_bit: Input should be less than or equal to 63 (got 64)"),
        ({"slots_config": {"a": {"dim": 0}}}, "slots_config.a.dim: Input should be greater than 0 (got 0)"),
        ({"slots_config": {"a": {"dim": "eight"}}}, "slots_config.a.dim: Input should be a valid integer, unable to parse string as an integer (got 'eight')"),
        ({"slots_config": {"a": {"dim": 2.5}}}, "slots_config.a.dim: Input should be a valid integer, got a number with a fractional part (got 2.5)"),
        ({"slots_config": {"a": {"dim": 2, "sample_fixed_size": 0}}}, "slots_config.a.sample_fixed_size: Input should be greater than 0 (got 0)"),
        ({"slots_config": {"a": {"dim": 2, "embedding_summation": "maybe"}}}, "slots_config.a.embedding_summation: Input should be a valid boolean, unable to interpret input (got 'maybe')"),
        ({"slots_config": {"a": {"dim": True}}}, "slots_config.a.dim: expected an integer, got the boolean true"),
        ({"slots_config": {}}, "slots_config defines no slots; a job needs at least one ID feature"),
        ({"slots_config": {True: {"dim": 2}}}, "slots_config: key True is a bool, not a string; YAML reads unquoted yes/no"),
        ({"slots_config": {"a": {"dim": 2}}, "feature_groups": {"g": [False]}}, "feature_groups.g.0: Input should be a valid string (got False); YAML reads unquoted"),
    ],
)
def test_embedding_value_errors_name_path_and_value(raw, expected):
    message = error_of(load_embedding_config_from_dict, raw)
    assert message.startswith("embedding_config.yml: ")
    assert expected in message


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({"common_config": {"job_type": "train"}}, "common_config.job_type: Input should be 'Train', 'Eval' or 'Infer' (got 'train')"),
        ({"common_config": {"checkpointing_config": {"num_workers": 0}}}, "common_config.checkpointing_config.num_workers: Input should be greater than 0 (got 0)"),
        ({"common_config": {"metrics_config": {"push_interval_seconds": -5}}}, "common_config.metrics_config.push_interval_seconds: Input should be greater than 0 (got -5)"),
        ({"embedding_worker_config": {"forward_buffer_size": 0}}, "embedding_worker_config.forward_buffer_size: Input should be greater than 0 (got 0)"),
        ({"embedding_worker_config": {"buffered_data_expired_sec": "soon"}}, "embedding_worker_config.buffered_data_expired_sec: Input should be a valid integer"),
        ({"embedding_parameter_server_config": {"capacity": -1}}, "embedding_parameter_server_config.capacity: Input should be greater than 0 (got -1)"),
        ({"embedding_parameter_server_config": {"num_hashmap_internal_shards": True}}, "num_hashmap_internal_shards: expected an integer, got the boolean true"),
        ({"embedding_parameter_server_config": {"incremental_buffer_size": 0}}, "incremental_buffer_size: Input should be greater than 0 (got 0)"),
        ({"common_config": {"infer_config": {"servers": ["ps0:8888", "ps1"]}}}, "common_config.infer_config.servers.1: expected 'host:port' with a port in 1..65535, got 'ps1'"),
        ({"common_config": {"infer_config": {"servers": ["ps0:70000"]}}}, "servers.0: expected 'host:port' with a port in 1..65535, got 'ps0:70000'"),
        ([1, 2], "the file must hold a mapping of keys, got list"),
    ],
)
def test_global_value_errors_name_path_and_value(raw, expected):
    message = error_of(load_global_config_from_dict, raw)
    assert message.startswith("global_config.yml: ")
    assert expected in message


def test_integers_written_in_scientific_notation_are_accepted():
    # PyYAML reads `capacity: 1e9` as the string "1e9"; a capacity is naturally written that way.
    config = load_global_config_from_dict({"embedding_parameter_server_config": {"capacity": "1e9", "incremental_buffer_size": 2e6}})
    assert config.embedding_parameter_server_config.capacity == 1_000_000_000
    assert config.embedding_parameter_server_config.incremental_buffer_size == 2_000_000
    assert "capacity: Input should be a valid integer" in error_of(
        load_global_config_from_dict, {"embedding_parameter_server_config": {"capacity": "1.5e0"}}
    )


def test_infer_servers_accept_ipv6_and_hostnames():
    config = load_global_config_from_dict({"common_config": {"job_type": "Infer", "infer_config": {
        "servers": ["[::1]:8888", "10.0.0.1:1", "ps-0.ps.default.svc:65535"], "embedding_checkpoint": "ckpt/"}}})
    assert len(config.common_config.infer_config.servers) == 3


# --- legacy spellings ------------------------------------------------------------------------------


def test_push_interval_sec_is_renamed_with_warning():
    with pytest.warns(DeprecationWarning, match="push_interval_sec is a legacy spelling; use common_config.metrics_config.push_interval_seconds") as record:
        config = load_global_config_from_dict({"common_config": {"metrics_config": {"push_interval_sec": 30}}})
    assert config.common_config.metrics_config.push_interval_seconds == 30
    assert record[0].filename == __file__  # points at the caller, not at persia/config.py
    message = error_of(load_global_config_from_dict, {"common_config": {"metrics_config": {"push_interval_sec": 3, "push_interval_seconds": 4}}})
    assert "both 'push_interval_sec' (legacy) and 'push_interval_seconds' are set; keep only 'push_interval_seconds'" in message


def test_full_amount_manager_buffer_size_is_accepted_and_has_no_effect():
    with pytest.warns(ConfigDeprecationWarning, match="full_amount_manager_buffer_size is a legacy PERSIA key with no effect"):
        config = load_global_config_from_dict({"embedding_parameter_server_config": {"full_amount_manager_buffer_size": 1000}})
    assert config == GlobalConfig()


def test_incremental_channel_capacity_is_kept_with_warning():
    with pytest.warns(ConfigDeprecationWarning, match="PERSIA parsed it but never used it; the value is kept but has no effect"):
        config = load_global_config_from_dict({"embedding_parameter_server_config": {"incremental_channel_capacity": 77}})
    assert config.embedding_parameter_server_config.incremental_channel_capacity == 77
    with pytest.warns(ConfigDeprecationWarning):
        assert "incremental_channel_capacity: Input should be greater than 0 (got 0)" in error_of(
            load_global_config_from_dict, {"embedding_parameter_server_config": {"incremental_channel_capacity": 0}}
        )


def test_top_level_persia_metrics_config_from_the_monitoring_tutorial_is_mapped():
    with pytest.warns(ConfigDeprecationWarning, match="top-level 'PersiaMetricsConfig' is legacy; move it to common_config.metrics_config"):
        config = load_global_config_from_dict({"PersiaMetricsConfig": {"enable_metrics": True, "job_name": "dlrm_v1.0"}})
    metrics = config.common_config.metrics_config
    assert metrics.enable_metrics is True and metrics.job_name == "dlrm_v1.0"
    message = error_of(load_global_config_from_dict, {
        "PersiaMetricsConfig": {"enable_metrics": True}, "common_config": {"metrics_config": {"enable_metrics": False}}})
    assert "both a top-level 'PersiaMetricsConfig' and 'common_config.metrics_config' are set" in message


def test_tutorial_initial_sparse_checkpoint_is_renamed():
    with pytest.warns(ConfigDeprecationWarning, match="use common_config.infer_config.embedding_checkpoint"):
        config = load_global_config_from_dict({"common_config": {"infer_config": {"initial_sparse_checkpoint": "/ckpt"}}})
    assert config.common_config.infer_config.embedding_checkpoint == "/ckpt"


def test_old_per_slot_capacity_is_accepted_with_warning():
    with pytest.warns(ConfigDeprecationWarning, match=r"slots_config.a.capacity is a legacy PERSIA key with no effect"):
        schema = load_embedding_config_from_dict({"slots_config": {"a": {"dim": 8, "capacity": 100000}}})
    assert schema.slot("a").dim == 8


def test_loading_never_mutates_the_callers_dict():
    raw = {"common_config": {"metrics_config": {"push_interval_sec": 30}}, "PersiaMetricsConfig": None}
    raw.pop("PersiaMetricsConfig")
    before = copy.deepcopy(raw)
    with pytest.warns(ConfigDeprecationWarning):
        load_global_config_from_dict(raw)
    assert raw == before


# --- slots, groups and prefixes --------------------------------------------------------------------


def test_user_set_index_prefix_is_an_error():
    message = error_of(load_embedding_config_from_dict, {"slots_config": {"a": {"dim": 2, "index_prefix": 0}}})
    assert message == (
        "embedding_config.yml: slots_config.a.index_prefix: index_prefix is computed from feature_groups "
        "and feature_index_prefix_bit and cannot be set; remove it"
    )


def test_hash_stack_config_rules():
    partial = error_of(load_embedding_config_from_dict, {"slots_config": {"a": {"dim": 2, "hash_stack_config": {"hash_stack_rounds": 2}}}})
    assert "missing required key 'embedding_size' in slots_config.a.hash_stack_config" in partial
    no_size = error_of(load_embedding_config_from_dict, {"slots_config": {"a": {"dim": 2, "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 0}}}})
    assert "slots_config.a.hash_stack_config: hash_stack_rounds is 2 but embedding_size is 0; a hash stack needs embedding_size > 0" in no_size
    too_big = error_of(load_embedding_config_from_dict, {"feature_index_prefix_bit": 60, "slots_config": {"a": {"dim": 2, "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 10}}}})
    assert "slots_config.a.hash_stack_config: hash_stack_rounds * embedding_size = 20 rows do not fit below the group prefix (at most 15" in too_big
    schema = load_embedding_config_from_dict({"slots_config": {"a": {"dim": 2, "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 10}}}})
    assert (schema.slot("a").hash_stack_rounds, schema.slot("a").hash_stack_embedding_size) == (2, 10)
    assert schema.slots_config["a"].hash_stack_config.enabled


def test_groups_in_persia_order_with_shared_prefixes():
    schema = load_embedding_config_from_dict({
        "feature_index_prefix_bit": 8,
        "slots_config": {n: {"dim": 4} for n in ["s1", "s2", "s3", "s4", "s5"]},
        "feature_groups": {"late": ["s4"], "early": ["s2", "s1"]},
    })
    assert [(g.name, g.slot_names) for g in schema.groups] == [
        ("late", ("s4",)), ("early", ("s2", "s1")), ("s3", ("s3",)), ("s5", ("s5",)),
    ]
    assert [g.index_prefix for g in schema.groups] == [(i + 1) << 56 for i in range(4)]
    assert schema.slot("s1").index_prefix == schema.slot("s2").index_prefix == 2 << 56
    assert schema.slot("s1").group == "early"
    assert schema.slot_names == ("s1", "s2", "s3", "s4", "s5")  # iteration keeps slots_config order
    assert list(schema.slots) == list(schema.slot_names)


@pytest.mark.parametrize(
    "groups, expected",
    [
        ({"g": ["a", "bb"]}, "feature_groups.g: 'bb' is not a slot in slots_config; did you mean 'b'?"),
        ({"g": ["a"], "h": ["b", "a"]}, "feature_groups: slot 'a' is in two groups, 'g' and 'h'; a slot belongs to at most one group"),
        ({"g": ["a", "a"]}, "feature_groups.g: slot 'a' is listed twice"),
        ({"c": ["a"]}, "feature_groups.c: the group has the name of slot 'c', which is in no group and so becomes its own group named 'c'"),
        ({"g": []}, "feature_groups.g: the group lists no slots"),
        ({"g": "a"}, "feature_groups.g: Input should be a valid list (got 'a')"),
    ],
)
def test_feature_group_errors(groups, expected):
    assert expected in error_of(load_embedding_config_from_dict, embedding(feature_groups=groups))


def test_group_named_like_a_grouped_slot_is_fine():
    schema = load_embedding_config_from_dict(embedding(feature_groups={"a": ["a", "b"]}))
    assert [g.name for g in schema.groups] == ["a", "c"]


def test_too_many_groups_for_the_prefix_bits():
    slots = {f"s{i}": {"dim": 1} for i in range(4)}
    message = error_of(load_embedding_config_from_dict, {"feature_index_prefix_bit": 2, "slots_config": slots})
    assert "feature_index_prefix_bit 2 leaves room for 3 feature groups, but there are 4" in message
    slots.pop("s3")
    schema = load_embedding_config_from_dict({"feature_index_prefix_bit": 2, "slots_config": slots})
    assert schema.groups[-1].index_prefix == 3 << 62 < 2**64
    grouped = load_embedding_config_from_dict({"feature_index_prefix_bit": 1, "slots_config": slots, "feature_groups": {"all": list(slots)}})
    assert grouped.slot("s0").index_prefix == 1 << 63


def test_unknown_slot_lookup_lists_close_names():
    schema = load_embedding_config(FIXTURES / "embedding_config.yml")
    with pytest.raises(KeyError) as err:
        schema.slot("eduction")
    assert isinstance(err.value, UnknownSlotError)
    assert str(err.value) == "unknown slot 'eduction': not in embedding_config.yml slots_config; did you mean 'education'?"
    with pytest.raises(UnknownSlotError, match="known slots: 'workclass', 'education'"):
        schema.slot("zzz")


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=1, max_size=12, unique=True),
    st.data(),
)
def test_prefix_property(slot_names, data):
    """Distinct groups get distinct prefixes in the top bits; a group's slots share one prefix."""
    grouped = data.draw(st.lists(st.sampled_from(slot_names), unique=True))
    cut = data.draw(st.integers(0, len(grouped)))
    groups = {f"G{i}": members for i, members in enumerate([grouped[:cut], grouped[cut:]]) if members}
    bits = data.draw(st.integers(4, 16))
    schema = load_embedding_config_from_dict({
        "feature_index_prefix_bit": bits, "slots_config": {n: {"dim": 1} for n in slot_names}, "feature_groups": groups,
    })
    prefixes = [g.index_prefix for g in schema.groups]
    assert len(set(prefixes)) == len(prefixes) == len(groups) + len(set(slot_names) - set(grouped))
    assert all(p < 2**64 and p % (1 << (64 - bits)) == 0 for p in prefixes)
    for group in schema.groups:
        assert {schema.slot(n).index_prefix for n in group.slot_names} == {group.index_prefix}


# --- round trips and YAML --------------------------------------------------------------------------


def test_round_trips_are_equal_and_use_current_spellings():
    with pytest.warns(ConfigDeprecationWarning):
        config = load_global_config(FIXTURES / "global_config_infer.yml")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert load_global_config_from_dict(config.to_dict()) == config
    # push_interval_sec came back as push_interval_seconds; only the kept legacy key still warns.
    assert [str(w.message) for w in record] == [
        "global_config.yml: embedding_parameter_server_config.incremental_channel_capacity is deprecated: "
        "PERSIA parsed it but never used it; the value is kept but has no effect"
    ]
    schema = load_embedding_config_from_dict(embedding(feature_groups={"g": ["c", "a"]}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_global_config_from_dict(GlobalConfig().to_dict()) == GlobalConfig()
        reloaded = load_embedding_config_from_dict(schema.to_dict())
    assert reloaded == schema and reloaded.groups == schema.groups
    assert isinstance(reloaded, EmbeddingSchema)


def test_duplicate_yaml_keys_are_errors(tmp_path):
    path = tmp_path / "embedding_config.yml"
    path.write_text("slots_config:\n  a:\n    dim: 2\n  a:\n    dim: 4\n")
    with pytest.raises(ConfigError) as err:
        load_embedding_config(path)
    assert str(err.value).startswith(f"{path}: invalid YAML:") and "duplicate key 'a'" in str(err.value)
    assert "line 4" in str(err.value)


def test_unreadable_files_are_config_errors(tmp_path):
    bad = tmp_path / "global_config.yml"
    bad.write_text("common_config: [unclosed\n")
    with pytest.raises(ConfigError, match=r"global_config.yml: invalid YAML"):
        load_global_config(bad)
    with pytest.raises(ConfigError, match=r"nope.yml: file not found"):
        load_global_config(tmp_path / "nope.yml")
    # a directory and a file that is not UTF-8: named, not a traceback or a bare codec message
    (tmp_path / "config_dir").mkdir()
    with pytest.raises(ConfigError, match=r"config_dir: a directory, not a file"):
        load_global_config(tmp_path / "config_dir")
    latin = tmp_path / "latin1.yml"
    latin.write_bytes("common_config: {}  # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yml: not UTF-8 text \(byte 0xe9 at offset"):
        load_global_config(latin)
    scalar = tmp_path / "scalar.yml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match=r"scalar.yml: the file must hold a mapping of keys, got int"):
        load_embedding_config(scalar)


def test_yaml_merge_keys_still_work(tmp_path):
    path = tmp_path / "embedding_config.yml"
    path.write_text("slots_config:\n  a: &base\n    dim: 2\n  b:\n    <<: *base\n    sqrt_scaling: true\n")
    schema = load_embedding_config(path)
    assert schema.slot("b").dim == 2 and schema.slot("b").sqrt_scaling


def test_examples_in_the_configuration_reference_load():
    """docs/configuration.md's two YAML examples stay valid (and use no legacy spelling)."""
    import re

    import yaml

    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    embedding_yaml, global_yaml = re.findall(r"```yaml\n(.*?)```", text, re.S)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = load_embedding_config_from_dict(yaml.safe_load(embedding_yaml))
        config = load_global_config_from_dict(yaml.safe_load(global_yaml))
    assert schema.slot("education").group == "demographics"
    assert config.common_config.checkpointing_config.num_workers == 8
