"""The node model: the Host door to the machine, the facts sources report, the typed node,
the merge and derivation of levels, findings, the fabric and the distance matrix."""
