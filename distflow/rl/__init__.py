"""Pure RL maths (advantages, losses, KL, GAE, shaping) and the registry of their names.

Shared by the rollout and trainer groups and owned by neither: ``rollout/`` and
``trainer/`` both import from here and never from each other. Weight sync lives in
:mod:`distflow.weights`.
"""
