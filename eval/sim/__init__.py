"""The cluster simulator, the paper's economics reproductions and the capacity planner.

Pure Python: no SGLang, no servers, no network. The simulator decides paths and handoffs with
the router's own policy code (pdd.policy) and estimators (pdd.router.estimates).
"""
