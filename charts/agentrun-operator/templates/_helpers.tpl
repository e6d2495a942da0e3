{{/*
Names and labels shared by every template.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "agentrun-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The fully qualified name of the release's objects: fullnameOverride, else the
release name when it already contains the chart name, else <release>-<chart>.
Cluster-scoped objects (ClusterRole, ClusterRoleBinding) use it too, so two
releases never share them.
*/}}
{{- define "agentrun-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart-version, for the helm.sh/chart label. */}}
{{- define "agentrun-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "agentrun-operator.labels" -}}
helm.sh/chart: {{ include "agentrun-operator.chart" . }}
{{ include "agentrun-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the operator's Pods (immutable once deployed). */}}
{{- define "agentrun-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agentrun-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "agentrun-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "agentrun-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The leader-election Lease (in the release namespace). */}}
{{- define "agentrun-operator.leaseName" -}}
{{- default (include "agentrun-operator.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* The operator image reference. */}}
{{- define "agentrun-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Base name of the cluster-scoped admission policies: the full name, and with
watchNamespace also that namespace, so one release per namespace (the
namespace-scoped pattern) gets policies of its own.
*/}}
{{- define "agentrun-operator.policyName" -}}
{{- $name := include "agentrun-operator.fullname" . }}
{{- if .Values.watchNamespace }}
{{- printf "%s-%s" $name .Values.watchNamespace }}
{{- else }}
{{- $name }}
{{- end }}
{{- end }}
