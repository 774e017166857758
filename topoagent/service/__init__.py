"""The service: the agent's loops (discovery, counters, activity, probes, leases, capacity,
exports), each owning its state and publishing into the one served value the doors read
(``served``), behind the narrow ``interface.Service`` the doors depend on.

Kept empty of imports: a module of it that another command needs (the lease rules' store,
the counters' history) must not pull in the event loop with the agent.
"""
