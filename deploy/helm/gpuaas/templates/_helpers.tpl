{{/* Names ------------------------------------------------------------------------------------------ */}}

{{- define "gpuaas.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuaas.fullname" -}}
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

{{/* The services with a database (Kubernetes names; the Python package is the name with "-" -> "_"). */}}
{{- define "gpuaas.dbServices" -}}
identity allocations catalog app-runtime metering billing
{{- end -}}

{{/* The component's Python package name: app-runtime -> app_runtime. */}}
{{- define "gpuaas.module" -}}
{{- replace "-" "_" . -}}
{{- end -}}

{{/* The component's environment prefix: app-runtime -> GPUAAS_APP_RUNTIME_. */}}
{{- define "gpuaas.envPrefix" -}}
{{- printf "GPUAAS_%s_" (replace "-" "_" . | upper) -}}
{{- end -}}

{{- define "gpuaas.componentName" -}}
{{- printf "%s-%s" (include "gpuaas.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------------------- */}}

{{- define "gpuaas.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "gpuaas.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuaas
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: dict "root" $ "component" "billing". */}}
{{- define "gpuaas.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuaas.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpuaas.componentLabels" -}}
{{ include "gpuaas.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Image and service account ---------------------------------------------------------------------- */}}

{{- define "gpuaas.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "gpuaas.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpuaas.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The settings of one component: `defaults` with `services.<name>` merged over it. */}}
{{- define "gpuaas.componentValues" -}}
{{- $own := index .root.Values.services .component | default dict -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.defaults) (deepCopy $own)) -}}
{{- end -}}

{{/* Secrets: names and where each value comes from -------------------------------------------------- */}}

{{- define "gpuaas.dbSecretName" -}}
{{- default (printf "%s-db" (include "gpuaas.fullname" .)) .Values.postgres.existingSecret -}}
{{- end -}}

{{- define "gpuaas.bootstrapSecretName" -}}
{{- default (printf "%s-bootstrap" (include "gpuaas.fullname" .)) .Values.identity.bootstrapAdmin.existingSecret -}}
{{- end -}}

{{- define "gpuaas.credentialsSecretName" -}}
{{- default (printf "%s-credentials" (include "gpuaas.fullname" .)) .Values.credentials.existingSecret -}}
{{- end -}}

{{- define "gpuaas.secretsKeysSecretName" -}}
{{- default (printf "%s-secrets-keys" (include "gpuaas.fullname" .)) .Values.secretsAtRest.existingSecret -}}
{{- end -}}

{{/* Per-service keys (issue 17): the secrets-at-rest keyring, the event signing key and the producers' public keys,
the service's own SASL user when kafka.sasl.perService. Context: dict root, component, prefix. */}}
{{- define "gpuaas.serviceKeysEnv" -}}
{{- $v := .root.Values -}}
{{- if eq $v.vault.keySource "vault" }}
{{- if not $v.vault.url }}{{ fail "vault.keySource vault needs vault.url" }}{{ end }}
- name: GPUAAS_SECRETS_KEY_SOURCE
  value: "vault"
{{- else }}
- name: GPUAAS_SECRETS_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "gpuaas.secretsKeysSecretName" .root }}
      key: {{ $v.secretsAtRest.key }}
- name: {{ .prefix }}EVENT_SIGNING_KEY
  valueFrom:
    secretKeyRef:
      name: {{ required "eventSigning.existingSecret is required (every service's events are accepted only signed)" $v.eventSigning.existingSecret }}
      key: {{ .component }}
{{- end }}
{{- if $v.vault.url }}
{{- include "gpuaas.vaultEnv" . }}
{{- end }}
{{- $verify := required "eventSigning.verifyKeys is required (every service's public key)" $v.eventSigning.verifyKeys }}
{{- range $emitter := list "identity" "allocations" "catalog" "app-runtime" "metering" "billing" }}
{{- if not (regexMatch (printf "(^|,)\\s*%s:" $emitter) $verify) }}
{{- fail (printf "eventSigning.verifyKeys has no public key of %s (consumers refuse its events unsigned by it)" $emitter) }}
{{- end }}
{{- end }}
- name: GPUAAS_EVENT_VERIFY_KEYS
  value: {{ $verify | quote }}
{{- if and (hasPrefix "SASL_" $v.kafka.securityProtocol) $v.kafka.sasl.perService }}
- name: GPUAAS_KAFKA_SECURITY_PROTOCOL
  value: {{ $v.kafka.securityProtocol | quote }}
- name: GPUAAS_KAFKA_SASL_MECHANISM
  value: {{ $v.kafka.sasl.mechanism | quote }}
- name: GPUAAS_KAFKA_SASL_USERNAME
  value: {{ printf "%s%s" $v.kafka.sasl.usernamePrefix .component | quote }}
- name: GPUAAS_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ required "kafka.sasl.existingSecret is required with a SASL_* securityProtocol" $v.kafka.sasl.existingSecret }}
      key: {{ .component }}
{{- end }}
{{- end -}}

{{- define "gpuaas.issuerUrl" -}}
{{- default (printf "%s/api/identity" (trimSuffix "/" .Values.publicUrl)) .Values.identity.issuerUrl -}}
{{- end -}}

{{- define "gpuaas.serviceUrl" -}}
{{- printf "http://%s:8080" (include "gpuaas.componentName" .) -}}
{{- end -}}

{{/* Environment shared by the services and the migration job (Kafka, JWKS, issuer). */}}
{{- define "gpuaas.sharedEnv" -}}
- name: GPUAAS_KAFKA_BOOTSTRAP
  value: {{ .Values.kafka.bootstrap | quote }}
