"""The `PersiaJob` spec as a pydantic model: the one source of the CRD schema and of
the operator's own validation.

PERSIA's fields (persiaEnv, env, volumes, logLevel, restartPolicy, imagePullPolicy,
enableMetrics and the four role blocks) keep their names and meaning so that PERSIA's
manifests apply unchanged; the added fields are `image`, per-role `template`, `nats`,
`trainingMode`, `configs` and `runPolicy`.

Every rule that the CRD states in CEL (`x-kubernetes-validations`) is also checked here,
so that `persia-operator render` and an API server without CEL report the same errors.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from . import constants as C
from .natsinfo import redact


class SpecError(ValueError):
    """An invalid PersiaJob: the message names every bad field and its value."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    item = {"rule": rule, "message": message}
    if field_path:
        item["fieldPath"] = field_path
    return item


class _Model(BaseModel):
    """camelCase on the wire, unknown fields rejected (the API server would prune them)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class EnvVar(_Model):
    """A core/v1 EnvVar (value or valueFrom)."""

    name: str = Field(min_length=1, description="Environment variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        None, description="core/v1 EnvVarSource (fieldRef, secretKeyRef, ...)."
    )

    @field_validator("name")
    @classmethod
    def _printable_without_equals(cls, name: str) -> str:
        """What every API server refuses in a container's env (1.32's relaxed rule; older ones
        refuse more): refused when the workload was created, naming its container, not this field."""
        if "=" in name or not all(" " <= ch <= "~" for ch in name):
            raise ValueError(f"an environment variable name must be printable ASCII without '=', got {name!r}")
        return name


_ENV_LIST = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}
_NAMED_ITEMS = {
    "items": {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string"}},
        "x-kubernetes-preserve-unknown-fields": True,
    },
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["name"],
}
_MOUNT_ITEMS = {
    "items": {
        "type": "object",
        "required": ["name", "mountPath"],
        "properties": {"name": {"type": "string"}, "mountPath": {"type": "string"}},
        "x-kubernetes-preserve-unknown-fields": True,
    }
}


def _check_env_names(env: list[EnvVar]) -> list[EnvVar]:
    seen: set[str] = set()
    for var in env:
        if var.name in seen:
            raise ValueError(f"duplicate environment variable name {var.name!r}")
        seen.add(var.name)
    return env


NATS_URL_ENV = "PERSIA_NATS_URL"


def _env_var(env: list[EnvVar], name: str) -> EnvVar | None:
    return next((var for var in env if var.name == name), None)


def user_nats_urls(env: list[EnvVar], roles: dict[str, RoleSpec]) -> dict[str, tuple[str, EnvVar] | None]:
    """Per role field: the PERSIA_NATS_URL its pods get from the user, as (where it is set,
    definition), or None. A role's env wins over spec.env, as in the rendered pods."""
    job_level = _env_var(env, NATS_URL_ENV)
    urls: dict[str, tuple[str, EnvVar] | None] = {}
    for field, role in roles.items():
        own = _env_var(role.env, NATS_URL_ENV)
        urls[field] = (f"{field}.env", own) if own else ("env", job_level) if job_level else None
    return urls


def _shown(var: EnvVar) -> str:
    """A definition for an error message, without URL user-info."""
    if var.value_from is not None:
        return f"valueFrom {var.value_from}"
    return repr(redact(var.value or ""))


def check_user_nats_url(env: list[EnvVar], roles: dict[str, RoleSpec], managed: bool | None,
                        external_url: str | None = None) -> list[str]:
    """A PERSIA_NATS_URL the user sets (value or valueFrom, in spec.env or a role's env)
    replaces the managed NATS for the whole job: every role must get the same one (roles on
    different NATS servers never meet), the operator must be able to read it (to check that
    NATS: a value or a secretKeyRef), and it excludes `nats.managed: true` (the pods would
    reach the user's NATS with the managed NATS's credentials)."""
    urls = user_nats_urls(env, roles)
    sources = {where: var for where, var in (u for u in urls.values() if u is not None)}
    if not sources:
        return []
    problems = []
    for where, var in sources.items():
        if var.value_from is not None and set(var.value_from) != {"secretKeyRef"}:
            problems.append(
                f"{where}: {NATS_URL_ENV} valueFrom must be a secretKeyRef (the operator reads it to check "
                f"that NATS), got {_shown(var)}"
            )
        elif var.value_from is None and not var.value:
            problems.append(
                f"{where}: {NATS_URL_ENV} is empty: set a URL (value or valueFrom.secretKeyRef), or remove it "
                "to get a managed NATS"
            )
    missing = [field for field, url in urls.items() if url is None]
    if missing:
        problems.append(
            f"{NATS_URL_ENV} is set in {', '.join(sources)} but not for {', '.join(missing)}: every role must "
            f"use the same NATS (set {NATS_URL_ENV} once in spec.env)"
        )
    definitions = {where: var.model_dump(exclude={"name"}) for where, var in sources.items()}
    if len({repr(d) for d in definitions.values()}) > 1:
        shown = ", ".join(f"{where}: {_shown(var)}" for where, var in sources.items())
        problems.append(
            f"{NATS_URL_ENV} differs between roles ({shown}): every role must use the same NATS "
            f"(set {NATS_URL_ENV} once in spec.env)"
        )
    if managed:
        problems.append(
            f"nats.managed: true and {NATS_URL_ENV} in {', '.join(sources)} are mutually exclusive: the pods "
            "would reach that NATS with the managed NATS's credentials"
        )
    if external_url:
        other = {where: var for where, var in sources.items() if var.value_from is not None or var.value != external_url}
        if other:
            shown = ", ".join(f"{where}: {_shown(var)}" for where, var in other.items())
            problems.append(
                f"nats.externalURL {redact(external_url)!r} and {NATS_URL_ENV} ({shown}) differ: the pods would use "
                f"{NATS_URL_ENV} while the operator checks nats.externalURL; set one of them"
            )
    return problems


