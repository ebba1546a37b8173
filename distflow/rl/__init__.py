"""Pure RL maths (advantages, losses, KL, GAE) and the weight-version protocol.

Shared by the rollout and trainer groups and owned by neither: ``rollout/`` and
``trainer/`` both import from here and never from each other.
"""
