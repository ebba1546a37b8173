"""Launchers: they start nodes and hand them seeds, and take no part in the run."""