class TemplateMetadata(_Model):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


_OVERLAY_NAMED_LISTS = ("containers", "initContainers", "ephemeralContainers", "volumes", "imagePullSecrets",
                        "resourceClaims")  # fmt: skip
_CONTAINER_NAMED_LISTS = ("env", "volumeMounts")


def _named_items(items: Any, where: str) -> list[str]:
    """Problems of a list of named objects (`where`: its path under the template's spec)."""
    if not isinstance(items, list):
        return [f"{where} must be a list, got {items!r:.200}"]
    return [f"{where}[{n}] must be an object with a name, got {item!r:.200}" for n, item in enumerate(items)
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"])]  # fmt: skip


class PodTemplateOverlay(_Model):
    """Merged over the rendered pod template of a role (see docs/operator.md)."""

    metadata: TemplateMetadata | None = None
    spec: dict[str, Any] | None = Field(
        None,
        description=(
            "A partial core/v1 PodSpec merged over the rendered one: maps merge, lists of "
            "named items (containers, volumes, env, ...) merge by name, other lists replace."
        ),
    )

    @field_validator("spec")
    @classmethod
    def _named_lists_are_named(cls, spec: dict[str, Any] | None) -> dict[str, Any] | None:
        """The lists merged by name hold named objects. A volume given as a string made the
        operator's own checks crash (no status, a ReconcileFailed event on every pass), and a
        container list given as a string went to the API server, refused there naming the
        StatefulSet, not this field."""
        problems: list[str] = []
        for key in _OVERLAY_NAMED_LISTS:
            if spec and spec.get(key) is not None:
                found = _named_items(spec[key], key)
                problems += found
                if not found and key.endswith(("ontainers", "Containers")):
                    for container in spec[key]:
                        problems += [p for field in _CONTAINER_NAMED_LISTS if container.get(field) is not None
                                     for p in _named_items(container[field], f"{key}[{container['name']}].{field}")]  # fmt: skip
        if problems:
            raise ValueError("; ".join(problems))
        return spec


_REPLICAS_RULE = _cel(
    f"self.replicas >= 1 && self.replicas <= {C.MAX_REPLICAS}",
    f"replicas must be between 1 and {C.MAX_REPLICAS}",
    ".replicas",
)


# A Kubernetes resource.Quantity as the API server parses it: a decimal number and a binary
# (Ki..Ei), decimal SI (n..E) or exponent (e3, E-2) suffix. Kept strict on purpose: anything
# else is refused by the API server when the workload is created, with a message that names
# the StatefulSet's container, not the PersiaJob's field.
_QUANTITY = re.compile(r"^\+?(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                       r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")  # fmt: skip
_SUFFIXES = {"": 1, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
             "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}  # fmt: skip


def parse_quantity(value: Any) -> float:
    """The value of a Kubernetes quantity (``"1.5Gi"``, ``"500m"``, ``2``); ValueError if it is not one
    the API server takes for a resource (negative ones included)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError("not a quantity")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("negative")
        return float(value)
    match = _QUANTITY.match(value.strip() if value.strip() == value else "")
    if match is None:
        raise ValueError("not a quantity")
    suffix = match["suffix"] or ""
    scale = _SUFFIXES.get(suffix) or 10.0 ** int(suffix[1:])
    return float(match["num"]) * scale


def check_resources(resources: dict[str, Any] | None) -> dict[str, Any] | None:
    """A core/v1 ResourceRequirements' limits and requests: every value a quantity, no request above
    its limit (the API server refuses both, but only when the workload is created, naming its
    container: the NATS, Services and ConfigMaps were created, and the job failed with
    ChildCreateFailed instead of naming the PersiaJob's field)."""
    if resources is None:
        return None
    problems = []
    parsed: dict[str, dict[str, float]] = {}
    for section in ("limits", "requests"):
        values = resources.get(section)
        if values is None:
            continue
        if not isinstance(values, dict):
            problems.append(f"{section} must be a map of resource name to quantity, got {values!r}")
            continue
        for name, value in values.items():
            try:
                parsed.setdefault(section, {})[name] = parse_quantity(value)
            except ValueError:
                problems.append(f"{section}.{name} must be a non-negative quantity such as 500m, 2 or 4Gi, got {value!r}")
    for name, request in parsed.get("requests", {}).items():
        limit = parsed.get("limits", {}).get(name)
        if limit is not None and request > limit:
            problems.append(f"requests.{name} {resources['requests'][name]!r} is more than limits.{name} "
                            f"{resources['limits'][name]!r}")  # fmt: skip
    if problems:
        raise ValueError("; ".join(problems))
    return resources


class RoleSpec(_Model):
    """One PERSIA role: PERSIA's fields plus an image and a pod template overlay."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [_REPLICAS_RULE]})

    replicas: int = Field(description=f"Number of replicas (1..{C.MAX_REPLICAS}).")
    resources: dict[str, Any] | None = Field(
        None, description="core/v1 ResourceRequirements of the role's container."
    )
    env: list[EnvVar] = Field(
        default_factory=list, description="Role-specific env (last wins).", json_schema_extra=_ENV_LIST
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list,
        description="core/v1 VolumeMounts of the role's container.",
        json_schema_extra=_MOUNT_ITEMS,
    )
    image: str | None = Field(None, description="Image of this role (overrides spec.image).")
    template: PodTemplateOverlay | None = None

    @field_validator("replicas")
    @classmethod
    def _replicas_in_range(cls, value: int) -> int:
        if not 1 <= value <= C.MAX_REPLICAS:
            raise ValueError(f"replicas must be between 1 and {C.MAX_REPLICAS}, got {value}")
        return value

    @field_validator("env")
    @classmethod
    def _unique_env(cls, env: list[EnvVar]) -> list[EnvVar]:
        return _check_env_names(env)

    @field_validator("resources")
    @classmethod
    def _quantities(cls, resources: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_resources(resources)

    @field_validator("volume_mounts")
    @classmethod
    def _mounts_named(cls, mounts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for mount in mounts:
            if not mount.get("name") or not mount.get("mountPath"):
                raise ValueError(f"every volumeMount needs a name and a mountPath, got {mount}")
        return mounts


class NNWorkerSpec(RoleSpec):
    nproc_per_node: int = Field(
        1, ge=1, le=C.MAX_NPROC_PER_NODE, description="Training processes per NN worker pod."
    )
    shm_size: str | None = Field(
        None,
        description=(
            "sizeLimit of the in-memory /dev/shm of NN worker pods (DDP and data loader "
            "workers exchange tensors through it); unset: no limit but the pod's memory."
        ),
    )

    @field_validator("shm_size")
    @classmethod
    def _shm_quantity(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_quantity(value)
            except ValueError:
                raise ValueError(f"must be a non-negative quantity such as 8Gi, got {value!r}") from None
        return value

    def gpus(self) -> int:
        """GPUs requested per pod (limits, else requests), 0 when none."""
        resources = self.resources or {}
        for section in ("limits", "requests"):
            value = (resources.get(section) or {}).get(C.GPU_RESOURCE)
            if value is not None:
                try:
                    return int(str(value))
                except ValueError:
                    raise ValueError(f"nnWorker.resources.{section}.{C.GPU_RESOURCE} must be a whole number, got {value!r}") from None
        return 0

    @model_validator(mode="after")
    def _nproc_fits_gpus(self) -> "NNWorkerSpec":
        gpus = self.gpus()
        if gpus and self.nproc_per_node > gpus:
            raise ValueError(
                f"nprocPerNode {self.nproc_per_node} is more than the {gpus} GPUs requested per pod "
                f"({C.GPU_RESOURCE}): each training process needs its own GPU"
            )
        return self


class PersiaEnv(BaseModel):
    """PERSIA's config file paths and entry points, passed to every pod as env."""

    model_config = ConfigDict(extra="forbid")

    PERSIA_GLOBAL_CONFIG: str | None = Field(None, description="Path of global_config.yml.")
    PERSIA_EMBEDDING_CONFIG: str | None = Field(None, description="Path of embedding_config.yml.")
    PERSIA_NN_WORKER_ENTRY: str | None = Field(None, description="NN worker entry script.")
    PERSIA_DATALOADER_ENTRY: str | None = Field(None, description="Data loader entry script.")


class SecretRef(_Model):
    """A Secret in the job's namespace holding TLS material (cert-manager's layout)."""

    secret_name: str = Field(min_length=1, description="Secret with ca.crt, tls.crt and tls.key.")


class NatsAuth(_Model):
    """Credentials for an external NATS, from a Secret the user provides."""

    secret_name: str = Field(min_length=1, description="Secret in the job's namespace.")
    type: Literal["userPassword", "token", "creds"] = Field(
        "userPassword",
        description=(
            "userPassword: keys `user` and `password`; token: key `token`; creds: key "
            "`creds` (a NATS .creds or nkey seed file, mounted read-only)."
        ),
    )


class NatsSpec(_Model):
    """Either a NATS the operator runs for the job (`managed`) or an `externalURL`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!(has(self.externalURL) && has(self.managed) && self.managed)",
                    "nats.externalURL and nats.managed: true are mutually exclusive",
                ),
                _cel(
                    "!((has(self.auth) || has(self.tls)) && has(self.managed) && self.managed)",
                    "nats.auth and nats.tls are for an external NATS; a managed NATS gets "
                    "generated credentials",
                ),
                _cel(
                    f"!has(self.maxPayload) || (self.maxPayload >= 1 && "
                    f"self.maxPayload <= {C.NATS_MAX_PAYLOAD_LIMIT})",
                    f"nats.maxPayload must be between 1 and {C.NATS_MAX_PAYLOAD_LIMIT} bytes "
                    "(64 MiB, the nats-server max_pending limit)",
                    ".maxPayload",
                ),
                _cel(
                    f"!has(self.replicas) || (self.replicas >= 1 && "
                    f"self.replicas <= {C.MAX_NATS_REPLICAS})",
                    f"nats.replicas must be between 1 and {C.MAX_NATS_REPLICAS}",
                    ".replicas",
                ),
            ]
        }
    )

    managed: bool | None = Field(
        None, description="Run a per-job NATS (the default unless externalURL is set)."
    )
    replicas: int = Field(1, description=f"Managed NATS servers (1..{C.MAX_NATS_REPLICAS}).")
    max_payload: int = Field(
        C.NATS_MAX_PAYLOAD_LIMIT,
        description="Managed NATS max_payload in bytes (at most 64 MiB).",
    )
    external_url: str | None = Field(
        None,
        alias="externalURL",
        description="URL of an existing NATS (nats://host:4222); no NATS is rendered.",
    )
    image: str = Field(C.DEFAULT_NATS_IMAGE, description="Managed NATS image.")
    resources: dict[str, Any] | None = Field(
        None, description="Managed NATS container resources (default: see docs/operator.md)."
    )
    template: PodTemplateOverlay | None = None

    @field_validator("resources")
    @classmethod
    def _quantities(cls, resources: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_resources(resources)

    auth: NatsAuth | None = Field(
        None,
        description=(
            "Credentials of an external NATS (a managed NATS always gets a generated Secret, "
            "<job>-auth, that only the job's pods use)."
        ),
    )
    tls: SecretRef | None = Field(
        None, description="TLS client material for an external NATS (PERSIA_NATS_TLS_*)."
    )

    @field_validator("replicas")
    @classmethod
    def _nats_replicas(cls, value: int) -> int:
        if not 1 <= value <= C.MAX_NATS_REPLICAS:
            raise ValueError(f"nats.replicas must be between 1 and {C.MAX_NATS_REPLICAS}, got {value}")
        return value

    @field_validator("max_payload")
    @classmethod
    def _payload_limit(cls, value: int) -> int:
        if not 1 <= value <= C.NATS_MAX_PAYLOAD_LIMIT:
            raise ValueError(
                f"nats.maxPayload must be between 1 and {C.NATS_MAX_PAYLOAD_LIMIT} bytes "
                f"(64 MiB, the nats-server max_pending limit), got {value}"
            )
        return value

    @field_validator("external_url")
    @classmethod
    def _url_scheme(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^(nats|tls|ws|wss)://[^\s]+$", value):
            raise ValueError(f"nats.externalURL must look like nats://host:port, got {value!r}")
        return value

    @model_validator(mode="after")
    def _exclusive(self) -> "NatsSpec":
        if self.external_url and self.managed:
            raise ValueError("nats.externalURL and nats.managed: true are mutually exclusive")
        if (self.auth or self.tls) and self.managed:
            raise ValueError(
                "nats.auth and nats.tls are for an external NATS; a managed NATS gets generated credentials"
            )
        return self


class Configs(_Model):
    """Inline PERSIA configs, rendered into the ConfigMap `<job>-config` at /etc/persia."""

    global_config: dict[str, Any] | None = Field(
        None, description="Content of global_config.yml (alternative to PERSIA_GLOBAL_CONFIG)."
    )
    embedding_config: dict[str, Any] | None = Field(
        None,
        description="Content of embedding_config.yml (alternative to PERSIA_EMBEDDING_CONFIG).",
    )


class CheckpointSpec(_Model):
    """Where the runtime keeps its checkpoints and how often it writes them (CONTRACTS.md).

    The volume is mounted on the PS, embedding worker and NN worker pods; every restart of
    the job (failure, PS replacement, replica change, resume) continues from the last
    complete checkpoint found there (`resume: auto`)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "has(self.persistentVolumeClaim) != has(self.volume)",
                    "checkpoint: set exactly one of persistentVolumeClaim and volume",
                ),
            ]
        }
    )

    persistent_volume_claim: str | None = Field(
        None, description="Claim (ReadWriteMany across nodes) mounted at mountPath."
    )
    volume: str | None = Field(None, description="Name of a volume in spec.volumes mounted at mountPath.")
    mount_path: str = Field("/checkpoints", pattern=r"^/", description="Where the volume is mounted.")
    dir: str | None = Field(
        None,
        description="PERSIA_CHECKPOINT_DIR (default <mountPath>/<job name>); must lie under mountPath.",
    )
    interval_steps: int | None = Field(None, ge=1, description="Checkpoint every this many steps.")
    interval_seconds: float | None = Field(None, gt=0, description="Checkpoint at least this often.")
    keep: int = Field(3, ge=1, le=1000, description="Complete checkpoints kept.")
    resume: str = Field(
        "auto", min_length=1, description='"auto" (latest complete), "never", or a checkpoint path.'
    )

    @model_validator(mode="after")
    def _one_source(self) -> "CheckpointSpec":
        if (self.persistent_volume_claim is None) == (self.volume is None):
            raise ValueError("checkpoint: set exactly one of persistentVolumeClaim and volume")
        if self.dir is not None and not (self.dir + "/").startswith(self.mount_path.rstrip("/") + "/"):
            raise ValueError(f"checkpoint.dir {self.dir!r} must lie under checkpoint.mountPath {self.mount_path!r}")
        return self

    def directory(self, job_name: str) -> str:
        return self.dir or f"{self.mount_path.rstrip('/')}/{job_name}"


