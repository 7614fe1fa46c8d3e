"""Training workloads as the API server shows them: their pods resolved to ranks.

Pure: ``ranks`` maps a workload's pods to (dp, pp, tp) ranks and GPUs for each workload kind;
``objects`` reads fields of Kubernetes objects defensively. Imports nothing of the operator.
"""
