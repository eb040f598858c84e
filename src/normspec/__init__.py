"""normspec: declared-rounding specs, a backend registry and a conformance harness
for the normalization layers of RL training and rollout stacks."""

__version__ = "0.1.0"
