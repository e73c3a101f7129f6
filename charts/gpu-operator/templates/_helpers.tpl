{{/*
Names are fixed, as in NVIDIA's chart: one operator per cluster, and the operator's generated
RBAC (`gpu-operator rbac`) names its ClusterRole gpu-operator.
*/}}
{{- define "gpu-operator.name" -}}gpu-operator{{- end -}}

{{/* Labels of every object of the release. */}}
{{- define "gpu-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: gpu-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpu-operator
{{- end -}}

{{/* Selector labels of the operator's pods (NVIDIA's app label included). */}}
{{- define "gpu-operator.selectorLabels" -}}
app: gpu-operator
app.kubernetes.io/component: gpu-operator
{{- end -}}

{{/* The operator's image: repository/image:version, the tag defaulting to the appVersion. */}}
{{- define "gpu-operator.image" -}}
{{- $op := .Values.operator -}}
{{- $name := $op.image -}}
{{- if $op.repository }}{{ $name = printf "%s/%s" (trimSuffix "/" $op.repository) $op.image }}{{ end -}}
{{- $tag := toString ($op.version | default .Chart.AppVersion) -}}
{{- if hasPrefix "sha256:" $tag -}}
{{ printf "%s@%s" $name $tag }}
{{- else -}}
{{ printf "%s:%s" $name $tag }}
{{- end -}}
{{- end -}}

{{/*
gpu-operator.pick: YAML of the entries of .values named in .keys (all keys when .keys is
absent) that are set: booleans and numbers always, strings, lists and maps when not empty.
"version" becomes a string, because `--set driver.version=550.54` arrives as a number.
Use as: include "gpu-operator.pick" (dict "values" .Values.gfd "keys" (list ...)) | fromYaml
*/}}
{{- define "gpu-operator.pick" -}}
{{- $out := dict -}}
{{- $values := .values | default dict -}}
{{- range $key := (.keys | default (keys $values | sortAlpha)) -}}
{{- if hasKey $values $key -}}
{{- $v := get $values $key -}}
{{- if or (kindIs "bool" $v) (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) (not (empty $v)) -}}
{{- if eq $key "version" }}{{ $v = toString $v }}{{ end -}}
{{- $_ := set $out $key $v -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The image keys of an operand section, and its container overrides. */}}
{{- define "gpu-operator.imageKeys" -}}repository image version imagePullPolicy imagePullSecrets{{- end -}}
{{- define "gpu-operator.containerKeys" -}}resources args env{{- end -}}
