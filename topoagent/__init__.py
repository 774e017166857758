"""topoagent: node-level GPU topology discovery, measurement and placement."""
__version__ = "0.1.0"
