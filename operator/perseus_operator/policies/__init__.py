"""Cluster-wide PerseusPolicies: which workloads they manage and the jobs they create.

Pure selection (``selection``) and the plan of one round (``policy_sync``), carried out by
``policy_controller``. May import ``cluster`` (the controller only), ``jobs`` and
``workloads``.
"""
