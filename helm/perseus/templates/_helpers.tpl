{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "perseus.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release name + chart name, unless the release name already contains it. */}}
{{- define "perseus.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "perseus.operator.fullname" -}}
{{- printf "%s-operator" (include "perseus.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "perseus.agent.fullname" -}}
{{- printf "%s-node-agent" (include "perseus.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "perseus.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "perseus.labels" -}}
helm.sh/chart: {{ include "perseus.chart" . }}
app.kubernetes.io/name: {{ include "perseus.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: perseus
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of a component: (dict "ctx" $ "component" "operator"). */}}
{{- define "perseus.selectorLabels" -}}
app.kubernetes.io/name: {{ include "perseus.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "perseus.componentLabels" -}}
{{ include "perseus.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "perseus.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "perseus.operator.fullname" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "perseus.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create -}}
{{- default (include "perseus.agent.fullname" .) .Values.agent.serviceAccount.name -}}
{{- else -}}
{{- required "agent.serviceAccount.name is required when agent.serviceAccount.create is false" .Values.agent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image reference: (dict "ctx" $ "image" .Values.operator.image). */}}
{{- define "perseus.image" -}}
{{- $registry := (.ctx.Values.global).imageRegistry | default .ctx.Values.image.registry -}}
{{- $repo := .image.repository -}}
{{- if $registry -}}{{- $repo = printf "%s/%s" $registry $repo -}}{{- end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repo .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The user name of the agents' service account, as the API server authenticates it. */}}
{{- define "perseus.agent.username" -}}
{{- printf "system:serviceaccount:%s:%s" (include "perseus.namespace" .) (include "perseus.agent.serviceAccountName" .) -}}
{{- end -}}

{{/* The namespace of every namespaced object: namespaceOverride, else the release's. */}}
{{- define "perseus.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}
