{{/* RELEASE-operator, the name of everything this chart makes */}}
{{- define "kvpark.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpark.selectorLabels" -}}
app.kubernetes.io/name: kvpark-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpark.labels" -}}
{{ include "kvpark.selectorLabels" . }}
app.kubernetes.io/part-of: kvpark
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvpark.serviceAccountName" -}}
{{- default (include "kvpark.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* a map as k=v,k2=v2 (sorted), the way the operator reads KVPARK_POD_MONITOR_LABELS */}}
{{- define "kvpark.labelPairs" -}}
{{- $pairs := list -}}
{{- range $key, $value := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* metrics.podMonitor as the operator reads it: auto or false (`--set` makes booleans) */}}
{{- define "kvpark.podMonitor" -}}
{{- $value := toString .Values.metrics.podMonitor -}}
{{- ternary "false" "auto" (eq $value "false") -}}
{{- end -}}

{{- define "kvpark.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Least privilege: exactly the calls operator/kube.py and kopf make
(tests/operator/test_operator_rbac.py compares these rules with what they call), and update on
preemptservers/finalizers, which no call uses: the children's owner references set
blockOwnerDeletion, which the OwnerReferencesPermissionEnforcement admission plugin allows only to
who may update the owner's finalizers.
*/}}
{{- define "kvpark.rules" -}}
# patch: kopf takes off the finalizer an older operator's timer added
- apiGroups: [kvpark.io]
  resources: [preemptservers]
  verbs: [list, watch, patch]
- apiGroups: [kvpark.io]
  resources: [preemptservers/status]
  verbs: [patch]
- apiGroups: [kvpark.io]
  resources: [preemptservers/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, create, patch, delete]
- apiGroups: [inference.networking.k8s.io, inference.networking.x-k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* kopf's peering (kopf: list, watch, patch; kube.py: get), of the kind the mode uses */}}
{{- define "kvpark.peeringRules" -}}
- apiGroups: [kopf.dev]
  resources: [{{ . }}]
  verbs: [get, list, watch, patch, create]
{{- end -}}
