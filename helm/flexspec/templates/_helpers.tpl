{{/* Chart name, overridable with nameOverride. */}}
{{- define "flexspec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects. Kept to 40 characters: KubeRay derives longer names from the RayService
name (its RayCluster, head and serve Services).
*/}}
{{- define "flexspec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "flexspec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flexspec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "flexspec.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "flexspec.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The Kubernetes extended resource of one GPU: nvidia.com/gpu or amd.com/gpu. */}}
{{- define "flexspec.gpuResource" -}}
{{- if eq .Values.gpu.vendor "amd" }}amd.com/gpu{{ else }}nvidia.com/gpu{{ end }}
{{- end }}

{{/* "0,1,...,n-1" for n GPUs: the pod-local device indices (HIP_VISIBLE_DEVICES). */}}
{{- define "flexspec.deviceList" -}}
{{- $ids := list }}
{{- range $i := until (int .) }}{{ $ids = append $ids (toString $i) }}{{ end }}
{{- join "," $ids }}
{{- end }}

{{/* Container image reference. */}}
{{- define "flexspec.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}