FAILURE_ACTIONS = ("FailJob", "RestartJob", "RestartJobAndIgnoreMaxRestarts", "Ignore")
# What can be observed of a failed pod besides its exit code (see failures.py).
POD_FAILURE_CONDITIONS = ("DisruptionTarget", "Evicted", "OOMKilled", "Replaced", "NoExitCode")


class ExitCodes(_Model):
    operator: Literal["In", "NotIn"] = Field(description="Match codes in, or not in, values.")
    values: list[int] = Field(min_length=1, description="Exit codes (0..255).")

    @field_validator("values")
    @classmethod
    def _codes(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if not 0 <= v <= 255]
        if bad:
            raise ValueError(f"exit codes must be between 0 and 255, got {bad}")
        return values

    def matches(self, code: int | None) -> bool:
        if code is None:
            return False
        return (code in self.values) == (self.operator == "In")


class FailureRule(_Model):
    """First matching rule wins (user rules, then the defaults in docs/operator.md)."""

    name: str | None = Field(None, description="Shown in the status message when the rule decides.")
    action: Literal["FailJob", "RestartJob", "RestartJobAndIgnoreMaxRestarts", "Ignore"]
    roles: list[Literal["embeddingParameterServer", "embeddingWorker", "nnWorker", "dataloader"]] = Field(
        default_factory=list, description="Roles the rule applies to (empty: all)."
    )
    on_exit_codes: ExitCodes | None = Field(None, description="Match the failed container's exit code.")
    on_pod_conditions: list[Literal["DisruptionTarget", "Evicted", "OOMKilled", "Replaced", "NoExitCode"]] = (
        Field(default_factory=list, description="Match any of these observations of the pod.")
    )


