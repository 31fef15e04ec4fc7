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


class TemplateMetadata(_Model):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


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


_REPLICAS_RULE = _cel(
    f"self.replicas >= 1 && self.replicas <= {C.MAX_REPLICAS}",
    f"replicas must be between 1 and {C.MAX_REPLICAS}",
    ".replicas",
)


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


class PersiaEnv(BaseModel):
    """PERSIA's config file paths and entry points, passed to every pod as env."""

    model_config = ConfigDict(extra="forbid")

    PERSIA_GLOBAL_CONFIG: str | None = Field(None, description="Path of global_config.yml.")
    PERSIA_EMBEDDING_CONFIG: str | None = Field(None, description="Path of embedding_config.yml.")
    PERSIA_NN_WORKER_ENTRY: str | None = Field(None, description="NN worker entry script.")
    PERSIA_DATALOADER_ENTRY: str | None = Field(None, description="Data loader entry script.")


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
    resources: dict[str, Any] | None = Field(None, description="Managed NATS container resources.")
    template: PodTemplateOverlay | None = None

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
]


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
        volume_names = {v["name"] for v in self.volumes}
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
        """The PERSIA_NATS_URL every pod gets."""
        if not self.nats_managed():
            if self.nats.external_url:
                return self.nats.external_url
            return self._legacy_nats_url() or ""
        return f"nats://{job_name}-nats.{namespace}.svc:{C.NATS_CLIENT_PORT}"

    def nats_managed(self) -> bool:
        """Managed unless an external URL is given, explicitly or PERSIA's way.

        PERSIA's manifests brought their own NATS (nats-operator) and set PERSIA_NATS_URL
        in spec.env; such a manifest keeps using that NATS instead of getting a second one.
        """
        if self.nats.managed is not None:
            return self.nats.managed
        return not (self.nats.external_url or self._legacy_nats_url())

    def _legacy_nats_url(self) -> str | None:
        for var in self.env:
            if var.name == "PERSIA_NATS_URL" and var.value:
                return var.value
        return None

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
    spec: PersiaJobSpec | None = None
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError as err:
        problems += err.problems
    if problems:
        raise SpecError(problems)
    assert meta is not None and spec is not None
    return meta, spec
