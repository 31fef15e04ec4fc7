{{/* Full name of the release's objects (at most 63 characters). */}}
{{- define "persia-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "persia-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "persia-operator.labels" -}}
{{ include "persia-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "persia-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "persia-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Watched namespaces as a JSON list (empty: cluster-wide). */}}
{{- define "persia-operator.watchNamespaces" -}}
{{- $list := list -}}
{{- range .Values.watchNamespaces }}{{ $list = append $list . }}{{ end -}}
{{- if .Values.watchNamespace }}{{ $list = append $list .Values.watchNamespace }}{{ end -}}
{{- $list | uniq | toJson -}}
{{- end -}}

{{/* Exactly the API calls the operator makes (tests/operator/test_operator_rbac.py derives
them from a run of the operator and compares both ways). */}}
{{- define "persia-operator.rules" -}}
# The jobs: watched by kopf, read fresh by each pass, finalizer/annotations patched by
# kopf, deleted after ttlSecondsAfterFinished, listed by the pre-delete hook.
- apiGroups: ["persia.com"]
  resources: ["persiajobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["persia.com"]
  resources: ["persiajobs/status"]
  verbs: ["patch"]
# Not an API call: owner references with blockOwnerDeletion need it (admission).
- apiGroups: ["persia.com"]
  resources: ["persiajobs/finalizers"]
  verbs: ["update"]
# Children. get: only after a 409 on create (is it ours?), and workloads a restart waits on.
# patch: online resize; the job's config ConfigMap after "suspend, edit, resume".
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
# The job's PDBs are read by name each pass (auxiliary: a job runs without them).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create"]
# Pods are only watched (exit codes, evictions, uids, readiness).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# The generated <job>-auth Secret and the Secrets a job names (nats.auth, nats.tls):
# read by name, never listed or watched.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# Gang scheduling (spec.scheduling.gang); harmless where the CRDs are not installed.
# patch: a resize sets minMember to the job's new size.
- apiGroups: ["scheduling.volcano.sh", "scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}
