"""Cluster-wide PerseusPolicies: which workloads they manage and the jobs they create.

Pure: ``selection`` (which policy manages which workload, the PerseusJob it creates),
``parallelism`` (a workload's pipeline stages, microbatches and replicas, read from it),
``policy_sync`` (the plan of one round) and ``policy_status`` (what each policy's status says);
carried out by ``policy_controller``. May import ``cluster`` (the controller only), ``jobs``
and ``workloads``.
"""
