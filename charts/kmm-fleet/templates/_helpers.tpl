{{/*
The labels every object carries: kustomize's `labels` transformer in
addon-manifests/hub adds app.kubernetes.io/part-of to each object's metadata (not to
selectors or Pod templates). Helm's own conventional labels (helm.sh/chart,
app.kubernetes.io/managed-by, ...) are left out so that the default render equals the
kustomize base; Helm adds its ownership label and annotations when it installs.
*/}}
{{- define "kmm-fleet.partOf" -}}
app.kubernetes.io/part-of: kmm-fleet
{{- end }}

{{/* The tag of an image: its own, else global.imageTag, else the chart's appVersion. */}}
{{- define "kmm-fleet.tag" -}}
{{- .image.tag | default .root.Values.global.imageTag | default .root.Chart.AppVersion -}}
{{- end }}

{{/* An image reference from images.<name> with the global fallbacks. */}}
{{- define "kmm-fleet.image" -}}
{{- $registry := .image.registry | default .root.Values.global.imageRegistry -}}
{{- printf "%s/%s:%s" $registry .image.repository (include "kmm-fleet.tag" .) -}}
{{- end }}

{{/* The AddOnTemplate's name: a new version of kmm ships a new AddOnTemplate. */}}
{{- define "kmm-fleet.addonTemplate" -}}
kmm-{{ .Chart.AppVersion }}
{{- end }}
