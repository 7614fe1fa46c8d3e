"""Cluster power budgets: each PerseusPowerBudget's allocation of watts to the jobs of its domain.

Pure decisions (``budget_decisions``: when to solve the allocation again, which jobs to
re-target to which frontier point, the budget's status); what a domain holds and its measured
draw from the agents' energy counters (``domain``); the controller that carries them out
(``budget_controller``: reads the cluster, re-targets jobs through their annotation, writes the
status). May import ``cluster``, ``jobs``, ``workloads`` and ``metrics``.
"""