class FailurePolicy(_Model):
    rules: list[FailureRule] = Field(default_factory=list, description="Checked before the defaults.")
    stateful_roles: list[Literal["embeddingParameterServer", "embeddingWorker"]] = Field(
        default_factory=lambda: ["embeddingParameterServer", "embeddingWorker"],
        description=(
            "Roles whose pods hold state the job cannot lose: a replaced or deleted pod of "
            "one is a failure (Replaced; reason PSReplaced or EmbeddingWorkerReplaced)."
        ),
    )


class Scheduling(_Model):
    """Gang scheduling and queueing (see docs/operator.md, "Gang scheduling")."""

    gang: Literal["none", "volcano", "coscheduling"] = Field(
        "none",
        description=(
            "Render a PodGroup with minMember = every pod of the job: volcano "
            "(scheduling.volcano.sh) or coscheduling (scheduler-plugins, scheduling.x-k8s.io)."
        ),
    )
    schedule_timeout_seconds: int | None = Field(
        None, ge=1, description="coscheduling PodGroup scheduleTimeoutSeconds."
    )
    queue: str | None = Field(None, description="Volcano queue of the PodGroup.")


class RunPolicy(_Model):
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        "Running",
        description=(
            "Which workloads to delete once the job is finished: Running (servers and "
            "unfinished roles), All, or None."
        ),
    )
    backoff_limit: int = Field(
        3, ge=0, le=1000, description="Whole-job restarts allowed after retryable failures."
    )
    active_deadline_seconds: int | None = Field(
        None, ge=1, description="Fail the job (DeadlineExceeded) this long after it started."
    )
    startup_deadline_seconds: int | None = Field(
        None,
        ge=1,
        description=(
            "Fail the job (StartupDeadlineExceeded) when an attempt is not Ready this long "
            "after its children were created."
        ),
    )
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the finished PersiaJob (and its children) after this."
    )
    suspend: bool = Field(False, description="Remove the job's workloads; resume by clearing it.")
    scheduler_name: str | None = Field(None, description="schedulerName of every pod.")
    priority_class_name: str | None = Field(None, description="priorityClassName of every pod.")
    grace_period_seconds: int = Field(
        30,
        ge=1,
        le=3600,
        description=(
            "PERSIA_GRACE_PERIOD_SECONDS: how long a role may take to flush and checkpoint on "
            "SIGTERM; pods get terminationGracePeriodSeconds = this + 5."
        ),
    )


