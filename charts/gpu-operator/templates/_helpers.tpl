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

{{/*
The operator's image. repository/image:version, the tag defaulting to the appVersion (the
version of every part of a release: Cargo, chart, bundle and image). A digest is taken as
operator.version=sha256:... or as an image that already holds one (gpu-operator@sha256:...);
with repository and version empty, an image with its own tag is used as it is.
*/}}
{{- define "gpu-operator.image" -}}
{{- $op := .Values.operator -}}
{{- $name := $op.image -}}
{{- if $op.repository }}{{ $name = printf "%s/%s" (trimSuffix "/" $op.repository) $op.image }}{{ end -}}
{{- $version := toString ($op.version | default "") -}}
{{- if contains "@" $name -}}
{{ $name }}
{{- else if and (not $op.repository) (not $version) (contains ":" (last (splitList "/" $name))) -}}
{{ $name }}
{{- else if hasPrefix "sha256:" $version -}}
{{ printf "%s@%s" $name $version }}
{{- else -}}
{{ printf "%s:%s" $name ($version | default .Chart.AppVersion) }}
{{- end -}}
{{- end -}}

{{/*
The oldest Kubernetes release the operator supports: MIN_KUBERNETES_VERSION in
operator/src/api/mod.rs (xtask/tests/release.rs checks that they agree).
*/}}
{{- define "gpu-operator.minKubernetesVersion" -}}1.33{{- end -}}

{{/*
What can only be checked against the cluster the chart is installed into: its Kubernetes
version, and that the operator has an image to run. `lookup` answers only when Helm talks to a
cluster (install, upgrade, --dry-run=server); offline (`helm template`, `helm lint`) it returns
nothing, so rendering for review or GitOps needs no flags. kube-system exists in every cluster.
*/}}
{{- define "gpu-operator.clusterChecks" -}}
{{- if lookup "v1" "Namespace" "" "kube-system" -}}
{{- $min := include "gpu-operator.minKubernetesVersion" . -}}
{{- $running := .Capabilities.KubeVersion.Version -}}
{{- /* -0 lets pre-release and vendor builds such as v1.33.1-eks-1234 compare as releases. */ -}}
{{- if semverCompare (printf "<%s.0-0" $min) $running -}}
{{- fail (printf "this cluster runs Kubernetes %s; the GPU operator needs %s or later (the oldest release its API client and the ClusterPolicy CRD's validation rules support)" $running $min) -}}
{{- end -}}
{{- $image := include "gpu-operator.image" . -}}
{{- if not (contains "/" $image) -}}
{{- fail (printf "operator.repository is not set, so the operator's image would be %q, which no registry serves: this chart comes from a checkout, and only a released chart names its image. Install the released chart (docs/install.md: helm install gpu-operator oci://<registry>/charts/gpu-operator), publish your own release with make release REGISTRY=<registry> (docs/install.md), or set operator.repository to the registry and path you pushed the image to, for example --set operator.repository=registry.example.com/gpu-operator (operator.version: the tag, default %s, or a digest sha256:...)" $image .Chart.AppVersion) -}}
{{- end -}}
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
