{{/*
Names and labels shared by every template of the matrixpool chart.
*/}}

{{/* Chart name, truncated to a DNS label. */}}
{{- define "matrixpool.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects: the release name, suffixed with the chart name unless the
release name already contains it. Cluster-scoped objects use it too, so two releases never
collide.
*/}}
{{- define "matrixpool.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "matrixpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the operator pods; never change them (selectors are immutable). */}}
{{- define "matrixpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "matrixpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "matrixpool.labels" -}}
helm.sh/chart: {{ include "matrixpool.chart" . }}
{{ include "matrixpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: matrixpool
{{- end }}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "matrixpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "matrixpool.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- $message := "serviceAccount.name is required when serviceAccount.create is false" }}
{{- required $message .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Operator image reference; the tag defaults to the chart's appVersion. */}}
{{- define "matrixpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Name of the kopf peering object. */}}
{{- define "matrixpool.peeringName" -}}
{{- default (include "matrixpool.fullname" .) .Values.operator.peering.name }}
{{- end }}

{{/* Name of the checkpoint daemons' Secret (the cluster secret); the operator mounts it too. */}}
{{- define "matrixpool.checkpointSecret" -}}
{{- $name := printf "%s-checkpoint" (include "matrixpool.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- default $name .Values.checkpointDaemon.token.existingSecret }}
{{- end }}

{{/* Rules the values must follow that values.schema.json cannot state with a clear message. */}}
{{- define "matrixpool.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.operator.peering.enabled) }}
{{- fail "replicaCount > 1 needs operator.peering.enabled=true (kopf peering keeps replicas apart)" }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "serviceMonitor.enabled=true needs metrics.enabled=true" }}
{{- end }}
{{- end }}
