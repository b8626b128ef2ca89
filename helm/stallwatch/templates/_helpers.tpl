{{- define "stallwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stallwatch.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "stallwatch.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "stallwatch.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "stallwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stallwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stallwatch.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "stallwatch.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: agent
{{- end }}

{{- define "stallwatch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stallwatch.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A Kubernetes object name from a file name: "Stall_Overview.json" -> "stall-overview". */}}
{{- define "stallwatch.fileObjectName" -}}
{{- $stem := base . | trimSuffix (ext .) | lower }}
{{- regexReplaceAll "[^a-z0-9-]+" $stem "-" | trimAll "-" }}
{{- end }}

{{- define "stallwatch.socketPath" -}}
{{- printf "%s/events.sock" (trimSuffix "/" .Values.socket.mountPath) }}
{{- end }}

{{/*
The agent's configuration file: flag names without the dashes. The chart's own settings first,
then agent.config on top, so any flag can be preset from values.
*/}}
{{- define "stallwatch.agentConfig" -}}
{{- $config := dict
  "web.listen-address" (printf ":%d" (int .Values.agent.port))
  "web.telemetry-path" .Values.agent.telemetryPath
  "log.level" .Values.agent.logLevel }}
{{- range $name, $enabled := .Values.agent.collectors }}
{{- $_ := set $config (printf "collector.%s" $name) $enabled }}
{{- end }}
{{- if .Values.agent.collectors.events }}
{{- $_ := set $config "events.socket" (include "stallwatch.socketPath" .) }}
{{- end }}
{{- if .Values.hostProc.enabled }}
{{- /* The node's mounts are its init's: the agent's own /proc/self lists only the pod's. */}}
{{- $_ := set $config "spoke_nfs.proc" .Values.hostProc.mountPath }}
{{- $_ := set $config "spoke_nfs.pid" 1 }}
{{- end }}
{{- toYaml (mergeOverwrite $config .Values.agent.config) }}
{{- end }}

{{/* The agent container's securityContext: device mounts need a privileged container (see values.yaml). */}}
{{- define "stallwatch.containerSecurityContext" -}}
{{- $context := deepCopy .Values.securityContext }}
{{- if eq .Values.gpu.access "devices" }}
{{- $_ := set $context "privileged" true }}
{{- $_ := set $context "allowPrivilegeEscalation" true }}
{{- end }}
{{- toYaml $context }}
{{- end }}

{{- define "stallwatch.probe" -}}
{{- toYaml (mergeOverwrite (dict "httpGet" (dict "port" "metrics")) (deepCopy .)) }}
{{- end }}
