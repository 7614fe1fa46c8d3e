{{/*
A pod of the chart's Helm hooks: `perseus-operator --hook <hook>` in the operator image, as
the service account `sa`. Args: dict ctx, hook, timeout, sa.
*/}}
{{- define "perseus.operator.hookPodSpec" -}}
{{- $ctx := .ctx }}
{{- $op := $ctx.Values.operator }}
serviceAccountName: {{ .sa }}
restartPolicy: Never
{{- with $ctx.Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  seccompProfile:
    type: RuntimeDefault
containers:
  - name: hook
    image: {{ include "perseus.image" (dict "ctx" $ctx "image" $op.image) | quote }}
    imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
    command: ["perseus-operator"]
    args:
      - --hook={{ .hook }}
      - --hook-timeout-s={{ .timeout }}
      {{- range $op.watchNamespaces }}
      - --namespace={{ . }}
      {{- end }}
    env:
      - name: PERSEUS_OPERATOR_LEADER_ELECTION_NAMESPACE
        value: {{ (include "perseus.namespace" $ctx) | quote }}
      - name: PERSEUS_OPERATOR_LEADER_ELECTION_LEASE
        value: {{ include "perseus.operator.fullname" $ctx | quote }}
      - name: PERSEUS_OPERATOR_LEASE_DURATION_S
        value: {{ $op.leaderElection.leaseDurationSeconds | toString | quote }}
      - name: PERSEUS_OPERATOR_RENEW_DEADLINE_S
        value: {{ $op.leaderElection.renewDeadlineSeconds | toString | quote }}
      - name: PERSEUS_OPERATOR_RETRY_PERIOD_S
        value: {{ $op.leaderElection.retryPeriodSeconds | toString | quote }}
      - name: NUMBA_CACHE_DIR
        value: /tmp/numba
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      runAsNonRoot: true
      capabilities:
        drop: ["ALL"]
    resources:
      requests:
        cpu: 50m
        memory: 128Mi
      limits:
        memory: 512Mi
    volumeMounts:
      - name: tmp
        mountPath: /tmp
volumes:
  - name: tmp
    emptyDir:
      sizeLimit: 64Mi
{{- end }}