_SPEC_RULES = [
    _cel(
        "(has(self.configs) && has(self.configs.globalConfig)) != "
        "(has(self.persiaEnv) && has(self.persiaEnv.PERSIA_GLOBAL_CONFIG))",
        "set exactly one of persiaEnv.PERSIA_GLOBAL_CONFIG and configs.globalConfig",
    ),
    _cel(
        "(has(self.configs) && has(self.configs.embeddingConfig)) != "
        "(has(self.persiaEnv) && has(self.persiaEnv.PERSIA_EMBEDDING_CONFIG))",
        "set exactly one of persiaEnv.PERSIA_EMBEDDING_CONFIG and configs.embeddingConfig",
    ),
    _cel(
        "has(self.persiaEnv) && has(self.persiaEnv.PERSIA_NN_WORKER_ENTRY)",
        "persiaEnv.PERSIA_NN_WORKER_ENTRY is required (the NN worker entry script)",
    ),
    _cel(
        "!has(self.dataloader) || (has(self.persiaEnv) && has(self.persiaEnv.PERSIA_DATALOADER_ENTRY))",
        "persiaEnv.PERSIA_DATALOADER_ENTRY is required when spec.dataloader is set",
    ),
    _cel(
        "!has(self.nats) || !(has(self.nats.auth) || has(self.nats.tls)) || has(self.nats.externalURL) || "
        "(has(self.env) && self.env.exists(e, e.name == 'PERSIA_NATS_URL'))",
        "nats.auth and nats.tls are for an external NATS (nats.externalURL, or PERSIA_NATS_URL in "
        "spec.env); a managed NATS gets generated credentials",
    ),
]


