{{/*
Names. The full name is cut to 40 characters so that "<fullname>-p<i>-stage-<s>" (a pod's
hostname) stays within the 63 characters of a DNS label.
*/}}
{{- define "sarathi.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels shared by every object of the release. */}}
{{- define "sarathi.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sarathi.labels" -}}
{{ include "sarathi.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Per-pipeline names; call with (dict "root" $ "pipeline" $i). */}}
{{- define "sarathi.controllerName" -}}
{{- printf "%s-p%d-controller" (include "sarathi.fullname" .root) (int .pipeline) -}}
{{- end -}}
{{- define "sarathi.controlServiceName" -}}
{{- printf "%s-p%d-control" (include "sarathi.fullname" .root) (int .pipeline) -}}
{{- end -}}
{{- define "sarathi.stageSetName" -}}
{{- printf "%s-p%d-stage" (include "sarathi.fullname" .root) (int .pipeline) -}}
{{- end -}}
{{- define "sarathi.stagesServiceName" -}}
{{- printf "%s-stages" (include "sarathi.fullname" .) -}}
{{- end -}}
{{- define "sarathi.grpcHeadlessName" -}}
{{- printf "%s-grpc-headless" (include "sarathi.fullname" .) -}}
{{- end -}}
{{- define "sarathi.controllerAccountName" -}}
{{- printf "%s-controller" (include "sarathi.fullname" .) -}}
{{- end -}}
{{- define "sarathi.eppName" -}}
{{- printf "%s-epp" (include "sarathi.fullname" .) -}}
{{- end -}}

{{/* Labels of every controller pod of the release (Services, InferencePool, ServiceMonitor). */}}
{{- define "sarathi.controllerSelector" -}}
{{ include "sarathi.selectorLabels" . }}
app.kubernetes.io/component: controller
{{- end -}}
{{- define "sarathi.clusterName" -}}
{{- printf "%s-p%d" (.root.Values.etcd.clusterName | default (include "sarathi.fullname" .root)) (int .pipeline) -}}
{{- end -}}

{{/* etcd client endpoint HOST:PORT (external, or the in-chart one). */}}
{{- define "sarathi.etcdEndpoint" -}}
{{- if .Values.etcd.endpoint -}}
{{- .Values.etcd.endpoint -}}
{{- else -}}
{{- printf "%s-etcd:%d" (include "sarathi.fullname" .) (int .Values.etcd.clientPort) -}}
{{- end -}}
{{- end -}}

{{/* Images: workers follow `device`; the controller runs no model, so it takes the CPU image. */}}
{{- define "sarathi.workerImage" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.device) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- define "sarathi.controllerImage" -}}
{{- $tag := .Values.image.tag | default (printf "%s-cpu" .Chart.AppVersion) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "sarathi.attention" -}}
{{- .Values.stage.attention | default (eq .Values.device "cuda" | ternary "flashinfer" "torch") -}}
{{- end -}}

{{/*
Checks the schema cannot express (it sees one field at a time); they also hold with
--skip-schema-validation.
*/}}
{{- define "sarathi.demoModelPath" -}}/opt/sarathi/models/smollm2-135m-instruct{{- end -}}

{{- define "sarathi.validate" -}}
{{- if hasKey .Values "replicas" -}}
{{- fail (printf "replicas=%v: the value is now called pipelines (independent pipelines, a controller and its pp stage pods each): --set pipelines=%v" .Values.replicas .Values.replicas) -}}
{{- end -}}
{{- if not .Values.model.path -}}
{{- fail "model.path is required: the folder with config.json, tokenizer.json and *.safetensors inside the pods (--set model.path=/models/NAME)" -}}
{{- end -}}
{{- if and (eq .Values.device "cuda") (eq .Values.model.path (include "sarathi.demoModelPath" .)) (not .Values.model.volume) -}}
{{- fail "device=cuda: the demo model is baked into the CPU image only; set model.path and model.volume to the weights (see ci/gpu-tp4-pp2-values.yaml)" -}}
{{- end -}}
{{- if and .Values.inferencePool.enabled (not (int .Values.controller.httpPort)) -}}
{{- fail "inferencePool.enabled needs controller.httpPort: the inference gateway sends OpenAI requests and reads /metrics there" -}}
{{- end -}}
{{- if or (lt (int .Values.pp) 1) (lt (int .Values.tp) 1) (gt (int .Values.tp) 8) -}}
{{- fail (printf "pp=%v tp=%v: pp must be >= 1 and tp in 1..8" .Values.pp .Values.tp) -}}
{{- end -}}
{{- $budget := int .Values.scheduler.budgetTokens -}}
{{- $tile := int .Values.scheduler.tileTokens -}}
{{- if or (lt $budget 1) (lt $tile 1) (ne 0 (mod $budget $tile)) -}}
{{- fail (printf "scheduler.budgetTokens=%d must be a positive multiple of scheduler.tileTokens=%d" $budget $tile) -}}
{{- end -}}
{{- if and (gt (int .Values.controller.replicas) 1) (not .Values.etcd.enabled) -}}
{{- fail (printf "controller.replicas=%v needs etcd.enabled=true: the standby is elected through an etcd lease" .Values.controller.replicas) -}}
{{- end -}}
{{- if and (eq .Values.stage.attention "flashinfer") (ne .Values.device "cuda") -}}
{{- fail "stage.attention=flashinfer needs device=cuda" -}}
{{- end -}}
{{- end -}}

{{/* Rolls the pods when the ConfigMaps they read change. */}}
{{- define "sarathi.configChecksum" -}}
{{- $cfg := include (print .Template.BasePath "/configmap.yaml") . -}}
{{- $cfg | sha256sum | trunc 16 -}}
{{- end -}}

{{/*
The model volume and its mount, shared by controller and stage pods; nothing when model.volume is
empty (the model is in the image).
*/}}
{{- define "sarathi.modelVolume" -}}
{{- if .Values.model.volume -}}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end -}}
{{- end -}}
{{- define "sarathi.modelMount" -}}
{{- if .Values.model.volume -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end -}}
{{- end -}}

{{/* Pod (anti-)affinity term matching the stage pods of one pipeline; call with $p. */}}
{{- define "sarathi.pipelineStagesTerm" -}}
topologyKey: kubernetes.io/hostname
labelSelector:
  matchLabels:
    {{- include "sarathi.selectorLabels" .root | nindent 4 }}
    app.kubernetes.io/component: stage
    sarathi-cluster/pipeline: {{ .pipeline | quote }}
{{- end -}}
