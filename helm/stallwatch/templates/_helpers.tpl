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
{{- if .Values.podResources.enabled }}
{{- $_ := set $config "collector.pods" true }}
{{- $_ := set $config "pods.socket" "/var/lib/kubelet/pod-resources/kubelet.sock" }}
{{- $_ := set $config "pods.interval" .Values.podResources.interval }}
{{- end }}
{{- with .Values.agent.spokeCapacityBytes }}
{{- $_ := set $config "correlator.cache-capacity" . }}
{{- end }}
{{- if .Values.webConfig.enabled }}
{{- $_ := set $config "web.config.file" (printf "%s/web-config.yml" (trimSuffix "/" .Values.webConfig.mountPath)) }}
{{- end }}
{{- toYaml (mergeOverwrite $config .Values.agent.config) }}
{{- end }}

{{/* "true" when the agent's web config turns TLS on (from the inline document, or as declared). */}}
{{- define "stallwatch.tls" -}}
{{- with .Values.webConfig }}{{ if and .enabled (or .tls (hasKey .config "tls_server_config")) }}true{{ end }}{{ end }}
{{- end }}

{{- define "stallwatch.basicAuth" -}}
{{- with .Values.webConfig }}{{ if and .enabled (or .basicAuth (hasKey .config "basic_auth_users")) }}true{{ end }}{{ end }}
{{- end }}

{{/*
The scrape job Prometheus gives the agents: the value of the Service label that serviceMonitor.jobLabel
names (the operator's rule), else the Service's name. The rules select the agents by it.
*/}}
{{- define "stallwatch.scrapeJob" -}}
{{- $labels := include "stallwatch.labels" . | fromYaml }}
{{- with .Values.serviceMonitor.jobLabel }}
{{- if not (hasKey $labels .) }}
{{- fail (printf "serviceMonitor.jobLabel: the Service has no label %q (it has: %s)" . (keys $labels | sortAlpha | join ", ")) }}
{{- end }}
{{- index $labels . }}
{{- else }}
{{- include "stallwatch.fullname" . }}
{{- end }}
{{- end }}

{{/*
The agent container's securityContext: device mounts need a privileged container, the kubelet's
pod-resources socket a root user (see values.yaml).
*/}}
{{- define "stallwatch.containerSecurityContext" -}}
{{- $context := deepCopy .Values.securityContext }}
{{- if eq .Values.gpu.access "devices" }}
{{- $_ := set $context "privileged" true }}
{{- $_ := set $context "allowPrivilegeEscalation" true }}
{{- end }}
{{- if .Values.podResources.enabled }}
{{- $_ := set $context "runAsUser" 0 }}
{{- $_ := set $context "runAsNonRoot" false }}
{{- end }}
{{- toYaml $context }}
{{- end }}

{{/*
A probe of the agent: HTTP GET on the metrics port, HTTPS when TLS is on, and a TCP connect when basic
auth is on (the kubelet cannot send a password; /-/healthy and /-/ready answer whenever the server runs,
so the connect checks the same). Call with (list $ .Values.livenessProbe).
*/}}
{{- define "stallwatch.probe" -}}
{{- $root := index . 0 }}
{{- $probe := deepCopy (index . 1) }}
{{- if include "stallwatch.basicAuth" $root }}
{{- $_ := unset $probe "httpGet" }}
{{- $_ := set $probe "tcpSocket" (dict "port" "metrics") }}
{{- else }}
{{- $get := mergeOverwrite (dict "port" "metrics") ($probe.httpGet | default dict) }}
{{- if include "stallwatch.tls" $root }}
{{- $_ := set $get "scheme" "HTTPS" }}
{{- end }}
{{- $_ := set $probe "httpGet" $get }}
{{- end }}
{{- toYaml $probe }}
{{- end }}

{{- define "stallwatch.webConfigSecret" -}}
{{- .Values.webConfig.existingSecret | default (printf "%s-web-config" (include "stallwatch.fullname" .) | trunc 63 | trimSuffix "-") }}
{{- end }}
