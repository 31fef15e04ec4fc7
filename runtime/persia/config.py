"""Typed models and loaders for PERSIA's two YAML files: ``embedding_config.yml`` and
``global_config.yml``.

PERSIA parsed these with serde and silently ignored unknown keys, so a typo (``slot_config``,
``push_interval_sec``) quietly fell back to a default. Here every unknown key is an error that
names the file, the key path and the closest valid key; PERSIA's own legacy spellings still load,
with a :class:`ConfigDeprecationWarning` naming the replacement. Parsing is pure (dict in, model
out) so it tests without files; the ``load_*`` functions are thin YAML shells around it.

Derived values (feature groups, each slot's ``index_prefix``) are computed once, at validation;
treat loaded models as read-only.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import math
import re
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Dict, List, Mapping, Optional, Tuple, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

__all__ = [
    "ConfigError",
    "ConfigDeprecationWarning",
    "UnknownSlotError",
    "HashStackConfig",
    "SlotConfig",
    "EmbeddingSchema",
    "Slot",
    "FeatureGroup",
    "JobType",
    "InferConfig",
    "CheckpointingConfig",
    "MetricsConfig",
    "CommonConfig",
    "EmbeddingWorkerConfig",
    "EmbeddingParameterServerConfig",
    "GlobalConfig",
    "load_embedding_config",
    "load_embedding_config_from_dict",
    "load_global_config",
    "load_global_config_from_dict",
]

EMBEDDING_CONFIG_NAME = "embedding_config.yml"
GLOBAL_CONFIG_NAME = "global_config.yml"


class ConfigError(ValueError):
    """A config file that cannot be used; one line per problem, each prefixed with the file."""

    def __init__(self, source: str, problems: List[str]):
        self.source = source
        self.problems = list(problems)
        super().__init__("\n".join(f"{source}: {p}" for p in self.problems))


class ConfigDeprecationWarning(DeprecationWarning):
    """A legacy PERSIA spelling that still loads; the message names the replacement."""


# DeprecationWarning is hidden by default outside __main__; these are about the user's YAML, not
# about code, so show them (once per location) unless the user's own filters say otherwise later.
warnings.filterwarnings("default", category=ConfigDeprecationWarning)


class UnknownSlotError(KeyError):
    """A feature name that is not in ``slots_config``; lists the closest slot names."""

    def __init__(self, name: str, known: List[str]):
        self.name = name
        close = difflib.get_close_matches(str(name), known, n=3)
        if close:
            hint = "did you mean " + " or ".join(repr(c) for c in close) + "?"
        else:
            shown = ", ".join(repr(k) for k in known[:10]) + (", ..." if len(known) > 10 else "")
            hint = f"known slots: {shown}"
        self.message = f"unknown slot {name!r}: not in {EMBEDDING_CONFIG_NAME} slots_config; {hint}"
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return self.message


# --- field types -----------------------------------------------------------------------------


def _integral(value: Any) -> Any:
    """Accept ``8.0`` and ``"1e9"`` for integers (PyYAML reads ``1e9`` as a string); reject bools."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got the boolean {str(value).lower()}")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+(\.\d*)?[eE][+-]?\d+\s*", value):
        as_float = float(value)
        if as_float.is_integer():
            return int(as_float)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
PositiveInt = Annotated[int, BeforeValidator(_integral), Field(gt=0)]
NonNegativeInt = Annotated[int, BeforeValidator(_integral), Field(ge=0)]


