"""Negative-control shuili platform `perturbed`: the conformance suite must reject it."""
