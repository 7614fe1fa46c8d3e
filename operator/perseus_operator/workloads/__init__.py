"""Training workloads as the API server shows them: their pods resolved to ranks.

Pure, top to bottom: ``ranks`` maps a workload's pods to (dp, pp, tp) ranks and GPUs;
``node_ranks`` holds each workload kind's node-rank convention; ``completion`` tells whether a
workload ended; ``pods`` reads a training pod's fields (rank labels, variables, GPUs);
``selectors`` renders, parses and matches label selectors; ``objects`` reads fields of
Kubernetes objects defensively. Imports nothing of the operator.
"""