class _Section(BaseModel):
    """Base of every YAML section: unknown keys forbidden, read-only, empty section = defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_subsections_are_defaults(cls, data: Any) -> Any:
        # ``metrics_config:`` with nothing under it is YAML null; treat it as "all defaults".
        # Only sections and maps: a scalar left empty (``capacity:``) must not silently default.
        if isinstance(data, dict):
            for key, field in cls.model_fields.items():
                if key in data and data[key] is None and not field.is_required():
                    kind = _unwrap(field.annotation)
                    is_model = isinstance(kind, type) and issubclass(kind, BaseModel)
                    if is_model or get_origin(kind) in (dict, list):
                        data = {k: v for k, v in data.items() if k != key}
        return data


# --- embedding_config.yml --------------------------------------------------------------------


class HashStackConfig(_Section):
    """Map each ID to ``hash_stack_rounds`` IDs drawn from ``embedding_size`` rows per round."""

    hash_stack_rounds: NonNegativeInt
    embedding_size: NonNegativeInt

    @model_validator(mode="after")
    def _rounds_need_a_size(self) -> "HashStackConfig":
        if self.hash_stack_rounds > 0 and self.embedding_size == 0:
            raise ValueError(
                f"hash_stack_rounds is {self.hash_stack_rounds} but embedding_size is 0; "
                f"a hash stack needs embedding_size > 0"
            )
        if self.hash_stack_rounds == 0 and self.embedding_size > 0:
            raise ValueError(
                f"embedding_size is {self.embedding_size} but hash_stack_rounds is 0, which turns the hash "
                f"stack off; set hash_stack_rounds > 0 to use it, or embedding_size: 0 (or drop "
                f"hash_stack_config) for no hash stack"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.hash_stack_rounds > 0


class SlotConfig(_Section):
    """One ID feature ("slot") as written in ``slots_config``."""

    dim: PositiveInt
    sample_fixed_size: PositiveInt = 10
    embedding_summation: bool = True
    sqrt_scaling: bool = False
    hash_stack_config: HashStackConfig = HashStackConfig(hash_stack_rounds=0, embedding_size=0)


@dataclass(frozen=True)
class FeatureGroup:
    """Slots that share one ID prefix (so equal IDs in them share rows)."""

    name: str
    index: int
    index_prefix: int
    slot_names: Tuple[str, ...]


@dataclass(frozen=True)
class Slot:
    """A slot with everything derived: its group and the prefix put in its IDs' top bits."""

    name: str
    dim: int
    sample_fixed_size: int
    embedding_summation: bool
    sqrt_scaling: bool
    hash_stack_rounds: int
    hash_stack_embedding_size: int
    group: str
    group_index: int
    index_prefix: int