class ServingSpec(_Model):
    """Serving the job's model (docs/serving.md): inference PS replicas (a StatefulSet: each
    replica owns its shard of the rows, so it needs its index), inference embedding workers and
    model servers (Deployments with readiness probes), and a Service for predictions. Kept across
    training restarts; rendered by ``persia_operator.serving``."""

    model: str = Field(
        min_length=1,
        description=(
            "jit_dense.pt, or a checkpoint directory (the newest complete ckpt-*/jit_dense.pt is "
            "served and reloaded when a newer one appears), as the model server pods see it."
        ),
    )
    embedding_checkpoint: str | None = Field(
        None,
        description=(
            "Checkpoint the inference PS loads at start; unset: it starts empty and takes rows "
            "from incremental packets (online training with enable_incremental_update)."
        ),
    )
    embedding_parameter_server: RoleSpec
    embedding_worker: RoleSpec
    model_server: RoleSpec
    max_batch_size: int = Field(512, ge=1, le=65535, description="Samples per model call.")
    max_latency_ms: float = Field(5.0, ge=0, le=10000, description="Batching wait of a request.")


class PersiaJobSpec(_Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _SPEC_RULES})

    persia_env: PersiaEnv = Field(default_factory=PersiaEnv)
    env: list[EnvVar] = Field(
        default_factory=list, description="Env of every PERSIA pod.", json_schema_extra=_ENV_LIST
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="core/v1 Volumes of every PERSIA pod.",
        json_schema_extra=_NAMED_ITEMS,
    )
    log_level: str = Field("info", min_length=1, description="LOG_LEVEL of every pod.")
    restart_policy: Literal["Never", "OnFailure"] = Field(
        "Never",
        description=(
            "Pod restartPolicy of NN workers and data loaders (batch mode). Servers always "
            "restart in place; failures of any role restart the whole job."
        ),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="imagePullPolicy of every container (Kubernetes' default if unset)."
    )
    enable_metrics: bool = Field(
        True, description="Add Prometheus scrape annotations (every role serves /metrics)."
    )
    image: str | None = Field(None, description="Default image of every role.")
    training_mode: Literal["batch", "online"] = Field(
        "batch",
        description=(
            "batch: NN workers and data loaders are Indexed Jobs and the job succeeds when "
            "the NN workers complete; online: they are Deployments and never complete."
        ),
    )
    embedding_parameter_server: RoleSpec
    embedding_worker: RoleSpec
    nn_worker: NNWorkerSpec
    dataloader: RoleSpec | None = None
    nats: NatsSpec = Field(default_factory=NatsSpec)
    configs: Configs | None = None
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    checkpoint: CheckpointSpec | None = None
    serving: ServingSpec | None = Field(None, description="Serve the model as it trains (docs/serving.md).")
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)
    grpc_tls: SecretRef | None = Field(
        None,
        alias="grpcTLS",
        description=(
            "TLS for the PS and embedding-worker gRPC services: a Secret with ca.crt, tls.crt "
            "and tls.key (e.g. from cert-manager), mounted in every PERSIA pod."
        ),
    )
    scheduling: Scheduling = Field(default_factory=Scheduling)
    managed_by: str | None = Field(
        None,
        min_length=1,
        description=(
            "Controller that reconciles this job; the operator leaves jobs managed by another "
            f"controller alone (default and {C.MANAGED_BY_VALUE!r}: this operator). Immutable."
        ),
    )
    security_context: Literal["restricted", "none"] = Field(
        "restricted",
        description=(
            "restricted: non-root, no privilege escalation, all capabilities dropped, "
            "RuntimeDefault seccomp, read-only root filesystem for the servers. none: leave "
            "security contexts to the pod templates."
        ),
    )

    @field_validator("env")
    @classmethod
    def _unique_env(cls, env: list[EnvVar]) -> list[EnvVar]:
        return _check_env_names(env)

    @field_validator("volumes")
    @classmethod
    def _volumes_named(cls, volumes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        names = [v.get("name") for v in volumes]
        if not all(names):
            raise ValueError("every volume needs a name")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate volume names {duplicates}")
        return volumes

    @model_validator(mode="before")
    @classmethod
    def _restart_policy_always(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("restartPolicy") == "Always":
            raise ValueError(
                "restartPolicy: Always is not supported: NN workers would never complete; "
                "use Never (default) or OnFailure"
            )
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> "PersiaJobSpec":
        problems = []
        configs = self.configs or Configs()
        for env_name, inline, field in (
            ("PERSIA_GLOBAL_CONFIG", configs.global_config, "globalConfig"),
            ("PERSIA_EMBEDDING_CONFIG", configs.embedding_config, "embeddingConfig"),
        ):
            path = getattr(self.persia_env, env_name)
            if (inline is None) == (path is None):
                which = "both are set" if path else "neither is set"
                problems.append(f"set exactly one of persiaEnv.{env_name} and configs.{field} ({which})")
        if not self.persia_env.PERSIA_NN_WORKER_ENTRY:
            problems.append("persiaEnv.PERSIA_NN_WORKER_ENTRY is required (the NN worker entry script)")
        if self.dataloader is not None and not self.persia_env.PERSIA_DATALOADER_ENTRY:
            problems.append("persiaEnv.PERSIA_DATALOADER_ENTRY is required when spec.dataloader is set")
        problems += check_user_nats_url(self.env, self.roles(), self.nats.managed, self.nats.external_url)
        # The CEL rule's terms (it reads spec.env only): with nats.auth/tls, the URL goes there.
        if (self.nats.auth or self.nats.tls) and not (self.nats.external_url or _env_var(self.env, NATS_URL_ENV)):
            problems.append(
                "nats.auth and nats.tls are for an external NATS (nats.externalURL, or PERSIA_NATS_URL in "
                "spec.env); a managed NATS gets generated credentials"
            )
        volume_names = {v["name"] for v in self.volumes}
        if self.checkpoint is not None and self.checkpoint.volume and self.checkpoint.volume not in volume_names:
            problems.append(f"checkpoint.volume: volume {self.checkpoint.volume!r} is not in spec.volumes")
        for field, role in self.roles().items():
            template_volumes = {
                v.get("name") for v in ((role.template and role.template.spec) or {}).get("volumes", [])
            }
            for mount in role.volume_mounts:
                if mount["name"] not in volume_names | template_volumes:
                    problems.append(
                        f"{field}.volumeMounts: volume {mount['name']!r} is not in spec.volumes"
                    )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def roles(self) -> dict[str, RoleSpec]:
        """Present role blocks by spec field name, in a fixed order."""
        roles: dict[str, RoleSpec] = {
            "embeddingParameterServer": self.embedding_parameter_server,
            "embeddingWorker": self.embedding_worker,
            "nnWorker": self.nn_worker,
        }
        if self.dataloader is not None:
            roles["dataloader"] = self.dataloader
        return roles

    def role(self, role_id: str) -> RoleSpec | None:
        return self.roles().get(C.ROLE_FIELDS[role_id])

    def nats_url(self, job_name: str, namespace: str) -> str:
        """The PERSIA_NATS_URL every pod gets, as far as the spec tells it ("" when the user's
        comes from a Secret: see nats_url_secret)."""
        if not self.nats_managed():
            if self.nats.external_url:
                return self.nats.external_url
            user = self.user_nats_url()
            return (user.value or "") if user is not None else ""
        return f"nats://{job_name}-nats.{namespace}.svc:{C.NATS_CLIENT_PORT}"

    def nats_managed(self) -> bool:
        """Managed unless an external URL is given, explicitly or PERSIA's way.

        PERSIA's manifests brought their own NATS (nats-operator) and set PERSIA_NATS_URL
        in spec.env; such a manifest keeps using that NATS instead of getting a second one,
        whether the URL is a value or a valueFrom, in spec.env or in the roles' env (the
        managed NATS's credentials would be wrong for that NATS).
        """
        if self.nats.managed is not None:
            return self.nats.managed
        return not (self.nats.external_url or self.user_nats_url())

    def user_nats_url(self) -> EnvVar | None:
        """The PERSIA_NATS_URL the user sets for the pods (validation makes it the same for
        every role), or None."""
        urls = [url for url in user_nats_urls(self.env, self.roles()).values() if url is not None]
        return urls[0][1] if urls else None

    def nats_url_secret(self) -> tuple[str, str] | None:
        """(Secret, key) of a user's PERSIA_NATS_URL set through valueFrom.secretKeyRef: the
        operator reads it there to reach the same NATS as the pods."""
        user = self.user_nats_url()
        if user is None or self.nats.external_url or user.value_from is None:
            return None
        ref = user.value_from.get("secretKeyRef") or {}
        if not ref.get("name") or not ref.get("key"):
            return None
        return str(ref["name"]), str(ref["key"])

    def to_wire(self) -> dict[str, Any]:
        """The spec as stored in Kubernetes (camelCase, defaults filled, no nulls)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class JobMeta(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    creation_timestamp: str | None = Field(None, alias="creationTimestamp")


def check_job_name(name: str) -> list[str]:
    """The CEL rules on metadata.name, as plain checks."""
    problems = []
    if len(name) > C.MAX_JOB_NAME:
        problems.append(
            f"metadata.name {name!r} is {len(name)} characters; at most {C.MAX_JOB_NAME} are "
            f"allowed so that '{name}{C.LONGEST_WORKLOAD_SUFFIX}' fits in {C.MAX_WORKLOAD_NAME}"
        )
    if not re.match(C.JOB_NAME_PATTERN, name):
        problems.append(
            f"metadata.name {name!r} must be a DNS-1035 label (lower-case letters, digits and "
            "'-', starting with a letter)"
        )
    for ending in C.CLASHING_NAME_ENDINGS:
        if name.endswith(ending):
            problems.append(
                f"metadata.name {name!r} must not end in {ending!r}: its children would take names of the children "
                f"of job {name.removesuffix(ending)!r} (e.g. ConfigMap {name}-config)"
            )
    return problems


def _describe(err: dict[str, Any], prefix: str) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
    where = f"{prefix}.{loc}" if loc else prefix
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] in ("missing", "extra_forbidden"):
        if err["type"] == "extra_forbidden":
            return f"{where}: unknown field (value {err.get('input')!r})"
        return f"{where}: field required"
    value = err.get("input")
    shown = "" if isinstance(value, dict) or value is None else f" (got {value!r})"
    if shown and repr(value) in message:
        shown = ""
    return f"{where}: {message}{shown}"


def parse_spec(raw: Any) -> PersiaJobSpec:
    """Validate a spec from the API (camelCase); raise SpecError naming fields and values."""
    if not isinstance(raw, dict):
        raise SpecError([f"spec: must be an object, got {type(raw).__name__}"])
    try:
        return PersiaJobSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError([_describe(e, "spec") for e in err.errors()]) from None


KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def check_queue_label(labels: dict[str, str]) -> list[str]:
    """A Kueue queue label is refused, not half honoured. Kueue admits plain pods as one group
    only when no integration of its own owns them, and Jobs (NN workers, data loaders) always
    have one, as StatefulSets do where Kueue runs its statefulset integration: the group's total
    was never reached, the servers' pods stayed gated while the NN workers ran outside the
    quota. (A queueing controller may still suspend the job: `runPolicy.suspend`.)"""
    queue = labels.get(KUEUE_QUEUE_LABEL)
    if queue is None:
        return []
    return [f"metadata.labels.{KUEUE_QUEUE_LABEL}={queue!r}: Kueue is not supported yet: its plain-pod groups leave "
            "out pods a Job or a StatefulSet owns, so the job would wait for admission for ever; remove the label "
            "(scheduling.gang: volcano or coscheduling schedules the job's pods all or nothing)"]


def validate_job(body: dict[str, Any]) -> tuple[JobMeta, PersiaJobSpec]:
    """Validate a whole PersiaJob manifest (apiVersion, kind, metadata, spec)."""
    problems = []
    if body.get("apiVersion") != C.API_VERSION:
        problems.append(f"apiVersion must be {C.API_VERSION}, got {body.get('apiVersion')!r}")
    if body.get("kind") != C.KIND:
        problems.append(f"kind must be {C.KIND}, got {body.get('kind')!r}")
    meta_raw = body.get("metadata") or {}
    if not meta_raw.get("name"):
        problems.append("metadata.name: field required")
        meta = None
    else:
        meta = JobMeta.model_validate(meta_raw)
        problems += check_job_name(meta.name)
        problems += check_queue_label(meta.labels)
    spec: PersiaJobSpec | None = None
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError as err:
        problems += err.problems
    if problems:
        raise SpecError(problems)
    assert meta is not None and spec is not None
    return meta, spec
