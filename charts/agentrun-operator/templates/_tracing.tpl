{{/*
The operator's OpenTelemetry environment (values `tracing`): the standard
OTEL_* variables, so the operator exports its runs' traces over OTLP
(HTTP/protobuf). Nothing when tracing.enabled is false.
*/}}
{{- define "agentrun-operator.tracingEnv" -}}
{{- with .Values.tracing }}
{{- if .enabled }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ required "tracing.endpoint is required when tracing.enabled is true (e.g. http://otel-collector.observability:4318)" .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: "http/protobuf"
- name: OTEL_SERVICE_NAME
  value: {{ .serviceName | default "agentrun-operator" | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
{{- if ne (toString .samplerArg) "" }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | toString | quote }}
{{- end }}
{{- $attrs := list (printf "k8s.namespace.name=%s" $.Release.Namespace) }}
{{- range $k, $v := .resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k $v) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- with .headersSecret }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: headers
{{- end }}
{{- end }}
{{- end }}
{{- end }}