def _did_you_mean(word: str, candidates: List[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _resolve_groups(
    prefix_bit: int, slots: Mapping[str, SlotConfig], feature_groups: Mapping[str, List[str]]
) -> Tuple[Tuple[FeatureGroup, ...], Dict[str, Slot]]:
    """PERSIA's ``parse_embedding_config``: explicit groups in file order, then one group per
    ungrouped slot in slot order; ``index_prefix = (group_index + 1) << (64 - prefix_bit)``."""
    slot_names = list(slots)
    group_of: Dict[str, str] = {}
    for group, members in feature_groups.items():
        if not members:
            raise ValueError(f"feature_groups.{group}: the group lists no slots")
        for member in members:
            if member not in slots:
                raise ValueError(
                    f"feature_groups.{group}: {member!r} is not a slot in slots_config"
                    f"{_did_you_mean(member, slot_names)}"
                )
            if member in group_of:
                if group_of[member] == group:
                    raise ValueError(f"feature_groups.{group}: slot {member!r} is listed twice")
                raise ValueError(
                    f"feature_groups: slot {member!r} is in two groups, {group_of[member]!r} and "
                    f"{group!r}; a slot belongs to at most one group"
                )
            group_of[member] = group

    ordered: List[Tuple[str, Tuple[str, ...]]] = [(g, tuple(m)) for g, m in feature_groups.items()]
    for name in slot_names:
        if name not in group_of:
            if name in feature_groups:
                raise ValueError(
                    f"feature_groups.{name}: the group has the name of slot {name!r}, which is in no "
                    f"group and so becomes its own group named {name!r}; rename the group or put the "
                    f"slot in a group"
                )
            ordered.append((name, (name,)))

    max_groups = (1 << prefix_bit) - 1
    if len(ordered) > max_groups:
        raise ValueError(
            f"feature_index_prefix_bit {prefix_bit} leaves room for {max_groups} feature groups, but "
            f"there are {len(ordered)} ({len(feature_groups)} in feature_groups plus one per ungrouped "
            f"slot); raise feature_index_prefix_bit or put slots into feature_groups"
        )
    id_space = (1 << (64 - prefix_bit)) - 1
    shift = 64 - prefix_bit
    groups = []
    resolved: Dict[str, Slot] = {}
    for index, (group, members) in enumerate(ordered):
        prefix = (index + 1) << shift
        groups.append(FeatureGroup(group, index, prefix, members))
        for member in members:
            cfg = slots[member]
            hs = cfg.hash_stack_config
            if hs.hash_stack_rounds * hs.embedding_size > id_space:
                raise ValueError(
                    f"slots_config.{member}.hash_stack_config: hash_stack_rounds * embedding_size = "
                    f"{hs.hash_stack_rounds * hs.embedding_size} rows do not fit below the group prefix "
                    f"(at most {id_space} with feature_index_prefix_bit {prefix_bit})"
                )
            resolved[member] = Slot(
                name=member,
                dim=cfg.dim,
                sample_fixed_size=cfg.sample_fixed_size,
                embedding_summation=cfg.embedding_summation,
                sqrt_scaling=cfg.sqrt_scaling,
                hash_stack_rounds=hs.hash_stack_rounds,
                hash_stack_embedding_size=hs.embedding_size,
                group=group,
                group_index=index,
                index_prefix=prefix,
            )
    # keep slots_config order, not group order, for iteration
    return tuple(groups), {name: resolved[name] for name in slot_names}


class EmbeddingSchema(_Section):
    """``embedding_config.yml``: the slots (ID features), their groups and ID prefix width."""

    feature_index_prefix_bit: Int = Field(8, ge=1, le=63)
    slots_config: Dict[str, SlotConfig]
    feature_groups: Dict[str, List[str]] = Field(default_factory=dict)

    _groups: Tuple[FeatureGroup, ...] = PrivateAttr(default=())
    _slots: Mapping[str, Slot] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _derive(self) -> "EmbeddingSchema":
        if not self.slots_config:
            raise ValueError("slots_config defines no slots; a job needs at least one ID feature")
        for name in self.slots_config:
            if name == "":
                raise ValueError(f"slots_config: slot name {name!r} is empty; every slot needs a name "
                                 f"(the name its ID feature is sent under)")
        groups, slots = _resolve_groups(self.feature_index_prefix_bit, self.slots_config, self.feature_groups)
        self._groups = groups
        self._slots = MappingProxyType(slots)
        return self

    @property
    def groups(self) -> Tuple[FeatureGroup, ...]:
        """Feature groups in PERSIA order (explicit groups, then one per ungrouped slot)."""
        return self._groups

    @property
    def slots(self) -> Mapping[str, Slot]:
        """Resolved slots by name, in ``slots_config`` order."""
        return self._slots

    @property
    def slot_names(self) -> Tuple[str, ...]:
        return tuple(self._slots)

    def slot(self, name: str) -> Slot:
        """The resolved slot, or :class:`UnknownSlotError` naming the closest slots."""
        try:
            return self._slots[name]
        except (KeyError, TypeError):
            raise UnknownSlotError(name, list(self._slots)) from None

    def to_dict(self) -> dict:
        """Plain data that :func:`load_embedding_config_from_dict` turns back into an equal schema."""
        return self.model_dump(mode="json")


# --- global_config.yml -----------------------------------------------------------------------


class JobType(str, Enum):
    Train = "Train"
    Eval = "Eval"
    Infer = "Infer"


_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^:\s\[\]]+):(?P<port>\d{1,5})$")


def _check_host_port(value: Any) -> Any:
    if isinstance(value, str):
        match = _HOST_PORT.match(value)
        if not match or not 0 < int(match["port"]) < 65536:
            raise ValueError(f"expected 'host:port' with a port in 1..65535, got {value!r}")
    return value


class InferConfig(_Section):
    """Used with ``job_type: Infer``: the PS replicas (in replica order) and what they load."""

    servers: List[Annotated[str, BeforeValidator(_check_host_port)]] = Field(default_factory=list)
    embedding_checkpoint: Optional[str] = None


