"""Cluster power budgets: each PerseusPowerBudget's allocation of watts to the jobs of its domain.

Pure decisions (``budget_decisions``: when to solve the allocation again, which jobs to
re-target to which frontier point, the budget's status). The controller that carries them out
(list the domain's nodes and jobs, measure the draw, re-target, write the status) is not written
yet (issue 35, step 4). May import ``jobs`` and ``workloads``.
"""
