"""The service: the agent's loops and the snapshot they publish for the doors to serve.

Kept empty of imports: a one-shot command that needs one module of it (the probes'
``statefile``) must not pull in the event loop with the agent.
"""