def _check_resume(value: Any) -> Any:
    if value is None:
        return "auto"
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected 'auto', 'never' or a checkpoint path, got {value!r}")
    return value


class CheckpointingConfig(_Section):
    """Checkpoint I/O threads, and periodic checkpoints with resume (docs/configuration.md).

    ``checkpoint_dir`` unset: no periodic checkpoints and nothing to resume from (explicit
    ``dump_checkpoint`` calls still work). The ``PERSIA_CHECKPOINT_*`` / ``PERSIA_RESUME`` env
    variables override these keys (``persia.nn_worker.checkpoint_plan.settings_from``)."""

    num_workers: PositiveInt = 4
    checkpoint_dir: Optional[str] = None
    interval_steps: Optional[PositiveInt] = None
    interval_seconds: Optional[Annotated[float, Field(gt=0)]] = None
    keep: PositiveInt = 3
    resume: Annotated[str, BeforeValidator(_check_resume)] = "auto"


class MetricsConfig(_Section):
    # PERSIA defaulted enable_metrics to true and then warned on every push without a gateway.
    enable_metrics: bool = False
    job_name: str = "persia_default_jobname"
    push_interval_seconds: PositiveInt = 10


class CommonConfig(_Section):
    metrics_config: MetricsConfig = MetricsConfig()
    job_type: JobType = JobType.Train
    infer_config: InferConfig = InferConfig()
    checkpointing_config: CheckpointingConfig = CheckpointingConfig()


class EmbeddingWorkerConfig(_Section):
    forward_buffer_size: PositiveInt = 1000
    buffered_data_expired_sec: PositiveInt = 1000
    # A data loader sends a batch's ID features and its dense part at once, so an NN worker's
    # lookup may arrive first: it waits this long for them, then fails naming the batch.
    lookup_wait_sec: Annotated[float, Field(gt=0, le=600)] = 10.0


class EmbeddingParameterServerConfig(_Section):
    capacity: PositiveInt = 1_000_000_000
    num_hashmap_internal_shards: PositiveInt = 100
    enable_incremental_update: bool = False
    incremental_buffer_size: PositiveInt = 1_000_000
    incremental_dir: str = "/workspace/incremental_dir/"
    # A training PS deletes its packets older than this after each one it writes (0: never, as
    # PERSIA did, and the directory grows by a packet every incremental_buffer_size changed rows).
    incremental_retention_seconds: Annotated[float, Field(ge=0)] = 86_400.0
    # PERSIA parsed this but never used it; kept (None when absent) so nothing given is lost.
    incremental_channel_capacity: Optional[PositiveInt] = None


class GlobalConfig(_Section):
    """``global_config.yml``. Every key has a default, so an empty file is valid."""

    common_config: CommonConfig = CommonConfig()
    embedding_worker_config: EmbeddingWorkerConfig = EmbeddingWorkerConfig()
    embedding_parameter_server_config: EmbeddingParameterServerConfig = EmbeddingParameterServerConfig()

    def to_dict(self) -> dict:
        """Plain data that :func:`load_global_config_from_dict` turns back into an equal config."""
        return self.model_dump(mode="json", exclude_none=True)


# --- legacy spellings and error messages -----------------------------------------------------

# Keys older PERSIA releases used that we do not accept, with what replaced them.
_RENAMED: Dict[Tuple[Tuple[str, ...], str], str] = {
    ((), "shard_server_config"): "PERSIA renamed it to 'embedding_parameter_server_config'",
    ((), "embedding_server_config"): "PERSIA renamed it to 'embedding_parameter_server_config'",
    ((), "middleware_config"): "PERSIA renamed it to 'embedding_worker_config'",
    (("common_config",), "intent"): "PERSIA renamed it to 'job_type'",
    (("common_config",), "num_embedding_io_workers"): (
        "PERSIA replaced it with 'common_config.checkpointing_config.num_workers'"
    ),
}


def _warn(source: str, message: str) -> None:
    # Point the warning at the caller of load_*(), not at this module.
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame, level = frame.f_back, level + 1
    warnings.warn(f"{source}: {message}", ConfigDeprecationWarning, stacklevel=level)


