{{/*
zdelay chart helpers. The named templates a parent chart uses for a sidecar take the
subchart's own context, `.Subcharts.zdelay` (Helm 3.7+):

  initContainers:
    {{- include "zdelay.sidecar.container" .Subcharts.zdelay | nindent 8 }}
  volumes:
    {{- include "zdelay.sidecar.volumes" .Subcharts.zdelay | nindent 8 }}
  terminationGracePeriodSeconds: {{ include "zdelay.terminationGracePeriodSeconds" .Subcharts.zdelay }}
  annotations:
    checksum/zdelay-config: {{ include "zdelay.configChecksum" .Subcharts.zdelay }}
*/}}

{{- define "zdelay.name" -}}
{{- default "zdelay" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "zdelay.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "zdelay.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "zdelay.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "zdelay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "zdelay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "zdelay.labels" -}}
{{- include "zdelay.labelsWith" (dict "ctx" . "extra" dict) -}}
{{- end -}}

{{/*
An object's labels: the chart's own, then the object's extra labels (e.g.
serviceMonitor.labels), then commonLabels. The chart's own win, so a selector never changes;
commonLabels may not name them (a clear error instead of a silently ignored value).
*/}}
{{- define "zdelay.labelsWith" -}}
{{- $ctx := .ctx -}}
{{- $own := dict "helm.sh/chart" (include "zdelay.chart" $ctx) "app.kubernetes.io/name" (include "zdelay.name" $ctx) "app.kubernetes.io/instance" $ctx.Release.Name "app.kubernetes.io/version" ($ctx.Chart.AppVersion | toString) "app.kubernetes.io/managed-by" $ctx.Release.Service -}}
{{- $common := $ctx.Values.commonLabels | default dict -}}
{{- range $k := keys $common | sortAlpha -}}
{{- if hasKey $own $k -}}
{{- fail (printf "commonLabels.%s: the chart sets this label itself (its selectors rely on it); choose another key" $k) -}}
{{- end -}}
{{- end -}}
{{- toYaml (merge (deepCopy $own) (deepCopy (.extra | default dict)) (deepCopy $common)) -}}
{{- end -}}

{{/* The pod template's labels: the selector's, then podLabels, then commonLabels. */}}
{{- define "zdelay.podLabels" -}}
{{- $selector := include "zdelay.selectorLabels" . | fromYaml -}}
{{- toYaml (merge $selector (deepCopy (.Values.podLabels | default dict)) (deepCopy (.Values.commonLabels | default dict))) -}}
{{- end -}}

{{- define "zdelay.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
Milliseconds of a duration, rounded up: <number><unit> parts as the daemon reads them
("10s", "1min", "1m30s", "2 hours"; units ns, us, ms, s/sec, m/min, h/hr, d, w, M, y and their
long forms). The same pattern as the config schema (docs/reference/config.md, Durations).
*/}}
{{- define "zdelay.durationMs" -}}
{{- $d := toString . -}}
{{- $unit := "(nanos|nsec|ns|usec|us|µs|millis|msec|ms|seconds|second|secs|sec|s|minutes|minute|mins|min|m|hours|hour|hrs|hr|h|days|day|d|weeks|week|wks|wk|w|months|month|M|years|year|yrs|yr|y)" -}}
{{- if not (regexMatch (printf "^([0-9]+ *%s *)+$" $unit) $d) -}}
{{- fail (printf "duration %q: write it as <number><unit> parts, e.g. 10s, 1min, 1m30s (units ns, us, ms, s, m, h, d, w)" $d) -}}
{{- end -}}
{{- $second := 1000000000 -}}
{{- $factors := dict "nanos" 1 "nsec" 1 "ns" 1 "usec" 1000 "us" 1000 "µs" 1000 "millis" 1000000 "msec" 1000000 "ms" 1000000 "seconds" $second "second" $second "secs" $second "sec" $second "s" $second -}}
{{- range $u := list "minutes" "minute" "mins" "min" "m" }}{{ $_ := set $factors $u (mul 60 $second) }}{{ end -}}
{{- range $u := list "hours" "hour" "hrs" "hr" "h" }}{{ $_ := set $factors $u (mul 3600 $second) }}{{ end -}}
{{- range $u := list "days" "day" "d" }}{{ $_ := set $factors $u (mul 86400 $second) }}{{ end -}}
{{- range $u := list "weeks" "week" "wks" "wk" "w" }}{{ $_ := set $factors $u (mul 604800 $second) }}{{ end -}}
{{- range $u := list "months" "month" "M" }}{{ $_ := set $factors $u (mul 2630016 $second) }}{{ end -}}
{{- range $u := list "years" "year" "yrs" "yr" "y" }}{{ $_ := set $factors $u (mul 31557600 $second) }}{{ end -}}
{{- $ns := 0 -}}
{{- range $part := regexFindAll "[0-9]+ *[a-zA-Zµ]+" $d -1 -}}
{{- $n := regexFind "^[0-9]+" $part -}}
{{- $u := trimPrefix $n $part | trim -}}
{{- $ns = add $ns (mul ($n | int64) (get $factors $u)) -}}
{{- end -}}
{{- div (add $ns 999999) 1000000 -}}
{{- end -}}

{{/*
terminationGracePeriodSeconds: config.poller.shutdown_grace (default 10s) rounded up, plus
5 s for the process to exit after the batch in hand. A configured value below that fails.
*/}}
{{- define "zdelay.terminationGracePeriodSeconds" -}}
{{- $poller := ternary dict (.Values.config.poller | default dict) (not (empty .Values.existingConfigMap)) -}}
{{- $grace := $poller.shutdown_grace | default "10s" -}}
{{- $ms := include "zdelay.durationMs" $grace | int64 -}}
{{- $min := add (div (add $ms 999) 1000) 5 -}}
{{- $set := .Values.terminationGracePeriodSeconds -}}
{{- if kindIs "invalid" $set -}}
{{- $min -}}
{{- else if lt ($set | int64) ($min | int64) -}}
{{- fail (printf "terminationGracePeriodSeconds %v is below config.poller.shutdown_grace (%s) + 5 s = %d s: the kubelet would kill zdelay before it finished the batch in hand" $set $grace $min) -}}
{{- else -}}
{{- $set | int64 -}}
{{- end -}}
{{- end -}}

{{/* ---------- TOML rendering of the config ---------- */}}

{{- define "zdelay.toml.key" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{/* A value: string, bool, integer, float, array, or an inline table. */}}
{{- define "zdelay.toml.value" -}}
{{- $v := . -}}
{{- if kindIs "string" $v -}}
{{- toJson $v -}}
{{- else if kindIs "bool" $v -}}
{{- $v -}}
{{- else if kindIs "float64" $v -}}
{{- if eq ($v | int64 | float64) $v -}}{{ $v | int64 }}{{- else -}}{{ $v }}{{- end -}}
{{- else if or (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- $v -}}
{{- else if kindIs "slice" $v -}}
[{{ range $i, $e := $v }}{{ if $i }}, {{ end }}{{ include "zdelay.toml.value" $e }}{{ end }}]
{{- else if kindIs "map" $v -}}
{ {{- range $i, $k := keys $v | sortAlpha }}{{ if $i }},{{ end }} {{ include "zdelay.toml.key" $k }} = {{ include "zdelay.toml.value" (index $v $k) }}{{ end }} }
{{- else -}}
{{- fail (printf "config: cannot write %v (%s) as TOML" $v (kindOf $v)) -}}
{{- end -}}
{{- end -}}

{{/* "true" when v is a non-empty list of tables ([[x]] in TOML). */}}
{{- /* Two ifs, not `and`: before Go 1.18 (Helm < 3.9) `and` evaluates every argument, and len fails on a number. */ -}}
{{- define "zdelay.toml.isTableArray" -}}
{{- if kindIs "slice" . -}}
{{- if gt (len .) 0 -}}
{{- $all := true -}}
{{- range . }}{{ if not (kindIs "map" .) }}{{ $all = false }}{{ end }}{{ end -}}
{{- if $all }}true{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
A table's body: its plain keys first (name, kind, key, sink, target, then by name), then its sub-tables and arrays of tables (in the order
of .order when given, else by name). Null values are left out. A table holding only
sub-tables gets no header of its own.
*/}}
{{- define "zdelay.toml.table" -}}
{{- $path := .path -}}
{{- $t := .table -}}
{{- $order := .order | default list -}}
{{- $first := list "name" "kind" "key" "sink" "target" -}}
{{- $plainKeys := list -}}
{{- range $k := $first }}{{ if hasKey $t $k }}{{ $plainKeys = append $plainKeys $k }}{{ end }}{{ end -}}
{{- range $k := keys $t | sortAlpha }}{{ if not (has $k $first) }}{{ $plainKeys = append $plainKeys $k }}{{ end }}{{ end -}}
{{- range $k := $plainKeys -}}
{{- $v := index $t $k -}}
{{- if not (or (kindIs "invalid" $v) (kindIs "map" $v) (include "zdelay.toml.isTableArray" $v)) }}
{{ include "zdelay.toml.key" $k }} = {{ include "zdelay.toml.value" $v }}
{{- end -}}
{{- end -}}
{{- $keys := $order -}}
{{- range $k := keys $t | sortAlpha }}{{ if not (has $k $order) }}{{ $keys = append $keys $k }}{{ end }}{{ end -}}
{{- range $k := $keys -}}
{{- $v := index $t $k -}}
{{- $sub := printf "%s%s" (ternary "" (printf "%s." $path) (eq $path "")) (include "zdelay.toml.key" $k) -}}
{{- if kindIs "map" $v -}}
{{- $plain := false -}}
{{- range $vv := values $v }}{{ if not (or (kindIs "invalid" $vv) (kindIs "map" $vv) (include "zdelay.toml.isTableArray" $vv)) }}{{ $plain = true }}{{ end }}{{ end -}}
{{- if or $plain (eq (len $v) 0) }}

[{{ $sub }}]
{{- end -}}
{{- include "zdelay.toml.table" (dict "path" $sub "table" $v) -}}
{{- else if include "zdelay.toml.isTableArray" $v -}}
{{- range $v }}

[[{{ $sub }}]]
{{- include "zdelay.toml.table" (dict "path" $sub "table" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* [redis.tls] from tls.redis (JSON; {} when off). */}}
{{- define "zdelay.redisTlsDict" -}}
{{- $t := .Values.tls.redis -}}
{{- $tls := dict -}}
{{- if $t.enabled -}}
{{- $_ := set $tls "insecure_skip_verify" $t.insecureSkipVerify -}}
{{- if $t.caKey -}}{{- $_ := set $tls "ca_file" (printf "%s/%s" $t.mountPath $t.caKey) -}}{{- end -}}
{{- if $t.certKey -}}{{- $_ := set $tls "cert_file" (printf "%s/%s" $t.mountPath $t.certKey) -}}{{- end -}}
{{- if $t.keyKey -}}{{- $_ := set $tls "key_file" (printf "%s/%s" $t.mountPath $t.keyKey) -}}{{- end -}}
{{- end -}}
{{- toJson $tls -}}
{{- end -}}

{{/* [admin] from the admin values, listen addresses aside (those are env: see zdelay.env). */}}
{{- define "zdelay.adminDict" -}}
{{- $a := .Values.admin -}}
{{- $admin := dict "console" $a.console "public_reads" $a.publicReads -}}
{{- $hosts := $a.allowedHosts | default list -}}
{{- if $a.exposeHttpEnqueue -}}
{{- /* The enqueue Service's names: producers in the cluster call it by them. */ -}}
{{- $svc := printf "%s-enqueue" (include "zdelay.fullname" .) -}}
{{- $hosts = concat $hosts (list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace)) -}}
{{- end -}}
{{- with $hosts }}{{ $_ := set $admin "allowed_hosts" . }}{{ end -}}
{{- toJson $admin -}}
{{- end -}}

{{/* The effective config as a dict: values' config plus what the chart derives (redis.tls, admin). */}}
{{- define "zdelay.configDict" -}}
{{- $cfg := deepCopy (.Values.config | default dict) -}}
{{- $redis := $cfg.redis | default dict -}}
{{- $tls := include "zdelay.redisTlsDict" . | fromJson -}}
{{- if $tls -}}
{{- $_ := set $redis "tls" $tls -}}
{{- end -}}
{{- $_ := set $cfg "redis" $redis -}}
{{- $_ := set $cfg "admin" (include "zdelay.adminDict" . | fromJson) -}}
{{- toJson $cfg -}}
{{- end -}}

{{/* zdelay.toml, after the chart's checks. */}}
{{- define "zdelay.configToml" -}}
{{- include "zdelay.validate" . -}}
# zdelay.toml rendered by the zdelay Helm chart from .Values.config. Credentials come from
# ZDELAY_ environment variables (Secrets); admin.listen and admin.metrics_listen from
# ZDELAY_ADMIN__LISTEN and ZDELAY_ADMIN__METRICS_LISTEN.
{{- include "zdelay.toml.table" (dict "path" "" "table" (include "zdelay.configDict" . | fromJson) "order" (list "redis" "poller" "admin" "tracing" "sinks" "routes" "sources")) }}
{{ end -}}

{{/*
Rolls the pods when the config changes. With existingConfigMap the chart cannot see the
ConfigMap's content: only a new name (or the derived env) rolls them.
*/}}
{{- define "zdelay.configChecksum" -}}
{{- if .Values.existingConfigMap -}}
{{- include "zdelay.validate" . -}}
{{- printf "existingConfigMap=%s" .Values.existingConfigMap | sha256sum -}}
{{- else -}}
{{- include "zdelay.configToml" . | sha256sum -}}
{{- end -}}
{{- end -}}

{{/* The ConfigMap holding zdelay.toml: the chart's, or existingConfigMap. */}}
{{- define "zdelay.configMapName" -}}
{{- .Values.existingConfigMap | default (include "zdelay.fullname" .) -}}
{{- end -}}

{{/* Checks the schema cannot express; each failure names the value at fault. */}}
{{- define "zdelay.validate" -}}
{{- $external := not (empty .Values.existingConfigMap) -}}
{{- /* With existingConfigMap, config is ignored: nothing of it to check. */ -}}
{{- $cfg := ternary dict (.Values.config | default dict) $external -}}
{{- $redis := $cfg.redis | default dict -}}
{{- $sinks := $cfg.sinks | default dict -}}
{{- $s := .Values.secrets -}}
{{- if regexMatch "^[a-z]+://[^/]*@" ($redis.url | default "") -}}
{{- fail "config.redis.url holds credentials, which would land in a ConfigMap: put the URL in a Secret (secrets.redis.urlKey) or the password alone (secrets.redis.passwordKey)" -}}
{{- end -}}
{{- if and (or $s.redis.passwordKey $s.redis.urlKey) (not $s.redis.existingSecret) -}}
{{- fail "secrets.redis.passwordKey/urlKey need secrets.redis.existingSecret (the Secret's name)" -}}
{{- end -}}
{{- if and $s.redis.existingSecret (not (or $s.redis.passwordKey $s.redis.urlKey)) -}}
{{- fail "secrets.redis.existingSecret needs passwordKey or urlKey (which key of the Secret to use)" -}}
{{- end -}}
{{- $envNames := list -}}
{{- range $s.env }}{{ $envNames = append $envNames .name }}{{ end -}}
{{- range $name, $sink := $sinks -}}
{{- if regexMatch "^[a-z]+://[^/]*@" ($sink.url | default "") -}}
{{- fail (printf "config.sinks.%s.url holds credentials, which would land in a ConfigMap: use secrets.sinks.%s (existingSecret, urlKey)" $name $name) -}}
{{- end -}}
{{- $fromSecret := or (hasKey $s.sinks $name) (has (printf "ZDELAY_SINKS__%s__URL" (upper $name)) $envNames) -}}
{{- if and (has $sink.kind (list "amqp" "nats")) (not $sink.url) (not $fromSecret) -}}
{{- fail (printf "config.sinks.%s (%s) has no url: set config.sinks.%s.url or secrets.sinks.%s" $name $sink.kind $name $name) -}}
{{- end -}}
{{- end -}}
{{- range $name, $ref := $s.sinks -}}
{{- if and (not $external) (not (hasKey $sinks $name)) -}}
{{- fail (printf "secrets.sinks.%s: no sink %q in config.sinks" $name $name) -}}
{{- end -}}
{{- end -}}
{{- if eq (.Values.admin.port | int) (.Values.admin.metricsPort | int) -}}
{{- fail "admin.metricsPort must differ from admin.port (the console's)" -}}
{{- end -}}
{{- $at := $s.adminToken -}}
{{- if ne (empty $at.existingSecret) (empty $at.key) -}}
{{- fail "secrets.adminToken.existingSecret and key go together (the Secret and its key holding the token)" -}}
{{- end -}}
{{- $pt := $s.producerToken -}}
{{- if ne (empty $pt.existingSecret) (empty $pt.key) -}}
{{- fail "secrets.producerToken.existingSecret and key go together (the Secret and its key holding the token)" -}}
{{- end -}}
{{- if and .Values.admin.exposeHttpEnqueue (not $pt.existingSecret) (not (has "ZDELAY_ADMIN__PRODUCER_TOKEN" $envNames)) -}}
{{- fail "admin.exposeHttpEnqueue needs secrets.producerToken (without the producers' token the HTTP enqueue is off)" -}}
{{- end -}}
{{- $t := .Values.tls.redis -}}
{{- if $t.enabled -}}
{{- if not $t.existingSecret -}}
{{- fail "tls.redis.enabled needs tls.redis.existingSecret (the Secret with the CA and client certificate)" -}}
{{- end -}}
{{- if ne (empty $t.certKey) (empty $t.keyKey) -}}
{{- fail "tls.redis.certKey and tls.redis.keyKey go together (mutual TLS needs both)" -}}
{{- end -}}
{{- if and (not $external) (not $s.redis.urlKey) (not $redis.cluster_nodes) (not (hasPrefix "rediss://" ($redis.url | default ""))) -}}
{{- fail "tls.redis.enabled needs a rediss:// URL in config.redis.url" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* ---------- the container, shared by the Deployment and the sidecar ---------- */}}

{{- define "zdelay.env" -}}
- name: ZDELAY_CONFIG
  value: /etc/zdelay/zdelay.toml
- name: ZDELAY_ADMIN__LISTEN
  value: {{ printf "%s:%d" (ternary "0.0.0.0" "127.0.0.1" (or .Values.admin.exposeConsole .Values.admin.exposeHttpEnqueue)) (.Values.admin.port | int) | quote }}
- name: ZDELAY_ADMIN__METRICS_LISTEN
  value: {{ printf "0.0.0.0:%d" (.Values.admin.metricsPort | int) | quote }}
{{- if .Values.existingConfigMap }}
{{- /* The file is the user's: what the chart would have written into it comes as env, which wins over the file. */}}
{{- range $k, $v := include "zdelay.adminDict" . | fromJson }}
- name: ZDELAY_ADMIN__{{ upper $k }}
  value: {{ toJson $v | quote }}
{{- end }}
{{- range $k, $v := include "zdelay.redisTlsDict" . | fromJson }}
- name: ZDELAY_REDIS__TLS__{{ upper $k }}
  value: {{ ternary ($v | toString) (toJson $v) (kindIs "string" $v) | quote }}
{{- end }}
{{- end }}
{{- with .Values.secrets.adminToken }}
{{- if .existingSecret }}
- name: ZDELAY_ADMIN__TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- with .Values.secrets.producerToken }}
{{- if .existingSecret }}
- name: ZDELAY_ADMIN__PRODUCER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .key }}
{{- end }}
{{- end }}
- name: ZDELAY_LOG
  value: {{ .Values.log.level | quote }}