- name: GPUAAS_KAFKA_TOPIC_PREFIX
  value: {{ .Values.kafka.topicPrefix | quote }}
- name: GPUAAS_KAFKA_TOPIC_REPLICATION_FACTOR
  value: {{ .Values.kafka.topics.replicationFactor | quote }}
- name: GPUAAS_KAFKA_TOPIC_MIN_INSYNC_REPLICAS
  value: {{ .Values.kafka.topics.minInsyncReplicas | quote }}
- name: GPUAAS_JWKS_URL
  value: {{ printf "%s/.well-known/jwks.json" (include "gpuaas.serviceUrl" (dict "root" . "component" "identity")) | quote }}
- name: GPUAAS_JWT_ISSUER
  value: {{ include "gpuaas.issuerUrl" . | quote }}
- name: GPUAAS_JWT_AUDIENCE
  value: {{ .Values.identity.jwtAudience | quote }}
{{- /* With kafka.sasl.perService, each service's own user comes with gpuaas.serviceKeysEnv (the gateway has none). */}}
{{- if and (ne .Values.kafka.securityProtocol "PLAINTEXT") (not (and (hasPrefix "SASL_" .Values.kafka.securityProtocol) .Values.kafka.sasl.perService)) }}
- name: GPUAAS_KAFKA_SECURITY_PROTOCOL
  value: {{ .Values.kafka.securityProtocol | quote }}
{{- end }}
{{- if and (hasPrefix "SASL_" .Values.kafka.securityProtocol) (not .Values.kafka.sasl.perService) }}
- name: GPUAAS_KAFKA_SASL_MECHANISM
  value: {{ .Values.kafka.sasl.mechanism | quote }}
- name: GPUAAS_KAFKA_SASL_USERNAME
  value: {{ required "kafka.sasl.username is required with a SASL_* securityProtocol" .Values.kafka.sasl.username | quote }}
- name: GPUAAS_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ required "kafka.sasl.existingSecret is required with a SASL_* securityProtocol" .Values.kafka.sasl.existingSecret }}
      key: {{ .Values.kafka.sasl.passwordKey }}
{{- end }}
{{- if and (hasSuffix "SSL" .Values.kafka.securityProtocol) .Values.kafka.tls.existingSecret }}
- name: GPUAAS_KAFKA_SSL_CAFILE
  value: {{ printf "/etc/gpuaas/kafka/%s" .Values.kafka.tls.caKey | quote }}
{{- if .Values.kafka.tls.certKey }}
- name: GPUAAS_KAFKA_SSL_CERTFILE
  value: {{ printf "/etc/gpuaas/kafka/%s" .Values.kafka.tls.certKey | quote }}
- name: GPUAAS_KAFKA_SSL_KEYFILE
  value: {{ printf "/etc/gpuaas/kafka/%s" .Values.kafka.tls.keyKey | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "gpuaas.kafkaTlsMounted" -}}
{{- if and (hasSuffix "SSL" .Values.kafka.securityProtocol) .Values.kafka.tls.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* The database URL of one service, from the generated or the existing Secret. */}}
{{- define "gpuaas.databaseUrlEnv" -}}
- name: {{ include "gpuaas.envPrefix" .component }}DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "gpuaas.dbSecretName" .root }}
      key: {{ .component }}-database-url
{{- end -}}

{{/* Generated secret values are kept across upgrades: the value already in the cluster wins. */}}
{{- define "gpuaas.keptSecretValue" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if and $existing $existing.data (hasKey $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- .generate -}}
{{- end -}}
{{- end -}}

{{/* The gateway's upstream map (GPUAAS_GATEWAY_UPSTREAMS): Python service name -> in-cluster URL. */}}
{{- define "gpuaas.upstreams" -}}
{{- $m := dict -}}
{{- range $svc := splitList " " (include "gpuaas.dbServices" .) -}}
{{- $_ := set $m (include "gpuaas.module" $svc) (include "gpuaas.serviceUrl" (dict "root" $ "component" $svc)) -}}
{{- end -}}
{{- toJson $m -}}
{{- end -}}


{{/* A service's Vault / OpenBao client (gpuaas.kit.vault): server, CA, mounts and its own AppRole or token. */}}
{{- define "gpuaas.vaultEnv" -}}
{{- $v := .root.Values.vault }}
{{- $secret := required "vault.existingSecret is required with vault.url (each service's AppRole or token)" $v.existingSecret }}
- name: {{ .prefix }}VAULT_URL
  value: {{ $v.url | quote }}
- name: {{ .prefix }}VAULT_AUTH
  value: {{ $v.auth | quote }}
- name: {{ .prefix }}VAULT_KV_MOUNT
  value: {{ $v.kvMount | quote }}
- name: {{ .prefix }}VAULT_TRANSIT_MOUNT
  value: {{ $v.transitMount | quote }}
{{- if eq $v.auth "approle" }}
- name: {{ .prefix }}VAULT_APPROLE_MOUNT
  value: {{ $v.approleMount | quote }}
- name: {{ .prefix }}VAULT_ROLE_ID
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ printf "%s-role-id" .component }}
- name: {{ .prefix }}VAULT_SECRET_ID
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ printf "%s-secret-id" .component }}
{{- else }}
- name: {{ .prefix }}VAULT_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ printf "%s-token" .component }}
{{- end }}
{{- if $v.caSecret.name }}
- name: {{ .prefix }}VAULT_CA_CERT
  value: {{ printf "/etc/gpuaas/vault/%s" $v.caSecret.key | quote }}
{{- end }}
{{- end -}}