def _rename_key(section: Any, old: str, new: str, path: str, source: str, problems: List[str]) -> None:
    if not isinstance(section, dict) or old not in section:
        return
    if new in section:
        problems.append(f"{path}: both {old!r} (legacy) and {new!r} are set; keep only {new!r}")
        return
    _warn(source, f"{path}.{old} is a legacy spelling; use {path}.{new}")
    section[new] = section.pop(old)


def _check_keys_are_strings(node: Any, path: Tuple[Any, ...], problems: List[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                where = ".".join(map(str, path)) or "top level"
                problems.append(
                    f"{where}: key {key!r} is a {type(key).__name__}, not a string; YAML reads unquoted "
                    f"yes/no/on/off/true/false as booleans and digits as numbers, so quote it"
                )
            else:
                _check_keys_are_strings(value, (*path, key), problems)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_keys_are_strings(value, (*path, i), problems)


def _migrate_global(raw: dict, source: str) -> List[str]:
    problems: List[str] = []
    if "PersiaMetricsConfig" in raw:  # PERSIA's monitoring tutorial put metrics at the top level
        common = raw.get("common_config")
        if common is None:
            common = raw["common_config"] = {}
        if isinstance(common, dict):
            if common.get("metrics_config") is not None:
                problems.append(
                    "both a top-level 'PersiaMetricsConfig' and 'common_config.metrics_config' are set; "
                    "keep only common_config.metrics_config"
                )
            else:
                _warn(source, "top-level 'PersiaMetricsConfig' is legacy; move it to common_config.metrics_config")
                common["metrics_config"] = raw.pop("PersiaMetricsConfig")
    common = raw.get("common_config")
    if isinstance(common, dict):
        _rename_key(common.get("metrics_config"), "push_interval_sec", "push_interval_seconds",
                    "common_config.metrics_config", source, problems)
        _rename_key(common.get("infer_config"), "initial_sparse_checkpoint", "embedding_checkpoint",
                    "common_config.infer_config", source, problems)
    ps = raw.get("embedding_parameter_server_config")
    if isinstance(ps, dict):
        if "full_amount_manager_buffer_size" in ps:
            ps.pop("full_amount_manager_buffer_size")
            _warn(source, "embedding_parameter_server_config.full_amount_manager_buffer_size is a legacy "
                          "PERSIA key with no effect (PERSIA's code never had it); remove it")
        if "incremental_channel_capacity" in ps:
            _warn(source, "embedding_parameter_server_config.incremental_channel_capacity is deprecated: "
                          "PERSIA parsed it but never used it; the value is kept but has no effect")
    return problems


def _migrate_embedding(raw: dict, source: str) -> List[str]:
    problems: List[str] = []
    slots = raw.get("slots_config")
    if isinstance(slots, dict):
        for name, slot in slots.items():
            if not isinstance(slot, dict):
                continue
            if "index_prefix" in slot:
                slot.pop("index_prefix")
                problems.append(
                    f"slots_config.{name}.index_prefix: index_prefix is computed from feature_groups and "
                    f"feature_index_prefix_bit and cannot be set; remove it"
                )
            if "capacity" in slot:  # early PERSIA examples had a per-slot capacity
                slot.pop("capacity")
                _warn(source, f"slots_config.{name}.capacity is a legacy PERSIA key with no effect; the PS "
                              f"capacity is embedding_parameter_server_config.capacity in {GLOBAL_CONFIG_NAME}")
    return problems


def _unwrap(annotation: Any) -> Any:
    """Strip Annotated/Optional to the type whose keys or items a loc element indexes into."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin is Union:
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def _keys_at(model: type, loc: Tuple[Any, ...]) -> Optional[List[str]]:
    """The valid keys of the mapping at ``loc`` (a pydantic error location) below ``model``."""
    current: Any = model
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return None
            current = field.annotation
        elif get_origin(current) in (dict, Dict):
            current = get_args(current)[1]
        elif get_origin(current) in (list, List):
            current = get_args(current)[0]
        else:
            return None
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return None


def _closest_key(model: type, loc: Tuple[Any, ...]) -> Tuple[List[str], Optional[str]]:
    """The valid keys beside the unknown key at ``loc``, and the one closest to it (or None)."""
    valid = _keys_at(model, loc[:-1]) or []
    key = str(loc[-1]).lower()
    close = difflib.get_close_matches(key, valid, n=1)
    if not close and len(key) >= 4:  # 'round' -> 'hash_stack_rounds', 'capacity_limit' -> 'capacity'
        close = [v for v in valid if key in v or v in key][:1]
    return valid, (close[0] if close else None)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _format_error(model: type, error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        parent, key = loc[:-1], str(loc[-1])
        where = "at top level" if not parent else f"in {'.'.join(map(str, parent))}"
        if (tuple(map(str, parent)), key) in _RENAMED:
            return f"unknown key {key!r} {where}; {_RENAMED[(tuple(map(str, parent)), key)]}"
        valid, close = _closest_key(model, loc)
        if close:
            return f"unknown key {key!r} {where}; did you mean {close!r}?"
        return f"unknown key {key!r} {where}; valid keys: {', '.join(valid)}"
    if kind == "missing":
        parent = loc[:-1]
        where = "at top level" if not parent else f"in {'.'.join(map(str, parent))}"
        return f"missing required key {loc[-1]!r} {where}"
    message = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix):]
    if not loc:
        return message
    path = ".".join(map(str, loc))
    value = error.get("input")
    if isinstance(value, (dict, BaseModel)) or kind == "value_error":  # our messages name the value
        return f"{path}: {message}"
    hint = ""
    if kind == "string_type" and isinstance(value, (bool, int, float)):
        hint = "; YAML reads unquoted yes/no/on/off/true/false as booleans and digits as numbers, so quote it"
    return f"{path}: {message} (got {_describe(value)}){hint}"


def _validate(model: type, raw: Any, source: str, migrate) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(source, [f"the file must hold a mapping of keys, got {type(raw).__name__}"])
    raw = copy.deepcopy(raw)
    problems: List[str] = []
    _check_keys_are_strings(raw, (), problems)
    if problems:
        raise ConfigError(source, problems)
    problems = migrate(raw, source)
    try:
        parsed = model.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        # "missing 'slots_config'" is noise next to "unknown key 'slot_config'; did you mean ...".
        suggested = {
            (tuple(e["loc"][:-1]), _closest_key(model, tuple(e["loc"]))[1])
            for e in errors
            if e["type"] == "extra_forbidden"
        }
        errors = [
            e for e in errors
            if not (e["type"] == "missing" and (tuple(e["loc"][:-1]), e["loc"][-1]) in suggested)
        ]
        problems += [_format_error(model, e) for e in errors]
        raise ConfigError(source, problems) from None
    if problems:
        raise ConfigError(source, problems)
    return parsed


# --- loaders ---------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable key; SafeLoader reports it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Union[str, Path]) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.load(fh, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(str(path), ["file not found"]) from None
    except IsADirectoryError:
        raise ConfigError(str(path), ["a directory, not a file"]) from None
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read it: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"invalid YAML: {exc}"]) from None


def load_embedding_config_from_dict(raw: Any, source: str = EMBEDDING_CONFIG_NAME) -> EmbeddingSchema:
    """Validate an already-parsed ``embedding_config.yml``; ``source`` names it in errors."""
    return _validate(EmbeddingSchema, raw, source, _migrate_embedding)


def load_global_config_from_dict(raw: Any, source: str = GLOBAL_CONFIG_NAME) -> GlobalConfig:
    """Validate an already-parsed ``global_config.yml``; ``source`` names it in errors."""
    return _validate(GlobalConfig, raw, source, _migrate_global)


def load_embedding_config(path: Union[str, Path]) -> EmbeddingSchema:
    """Read and validate ``embedding_config.yml`` (raises :class:`ConfigError`)."""
    return load_embedding_config_from_dict(_read_yaml(path), source=str(path))


def load_global_config(path: Union[str, Path]) -> GlobalConfig:
    """Read and validate ``global_config.yml`` (raises :class:`ConfigError`)."""
    return load_global_config_from_dict(_read_yaml(path), source=str(path))