- name: ZDELAY_LOG_FORMAT
  value: {{ .Values.log.format | quote }}
{{- /* A stable instance id: a restarted container takes its poller slots back at once. */}}
- name: ZDELAY_POLLER__INSTANCE_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- with .Values.secrets.redis }}
{{- if .passwordKey }}
- name: ZDELAY_REDIS__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .passwordKey }}
{{- end }}
{{- if .urlKey }}
- name: ZDELAY_REDIS__URL
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .urlKey }}
{{- end }}
{{- end }}
{{- range $name, $ref := .Values.secrets.sinks }}
- name: ZDELAY_SINKS__{{ upper $name }}__URL
  valueFrom:
    secretKeyRef:
      name: {{ $ref.existingSecret }}
      key: {{ $ref.urlKey }}
{{- end }}
{{- range .Values.secrets.env }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .key }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "zdelay.volumeMounts" -}}
- name: zdelay-config
  mountPath: /etc/zdelay/zdelay.toml
  subPath: zdelay.toml
  readOnly: true
{{- if .Values.tls.redis.enabled }}
- name: zdelay-redis-tls
  mountPath: {{ .Values.tls.redis.mountPath }}
  readOnly: true
{{- end }}
{{- range $i, $f := .Values.secrets.files }}
- name: zdelay-secret-{{ $i }}
  mountPath: {{ $f.mountPath }}
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes. Secret files are mode 0440 (group 65532 through the pod's fsGroup); a sidecar cannot rely on the application pod's fsGroup, so there they are 0444. */}}
{{- define "zdelay.volumesFor" -}}
{{- $ctx := .ctx -}}
{{- $mode := ternary "0444" "0440" .sidecar -}}
- name: zdelay-config
  configMap:
    name: {{ include "zdelay.configMapName" $ctx }}
    items:
      - key: zdelay.toml
        path: zdelay.toml
{{- with $ctx.Values.tls.redis }}
{{- if .enabled }}
- name: zdelay-redis-tls
  secret:
    secretName: {{ .existingSecret }}
    defaultMode: {{ $mode }}
    items:
    {{- range $key := list .caKey .certKey .keyKey }}
    {{- if $key }}
      - key: {{ $key }}
        path: {{ $key }}
    {{- end }}
    {{- end }}
{{- end }}
{{- end }}
{{- range $i, $f := $ctx.Values.secrets.files }}
- name: zdelay-secret-{{ $i }}
  secret:
    secretName: {{ $f.existingSecret }}
    defaultMode: {{ $mode }}
{{- end }}
{{- with $ctx.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "zdelay.containerFor" -}}
{{- $ctx := .ctx -}}
{{- $sidecar := .sidecar -}}
{{- $v := $ctx.Values -}}
{{- $port := ternary "zdelay-metrics" "metrics" $sidecar -}}
{{- $console := ternary "zdelay-console" "console" $sidecar -}}
- name: zdelay
  image: {{ include "zdelay.image" $ctx | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if and $sidecar $v.sidecar.native }}
  {{- if semverCompare "<1.29.0-0" $ctx.Capabilities.KubeVersion.Version }}
  {{- fail (printf "sidecar.native: a native sidecar (an init container with restartPolicy Always) needs Kubernetes 1.29+, this is %s; set zdelay.sidecar.native=false for a regular container" $ctx.Capabilities.KubeVersion.Version) }}
  {{- end }}
  restartPolicy: Always
  {{- end }}
  args: ["run"]
  env:
    {{- include "zdelay.env" $ctx | nindent 4 }}
  {{- with $v.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  ports:
    - name: {{ $port }}
      containerPort: {{ $v.admin.metricsPort }}
      protocol: TCP
    {{- if or (and $v.admin.console $v.admin.exposeConsole) $v.admin.exposeHttpEnqueue }}
    - name: {{ $console }}
      containerPort: {{ $v.admin.port }}
      protocol: TCP
    {{- end }}
  {{- if and $v.probes.readiness.enabled (or (not $sidecar) $v.sidecar.readinessProbe) }}
  readinessProbe:
    httpGet:
      path: {{ eq ($v.probes.readiness.sinks | default "ignore") "require" | ternary "/readyz" "/readyz?sinks=ignore" }}
      port: {{ $port }}
    periodSeconds: {{ $v.probes.readiness.periodSeconds }}
    timeoutSeconds: {{ $v.probes.readiness.timeoutSeconds }}
    failureThreshold: {{ $v.probes.readiness.failureThreshold }}
  {{- end }}
  {{- if $v.probes.startup.enabled }}
  startupProbe:
    httpGet:
      path: /healthz
      port: {{ $port }}
    periodSeconds: {{ $v.probes.startup.periodSeconds }}
    timeoutSeconds: {{ $v.probes.startup.timeoutSeconds }}
    failureThreshold: {{ $v.probes.startup.failureThreshold }}
  {{- end }}
  {{- if $v.probes.liveness.enabled }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: {{ $port }}
    periodSeconds: {{ $v.probes.liveness.periodSeconds }}
    timeoutSeconds: {{ $v.probes.liveness.timeoutSeconds }}
    failureThreshold: {{ $v.probes.liveness.failureThreshold }}
  {{- end }}
  {{- with $v.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    {{- include "zdelay.volumeMounts" $ctx | nindent 4 }}
{{- end -}}

{{/* The standalone pod's container and volumes. */}}
{{- define "zdelay.container" -}}
{{- include "zdelay.containerFor" (dict "ctx" . "sidecar" false) -}}
{{- end -}}

{{- define "zdelay.volumes" -}}
{{- include "zdelay.volumesFor" (dict "ctx" . "sidecar" false) -}}
{{- end -}}

{{/*
The sidecar: a list item for the application pod's initContainers (sidecar.native, the
default: restartPolicy Always, Kubernetes 1.29+) or containers (sidecar.native=false).
Call it with the zdelay subchart's context: include "zdelay.sidecar.container" .Subcharts.zdelay
*/}}
{{- define "zdelay.sidecar.container" -}}
{{- include "zdelay.containerFor" (dict "ctx" . "sidecar" true) -}}
{{- end -}}

{{- define "zdelay.sidecar.volumes" -}}
{{- include "zdelay.volumesFor" (dict "ctx" . "sidecar" true) -}}
{{- end -}}
