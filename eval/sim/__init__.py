"""The cluster simulator, the paper's economics reproductions and the capacity planner.

Pure Python: no SGLang, no servers, no network. The simulator decides paths and handoffs with
the router's own policy code (pdd.policy) and estimators (pdd.router.estimates).

Modules: hardware (chips, models, links), costs (a forward's time), requests, config (tiers,
deployments, SLA), clock, tiers (P and decode instances), wan, simulation (the router's part,
`simulate`), results (per-request results, summaries), planner, economics, calibrate (against a
live run), cli.
"""
